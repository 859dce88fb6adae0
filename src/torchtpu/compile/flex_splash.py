"""FlexAttention with a block mask and no score_mod as JAX's splash kernel on a TPU.

Where the eager block path would run (flex_blocks.py: the block counts are known), a
call that the kernel can take runs as ``torchtpu_nn::flex_splash`` instead (Note [Block
masks as splash's mask information], ops/splash_attention.py): the block mask's lists
become the kernel's grid as they are, and mask_mod is evaluated here, as torch ops on
the partial blocks only, into the element masks the kernel reads.

What the kernel takes (anything else keeps the block path, and
``torchtpu.metrics()["attention"]`` counts each choice with its reason):
- no score_mod (a score_mod is arbitrary code per score; mask_mod is data here);
- bfloat16 q, k and v of rank 4 with a head size of 64 or 128 (as the flash kernels,
  ops/flash_attention.py, for the same reasons: on a TPU v5e float32 inputs through the
  kernel differed from float64 by up to 1.4e-2, the block path's by 1.5e-4);
- blocks of multiples of 128 that divide the lengths, and block lists that fit the
  kernel's scalar memory (``SCALAR_MEMORY_BUDGET``);
- no request for the maximum scores (``return_aux=AuxRequest(max_scores=True)``);
  in the backward, no gradient through the log-sum-exp.

``config.flash_attention`` decides it as for SDPA: "auto" on a TPU, "on" anywhere
(interpreted off a TPU, how the tests check it), "off" never.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

from torchtpu.observe import metrics
from torchtpu.ops import flash_attention
from torchtpu.ops.splash_attention import flex_splash_backward_op, flex_splash_op

# The smallest block the kernel takes on either axis (a TPU lane's width).
BLOCK = 128


# What the kernel's scalar memory may hold of a block mask's lists: a grid's three
# int32 arrays of [batch * heads, blocks, slots] are prefetched into it whole, and a v5e
# core has 1 MiB of it (jax's tpu_info); half, for the kernels' own scalars. Larger lists
# (a causal mask over 8k keys with 32 heads and batch: 133k slots) keep the block path.
SCALAR_MEMORY_BUDGET = 512 * 1024


def too_large(query, block_mask, most, most_t=None) -> str | None:
    """Why the block lists do not fit the kernel's scalar memory, or None."""
    slots = max(most[0], 1) + most[1]
    grids = [block_mask[2].shape[-1] * slots]  # per row: query blocks x slots
    if most_t is not None:
        grids.append(block_mask[6].shape[-1] * (max(most_t[0], 1) + most_t[1]))
    if 3 * 4 * query.size(0) * query.size(1) * max(grids) > SCALAR_MEMORY_BUDGET:
        return "block lists too large for the kernel's scalar memory"
    return None


def count(reason: str | None, backward: bool) -> None:
    """Counts the choice, or the reason the kernel was not taken, beside the block
    path's own choice."""
    if reason is not None:
        metrics.count("attention", f"flex: no splash: {reason}")
    else:
        metrics.count("attention", "flex: splash" + (" (backward)" if backward else ""))


def why_not(query, key, value, score_mod, block_mask, kernel_options, grad_lse=None) -> str | None:
    """Why a call the kernel is offered for does not take it, before its block counts
    are known; None where it may."""
    if not _is_identity(score_mod):
        return "a score_mod"
    if (kernel_options or {}).get("OUTPUT_MAX"):
        return "the maximum scores asked for"
    if grad_lse is not None:
        return "a gradient through the log-sum-exp"
    if any(t.dtype != torch.bfloat16 for t in (query, key, value)):
        return "not bfloat16"
    layout = flash_attention.layout_problem(query, key, value)
    if layout is not None:
        return layout
    if query.size(-1) not in flash_attention.HEAD_SIZES:
        sizes = " or ".join(map(str, flash_attention.HEAD_SIZES))
        return f"a head size other than {sizes}"
    if key.size(0) not in (1, query.size(0)) or query.size(1) % key.size(1):
        return "batches or heads that do not broadcast"
    q_block, kv_block = block_mask[-3], block_mask[-2]
    if q_block % BLOCK or kv_block % BLOCK:
        return f"blocks not multiples of {BLOCK}"
    if query.size(2) % q_block or key.size(2) % kv_block:
        return "lengths not multiples of the blocks"
    if any(block_mask[i] is None for i in (6, 7)):
        return "no query block lists (the backward's)"
    return None


def _is_identity(score_mod) -> bool:
    """Whether score_mod returns its score unchanged: None, torch's ``_identity``, or a
    traced graph whose output is its first input."""
    if score_mod is None or getattr(score_mod, "__name__", None) == "_identity":
        return True
    graph = getattr(score_mod, "graph", None)
    if graph is None:
        return False
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = nodes[-1]
    return (
        bool(placeholders)
        and output.op == "output"
        and len(nodes) == len(placeholders) + 1
        and output.args[0] in (placeholders[0], (placeholders[0],))
    )


def _slots(num, indices, most: int, blocks: int):
    """[Bm, Hm, R, most]: the listed blocks, -1 past each list's end."""
    if not most:
        return None
    listed = torch.arange(most, device=num.device) < num.unsqueeze(-1)
    chosen = indices[..., :most].clamp(0, blocks - 1).int()
    return torch.where(listed, chosen, -1)


