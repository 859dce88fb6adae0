"""Upsampling: nearest, nearest-exact, (bi/tri)linear, bicubic and anti-aliased
bilinear interpolation, and their backward ops.

Each interpolation is separable: one axis at a time, in the order torch's CPU kernels
combine them, computing in the opmath dtype (float32 for 16-bit floats) with torch's
source-index arithmetic. Backward ops are the VJP of the forward lowering (the
forward is linear in its input), so the two cannot disagree.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torchtpu.ops import unsupported
from torchtpu.ops.registry import aten, lowers
from torchtpu.ops.util import opmath_dtype


@lowers(aten.upsample_nearest2d.default)
def upsample_nearest2d(self, output_size, scales_h=None, scales_w=None):
    return _nearest(self, output_size, (scales_h, scales_w))


@lowers(aten.upsample_nearest1d.default)
def upsample_nearest1d(self, output_size, scales=None):
    return _nearest(self, output_size, (scales,))


@lowers(aten.upsample_nearest3d.default)
def upsample_nearest3d(self, output_size, scales_d=None, scales_h=None, scales_w=None):
    return _nearest(self, output_size, (scales_d, scales_h, scales_w))


def _nearest(self, output_size, scales, exact=False):
    """Nearest-neighbour upsampling; ``exact`` samples at pixel centres (torch's
    nearest-exact) where plain nearest floors the output index times the scale."""
    x = self
    n = len(output_size)
    offset = 0.5 if exact else 0.0
    for i in range(n):
        axis = self.ndim - n + i
        size_in, size_out = self.shape[axis], output_size[i]
        scale = (1.0 / scales[i]) if scales[i] else size_in / size_out
        position = (jnp.arange(size_out, dtype=jnp.float32) + offset) * jnp.float32(scale)
        src = jnp.minimum(jnp.floor(position).astype(jnp.int64), size_in - 1)
        x = jnp.take(x, src, axis=axis)
    return x


# -- linear and cubic interpolation ---------------------------------------------------------


def _scale(size_in, size_out, align_corners, scale, real):
    """torch's area_pixel_compute_scale, in the opmath dtype ``real``."""
    if align_corners:
        return real(size_in - 1) / real(size_out - 1) if size_out > 1 else real(0)
    if scale is not None and scale > 0:
        return real(1.0 / scale)
    return real(size_in) / real(size_out)


def _source_index(size_in, size_out, align_corners, scale, real, cubic):
    """torch's area_pixel_compute_source_index of every output position."""
    ratio = _scale(size_in, size_out, align_corners, scale, real)
    dst = jnp.arange(size_out, dtype=real)
    if align_corners:
        return ratio * dst
    src = ratio * (dst + real(0.5)) - real(0.5)
    return src if cubic else jnp.maximum(src, real(0))


