"""Ops of their own kind: distances, histograms, searchsorted, segment and index reductions, ..."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchtpu import dtypes
from torchtpu.ops import unsupported
from torchtpu.ops.indexing import nonzero_coordinates
from torchtpu.ops.registry import aten, lowers
from torchtpu.ops.util import canonical_dim, cast, flat_draw, opmath_dtype
from torchtpu.ops.value_checks import error_if

# -- distances -----------------------------------------------------------------------------


def _p_norm_of_differences(diff, p):
    """The p-norm over the last axis of ``diff``, as torch's distance kernels compute it."""
    magnitude = jnp.abs(diff)
    if p == 0:
        return jnp.sum(magnitude != 0, axis=-1).astype(diff.dtype)
    if p == 1:
        return jnp.sum(magnitude, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(magnitude * magnitude, axis=-1))
    if math.isinf(p):
        return jnp.max(magnitude, axis=-1, initial=0)
    return jnp.sum(magnitude**p, axis=-1) ** (1 / p)


def _p_norm_gradient(diff, dist, grad, p):
    """d(dist)/d(diff) * grad per pair and coordinate; ``dist`` and ``grad`` have a trailing
    axis of 1. At a zero distance the gradient is zero, as in torch's kernels."""
    zero = jnp.zeros((), diff.dtype)
    sign = jnp.sign(diff)
    if p == 0:
        return jnp.zeros_like(diff)
    if p == 1:
        return grad * sign
    if p == 2:
        return jnp.where(dist == 0, zero, grad * diff / jnp.where(dist == 0, 1, dist))
    if math.isinf(p):
        return grad * sign * (jnp.abs(diff) == dist)
    safe_dist = jnp.where(dist == 0, 1, dist)
    magnitude = jnp.abs(diff)
    value = sign * magnitude ** (p - 1) * grad / safe_dist ** (p - 1)
    undefined = dist == 0
    if p < 1:
        undefined = undefined | (diff == 0)
    return jnp.where(undefined, zero, value)


def _check_p(p, name):
    if p < 0:
        raise RuntimeError(f"{name} only supports non-negative p values")


def _euclidean_dist(x1, x2, precision):
    # torch's matrix-product form of the 2-norm distance, used for many rows: one
    # matmul of [-2 x1, |x1|^2, 1] and [x2, 1, |x2|^2], clamped at zero.
    x1_norm = jnp.sum(x1 * x1, axis=-1, keepdims=True)
    x2_norm = jnp.sum(x2 * x2, axis=-1, keepdims=True)
    left = jnp.concatenate([-2 * x1, x1_norm, jnp.ones_like(x1_norm)], axis=-1)
    right = jnp.concatenate([x2, jnp.ones_like(x2_norm), x2_norm], axis=-1)
    product = jnp.matmul(left, jnp.swapaxes(right, -1, -2), precision=precision)
    return jnp.sqrt(jnp.maximum(product, 0))


@lowers(aten._cdist_forward.default, precision=True)
def _cdist_forward(x1, x2, p, compute_mode, *, precision):
    _check_p(p, "cdist")
    mode = 0 if compute_mode is None else compute_mode
    rows1, rows2 = x1.shape[-2], x2.shape[-2]
    if p == 2 and (mode == 1 or (mode == 0 and (rows1 > 25 or rows2 > 25))):
        return _euclidean_dist(x1, x2, precision)
    return _p_norm_of_differences(x1[..., :, None, :] - x2[..., None, :, :], p)


@lowers(aten._cdist_backward.default)
def _cdist_backward(grad, x1, x2, p, cdist):
    if p == 0 or grad.size == 0 or x1.size == 0 or x2.size == 0:
        return jnp.zeros_like(x1)  # torch's shortcut: x1's own shape, not broadcast
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    pair_grad = _p_norm_gradient(diff, cdist[..., None], grad[..., None], p)
    return jnp.sum(pair_grad, axis=-2)


def _pairs(n):
    """The row pairs (i < j) of pdist, in its output order (constants: jnp's would
    build a float64 mask in the program)."""
    return np.triu_indices(n, 1)


@lowers(aten._pdist_forward.default)
def _pdist_forward(self, p=2.0):
    _check_p(p, "pdist")
    first, second = _pairs(self.shape[0])
    return _p_norm_of_differences(self[first] - self[second], p)


@lowers(aten._pdist_backward.default)
def _pdist_backward(grad, self, p, pdist):
    first, second = _pairs(self.shape[0])
    pair_grad = _p_norm_gradient(self[first] - self[second], pdist[:, None], grad[:, None], p)
    return jnp.zeros_like(self).at[first].add(pair_grad).at[second].add(-pair_grad)


