"""FlexAttention inside a compiled program: a loop over the slots of a block mask's lists.

Note [Blockwise FlexAttention in a trace]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Eagerly, the listed blocks are gathered at once (flex_blocks.py), which needs K, the
most blocks any query block lists, as a number when the op's program is built: a read
of the device. Inside a compiled graph or a ``torchtpu.jit`` step the block mask's
lists are values of the program, known only when it runs. So the program loops
instead (``lax.while_loop``) over the slots j = 0, 1, ... of the lists, as many times
as the most any query block lists -- a count the program computes. Iteration j scores
every query block against the j-th block its lists name (a block of ``kv_indices``,
then of ``full_kv_indices``; past a list's end, nothing) and folds those scores into a
running maximum, sum and output per query (flash attention's online softmax). Each
iteration holds [B, H, L, KV_BLOCK_SIZE] scores instead of the [B, H, L, S] of torch's
dense implementation: a sliding window over 8k tokens no longer costs an 8k x 8k
matrix. The backward loops the same way, recomputing each slot's scores from the
forward's log-sum-exp, and adds the keys' and values' gradients into place.

score_mod and mask_mod are torch code: each iteration runs them on tpu tensors holding
the iteration's values (vmapped as flex_blocks.py vmaps them), so they are traced into
the loop's body. The value checks their ops state there (an index out of range) are
or-ed over the iterations and become the program's checks, as any traced op's are
(`_TorchStep`). A score_mod that draws random numbers is refused by torch's vmap
before it could be (one draw per iteration would not be the op's draw).
"""

from __future__ import annotations

import math

import torch
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

from torchtpu import matmul_precision as _precision
from torchtpu import tracing
from torchtpu.compile.program import tensor_of
from torchtpu.dispatch.values import materialize
from torchtpu.runtime import jax


class _Slots:
    """A block mask's lists as the program's arrays: which keys slot j of every query
    block scores."""

    def __init__(self, block_mask: tuple, shape: tuple, kv_length: int):
        jnp = jax().numpy
        batch, heads, length = shape
        kv_num, kv_indices, full_num, full_indices = block_mask[2:6]
        self.q_block, self.kv_block = block_mask[-3], block_mask[-2]
        self.q_blocks = kv_num.shape[-1]
        size = (batch, heads, self.q_blocks)
        self.partial_count = jnp.broadcast_to(materialize(kv_num), size).astype(jnp.int32)
        self.partial = jnp.broadcast_to(materialize(kv_indices), size + kv_indices.shape[-1:])
        if full_num is None:
            self.full_count, self.full = jnp.zeros(size, jnp.int32), None
        else:
            self.full_count = jnp.broadcast_to(materialize(full_num), size).astype(jnp.int32)
            self.full = jnp.broadcast_to(materialize(full_indices), size + full_indices.shape[-1:])
        # The loop's trip count: the most blocks any query block lists.
        self.count = jnp.max(self.partial_count + self.full_count)
        self.length, self.kv_length = length, kv_length
        self.b = jnp.arange(batch).reshape(-1, 1, 1, 1)
        self.h = jnp.arange(heads).reshape(1, -1, 1, 1)
        rows = jnp.arange(self.q_blocks * self.q_block).reshape(self.q_blocks, self.q_block)
        self.q_valid = (rows < length)[None, None, :, :, None]  # [1, 1, QB, Q_BLOCK, 1]

    def keys_at(self, j):
        """(key positions [B, H, QB, KV_BLOCK], clamped to real keys; whether each is a
        listed, real key) of slot ``j``."""
        jnp = jax().numpy
        block = _slot(self.partial, j)
        if self.full is not None:
            block = jnp.where(j < self.partial_count, block, _slot(self.full, j - self.partial_count))
        listed = j < self.partial_count + self.full_count
        positions = block.astype(jnp.int32)[..., None] * self.kv_block + jnp.arange(self.kv_block)
        valid = listed[..., None] & (positions < self.kv_length)
        return jnp.minimum(positions, self.kv_length - 1), valid

    def indices(self):
        """(b [B], h [H], q_idx [QB, Q_BLOCK]) as the int64 tpu tensors score_mod and
        mask_mod take; a padded query's index is the last real one (it is masked)."""
        jnp = jax().numpy
        rows = jnp.arange(self.q_blocks * self.q_block).reshape(self.q_blocks, self.q_block)
        q = jnp.minimum(rows, self.length - 1)
        return tuple(
            tensor_of(x.reshape(-1).astype(jnp.int64), torch.int64) for x in (self.b, self.h)
        ) + (tensor_of(q.astype(jnp.int64), torch.int64),)

    def slot_specs(self, batch: int, heads: int) -> tuple:
        """The shapes of one slot's (scores, key positions, valid) arrays."""
        jnp, spec = jax().numpy, jax().ShapeDtypeStruct
        keys = (batch, heads, self.q_blocks, self.kv_block)
        scores = (batch, heads, self.q_blocks, self.q_block, self.kv_block)
        return spec(scores, jnp.float32), spec(keys, jnp.int32), spec(keys, jnp.bool_)

    def rows(self, x):
        """[B, H, L, D] -> [B, H, QB, Q_BLOCK, D], padded with zeros past L."""
        jnp = jax().numpy
        pad = self.q_blocks * self.q_block - x.shape[2]
        if pad:
            x = jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))
        return x.reshape(x.shape[:2] + (self.q_blocks, self.q_block, x.shape[-1]))

    def unrows(self, x):
        """The inverse of ``rows`` (also for [B, H, QB, Q_BLOCK])."""
        x = x.reshape(x.shape[:2] + (-1,) + x.shape[4:])
        return x[:, :, : self.length]

    def gather(self, x, positions):
        """[B, H, S, D] -> the rows at ``positions``: [B, H, QB, KV_BLOCK, D]."""
        return x[self.b, self.h, positions]

    def add_at(self, total, positions, rows):
        """``total`` [B, H, S, D] with [B, H, QB, KV_BLOCK, D] ``rows`` added at ``positions``."""
        return total.at[self.b, self.h, positions].add(rows)


