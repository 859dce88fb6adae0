"""Reductions, scans and sorting.

Accumulation dtypes are policy (``compute_in_result``): ``sum`` of int8 runs in int64
and ``mean`` of float16 in float32, as on torch's CPU kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from torchtpu.ops.registry import aten, lowers
from torchtpu.ops.util import canonical_dim, canonical_dims, complex_logaddexp, opmath
from torchtpu.ops.value_checks import error_if


def _axes(self, dim):
    return canonical_dims(dim, self.ndim)


# Reductions without an identity (max, median, ...) raise on empty input as torch's CPU
# kernels do; shapes are static, so this is a trace-time check.


def _require_elements(self, name):
    if self.size == 0:
        raise RuntimeError(
            f"{name}(): Expected reduction dim to be specified for input.numel() == 0. "
            "Specify the reduction dim with the 'dim' argument."
        )


def _require_dim_elements(self, axis, name):
    if self.shape[axis] == 0:
        raise IndexError(f"{name}(): Expected reduction dim {axis} to have non-zero size.")


@lowers(aten.sum.default, compute_in_result=("self",))
def sum_(self, dtype=None):
    return jnp.sum(self)


@lowers(aten.sum.dim_IntList, compute_in_result=("self",))
def sum_dim(self, dim, keepdim=False, dtype=None):
    return jnp.sum(self, axis=_axes(self, dim), keepdims=keepdim)


@lowers(aten.nansum.default, compute_in_result=("self",))
def nansum(self, dim=None, keepdim=False, dtype=None):
    return jnp.nansum(self, axis=_axes(self, dim), keepdims=keepdim)


@lowers(aten.mean.default, compute_in_result=("self",))
def mean(self, dtype=None):
    return jnp.mean(self)


@lowers(aten.mean.dim, compute_in_result=("self",))
def mean_dim(self, dim, keepdim=False, dtype=None):
    return jnp.mean(self, axis=_axes(self, dim), keepdims=keepdim)


@lowers(aten.prod.default, compute_in_result=("self",))
def prod(self, dtype=None):
    return jnp.prod(self)


@lowers(aten.prod.dim_int, compute_in_result=("self",))
def prod_dim(self, dim, keepdim=False, dtype=None):
    return jnp.prod(
        self, axis=canonical_dim(dim, self.ndim) if self.ndim else None, keepdims=keepdim
    )


@lowers(aten.amax.default)
def amax(self, dim=(), keepdim=False):
    return jnp.max(self, axis=_axes(self, dim), keepdims=keepdim)


@lowers(aten.amin.default)
def amin(self, dim=(), keepdim=False):
    return jnp.min(self, axis=_axes(self, dim), keepdims=keepdim)


@lowers(aten.max.default)
def max_(self):
    _require_elements(self, "max")
    return jnp.max(self)


@lowers(aten.min.default)
def min_(self):
    _require_elements(self, "min")
    return jnp.min(self)


@lowers(aten.max.other, promote="default")
def max_other(self, other):
    return jnp.maximum(self, other)


@lowers(aten.min.other, promote="default")
def min_other(self, other):
    return jnp.minimum(self, other)


def _arg_extreme(self, dim, keepdim, largest: bool):
    if self.ndim == 0:
        return jnp.zeros((), jnp.int64)
    fn = jnp.argmax if largest else jnp.argmin
    if dim is None:
        out = fn(self.reshape(-1))
        return out.reshape((1,) * self.ndim) if keepdim else out
    return fn(self, axis=canonical_dim(dim, self.ndim), keepdims=keepdim)


@lowers(aten.argmax.default)
def argmax(self, dim=None, keepdim=False):
    return _arg_extreme(self, dim, keepdim, True)


@lowers(aten.argmin.default)
def argmin(self, dim=None, keepdim=False):
    return _arg_extreme(self, dim, keepdim, False)


@lowers(aten.max.dim)
def max_dim(self, dim, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    axis = canonical_dim(dim, self.ndim)
    _require_dim_elements(self, axis, "max")
    return jnp.max(self, axis=axis, keepdims=keepdim), jnp.argmax(self, axis=axis, keepdims=keepdim)


@lowers(aten.min.dim)
def min_dim(self, dim, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    axis = canonical_dim(dim, self.ndim)
    _require_dim_elements(self, axis, "min")
    return jnp.min(self, axis=axis, keepdims=keepdim), jnp.argmin(self, axis=axis, keepdims=keepdim)


@lowers(aten.aminmax.default)
def aminmax(self, dim=None, keepdim=False):
    if dim is None:
        lo, hi = jnp.min(self), jnp.max(self)
        if keepdim:
            shape = (1,) * self.ndim
            return lo.reshape(shape), hi.reshape(shape)
        return lo, hi
    axis = canonical_dim(dim, self.ndim) if self.ndim else None
    return jnp.min(self, axis=axis, keepdims=keepdim), jnp.max(self, axis=axis, keepdims=keepdim)


def _variance(self, dim, correction, keepdim):
    axes = _axes(self, dim)
    n = 1
    for a in axes:
        n *= self.shape[a]
    correction = 1 if correction is None else correction
    mean = jnp.mean(self, axis=axes, keepdims=True)
    centered = self - mean
    squares = (
        jnp.real(centered * jnp.conj(centered)) if jnp.iscomplexobj(self) else centered * centered
    )
    total = jnp.sum(squares, axis=axes, keepdims=keepdim)
    var = total / jnp.maximum(n - correction, 0)
    return var, (mean if keepdim else jnp.squeeze(mean, axes) if axes else mean.reshape(()))


# The variance of a complex tensor is real: these compute in the input's opmath dtype,
# not in the result's (which would drop the imaginary parts first).


@lowers(aten.var.correction)
def var(self, dim=None, correction=None, keepdim=False):
    return _variance(opmath(self), dim, correction, keepdim)[0]


@lowers(aten.std.correction)
def std(self, dim=None, correction=None, keepdim=False):
    return jnp.sqrt(_variance(opmath(self), dim, correction, keepdim)[0])


@lowers(aten.var_mean.correction)
def var_mean(self, dim=None, correction=None, keepdim=False):
    return _variance(opmath(self), dim, correction, keepdim)


@lowers(aten.std_mean.correction)
def std_mean(self, dim=None, correction=None, keepdim=False):
    var, mean = _variance(opmath(self), dim, correction, keepdim)
    return jnp.sqrt(var), mean


@lowers(aten.any.default)
def any_(self):
    return jnp.any(self != 0)


@lowers(aten.any.dim, aten.any.dims)
def any_dim(self, dim=None, keepdim=False):
    return jnp.any(self != 0, axis=_axes(self, dim), keepdims=keepdim)


# torch's checks of a bool tensor, as used by autograd's anomaly mode (`check_nan`) and
# torch._assert_async: the self of both is a bool tensor.
@lowers(aten._is_any_true.default)
def is_any_true(self):
    return jnp.any(self)


@lowers(aten._is_all_true.default)
def is_all_true(self):
    return jnp.all(self)


@lowers(aten._assert_async.default, aten._assert_async.msg)
def _assert_async(self, assert_msg="Expected Tensor with single nonzero value, but got zero"):
    """torch._assert_async (Dynamo makes one of ``assert`` on a tensor): a value
    check, raised at the next read, as a device-side assert would be."""
    if self.size != 1:
        raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
    error_if(jnp.all(self == 0), RuntimeError, assert_msg)
    return ()


@lowers(aten.all.default)
def all_(self):
    return jnp.all(self != 0)


@lowers(aten.all.dim, aten.all.dims)
def all_dim(self, dim=None, keepdim=False):
    return jnp.all(self != 0, axis=_axes(self, dim), keepdims=keepdim)


@lowers(aten.count_nonzero.dim_IntList, aten.count_nonzero.default)
def count_nonzero(self, dim=None):
    return jnp.sum(self != 0, axis=_axes(self, dim), dtype=jnp.int64)


@lowers(aten.hash_tensor.default)
def hash_tensor(self, dim=(), keepdim=False, mode=0):
    """The XOR of the elements' bits, each widened to its 64-bit float or integer."""
    if mode != 0:
        raise RuntimeError(f"hash_tensor: mode {mode} is not supported (only 0, xor)")
    # torch's kernel refuses empty reductions although xor has an identity
    if not dim:
        _require_elements(self, "hash_tensor")
    for axis in _axes(self, dim) or ():
        _require_dim_elements(self, axis, "hash_tensor")
    if self.dtype == jnp.float64:
        bits = lax.bitcast_convert_type(self, jnp.uint64)
    elif jnp.issubdtype(self.dtype, jnp.floating):
        bits = _float64_bits(self.astype(jnp.float32))
    else:
        wide = self.astype(jnp.uint64 if self.dtype == jnp.uint64 else jnp.int64)
        bits = lax.bitcast_convert_type(wide, jnp.uint64)
    return jnp.bitwise_xor.reduce(bits, axis=_axes(self, dim), keepdims=keepdim)


