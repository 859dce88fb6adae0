"""Factories: ops that make a tensor from nothing but their arguments.

``torch.zeros(..., device="tpu")`` and friends reach these through the PrivateUse1
kernels registered in device.py; the output dtype comes from torch's meta kernel.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from torchtpu import dtypes
from torchtpu.ops.registry import aten, lowers


def _dtype(dtype, fallback=jnp.float32):
    return dtypes.to_jax(dtype) if dtype is not None else fallback


# torch's "zero tensor" (a gradient known to be zero, e.g. sgn's of a real input) is
# an ordinary tensor of zeros here.
@lowers(aten.zeros.default, aten._efficientzerotensor.default)
def zeros(size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _dtype(dtype))


@lowers(aten.ones.default)
def ones(size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), _dtype(dtype))


def _fill_dtype(fill_value):
    """``torch.full``'s dtype when none is given: the fill value's kind at torch's
    defaults. (Filled as it comes, a Python float would fill a float64 array before the
    result is cast: on a TPU, float64 work runs on the host.)"""
    kind = jnp.result_type(fill_value)
    if jnp.issubdtype(kind, jnp.bool_):
        return jnp.bool_
    if jnp.issubdtype(kind, jnp.integer):
        return jnp.int64
    return dtypes.to_jax(_result_dtype(None, fill_value))


@lowers(aten.full.default)
def full(size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    kind = _fill_dtype(fill_value) if dtype is None else dtypes.to_jax(dtype)
    return jnp.full(tuple(size), fill_value, kind)


@lowers(aten.scalar_tensor.default)
def scalar_tensor(s, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(s)


@lowers(aten.zeros_like.default)
def zeros_like(self, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(self.shape, _dtype(dtype, self.dtype))


@lowers(aten.ones_like.default)
def ones_like(self, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.ones(self.shape, _dtype(dtype, self.dtype))


@lowers(aten.full_like.default)
def full_like(
    self, fill_value, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None
):
    return jnp.full(self.shape, fill_value, _dtype(dtype, self.dtype))  # no float64 fill


@lowers(aten.new_zeros.default)
def new_zeros(self, size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _dtype(dtype, self.dtype))


@lowers(aten.new_ones.default)
def new_ones(self, size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), _dtype(dtype, self.dtype))


@lowers(aten.new_full.default)
def new_full(self, size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value, _dtype(dtype, self.dtype))  # no float64 fill


def _result_dtype(dtype, *values):
    """A range's dtype: the given one, else torch's default (complex for complex ends)."""
    if dtype is not None:
        return dtype
    default = torch.get_default_dtype()  # part of every plan's key (dispatch/plans.py)
    if any(jnp.iscomplexobj(v) for v in values):
        return torch.complex128 if default == torch.float64 else torch.complex64
    return default


def _float32_range(start, step, length):
    """``start + i * step`` for ``i < length``, computed in float32 as float64 would,
    then rounded: ``i * step`` exactly (Dekker's product: ``i`` and ``step`` split into
    12-bit halves whose products float32 holds), its sum with ``start`` with its
    rounding error (Knuth's two-sum), and the parts of ``start`` and ``step`` float32
    does not hold added back. So ``arange(0, 1, 0.1)[9]`` is ``0.9``, as on the CPU. No
    float64: a TPU computes float64 only on the host."""
    f32 = np.float32
    start_hi, step_hi = f32(start), f32(step)
    start_lo, step_lo = f32(start - float(start_hi)), f32(step - float(step_hi))
    mantissa, exponent = math.frexp(float(step_hi))
    step_top = f32(math.ldexp(math.floor(mantissa * 4096) / 4096, exponent))
    step_bottom = f32(step_hi - step_top)
    index = jnp.arange(length, dtype=jnp.int32)
    i = index.astype(jnp.float32)  # exact below 2**24, as are the halves
    i_top, i_bottom = (index & ~4095).astype(jnp.float32), (index & 4095).astype(jnp.float32)
    product = i * step_hi
    product_error = ((i_top * step_top - product) + i_top * step_bottom + i_bottom * step_top) + (
        i_bottom * step_bottom
    )
    total = product + start_hi
    back = total - product
    sum_error = (product - (total - back)) + (start_hi - back)
    return total + (sum_error + (product_error + (i * step_lo + start_lo)))


def _range(start, step, length, dtype):
    """``start + i * step`` for ``i < length`` in ``dtype`` (static Python numbers)."""
    if all(isinstance(v, int) for v in (start, step)) and not dtype.is_complex:
        # Integral ends: exact integers, rounded once into a floating dtype.
        return (start + jnp.arange(length, dtype=jnp.int64) * step).astype(dtypes.to_jax(dtype))
    if dtype == torch.float64 or not dtype.is_floating_point:
        return start + jnp.arange(length, dtype=jnp.float64) * step  # as torch: in double
    return _float32_range(start, step, length)


def _arange(start, end, step, dtype):
    if dtype is None and all(isinstance(v, int) for v in (start, end, step)):
        dtype = torch.int64
    dtype = _result_dtype(dtype)
    if not dtype.is_floating_point:
        # An integer arange truncates its ends and step first (torch steps in the type).
        start, end, step = int(start), int(end), int(step)
    length = max(0, math.ceil((end - start) / step))
    return _range(start, step, length, dtype)


@lowers(aten.range.step, static=("start", "end", "step"))
def range_step(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    """torch.range (deprecated): both ends included."""
    length = max(0, math.floor((end - start) / step) + 1)
    return _range(start, step, length, _result_dtype(dtype))


@lowers(aten.range.default, static=("start", "end"))
def range_(start, end, dtype=None, layout=None, device=None, pin_memory=None):
    return range_step(start, end, 1, dtype)


@lowers(aten.arange.start_step, static=("start", "end", "step"))
def arange_start_step(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange(start, end, step, dtype)


@lowers(aten.arange.start, static=("start", "end"))
def arange_start(start, end, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange(start, end, 1, dtype)


@lowers(aten.arange.default, static=("end",))
def arange(end, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange(0, end, 1, dtype)


def _linspace_work(dtype):
    """The dtype torch's CPU kernel steps a linspace in: double for integer results (and
    float64), float32 for float32 and 16-bit floats, complex64 for complex64. No float64
    for float32 results: a TPU computes float64 only on the host."""
    if dtype.is_complex:
        return jnp.complex64 if dtype == torch.complex64 else jnp.complex128
    if dtype.is_floating_point and dtype != torch.float64:
        return jnp.float32
    return jnp.float64


def _linspace(start, end, steps, work):
    # torch's formula: from both ends towards the middle, so both ends are exact.
    start, end = jnp.asarray(start).astype(work), jnp.asarray(end).astype(work)
    if steps == 1:
        return start.reshape(1)
    step = (end - start) / (steps - 1)
    i = jnp.arange(steps, dtype=jnp.real(start).dtype)
    half = steps // 2
    return jnp.where(i < half, start + step * i, end - step * (steps - 1 - i))


@lowers(aten.linspace.default, static=("steps",))
def linspace(start, end, steps, dtype=None, layout=None, device=None, pin_memory=None):
    dtype = _result_dtype(dtype, start, end)
    out = _linspace(start, end, steps, _linspace_work(dtype))
    if not dtype.is_floating_point and not dtype.is_complex:
        # Integer linspace: torch computes in the integer type's step arithmetic.
        return jnp.trunc(jnp.real(out))
    return out


@lowers(aten.logspace.default, static=("steps",))
def logspace(start, end, steps, base=10.0, dtype=None, layout=None, device=None, pin_memory=None):
    dtype = _result_dtype(dtype, start, end)
    work = _linspace_work(dtype)
    if not dtype.is_floating_point and not dtype.is_complex:
        # Integer logspace: torch truncates the exponents' ends to integers first.
        start, end = (jnp.trunc(jnp.asarray(v, jnp.float64)) for v in (start, end))
    return jnp.power(jnp.asarray(base, work), _linspace(start, end, steps, work))


@lowers(aten.eye.default)
def eye(n, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, dtype=_dtype(dtype))


@lowers(aten.eye.m)
def eye_m(n, m, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, m, dtype=_dtype(dtype))


@lowers(aten.tril_indices.default)
def tril_indices(row, col, offset=0, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(np.stack(np.tril_indices(row, offset, col)), jnp.int64)  # a constant


@lowers(aten.triu_indices.default)
def triu_indices(row, col, offset=0, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(np.stack(np.triu_indices(row, offset, col)), jnp.int64)  # a constant