def _cubic_weights(t, real):
    """The 4 taps' weights at fraction ``t`` of torch's cubic convolution (A = -0.75)."""
    a = real(-0.75)

    def inner(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def outer(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return [outer(t + 1), inner(t), inner(1 - t), outer(2 - t)]


def _taps(self, output_size, align_corners, scales, cubic):
    """Separable interpolation of the last ``len(output_size)`` axes: each output is
    sum_j w_j * x[i_j], innermost axis first, as torch's CPU kernels nest it."""
    real = jnp.float64 if self.dtype == jnp.float64 else jnp.float32
    x = self.astype(real)
    n = len(output_size)
    for i in reversed(range(n)):
        axis = self.ndim - n + i
        size_in, size_out = self.shape[axis], output_size[i]
        src = _source_index(size_in, size_out, align_corners, scales[i], real, cubic)
        if cubic:
            start = jnp.floor(src).astype(jnp.int64)
            t = src - start.astype(real)
            positions = [jnp.clip(start - 1 + j, 0, size_in - 1) for j in range(4)]
            weights = _cubic_weights(t, real)
        else:
            lo = jnp.minimum(jnp.floor(src).astype(jnp.int64), size_in - 1)
            t = jnp.clip(src - lo.astype(real), 0, 1)
            positions = [lo, jnp.minimum(lo + 1, size_in - 1)]
            weights = [1 - t, t]
        shape = [1] * x.ndim
        shape[axis] = size_out
        out = None
        for position, weight in zip(positions, weights):
            term = jnp.take(x, position, axis=axis) * weight.reshape(shape)
            out = term if out is None else out + term
        x = out
    return x.astype(self.dtype)


@lowers(aten.upsample_linear1d.default)
def upsample_linear1d(self, output_size, align_corners, scales=None):
    return _taps(self, output_size, align_corners, (scales,), cubic=False)


@lowers(aten.upsample_bilinear2d.default)
def upsample_bilinear2d(self, output_size, align_corners, scales_h=None, scales_w=None):
    if self.dtype == jnp.uint8:

        def weights(n, size, scale):
            return _filter_weights(n, size, align_corners, scale, _linear_filter, 2, False)

        return _resize_uint8(self, output_size, (scales_h, scales_w), weights)
    return _taps(self, output_size, align_corners, (scales_h, scales_w), cubic=False)


# Note [uint8 resizing in fixed point]
#     torch's CPU kernels resize uint8 images as Pillow does (bilinear and bicubic, with
#     or without antialiasing): one pass per axis that
#     changes size, the last axis first, each with int16 weights scaled by 2**precision
#     (the most bits the largest weight allows) and rounded back to uint8 after the pass
#     (UpSampleKernel.cpp, _compute_index_ranges_int16_weights). Computing in float and
#     rounding once differs from it by up to 2; these are its steps.


def _linear_filter(x):
    return max(0.0, 1.0 - abs(x))


def _cubic_filter(a):
    def cubic(x):
        x = abs(x)
        if x < 1.0:
            return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
        if x < 2.0:
            return (((x - 5) * x + 8) * x - 4) * a
        return 0.0

    return cubic


def _filter_weights(size_in, size_out, align_corners, scale, filter_fn, taps, antialias):
    """The (size_out, size_in) float64 weights of one axis, as the kernels of the
    antialiased and the uint8 resizes compute them (_compute_indices_min_size_weights_aa):
    the filter over the taps in range, normalised to sum to one per output."""
    ratio = _scale(size_in, size_out, align_corners, scale, float)
    delta = 0.5 if align_corners and not antialias else 0.0
    support = taps * 0.5
    if antialias and ratio >= 1.0:  # widened to the scale when downsampling
        support, invscale = support * ratio, 1.0 / ratio
    else:
        invscale = 1.0
    most = int(math.ceil(support)) * 2 + 1 if antialias else taps
    weights = np.zeros((size_out, size_in))
    for i in range(size_out):
        center = ratio * (i + 0.5 - delta)
        # int() truncates toward zero as the kernel's static_cast does
        start = max(int(center - support + 0.5 + delta), 0)
        count = min(max(min(int(center + support + 0.5 + delta), size_in) - start, 0), most)
        row = [filter_fn((j + start - center + 0.5 - delta) * invscale) for j in range(count)]
        total = sum(row)
        if total != 0.0:
            weights[i, start : start + count] = [w / total for w in row]
    return weights


def _int16_weights(weights):
    """Weights scaled by 2**precision, the most bits the largest allows in an int16, and
    rounded half away from zero (_compute_index_ranges_int16_weights); and precision."""
    largest = weights.max(initial=0.0)
    precision = 0
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    return np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5)).astype(np.int32), precision


def _keys_cubic_weights(size_in, size_out, align_corners, scale):
    """The (size_out, size_in) float64 weights of one axis of torch's uint8 bicubic resize
    without antialiasing (_compute_indices_min_size_weights): Keys' cubic (A = -0.75) at
    the float kernel's source index, the taps past an edge added to the edge's weight
    (the float kernel reads the edge pixel there), not normalised."""
    ratio = _scale(size_in, size_out, align_corners, scale, float)
    cubic = _cubic_filter(-0.75)
    weights = np.zeros((size_out, size_in))
    for i in range(size_out):
        real = ratio * i if align_corners else ratio * (i + 0.5) - 0.5
        index = min(math.floor(real), size_in - 1)
        fraction = min(max(real - index, 0.0), 1.0)
        for j in range(4):
            weights[i, min(max(index - 1 + j, 0), size_in - 1)] += cubic(j - 1 - fraction)
    return weights


