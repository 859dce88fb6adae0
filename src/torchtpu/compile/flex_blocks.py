"""FlexAttention over the blocks a BlockMask lists, not the whole score matrix.

Note [Blockwise FlexAttention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A BlockMask lists, per (batch, head, block of ``Q_BLOCK_SIZE`` queries), the blocks of
``KV_BLOCK_SIZE`` keys that hold any unmasked score: ``kv_num_blocks``/``kv_indices``
(blocks mask_mod decides inside) and ``full_kv_num_blocks``/``full_kv_indices`` (blocks
it passes whole). torch's dense implementation (``sdpa_dense``) ignores the lists: it
scores every query against every key, [B, H, L, S], and masks. Here the keys and values
of the listed blocks are gathered per query block and only those are scored:
[B, H, L/Q_BLOCK_SIZE, Q_BLOCK_SIZE, K * KV_BLOCK_SIZE], K being the most blocks any
query block lists. score_mod and mask_mod are applied through nested vmaps, as torch
applies them, with the gathered key positions as ``kv_idx``; slots past a block list's
end, keys past S and queries past L are masked. The backward recomputes the scores the
same way, follows torch's dense backward (score_mod's joint graph for the scores'
gradient and the captured tensors'), and adds the keys' and values' gradients back
into place. A sliding window of W keys over S costs memory and work in proportion to
L * (W + 2 blocks) rather than L * S.

K is a value on the device, read once per block mask (cached by its tensors and their
versions): so this runs where values can be read -- Strict, Debug and DeferAndFuse (a
flush at a block mask's first use). Inside a trace (torch.compile, torchtpu.jit) a
block mask's tensors have no values yet: there the program loops over the lists' slots
instead (flex_loop.py, Note [Blockwise FlexAttention in a trace]) where the keys span
at least ``LOOP_MIN_BLOCKS`` blocks. torch's dense implementation runs where the blocks
would leave more than half of the scores, or a trace's keys span fewer blocks
(``config.flex_blocks`` "auto"; "on": blocks or the loop wherever there is more than
one block, "off": never). ``torchtpu.metrics()["attention"]`` counts each choice with
its reason.
"""

from __future__ import annotations

import importlib
import math
import weakref

import torch
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

from torchtpu import config, tracing
from torchtpu.compile import flex_loop, flex_splash
from torchtpu.compile.program import tensor_of
from torchtpu.dispatch.values import materialize
from torchtpu.observe import metrics
from torchtpu.ops import flash_attention

_hop = importlib.import_module("torch._higher_order_ops.flex_attention")

# id(kv_num_blocks) -> (a weak reference to it, its and full_kv_num_blocks' versions,
# (K partial, K full)). Not a WeakKeyDictionary: that compares keys with ==, which on
# tensors is elementwise.
_most_blocks: dict[int, tuple] = {}


# In a trace, "auto" loops over the lists' slots only where the keys span at least this
# many blocks: over fewer, the whole score matrix is small and one product computes it.
LOOP_MIN_BLOCKS = 16

# `blocks_to_visit`'s answer inside a trace: loop over the lists' slots (flex_loop.py).
LOOP = "loop"


def blocks_to_visit(block_mask: tuple, kv_length: int, dtype: torch.dtype):
    """(K partial, K full): the most blocks of each list any query block visits; `LOOP`
    inside a trace, where the program loops over the lists instead; None where the
    dense implementation runs. Counts the choice and its reason."""
    reason, most = _why_dense(block_mask, kv_length, dtype)
    if reason is not None:
        choice = f"flex: dense: {reason}"
    else:
        choice = "flex: blocks, looped in the program" if most == LOOP else "flex: blocks"
    metrics.count("attention", choice)
    return most if reason is None else None


def _why_dense(block_mask: tuple, kv_length: int, dtype: torch.dtype):
    kv_block = block_mask[-2]
    reason = _why_dense_anyway(kv_block, kv_length)
    if reason is not None:
        return reason, None
    if tracing.active() is not None:
        reason = _why_not_looped(kv_block, kv_length, dtype)
        return reason, LOOP if reason is None else None
    most = _most(block_mask[2], block_mask[4])
    if config.flex_blocks != "on" and 2 * sum(most) * kv_block > kv_length:
        return "the listed blocks hold more than half of the scores", None
    return None, most


