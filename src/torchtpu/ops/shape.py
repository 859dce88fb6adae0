"""Ops that rearrange or combine tensors: cat, stack, pad, repeat, flip, roll, ...
(view ops are in views.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from torchtpu.ops.registry import aten, lowers
from torchtpu.ops.util import canonical_dim


@lowers(aten.cat.default, promote="no_opmath", promote_args=("tensors",))
def cat(tensors, dim=0):
    # torch skips 1-d empty tensors in cat, whatever the other shapes (legacy rule).
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        return tensors[0]
    return jnp.concatenate(kept, axis=canonical_dim(dim, kept[0].ndim))


@lowers(aten.stack.default, promote="no_opmath", promote_args=("tensors",))
def stack(tensors, dim=0):
    return jnp.stack(tensors, axis=canonical_dim(dim, tensors[0].ndim + 1))


@lowers(aten.constant_pad_nd.default)
def constant_pad_nd(self, pad, value=0):
    config = [(0, 0, 0)] * self.ndim
    for i in range(len(pad) // 2):
        dim = self.ndim - 1 - i
        config[dim] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(self, jnp.asarray(value, self.dtype), config)


def _pad_mode(self, padding, mode):
    # Output position i of a dim reads input position i - before, clamped ("edge") or
    # reflected ("reflect") into range -- which also covers negative paddings.
    for i in range(len(padding) // 2):
        dim = self.ndim - 1 - i
        before, after = padding[2 * i], padding[2 * i + 1]
        n = self.shape[dim]
        source = jnp.arange(n + before + after) - before
        if mode == "edge":
            source = jnp.clip(source, 0, n - 1)
        else:
            source = (n - 1) - jnp.abs((n - 1) - jnp.abs(source))
        self = jnp.take(self, source, axis=dim)
    return self


@lowers(aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default)
def reflection_pad(self, padding):
    return _pad_mode(self, padding, "reflect")


@lowers(
    aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default
)
def replication_pad(self, padding):
    return _pad_mode(self, padding, "edge")


@lowers(
    aten.reflection_pad1d_backward.default,
    aten.reflection_pad2d_backward.default,
    aten.reflection_pad3d_backward.default,
)
def reflection_pad_backward(grad_output, self, padding):
    _, vjp = jax.vjp(lambda x: _pad_mode(x, padding, "reflect"), self)
    return vjp(grad_output)[0]


@lowers(
    aten.replication_pad1d_backward.default,
    aten.replication_pad2d_backward.default,
    aten.replication_pad3d_backward.default,
)
def replication_pad_backward(grad_output, self, padding):
    _, vjp = jax.vjp(lambda x: _pad_mode(x, padding, "edge"), self)
    return vjp(grad_output)[0]


@lowers(aten.repeat.default)
def repeat(self, repeats):
    lead = len(repeats) - self.ndim
    x = self.reshape((1,) * lead + self.shape)
    return jnp.tile(x, tuple(repeats))


@lowers(aten.flip.default)
def flip(self, dims):
    if self.ndim == 0:
        return self
    return jnp.flip(self, axis=tuple(canonical_dim(d, self.ndim) for d in dims))


@lowers(aten.roll.default)
def roll(self, shifts, dims=()):
    if not dims:
        return jnp.roll(self.reshape(-1), shifts[0]).reshape(self.shape)
    return jnp.roll(self, tuple(shifts), axis=tuple(canonical_dim(d, self.ndim) for d in dims))


@lowers(aten.rot90.default)
def rot90(self, k=1, dims=(0, 1)):
    return jnp.rot90(self, k, axes=tuple(canonical_dim(d, self.ndim) for d in dims))


@lowers(aten.diag_embed.default)
def diag_embed(self, offset=0, dim1=-2, dim2=-1):
    n = self.shape[-1] + abs(offset)
    out_ndim = self.ndim + 1
    d1, d2 = canonical_dim(dim1, out_ndim), canonical_dim(dim2, out_ndim)
    rows = jnp.arange(self.shape[-1]) + max(-offset, 0)
    cols = jnp.arange(self.shape[-1]) + max(offset, 0)
    full = jnp.zeros(self.shape[:-1] + (n, n), self.dtype).at[..., rows, cols].set(self)
    # `full` has the two new dims last; move them to dim1, dim2.
    rest = [i for i in range(out_ndim) if i not in (d1, d2)]
    order = [0] * out_ndim
    for position, source in zip(rest + [d1, d2], range(out_ndim)):
        order[position] = source
    return jnp.transpose(full, order)


@lowers(aten.trace.default, compute_in_result=("self",))
def trace(self):
    return jnp.trace(self)