def _grid(lists, most: tuple[int, int], batch: int, heads: int, blocks: int):
    """(slots [B*H, R, K] with at least one partial slot, the partial slots' count)."""
    num, indices, full_num, full_indices = lists
    partial_slots = max(most[0], 1)  # the kernel reads element masks of some shape
    parts = [_slots(num, indices, partial_slots, blocks)]
    if most[1]:
        parts.append(_slots(full_num, full_indices, most[1], blocks))
    slots = torch.cat(parts, -1)
    return slots.expand(batch, heads, *slots.shape[2:]).reshape(
        batch * heads, *slots.shape[2:]
    ), partial_slots


def _evaluate(mask_mod, levels, b, h, q, kv, buffers):
    """mask_mod over nested vmaps (``levels``: in_dims of (b, h, q_idx, kv_idx), outermost
    first), as booleans."""
    fn = mask_mod
    for dims in reversed(levels):
        fn = torch.vmap(fn, in_dims=dims + (None,) * len(buffers))
    with TransformGetItemToIndex():
        return fn(b, h, q, kv, *buffers).bool()


def _partial_masks(block_mask, slots, partial_slots, batch, heads, buffers, transposed: bool):
    """The element masks of the partial blocks the slots list, flattened to [B*H*R*P,
    rows, columns]: mask_mod's values, [q block, kv block] for the forward, transposed
    ([kv, q]) for the key and value gradients, whose rows are key blocks."""
    q_block, kv_block, mask_mod = block_mask[-3], block_mask[-2], block_mask[-1]
    device = slots.device
    listed = slots[..., :partial_slots].clamp(min=0).long().reshape(batch, heads, -1, partial_slots)
    b, h = torch.arange(batch, device=device), torch.arange(heads, device=device)
    rows = torch.arange(listed.shape[2], device=device)
    if not transposed:
        q = rows.unsqueeze(-1) * q_block + torch.arange(q_block, device=device)  # [R, bq]
        kv = listed.unsqueeze(-1) * kv_block + torch.arange(kv_block, device=device)  # [B,H,R,P,bk]
        levels = [(0, None, None, 0), (None, 0, None, 0), (None, None, 0, 0),
                  (None, None, None, 0), (None, None, 0, None), (None, None, None, 0)]  # fmt: skip
        masks = _evaluate(mask_mod, levels, b, h, q, kv, buffers)  # [B,H,R,P,bq,bk]
    else:
        q = listed.unsqueeze(-1) * q_block + torch.arange(q_block, device=device)  # [B,H,R,P,bq]
        kv = rows.unsqueeze(-1) * kv_block + torch.arange(kv_block, device=device)  # [R, bk]
        levels = [(0, None, 0, None), (None, 0, 0, None), (None, None, 0, 0),
                  (None, None, 0, None), (None, None, None, 0), (None, None, 0, None)]  # fmt: skip
        masks = _evaluate(mask_mod, levels, b, h, q, kv, buffers)  # [B,H,R,P,bk,bq]
    return masks.reshape(-1, *masks.shape[-2:])


# (id of a block mask's first list tensor, transposed, batch, heads) -> (a weak reference
# to that tensor, what the layout was made from, the layout). Not a WeakKeyDictionary:
# that compares keys with ==, which on tensors is elementwise.
_layouts: dict[tuple, tuple] = {}


def _layout(block_mask, most, batch: int, heads: int, buffers, transposed: bool):
    """(slots, partial blocks' element masks, partial slots) of the forward's lists, or
    of the transposed ones. Made once per block mask: every layer of a model attends
    with the same one, and the backward with its forward's. Made again where its lists,
    mask_mod or mask_mod's captured tensors changed."""
    lists = block_mask[6:10] if transposed else block_mask[2:6]
    first = lists[0]
    key = (id(first), transposed, batch, heads)
    made_from = (
        tuple(None if t is None else t._version for t in lists),
        block_mask[-1],
        tuple((id(b), b._version) if isinstance(b, torch.Tensor) else b for b in buffers),
        most,
    )
    cached = _layouts.get(key)
    if cached is not None and cached[0]() is first and cached[1] == made_from:
        return cached[2]
    slots, partial_slots = _grid(lists, most, batch, heads, lists[1].shape[-1])
    masks = _partial_masks(block_mask, slots, partial_slots, batch, heads, buffers, transposed)
    layout = (slots, masks, partial_slots)
    _layouts[key] = (weakref.ref(first, lambda _: _layouts.pop(key, None)), made_from, layout)
    return layout


def forward(query, key, value, block_mask, scale, most, mask_buffers):
    """flex_attention's (out, log2-sum-exp, maximum scores) by the kernel. The maximum
    scores are not computed (``why_not`` refuses a call that asks for them): zeros."""
    batch, heads = query.shape[:2]
    slots, masks, partial_slots = _layout(block_mask, most, batch, heads, mask_buffers, False)
    out, lse = flex_splash_op(query, key, value, slots, masks, scale, partial_slots)
    lse = lse / math.log(2)
    return out, lse, torch.zeros_like(lse)


def backward(grad_out, query, key, value, block_mask, scale, most, most_t, mask_buffers):
    """(grad q, grad k, grad v) by the kernel's backward."""
    batch, heads = query.shape[:2]
    slots, masks, partial_slots = _layout(block_mask, most, batch, heads, mask_buffers, False)
    columns, masks_t, partial_t = _layout(block_mask, most_t, batch, heads, mask_buffers, True)
    if grad_out is None:
        grad_out = torch.zeros_like(query)
    grads = flex_splash_backward_op(
        grad_out, query, key, value, slots, masks, columns, masks_t, scale, partial_slots, partial_t
    )
    return tuple(grads)