def _resize_uint8(self, output_size, scales, axis_weights):
    """Note [uint8 resizing in fixed point]; ``axis_weights(size_in, size_out, scale)``
    is one axis's (size_out, size_in) float weights."""
    x = self
    for i in reversed(range(2)):
        axis = self.ndim - 2 + i
        if x.shape[axis] == output_size[i]:
            continue
        weights, precision = _int16_weights(axis_weights(x.shape[axis], output_size[i], scales[i]))
        moved = jnp.moveaxis(x.astype(jnp.int32), axis, -1)
        total = jnp.matmul(moved, jnp.asarray(weights.T), precision=lax.Precision.HIGHEST)
        rounded = (total + (1 << (precision - 1))) >> precision
        x = jnp.moveaxis(jnp.clip(rounded, 0, 255).astype(jnp.uint8), -1, axis)
    return x


@lowers(aten.upsample_trilinear3d.default)
def upsample_trilinear3d(
    self, output_size, align_corners, scales_d=None, scales_h=None, scales_w=None
):
    return _taps(self, output_size, align_corners, (scales_d, scales_h, scales_w), cubic=False)


@lowers(aten.upsample_bicubic2d.default)
def upsample_bicubic2d(self, output_size, align_corners, scales_h=None, scales_w=None):
    if self.dtype == jnp.uint8:

        def weights(n, size, scale):
            return _keys_cubic_weights(n, size, align_corners, scale)

        return _resize_uint8(self, output_size, (scales_h, scales_w), weights)
    return _taps(self, output_size, align_corners, (scales_h, scales_w), cubic=True)


def _linear_backward(forward, grad_output, input_size):
    """The input gradient of ``forward``, a function linear in its input (upsampling):
    its VJP, taken at a zero input of ``input_size`` (any point would do)."""
    zeros = jnp.zeros(tuple(input_size), grad_output.dtype)
    _, vjp = jax.vjp(forward, zeros)
    return vjp(grad_output)[0]


def _nearest_backward(grad_output, output_size, input_size, scales, exact=False):
    return _linear_backward(
        lambda x: _nearest(x, output_size, scales, exact), grad_output, input_size
    )


@lowers(aten._upsample_nearest_exact1d_backward.default)
def _upsample_nearest_exact1d_backward(grad_output, output_size, input_size, scales=None):
    return _nearest_backward(grad_output, output_size, input_size, (scales,), exact=True)


@lowers(aten._upsample_nearest_exact2d_backward.default)
def _upsample_nearest_exact2d_backward(
    grad_output, output_size, input_size, scales_h=None, scales_w=None
):
    return _nearest_backward(grad_output, output_size, input_size, (scales_h, scales_w), True)


@lowers(aten._upsample_nearest_exact3d_backward.default)
def _upsample_nearest_exact3d_backward(
    grad_output, output_size, input_size, scales_d=None, scales_h=None, scales_w=None
):
    scales = (scales_d, scales_h, scales_w)
    return _nearest_backward(grad_output, output_size, input_size, scales, exact=True)


@lowers(aten.upsample_nearest1d_backward.default)
def upsample_nearest1d_backward(grad_output, output_size, input_size, scales=None):
    return _nearest_backward(grad_output, output_size, input_size, (scales,))


@lowers(aten.upsample_nearest2d_backward.default)
def upsample_nearest2d_backward(grad_output, output_size, input_size, scales_h=None, scales_w=None):
    return _nearest_backward(grad_output, output_size, input_size, (scales_h, scales_w))


@lowers(aten.upsample_nearest3d_backward.default)
def upsample_nearest3d_backward(
    grad_output, output_size, input_size, scales_d=None, scales_h=None, scales_w=None
):
    return _nearest_backward(grad_output, output_size, input_size, (scales_d, scales_h, scales_w))


