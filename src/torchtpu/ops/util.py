"""Small helpers shared by lowerings."""

from __future__ import annotations

import math


def canonical_dim(dim: int, ndim: int) -> int:
    """``dim`` in ``range(ndim)``; torch treats a 0-d tensor as having one dim here."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})"
        )
    return dim + n if dim < 0 else dim


def canonical_dims(dims, ndim: int) -> tuple[int, ...]:
    """Reduction dims: None or [] mean all dims."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({canonical_dim(d, ndim) for d in dims})) if ndim else ()


def cast(x, dtype):
    """``x`` as ``dtype`` the way torch converts: complex to real keeps the real part."""
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype)
    x = jnp.asarray(x)
    if x.dtype == dtype:
        return x
    if jnp.issubdtype(x.dtype, jnp.complexfloating) and not jnp.issubdtype(
        dtype, jnp.complexfloating
    ):
        x = jnp.real(x)
    return x.astype(dtype)


def opmath_dtype(dtype):
    """The dtype torch's CPU kernels compute ``dtype`` in: float32 for 16-bit floats."""
    import jax.numpy as jnp

    return jnp.float32 if dtype in (jnp.float16, jnp.bfloat16) else dtype


def opmath(x):
    """``x`` in its `opmath_dtype` (Python numbers as they are)."""
    if not hasattr(x, "dtype"):
        return x
    work = opmath_dtype(x.dtype)
    return x if x.dtype == work else x.astype(work)


def complex_logaddexp(x, y):
    """torch's complex log(exp(x) + exp(y)): the operand of larger real part plus
    log1p(exp(other - it)), so the imaginary part is not reduced to (-pi, pi]."""
    import jax.numpy as jnp

    x, y = jnp.broadcast_arrays(x, y)
    x_larger = jnp.real(x) >= jnp.real(y)
    high, low = jnp.where(x_larger, x, y), jnp.where(x_larger, y, x)
    result = jnp.log1p(jnp.exp(low - high)) + high
    nan = jnp.isnan(jnp.real(low)) | jnp.isnan(jnp.imag(low))
    infinite = ~jnp.isfinite(jnp.real(low)) & (jnp.real(low) == jnp.real(high))
    both_inf = jnp.where(jnp.real(low) < 0, low, jnp.log(jnp.exp(low) + jnp.exp(high)))
    result = jnp.where(infinite, both_inf, result)
    return jnp.where(nan, jnp.asarray(complex(jnp.nan, jnp.nan), x.dtype), result)


# Note [Random draws are flat]
#     Every sampler draws a 1-d array of the tensor's numel, reshaped: the same values
#     as a draw of the tensor's shape (JAX's threefry bits are counted over the flat
#     index), but XLA compiles a rank-1 draw in a fraction of the time of a rank-4 one
#     (0.35 s against 1.4 s on the CPU for normal of (10, 8, 6, 5)). Eager code meets a
#     new program for every new shape, so this is paid often.
def flat_draw(sampler, key, shape, **kwargs):
    """``sampler(key, shape=shape, **kwargs)`` (a ``jax.random`` function), drawn flat
    (Note [Random draws are flat])."""
    return sampler(key, shape=(math.prod(shape),), **kwargs).reshape(shape)


def true_positions(flat, size: int):
    """``(positions, found)``: the indices of the first ``size`` True elements of the 1-D
    bool array ``flat``, in order (0 in slots past the last one), and which slots hold
    one -- ``jnp.flatnonzero(flat, size=size)``, computed as one scatter. XLA:TPU took
    17-19 s to compile jnp.nonzero's form (a bincount, then a cumsum) for any size on a
    v5e, and 0.3-0.7 s for this, which also ran faster (151 us against 725 us for 2,048 of
    8,192). Positions are int32 where they fit: 64-bit scatters are emulated on a TPU."""
    import jax.numpy as jnp

    n = flat.shape[0]
    index = jnp.int32 if n < 2**31 else jnp.int64
    slot = jnp.where(flat, jnp.cumsum(flat, dtype=index) - 1, size)  # size: dropped
    positions = jnp.zeros((size,), index).at[slot].set(jnp.arange(n, dtype=index), mode="drop")
    return positions, jnp.arange(size) < jnp.sum(flat, dtype=index)
