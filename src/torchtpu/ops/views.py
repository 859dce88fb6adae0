"""View ops: lowerings that select or rearrange elements without computing.

As views (``view=True``) they make tensors that share storage (storage.py); their
``*_copy`` twins are the same functions as plain computations (decompositions and
compiled graphs use those). Reshape-, permute- and dtype-like views carry an exact
inverse; index-like views (slice, select, diagonal, unfold, as_strided, split, unbind)
use view_chains.py's generic scatter.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from torchtpu import storage
from torchtpu.ops import view_chains
from torchtpu.ops.registry import aten, lowers
from torchtpu.ops.util import canonical_dim

# -- exact inverses -------------------------------------------------------------------------


def _reshape_back(base, value, *args, index=None):
    return value.reshape(base.shape)


def _inverse_permutation(perm):
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return inverse


def _permute_back(base, value, dims, index=None):
    perm = [canonical_dim(d, base.ndim) for d in dims]
    return jnp.transpose(value, _inverse_permutation(perm))


def _transpose_back(base, value, dim0, dim1, index=None):
    return transpose(value, dim0, dim1)


def _t_back(base, value, index=None):
    return t(value)


def _slice_back(base, value, dim, start, end, step, index=None):
    dim = canonical_dim(dim, base.ndim)
    start, _, step = slice_bounds(base.shape[dim], start, end, step)
    if step == 1:
        return lax.dynamic_update_slice_in_dim(base, value.astype(base.dtype), start, dim)
    return view_chains.scatter_into(
        base, storage.ViewStep(aten.slice.Tensor, (dim, start, end, step)), value
    )


def _select_back(base, value, dim, index_, index=None):
    dim = canonical_dim(dim, base.ndim)
    i = index_ + base.shape[dim] if index_ < 0 else index_
    return lax.dynamic_update_index_in_dim(base, value.astype(base.dtype), i, dim)


def _expand_back(base, value, size, implicit=False, index=None):
    # The copies of an element share its storage. view_chains.write refuses writes into
    # the expanded tensor itself, so a write reaching here came through a view (e.g.
    # a select) that exposes at most one copy of each element: that copy, where it
    # changed, is the element's new value.
    lead = value.ndim - base.ndim
    copies = tuple(range(lead)) + tuple(
        lead + d for d, n in enumerate(base.shape) if n == 1 and value.shape[lead + d] != 1
    )
    if not copies:
        return value.reshape(base.shape)
    old = jnp.broadcast_to(base, value.shape)
    kept = [d for d in range(value.ndim) if d not in copies]
    order = list(copies) + kept
    flat_shape = (-1,) + tuple(value.shape[d] for d in kept)
    values = jnp.transpose(value, order).reshape(flat_shape)
    changed = jnp.transpose(_differs(value, old), order).reshape(flat_shape)
    which = jnp.argmax(changed, axis=0)
    new = jnp.take_along_axis(values, which[None], axis=0)[0]
    return jnp.where(changed.any(axis=0), new, values[0]).reshape(base.shape)


def _differs(a, b):
    """Elementwise ``a != b`` on the bits: NaNs equal themselves, -0.0 differs from 0.0."""
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        return _differs(jnp.real(a), jnp.real(b)) | _differs(jnp.imag(a), jnp.imag(b))
    if jnp.issubdtype(a.dtype, jnp.floating):
        bits = jnp.dtype(f"uint{a.dtype.itemsize * 8}")
        return lax.bitcast_convert_type(a, bits) != lax.bitcast_convert_type(b, bits)
    return a != b


def _dtype_view_back(base, value, dtype, index=None):
    return view_dtype(value, _torch_dtype_of(base))


def _view_as_real_back(base, value, index=None):
    return lax.complex(value[..., 0], value[..., 1]).astype(base.dtype)


def _view_as_complex_back(base, value, index=None):
    return jnp.stack([jnp.real(value), jnp.imag(value)], axis=-1).astype(base.dtype)


def _conj_back(base, value, index=None):
    return jnp.conj(value)


def _neg_back(base, value, index=None):
    return -value


def _torch_dtype_of(array):
    from torchtpu import dtypes

    return dtypes.to_torch(array.dtype)


# -- the views ---------------------------------------------------------------------------------


@lowers(aten.view.default, view=True, view_inverse=_reshape_back)
@lowers(aten._unsafe_view.default, view=True, view_inverse=_reshape_back)
@lowers(aten.view_copy.default)
def view(self, size):
    return jnp.reshape(self, tuple(size))


@lowers(aten._reshape_alias.default, view=True, view_inverse=_reshape_back)
@lowers(aten._reshape_alias_copy.default)
def _reshape_alias(self, size, stride):
    return jnp.reshape(self, tuple(size))


@lowers(aten.t.default, view=True, view_inverse=_t_back)
@lowers(aten.t_copy.default)
def t(self):
    return self if self.ndim < 2 else jnp.transpose(self)


@lowers(aten.transpose.int, view=True, view_inverse=_transpose_back)
@lowers(aten.transpose_copy.int)
def transpose(self, dim0, dim1):
    if self.ndim == 0:
        return self
    return jnp.swapaxes(self, canonical_dim(dim0, self.ndim), canonical_dim(dim1, self.ndim))


@lowers(aten.permute.default, view=True, view_inverse=_permute_back)
@lowers(aten.permute_copy.default)
def permute(self, dims):
    return jnp.transpose(self, [canonical_dim(d, self.ndim) for d in dims])


@lowers(aten.expand.default, view=True, view_inverse=_expand_back)
@lowers(aten.expand_copy.default)
def expand(self, size, implicit=False):
    lead = len(size) - self.ndim
    shape = tuple(
        self.shape[i - lead] if (n == -1 and i >= lead) else n for i, n in enumerate(size)
    )
    return jnp.broadcast_to(self, shape)


def _squeezed_shape(shape, dims):
    return tuple(n for i, n in enumerate(shape) if not (i in dims and n == 1))


@lowers(aten.squeeze.default, view=True, view_inverse=_reshape_back)
@lowers(aten.squeeze_copy.default)
def squeeze(self):
    return self.reshape(_squeezed_shape(self.shape, set(range(self.ndim))))


@lowers(aten.squeeze.dim, view=True, view_inverse=_reshape_back)
@lowers(aten.squeeze_copy.dim)
def squeeze_dim(self, dim):
    if self.ndim == 0:
        return self
    return self.reshape(_squeezed_shape(self.shape, {canonical_dim(dim, self.ndim)}))


@lowers(aten.squeeze.dims, view=True, view_inverse=_reshape_back)
@lowers(aten.squeeze_copy.dims)
def squeeze_dims(self, dim):
    if self.ndim == 0:
        return self
    return self.reshape(_squeezed_shape(self.shape, {canonical_dim(d, self.ndim) for d in dim}))


@lowers(aten.unsqueeze.default, view=True, view_inverse=_reshape_back)
@lowers(aten.unsqueeze_copy.default)
def unsqueeze(self, dim):
    return jnp.expand_dims(self, canonical_dim(dim, self.ndim + 1))


def slice_bounds(size, start, end, step):
    start = 0 if start is None else start
    end = size if end is None else end
    if start < 0:
        start += size
    if end < 0:
        end += size
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end, step


@lowers(aten.slice.Tensor, view=True, view_inverse=_slice_back)
@lowers(aten.slice_copy.Tensor)
def slice_(self, dim=0, start=None, end=None, step=1):
    dim = canonical_dim(dim, self.ndim)
    start, end, step = slice_bounds(self.shape[dim], start, end, step)
    return lax.slice_in_dim(self, start, end, step, axis=dim)


@lowers(aten.narrow.default, view=True)
@lowers(aten.narrow_copy.default)
def narrow(self, dim, start, length):
    dim = canonical_dim(dim, self.ndim)
    if start < 0:
        start += self.shape[dim]
    return lax.slice_in_dim(self, start, start + length, 1, axis=dim)


@lowers(aten.select.int, view=True, view_inverse=_select_back)
@lowers(aten.select_copy.int)
def select(self, dim, index):
    dim = canonical_dim(dim, self.ndim)
    if index < 0:
        index += self.shape[dim]
    return lax.index_in_dim(self, index, axis=dim, keepdims=False)


@lowers(aten.diagonal.default, view=True)
@lowers(aten.diagonal_copy.default)
def diagonal(self, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(
        self, offset, canonical_dim(dim1, self.ndim), canonical_dim(dim2, self.ndim)
    )


@lowers(aten.unfold.default, view=True)
@lowers(aten.unfold_copy.default)
def unfold(self, dimension, size, step):
    if self.ndim == 0:
        return self.reshape(1)
    dim = canonical_dim(dimension, self.ndim)
    count = (self.shape[dim] - size) // step + 1
    index = (jnp.arange(count) * step)[:, None] + jnp.arange(size)[None, :]
    windows = jnp.take(self, index, axis=dim)  # (..., count, size, ...)
    return jnp.moveaxis(windows, dim + 1, -1)


@lowers(aten.split.Tensor, view=True)
@lowers(aten.unsafe_split.Tensor, view=True)
@lowers(aten.split_copy.Tensor)
def split(self, split_size, dim=0):
    dim = canonical_dim(dim, self.ndim)
    n = self.shape[dim]
    if split_size == 0:
        return [self]
    sizes = [split_size] * (n // split_size) + ([n % split_size] if n % split_size else [])
    return split_with_sizes(self, sizes or [0], dim)


@lowers(aten.split_with_sizes.default, view=True)
@lowers(aten.unsafe_split_with_sizes.default, view=True)
@lowers(aten.split_with_sizes_copy.default)
def split_with_sizes(self, split_sizes, dim=0):
    dim = canonical_dim(dim, self.ndim)
    out, start = [], 0
    for size in split_sizes:
        out.append(lax.slice_in_dim(self, start, start + size, 1, axis=dim))
        start += size
    return out


@lowers(aten.unbind.int, view=True)
@lowers(aten.unbind_copy.int)
def unbind(self, dim=0):
    dim = canonical_dim(dim, self.ndim)
    return [lax.index_in_dim(self, i, axis=dim, keepdims=False) for i in range(self.shape[dim])]


@lowers(aten.as_strided.default, view=True)
@lowers(aten.as_strided_copy.default)
def as_strided(self, size, stride, storage_offset=None, _storage_strides=None):
    """``_storage_strides``: the memory layout of ``self`` when it is a storage's base
    (Note [Storage strides]); as an op of its own, ``self`` is taken as contiguous."""
    strides = (
        _storage_strides
        if _storage_strides is not None
        else storage._contiguous_strides(self.shape)
    )
    flat = storage.physical(self, strides)
    offset = storage_offset or 0
    position = jnp.full(tuple(size), offset, dtype=jnp.int64)
    for dim, (n, s) in enumerate(zip(size, stride)):
        axis = [1] * len(size)
        axis[dim] = n
        position = position + (jnp.arange(n, dtype=jnp.int64) * s).reshape(axis)
    return flat[position]


@lowers(aten.view.dtype, view=True, view_inverse=_dtype_view_back)
@lowers(aten.view_copy.dtype)
def view_dtype(self, dtype):
    from torchtpu import dtypes

    # bitcast_convert_type takes neither bool nor complex values: bools travel as
    # uint8, complex numbers as (real, imag) pairs along the last dim.
    x = self
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    elif jnp.issubdtype(x.dtype, jnp.complexfloating):
        pairs = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
        # (no -1: x may have no elements; a 0-d x is its one pair)
        x = pairs.reshape(*x.shape[:-1], 2 * x.shape[-1]) if x.ndim else pairs
    target = dtypes.to_jax(dtype)
    if target == jnp.bool_:
        out = _bitcast(x, jnp.dtype(jnp.uint8)).astype(jnp.bool_)
    elif jnp.issubdtype(target, jnp.complexfloating):
        pairs = _bitcast(x, jnp.finfo(target).dtype)
        out = lax.complex(pairs[..., 0::2], pairs[..., 1::2])
    else:
        out = _bitcast(x, target)
    # A 0-d tensor is viewed only as a dtype of its size (torch checks): one element,
    # whatever shape the pairs of a complex side gave it.
    return out.reshape(()) if self.ndim == 0 else out


def _bitcast(x, target):
    """``x``'s bytes as ``target`` values; the last dim scales with the element size."""
    ratio = x.dtype.itemsize / target.itemsize
    if ratio == 1:
        return lax.bitcast_convert_type(x, target)
    if ratio > 1:  # to a smaller type: the last dim grows
        out = lax.bitcast_convert_type(x, target)
        return out.reshape(*x.shape[:-1], x.shape[-1] * int(ratio)) if x.ndim else out.reshape(-1)
    k = int(round(1 / ratio))  # to a larger type: the last dim shrinks
    return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // k, k), target)


@lowers(aten.view_as_real.default, view=True, view_inverse=_view_as_real_back)
@lowers(aten.view_as_real_copy.default)
def view_as_real(self):
    return jnp.stack([jnp.real(self), jnp.imag(self)], axis=-1)


@lowers(aten.view_as_complex.default, view=True, view_inverse=_view_as_complex_back)
@lowers(aten.view_as_complex_copy.default)
def view_as_complex(self):
    return lax.complex(self[..., 0], self[..., 1])


@lowers(aten._conj.default, view=True, view_inverse=_conj_back)
@lowers(aten._conj_copy.default)
def _conj(self):
    return jnp.conj(self)


@lowers(aten._neg_view.default, view=True, view_inverse=_neg_back)
@lowers(aten._neg_view_copy.default)
def _neg_view(self):
    return -self


@lowers(aten.alias_copy.default, aten.detach_copy.default, aten.lift_fresh_copy.default)
def alias_copy(self):
    return self


@lowers(aten.clone.default)
def clone(self, memory_format=None):
    return self