def _slot(lists, j):
    """lists[..., j] per query block, j an array of the lists' leading shape (or a
    number); a j past the lists' end reads their last slot (masked by the caller)."""
    jnp = jax().numpy
    j = jnp.clip(jnp.broadcast_to(j, lists.shape[:-1]), 0, lists.shape[-1] - 1)
    return jnp.take_along_axis(lists, j[..., None].astype(jnp.int32), axis=-1)[..., 0]


class _TorchStep:
    """A function of JAX arrays that runs torch code on tpu tensors inside a loop's body:
    its value checks become flags the loop carries (Note [Blockwise FlexAttention in a
    trace]). `shapes` runs it abstractly first: the flags' count and meanings, and which
    of its outputs are None, are known before the loop is built."""

    def __init__(self, fn):
        self.fn = fn
        self.infos: list = []

    def __call__(self, *arrays):
        # No random draws to account for: torch's vmap, which applies score_mod and
        # mask_mod, refuses random ops ("randomness error mode").
        trace = tracing.active()
        checks = len(trace.checks)
        out = self.fn(*arrays)
        stated = trace.checks[checks:]
        del trace.checks[checks:]
        self.infos = [info for _, *info in stated]
        return out, tuple(flag for flag, *_ in stated)

    def shapes(self, *arrays):
        return jax().eval_shape(self, *arrays)

    def file(self, flags) -> None:
        """After the loop: its or-ed flags become the program's checks."""
        tracing.active().checks.extend((flag, *info) for flag, info in zip(flags, self.infos))