def _float64_bits(x):
    """The bits of float32 ``x`` widened to float64, built with integer ops: a TPU has no
    float64, and its emulated float64 does not keep these bits (it differed on a v5e)."""
    u64 = jnp.uint64
    b = lax.bitcast_convert_type(x, jnp.uint32)
    sign = (b >> 31).astype(u64) << 63
    exponent = (b >> 23) & 0xFF
    mantissa = b & 0x7FFFFF
    # a normal number: rebias the exponent (1023 - 127) and widen the mantissa
    normal = ((exponent.astype(u64) + 896) << 52) | (mantissa.astype(u64) << 29)
    # a subnormal one (exponent 0) is normal as a float64: its top set bit p becomes
    # the implicit 1, and the exponent 2**(p - 149) is biased by 1023
    top = 31 - lax.clz(mantissa)
    shifted = (mantissa.astype(u64) << (52 - top).astype(u64)) & ((1 << 52) - 1)
    subnormal = jnp.where(mantissa == 0, u64(0), ((top + 874).astype(u64) << 52) | shifted)
    # infinity and NaN: the largest exponent; a NaN comes out quiet, as the CPU's does
    quiet = jnp.where(mantissa == 0, u64(0), u64(1 << 51))
    special = (u64(2047) << 52) | (mantissa.astype(u64) << 29) | quiet
    bits = jnp.where(exponent == 0, subnormal, jnp.where(exponent == 255, special, normal))
    return sign | bits


