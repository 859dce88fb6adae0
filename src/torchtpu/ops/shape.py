"""Ops that rearrange or combine tensors: cat, stack, pad, repeat, flip, roll, ...
(view ops are in views.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
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


@lowers(aten.upsample_bilinear2d.default)
def upsample_bilinear2d(self, output_size, align_corners, scales_h=None, scales_w=None):
    x = self.astype(jnp.float32) if self.dtype in (jnp.float16, jnp.bfloat16) else self
    for i, (size_out, scale) in enumerate(zip(output_size, (scales_h, scales_w))):
        axis = self.ndim - 2 + i
        size_in = self.shape[axis]
        if align_corners:
            ratio = (size_in - 1) / (size_out - 1) if size_out > 1 else 0.0
            src = jnp.arange(size_out) * ratio
        else:
            ratio = (1.0 / scale) if scale else size_in / size_out
            src = jnp.maximum((jnp.arange(size_out) + 0.5) * ratio - 0.5, 0.0)
        lo = jnp.minimum(jnp.floor(src).astype(jnp.int64), size_in - 1)
        hi = jnp.minimum(lo + 1, size_in - 1)
        frac = (src - lo).astype(x.dtype)
        shape = [1] * x.ndim
        shape[axis] = size_out
        frac = frac.reshape(shape)
        x = jnp.take(x, lo, axis=axis) * (1 - frac) + jnp.take(x, hi, axis=axis) * frac
    return x.astype(self.dtype)


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


@lowers(aten.upsample_bilinear2d_backward.default)
def upsample_bilinear2d_backward(
    grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None
):
    return _linear_backward(
        lambda x: upsample_bilinear2d(x, output_size, align_corners, scales_h, scales_w),
        grad_output,
        input_size,
    )


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


@lowers(aten._upsample_bilinear2d_aa.default)
def _upsample_bilinear2d_aa(self, output_size, align_corners, scales_h=None, scales_w=None):
    if not jnp.issubdtype(self.dtype, jnp.floating):
        # torch's uint8 kernel rounds fixed-point weights: not reproduced here.
        raise NotImplementedError(f"_upsample_bilinear2d_aa of {self.dtype} on tpu")
    compute = jnp.float32 if self.dtype in (jnp.float16, jnp.bfloat16) else self.dtype
    h_in, w_in = self.shape[-2:]
    real = np.float64 if compute == jnp.float64 else np.float32
    rows = jnp.asarray(_antialias_weights(h_in, output_size[0], align_corners, scales_h, real))
    cols = jnp.asarray(_antialias_weights(w_in, output_size[1], align_corners, scales_w, real))
    out = jnp.einsum(
        "...hw,Hh,Ww->...HW", self.astype(compute), rows, cols, precision=lax.Precision.HIGHEST
    )
    return out.astype(self.dtype)


@lowers(aten._upsample_bilinear2d_aa_backward.default)
def _upsample_bilinear2d_aa_backward(
    grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None
):
    return _linear_backward(
        lambda x: _upsample_bilinear2d_aa(x, output_size, align_corners, scales_h, scales_w),
        grad_output,
        input_size,
    )


@lowers(aten.trace.default, compute_in_result=("self",))
def trace(self):
    return jnp.trace(self)
