"""``torch.nn.functional.cross_entropy`` of class-index targets as one op forward and
one op backward.

torch runs ``cross_entropy`` as its composite: ``log_softmax``, then ``nll_loss``;
backward, ``nll_loss_backward`` (a [N, C] gradient, zero but at the targets) and
``_log_softmax_backward_data``. Eagerly each is a program of its own, and between them
three float32 [N, C] arrays live at once in the backward: log_softmax's saved output,
nll_loss's gradient and log_softmax's. For a language model's loss, C is the
vocabulary: at GPT-2 small's 8x1024 tokens one such array is 1.5 GiB, and on a TPU v5e
the four ops kept the chip busy ~21 ms a step (docs/performance.md). On tpu
(device.py ``_cross_entropy_loss``) the loss of [N, C] logits and [N] class indices is
instead:

- ``torchtpu_nn::cross_entropy``: the loss (losses.py ``class_index_cross_entropy``:
  weights, ``ignore_index``, label smoothing and the three reductions as torch's) and
  each row's logsumexp, with no (N, C) array made (Note [Cross entropy without
  log-probabilities] in losses.py);
- ``torchtpu_nn::cross_entropy_backward``: the logits' gradient from the logits and
  those logsumexps (JAX's ``vjp`` of the same function, so forward and backward
  cannot disagree).

Autograd saves the logits themselves and the [N] logsumexps. Under autocast, where
torch's composite casts 16-bit logits to float32 for ``log_softmax`` and ``nll_loss``,
``dtype`` (float32) is what the op computes in, and the gradient is cast back to the
logits' dtype. Float32 logits that are a 16-bit tensor's ``.float()`` are saved as
that tensor (Note [Saving the logits' values], dispatch/saved_values.py): the
backward op then widens them itself (``input_dtype``). A backward differentiated again
(``create_graph=True``) runs torch's composite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torchtpu import dtypes
from torchtpu.ops.losses import class_index_cross_entropy
from torchtpu.ops.registry import lowers

_library = torch.library.Library("torchtpu_nn", "FRAGMENT")
_library.define(
    "cross_entropy(Tensor input, Tensor target, Tensor? weight, int reduction, "
    "int ignore_index, float label_smoothing, ScalarType? dtype) -> (Tensor, Tensor)"
)
_library.define(
    "cross_entropy_backward(Tensor grad_out, Tensor input, Tensor logsumexp, Tensor target, "
    "Tensor? weight, int reduction, int ignore_index, float label_smoothing, "
    "ScalarType? dtype, ScalarType? input_dtype=None) -> Tensor"
)
cross_entropy_op = torch.ops.torchtpu_nn.cross_entropy.default
cross_entropy_backward_op = torch.ops.torchtpu_nn.cross_entropy_backward.default

_OPTIONS = ("reduction", "ignore_index", "label_smoothing", "dtype")


@torch.library.register_fake("torchtpu_nn::cross_entropy", lib=_library)
def _cross_entropy_fake(input, target, weight, reduction, ignore_index, label_smoothing, dtype):
    shape = input.shape[:1] if reduction == 0 else ()
    out = dtype or input.dtype
    work = torch.promote_types(out, torch.float32)
    return input.new_empty(shape, dtype=out), input.new_empty(input.shape[:1], dtype=work)


@torch.library.register_fake("torchtpu_nn::cross_entropy_backward", lib=_library)
def _cross_entropy_backward_fake(
    grad_out, input, logsumexp, target, weight, reduction, ignore_index, label_smoothing, dtype,
    input_dtype=None,
):  # fmt: skip
    return input.new_empty(input.shape, dtype=input_dtype or input.dtype)


def _loss_fn(target, weight, reduction, ignore_index, label_smoothing, dtype, logsumexp=None):
    """The loss as a function of the logits, computed in ``dtype`` where given, with
    the rows' ``logsumexp`` where the forward computed them."""

    def loss(logits):
        out = logits.dtype if dtype is None else dtypes.to_jax(dtype)
        work = jnp.promote_types(out, jnp.float32)  # 16-bit floats: float32 inside, once
        weights = None if weight is None else weight.astype(work)
        value = class_index_cross_entropy(
            logits.astype(work), target, weights, reduction, ignore_index, label_smoothing,
            logsumexp,
        )  # fmt: skip
        return value.astype(out)

    return loss


@lowers(cross_entropy_op, static=_OPTIONS)
def _cross_entropy(input, target, weight, reduction, ignore_index, label_smoothing, dtype):
    """The loss, and the rows' logsumexp for the backward (Note [Cross entropy without
    log-probabilities] in losses.py)."""
    out = input.dtype if dtype is None else dtypes.to_jax(dtype)
    logits = input.astype(jnp.promote_types(out, jnp.float32))
    logsumexp = jax.nn.logsumexp(logits, axis=1)
    loss = _loss_fn(target, weight, reduction, ignore_index, label_smoothing, dtype, logsumexp)
    return loss(input), logsumexp


@lowers(cross_entropy_backward_op, static=(*_OPTIONS, "input_dtype"))
def _cross_entropy_backward(
    grad_out, input, logsumexp, target, weight, reduction, ignore_index, label_smoothing, dtype,
    input_dtype=None,
):  # fmt: skip
    """The logits' gradient; where ``input_dtype`` is given, ``input`` holds the 16-bit
    values of a float32 input (dispatch/saved_values.py) and the gradient is the float32
    input's."""
    if input_dtype is not None:
        input = input.astype(dtypes.to_jax(input_dtype))
    loss = _loss_fn(target, weight, reduction, ignore_index, label_smoothing, dtype, logsumexp)
    value, vjp = jax.vjp(loss, input)
    return vjp(grad_out.astype(value.dtype))[0]


class CrossEntropy(torch.autograd.Function):
    """``cross_entropy_op`` with ``cross_entropy_backward_op`` as its backward."""

    @staticmethod
    def forward(ctx, input, target, weight, reduction, ignore_index, label_smoothing, dtype):
        ctx.options = (reduction, ignore_index, label_smoothing, dtype)
        ctx.input_dtype = input.dtype
        loss, logsumexp = cross_entropy_op(input, target, weight, *ctx.options)
        ctx.save_for_backward(input, logsumexp, target, weight)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        input, logsumexp, target, weight = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: torch's composite, differentiated
            reduction, ignore_index, label_smoothing, dtype = ctx.options
            logits = input if dtype is None else input.to(dtype)
            loss = torch.ops.aten.cross_entropy_loss.default.decompose(
                logits, target, weight, reduction, ignore_index, label_smoothing
            )
            (grad,) = torch.autograd.grad(loss, input, grad_out, create_graph=True)
        else:
            # The input may come back narrower than it was (dispatch/saved_values.py).
            widened_to = ctx.input_dtype if input.dtype != ctx.input_dtype else None
            grad = cross_entropy_backward_op(
                grad_out, input, logsumexp, target, weight, *ctx.options, input_dtype=widened_to
            )
        return grad, None, None, None, None, None, None
