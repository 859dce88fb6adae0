"""Neural-network ops: convolution, pooling, normalisation, embedding, softmax, RNN cells.

Where torch has a dedicated backward op, it is lowered as the JAX ``vjp`` of the
forward lowering, so forward and backward cannot disagree.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
from jax import lax

from torchtpu.ops.registry import aten, lowers
from torchtpu.ops.util import canonical_dim, opmath, opmath_dtype
from torchtpu.ops.value_checks import error_if

_LOW_FLOATS = (jnp.float16, jnp.bfloat16)


def _tuple(value, n):
    if isinstance(value, int):
        return (value,) * n
    value = tuple(value)
    return value * n if len(value) == 1 else value


# -- convolution --------------------------------------------------------------------------------


def _dimension_numbers(n):
    spatial = "DHW"[-n:] if n <= 3 else None
    return (f"NC{spatial}", f"OI{spatial}", f"NC{spatial}")


def _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups, precision):
    n = input.ndim - 2
    stride, padding, dilation = _tuple(stride, n), _tuple(padding, n), _tuple(dilation, n)
    numbers = _dimension_numbers(n)
    low = input.dtype in _LOW_FLOATS
    kwargs = dict(precision=precision, preferred_element_type=jnp.float32 if low else None)
    if not transposed:
        out = lax.conv_general_dilated(
            input,
            weight,
            window_strides=stride,
            padding=[(p, p) for p in padding],
            rhs_dilation=dilation,
            dimension_numbers=numbers,
            feature_group_count=groups,
            **kwargs,
        )
        return out.astype(input.dtype) if low else out
    # A transposed convolution is the gradient of a convolution: dilate the input by
    # the stride and convolve with the flipped, transposed kernel.
    output_padding = _tuple(output_padding, n)
    in_channels = weight.shape[0]
    k = weight.shape[2:]
    w = weight.reshape(groups, in_channels // groups, weight.shape[1], *k)
    w = jnp.swapaxes(w, 1, 2).reshape(groups * weight.shape[1], in_channels // groups, *k)
    w = jnp.flip(w, axis=tuple(range(2, 2 + n)))
    pads = [
        (
            dilation[i] * (k[i] - 1) - padding[i],
            dilation[i] * (k[i] - 1) - padding[i] + output_padding[i],
        )
        for i in range(n)
    ]
    out = lax.conv_general_dilated(
        input,
        w,
        window_strides=(1,) * n,
        padding=pads,
        lhs_dilation=stride,
        rhs_dilation=dilation,
        dimension_numbers=numbers,
        feature_group_count=groups,
        **kwargs,
    )
    return out.astype(input.dtype) if low else out


def _bias_shape(bias, ndim):
    return bias.reshape((1, -1) + (1,) * (ndim - 2))


@lowers(aten.convolution.default, precision=True)
def convolution(
    input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, *, precision
):
    # torch's ConvParams checks, which its meta kernel leaves to the device kernels
    if any(s <= 0 for s in stride):
        raise RuntimeError("non-positive stride is not supported")
    if any(p < 0 for p in padding):
        raise RuntimeError("negative padding is not supported")
    if any(p < 0 for p in output_padding):
        raise RuntimeError("negative output_padding is not supported")
    if any(d <= 0 for d in dilation):
        raise RuntimeError("dilation should be greater than zero")
    out = _conv(
        input, weight, stride, padding, dilation, transposed, output_padding, groups, precision
    )
    if bias is not None:
        out = out + _bias_shape(bias, out.ndim).astype(out.dtype)
    return out


@lowers(aten.convolution_backward.default, precision=True)
def convolution_backward(
    grad_output,
    input,
    weight,
    bias_sizes,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    output_mask,
    *,
    precision,
):
    def forward(x, w):
        return _conv(x, w, stride, padding, dilation, transposed, output_padding, groups, precision)

    _, vjp = jax.vjp(forward, input, weight)
    grad_input, grad_weight = vjp(grad_output.astype(input.dtype))
    grad_bias = jnp.sum(opmath(grad_output), axis=(0,) + tuple(range(2, grad_output.ndim))).astype(
        grad_output.dtype
    )
    return grad_input, grad_weight, grad_bias


# -- pooling ------------------------------------------------------------------------------------


def _pool_output_size(size, k, s, p, d, ceil_mode):
    numerator = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)
    out = numerator // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _windows(x, kernel, stride, padding, dilation, ceil_mode, pad_value):
    """All window positions as one stacked axis: (prod(kernel), N, C, *out)."""
    n = len(kernel)
    spatial = x.shape[-n:]
    out = [
        _pool_output_size(spatial[i], kernel[i], stride[i], padding[i], dilation[i], ceil_mode)
        for i in range(n)
    ]
    pads = [(0, 0)] * (x.ndim - n)
    for i in range(n):
        needed = (out[i] - 1) * stride[i] + dilation[i] * (kernel[i] - 1) + 1
        pads.append((padding[i], max(needed - spatial[i] - padding[i], padding[i])))
    padded = jnp.pad(x, pads, constant_values=pad_value)
    views = []
    for offsets in itertools.product(*(range(k) for k in kernel)):
        index = [slice(None)] * (x.ndim - n)
        for i, o in enumerate(offsets):
            start = o * dilation[i]
            index.append(slice(start, start + (out[i] - 1) * stride[i] + 1, stride[i]))
        views.append(padded[tuple(index)])
    return jnp.stack(views), out


def _pool_args(kernel_size, stride, padding, dilation, n):
    kernel = _tuple(kernel_size, n)
    stride = _tuple(stride, n) if stride else kernel
    return kernel, stride, _tuple(padding, n), _tuple(dilation, n)


def _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, n):
    kernel, stride, padding, dilation = _pool_args(kernel_size, stride, padding, dilation, n)
    low = -jnp.inf if jnp.issubdtype(self.dtype, jnp.floating) else jnp.iinfo(self.dtype).min
    windows, out = _windows(self, kernel, stride, padding, dilation, ceil_mode, low)
    # NaN wins, as in torch.
    nan = jnp.isnan(windows) if jnp.issubdtype(self.dtype, jnp.floating) else None
    keyed = jnp.where(nan, jnp.inf, windows) if nan is not None else windows
    which = jnp.argmax(keyed, axis=0)
    values = jnp.take_along_axis(windows, which[None], axis=0)[0]
    # Flat index into the input's spatial dims of the chosen element.
    spatial = self.shape[-n:]
    offsets = jnp.asarray(list(itertools.product(*(range(k) for k in kernel))), jnp.int64)  # (K, n)
    chosen = offsets[which]  # (..., *out, n)
    flat = jnp.zeros(which.shape, jnp.int64)
    for i in range(n):
        shape = [1] * which.ndim
        shape[which.ndim - n + i] = out[i]
        base = (jnp.arange(out[i], dtype=jnp.int64) * stride[i] - padding[i]).reshape(shape)
        position = base + chosen[..., i] * dilation[i]
        flat = flat * spatial[i] + position
    return values, flat


@lowers(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, 2)


@lowers(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, 3)


def _max_pool_backward(grad_output, self, indices, n):
    lead = self.shape[:-n]
    size = math.prod(self.shape[-n:])
    if math.prod(lead) == 0:
        return jnp.zeros(self.shape, grad_output.dtype)
    grad = jnp.zeros(lead + (size,), grad_output.dtype)
    g = grad_output.reshape(lead + (-1,))
    idx = indices.reshape(lead + (-1,))
    grad = jax.vmap(lambda z, i, v: z.at[i].add(v))(
        grad.reshape(-1, size), idx.reshape(-1, idx.shape[-1]), g.reshape(-1, g.shape[-1])
    )
    return grad.reshape(self.shape)


@lowers(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(
    grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices
):
    return _max_pool_backward(grad_output, self, indices, 2)


@lowers(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(
    grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices
):
    return _max_pool_backward(grad_output, self, indices, 3)


def _max_unpool(self, indices, output_size):
    """Each value to its index in its plane of the output, zeros elsewhere. torch's
    decomposition scatters into one flat buffer, so an index past its plane wrote into
    the next plane; the CPU kernel refuses it, and so does this one."""
    n = len(output_size)
    plane = math.prod(output_size)
    error_if(
        jnp.any((indices < 0) | (indices >= plane)),
        RuntimeError,
        "Found an invalid max index (output volumes are of size "
        + "x".join(map(str, output_size))
        + ")",
    )
    lead = self.shape[:-n]
    values = self.reshape(math.prod(lead), -1)
    out = jnp.zeros((values.shape[0], plane), self.dtype)
    rows = jnp.arange(values.shape[0])[:, None]
    out = out.at[rows, indices.reshape(values.shape)].set(values, mode="drop")
    return out.reshape(*lead, *output_size)


@lowers(aten.max_unpool2d.default)
def max_unpool2d(self, indices, output_size):
    return _max_unpool(self, indices, output_size)


@lowers(aten.max_unpool3d.default)
def max_unpool3d(self, indices, output_size, stride, padding):
    return _max_unpool(self, indices, output_size)


def _avg_pool(
    self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, n
):
    kernel, stride, padding, _ = _pool_args(kernel_size, stride, padding, 1, n)
    spatial = self.shape[-n:]
    out = [
        _pool_output_size(spatial[i], kernel[i], stride[i], padding[i], 1, ceil_mode)
        for i in range(n)
    ]
    x = opmath(self)
    total = _window_sum(x, kernel, stride, padding, out, 0)
    if divisor_override:
        return (total / divisor_override).astype(self.dtype)
    ones = jnp.ones(spatial, x.dtype)
    count = _window_sum(ones, kernel, stride, padding, out, 1 if count_include_pad else 0)
    return (total / count).astype(self.dtype)


def _window_sum(x, kernel, stride, padding, out, pad_value):
    """The sum of each window over the last ``len(kernel)`` dims, as one reduce_window
    (a program of constant size: stacking every window offset, as max pooling does,
    grows with the kernel; EfficientNet pools with a 320 x 320 kernel). ``padding`` is
    filled with ``pad_value``; the overhang of ceil_mode with zeros (it never counts)."""
    n = len(kernel)
    lead = x.ndim - n
    x = jnp.pad(x, [(0, 0)] * lead + [(p, p) for p in padding], constant_values=pad_value)
    overhang = [max((out[i] - 1) * stride[i] + kernel[i] - x.shape[lead + i], 0) for i in range(n)]
    x = jnp.pad(x, [(0, 0)] * lead + [(0, h) for h in overhang])
    # A concrete zero: JAX then knows the sum and can differentiate it.
    total = lax.reduce_window(
        x,
        x.dtype.type(0),
        lax.add,
        (1,) * lead + tuple(kernel),
        (1,) * lead + tuple(stride),
        "VALID",
    )
    return total[(slice(None),) * lead + tuple(slice(0, o) for o in out)]


@lowers(aten.avg_pool2d.default)
def avg_pool2d(
    self,
    kernel_size,
    stride=(),
    padding=0,
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
):
    return _avg_pool(
        self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2
    )


@lowers(aten.avg_pool3d.default)
def avg_pool3d(
    self,
    kernel_size,
    stride=(),
    padding=0,
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
):
    return _avg_pool(
        self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3
    )


@lowers(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(
    grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
):
    _, vjp = jax.vjp(
        lambda x: _avg_pool(
            x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2
        ),
        self,
    )
    return vjp(grad_output)[0]


@lowers(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(
    grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
):
    _, vjp = jax.vjp(
        lambda x: _avg_pool(
            x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3
        ),
        self,
    )
    return vjp(grad_output)[0]


def _adaptive_bins(size, out):
    """torch's adaptive bins along one dim: (out, K) positions and validity, where K
    is the widest bin; bin i spans [floor(i * size / out), ceil((i + 1) * size / out))."""
    starts = [(i * size) // out for i in range(out)]
    ends = [-((-(i + 1) * size) // out) for i in range(out)]
    width = max(e - s for s, e in zip(starts, ends))
    positions = [[min(s + k, size - 1) for k in range(width)] for s in starts]
    valid = [[s + k < e for k in range(width)] for s, e in zip(starts, ends)]
    return jnp.asarray(positions, jnp.int64), jnp.asarray(valid)


def _adaptive_max_pool(self, output_size, n):
    spatial, out = self.shape[-n:], _tuple(output_size, n)
    bins = [_adaptive_bins(size, o) for size, o in zip(spatial, out)]  # (o, K) per dim
    # windows[..., i_1, ..., i_n, k_1, ..., k_n] = self[..., pos_1[i_1, k_1], ...]
    positions, valid, flat = [], True, 0
    for d, ((pos, ok), size) in enumerate(zip(bins, spatial)):
        shape = [1] * (2 * n)
        shape[d], shape[n + d] = pos.shape
        positions.append(pos.reshape(shape))
        valid = valid & ok.reshape(shape)
        flat = flat * size + pos.reshape(shape)
    window = math.prod(pos.shape[1] for pos, _ in bins)
    windows = self[(Ellipsis, *positions)].reshape(self.shape[:-n] + tuple(out) + (window,))
    valid = jnp.broadcast_to(valid, tuple(out) + flat.shape[n:]).reshape(tuple(out) + (window,))
    flat = jnp.broadcast_to(flat, valid.shape[:n] + flat.shape[n:]).reshape(valid.shape)
    low = -jnp.inf if jnp.issubdtype(self.dtype, jnp.floating) else jnp.iinfo(self.dtype).min
    # NaN wins, as in torch; then the first of equal maxima.
    keyed = (
        jnp.where(jnp.isnan(windows), jnp.inf, windows)
        if jnp.issubdtype(self.dtype, jnp.floating)
        else windows
    )
    which = jnp.argmax(jnp.where(valid, keyed, low), axis=-1)
    values = jnp.take_along_axis(windows, which[..., None], axis=-1)[..., 0]
    chosen = jnp.broadcast_to(flat, windows.shape)
    indices = jnp.take_along_axis(chosen, which[..., None], axis=-1)[..., 0]
    return values, indices


@lowers(aten.adaptive_max_pool2d.default)
def adaptive_max_pool2d(self, output_size):
    return _adaptive_max_pool(self, output_size, 2)


@lowers(aten.adaptive_max_pool3d.default)
def adaptive_max_pool3d(self, output_size):
    return _adaptive_max_pool(self, output_size, 3)


@lowers(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad_output, self, indices):
    return _max_pool_backward(grad_output, self, indices, 2)


@lowers(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad_output, self, indices):
    return _max_pool_backward(grad_output, self, indices, 3)


# Fractional max pooling (Graham 2014): windows of a fixed size whose starts follow a
# pseudo-random sequence per plane, drawn from the op's random_samples input (so the
# op itself is deterministic). Which sample drives which dim is torch's choice: W, H in
# 2d and T, H, W in 3d.
_FRACTIONAL_SAMPLE_OF_DIM = {2: (1, 0), 3: (0, 1, 2)}


def _fractional_starts(sample, size, out, pool):
    """torch's window starts (..., out) along a dim, from per-plane samples (...), in the
    samples' dtype as torch's kernel computes them."""
    last = jnp.full(sample.shape + (1,), size - pool, jnp.int64)
    if out == 1:
        return last
    alpha = jnp.asarray(size - pool, sample.dtype) / jnp.asarray(out - 1, sample.dtype)
    steps = jnp.arange(out - 1, dtype=sample.dtype)
    starts = ((steps + sample[..., None]) * alpha).astype(jnp.int64)
    starts = starts - (sample * alpha).astype(jnp.int64)[..., None]
    return jnp.concatenate([starts, last], axis=-1)


def _fractional_max_pool(self, kernel_size, output_size, random_samples, n):
    batched = self if self.ndim == n + 2 else self[None]
    samples = random_samples.reshape(batched.shape[:2] + (n,))
    spatial = batched.shape[2:]
    pools, outs = _tuple(kernel_size, n), _tuple(output_size, n)
    # Window element positions, broadcast to (N, C, out_1..out_n, pool_1..pool_n).
    index = [
        jnp.arange(batched.shape[0]).reshape((-1,) + (1,) * (2 * n + 1)),
        jnp.arange(batched.shape[1]).reshape((1, -1) + (1,) * (2 * n)),
    ]
    flat = 0
    for d, which in enumerate(_FRACTIONAL_SAMPLE_OF_DIM[n]):
        starts = _fractional_starts(samples[..., which], spatial[d], outs[d], pools[d])
        shape = list(batched.shape[:2]) + [1] * (2 * n)
        shape[2 + d], shape[2 + n + d] = outs[d], pools[d]
        position = (starts[..., None] + jnp.arange(pools[d])).reshape(shape)
        index.append(position)
        flat = flat * spatial[d] + position
    windows = batched[tuple(index)]
    window_shape = windows.shape[: 2 + n] + (math.prod(pools),)
    windows = windows.reshape(window_shape)
    flat = jnp.broadcast_to(flat, windows.shape[:-1] + tuple(pools)).reshape(window_shape)
    # torch keeps the first of equal maxima, but the last NaN.
    nan = jnp.isnan(windows)
    last_nan = windows.shape[-1] - 1 - jnp.argmax(nan[..., ::-1], axis=-1)
    which = jnp.where(jnp.any(nan, axis=-1), last_nan, jnp.argmax(windows, axis=-1))
    values = jnp.take_along_axis(windows, which[..., None], axis=-1)[..., 0]
    indices = jnp.take_along_axis(flat, which[..., None], axis=-1)[..., 0]
    if self.ndim != n + 2:
        values, indices = values[0], indices[0]
    return values, indices


@lowers(aten.fractional_max_pool2d.default)
def fractional_max_pool2d(self, kernel_size, output_size, random_samples):
    return _fractional_max_pool(self, kernel_size, output_size, random_samples, 2)


@lowers(aten.fractional_max_pool3d.default)
def fractional_max_pool3d(self, kernel_size, output_size, random_samples):
    return _fractional_max_pool(self, kernel_size, output_size, random_samples, 3)


@lowers(aten.fractional_max_pool2d_backward.default)
def fractional_max_pool2d_backward(grad_output, self, kernel_size, output_size, indices):
    return _max_pool_backward(grad_output, self, indices, 2)


@lowers(aten.fractional_max_pool3d_backward.default)
def fractional_max_pool3d_backward(grad_output, self, kernel_size, output_size, indices):
    return _max_pool_backward(grad_output, self, indices, 3)


def _adaptive_matrix(size, out, dtype):
    """(out, size) averaging weights of torch's adaptive bins."""
    rows = []
    for i in range(out):
        start = (i * size) // out
        end = -((-(i + 1) * size) // out)
        row = [0.0] * size
        for j in range(start, end):
            row[j] = 1.0 / (end - start)
        rows.append(row)
    return jnp.asarray(rows, dtype)


def _adaptive_avg_pool(self, output_size, n):
    output_size = _tuple(output_size, n)
    x = opmath(self)
    for i in range(n):
        axis = self.ndim - n + i
        m = _adaptive_matrix(self.shape[axis], output_size[i], x.dtype)
        x = jnp.moveaxis(
            jnp.tensordot(x, m, axes=([axis], [1]), precision=lax.Precision.HIGHEST), -1, axis
        )
    return x.astype(self.dtype)


@lowers(aten._adaptive_avg_pool2d.default)
def _adaptive_avg_pool2d(self, output_size):
    return _adaptive_avg_pool(self, output_size, 2)


@lowers(aten._adaptive_avg_pool3d.default)
def _adaptive_avg_pool3d(self, output_size):
    return _adaptive_avg_pool(self, output_size, 3)


@lowers(aten._adaptive_avg_pool2d_backward.default)
def _adaptive_avg_pool2d_backward(grad_output, self):
    _, vjp = jax.vjp(lambda x: _adaptive_avg_pool(x, grad_output.shape[-2:], 2), self)
    return vjp(grad_output)[0]


@lowers(aten._adaptive_avg_pool3d_backward.default)
def _adaptive_avg_pool3d_backward(grad_output, self):
    _, vjp = jax.vjp(lambda x: _adaptive_avg_pool(x, grad_output.shape[-3:], 3), self)
    return vjp(grad_output)[0]


# -- grid sampling --------------------------------------------------------------------------------
# torch's GridSampler.h formulas, for any number of spatial axes. Modes: interpolation
# 0 bilinear, 1 nearest, 2 bicubic (2-d only); padding 0 zeros, 1 border, 2 reflection.


def _grid_unnormalize(coord, size, align_corners):
    """[-1, 1] -> pixel coordinates."""
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _grid_reflect(coord, twice_low, twice_high):
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    coord = jnp.abs(coord - low)
    extra = jnp.fmod(coord, span)
    flips = jnp.floor(coord / span)
    return jnp.where(flips % 2 == 0, extra + low, span - extra + low)


def _grid_pad(coord, size, padding_mode, align_corners):
    """torch's compute_coordinates: where a coordinate outside the input reads."""
    if padding_mode == 2:
        twice = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        coord = _grid_reflect(coord, *twice)
    if padding_mode in (1, 2):
        coord = jnp.clip(coord, 0, size - 1)
    return coord


def _grid_read(flat, sizes, indices):
    """flat (N, C, prod(sizes)) at integer ``indices`` (one (N, P) array per spatial
    axis): (N, C, P), zero where an index is outside the input."""
    inside = functools.reduce(jnp.logical_and, [(i >= 0) & (i < s) for i, s in zip(indices, sizes)])
    linear = 0
    for i, s in zip(indices, sizes):
        linear = linear * s + jnp.clip(i, 0, s - 1)
    values = jnp.take_along_axis(flat, linear[:, None, :], axis=2)
    return jnp.where(inside[:, None, :], values, 0)


def _cubic_weights(t):
    """The four taps' weights at fraction t (torch's cubic convolution, A = -0.75)."""
    a = -0.75

    def near(x):
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return far(t + 1), near(t), near(1 - t), far(2 - t)


def _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners):
    n = grid.shape[-1]
    batch, channels, *sizes = input.shape
    flat = input.reshape(batch, channels, -1)
    # The grid lists x (the last axis) first.
    coords = [
        _grid_unnormalize(grid[..., n - 1 - axis].reshape(batch, -1), size, align_corners)
        for axis, size in enumerate(sizes)
    ]
    if interpolation_mode == 2:
        # Each tap is padded on its own, after the fractions are taken.
        low = [jnp.floor(c) for c in coords]
        weights = [_cubic_weights(c - lo) for c, lo in zip(coords, low)]
        out = 0
        for taps in itertools.product(range(4), repeat=n):
            indices, weight = [], 1
            for lo, w, size, tap in zip(low, weights, sizes, taps):
                padded = _grid_pad(lo - 1 + tap, size, padding_mode, align_corners)
                indices.append(padded.astype(jnp.int64))
                weight = weight * w[tap]
            out = out + _grid_read(flat, sizes, indices) * weight[:, None, :]
    else:
        coords = [_grid_pad(c, size, padding_mode, align_corners) for c, size in zip(coords, sizes)]
        if interpolation_mode == 1:
            # std::nearbyint: halves round to even, as jnp.round does.
            out = _grid_read(flat, sizes, [jnp.round(c).astype(jnp.int64) for c in coords])
        else:
            low = [jnp.floor(c) for c in coords]
            out = 0
            for corner in itertools.product((0, 1), repeat=n):
                weight = 1
                for c, lo, bit in zip(coords, low, corner):
                    weight = weight * ((c - lo) if bit else (lo + 1 - c))
                indices = [(lo + bit).astype(jnp.int64) for lo, bit in zip(low, corner)]
                out = out + _grid_read(flat, sizes, indices) * weight[:, None, :]
    return out.reshape(batch, channels, *grid.shape[1:-1])


