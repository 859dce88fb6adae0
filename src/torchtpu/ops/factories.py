"""Factories: ops that make a tensor from nothing but their arguments.

``torch.zeros(..., device="tpu")`` and friends reach these through the PrivateUse1
kernels registered in device.py; the output dtype comes from torch's meta kernel.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

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


@lowers(aten.full.default)
def full(size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value)


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
    return jnp.full(self.shape, fill_value)


@lowers(aten.new_zeros.default)
def new_zeros(self, size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _dtype(dtype, self.dtype))


@lowers(aten.new_ones.default)
def new_ones(self, size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), _dtype(dtype, self.dtype))


@lowers(aten.new_full.default)
def new_full(self, size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value)


def _arange(start, end, step, dtype):
    length = max(0, math.ceil((end - start) / step))
    integral = all(isinstance(v, int) for v in (start, end, step))
    if integral and (dtype is None or not dtype.is_floating_point):
        return start + jnp.arange(length, dtype=jnp.int64) * step
    # torch accumulates in double: start + i * step.
    return start + jnp.arange(length, dtype=jnp.float64) * step


@lowers(aten.range.step, static=("start", "end", "step"))
def range_step(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    """torch.range (deprecated): both ends included, computed in double."""
    length = max(0, math.floor((end - start) / step) + 1)
    return start + jnp.arange(length, dtype=jnp.float64) * step


@lowers(aten.range.default, static=("start", "end"))
def range_(start, end, dtype=None, layout=None, device=None, pin_memory=None):
    return range_step(start, end, 1)


@lowers(aten.arange.start_step, static=("start", "end", "step"))
def arange_start_step(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange(start, end, step, dtype)


@lowers(aten.arange.start, static=("start", "end"))
def arange_start(start, end, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange(start, end, 1, dtype)


@lowers(aten.arange.default, static=("end",))
def arange(end, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange(0, end, 1, dtype)


def _linspace(start, end, steps):
    # torch's formula: from both ends towards the middle, so both ends are exact.
    if steps == 1:
        return jnp.full((1,), start, dtype=jnp.result_type(start, jnp.float64))
    start = jnp.asarray(start)
    end = jnp.asarray(end)
    work = jnp.complex128 if jnp.iscomplexobj(start) or jnp.iscomplexobj(end) else jnp.float64
    start, end = start.astype(work), end.astype(work)
    step = (end - start) / (steps - 1)
    i = jnp.arange(steps, dtype=jnp.float64)
    half = steps // 2
    return jnp.where(i < half, start + step * i, end - step * (steps - 1 - i))


@lowers(aten.linspace.default, static=("steps",))
def linspace(start, end, steps, dtype=None, layout=None, device=None, pin_memory=None):
    out = _linspace(start, end, steps)
    if dtype is not None and not dtype.is_floating_point and not dtype.is_complex:
        # Integer linspace: torch computes in the integer type's step arithmetic.
        return jnp.trunc(jnp.real(out)) if not jnp.iscomplexobj(out) else out
    return out


@lowers(aten.logspace.default, static=("steps",))
def logspace(start, end, steps, base=10.0, dtype=None, layout=None, device=None, pin_memory=None):
    if dtype is not None and not dtype.is_floating_point and not dtype.is_complex:
        # Integer logspace: torch truncates the exponents' ends to integers first.
        start, end = (jnp.trunc(jnp.asarray(v, jnp.float64)) for v in (start, end))
    return jnp.power(base, _linspace(start, end, steps))


@lowers(aten.eye.default)
def eye(n, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, dtype=_dtype(dtype))


@lowers(aten.eye.m)
def eye_m(n, m, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, m, dtype=_dtype(dtype))


@lowers(aten.tril_indices.default)
def tril_indices(row, col, offset=0, dtype=None, layout=None, device=None, pin_memory=None):
    r, c = jnp.tril_indices(row, offset, col)
    return jnp.stack([r, c]).astype(jnp.int64)


@lowers(aten.triu_indices.default)
def triu_indices(row, col, offset=0, dtype=None, layout=None, device=None, pin_memory=None):
    r, c = jnp.triu_indices(row, offset, col)
    return jnp.stack([r, c]).astype(jnp.int64)