@lowers(aten._trilinear.default)
def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    # One einsum over the dims of the expanded operands: each input lacks its expanded
    # dims, the result lacks the summed ones.
    ndim = i1.ndim + len(expand1)
    letters = [chr(ord("a") + d) for d in range(ndim)]

    def subscript(expand):
        return "".join(letters[d] for d in range(ndim) if d not in expand)

    out = "".join(letters[d] for d in range(ndim) if d not in sumdim)
    spec = f"{subscript(expand1)},{subscript(expand2)},{subscript(expand3)}->{out}"
    work = opmath_dtype(i1.dtype)
    operands = (x.astype(work) for x in (i1, i2, i3))
    return jnp.einsum(spec, *operands, precision=lax.Precision.HIGHEST)


@lowers(aten._conj_physical.default)
def _conj_physical(self):
    return jnp.conj(self)


# -- comparisons returning a Python bool ---------------------------------------------------


def _common_dtype(*arrays):
    common = dtypes.to_torch(arrays[0].dtype)
    for a in arrays[1:]:
        common = torch.promote_types(common, dtypes.to_torch(a.dtype))
    return dtypes.to_jax(common)


@lowers(aten.equal.default)
def equal(self, other):
    if self.shape != other.shape:
        return jnp.asarray(False)
    common = _common_dtype(self, other)
    return jnp.all(self.astype(common) == other.astype(common))


def _scalar_type_name(dtype):
    """torch's ScalarType name of a dtype (``Float``), as its error messages write it."""
    return (
        torch.empty(0, dtype=dtypes.to_torch(dtype)).type().removeprefix("torch.")[: -len("Tensor")]
    )