def _antialias_weights(size_in, size_out, align_corners, scale, real):
    """The (size_out, size_in) matrix of torch's anti-aliased linear interpolation along
    one axis (UpSampleKernel.cpp's _compute_indices_min_size_weights_aa): a triangle
    filter widened by the scale when downsampling, normalised to sum to one per output.
    Sizes are static, so the matrix is a constant of the compiled function.

    The kernel computes in the opmath type ``real`` (float32 for float32 tensors), with
    some steps promoted to double by C++'s rules; each ``real(...)`` below is one of its
    roundings, so the weights match the kernel's and so do values near zero."""
    if align_corners:
        ratio = real(real(size_in) - 1) / real(size_out - 1) if size_out > 1 else real(0)
    elif scale is not None and scale > 0:
        ratio = real(1.0 / scale)
    else:
        ratio = real(size_in) / real(size_out)
    support = real(1.0 * float(ratio)) if ratio >= 1.0 else real(1.0)  # 2 taps * 0.5
    max_taps = int(math.ceil(support)) * 2 + 1
    invscale = real(1.0 / float(ratio)) if ratio >= 1.0 else real(1.0)
    weights = np.zeros((size_out, size_in), real)
    for i in range(size_out):
        center = real(float(ratio) * (i + 0.5))
        # int() truncates toward zero like the kernel's static_cast.
        start = max(int(float(center - support) + 0.5), 0)
        taps = min(max(min(int(float(center + support) + 0.5), size_in) - start, 0), max_taps)
        total = real(0)
        for j in range(taps):
            x = real((float(real(j + start) - center) + 0.5) * float(invscale))
            w = real(1.0 - abs(float(x))) if abs(x) < 1.0 else real(0)
            weights[i, start + j] = w
            total = real(total + w)
        if total != 0.0:
            weights[i, start : start + taps] /= total
    return weights


def _antialiased(self, op, output_size, align_corners, scales, filter_fn, taps, weights):
    """An antialiased resize of the last two axes: uint8 in fixed point as the CPU's
    kernel (Note [uint8 resizing in fixed point]), floats as one product with each
    axis's (size_out, size_in) ``weights(size_in, size_out, scale, real)``."""
    if self.dtype == jnp.uint8:

        def uint8_weights(n, size, scale):
            return _filter_weights(n, size, align_corners, scale, filter_fn, taps, True)

        return _resize_uint8(self, output_size, scales, uint8_weights)
    if not jnp.issubdtype(self.dtype, jnp.floating):
        unsupported.refuse(f"{op}: integer input", f" (got {self.dtype})")
    compute = opmath_dtype(self.dtype)
    real = np.float64 if compute == jnp.float64 else np.float32
    rows, cols = (
        jnp.asarray(weights(n, size, scale, real), compute)
        for n, size, scale in zip(self.shape[-2:], output_size, scales)
    )
    out = jnp.einsum(
        "...hw,Hh,Ww->...HW", self.astype(compute), rows, cols, precision=lax.Precision.HIGHEST
    )
    return out.astype(self.dtype)


@lowers(aten._upsample_bilinear2d_aa.default)
def _upsample_bilinear2d_aa(self, output_size, align_corners, scales_h=None, scales_w=None):
    def weights(n, size, scale, real):
        return _antialias_weights(n, size, align_corners, scale, real)

    scales = (scales_h, scales_w)
    return _antialiased(
        self,
        "_upsample_bilinear2d_aa",
        output_size,
        align_corners,
        scales,
        _linear_filter,
        2,
        weights,
    )


# Pillow's bicubic (a = -0.5), which torch's antialiased bicubic follows.
_PILLOW_CUBIC = _cubic_filter(-0.5)


@lowers(aten._upsample_bicubic2d_aa.default)
def _upsample_bicubic2d_aa(self, output_size, align_corners, scales_h=None, scales_w=None):
    def weights(n, size, scale, real):
        return _filter_weights(n, size, align_corners, scale, _PILLOW_CUBIC, 4, True)

    scales = (scales_h, scales_w)
    return _antialiased(
        self,
        "_upsample_bicubic2d_aa",
        output_size,
        align_corners,
        scales,
        _PILLOW_CUBIC,
        4,
        weights,
    )


def _backward_of(forward):
    """The backward op of an interpolation taking (x, output_size, align_corners, *scales):
    its arguments are (grad_output, output_size, input_size, align_corners, *scales)."""

    def backward(grad_output, output_size, input_size, align_corners, *scales):
        return _linear_backward(
            lambda x: forward(x, output_size, align_corners, *scales), grad_output, input_size
        )

    return backward


for _backward, _forward in {
    aten.upsample_linear1d_backward.default: upsample_linear1d,
    aten.upsample_bilinear2d_backward.default: upsample_bilinear2d,
    aten.upsample_trilinear3d_backward.default: upsample_trilinear3d,
    aten.upsample_bicubic2d_backward.default: upsample_bicubic2d,
    aten._upsample_bilinear2d_aa_backward.default: _upsample_bilinear2d_aa,
    aten._upsample_bicubic2d_aa_backward.default: _upsample_bicubic2d_aa,
}.items():
    lowers(_backward)(_backward_of(_forward))