def _mods(score_mod, block_mask, slots: _Slots, score_buffers, mask_buffers, vmapped):
    """A function of (scores, key positions, valid) arrays of one slot: (scores after
    score_mod with the masked ones -inf, the kept mask), score_mod and mask_mod run as
    torch code."""
    jnp = jax().numpy
    score_mod = vmapped(score_mod, True, buffers=len(score_buffers))
    mask_mod = vmapped(block_mask[-1], False, buffers=len(mask_buffers))
    b, h, q = slots.indices()

    def mods(scores, positions, valid):
        kv = tensor_of(positions.astype(jnp.int64), torch.int64)
        with TransformGetItemToIndex():
            keep = mask_mod(b, h, q, kv, *mask_buffers)
            modded = score_mod(tensor_of(scores, torch.float32), b, h, q, kv, *score_buffers)
        keep = materialize(keep) & valid[:, :, :, None, :] & slots.q_valid
        return jnp.where(keep, materialize(modded).astype(jnp.float32), -jnp.inf), keep

    return mods


def _scores(rows, keys, scale, precision):
    """[B, H, QB, Q_BLOCK, KV_BLOCK] float32 scores of query rows against gathered keys."""
    jnp = jax().numpy
    f32 = jnp.float32
    s = jnp.einsum("bhqie,bhqke->bhqik", rows.astype(f32), keys.astype(f32), precision=precision)
    return s * jnp.asarray(scale, f32)