def _splash_blocks(
    query, key, value, score_mod, block_mask, kernel_options, grad_lse=None, backward=False
):
    """Where an eager call runs as JAX's splash kernel (flex_splash.py): the most blocks
    of the forward's lists and, for the backward, of the transposed ones; else None."""
    if tracing.active() is not None or _why_dense_anyway(block_mask[-2], key.size(2)):
        return None
    if not flash_attention.offered():
        return None
    reason = flex_splash.why_not(query, key, value, score_mod, block_mask, kernel_options, grad_lse)
    most = most_t = None
    if reason is None:
        most = _most(block_mask[2], block_mask[4])
        most_t = _most(block_mask[6], block_mask[8]) if backward else None
        reason = flex_splash.too_large(query, block_mask, most, most_t)
    flex_splash.count(reason, backward)
    return None if reason is not None else (most, most_t)


def _why_dense_anyway(kv_block: int, kv_length: int) -> str | None:
    if config.flex_blocks == "off":
        return "config.flex_blocks is 'off'"
    if kv_block >= kv_length:
        return "one block holds every key (no mask, or a block as long as the keys)"
    return None


def _why_not_looped(kv_block: int, kv_length: int, dtype: torch.dtype) -> str | None:
    """In a trace, why the dense implementation runs instead of the loop, or None."""
    if dtype == torch.float64:
        return "traced float64 (the loop computes in float32)"
    if config.flex_blocks != "on" and kv_length < LOOP_MIN_BLOCKS * kv_block:
        return f"traced, the keys span fewer than {LOOP_MIN_BLOCKS} blocks"
    return None


def loops_when_traced(kv_block: int, kv_length: int, dtype: torch.dtype) -> bool:
    """Whether a call with a block mask of ``kv_block`` keys a block over ``kv_length``
    keys loops over its lists when traced (Note [Blockwise FlexAttention in a trace])."""
    return _why_dense_anyway(kv_block, kv_length) is None and _why_not_looped(kv_block, kv_length, dtype) is None


def _most(kv_num: torch.Tensor, full_num: torch.Tensor | None) -> tuple[int, int]:
    versions = (kv_num._version, None if full_num is None else full_num._version)
    key = id(kv_num)
    cached = _most_blocks.get(key)
    if cached is not None and cached[0]() is kv_num and cached[1] == versions:
        return cached[2]
    if full_num is None:
        most = (int(kv_num.max()), 0)
    else:
        most = tuple(torch.stack([kv_num.max(), full_num.max()]).tolist())
    ref = weakref.ref(kv_num, lambda _: _most_blocks.pop(key, None))
    _most_blocks[key] = (ref, versions, most)
    return most


