"""What the loss saves for its backward: its logits' values, held as cheaply as they
can be, not the logits tensor.

Note [Saving the logits' values]
    A language model's loss is taken in float32 of 16-bit logits: ``F.cross_entropy(
    logits.float(), target)`` (Transformers' ``ForCausalLMLoss`` upcasts so, as do
    TorchTitan and ``benchmarks/gpt.py``). The loss saves its input for the backward,
    so eagerly the float32 copy of the logits lives from the forward to the backward:
    1.5 GiB at GPT-2 small's 8x1024 tokens (vocabulary 50,304), 4 GiB for as many
    tokens of a Llama 3 (128k), at the step's peak. Its values are the 16-bit logits'
    exactly (a widening loses nothing), and those usually live anyway (the model's
    output). So:

    - ``_to_copy`` from a 16-bit float to float32 (special.py) notes, for the new
      storage, the source tensor's storage (weakly: the note keeps nothing alive), its
      version and its view: `note_widening`.
    - The loss (torchtpu's ``cross_entropy`` op, device.py) saves its input as autograd
      does, then `save_values` re-packs that saved tensor with autograd's own
      per-tensor hooks (``SavedTensor.register_hooks``, the mechanism torch documents
      for storing saved tensors differently). Where the input's storage is unwritten
      since the cast and the source's storage alive and unwritten too, what stays
      saved is a 16-bit tensor on the source's array, and the float32 copy is freed as
      soon as nothing else holds it; the backward op widens the 16-bit values inside
      its program. Otherwise what stays saved is the input's current array (no copy:
      JAX arrays are immutable), so a later in-place write to the logits leaves the
      loss's backward as it was.
    - Unpacked, the saved tensor keeps its place in the graph (its ``grad_fn``): a
      backward with ``create_graph=True`` differentiates through the cast as before.
      It is not version-checked (autograd checks no saved tensor with hooks), as
      torch's own ``cross_entropy`` saves ``log_softmax``'s result, not its input:
      writing into the logits after taking the loss is allowed on the CPU, and now on
      tpu too.
    - Where the caller's own saved-tensor hooks are active (activation checkpointing,
      ``save_on_cpu``), those keep the input as they choose: nothing changes.
"""

from __future__ import annotations

import weakref

import torch

from torchtpu import tracing
from torchtpu.storage import Storage
from torchtpu.tensor import TPUTensor

_NARROW_DTYPES = (torch.bfloat16, torch.float16)

# The storage of each live widened copy -> (its version when made, a weak reference to
# the source's storage, the source's version then, the source's metadata).
_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def note_widening(source: TPUTensor, out: TPUTensor) -> None:
    """``out`` is ``source`` widened to float32 (``_to_copy``): remember ``source``."""
    if (
        source.dtype in _NARROW_DTYPES
        and out.dtype == torch.float32
        and tracing._active is None
        and source._storage.array is not None
    ):
        src = source._storage
        _SOURCES[out._storage] = (out._storage.version, weakref.ref(src), src.version, source._meta)


def _values(t: TPUTensor) -> TPUTensor:
    """A tensor with ``t``'s current values that no write can change: 16-bit where
    ``t`` is a widened copy whose source holds them (`note_widening`)."""
    storage, chain, dtype = t._storage, t._chain, t.dtype
    noted = _SOURCES.get(storage)
    if noted is not None and noted[0] == storage.version:
        _, source_ref, source_version, (_, _, _, source_dtype, source_chain) = noted
        source = source_ref()
        if source is not None and source.version == source_version and source.array is not None:
            # The copy's base array is the source's chain applied to the source's base.
            storage, chain, dtype = source, source_chain + chain, source_dtype
    snapshot = Storage(storage.array, storage.shape, storage.strides, storage.dtype, storage.device_index)
    return TPUTensor(snapshot, chain, tuple(t.shape), t.stride(), t.storage_offset(), dtype)


def save_values(node, index: int, t: TPUTensor) -> None:
    """Keep ``t``, saved by autograd node ``node`` as its ``index``th saved tensor, as
    its values now (Note [Saving the logits' values])."""
    if t._storage.array is None or tracing._active is not None:
        return  # uninitialised (reads as zeros), or traced into one program by XLA
    values, dtype = _values(t), t.dtype  # the hooks must not hold ``t``

    def unpack(saved: TPUTensor) -> TPUTensor:
        # A backward that builds a graph (create_graph=True) gets the input's dtype.
        return saved.to(dtype) if torch.is_grad_enabled() and saved.dtype != dtype else saved

    try:
        node._raw_saved_tensors[index].register_hooks(lambda _: values, unpack)
    except RuntimeError:
        # Saved-tensor hooks of the caller's own decide how it is kept (torch.utils.
        # checkpoint, save_on_cpu), or hooks are disabled here: autograd's save stands.
        pass