def forward(query, key, value, score_mod, block_mask, scale, score_buffers, mask_buffers, vmapped):
    """(out, log-sum-exp, max score) arrays, natural logs: out [B, H, L, Ev] in the
    query's dtype, the others [B, H, L] float32; key and value have the query's batch
    and heads."""
    jnp, lax = jax().numpy, jax().lax
    slots = _Slots(block_mask, tuple(query.shape[:3]), key.size(2))
    q, k, v = materialize(query), materialize(key), materialize(value)
    precision = _precision.lax_precision(_precision.current())
    rows = slots.rows(q)
    step = _TorchStep(_mods(score_mod, block_mask, slots, score_buffers, mask_buffers, vmapped))
    batch, heads = q.shape[:2]
    blocks = (batch, heads, slots.q_blocks, slots.q_block)
    _, flag_shapes = step.shapes(*slots.slot_specs(batch, heads))
    dtype = q.dtype

    def body(carry):
        j, top, total, out, flags = carry
        positions, valid = slots.keys_at(j)
        scores = _scores(rows, slots.gather(k, positions), scale, precision)
        (modded, _), new_flags = step(scores, positions, valid)
        new_top = jnp.maximum(top, modded.max(-1))
        shift = jnp.where(new_top == -jnp.inf, 0.0, new_top)
        weights = jnp.exp(modded - shift[..., None])  # 0 where masked
        rescale = jnp.exp(top - shift)
        total = total * rescale + weights.sum(-1)
        values = slots.gather(v, positions)
        out = out * rescale[..., None] + jnp.einsum(
            "bhqik,bhqkv->bhqiv", weights.astype(dtype), values.astype(dtype),
            precision=precision, preferred_element_type=jnp.float32,
        )  # fmt: skip
        flags = tuple(a | b for a, b in zip(flags, new_flags))
        return j + 1, new_top, total, out, flags

    start = (
        jnp.int32(0),
        jnp.full(blocks, -jnp.inf, jnp.float32),
        jnp.zeros(blocks, jnp.float32),
        jnp.zeros(blocks + (v.shape[-1],), jnp.float32),
        tuple(jnp.zeros(f.shape, f.dtype) for f in flag_shapes),
    )
    _, top, total, out, flags = lax.while_loop(lambda c: c[0] < slots.count, body, start)
    step.file(flags)
    seen = total > 0
    out = jnp.where(seen[..., None], out / jnp.where(seen, total, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    return slots.unrows(out).astype(dtype), slots.unrows(lse), slots.unrows(top)


def backward(
    query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
    block_mask, scale, score_buffers, mask_buffers, vmapped, wanted,
):  # fmt: skip
    """(grad q, grad k, grad v) float32 arrays with the query's batch and heads, and the
    gradients of score_mod's captured tensors (arrays, or None where ``wanted`` says
    none). logsumexp and its gradient are in natural logs; key and value have the
    query's batch and heads."""
    jnp, lax = jax().numpy, jax().lax
    slots = _Slots(block_mask, tuple(query.shape[:3]), key.size(2))
    q, k, v = materialize(query), materialize(key), materialize(value)
    precision = _precision.lax_precision(_precision.current())
    f32 = jnp.float32
    rows = slots.rows(q)
    grad_rows = slots.rows(materialize(grad_out)).astype(f32)
    lse = slots.rows(logsumexp[..., None])[..., 0]
    grad_lse = slots.rows(grad_logsumexp[..., None])[..., 0]
    out_dot_grad = (slots.rows(materialize(out)).astype(f32) * grad_rows).sum(-1)
    mods = _mods(fw_graph, block_mask, slots, score_buffers, mask_buffers, vmapped)
    joint = vmapped(
        joint_graph, True, extra=1, buffers=len(score_buffers),
        out_dims=[0, None, None, None, None] + [None] * len(score_buffers),
    )  # fmt: skip
    b, h, q_index = slots.indices()

    def slot_gradients(scores, positions, valid):
        """(the weights, the gradient of each score, the gradients of score_mod's
        captured tensors) of one slot."""
        modded, keep = mods(scores, positions, valid)
        weights = jnp.where((lse == -jnp.inf)[..., None], 0.0, jnp.exp(modded - lse[..., None]))
        values = slots.gather(v, positions).astype(f32)
        grad_weights = jnp.einsum("bhqiv,bhqkv->bhqik", grad_rows, values, precision=precision)
        grad_modded = weights * (grad_weights - out_dot_grad[..., None] + grad_lse[..., None])
        kv = tensor_of(positions.astype(jnp.int64), torch.int64)
        with TransformGetItemToIndex():
            grad_scores, _, _, _, _, *captured = joint(
                tensor_of(scores, torch.float32), b, h, q_index, kv,
                tensor_of(grad_modded, torch.float32), *score_buffers,
            )  # fmt: skip
        captured = [
            materialize(g).astype(f32) if want and g is not None else None
            for g, want in zip(captured, wanted)
        ]
        grad_scores = jnp.where(keep, materialize(grad_scores).astype(f32) * scale, 0.0)
        return weights, grad_scores, captured

    step = _TorchStep(slot_gradients)
    batch, heads = q.shape[:2]
    blocks = (batch, heads, slots.q_blocks, slots.q_block)
    (_, _, captured_shapes), flag_shapes = step.shapes(*slots.slot_specs(batch, heads))

    def body(carry):
        j, grad_q, grad_k, grad_v, grad_captured, flags = carry
        positions, valid = slots.keys_at(j)
        keys = slots.gather(k, positions).astype(f32)
        scores = _scores(rows, keys, scale, precision)
        (weights, grad_scores, captured), new_flags = step(scores, positions, valid)
        grad_v = slots.add_at(
            grad_v, positions,
            jnp.einsum("bhqik,bhqiv->bhqkv", weights, grad_rows, precision=precision),
        )  # fmt: skip
        grad_q = grad_q + jnp.einsum("bhqik,bhqke->bhqie", grad_scores, keys, precision=precision)
        grad_k = slots.add_at(
            grad_k, positions,
            jnp.einsum("bhqik,bhqie->bhqke", grad_scores, rows.astype(f32), precision=precision),
        )  # fmt: skip
        grad_captured = tuple(
            total if g is None else total + g for total, g in zip(grad_captured, captured)
        )
        flags = tuple(a | b for a, b in zip(flags, new_flags))
        return j + 1, grad_q, grad_k, grad_v, grad_captured, flags

    start = (
        jnp.int32(0),
        jnp.zeros(blocks + (q.shape[-1],), f32),
        jnp.zeros(k.shape, f32),
        jnp.zeros(v.shape, f32),
        tuple(None if s is None else jnp.zeros(s.shape, f32) for s in captured_shapes),
        tuple(jnp.zeros(f.shape, f.dtype) for f in flag_shapes),
    )
    _, grad_q, grad_k, grad_v, grad_captured, flags = lax.while_loop(
        lambda c: c[0] < slots.count, body, start
    )
    step.file(flags)
    return slots.unrows(grad_q), grad_k, grad_v, list(grad_captured)


def log2(x):
    """Natural logs to the flex_attention op's base 2."""
    return x / math.log(2)