@lowers(aten.allclose.default)
def allclose(self, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    if self.dtype != other.dtype:
        raise RuntimeError(
            f"{_scalar_type_name(self.dtype)} did not match {_scalar_type_name(other.dtype)}"
        )
    if rtol < 0:
        raise RuntimeError(f"rtol must be greater than or equal to zero, but got {rtol}")
    if atol < 0:
        raise RuntimeError(f"atol must be greater than or equal to zero, but got {atol}")
    close = self == other
    inexact = jnp.issubdtype(self.dtype, jnp.inexact)
    if equal_nan and inexact:
        close = close | (jnp.isnan(self) & jnp.isnan(other))
    if rtol != 0 or atol != 0:
        # torch's isclose: in the inputs' dtype, bool in the default float dtype.
        work = self.dtype if self.dtype != jnp.bool_ else jnp.float32
        a, b = self.astype(work), other.astype(work)
        if not inexact:
            work = jnp.float32
        allowed = jnp.asarray(atol, work) + jnp.abs(jnp.asarray(rtol, work) * b)
        actual = jnp.abs(a - b)
        close = close | (jnp.isfinite(actual) & (actual <= allowed))
    return jnp.all(close)


# -- shapes from values, made static -------------------------------------------------------


@lowers(aten.nonzero_static.default)
def nonzero_static(self, size, fill_value=-1):
    if self.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    if self.size == 0:
        return jnp.full((size, self.ndim), fill_value, jnp.int64)
    coordinates, found = nonzero_coordinates(self, size)
    return jnp.where(found[:, None], coordinates, jnp.asarray(fill_value, jnp.int64))


@lowers(aten.resize.default)
def resize(self, size, memory_format=None):
    # The leading values in row-major order, as resize_ keeps them here (dispatch/special.py);
    # torch leaves new elements uninitialized: they are zeros.
    numel = math.prod(size)
    flat = self.reshape(-1)[:numel]
    flat = jnp.pad(flat, (0, numel - flat.shape[0]))
    return flat.reshape(tuple(size))


# -- random factories like a tensor -----------------------------------------------------------


@lowers(aten.randn_like.default, random=True)
def randn_like(
    self, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, *, key
):
    work = opmath_dtype(dtypes.to_jax(dtype) if dtype is not None else self.dtype)
    return flat_draw(jax.random.normal, key, self.shape, dtype=work)


@lowers(aten.rand_like.default, random=True)
def rand_like(
    self, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, *, key
):
    work = opmath_dtype(dtypes.to_jax(dtype) if dtype is not None else self.dtype)
    if jnp.issubdtype(work, jnp.complexfloating):
        # torch draws the real and imaginary parts each from [0, 1)
        pair = flat_draw(jax.random.uniform, key, self.shape + (2,), dtype=jnp.finfo(work).dtype)
        return lax.complex(pair[..., 0], pair[..., 1])
    return flat_draw(jax.random.uniform, key, self.shape, dtype=work)


@lowers(aten.randint_like.default, random=True)
def randint_like(
    self, high, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, *, key
):
    return flat_draw(jax.random.randint, key, self.shape, minval=0, maxval=high, dtype=jnp.int64)


@lowers(aten.randint_like.low_dtype, random=True)
def randint_like_low_dtype(
    self,
    low,
    high,
    dtype=None,
    layout=None,
    device=None,
    pin_memory=None,
    memory_format=None,
    *,
    key,
):
    return flat_draw(jax.random.randint, key, self.shape, minval=low, maxval=high, dtype=jnp.int64)


# -- searching and counting ------------------------------------------------------------------


def _binary_search(boundaries, values, right):
    """torch's searchsorted loop, per row: boundaries (rows, n), values (rows, m). Its
    comparisons are kept as written (``!(mid >= value)``) so NaNs land where torch's do."""
    rows, n = boundaries.shape
    start = jnp.zeros(values.shape, jnp.int64)
    end = jnp.full(values.shape, n, jnp.int64)

    def step(_, bounds):
        start, end = bounds
        active = start < end
        mid = start + ((end - start) >> 1)
        mid_value = jnp.take_along_axis(boundaries, jnp.clip(mid, 0, max(n - 1, 0)), axis=1)
        go_right = ~(mid_value > values) if right else ~(mid_value >= values)
        return (
            jnp.where(active & go_right, mid + 1, start),
            jnp.where(active & ~go_right, mid, end),
        )

    start, _ = lax.fori_loop(0, n.bit_length() + 1, step, (start, end))
    return start


def _searchsorted(sorted_sequence, values, right, side, sorter):
    if side is not None:
        if right and side == "left":
            raise RuntimeError(
                "torch.searchsorted(): side and right can't be set to opposites, got side of "
                "left while right was True"
            )
        right = side == "right"
    n = sorted_sequence.shape[-1]
    if sorter is not None:
        error_if(
            jnp.any((sorter < 0) | (sorter >= n)),
            RuntimeError,
            "torch.searchsorted(): sorter index out of range",
        )
        sorted_sequence = jnp.take_along_axis(sorted_sequence, jnp.clip(sorter, 0, n - 1), -1)
    if values.size == 0 or n == 0:
        return jnp.zeros(values.shape, jnp.int64)
    common = _common_dtype(sorted_sequence, values)
    sorted_sequence, values = sorted_sequence.astype(common), values.astype(common)
    if sorted_sequence.ndim == 1:
        found = _binary_search(sorted_sequence[None], values.reshape(1, -1), right)
    else:
        rows = math.prod(sorted_sequence.shape[:-1])
        found = _binary_search(sorted_sequence.reshape(rows, n), values.reshape(rows, -1), right)
    return found.reshape(values.shape)


@lowers(aten.searchsorted.Tensor)
def searchsorted(sorted_sequence, self, out_int32=False, right=False, side=None, sorter=None):
    return _searchsorted(sorted_sequence, self, right, side, sorter)


@lowers(aten.searchsorted.Scalar)
def searchsorted_scalar(
    sorted_sequence, self, out_int32=False, right=False, side=None, sorter=None
):
    return _searchsorted(sorted_sequence, jnp.asarray(self), right, side, sorter)


@lowers(aten.mode.default)
def mode(self, dim=-1, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    axis = canonical_dim(dim, self.ndim)
    moved = jnp.moveaxis(self, axis, -1)
    n = moved.shape[-1]
    # Like torch's CPU kernel: sort each slice, and take the smallest of the most
    # frequent values. Its index is the last of the value's positions (torch's small-
    # slice sort keeps equal values in order, and it takes the last of the run).
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int64), moved.shape)
    values, indices = lax.sort((moved, positions), dimension=moved.ndim - 1, num_keys=1)
    step = jnp.arange(n)
    run_ends = jnp.concatenate(
        [values[..., 1:] != values[..., :-1], jnp.ones(values.shape[:-1] + (1,), bool)], axis=-1
    )
    run_starts = jnp.concatenate(
        [jnp.ones(values.shape[:-1] + (1,), bool), run_ends[..., :-1]], axis=-1
    )
    first_of_run = lax.cummax(jnp.where(run_starts, step, 0), axis=values.ndim - 1)
    frequency = jnp.where(run_ends, step - first_of_run + 1, 0)
    best = jnp.argmax(frequency, axis=-1, keepdims=True)
    value = jnp.take_along_axis(values, best, axis=-1)[..., 0]
    index = jnp.take_along_axis(indices, best, axis=-1)[..., 0]
    if keepdim:
        value, index = jnp.expand_dims(value, axis), jnp.expand_dims(index, axis)
    return value, index


# -- index and segment reductions -------------------------------------------------------------