@lowers(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def grid_sampler(input, grid, interpolation_mode, padding_mode, align_corners):
    compute = opmath_dtype(input.dtype)
    out = _grid_sample(
        input.astype(compute), grid.astype(compute), interpolation_mode, padding_mode, align_corners
    )
    return out.astype(input.dtype)


@lowers(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default)
def grid_sampler_backward(
    grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask
):
    _, vjp = jax.vjp(
        lambda x, g: grid_sampler(x, g, interpolation_mode, padding_mode, align_corners),
        input,
        grid,
    )
    return vjp(grad_output)


# -- normalisation ------------------------------------------------------------------------------


def _batch_norm_train(input, weight, bias, eps):
    x = opmath(input)
    axes = (0,) + tuple(range(2, input.ndim))
    mean = jnp.mean(x, axis=axes)
    var = jnp.mean(jnp.square(x - _bias_shape(mean, x.ndim)), axis=axes)
    invstd = lax.rsqrt(var + eps)
    out = _normalise(x, mean, invstd, weight, bias).astype(input.dtype)
    return out, mean, invstd, var


def _normalise(x, mean, invstd, weight, bias):
    out = (x - _bias_shape(mean, x.ndim)) * _bias_shape(invstd, x.ndim)
    if weight is not None:
        out = out * _bias_shape(weight.astype(out.dtype), x.ndim)
    if bias is not None:
        out = out + _bias_shape(bias.astype(out.dtype), x.ndim)
    return out


def _updated_stats(input, mean, var, running_mean, running_var, momentum):
    n = input.size // input.shape[1]
    unbiased = var * (n / max(n - 1, 1))
    new_mean = (1 - momentum) * running_mean + momentum * mean.astype(running_mean.dtype)
    new_var = (1 - momentum) * running_var + momentum * unbiased.astype(running_var.dtype)
    return new_mean, new_var


def _batch_norm_eval(input, weight, bias, running_mean, running_var, eps):
    # torch's meta kernels size the saved mean and invstd (C,) in eval mode too (CPU
    # kernels return them empty), and outputs take the meta shapes: they are the
    # running statistics here, which no backward reads.
    x = opmath(input)
    mean = opmath(running_mean)
    invstd = lax.rsqrt(opmath(running_var) + eps)
    return _normalise(x, mean, invstd, weight, bias).astype(input.dtype), mean, invstd


@lowers(aten._native_batch_norm_legit_functional.default, cpu_statistics=True)
def _native_batch_norm_legit_functional(
    input, weight, bias, running_mean, running_var, training, momentum, eps
):
    if not training:
        out, a, b = _batch_norm_eval(input, weight, bias, running_mean, running_var, eps)
        return out, a, b, running_mean, running_var
    out, mean, invstd, var = _batch_norm_train(input, weight, bias, eps)
    new_mean, new_var = _updated_stats(input, mean, var, running_mean, running_var, momentum)
    return out, mean, invstd, new_mean, new_var


@lowers(aten._native_batch_norm_legit.no_stats, cpu_statistics=True)
def _native_batch_norm_legit_no_stats(input, weight, bias, training, momentum, eps):
    out, mean, invstd, _ = _batch_norm_train(input, weight, bias, eps)
    return out, mean, invstd


@lowers(aten._native_batch_norm_legit_no_training.default, cpu_statistics=True)
def _native_batch_norm_legit_no_training(
    input, weight, bias, running_mean, running_var, momentum, eps
):
    return _batch_norm_eval(input, weight, bias, running_mean, running_var, eps)


@lowers(aten.native_batch_norm.default, cpu_statistics=True)
def native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    if training or running_mean is None:
        out, mean, invstd, _ = _batch_norm_train(input, weight, bias, eps)
        return out, mean, invstd
    return _batch_norm_eval(input, weight, bias, running_mean, running_var, eps)


@lowers(aten._batch_norm_with_update_functional.default, cpu_statistics=True)
def _batch_norm_with_update_functional(
    input, weight, bias, running_mean, running_var, momentum, eps
):
    out, mean, invstd, var = _batch_norm_train(input, weight, bias, eps)
    new_mean, new_var = _updated_stats(input, mean, var, running_mean, running_var, momentum)
    return out, mean, invstd, jnp.zeros((0,), jnp.uint8), new_mean, new_var


@lowers(aten._batch_norm_no_update.default, cpu_statistics=True)
def _batch_norm_no_update(input, weight, bias, running_mean, running_var, momentum, eps):
    if running_mean is None:
        out, mean, invstd, _ = _batch_norm_train(input, weight, bias, eps)
        return out, mean, invstd, jnp.zeros((0,), jnp.uint8)
    out, a, b = _batch_norm_eval(input, weight, bias, running_mean, running_var, eps)
    return out, a, b, jnp.zeros((0,), jnp.uint8)


def _normalisation_grads(g, xhat, invstd, w, axes):
    """Gradient of ``w * xhat`` w.r.t. x, where ``xhat = (x - mean(x)) * invstd`` is
    normalised over ``axes`` (mean and invstd broadcastable to x)."""
    gw = g if w is None else g * w
    mean_gw = jnp.mean(gw, axis=axes, keepdims=True)
    mean_gw_xhat = jnp.mean(gw * xhat, axis=axes, keepdims=True)
    return invstd * (gw - mean_gw - xhat * mean_gw_xhat)


def _batch_norm_grads(
    grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps
):
    x, g = opmath(input), opmath(grad_out)
    axes = (0,) + tuple(range(2, x.ndim))
    if train:
        mean, invstd = opmath(save_mean), opmath(save_invstd)
    else:
        mean, invstd = opmath(running_mean), lax.rsqrt(opmath(running_var) + eps)
    mean, invstd = _bias_shape(mean, x.ndim), _bias_shape(invstd, x.ndim)
    w = None if weight is None else _bias_shape(opmath(weight), x.ndim)
    xhat = (x - mean) * invstd
    if train:
        grad_input = _normalisation_grads(g, xhat, invstd, w, axes)
    else:
        grad_input = g * invstd * (1 if w is None else w)
    grad_weight = jnp.sum(g * xhat, axis=axes)
    grad_bias = jnp.sum(g, axis=axes)
    return grad_input.astype(input.dtype), grad_weight, grad_bias


@lowers(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(
    grad_out,
    input,
    weight,
    running_mean,
    running_var,
    save_mean,
    save_invstd,
    train,
    eps,
    output_mask,
):
    return _batch_norm_grads(
        grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps
    )


@lowers(aten.batch_norm_backward.default)
def batch_norm_backward(
    grad_out,
    input,
    weight,
    running_mean,
    running_var,
    save_mean,
    save_var,
    update,
    eps,
    output_mask,
    reserve,
):
    train = update or running_mean is None
    return _batch_norm_grads(
        grad_out, input, weight, running_mean, running_var, save_mean, save_var, train, eps
    )


def _layer_norm(input, normalized_shape, weight, bias, eps):
    x = opmath(input)
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * opmath(weight)
    if bias is not None:
        out = out + opmath(bias)
    return out.astype(input.dtype), mean, rstd


@lowers(aten.native_layer_norm.default, cpu_statistics=True)
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    return _layer_norm(input, normalized_shape, weight, bias, eps)


@lowers(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(
    grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask
):
    x, g = opmath(input), opmath(grad_out)
    k = len(normalized_shape)
    axes = tuple(range(x.ndim - k, x.ndim))
    lead = tuple(range(x.ndim - k))
    xhat = (x - mean) * rstd
    w = None if weight is None else opmath(weight)
    grad_input = _normalisation_grads(g, xhat, rstd, w, axes)
    grad_weight = jnp.sum(g * xhat, axis=lead) if weight is not None else None
    grad_bias = jnp.sum(g, axis=lead) if bias is not None else None
    return grad_input.astype(input.dtype), grad_weight, grad_bias


def _group_norm(input, weight, bias, N, C, HxW, group, eps):
    # (Sizes spelt out: an empty batch leaves nothing to infer a -1 from.)
    x = opmath(input).reshape(N, group, C // group * HxW)
    mean = jnp.mean(x, axis=-1)
    var = jnp.mean(jnp.square(x - mean[..., None]), axis=-1)
    rstd = lax.rsqrt(var + eps)
    out = ((x - mean[..., None]) * rstd[..., None]).reshape(input.shape)
    shape = (1, C) + (1,) * (input.ndim - 2)
    if weight is not None:
        out = out * opmath(weight).reshape(shape)
    if bias is not None:
        out = out + opmath(bias).reshape(shape)
    return out.astype(input.dtype), mean, rstd


@lowers(aten.native_group_norm.default, cpu_statistics=True)
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    return _group_norm(input, weight, bias, N, C, HxW, group, eps)


@lowers(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    x = opmath(input).reshape(N, group, C // group, -1)
    g = opmath(grad_out).reshape(x.shape)
    m, r = mean[:, :, None, None], rstd[:, :, None, None]
    xhat = (x - m) * r
    w = None if weight is None else opmath(weight).reshape(1, group, C // group, 1)
    grad_input = _normalisation_grads(g, xhat, r, w, (2, 3)).reshape(input.shape)
    grad_weight = jnp.sum(g * xhat, axis=(0, 3)).reshape(C)
    grad_bias = jnp.sum(g, axis=(0, 3)).reshape(C)
    return grad_input.astype(input.dtype), grad_weight, grad_bias


@lowers(aten._fused_rms_norm.default)
def _fused_rms_norm(input, normalized_shape, weight, eps):
    x = opmath(input)
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    if eps is None:
        eps = float(jnp.finfo(x.dtype).eps)
    rstd = lax.rsqrt(jnp.mean(x * x, axis=axes, keepdims=True) + eps)
    out = x * rstd
    if weight is not None:
        out = out * opmath(weight)
    return out.astype(input.dtype), rstd


# -- embedding ----------------------------------------------------------------------------------


@lowers(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    n = weight.shape[0]
    error_if(jnp.any((indices < 0) | (indices >= n)), IndexError, "index out of range in self")
    return jnp.take(weight, indices, axis=0)


@lowers(aten.embedding_renorm.default)
def embedding_renorm(self, indices, max_norm, norm_type):
    # The rows that ``indices`` use are scaled down to a norm of at most max_norm,
    # with torch's 1e-7 slack; other rows are left alone.
    x = opmath(self)
    norms = jnp.sum(jnp.abs(x) ** norm_type, axis=1, keepdims=True) ** (1.0 / norm_type)
    used = jnp.zeros((self.shape[0], 1), bool).at[indices.reshape(-1)].set(True)
    scale = jnp.where(used & (norms > max_norm), max_norm / (norms + 1e-7), 1.0)
    return (x * scale).astype(self.dtype)


@lowers(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    idx = indices.reshape(-1)
    grad = opmath(grad_output).reshape(idx.shape[0], -1)
    if padding_idx >= 0:
        grad = jnp.where((idx == padding_idx)[:, None], 0, grad)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), grad.dtype).at[idx].add(1)
        grad = grad / counts[idx][:, None]
    out = jnp.zeros((num_weights, grad.shape[1]), grad.dtype).at[idx].add(grad)
    return out.reshape((num_weights,) + grad_output.shape[indices.ndim :]).astype(grad_output.dtype)


# -- softmax ------------------------------------------------------------------------------------


@lowers(aten._softmax.default)
def _softmax(self, dim, half_to_float):
    x = opmath(self)
    if x.ndim == 0:
        return jnp.ones_like(x)
    return jax.nn.softmax(x, axis=canonical_dim(dim, self.ndim))


@lowers(aten._log_softmax.default)
def _log_softmax(self, dim, half_to_float):
    x = opmath(self)
    if x.ndim == 0:
        return jnp.zeros_like(x)
    return jax.nn.log_softmax(x, axis=canonical_dim(dim, self.ndim))


@lowers(aten._softmax_backward_data.default)
def _softmax_backward_data(grad_output, output, dim, input_dtype):
    g, y = opmath(grad_output), opmath(output)
    if y.ndim == 0:
        return jnp.zeros_like(g)
    axis = canonical_dim(dim, y.ndim)
    return y * (g - jnp.sum(g * y, axis=axis, keepdims=True))


@lowers(aten._log_softmax_backward_data.default)
def _log_softmax_backward_data(grad_output, output, dim, input_dtype):
    g, y = opmath(grad_output), opmath(output)
    if y.ndim == 0:
        return jnp.zeros_like(g)
    axis = canonical_dim(dim, y.ndim)
    return g - jnp.exp(y) * jnp.sum(g, axis=axis, keepdims=True)


# -- fused recurrent cells (torch's LSTM/GRU use these on accelerator devices) --------------------


def _sigmoid_grad(y):
    return y * (1 - y)


@lowers(aten._thnn_fused_lstm_cell.default)
def _thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias + hidden_bias
    i, f, g, o = jnp.split(gates, 4, axis=1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * cx + i * g
    hy = o * jnp.tanh(cy)
    # The workspace keeps the activated gates for the backward.
    return hy, cy, jnp.concatenate([i, f, g, o], axis=1)


@lowers(aten._thnn_fused_lstm_cell_backward_impl.default)
def _thnn_fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    i, f, g, o = jnp.split(workspace, 4, axis=1)
    tanh_cy = jnp.tanh(cy)
    d_hy = jnp.zeros_like(cy) if grad_hy is None else grad_hy
    d_cy = (jnp.zeros_like(cy) if grad_cy is None else grad_cy) + d_hy * o * (1 - tanh_cy * tanh_cy)
    grad_gates = jnp.concatenate(
        [
            d_cy * g * _sigmoid_grad(i),
            d_cy * cx * _sigmoid_grad(f),
            d_cy * i * (1 - g * g),
            d_hy * tanh_cy * _sigmoid_grad(o),
        ],
        axis=1,
    )
    grad_bias = jnp.sum(grad_gates, axis=0) if has_bias else None
    return grad_gates, d_cy * f, grad_bias


@lowers(aten._thnn_fused_gru_cell.default)
def _thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    if input_bias is not None:
        input_gates = input_gates + input_bias
        hidden_gates = hidden_gates + hidden_bias
    i_r, i_z, i_n = jnp.split(input_gates, 3, axis=1)
    h_r, h_z, h_n = jnp.split(hidden_gates, 3, axis=1)
    r = jax.nn.sigmoid(i_r + h_r)
    z = jax.nn.sigmoid(i_z + h_z)
    n = jnp.tanh(i_n + r * h_n)
    hy = n + z * (hx - n)
    return hy, jnp.concatenate([r, z, n, hx, h_n], axis=1)


@lowers(aten._thnn_fused_gru_cell_backward.default)
def _thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hx, h_n = jnp.split(workspace, 5, axis=1)
    d_n = grad_hy * (1 - z) * (1 - n * n)
    d_z = grad_hy * (hx - n) * _sigmoid_grad(z)
    d_r = d_n * h_n * _sigmoid_grad(r)
    grad_input_gates = jnp.concatenate([d_r, d_z, d_n], axis=1)
    grad_hidden_gates = jnp.concatenate([d_r, d_z, d_n * r], axis=1)
    grad_hx = grad_hy * z
    if has_bias:
        return (
            grad_input_gates,
            grad_hidden_gates,
            grad_hx,
            jnp.sum(grad_input_gates, 0),
            jnp.sum(grad_hidden_gates, 0),
        )
    return grad_input_gates, grad_hidden_gates, grad_hx, None, None


@lowers(aten._weight_norm_interface_backward.default)
def _weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    # w = v * g / ||v||, the norm over every dimension but `dim` (kept as size 1, as
    # saved_g and saved_norms are). As torch's kernel: from the saved norms.
    axes = tuple(d for d in range(saved_v.ndim) if d != dim)
    grad_g = jnp.sum(grad_w * saved_v, axis=axes, keepdims=True) / saved_norms
    grad_v = (saved_g / saved_norms) * (grad_w - saved_v * (grad_g / saved_norms))
    return grad_v, grad_g.reshape(saved_g.shape)


# -- attention ----------------------------------------------------------------------------------


@lowers(
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    static=("dropout_p", "is_causal", "scale"),
    precision=True,
)
def _scaled_dot_product_flash_attention_for_cpu(
    query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None, *, precision
):
    """torch's CPU flash attention: the output and the log-sum-exp of each query's scores
    (float32 for 16-bit inputs). torch's own decomposition of the op returns the
    attention weights in place of the log-sum-exp, so it is lowered here. A query that
    may attend to no key gets zeros and a log-sum-exp of 0, as the CPU kernel gives."""
    if dropout_p > 0:
        raise RuntimeError(
            "scaled_dot_product_attention_flash_attention: Currently do not support dropout > 0"
        )
    work = opmath_dtype(query.dtype)
    q, k, v = (x.astype(work) for x in (query, key, value))
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` heads
        k, v = jnp.repeat(k, groups, axis=-3), jnp.repeat(v, groups, axis=-3)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = jnp.matmul(q, jnp.swapaxes(k, -1, -2), precision=precision) * scale
    if is_causal:
        length, keys = scores.shape[-2:]
        scores = jnp.where(jnp.tril(jnp.ones((length, keys), bool)), scores, -jnp.inf)
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            scores = jnp.where(attn_mask, scores, -jnp.inf)
        else:
            scores = scores + attn_mask.astype(work)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    empty = jnp.isneginf(peak)  # no key to attend to
    weights = jnp.exp(scores - jnp.where(empty, 0, peak))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.matmul(weights / jnp.where(empty, 1, total), v, precision=precision)
    lse = jnp.where(empty, 0, peak + jnp.log(jnp.where(empty, 1, total)))[..., 0]
    return out.astype(query.dtype), lse.astype(jnp.float32 if work != jnp.float64 else work)


@lowers(
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    static=("dropout_p", "is_causal", "scale"),
    precision=True,
)
def _scaled_dot_product_flash_attention_for_cpu_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    dropout_p,
    is_causal,
    attn_mask=None,
    scale=None,
    *,
    precision,
):
    def forward(q, k, v):
        return _scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask, scale, precision=precision
        )[0]

    _, pullback = jax.vjp(forward, query, key, value)
    return pullback(grad_out.astype(query.dtype))
