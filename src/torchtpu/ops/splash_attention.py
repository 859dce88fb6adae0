"""FlexAttention with a block mask by JAX's Pallas splash kernel on a TPU.

Note [Block masks as splash's mask information]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
JAX's splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) is a
FlashAttention kernel whose grid visits, per (head, query block), a short list of key
blocks, each marked empty, partial (its element mask is data) or full. That is what a
torch ``BlockMask`` lists: ``kv_indices`` (partial blocks) and ``full_kv_indices``
(full blocks) per (batch, head, query block), and ``q_indices``/``full_q_indices`` per
key block for the backward's key and value gradients. So the lists become splash's
``MaskInfo`` as they are: the grid's width is the most blocks any query block lists
(not the number of key blocks), slot j of a row names the j-th listed block
(``data_next``), its kind (``block_mask``: 0 past the list's end, 1 partial, 2 full)
and, for a partial block, which element mask it takes (``mask_next``). The element
masks of the partial blocks are mask_mod's values on those blocks only (made by
compile/flex_splash.py before the op: [rows, K, bq, bk] booleans). Memory and work
follow the listed blocks: a sliding window over 8k keys never holds an 8k x 8k array.

The batch is folded into the heads (splash has no batch): query head b*Hq + h uses key
head b*Hkv + h // (Hq / Hkv), which is splash's own grouping. A row that no key may be
attended from gives zeros and a log-sum-exp of -inf, as torch's flex_attention does
(splash's would divide by a zero sum): the op masks it, and the backward gives it a
zero output gradient, so such rows add nothing to any gradient.

The backward runs splash's own (its dq kernel over the forward's lists, its dkv kernel
over the transposed ones) after recomputing the forward inside ``jax.vjp``, as
ops/flash_attention.py does for SDPA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torchtpu.ops.flash_attention import kernels_context
from torchtpu.ops.registry import lowers

_library = torch.library.Library("torchtpu_nn", "FRAGMENT")
_library.define(
    "flex_splash(Tensor query, Tensor key, Tensor value, Tensor rows, Tensor partial, "
    "float scale, int partial_slots) -> (Tensor, Tensor)"
)
_library.define(
    "flex_splash_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
    "Tensor rows, Tensor partial, Tensor columns, Tensor partial_t, float scale, "
    "int partial_slots, int partial_slots_t) -> Tensor[]"
)
flex_splash_op = torch.ops.torchtpu_nn.flex_splash.default
flex_splash_backward_op = torch.ops.torchtpu_nn.flex_splash_backward.default


@torch.library.register_fake("torchtpu_nn::flex_splash", lib=_library)
def _flex_splash_fake(query, key, value, rows, partial, scale, partial_slots):
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    return out, query.new_empty(query.shape[:-1], dtype=torch.float32)


@torch.library.register_fake("torchtpu_nn::flex_splash_backward", lib=_library)
def _flex_splash_backward_fake(
    grad_out, query, key, value, rows, partial, columns, partial_t, scale, slots, slots_t
):
    return [query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)]


def _mask_info(slots, partial, partial_slots: int, transposed: bool):
    """splash's MaskInfo from a block mask's lists: ``slots`` [rows, R, K] holds the
    listed blocks (partial ones in the first ``partial_slots`` slots, then full ones; -1
    past a list's end), ``partial`` [rows * R * partial_slots, bq, bk] their element
    masks. For the key and value gradients (``transposed``) R runs over key blocks and
    the slots list query blocks; splash wants those arrays as [rows, K, R]."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info

    heads, r, k = slots.shape
    listed = slots >= 0
    is_partial = jnp.arange(k) < partial_slots
    kind = jnp.where(listed, jnp.where(is_partial, 1, 2), 0).astype(jnp.int32)
    data = jnp.where(listed, slots, 0).astype(jnp.int32)
    which = jnp.arange(heads * r, dtype=jnp.int32).reshape(heads, r, 1) * partial_slots
    which = jnp.where(listed & is_partial, which + jnp.arange(k, dtype=jnp.int32), 0)
    if transposed:
        data, kind, which = (x.transpose(0, 2, 1) for x in (data, kind, which))
    return splash_attention_mask_info.MaskInfo(
        data_next=data,
        mask_next=which,
        block_mask=kind,
        partial_mask_blocks=partial,
        q_sequence=None,
    )


def _live_rows(slots, partial, partial_slots: int, length: int):
    """[rows, L]: whether a query may attend to any key (a full block listed, or a true
    element in a listed partial block's row)."""
    heads, r, _ = slots.shape
    full = (slots[..., partial_slots:] >= 0).any(-1)  # [rows, R]
    block_q = partial.shape[-2]
    rows_of_partials = partial.reshape(heads, r, partial_slots, block_q, -1).any(-1)
    listed = (slots[..., :partial_slots] >= 0)[..., None]
    in_partials = (rows_of_partials & listed).any(2)  # [rows, R, bq]
    return (full[..., None] | in_partials).reshape(heads, length)


def _kernel(slots, partial, partial_slots, columns=None, partial_t=None, slots_t=0, save=False):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    block_q, block_kv = partial.shape[-2:]
    blocks = splash.BlockSizes(
        block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
        block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
        block_q_dq=block_q, block_kv_dq=block_kv,
    )  # fmt: skip
    forward = _mask_info(slots, partial, partial_slots, transposed=False)
    backward = None if columns is None else _mask_info(columns, partial_t, slots_t, transposed=True)
    return splash.SplashAttentionKernel(
        forward, forward if backward is not None else None, backward,
        block_sizes=blocks, is_mqa=False, save_residuals=save,
        mask_value=splash.DEFAULT_MASK_VALUE, attn_logits_soft_cap=None,
        residual_checkpoint_name=None, mask_function=None, interpret=False,
    )  # fmt: skip


def _folded(query, key, value, scale):
    """q, k and v with the batch folded into the heads; q scaled (splash does not
    scale)."""
    batch = query.shape[0]
    key = jnp.broadcast_to(key, (batch, *key.shape[1:]))
    value = jnp.broadcast_to(value, (batch, *value.shape[1:]))
    fold = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    scaled = (query.astype(jnp.float32) * scale).astype(query.dtype)
    return fold(scaled), fold(key), fold(value)


@lowers(flex_splash_op, static=("scale", "partial_slots"))
def _flex_splash(query, key, value, rows, partial, scale, partial_slots):
    batch, heads, length, _ = query.shape
    q, k, v = _folded(query, key, value, scale)
    with kernels_context():
        out, (lse,) = _kernel(rows, partial, partial_slots, save=True)(q, k, v)
    live = _live_rows(rows, partial, partial_slots, length)
    out = jnp.where(live[..., None], out, 0).astype(query.dtype)
    lse = jnp.where(live, lse, -jnp.inf)
    return (
        out.reshape(batch, heads, length, -1),
        lse.reshape(batch, heads, length).astype(jnp.float32),
    )


@lowers(flex_splash_backward_op, static=("scale", "partial_slots", "partial_slots_t"))
def _flex_splash_backward(
    grad_out, query, key, value, rows, partial, columns, partial_t, scale, partial_slots,
    partial_slots_t,
):  # fmt: skip
    batch, heads, length, _ = query.shape
    q, k, v = _folded(query, key, value, scale)
    live = _live_rows(rows, partial, partial_slots, length)
    grad = jnp.where(live[..., None], grad_out.reshape(-1, length, grad_out.shape[-1]), 0)
    with kernels_context():
        kernel = _kernel(rows, partial, partial_slots, columns, partial_t, partial_slots_t)
        _, pullback = jax.vjp(kernel, q, k, v)
        grad_q, grad_k, grad_v = pullback(grad.astype(query.dtype))
    grad_q = (grad_q.astype(jnp.float32) * scale).astype(query.dtype).reshape(query.shape)
    kv_shape = (batch, *key.shape[1:])
    grad_k = grad_k.reshape(kv_shape)
    grad_v = grad_v.reshape((batch, *value.shape[1:]))
    if key.shape[0] != batch:  # one key batch broadcast over the queries': sum in float32
        grad_k, grad_v = (g.astype(jnp.float32).sum(0, keepdims=True) for g in (grad_k, grad_v))
    return [grad_q, grad_k.astype(key.dtype), grad_v.astype(value.dtype)]
