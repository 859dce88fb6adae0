"""Indexing: advanced indexing, gather/scatter, index_* ops, masks.

Index values are checked (checks.py): an index out of range raises torch's exception
type at the next read of values, never a silently clamped result.
"""

from __future__ import annotations

import jax.numpy as jnp

from torchtpu.checks import error_if
from torchtpu.ops.registry import aten, lowers
from torchtpu.ops.util import canonical_dim, cast


def _check_bounds(index, size, dim, exc=IndexError, message=None):
    error_if(
        jnp.any((index < -size) | (index >= size)),
        exc,
        message or f"index is out of bounds for dimension {dim} with size {size}",
    )


def _index_tuple(self, indices):
    """torch's index list as a numpy-style index: None becomes a full slice."""
    out = []
    for dim, index in enumerate(indices):
        if index is None:
            out.append(slice(None))
            continue
        if index.dtype == jnp.bool_ or index.dtype == jnp.uint8:
            raise NotImplementedError("boolean indices reach the lowering only as integer indices")
        _check_bounds(index, self.shape[dim], dim)
        out.append(index)
    return tuple(out)


@lowers(aten.index.Tensor)
def index(self, indices):
    return self[_index_tuple(self, indices)]


@lowers(aten._unsafe_index.Tensor)
def _unsafe_index(self, indices):
    return self[tuple(slice(None) if i is None else i for i in indices)]


@lowers(aten.index_put.default)
def index_put(self, indices, values, accumulate=False):
    where = _index_tuple(self, indices)
    values = cast(values, self.dtype)
    return self.at[where].add(values) if accumulate else self.at[where].set(values)


@lowers(aten._unsafe_index_put.default)
def _unsafe_index_put(self, indices, values, accumulate=False):
    where = tuple(slice(None) if i is None else i for i in indices)
    values = cast(values, self.dtype)
    return self.at[where].add(values) if accumulate else self.at[where].set(values)


@lowers(aten._index_put_impl_.default)
def _index_put_impl_(self, indices, values, accumulate=False, unsafe=False):
    return index_put(self, indices, values, accumulate)


@lowers(aten.index_select.default)
def index_select(self, dim, index):
    if self.ndim == 0:
        _check_bounds(index, 1, 0, message="index out of range in self")
        return jnp.broadcast_to(self, index.shape).reshape(index.shape or ())
    dim = canonical_dim(dim, self.ndim)
    _check_bounds(index, self.shape[dim], dim, message="index out of range in self")
    return jnp.take(self, index.reshape(-1), axis=dim)


def _along(self, dim, index):
    """Full index tuple addressing self[..., index[...], ...] at every position of index."""
    dim = canonical_dim(dim, self.ndim)
    grids = jnp.meshgrid(*[jnp.arange(n) for n in index.shape], indexing="ij")
    return tuple(index if d == dim else grids[d] for d in range(index.ndim)), dim


@lowers(aten.gather.default)
def gather(self, dim, index, sparse_grad=False):
    if self.ndim == 0:
        return jnp.broadcast_to(self, index.shape)
    dim = canonical_dim(dim, self.ndim)
    _check_bounds(index, self.shape[dim], dim, exc=RuntimeError)
    where, _ = _along(self, dim, index)
    return self[where]


def _scatter(self, dim, index, src, mode):
    if self.ndim == 0:
        where = ()
        src = jnp.reshape(src, ()) if jnp.ndim(src) else src
    else:
        dim = canonical_dim(dim, self.ndim)
        _check_bounds(index, self.shape[dim], dim, exc=RuntimeError)
        where, _ = _along(self, dim, index)
        if jnp.ndim(src):
            src = src[tuple(slice(0, n) for n in index.shape)]
        else:
            src = jnp.broadcast_to(src, index.shape)
    src = cast(src, self.dtype)
    ref = self.at[where]
    if mode == "set":
        return ref.set(src)
    if mode in ("add", "sum"):
        return ref.add(src)
    if mode in ("multiply", "prod"):
        return ref.multiply(src)
    if mode == "amax":
        return ref.max(src)
    if mode == "amin":
        return ref.min(src)
    raise RuntimeError(f"reduce argument must be either add or multiply, got {mode}")


