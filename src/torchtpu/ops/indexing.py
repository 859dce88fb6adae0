"""Indexing: advanced indexing, gather/scatter, index_* ops, masks.

Index values are checked (checks.py): an index out of range raises torch's exception
type at the next read of values, never a silently clamped result.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.ops.registry import aten, lowers
from torchtpu.ops.util import canonical_dim, cast, true_positions
from torchtpu.ops.value_checks import error_if


def _check_bounds(index, size, dim, exc=IndexError, message=None, negative=True):
    """Raise like torch for an index outside ``[-size, size)``, or outside ``[0, size)``
    for the ops whose CPU kernels take no negative indices (``negative=False``)."""
    low = -size if negative else 0
    error_if(
        jnp.any((index < low) | (index >= size)),
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


@lowers(aten.index.Tensor, index_list=True)
def index(self, indices):
    return self[_index_tuple(self, indices)]


@lowers(aten._unsafe_index.Tensor)
def _unsafe_index(self, indices):
    return self[tuple(slice(None) if i is None else i for i in indices)]


@lowers(aten.index_put.default, index_list=True)
def index_put(self, indices, values, accumulate=False):
    where = _index_tuple(self, indices)
    values = cast(values, self.dtype)
    return _add_at(self, where, values) if accumulate else self.at[where].set(values)


@lowers(aten._unsafe_index_put.default)
def _unsafe_index_put(self, indices, values, accumulate=False):
    where = tuple(slice(None) if i is None else i for i in indices)
    values = cast(values, self.dtype)
    return _add_at(self, where, values) if accumulate else self.at[where].set(values)


@lowers(aten._index_put_impl_.default, index_list=True)
def _index_put_impl_(self, indices, values, accumulate=False, unsafe=False):
    return index_put(self, indices, values, accumulate)


@lowers(aten.index_select.default)
def index_select(self, dim, index):
    if self.ndim == 0:
        _check_bounds(index, 1, 0, message="index out of range in self", negative=False)
        return self  # torch gives a 0-d result for a 0-d self, whatever the index's shape
    dim = canonical_dim(dim, self.ndim)
    _check_bounds(index, self.shape[dim], dim, message="index out of range in self", negative=False)
    return jnp.take(self, index.reshape(-1), axis=dim)


def _along(self, dim, index):
    """Full index tuple addressing self[..., index[...], ...] at every position of index."""
    dim = canonical_dim(dim, self.ndim)
    grids = jnp.meshgrid(*[jnp.arange(n) for n in index.shape], indexing="ij")
    return tuple(index if d == dim else grids[d] for d in range(index.ndim)), dim


@lowers(aten.gather.default)
def gather(self, dim, index, sparse_grad=False):
    if index.size == 0:  # torch takes an empty index of any rank
        return jnp.zeros(index.shape, self.dtype)
    if self.ndim == 0:
        return jnp.broadcast_to(self, index.shape)
    dim = canonical_dim(dim, self.ndim)
    _check_bounds(index, self.shape[dim], dim, exc=RuntimeError, negative=False)
    where, _ = _along(self, dim, index)
    return self[where]


def _add_at(x, where, values):
    """``x.at[where].add(values)``, adding bools as torch does (logical or)."""
    if x.dtype == jnp.bool_:
        return x.at[where].max(values.astype(jnp.bool_))
    return x.at[where].add(values)


def _scatter(self, dim, index, src, mode):
    if self.ndim == 0:
        where = ()
        src = jnp.reshape(src, ()) if jnp.ndim(src) else src
    else:
        dim = canonical_dim(dim, self.ndim)
        _check_bounds(index, self.shape[dim], dim, exc=RuntimeError, negative=False)
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
        return _add_at(self, where, src)
    if mode in ("multiply", "prod"):
        return ref.min(src) if self.dtype == jnp.bool_ else ref.multiply(src)
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
    if index.size == 0:
        return self
    if self.ndim == 0:  # torch scatters into a 0-d tensor as into its one element
        one = scatter_reduce(
            self.reshape(1), 0, index.reshape(1), src.reshape(1), reduce, include_self
        )
        return one.reshape(())
    dim = canonical_dim(dim, self.ndim)
    _check_bounds(index, self.shape[dim], dim, exc=RuntimeError, negative=False)
    where, _ = _along(self, dim, index)
    src = cast(src[tuple(slice(0, n) for n in index.shape)], self.dtype)
    touched = jnp.zeros(self.shape, bool).at[where].set(True)
    if reduce == "mean":
        total = jnp.where(touched & ~include_self, 0, self).astype(self.dtype).at[where].add(src)
        count = jnp.where(include_self, 1, 0) + jnp.zeros(self.shape, jnp.int64).at[where].add(1)
        count = jnp.where(touched, count, 1)
        mean = (
            total / count.astype(total.dtype)
            if jnp.issubdtype(self.dtype, jnp.inexact)
            else total // count
        )
        return jnp.where(touched, mean, self).astype(self.dtype)
    if self.dtype == jnp.bool_:
        lowest, highest = False, True
    elif jnp.issubdtype(self.dtype, jnp.inexact):
        lowest, highest = jnp.finfo(self.dtype).min, jnp.finfo(self.dtype).max
    else:
        lowest, highest = jnp.iinfo(self.dtype).min, jnp.iinfo(self.dtype).max
    identity = {"sum": 0, "prod": 1, "amax": lowest, "amin": highest}[reduce]
    base = self if include_self else jnp.where(touched, jnp.asarray(identity, self.dtype), self)
    if jnp.issubdtype(self.dtype, jnp.floating) and reduce in ("amax", "amin") and not include_self:
        base = jnp.where(touched, -jnp.inf if reduce == "amax" else jnp.inf, self)
    return _scatter(base, dim, index, src, reduce)


@lowers(aten.index_add.default)
def index_add(self, dim, index, source, alpha=1):
    if self.ndim == 0:
        return self + jnp.sum(source * alpha)
    dim = canonical_dim(dim, self.ndim)
    others = [n for d, n in enumerate(self.shape) if d != dim]
    if source.ndim != self.ndim or [n for d, n in enumerate(source.shape) if d != dim] != others:
        raise RuntimeError(
            "source tensor shape must match self tensor shape, excluding the specified "
            f"dimension. Got self.shape = {list(self.shape)} source.shape = {list(source.shape)}"
        )
    # torch's CPU kernel checks a 1-d self with an IndexError, others with a RuntimeError.
    if self.ndim == 1:
        _check_bounds(index, self.shape[0], 0, message="index out of range in self", negative=False)
    else:
        _check_bounds(index, self.shape[dim], dim, exc=RuntimeError, negative=False)
    where = (slice(None),) * dim + (index,)
    source = cast(source, self.dtype)
    if not (isinstance(alpha, (int, float)) and alpha == 1):
        source = source * cast(alpha, self.dtype)
    return _add_at(self, where, source)


@lowers(aten.index_copy.default)
def index_copy(self, dim, index, source):
    if self.ndim == 0:
        return jnp.reshape(source, ())
    dim = canonical_dim(dim, self.ndim)
    _check_bounds(
        index,
        self.shape[dim],
        dim,
        message=f"index_copy_(): index is out of bounds for dimension {dim} with size {self.shape[dim]}",
        negative=False,
    )
    return self.at[(slice(None),) * dim + (index,)].set(cast(source, self.dtype))


@lowers(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(self, dim, index, value):
    if self.ndim == 0:
        return jnp.where(index.size > 0, cast(value, self.dtype), self)
    dim = canonical_dim(dim, self.ndim)
    _check_bounds(index, self.shape[dim], dim)
    return self.at[(slice(None),) * dim + (index,)].set(cast(value, self.dtype))


@lowers(aten.diagonal_scatter.default)
def diagonal_scatter(self, src, offset=0, dim1=0, dim2=1):
    d1, d2 = canonical_dim(dim1, self.ndim), canonical_dim(dim2, self.ndim)
    n = src.shape[-1]
    rows = jnp.arange(n) + max(-offset, 0)
    cols = jnp.arange(n) + max(offset, 0)
    # src has the diagonal as its last dim, like torch.diagonal's result.
    moved = jnp.moveaxis(self, (d1, d2), (-2, -1))
    moved = moved.at[..., rows, cols].set(cast(src, self.dtype))
    return jnp.moveaxis(moved, (-2, -1), (d1, d2))


@lowers(aten.masked_scatter.default)
def masked_scatter(self, mask, source):
    if mask.dtype != jnp.bool_:
        raise RuntimeError(
            f"masked_scatter_ only supports boolean masks, but got mask with dtype {mask.dtype}"
        )
    # The out-of-place op broadcasts self and mask against each other (expand_outplace).
    self = jnp.broadcast_to(self, jnp.broadcast_shapes(self.shape, mask.shape))
    mask = jnp.broadcast_to(mask, self.shape).reshape(-1)
    position = jnp.cumsum(mask) - 1
    error_if(
        jnp.sum(mask) > source.size,
        RuntimeError,
        "masked_scatter: expected source to have at least as many elements as ones in mask",
    )
    picked = (
        source.reshape(-1)[jnp.clip(position, 0, max(source.size - 1, 0))]
        if source.size
        else jnp.zeros_like(self.reshape(-1))
    )
    return jnp.where(mask, cast(picked, self.dtype), self.reshape(-1)).reshape(self.shape)


@lowers(aten.masked_scatter_backward.default)
def masked_scatter_backward(grad_output, mask, sizes):
    # Source element k went to the k-th True position of the mask; the rest of the
    # source was not used and gets a zero gradient. Shapes are static (``sizes``).
    numel = math.prod(sizes)
    mask = jnp.broadcast_to(mask, grad_output.shape).reshape(-1)
    position = jnp.where(mask, jnp.cumsum(mask) - 1, numel)
    grad = (
        jnp.zeros((numel,), grad_output.dtype)
        .at[position]
        .set(grad_output.reshape(-1), mode="drop")
    )
    return grad.reshape(sizes)


_TAKE_MESSAGE = "out of range: tried to access index out of bounds of a tensor of {} elements"


@lowers(aten.take.default)
def take(self, index):
    _check_bounds(index, self.size, 0, message=_TAKE_MESSAGE.format(self.size))
    return self.reshape(-1)[index]


@lowers(aten.put.default)
def put(self, index, source, accumulate=False):
    _check_bounds(index, self.size, 0, message=_TAKE_MESSAGE.format(self.size))
    flat = self.reshape(-1)
    source = cast(source, self.dtype).reshape(-1)
    index = index.reshape(-1)
    flat = _add_at(flat, index, source) if accumulate else flat.at[index].set(source)
    return flat.reshape(self.shape)


# -- data-dependent shapes -----------------------------------------------------------------------
#
# These run outside the op's plan, on concrete arrays (``dynamic_shape=True``). Each runs
# as two jitted functions: one computes the output size, the other the output at that
# (static) size. Op-by-op JAX would compile every primitive on first use instead.


@jax.jit
def _count_nonzero(x):
    return jnp.count_nonzero(x)


def nonzero_coordinates(x, size):
    """The coordinates of ``x``'s first ``size`` nonzero elements, one row each, and
    which rows hold one (the others are zeros)."""
    positions, found = true_positions((x != 0).reshape(-1), size)
    coordinates = jnp.stack(jnp.unravel_index(positions, x.shape), axis=1)
    return coordinates.astype(jnp.int64), found


@functools.partial(jax.jit, static_argnames=("size",))
def _nonzero_sized(x, size):
    return nonzero_coordinates(x, size)[0]


@lowers(aten.nonzero.default, dynamic_shape=True)
def nonzero(self):
    if self.ndim == 0:
        return jnp.zeros((1 if bool(self) else 0, 0), jnp.int64)
    return _nonzero_sized(self, size=int(_count_nonzero(self)))


@jax.jit
def _masked_select_count(self, mask):
    return jnp.count_nonzero(jnp.broadcast_to(mask, jnp.broadcast_shapes(self.shape, mask.shape)))


@functools.partial(jax.jit, static_argnames=("size",))
def _masked_select_sized(self, mask, size):
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    where, _ = true_positions(jnp.broadcast_to(mask, shape).reshape(-1), size)
    return jnp.broadcast_to(self, shape).reshape(-1)[where]


@lowers(aten.masked_select.default, dynamic_shape=True)
def masked_select(self, mask):
    return _masked_select_sized(self, mask, size=int(_masked_select_count(self, mask)))


def _sorted_rows(self, axis):
    """The rows along ``axis`` (elements when None) sorted, the permutation that sorts
    them, and where each sorted row differs from the one before (starts a group).

    Written out rather than ``jnp.unique(..., size=)``, whose positions come from
    ``jnp.nonzero``: XLA:TPU took ~25 s to compile ``unique`` of 100 values that way on
    a v5e (`true_positions`). NaN != NaN, so each NaN is a group of its own, as torch
    keeps them."""
    moved = self.reshape(-1) if axis is None else jnp.moveaxis(self, axis, 0)
    rows = moved.reshape(moved.shape[0], -1)
    if rows.shape[1] == 1:
        order = jnp.argsort(rows[:, 0], stable=True)
    elif rows.shape[1] == 0:  # every row is empty, so equal
        order = jnp.arange(rows.shape[0])
    else:
        order = jnp.lexsort(tuple(rows[:, j] for j in reversed(range(rows.shape[1]))))
    ordered = moved[order]
    flat = rows[order]
    change = jnp.concatenate([jnp.ones((1,), bool), jnp.any(flat[1:] != flat[:-1], axis=1)])
    return ordered, order, change


def _groups(change, size):
    """Where each of the first ``size`` groups starts, and how many rows it has."""
    starts, _ = true_positions(change, size)
    ends = jnp.concatenate([starts[1:], jnp.full((1,), change.shape[0], starts.dtype)])
    return starts, (ends - starts).astype(jnp.int64)


@functools.partial(jax.jit, static_argnames=("axis",))
def _unique_count(self, axis):
    """How many unique values or rows, and whether any element is NaN."""
    _, _, change = _sorted_rows(self, axis)
    holds_nan = jnp.isnan(self).any() if jnp.issubdtype(self.dtype, jnp.inexact) else False
    return jnp.count_nonzero(change), holds_nan


@functools.partial(jax.jit, static_argnames=("axis", "size"))
def _unique_sized(self, axis, size):
    ordered, order, change = _sorted_rows(self, axis)
    starts, counts = _groups(change, size)
    values = ordered[starts] if axis is None else jnp.moveaxis(ordered[starts], 0, axis)
    group = jnp.cumsum(change, dtype=starts.dtype) - 1
    inverse = jnp.zeros(group.shape, group.dtype).at[order].set(group)
    inverse = inverse.reshape(self.shape if axis is None else (-1,))
    return values, inverse.astype(jnp.int64), counts


def _unique_rows_holding_nan(self, axis):
    """unique(dim=axis) by torch's CPU kernel. It sorts rows with std::sort and a
    lexicographic comparator for which a NaN is neither less nor greater than anything, so
    where rows holding NaN land (and so the order, inverse and counts) follows the sort's
    steps on that input, which only that kernel repeats. Such inputs are rare; the values
    travel once each way (16-bit floats widened exactly, for numpy)."""
    host = np.array(self)  # a writable copy, as torch.from_numpy wants
    if host.dtype == jnp.bfloat16:  # numpy's bfloat16 (ml_dtypes) is unknown to torch
        host = host.astype(np.float32)
    values, inverse, counts = torch.unique(
        torch.from_numpy(host), dim=axis, return_inverse=True, return_counts=True
    )
    values = jnp.asarray(values.numpy()).astype(self.dtype)
    return values, jnp.asarray(inverse.numpy()), jnp.asarray(counts.numpy())


def _unique(self, axis):
    if self.size == 0:
        values = self.reshape(-1) if axis is None else self
        inverse = jnp.zeros(self.shape if axis is None else (self.shape[axis],), jnp.int64)
        return values, inverse, jnp.zeros((0,), jnp.int64)
    count, holds_nan = jax.device_get(_unique_count(self, axis=axis))
    if axis is not None and holds_nan:
        return _unique_rows_holding_nan(self, axis)
    return _unique_sized(self, axis=axis, size=int(count))


def _only_asked(result, return_inverse, return_counts):
    """(values, inverse, counts) with what was not asked for empty, as torch returns it."""
    values, inverse, counts = result
    nothing = jnp.zeros((0,), jnp.int64)
    return values, inverse if return_inverse else nothing, counts if return_counts else nothing


@lowers(aten._unique.default, dynamic_shape=True)
def _unique_(self, sorted=True, return_inverse=False):
    return _only_asked(_unique(self, None), return_inverse, False)[:2]


@lowers(aten._unique2.default, dynamic_shape=True)
def _unique2(self, sorted=True, return_inverse=False, return_counts=False):
    return _only_asked(_unique(self, None), return_inverse, return_counts)


@lowers(aten.unique_dim.default, dynamic_shape=True)
def unique_dim(self, dim, sorted=True, return_inverse=False, return_counts=False):
    return _unique(self, canonical_dim(dim, self.ndim))


def _consecutive_rows(self, axis):
    """Rows along ``axis`` (all elements when None), and where each differs from the one before."""
    rows = (
        self.reshape(-1, 1)
        if axis is None
        else jnp.moveaxis(self, axis, 0).reshape(self.shape[axis], -1)
    )
    change = jnp.concatenate([jnp.ones((1,), bool), jnp.any(rows[1:] != rows[:-1], axis=1)])
    return rows, change


@functools.partial(jax.jit, static_argnames=("axis",))
def _unique_consecutive_count(self, axis):
    return jnp.count_nonzero(_consecutive_rows(self, axis)[1])


@functools.partial(jax.jit, static_argnames=("axis", "size"))
def _unique_consecutive_sized(self, axis, size):
    _, change = _consecutive_rows(self, axis)
    group = jnp.cumsum(change) - 1
    starts, counts = _groups(change, size)
    if axis is None:
        values = self.reshape(-1)[starts]
        inverse = group.reshape(self.shape)
    else:
        values = jnp.take(self, starts, axis=axis)
        inverse = group
    return values, inverse.astype(jnp.int64), counts


@lowers(aten.unique_consecutive.default, dynamic_shape=True)
def unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    axis = None if dim is None else canonical_dim(dim, self.ndim)
    if self.size == 0:
        result = _unique(self, axis)
    else:
        size = int(_unique_consecutive_count(self, axis=axis))
        result = _unique_consecutive_sized(self, axis=axis, size=size)
    return _only_asked(result, return_inverse, return_counts)


# -- the same ops at a size the user states: Note [Sizes the user states] (dispatch/bounded.py)
#
# Static ops (the size is part of the call), so they run inside a DeferAndFuse chunk or a
# traced program like any other; the size is checked on the device: a wrong one raises at
# the next read (dispatch/checks.py), never a silently cut or padded result.
_bounded = torch.library.Library("torchtpu_bounded", "DEF")
_bounded.define("nonzero(Tensor self, int size) -> Tensor")
_bounded.define("masked_select(Tensor self, Tensor mask, int size) -> Tensor")
_bounded.define(
    "unique(Tensor self, int size, int? dim, bool consecutive) -> (Tensor, Tensor, Tensor)"
)
nonzero_bounded = torch.ops.torchtpu_bounded.nonzero.default
masked_select_bounded = torch.ops.torchtpu_bounded.masked_select.default
unique_bounded = torch.ops.torchtpu_bounded.unique.default


@torch.library.register_fake("torchtpu_bounded::nonzero", lib=_bounded)
def _nonzero_bounded_meta(self, size):
    return self.new_empty((size, self.dim()), dtype=torch.int64)


@torch.library.register_fake("torchtpu_bounded::masked_select", lib=_bounded)
def _masked_select_bounded_meta(self, mask, size):
    return self.new_empty((size,))


@torch.library.register_fake("torchtpu_bounded::unique", lib=_bounded)
def _unique_bounded_meta(self, size, dim, consecutive):
    if dim is None:
        values, inverse = self.new_empty((size,)), self.new_empty(self.shape, dtype=torch.int64)
    else:
        values = self.new_empty(self.shape[:dim] + (size,) + self.shape[dim + 1 :])
        inverse = self.new_empty((self.shape[dim],), dtype=torch.int64)
    return values, inverse, self.new_empty((size,), dtype=torch.int64)


def _check_stated(op: str, count, size: int) -> None:
    error_if(
        count != size,
        RuntimeError,
        f"{op}: torchtpu.bounded({size}) stated the size of its result, but its input's "
        f"values give a result of another size",
    )


@lowers(nonzero_bounded, static=("size",))
def nonzero_at_size(self, size):
    if self.ndim == 0:
        _check_stated("nonzero", (self != 0).astype(jnp.int32), size)
        return jnp.zeros((size, 0), jnp.int64)
    _check_stated("nonzero", jnp.count_nonzero(self), size)
    return _nonzero_sized(self, size=size)


@lowers(masked_select_bounded, static=("size",))
def masked_select_at_size(self, mask, size):
    _check_stated("masked_select", _masked_select_count(self, mask), size)
    return _masked_select_sized(self, mask, size=size)


@lowers(unique_bounded, static=("size", "dim", "consecutive"))
def unique_at_size(self, size, dim, consecutive):
    name = "unique_consecutive" if consecutive else "unique"
    axis = None if dim is None else canonical_dim(dim, self.ndim)
    if self.size == 0:
        _check_stated(name, 0, size)  # a Python number: raises at once
        return _unique(self, axis)
    if consecutive:
        _check_stated(name, _unique_consecutive_count(self, axis=axis), size)
        return _unique_consecutive_sized(self, axis=axis, size=size)
    count, holds_nan = _unique_count(self, axis=axis)
    _check_stated(name, count, size)
    if axis is not None and jnp.issubdtype(self.dtype, jnp.inexact):
        # Where rows holding NaN land, only torch's CPU sort decides (_unique_rows_holding_nan),
        # which a program cannot call.
        error_if(
            holds_nan,
            NotImplementedError,
            f"{name}: torchtpu.bounded does not take unique(dim=...) of rows holding NaN; "
            "leave it outside the bounded block",
        )
    return _unique_sized(self, axis=axis, size=size)


@functools.partial(jax.jit, static_argnames=("size",))
def _repeat_interleave_sized(repeats, size):
    return jnp.repeat(
        jnp.arange(repeats.shape[0], dtype=jnp.int64), repeats, total_repeat_length=size
    )


@jax.jit
def _total_and_least(x):
    return jnp.sum(x), jnp.min(x, initial=0)


@lowers(aten.repeat_interleave.Tensor, dynamic_shape=True)
def repeat_interleave(repeats, output_size=None):
    total, least = (int(v) for v in _total_and_least(repeats))  # one read of the device
    if least < 0:
        raise RuntimeError("repeats can not be negative")
    return _repeat_interleave_sized(repeats, size=total if output_size is None else output_size)


@jax.jit
def _min_max(x):
    return jnp.min(x), jnp.max(x)


@functools.partial(jax.jit, static_argnames=("length",))
def _bincount_sized(self, weights, length):
    out = jnp.bincount(self, weights=weights, length=length)
    return out if weights is not None else out.astype(jnp.int64)


@lowers(aten.bincount.default, dynamic_shape=True)
def bincount(self, weights=None, minlength=0):
    length = minlength
    if self.size:
        low, high = (int(v) for v in _min_max(self))
        if low < 0:
            raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
        length = max(high + 1, minlength)
    return _bincount_sized(self, weights, length=length)


# Note [one_hot's checks on tpu]
#     torch's one_hot skips its value checks for tensor subclasses: it decomposes to
#     ``arange(num_classes) == x``, so a class out of range gave a row of zeros. On tpu
#     one_hot (an AutogradPrivateUse1 kernel, device.py) calls this op instead, whose
#     checks run on the device and raise the CPU's errors at the next read.
_library = torch.library.Library("torchtpu_checked", "DEF")
_library.define("one_hot(Tensor self, int num_classes) -> Tensor")
one_hot_checked = torch.ops.torchtpu_checked.one_hot.default


@torch.library.register_fake("torchtpu_checked::one_hot", lib=_library)
def _one_hot_meta(self, num_classes):
    return self.new_empty((*self.shape, num_classes))


@lowers(one_hot_checked, static=("num_classes",))
def one_hot(self, num_classes):
    error_if(jnp.any(self < 0), RuntimeError, "Class values must be non-negative.")
    error_if(
        jnp.any(self >= num_classes), RuntimeError, "Class values must be smaller than num_classes."
    )
    return (self[..., None] == jnp.arange(num_classes, dtype=self.dtype)).astype(self.dtype)
