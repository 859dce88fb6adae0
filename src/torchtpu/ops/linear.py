"""``torch.nn.functional.linear`` as one op forward and one op backward, with
autocast's casts inside them.

torch runs ``linear`` as its composite: a transpose and ``addmm`` forward (a view,
``mm`` and a view for inputs of more than two dims), and ``mm``, ``mm`` and ``sum``
backward. Under ``torch.autocast`` each float32 input is first cast to the autocast
dtype by an op of its own, and each of their gradients cast back. Eagerly on a TPU
every one of those ops is a program launch, ~120 us of host time on a v5e's host
(docs/performance.md): an autocast ``nn.Linear`` cost ten launches a training step,
and a GPT step's hundreds of them were most of Strict's step. On tpu (device.py
``_linear``, and its autocast kernel) a linear layer is one launch forward and one
backward instead:

- ``torchtpu_nn::linear(input, weight, bias, dtype, keep_input)``: ``dtype`` (the
  autocast dtype, or None) is what the inputs are cast to inside the op; the product
  and the bias's addition are addmm's lowering, so values are those of the composite.
  Its second output is the input in that dtype, which the backward needs (as
  autocast's own cast of it is what torch's backward saves), or an empty placeholder
  where the input needs no cast or no weight gradient is wanted (``keep_input``).
- ``torchtpu_nn::linear_backward``: the wanted gradients, each made in the working
  dtype as the composite's ``mm``/``sum`` make it, then cast to its input's dtype as
  the casts' backward does; an unwanted one is an empty placeholder.

The weight is saved as it is (a parameter outlives the step anyway), so an autocast
step holds no extra low-precision copy of each weight until its backward. A backward
that must itself be differentiable (``create_graph=True``) runs as torch ops.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from torchtpu import dtypes
from torchtpu.ops.linalg import addmm, mm
from torchtpu.ops.registry import lowers

_library = torch.library.Library("torchtpu_nn", "FRAGMENT")
_library.define(
    "linear(Tensor input, Tensor weight, Tensor? bias, ScalarType? dtype, bool keep_input) "
    "-> (Tensor, Tensor)"
)
_library.define(
    "linear_backward(Tensor grad_out, Tensor input, Tensor weight, ScalarType input_dtype, "
    "ScalarType? bias_dtype, ScalarType? dtype, bool[3] wanted) -> Tensor[]"
)
linear_op = torch.ops.torchtpu_nn.linear.default
linear_backward_op = torch.ops.torchtpu_nn.linear_backward.default


@torch.library.register_fake("torchtpu_nn::linear", lib=_library)
def _linear_fake(input, weight, bias, dtype, keep_input):
    work = dtype or input.dtype
    out = input.new_empty((*input.shape[:-1], weight.shape[0]), dtype=work)
    return out, input.new_empty(input.shape if keep_input else (0,), dtype=work)


@torch.library.register_fake("torchtpu_nn::linear_backward", lib=_library)
def _linear_backward_fake(grad_out, input, weight, input_dtype, bias_dtype, dtype, wanted):
    shapes = (input.shape, weight.shape, weight.shape[:1])
    kinds = (input_dtype, weight.dtype, bias_dtype or weight.dtype)
    return [
        input.new_empty(shape if want else (0,), dtype=kind)
        for shape, kind, want in zip(shapes, kinds, wanted)
    ]


def _work(dtype, like):
    return like.dtype if dtype is None else dtypes.to_jax(dtype)


@lowers(linear_op, static=("dtype", "keep_input"), precision=True)
def _linear(input, weight, bias, dtype, keep_input, *, precision):
    work = _work(dtype, input)
    x = input.astype(work)
    rows = x.reshape(-1, x.shape[-1])  # a 1-d input is one row
    w = weight.astype(work).T
    if bias is None:
        out = mm(rows, w, precision=precision)
    else:
        out = addmm(bias.astype(work), rows, w, precision=precision)
    out = out.reshape(*input.shape[:-1], weight.shape[0])
    return out, x if keep_input else jnp.zeros((0,), work)


@lowers(linear_backward_op, static=("input_dtype", "bias_dtype", "dtype", "wanted"), precision=True)
def _linear_backward(grad_out, input, weight, input_dtype, bias_dtype, dtype, wanted, *, precision):
    work = _work(dtype, weight)
    input_kind = dtypes.to_jax(input_dtype)
    rows = grad_out.astype(work).reshape(-1, grad_out.shape[-1])
    grads = []
    if wanted[0]:
        grad = mm(rows, weight.astype(work), precision=precision)
        grads.append(grad.reshape(input.shape).astype(input_kind))
    else:
        grads.append(jnp.zeros((0,), input_kind))
    if wanted[1]:
        x = input.astype(work).reshape(-1, input.shape[-1])
        grads.append(mm(rows.T, x, precision=precision).astype(weight.dtype))
    else:
        grads.append(jnp.zeros((0,), weight.dtype))
    bias_kind = dtypes.to_jax(bias_dtype) if bias_dtype is not None else weight.dtype
    if wanted[2]:  # summed in float32 for 16-bit floats, as the sum lowering's jnp.sum does
        grads.append(jnp.sum(rows, axis=0).astype(bias_kind))
    else:
        grads.append(jnp.zeros((0,), bias_kind))
    return grads


class Linear(torch.autograd.Function):
    """``linear_op`` with ``linear_backward_op`` as its backward (the module's note).

    The kept input is an output too, so that a backward differentiated again
    (``create_graph=True``: a gradient penalty, MAML) reaches the input through it, as
    through autocast's own cast; nothing else reads it, and its gradient is None
    unless such a backward asks for it (no zeros are made for it)."""

    @staticmethod
    def forward(ctx, input, weight, bias, dtype, keep_input):
        out, kept = linear_op(input, weight, bias, dtype, keep_input)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(kept if keep_input else input, weight)
        ctx.input_dtype = input.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.dtype = dtype
        return out, kept

    @staticmethod
    def backward(ctx, grad_out, grad_kept):
        saved_input, weight = ctx.saved_tensors
        wanted = list(ctx.needs_input_grad[:3])
        if ctx.bias_dtype is None:
            wanted[2] = False
        grads = [None, None, None]
        if grad_out is not None:
            if torch.is_grad_enabled():  # create_graph: a backward that is differentiable
                grads = _differentiable_backward(ctx, grad_out, saved_input, weight, wanted)
            else:
                made = linear_backward_op(
                    grad_out,
                    saved_input,
                    weight,
                    ctx.input_dtype,
                    ctx.bias_dtype,
                    ctx.dtype,
                    wanted,
                )
                grads = [g if want else None for g, want in zip(made, wanted)]
        if grad_kept is not None and wanted[0]:  # the kept input's, as its cast's backward
            cast_back = grad_kept.to(ctx.input_dtype)
            grads[0] = cast_back if grads[0] is None else grads[0] + cast_back
        return (*grads, None, None)


def _differentiable_backward(ctx, grad_out, input, weight, wanted):
    """linear_backward's gradients as torch ops, for a backward autograd records."""
    dtype = ctx.dtype or weight.dtype
    rows = grad_out.reshape(-1, grad_out.shape[-1])
    grads = [None, None, None]
    if wanted[0]:
        grads[0] = grad_out.matmul(weight.to(dtype)).to(ctx.input_dtype)
    if wanted[1]:
        x = input.to(dtype).reshape(-1, input.shape[-1])
        grads[1] = rows.t().mm(x).to(weight.dtype)
    if wanted[2]:
        grads[2] = rows.sum(0).to(ctx.bias_dtype)
    return grads