@lowers(aten.scatter.src, aten.scatter.value)
def scatter(self, dim, index, src):
    return _scatter(self, dim, index, src, "set")


@lowers(aten.scatter.reduce, aten.scatter.value_reduce)
def scatter_reduce_legacy(self, dim, index, src, reduce):
    return _scatter(self, dim, index, src, reduce)


@lowers(aten.scatter_add.default)
def scatter_add(self, dim, index, src):
    return _scatter(self, dim, index, src, "add")


@lowers(aten.scatter_reduce.two)
def scatter_reduce(self, dim, index, src, reduce, include_self=True):
    if self.ndim == 0 or index.size == 0:
        return self
    dim = canonical_dim(dim, self.ndim)
    _check_bounds(index, self.shape[dim], dim, exc=RuntimeError)
    where, _ = _along(self, dim, index)
    src = cast(src[tuple(slice(0, n) for n in index.shape)], self.dtype)
    touched = jnp.zeros(self.shape, bool).at[where].set(True)
    if reduce == "mean":
        total = jnp.where(touched & ~include_self, 0, self).astype(self.dtype).at[where].add(src)
        count = jnp.where(include_self, 1, 0) + jnp.zeros(self.shape, jnp.int64).at[where].add(1)
        count = jnp.where(touched, count, 1)
        mean = total / count.astype(total.dtype) if jnp.issubdtype(self.dtype, jnp.inexact) else total // count
        return jnp.where(touched, mean, self).astype(self.dtype)
    identity = {
        "sum": 0,
        "prod": 1,
        "amax": jnp.finfo(self.dtype).min if jnp.issubdtype(self.dtype, jnp.inexact) else jnp.iinfo(self.dtype).min,
        "amin": jnp.finfo(self.dtype).max if jnp.issubdtype(self.dtype, jnp.inexact) else jnp.iinfo(self.dtype).max,
    }[reduce]
    base = self if include_self else jnp.where(touched, jnp.asarray(identity, self.dtype), self)
    if jnp.issubdtype(self.dtype, jnp.floating) and reduce in ("amax", "amin") and not include_self:
        base = jnp.where(touched, -jnp.inf if reduce == "amax" else jnp.inf, self)
    return _scatter(base, dim, index, src, reduce)


@lowers(aten.index_add.default)
def index_add(self, dim, index, source, alpha=1):
    if self.ndim == 0:
        return self + jnp.sum(source * alpha)
    dim = canonical_dim(dim, self.ndim)
    _check_bounds(index, self.shape[dim], dim, message="index out of range in self")
    where = (slice(None),) * dim + (index,)
    source = cast(source, self.dtype)
    if not (isinstance(alpha, (int, float)) and alpha == 1):
        source = source * cast(alpha, self.dtype)
    return self.at[where].add(source)


@lowers(aten.index_copy.default)
def index_copy(self, dim, index, source):
    if self.ndim == 0:
        return jnp.reshape(source, ())
    dim = canonical_dim(dim, self.ndim)
    _check_bounds(index, self.shape[dim], dim, message="index out of range in self")
    return self.at[(slice(None),) * dim + (index,)].set(cast(source, self.dtype))


