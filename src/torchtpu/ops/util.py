"""Small helpers shared by lowerings."""

from __future__ import annotations


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