def _identity(reduce, dtype):
    """The value a slot starts from when its own value is left out of a reduction."""
    if reduce in ("sum", "mean"):
        return jnp.zeros((), dtype)
    if reduce == "prod":
        return jnp.ones((), dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(-jnp.inf if reduce == "amax" else jnp.inf, dtype)
    info = jnp.iinfo(dtype) if dtype != jnp.bool_ else None
    if info is None:
        return jnp.asarray(reduce == "amin", dtype)
    return jnp.asarray(info.min if reduce == "amax" else info.max, dtype)


@lowers(aten.index_reduce.default)
def index_reduce(self, dim, index, source, reduce, include_self=True):
    if reduce not in ("prod", "mean", "amax", "amin"):
        raise RuntimeError(
            f"index_reduce(): Expected reduce to be one of prod, mean, amax or amin, got {reduce}."
        )
    scalar = self.ndim == 0
    if scalar:
        self, source = self.reshape(1), source.reshape(1)
    dim = canonical_dim(dim, self.ndim)
    size = self.shape[dim]
    error_if(jnp.any((index < 0) | (index >= size)), IndexError, "index out of range in self")
    where = (slice(None),) * dim + (index,)
    source = cast(source, self.dtype)
    touched = jnp.zeros((size,), bool).at[index].set(True)
    touched = touched.reshape((size,) + (1,) * (self.ndim - dim - 1))
    base = self if include_self else jnp.where(touched, _identity(reduce, self.dtype), self)
    ref = base.at[where]
    if reduce == "prod":
        out = ref.multiply(source)
    elif reduce == "amax":
        out = ref.max(source)
    elif reduce == "amin":
        out = ref.min(source)
    else:
        total = ref.add(source)
        count = jnp.zeros((size,), jnp.int64).at[index].add(1) + (1 if include_self else 0)
        count = jnp.maximum(count, 1).reshape(touched.shape).astype(self.dtype)
        if jnp.issubdtype(self.dtype, jnp.inexact):
            out = total / count
        else:
            out = jnp.floor_divide(total, count)
    return out.reshape(()) if scalar else out


# -- histograms ----------------------------------------------------------------------------
#
# As torch's CPU kernel (HistogramKernel.cpp): each value's bin comes from linear
# interpolation between the outer edges (histc), refined by a search among the
# neighbouring edges (histogram with a bin count), or from a binary search among given
# edges. A value outside the outer edges (or NaN) counts nowhere; one on the last edge
# counts in the last bin. Counts accumulate in the input's dtype, as torch's do.


def _require_floating(self, name):
    if not jnp.issubdtype(self.dtype, jnp.floating):
        raise NotImplementedError(
            f"\"{name}\" not implemented for '{_scalar_type_name(self.dtype)}'"
        )


def _linspace_edges(left, right, bins, dtype):
    """``torch.linspace(left, right, bins + 1)`` in ``dtype``: both ends exact."""
    start, end = left.astype(dtype).astype(jnp.float64), right.astype(dtype).astype(jnp.float64)
    step = (end - start) / bins
    i = jnp.arange(bins + 1, dtype=jnp.float64)
    return jnp.where(i < (bins + 1) // 2, start + step * i, end - step * (bins - i)).astype(dtype)


def _linear_bin(values, edges, local_search):
    bins = edges.shape[0] - 1
    left, right = edges[0], edges[-1]
    position = ((values - left) * jnp.asarray(bins, values.dtype) / (right - left)).astype(
        jnp.int64
    )
    if local_search:
        # upper_bound among edges[pos - 1 : pos + 2], as torch's local search.
        low = jnp.maximum(position - 1, 0)
        high = jnp.minimum(position + 2, bins + 1)
        candidates = low[:, None] + jnp.arange(3)
        above = (candidates < high[:, None]) & (
            edges[jnp.clip(candidates, 0, bins)] > values[:, None]
        )
        first_above = jnp.where(above, candidates, high[:, None]).min(axis=1)
        position = first_above - 1
    return position


def _searched_bin(values, edges):
    return _binary_search(edges[None], values[None], right=True)[0] - 1


def _histogram(rows, edges, weight, density, locate):
    """Counts of ``rows`` (N, D) in the bins between ``edges`` (a list of D arrays);
    ``locate(values, edges)`` gives each value's bin."""
    shape = tuple(e.shape[0] - 1 for e in edges)
    flat = jnp.zeros((rows.shape[0],), jnp.int64)
    inside = jnp.ones((rows.shape[0],), bool)
    for d, e in enumerate(edges):
        values = rows[:, d]
        inside = inside & (values >= e[0]) & (values <= e[-1])
        position = jnp.clip(locate(values, e), 0, shape[d] - 1)
        flat = flat * shape[d] + position
    dtype = rows.dtype
    counts = jnp.ones(rows.shape[0], dtype) if weight is None else weight.reshape(-1).astype(dtype)
    flat = jnp.where(inside, flat, math.prod(shape))
    hist = jnp.zeros(math.prod(shape), dtype).at[flat].add(counts, mode="drop").reshape(shape)
    if density:
        hist = hist / jnp.sum(hist)
        for d, e in enumerate(edges):
            lengths = (e[1:] - e[:-1]).reshape((1,) * d + (-1,) + (1,) * (len(shape) - d - 1))
            hist = hist / lengths
    return hist


def _check_bin_counts(bins):
    for d, count in enumerate(bins):
        if count <= 0:
            raise RuntimeError(
                f"torch.histogramdd(): bins must be > 0, but got {count} for dimension {d}"
            )


def _outer_edges(rows, bounds):
    """Each dimension's (left, right) edges in float64: the range if given, else the
    data's extremes; an empty range widens by 0.5 each way, as numpy's."""
    n_dims = rows.shape[1]
    if bounds is not None:
        left = jnp.asarray(bounds[0::2], jnp.float64)
        right = jnp.asarray(bounds[1::2], jnp.float64)
        for d in range(n_dims):
            low, high = bounds[2 * d], bounds[2 * d + 1]
            if not (math.isfinite(low) and math.isfinite(high)):
                raise RuntimeError(
                    f"torch.histogramdd: dimension {d}'s range [{low}, {high}] is not finite"
                )
            if low > high:
                raise RuntimeError(
                    f"torch.histogramdd: min should not exceed max, but got min {low} max "
                    f"{high} for dimension {d}"
                )
    elif rows.shape[0] > 0:
        left = jnp.min(rows, axis=0).astype(jnp.float64)
        right = jnp.max(rows, axis=0).astype(jnp.float64)
        error_if(
            ~jnp.all(jnp.isfinite(left) & jnp.isfinite(right)),
            RuntimeError,
            "torch.histogramdd: the range of the input is not finite",
        )
    else:
        left, right = jnp.zeros(n_dims, jnp.float64), jnp.ones(n_dims, jnp.float64)
    empty = left == right
    return jnp.where(empty, left - 0.5, left), jnp.where(empty, right + 0.5, right)


def _bin_count_edges(rows, bins, bounds):
    _check_bin_counts(bins)
    left, right = _outer_edges(rows, bounds)
    return [_linspace_edges(left[d], right[d], n, rows.dtype) for d, n in enumerate(bins)]


def _linear_search_bin(values, edges):
    return _linear_bin(values, edges, local_search=True)


@lowers(aten.histc.default, static=("min", "max"))
def histc(self, bins=100, min=0, max=0):
    """As torch's kernels, in the input's dtype (no float64: on a TPU that would send
    every call to the host). Integer input is binned as on CUDA, in integer
    arithmetic (torch's CPU kernel refuses it): Hugging Face's MoE routing counts
    tokens per expert with an int histc on accelerators."""
    integer = jnp.issubdtype(self.dtype, jnp.integer)
    if not integer:
        _require_floating(self, "histogram_cpu")
    _check_bin_counts([bins])
    left, right = _histc_range(self, min, max, integer)
    values = self.reshape(-1)
    if integer:
        position = (values - left) * jnp.asarray(bins, self.dtype) // (right - left)
    else:
        position = (values - left) * jnp.asarray(bins, self.dtype) / (right - left)
    position = jnp.clip(position.astype(jnp.int32), 0, bins - 1)  # the last edge: last bin
    inside = (values >= left) & (values <= right)  # NaN is neither
    position = jnp.where(inside, position, bins)
    return jnp.zeros(bins, self.dtype).at[position].add(jnp.ones((), self.dtype), mode="drop")


def _histc_range(self, low, high, integer):
    """histc's outer edges in the input's dtype. ``min == max`` (both 0 by default)
    means the data's extremes; an empty range widens by 1 each way. Given bounds are
    checked at once, as torch checks them; the data's, when the values are read."""
    dtype = self.dtype
    if low == high and self.size:
        left, right = jnp.min(self), jnp.max(self)
        empty = left == right
        one = jnp.asarray(1, dtype)
        left, right = jnp.where(empty, left - one, left), jnp.where(empty, right + one, right)
        if not integer:
            error_if(
                ~(jnp.isfinite(left) & jnp.isfinite(right)),
                RuntimeError,
                "torch.histc: range of [min, max] is not finite",
            )
        return left, right
    low, high = float(low), float(high)
    if low == high:
        low, high = low - 1, high + 1
    if not (math.isfinite(low) and math.isfinite(high)):
        raise RuntimeError(f"torch.histc: range of [{low:g}, {high:g}] is not finite")
    if low > high:
        raise RuntimeError("torch.histc: max must be larger than min")
    if integer:  # CUDA converts the bounds to the input's type, truncating
        low, high = int(low), int(high)
    return jnp.asarray(low, dtype), jnp.asarray(high, dtype)


@lowers(aten.histogram.bin_ct)
def histogram_bin_ct(self, bins=100, range=None, weight=None, density=False):
    _require_floating(self, "histogramdd")
    rows = self.reshape(-1, 1)
    edges = _bin_count_edges(rows, [bins], range)
    return _histogram(rows, edges, weight, density, _linear_search_bin), edges[0]


@lowers(aten.histogram.bins_tensor)
def histogram_bins_tensor(self, bins, weight=None, density=False):
    _require_floating(self, "histogramdd")
    edges = [bins.astype(self.dtype)]
    return _histogram(self.reshape(-1, 1), edges, weight, density, _searched_bin), edges[0]


@lowers(aten._histogramdd_from_bin_cts.default)
def _histogramdd_from_bin_cts(self, bins, range=None, weight=None, density=False):
    _require_floating(self, "histogramdd")
    if len(bins) != self.shape[-1]:
        raise RuntimeError(
            "histogramdd: The size of bins must be equal to the innermost dimension of the input."
        )
    rows = self.reshape(-1, self.shape[-1])
    edges = _bin_count_edges(rows, bins, range)
    return _histogram(rows, edges, weight, density, _linear_search_bin)


@lowers(aten._histogramdd_bin_edges.default)
def _histogramdd_bin_edges(self, bins, range=None, weight=None, density=False):
    _require_floating(self, "histogramdd")
    return _bin_count_edges(self.reshape(-1, self.shape[-1]), bins, range)


# torch has no Meta kernel for _histogramdd_bin_edges, and a plan sizes a list of
# outputs from the Meta kernel (dispatch/builder.py): dimension d has bins[d] + 1 edges.
_META = torch.library.Library("aten", "IMPL")


@torch.library.impl(_META, "_histogramdd_bin_edges", "Meta")
def _histogramdd_bin_edges_meta(self, bins, range=None, weight=None, density=False):
    return [self.new_empty(n + 1) for n in bins]


@lowers(aten._histogramdd_from_bin_tensors.default)
def _histogramdd_from_bin_tensors(self, bins, weight=None, density=False):
    _require_floating(self, "histogramdd")
    rows = self.reshape(-1, self.shape[-1])
    edges = [b.astype(self.dtype) for b in bins]
    return _histogram(rows, edges, weight, density, _searched_bin)


# -- segment reductions ----------------------------------------------------------------------
#
# data is (outer..., N, inner...) with the segments along axis = lengths.ndim - 1; as the
# CPU kernel, we work on data as (outer, N, inner) and on offsets as (outer, S + 1).


def _segments(data, lengths, offsets):
    """(data as (outer, N, inner), offsets (outer, S + 1), segment of each position (outer,
    N), S for positions in no segment)."""
    bounds = lengths if lengths is not None else offsets
    axis = bounds.ndim - 1
    outer = math.prod(data.shape[:axis])
    rows = data.reshape(outer, data.shape[axis], -1)
    if lengths is not None:
        lengths = lengths.reshape(outer, -1).astype(jnp.int64)
        offsets = jnp.concatenate(
            [jnp.zeros((outer, 1), jnp.int64), jnp.cumsum(lengths, axis=1)], axis=1
        )
    else:
        offsets = offsets.reshape(outer, -1).astype(jnp.int64)
    count = offsets.shape[1] - 1
    position = jnp.arange(rows.shape[1])
    segment = jnp.sum(offsets[:, 1:, None] <= position, axis=1)
    inside = (offsets[:, :1] <= position) & (position < offsets[:, -1:])
    return rows, offsets, jnp.where(inside, segment, count)


def _segment_scatter(rows, segment, count, fill):
    """A scatter target (outer, S, inner) filled with ``fill``, and the index of each
    data position in it."""
    outer = jnp.arange(rows.shape[0])[:, None]
    target = jnp.full((rows.shape[0], count, rows.shape[2]), fill, rows.dtype)
    return target, (outer, segment)


@lowers(aten.segment_reduce.default)
def segment_reduce(
    data, reduce, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None
):
    if indices is not None:
        raise RuntimeError("segment_reduce(): indices based reduction is not supported yet.")
    rows, bounds, segment = _segments(data, lengths, offsets)
    count = bounds.shape[1] - 1
    sizes = bounds[:, 1:] - bounds[:, :-1]
    if not unsafe:
        error_if(jnp.any(sizes < 0), RuntimeError, "lengths contains negative value!")
        if lengths is not None:
            error_if(
                jnp.any(bounds[:, -1] != rows.shape[1]),
                RuntimeError,
                "segment_reduce(): Expected all rows of lengths along axis to sum to "
                "data.size(lengths.dim()-1) when !unsafe.",
            )
    start = {"max": -jnp.inf, "min": jnp.inf, "prod": 1}.get(reduce, 0)
    if initial is not None:
        start = initial
    target, where = _segment_scatter(rows, segment, count, start)
    ref = target.at[where]
    if reduce in ("sum", "mean"):
        out = ref.add(rows, mode="drop")
    elif reduce == "prod":
        out = ref.multiply(rows, mode="drop")
    elif reduce in ("max", "min"):
        out = ref.max(rows, mode="drop") if reduce == "max" else ref.min(rows, mode="drop")
        # A NaN in a segment is its result, as in torch's kernel.
        nan_seen = jnp.zeros(target.shape, bool).at[where].max(jnp.isnan(rows), mode="drop")
        out = jnp.where(nan_seen, jnp.nan, out)
    else:
        raise RuntimeError(f"segment_reduce(): unsupported reduction {reduce}")
    if reduce == "mean":
        sizes = sizes[:, :, None].astype(out.dtype)
        if initial is None:
            out = out / sizes  # an empty segment: 0 / 0 = NaN, as in torch
        else:
            out = jnp.where((sizes > 0) & ~jnp.isnan(out), out / jnp.maximum(sizes, 1), out)
    return out.reshape(_segment_output_shape(data, lengths, offsets))


def _segment_output_shape(data, lengths, offsets):
    axis = (lengths if lengths is not None else offsets).ndim - 1
    count = lengths.shape[-1] if lengths is not None else offsets.shape[-1] - 1
    return data.shape[:axis] + (count,) + data.shape[axis + 1 :]


@lowers(aten._segment_reduce_backward.default)
def _segment_reduce_backward(
    grad, output, data, reduce, lengths=None, offsets=None, axis=0, initial=None
):
    rows, bounds, segment = _segments(data, lengths, offsets)
    count = bounds.shape[1] - 1
    outer = jnp.arange(rows.shape[0])[:, None]
    grad = grad.reshape(rows.shape[0], count, -1)
    output = output.reshape(rows.shape[0], count, -1)
    inside = (segment < count)[:, :, None]
    # Scatters go to `segment` (dropping positions in no segment), gathers read `own`.
    own = (outer, jnp.minimum(segment, max(count - 1, 0)))
    segment = (outer, segment)
    grad_at = grad[own]  # each position's segment's gradient
    zero = jnp.zeros((), rows.dtype)
    if reduce == "sum":
        result = grad_at
    elif reduce == "mean":
        sizes = (bounds[:, 1:] - bounds[:, :-1]).astype(rows.dtype)
        result = grad_at / sizes[own][:, :, None]
    elif reduce in ("max", "min"):
        # Every position holding the result (or a NaN) gets the gradient; shared by
        # several, positive gradients are divided among them, as in torch's kernel.
        chosen = jnp.isnan(rows) | (rows == output[own])
        ties = (
            jnp.zeros(grad.shape, jnp.int64).at[segment].add(chosen.astype(jnp.int64), mode="drop")
        )
        ties = ties[own].astype(rows.dtype)
        result = jnp.where(chosen, grad_at, zero)
        result = jnp.where((ties >= 2) & (result > 0), result / ties, result)
    elif reduce == "prod":
        # At a zero or NaN, the product of the others; elsewhere output / value.
        special = jnp.isnan(rows) | (rows == 0)
        is_nan = jnp.isnan(rows)
        regular = (
            jnp.ones(grad.shape, rows.dtype)
            .at[segment]
            .multiply(jnp.where(special, 1, rows), mode="drop")
        )
        if initial is not None:
            regular = regular * jnp.asarray(initial, rows.dtype)
        nans = (
            jnp.zeros(grad.shape, jnp.int64).at[segment].add(is_nan.astype(jnp.int64), mode="drop")
        )
        zeros = (
            jnp.zeros(grad.shape, jnp.int64)
            .at[segment]
            .add((special & ~is_nan).astype(jnp.int64), mode="drop")
        )
        other_nan = nans[own] - is_nan > 0
        other_zero = zeros[own] - (special & ~is_nan) > 0
        exclusive = jnp.where(other_nan, jnp.nan, jnp.where(other_zero, zero, regular[own]))
        result = jnp.where(special, grad_at * exclusive, grad_at * output[own] / rows)
    else:
        raise RuntimeError(f"segment_reduce(): unsupported reduction {reduce}")
    return jnp.where(inside, result, zero).reshape(data.shape)


# -- random ops with an input ----------------------------------------------------------------


@lowers(
    aten.rrelu_with_noise.default,
    aten.rrelu_with_noise_.default,
    aten.rrelu_with_noise_functional.default,
    random=True,
)
def rrelu_with_noise(
    self, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None, *, key
):
    """The result, then the new noise (the op writes it; rrelu_with_noise_ writes self too)."""
    if not training:
        slope = (lower + upper) / 2
        return jnp.where(self >= 0, self, self * jnp.asarray(slope, self.dtype)), noise
    # Training: each non-positive element is scaled by a uniform draw in [lower, upper],
    # which the noise records (1 elsewhere), as torch's CPU kernel.
    work = opmath_dtype(self.dtype)
    draws = flat_draw(jax.random.uniform, key, self.shape, dtype=work, minval=lower, maxval=upper)
    draws = draws.astype(self.dtype)
    slope = jnp.where(self <= 0, draws, jnp.ones((), self.dtype))
    return self * slope, slope.astype(noise.dtype)


# -- embedding bags ------------------------------------------------------------------------
#
# The auxiliary outputs follow torch's meta kernel (as on CUDA): offset2bag is the bag of
# each index, bag_size the number of non-padding indices of each bag (offsets.shape), and
# max_indices, in max mode only, the row that gave each maximum. Our backward reads them.

_SUM, _MEAN, _MAX = 0, 1, 2


def _bags(indices, offsets, include_last_offset, padding_idx):
    """(number of bags, each index's bag, whether the index counts in it)."""
    n = indices.shape[0]
    num_bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    position = jnp.arange(n)
    bag = jnp.sum(offsets[1:num_bags, None] <= position, axis=0)
    # With include_last_offset, indices past the last offset are in no bag (torch reads
    # uninitialized memory for them on its fast path, and leaves them out otherwise).
    end = offsets[num_bags] if include_last_offset else n
    in_bag = (position >= offsets[0]) & (position < end)
    return num_bags, bag, in_bag & (indices != padding_idx)


def _embedding_bag(
    weight, indices, offsets, mode, per_sample_weights, include_last_offset, padding_idx
):
    error_if(  # torch's CPU words (it names the first bad index and its value)
        jnp.any((indices < 0) | (indices >= weight.shape[0])),
        RuntimeError,
        f"an index of input takes a value which is not in the valid range [0, {weight.shape[0]})",
    )
    num_bags, offset2bag, counted = _bags(indices, offsets, include_last_offset, padding_idx)
    bag = jnp.where(counted, offset2bag, num_bags)  # scatters drop the uncounted
    rows = weight[jnp.clip(indices, 0, weight.shape[0] - 1)]
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(rows.dtype)
    sizes = jnp.zeros(num_bags, jnp.int64).at[bag].add(1, mode="drop")
    bag_size = jnp.zeros(offsets.shape, jnp.int64).at[:num_bags].set(sizes)
    empty = (sizes == 0)[:, None]
    features = weight.shape[1]
    if mode == _MAX:
        best = jnp.full((num_bags, features), -jnp.inf, weight.dtype).at[bag].max(rows, mode="drop")
        is_best = rows == best[jnp.minimum(bag, max(num_bags - 1, 0))]
        # The first index reaching each maximum gives its row, as torch's kernels.
        first = (
            jnp.full((num_bags, features), indices.shape[0], jnp.int64)
            .at[bag]
            .min(
                jnp.where(is_best, jnp.arange(indices.shape[0])[:, None], indices.shape[0]),
                mode="drop",
            )
        )
        max_indices = jnp.where(empty, -1, indices[jnp.minimum(first, indices.shape[0] - 1)])
        output = jnp.where(empty, jnp.zeros((), weight.dtype), best)
    else:
        output = jnp.zeros((num_bags, features), weight.dtype).at[bag].add(rows, mode="drop")
        if mode == _MEAN:
            output = output / jnp.maximum(sizes, 1)[:, None].astype(weight.dtype)
        max_indices = jnp.zeros((0,), jnp.int64)
    return output, offset2bag.astype(jnp.int64), bag_size, max_indices.astype(jnp.int64)


@lowers(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def _embedding_bag_forward(
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    return _embedding_bag(
        weight, indices, offsets, mode, per_sample_weights, include_last_offset, padding_idx
    )


def _counted_bags(grad, indices, offsets, padding_idx):
    # The bag count is grad's; offsets has one more entry with include_last_offset.
    include_last_offset = offsets.shape[0] == grad.shape[0] + 1
    return _bags(indices, offsets, include_last_offset, padding_idx)


@lowers(aten._embedding_bag_backward.default)
def _embedding_bag_backward(
    grad,
    indices,
    offsets,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    sparse,
    per_sample_weights,
    padding_idx=-1,
):
    if sparse:
        unsupported.refuse("_embedding_bag_backward: sparse")
    if scale_grad_by_freq:
        unsupported.refuse("_embedding_bag_backward: scale_grad_by_freq")
    grad_weight = jnp.zeros((num_weights, grad.shape[1]), grad.dtype)
    if mode == _MAX:
        rows = jnp.where(maximum_indices < 0, num_weights, maximum_indices)
        features = jnp.arange(grad.shape[1])[None, :]
        return grad_weight.at[rows, features].add(grad, mode="drop")
    num_bags, bag, counted = _counted_bags(grad, indices, offsets, padding_idx)
    contribution = grad[jnp.minimum(bag, max(num_bags - 1, 0))]
    if mode == _MEAN:
        contribution = contribution / jnp.maximum(bag_size[bag], 1)[:, None].astype(grad.dtype)
    if per_sample_weights is not None:
        contribution = contribution * per_sample_weights[:, None].astype(grad.dtype)
    rows = jnp.where(counted, indices, num_weights)
    return grad_weight.at[rows].add(contribution, mode="drop")


@lowers(aten._embedding_bag_per_sample_weights_backward.default)
def _embedding_bag_per_sample_weights_backward(
    grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1
):
    if mode != _SUM:
        raise RuntimeError(
            "embedding_bag_backward: per_sample_weights only supported for mode='sum'"
        )
    num_bags, bag, counted = _counted_bags(grad, indices, offsets, padding_idx)
    bag_grad = grad[jnp.minimum(bag, max(num_bags - 1, 0))]
    rows = weight[jnp.clip(indices, 0, weight.shape[0] - 1)]
    return jnp.where(counted, jnp.sum(bag_grad * rows.astype(grad.dtype), axis=1), 0)
