"""nn.TransformerEncoder's nested-tensor fast path, with tpu tensors.

Note [No nested tensors on tpu]
    In eval with no grad and a ``src_key_padding_mask``, ``nn.TransformerEncoder``
    first asks ``_nested_tensor_from_mask_left_aligned(src, ~mask)`` (its mask_check),
    and if every row's padding is at its end it packs the batch into a nested tensor
    (``_nested_tensor_from_mask``), runs the layers on the ragged sequences and unpacks
    with zeros at the padded positions (then its final norm). A ragged shape is nothing
    XLA can compile; the encoder's padded path computes the same values at every
    unpadded position (each layer masks the padded keys), but leaves at padded ones
    whatever the layers computed there.

    So on tpu the answer to the mask check is "no": the encoder runs its padded path at
    static shapes, with no read of the mask on the host. `TransformerEncoder.forward`
    is wrapped (_compat.py) to then do what the nested path would have done: where the
    check was asked and the encoder's remaining conditions for the nested path hold,
    the padded positions become the final norm of zeros (zeros without a norm), on the
    device and only if the mask is left-aligned — a mask that is not takes the padded
    path on the CPU too. Asked to pack anyway (``mask_check=False``), tpu refuses.
"""

from __future__ import annotations

import threading

import torch

from torchtpu import _compat

# The mask (True where a position holds a token) the running encoder asked about.
_asked = threading.local()


def not_left_aligned(func, args, kwargs) -> bool:
    """The encoder's mask check on tpu: the padded path (see the Note)."""
    _asked.valid = args[1]
    return False


def refuse_nested_tensors(func, args, kwargs):
    from torchtpu.ops.unsupported import refuse

    refuse("nested tensors", op=str(func))


def _forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
    """``nn.TransformerEncoder.forward``, with its nested path's zeros on tpu."""
    if torch.compiler.is_compiling():  # no mask check is made while compiling
        return _torchs_forward(self, src, mask, src_key_padding_mask, is_causal)
    outer = getattr(_asked, "valid", None)  # an encoder inside a layer of another
    _asked.valid = None
    try:
        output = _torchs_forward(self, src, mask, src_key_padding_mask, is_causal)
        valid = _asked.valid
    finally:
        _asked.valid = outer
    if valid is None or not _takes_nested_path(self, src, mask):
        return output
    left_aligned = (valid[:, 1:] <= valid[:, :-1]).all()
    padded = ~valid  # [batch, sequence]: the nested path is for batch_first encoders
    fill = output.new_zeros(output.shape[-1])
    if self.norm is not None:
        fill = self.norm(fill)
    return torch.where(padded[..., None] & left_aligned, fill, output)


def _takes_nested_path(encoder, src, mask) -> bool:
    """The encoder's conditions for its nested path checked after the mask check
    (torch 2.11-2.15: ``TransformerEncoder.forward``)."""
    if mask is not None or torch.is_autocast_enabled():
        return False
    first = encoder.layers[0]
    return not (
        torch.is_grad_enabled()
        and (src.requires_grad or any(p.requires_grad for p in first.parameters()))
    )


_torchs_forward = _compat.wrap_transformer_encoder_forward(_forward)