@lowers(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(self, dim, index, value):
    if self.ndim == 0:
        return jnp.where(index.size > 0, cast(value, self.dtype), self)
    dim = canonical_dim(dim, self.ndim)
    _check_bounds(index, self.shape[dim], dim, message="index out of range in self")
    return self.at[(slice(None),) * dim + (index,)].set(cast(value, self.dtype))


@lowers(aten.masked_scatter.default)
def masked_scatter(self, mask, source):
    mask = jnp.broadcast_to(mask, self.shape).reshape(-1)
    position = jnp.cumsum(mask) - 1
    error_if(jnp.sum(mask) > source.size, RuntimeError, "masked_scatter: expected source to have at least as many elements as ones in mask")
    picked = source.reshape(-1)[jnp.clip(position, 0, max(source.size - 1, 0))] if source.size else jnp.zeros_like(self.reshape(-1))
    return jnp.where(mask, cast(picked, self.dtype), self.reshape(-1)).reshape(self.shape)


@lowers(aten.take.default)
def take(self, index):
    _check_bounds(index, max(self.size, 0), 0, message="out of range: tried to access index out of bounds")
    return self.reshape(-1)[index]


# -- data-dependent shapes: run op by op on concrete arrays --------------------------------------


@lowers(aten.nonzero.default, dynamic_shape=True)
def nonzero(self):
    if self.ndim == 0:
        return jnp.zeros((1 if bool(self) else 0, 0), jnp.int64)
    return jnp.stack(jnp.nonzero(self), axis=1).astype(jnp.int64)


@lowers(aten.masked_select.default, dynamic_shape=True)
def masked_select(self, mask):
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    return jnp.broadcast_to(self, shape)[jnp.broadcast_to(mask, shape)]


@lowers(aten._unique2.default, dynamic_shape=True)
def _unique2(self, sorted=True, return_inverse=False, return_counts=False):
    values, inverse, counts = jnp.unique(self.reshape(-1), return_inverse=True, return_counts=True)
    return values, inverse.reshape(self.shape).astype(jnp.int64), counts.astype(jnp.int64)


@lowers(aten.unique_dim.default, dynamic_shape=True)
def unique_dim(self, dim, sorted=True, return_inverse=False, return_counts=False):
    dim = canonical_dim(dim, self.ndim)
    values, inverse, counts = jnp.unique(self, axis=dim, return_inverse=True, return_counts=True)
    return values, inverse.reshape(-1).astype(jnp.int64), counts.astype(jnp.int64)


@lowers(aten.unique_consecutive.default, dynamic_shape=True)
def unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    if dim is None:
        flat = self.reshape(-1)
        if flat.size == 0:
            return flat, jnp.zeros(self.shape, jnp.int64), jnp.zeros((0,), jnp.int64)
        change = jnp.concatenate([jnp.ones((1,), bool), flat[1:] != flat[:-1]])
        group = jnp.cumsum(change) - 1
        values = flat[change]
        counts = jnp.bincount(group, length=values.shape[0])
        return values, group.reshape(self.shape).astype(jnp.int64), counts.astype(jnp.int64)
    dim = canonical_dim(dim, self.ndim)
    moved = jnp.moveaxis(self, dim, 0)
    rows = moved.reshape(moved.shape[0], -1)
    change = jnp.concatenate([jnp.ones((1,), bool), jnp.any(rows[1:] != rows[:-1], axis=1)])
    group = jnp.cumsum(change) - 1
    values = jnp.moveaxis(moved[change], 0, dim)
    counts = jnp.bincount(group, length=int(change.sum()))
    return values, group.astype(jnp.int64), counts.astype(jnp.int64)


@lowers(aten.repeat_interleave.Tensor, dynamic_shape=True)
def repeat_interleave(repeats, output_size=None):
    return jnp.repeat(jnp.arange(repeats.shape[0], dtype=jnp.int64), repeats, total_repeat_length=output_size)


@lowers(aten.bincount.default, dynamic_shape=True)
def bincount(self, weights=None, minlength=0):
    if self.size and int(self.min()) < 0:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    length = max(int(self.max()) + 1 if self.size else 0, minlength)
    out = jnp.bincount(self, weights=weights, length=length)
    return out if weights is not None else out.astype(jnp.int64)