@lowers(aten.linalg_vector_norm.default, static=("ord",))
def linalg_vector_norm(self, ord=2, dim=None, keepdim=False, dtype=None):
    x = opmath(jnp.abs(self))
    axes = _axes(self, dim)
    if ord == float("inf"):
        return jnp.max(x, axis=axes, keepdims=keepdim)
    if ord == float("-inf"):
        return jnp.min(x, axis=axes, keepdims=keepdim)
    if isinstance(ord, (int, float)) and ord == 0:
        return jnp.sum((x != 0).astype(x.dtype), axis=axes, keepdims=keepdim)
    if isinstance(ord, (int, float)) and ord == 1:
        return jnp.sum(x, axis=axes, keepdims=keepdim)
    if isinstance(ord, (int, float)) and ord == 2:
        return jnp.sqrt(jnp.sum(x * x, axis=axes, keepdims=keepdim))
    ord = jnp.asarray(ord, x.dtype)
    return jnp.sum(x**ord, axis=axes, keepdims=keepdim) ** (1 / ord)


@lowers(aten.logsumexp.default, promote="int_to_float")
def logsumexp(self, dim, keepdim=False):
    axes = _axes(self, dim)
    if not axes and self.ndim:
        return self
    return jax.nn.logsumexp(self, axis=axes, keepdims=keepdim)


# -- scans ------------------------------------------------------------------------------------


@lowers(aten.cumsum.default, compute_in_result=("self",))
def cumsum(self, dim, dtype=None):
    if self.ndim == 0:
        return self
    return jnp.cumsum(self, axis=canonical_dim(dim, self.ndim))


@lowers(aten.cumprod.default, compute_in_result=("self",))
def cumprod(self, dim, dtype=None):
    if self.ndim == 0:
        return self
    return jnp.cumprod(self, axis=canonical_dim(dim, self.ndim))


@lowers(aten.logcumsumexp.default)
def logcumsumexp(self, dim):
    if self.ndim == 0:
        return self
    axis = canonical_dim(dim, self.ndim)
    if not jnp.iscomplexobj(self):
        return lax.cumlogsumexp(self, axis=axis)

    # torch folds complex values left to right with its logaddexp, whose imaginary
    # parts are not reduced to (-pi, pi]: a reassociating scan could differ by 2 pi.
    def step(total, x):
        total = complex_logaddexp(total, x)
        return total, total

    moved = jnp.moveaxis(self, axis, 0)
    _, rest = lax.scan(step, moved[0], moved[1:])
    return jnp.moveaxis(jnp.concatenate([moved[:1], rest]), 0, axis)


def _cum_extreme(self, dim, better):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    axis = canonical_dim(dim, self.ndim)
    n = self.shape[axis]
    shape = [1] * self.ndim
    shape[axis] = n
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int64).reshape(shape), self.shape)

    def combine(a, b):
        value_a, index_a = a
        value_b, index_b = b
        # b comes later: take it when better or equal (torch returns the last index
        # of ties), or when it is NaN (NaN propagates).
        take_b = (
            better(value_b, value_a) | (value_b == value_a) | jnp.isnan(value_b)
            if jnp.issubdtype(value_a.dtype, jnp.inexact)
            else better(value_b, value_a) | (value_b == value_a)
        )
        if jnp.issubdtype(value_a.dtype, jnp.inexact):
            take_b = take_b & ~(jnp.isnan(value_a) & ~jnp.isnan(value_b))
        return jnp.where(take_b, value_b, value_a), jnp.where(take_b, index_b, index_a)

    return lax.associative_scan(combine, (self, positions), axis=axis)


@lowers(aten.cummax.default)
def cummax(self, dim):
    return _cum_extreme(self, dim, jnp.greater)