class _Gathered:
    """The positions one call scores: per (b, h, query block), the listed blocks' keys."""

    def __init__(self, block_mask: tuple, most: tuple[int, int], shape: tuple, kv_length: int):
        batch, heads, length = shape
        kv_num, kv_indices, full_num, full_indices = block_mask[2:6]
        self.q_block, kv_block = block_mask[-3], block_mask[-2]
        self.q_blocks = kv_num.shape[-1]
        lists, counts = [kv_indices[..., : most[0]]], [(kv_num, most[0])]
        if most[1]:
            lists.append(full_indices[..., : most[1]])
            counts.append((full_num, most[1]))
        device = kv_num.device
        blocks = torch.cat(lists, -1).long()  # [Bm, Hm, QB, K]
        listed = torch.cat(
            [torch.arange(k, device=device) < num.unsqueeze(-1) for num, k in counts], -1
        )
        size = (batch, heads, self.q_blocks, blocks.shape[-1])
        blocks, listed = blocks.expand(size), listed.expand(size)
        within = torch.arange(kv_block, device=device)
        kv = (blocks.unsqueeze(-1) * kv_block + within).flatten(-2)  # [B, H, QB, N]
        self.kv_valid = listed.repeat_interleave(kv_block, -1) & (kv < kv_length)
        self.kv = kv.clamp(max=kv_length - 1)  # a masked slot reads a real key
        q = torch.arange(self.q_blocks * self.q_block, device=device).view(self.q_blocks, -1)
        self.q_valid = q < length
        self.q = q.clamp(max=length - 1)
        self.b = torch.arange(batch, device=device)
        self.h = torch.arange(heads, device=device)
        self.length = length

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, L, D] -> [B, H, QB, Q_BLOCK_SIZE, D], padded with zeros past L."""
        pad = self.q_blocks * self.q_block - x.shape[2]
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
        return x.unflatten(2, (self.q_blocks, self.q_block))

    def unrows(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of ``rows`` (also for [B, H, QB, Q_BLOCK_SIZE])."""
        return x.flatten(2, 3)[:, :, : self.length]

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, S, D] -> the listed blocks' rows, [B, H, QB, N, D]."""
        b = self.b.view(-1, 1, 1, 1)
        h = self.h.view(1, -1, 1, 1)
        return x[b, h, self.kv]

    def add_back(self, gathered: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Sum [B, H, QB, N, D] rows of ``keys`` back into a [B, H, S, D] like ``like``."""
        batch, heads, kv_length, d = like.shape
        flat = (self.b.view(-1, 1, 1, 1) * heads + self.h.view(1, -1, 1, 1)) * kv_length + self.kv
        out = torch.zeros(batch * heads * kv_length, d, dtype=gathered.dtype, device=like.device)
        out.index_add_(0, flat.reshape(-1), gathered.reshape(-1, d))
        return out.view(batch, heads, kv_length, d)

    def valid(self) -> torch.Tensor:
        """[B, H, QB, Q_BLOCK_SIZE, N]: a real query and a listed key."""
        return self.kv_valid.unsqueeze(-2) & self.q_valid.view(1, 1, self.q_blocks, -1, 1)


def _vmap_gathered(fn, scores: bool, extra: int = 0, buffers: int = 0, out_dims=0):
    """``fn(score?, b, h, q_idx, kv_idx, *extra, *buffers)`` on scalars, vmapped over
    the gathered layout: score and extra [B, H, QB, Q_BLOCK_SIZE, N], b [B], h [H],
    q_idx [QB, Q_BLOCK_SIZE], kv_idx [B, H, QB, N] (torch's ``_vmap_for_bhqkv``, for
    key positions that differ per query block)."""
    # Innermost level first: for (b, h, q_idx, kv_idx).
    levels = [
        (None, None, None, 0),  # N
        (None, None, 0, None),  # Q_BLOCK_SIZE
        (None, None, 0, 0),  # QB
        (None, 0, None, 0),  # H
        (0, None, None, 0),  # B
    ]
    for dims in levels:
        in_dims = ((0,) if scores else ()) + dims + (0,) * extra + (None,) * buffers
        fn = torch.vmap(fn, in_dims=in_dims, out_dims=out_dims)
    return fn


def _scores(query, key, score_mod, block_mask, scale, at, score_buffers, mask_buffers):
    """(scores, scores after score_mod and the masks), both [B, H, QB, Q_BLOCK_SIZE, N]
    in torch's working precision, the mask kept, and the gathered keys."""
    precision = torch.float64 if query.dtype == torch.float64 else torch.float32
    keys = at.keys(key)
    scores = at.rows(query).to(precision) @ keys.to(precision).transpose(-2, -1)
    score_mod = _vmap_gathered(score_mod, True, buffers=len(score_buffers))
    mask_mod = _vmap_gathered(block_mask[-1], False, buffers=len(mask_buffers))
    with TransformGetItemToIndex():
        scores = (scores * scale).to(precision)
        keep = mask_mod(at.b, at.h, at.q, at.kv, *mask_buffers) & at.valid()
        modded = score_mod(scores, at.b, at.h, at.q, at.kv, *score_buffers)
        minus_inf = torch.tensor(-math.inf, dtype=precision, device=scores.device)
        return scores, torch.where(keep, modded, minus_inf), keep, keys


def _heads_and_batch(query, key, value):
    """key and value with query's heads (GQA) and batch, as torch's dense path has them."""
    groups = query.size(1) // key.size(1)
    key = torch.repeat_interleave(key, groups, dim=1)
    value = torch.repeat_interleave(value, groups, dim=1)
    if not (query.size(0) == key.size(0) or (query.size(0) > 1 and key.size(0) == 1)):
        raise RuntimeError(f"Bq and Bkv must broadcast. Got Bq={query.size(0)} and Bkv={key.size(0)}")
    return key.expand((query.size(0), *key.shape[1:])), value.expand((query.size(0), *value.shape[1:]))


def forward(query, key, value, score_mod, block_mask, scale, kernel_options, score_buffers=(), mask_buffers=()):
    """The flex_attention op's (out, log2-sum-exp, log2 max score), torch's dense
    implementation's results, from the listed blocks only (or by it, where those are
    not known or would not pay)."""
    splash = _splash_blocks(query, key, value, score_mod, block_mask, kernel_options)
    if splash is not None:
        most = splash[0]
        out, lse, top = flex_splash.forward(query, key, value, block_mask, scale, most, mask_buffers)
        return _hop._permute_strides(out, query.stride()), lse, top
    most = blocks_to_visit(block_mask, key.size(2), query.dtype)
    if most is None:
        return _hop.sdpa_dense(
            query, key, value, score_mod, block_mask, scale, kernel_options, score_buffers, mask_buffers
        )
    key, value = _heads_and_batch(query, key, value)
    if most == LOOP:
        out, lse, top = flex_loop.forward(
            query, key, value, score_mod, block_mask, scale, score_buffers, mask_buffers, _vmap_gathered
        )
        out = _hop._permute_strides(tensor_of(out, query.dtype), query.stride())
        lse, top = (tensor_of(flex_loop.log2(x), torch.float32) for x in (lse, top))
        return out, lse, top
    at = _Gathered(block_mask, most, query.shape[:3], key.size(2))
    _, modded, _, _ = _scores(query, key, score_mod, block_mask, scale, at, score_buffers, mask_buffers)
    lse = modded.logsumexp(-1)
    lse = torch.where(torch.all(modded == -math.inf, dim=-1), -math.inf, lse)
    max_scores = modded.max(-1)[0]
    weights = torch._safe_softmax(modded, dim=-1)
    out = weights.to(query.dtype) @ at.keys(value).to(query.dtype)
    out = _hop._permute_strides(at.unrows(out), query.stride())
    return out, at.unrows(lse) / math.log(2), at.unrows(max_scores) / math.log(2)


def backward(
    query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
    block_mask, scale, kernel_options, score_buffers, mask_buffers, dense,
):  # fmt: skip
    """The flex_attention_backward op's (grad q, grad k, grad v, grads of score_mod's
    captured tensors), from the listed blocks only; ``dense`` where they are not known
    or would not pay."""
    splash = _splash_blocks(
        query, key, value, fw_graph, block_mask, kernel_options, grad_logsumexp, backward=True
    )
    if splash is not None:
        most, most_t = splash
        grads = flex_splash.backward(
            grad_out, query, key, value, block_mask, scale, most, most_t, mask_buffers
        )
        strides = (query.stride(), key.stride(), value.stride())
        grads = tuple(_hop._permute_strides(g, s) for g, s in zip(grads, strides))
        return (*grads, tuple(None for _ in score_buffers))
    most = blocks_to_visit(block_mask, key.size(2), query.dtype)
    if most is None:
        return dense(
            query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
            block_mask, scale, kernel_options, score_buffers, mask_buffers,
        )  # fmt: skip
    if query.dtype != key.dtype or query.dtype != value.dtype:
        raise ValueError(
            "Backward pass with mixed query, key, and value dtype is not supported, got "
            f"query.dtype={query.dtype}, key.dtype={key.dtype}, and value.dtype={value.dtype}"
        )
    if joint_graph is None:
        examples = (query.new_zeros((), requires_grad=True),) + tuple(
            query.new_zeros((), dtype=torch.int) for _ in range(4)
        )
        _, joint_graph = _hop.create_fw_bw_graph(fw_graph, examples, score_buffers)
    kv_batch, kv_heads = key.size(0), key.size(1)
    key_in, value_in = key, value
    key, value = _heads_and_batch(query, key, value)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    if grad_logsumexp is None:
        grad_logsumexp = torch.zeros_like(logsumexp)
    args = (
        query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
        block_mask, scale, score_buffers, mask_buffers,
    )  # fmt: skip
    if most == LOOP:
        grad_query, grad_key, grad_value, grad_captured = _looped_backward(*args)
    else:
        grad_query, grad_key, grad_value, grad_captured = _gathered_backward(most, *args)

    groups = query.size(1) // kv_heads
    grad_key = grad_key.unflatten(1, (kv_heads, groups)).sum(2)
    grad_value = grad_value.unflatten(1, (kv_heads, groups)).sum(2)
    if query.size(0) != kv_batch:
        grad_key = grad_key.sum(0, keepdim=True)
        grad_value = grad_value.sum(0, keepdim=True)
    grad_query = _hop._permute_strides(grad_query.to(query.dtype), query.stride())
    grad_key = _hop._permute_strides(grad_key.to(key_in.dtype), key_in.stride())
    grad_value = _hop._permute_strides(grad_value.to(value_in.dtype), value_in.stride())
    captured = tuple(
        torch.empty_like(b, memory_format=torch.contiguous_format).copy_(g)
        if want and g is not None
        else None
        for b, g, want in zip(score_buffers, grad_captured, _gradients_wanted(joint_graph, score_buffers))
    )
    return grad_query, grad_key, grad_value, captured


def gradients_computed(joint_graph, count: int) -> list:
    """Per captured tensor, whether score_mod's joint graph returns its gradient (its
    last ``count`` outputs; None where the tensor needed none when it was traced)."""
    if joint_graph is None or not count:
        return [False] * count
    output = next(n for n in joint_graph.graph.nodes if n.op == "output")
    return [o is not None for o in output.args[0][-count:]]


def _gradients_wanted(joint_graph, buffers) -> list:
    """Per captured tensor, whether the op returns its gradient: where it requires one;
    in a trace, whose tensors never do, where score_mod's joint graph computes one (the
    program traced needs those its joint graph was made for)."""
    if tracing.active() is not None:
        return gradients_computed(joint_graph, len(buffers))
    return [isinstance(b, torch.Tensor) and b.requires_grad for b in buffers]


def _looped_backward(
    query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
    block_mask, scale, score_buffers, mask_buffers,
):  # fmt: skip
    """`_gathered_backward`'s results from a loop in the program (flex_loop.py)."""
    # logsumexp and its gradient in log2 (the forward op's), back to natural logs.
    lse = materialize(logsumexp) * math.log(2)
    grad_lse = materialize(grad_logsumexp) / math.log(2)
    grads = flex_loop.backward(
        query, key, value, out, lse, grad_out, grad_lse, fw_graph, joint_graph,
        block_mask, scale, score_buffers, mask_buffers, _vmap_gathered,
        _gradients_wanted(joint_graph, score_buffers),
    )  # fmt: skip
    grad_query, grad_key, grad_value = (tensor_of(g, torch.float32) for g in grads[:3])
    captured = [None if g is None else tensor_of(g, torch.float32) for g in grads[3]]
    return grad_query, grad_key, grad_value, captured


def _gathered_backward(
    most, query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
    block_mask, scale, score_buffers, mask_buffers,
):  # fmt: skip
    """(grad q, grad k, grad v with the query's batch and heads, the gradients of
    score_mod's captured tensors) from the ``most`` listed blocks, gathered at once."""
    at = _Gathered(block_mask, most, query.shape[:3], key.size(2))
    # logsumexp and its gradient in log2 (the forward op's), back to natural logs.
    logsumexp = at.rows(logsumexp.unsqueeze(-1)).squeeze(-1) * math.log(2)
    grad_logsumexp = at.rows(grad_logsumexp.unsqueeze(-1)).squeeze(-1) / math.log(2)
    scores, modded, keep, keys = _scores(
        query, key, fw_graph, block_mask, scale, at, score_buffers, mask_buffers
    )
    weights = torch.exp(modded - logsumexp.unsqueeze(-1))
    weights = torch.where((logsumexp == -math.inf).unsqueeze(-1), 0, weights)

    values = at.keys(value)
    grad_rows = at.rows(grad_out)
    grad_value = at.add_back(weights.to(query.dtype).transpose(-2, -1) @ grad_rows, value)
    grad_weights = grad_rows.to(weights.dtype) @ values.to(weights.dtype).transpose(-2, -1)
    out_dot_grad = (at.rows(out).to(weights.dtype) * grad_rows.to(weights.dtype)).sum(-1, keepdim=True)
    grad_modded = weights * (grad_weights - out_dot_grad + grad_logsumexp.unsqueeze(-1))

    joint = _vmap_gathered(
        joint_graph, True, extra=1, buffers=len(score_buffers),
        out_dims=[0, None, None, None, None] + [None] * len(score_buffers),
    )  # fmt: skip
    with TransformGetItemToIndex():
        grad_scores, _, _, _, _, *grad_captured = joint(
            scores, at.b, at.h, at.q, at.kv, grad_modded, *score_buffers
        )
    grad_scores = torch.where(keep, (grad_scores * scale).to(query.dtype), 0)
    grad_query = at.unrows(grad_scores @ keys)
    grad_key = at.add_back(grad_scores.transpose(-2, -1) @ at.rows(query), key)
    return grad_query, grad_key, grad_value, grad_captured
