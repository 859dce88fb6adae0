"""Scaled dot-product attention as one op in the input's dtype, forward and backward.

torch's ``scaled_dot_product_attention`` picks a fused kernel on CUDA and the CPU; for
any other device it runs its math decomposition, which on bfloat16 inputs casts q, k
and v to float32, builds a float32 mask and saves float32 copies of q, k and v and the
float32 [B, H, L, S] probabilities for the backward, held for every layer until the
backward runs. On tpu, ``scaled_dot_product_attention`` (an
AutogradPrivateUse1 kernel, device.py ``_scaled_dot_product_attention``) calls
``torchtpu_nn::attention`` instead:

- the products run in the input's dtype with float32 accumulation and the softmax in
  float32, as CUDA's flash kernels do; the output is in the input's dtype;
- its backward (``attention_backward``) recomputes the weights from q, k and v, so
  autograd saves q, k, v and the mask only;
- causal masks (torch's: top-left aligned), boolean and additive masks broadcast to
  [..., L, S], ``scale`` and ``enable_gqa`` as torch's; a row every position of which
  is masked out gives zeros, as torch's math path does since 2.5.

Dropout (``dropout_p > 0``) and a mask that requires a gradient take torch's math path.
float32 inputs follow torch's float32 matmul precision (matmul_precision.py). The
scores are materialised inside the op's program, except where a fused kernel takes
the call: JAX's Pallas flash kernels on a TPU (bfloat16, no mask, lengths multiples of
128; ops/flash_attention.py), cuDNN's through ``jax.nn.dot_product_attention`` on a GPU
(ops/cudnn_attention.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from torchtpu.ops import cudnn_attention, flash_attention
from torchtpu.ops.registry import lowers

_library = torch.library.Library("torchtpu_nn", "DEF")
_library.define(
    "attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, bool is_causal, "
    "float scale, bool enable_gqa) -> Tensor"
)
_library.define(
    "attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
    "Tensor? attn_mask, bool is_causal, float scale, bool enable_gqa) -> Tensor[]"
)
attention_op = torch.ops.torchtpu_nn.attention.default
attention_backward_op = torch.ops.torchtpu_nn.attention_backward.default


@torch.library.register_fake("torchtpu_nn::attention", lib=_library)
def _attention_fake(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


@torch.library.register_fake("torchtpu_nn::attention_backward", lib=_library)
def _attention_backward_fake(grad_out, query, key, value, attn_mask, is_causal, scale, enable_gqa):
    return [query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)]


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, is_causal, scale, enable_gqa = inputs
    ctx.save_for_backward(query, key, value, attn_mask)
    ctx.options = (is_causal, scale, enable_gqa)


def _backward(ctx, grad_out):
    query, key, value, attn_mask = ctx.saved_tensors
    grads = attention_backward_op(grad_out, query, key, value, attn_mask, *ctx.options)
    return (*grads, None, None, None, None)


torch.library.register_autograd(
    "torchtpu_nn::attention", _backward, setup_context=_setup_context, lib=_library
)


def _grouped(query, key, value, enable_gqa):
    """Key and value with their heads repeated to the query's (``enable_gqa``), and the
    number of query heads per key head."""
    if enable_gqa and key.ndim >= 3 and key.shape[-3] != query.shape[-3]:
        repeats = query.shape[-3] // key.shape[-3]
        return jnp.repeat(key, repeats, axis=-3), jnp.repeat(value, repeats, axis=-3), repeats
    return key, value, 1


def _weights(query, key, attn_mask, is_causal, scale, precision):
    """The attention weights [..., L, S] in the working dtype (float32, or float64 for
    float64 inputs): products of the inputs' dtype accumulated in it, the softmax in
    it; a row with nothing to attend to is zeros."""
    work = _working(query.dtype)
    scores = _product(query, key, "...ld,...sd->...ls", precision, query.dtype) * work.type(scale)
    keep = None
    if is_causal:  # torch's causal mask: top-left aligned
        keep = jnp.tril(jnp.ones(scores.shape[-2:], jnp.bool_))
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            keep = attn_mask if keep is None else keep & attn_mask
        else:
            scores = scores + attn_mask.astype(work)
    if keep is not None:
        scores = jnp.where(keep, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    return weights / jnp.where(total == 0, 1.0, total)


def _working(dtype):
    """What attention of ``dtype`` inputs accumulates in: float32 (float64 for float64)."""
    return jnp.dtype(jnp.promote_types(dtype, jnp.float32))


def _product(a, b, spec, precision, dtype):
    """``einsum(spec, a, b)`` of ``dtype`` operands, accumulated in the working dtype."""
    return jnp.einsum(
        spec,
        a.astype(dtype),
        b.astype(dtype),
        precision=precision,
        preferred_element_type=_working(dtype),
    )


def _fused(query, key, value, attn_mask, is_causal):
    """The module of the fused kernel this call takes (cuDNN's on a GPU, the Pallas
    flash kernels on a TPU), or None for the dense lowering; the choice is counted."""
    if cudnn_attention.offered():
        return cudnn_attention if cudnn_attention.applies(query, key, value, attn_mask, is_causal) else None
    return flash_attention if flash_attention.applies(query, key, value, attn_mask) else None


@lowers(attention_op, static=("is_causal", "scale", "enable_gqa"), precision=True)
def _attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, *, precision):
    key, value, _ = _grouped(query, key, value, enable_gqa)
    kernel = _fused(query, key, value, attn_mask, is_causal)
    if kernel is not None:
        return kernel.forward(query, key, value, is_causal, scale)
    weights = _weights(query, key, attn_mask, is_causal, scale, precision)
    return _product(weights, value, "...ls,...sd->...ld", precision, value.dtype).astype(
        query.dtype
    )


@lowers(attention_backward_op, static=("is_causal", "scale", "enable_gqa"), precision=True)
def _attention_backward(
    grad_out, query, key, value, attn_mask, is_causal, scale, enable_gqa, *, precision
):
    """The gradients from the recomputed weights P (FlashAttention's backward):
    dV = Pᵀ dO, dP = dO Vᵀ, dS = P (dP - rowsum(dO O)), dQ = dS K s, dK = dSᵀ Q s, with
    dP and dS kept in the working dtype (a 16-bit dP loses the difference dS is made
    of)."""
    dtype = query.dtype
    grouped_key, grouped_value, repeats = _grouped(query, key, value, enable_gqa)
    kernel = _fused(query, grouped_key, grouped_value, attn_mask, is_causal)
    if kernel is not None:
        grad_query, grad_key, grad_value = kernel.backward(
            grad_out, query, grouped_key, grouped_value, is_causal, scale
        )
    else:
        weights = _weights(query, grouped_key, attn_mask, is_causal, scale, precision)
        out = _product(weights, grouped_value, "...ls,...sd->...ld", precision, dtype)
        grad_value = _product(weights, grad_out, "...ls,...ld->...sd", precision, dtype)
        grad_weights = _product(grad_out, grouped_value, "...ld,...sd->...ls", precision, dtype)
        work = _working(dtype)
        row = jnp.sum(grad_out.astype(work) * out.astype(dtype).astype(work), -1)
        grad_scores = weights * (grad_weights - row[..., None]) * work.type(scale)
        grad_query = _product(grad_scores, grouped_key, "...ls,...sd->...ld", precision, dtype)
        grad_key = _product(grad_scores, query, "...ls,...ld->...sd", precision, dtype)
    if repeats > 1:  # each key head served `repeats` query heads: their gradients add up
        grad_key, grad_value = (
            g.reshape(*g.shape[:-3], key.shape[-3], repeats, *g.shape[-2:]).sum(-3)
            for g in (grad_key, grad_value)
        )
    return [grad_query.astype(dtype), grad_key.astype(key.dtype), grad_value.astype(value.dtype)]