@lowers(aten.cummin.default)
def cummin(self, dim):
    return _cum_extreme(self, dim, jnp.less)


# -- sorting ----------------------------------------------------------------------------------


def _sort(self, dim, descending):
    """Stable sort along ``dim``; NaN counts as the largest value, as in torch."""
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    axis = canonical_dim(dim, self.ndim)
    shape = [1] * self.ndim
    shape[axis] = self.shape[axis]
    index = jnp.broadcast_to(
        jnp.arange(self.shape[axis], dtype=jnp.int64).reshape(shape), self.shape
    )
    if not descending:
        # XLA's sort orders NaN last, as torch does.
        _, idx = lax.sort((self, index), dimension=axis, num_keys=1, is_stable=True)
    elif jnp.issubdtype(self.dtype, jnp.floating):
        # NaN first, then the values from the largest; ties keep their input order.
        not_nan = (~jnp.isnan(self)).astype(jnp.int8)
        _, _, idx = lax.sort((not_nan, -self, index), dimension=axis, num_keys=2, is_stable=True)
    else:
        if self.dtype == jnp.bool_:
            keys = ~self
        elif jnp.issubdtype(self.dtype, jnp.unsignedinteger):
            keys = jnp.iinfo(self.dtype).max - self
        else:
            keys = ~self  # -x - 1: reverses the order without overflow
        _, idx = lax.sort((keys, index), dimension=axis, num_keys=1, is_stable=True)
    return jnp.take_along_axis(self, idx, axis=axis), idx


@lowers(aten.sort.default)
def sort(self, dim=-1, descending=False):
    return _sort(self, dim, descending)


@lowers(aten.sort.stable)
def sort_stable(self, stable=None, dim=-1, descending=False):
    return _sort(self, dim, descending)


@lowers(aten.topk.default)
def topk(self, k, dim=-1, largest=True, sorted=True):
    values, indices = _sort(self, dim, descending=largest)
    if self.ndim == 0:
        return values, indices
    axis = canonical_dim(dim, self.ndim)
    return lax.slice_in_dim(values, 0, k, axis=axis), lax.slice_in_dim(indices, 0, k, axis=axis)


@lowers(aten.kthvalue.default)
def kthvalue(self, k, dim=-1, keepdim=False):
    values, indices = _sort(self, dim, descending=False)
    if self.ndim == 0:
        return values, indices
    axis = canonical_dim(dim, self.ndim)
    value = lax.index_in_dim(values, k - 1, axis=axis, keepdims=keepdim)
    index = lax.index_in_dim(indices, k - 1, axis=axis, keepdims=keepdim)
    return value, index


def _median(self, dim, keepdim, ignore_nan):
    flat = dim is None
    x = self.reshape(-1) if flat else self
    if x.ndim == 0:
        return (x, jnp.zeros((), jnp.int64)) if not flat else x
    if flat and x.size == 0:
        return jnp.full((), jnp.nan, x.dtype)  # torch's median of nothing
    axis = 0 if flat else canonical_dim(dim, x.ndim)
    _require_dim_elements(x, axis, "median")
    values, indices = _sort(x, axis, descending=False)
    n = x.shape[axis]
    if ignore_nan and jnp.issubdtype(x.dtype, jnp.floating):
        count = jnp.sum(~jnp.isnan(x), axis=axis, keepdims=True)
        k = jnp.maximum((count - 1) // 2, 0)
    else:
        nan_any = (
            jnp.any(jnp.isnan(x), axis=axis, keepdims=True)
            if jnp.issubdtype(x.dtype, jnp.floating)
            else False
        )
        k = jnp.full((1,) * x.ndim, (n - 1) // 2)
        if nan_any is not False:
            first_nan = jnp.argmax(jnp.isnan(values), axis=axis, keepdims=True)
            k = jnp.where(nan_any, first_nan, k)
    k = jnp.broadcast_to(k, values.shape[:axis] + (1,) + values.shape[axis + 1 :])
    value = jnp.take_along_axis(values, k, axis=axis)
    index = jnp.take_along_axis(indices, k, axis=axis)
    if flat:
        return value.reshape(())
    if not keepdim:
        value, index = jnp.squeeze(value, axis), jnp.squeeze(index, axis)
    return value, index


@lowers(aten.median.default)
def median(self):
    return _median(self, None, False, ignore_nan=False)


@lowers(aten.median.dim)
def median_dim(self, dim, keepdim=False):
    return _median(self, dim, keepdim, ignore_nan=False)


@lowers(aten.nanmedian.default)
def nanmedian(self):
    return _median(self, None, False, ignore_nan=True)


@lowers(aten.nanmedian.dim)
def nanmedian_dim(self, dim, keepdim=False):
    return _median(self, dim, keepdim, ignore_nan=True)
