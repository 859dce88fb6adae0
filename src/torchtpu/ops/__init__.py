"""The lowering table (registry.py) and the op families that fill it.

Importing this package imports JAX (configured by runtime.jax() first, so x64 is on
before any lowering touches jax.numpy).
"""

from torchtpu.runtime import jax as _configure_jax

_configure_jax()

from torchtpu.ops import (  # noqa: E402, F401  (each module registers its lowerings)
    attention,
    cross_entropy,
    elementwise,
    factories,
    fft,
    foreach,
    indexing,
    ldl,
    linalg,
    linalg_solvers,
    linear,
    losses,
    misc,
    nn,
    optimizers,
    random,
    reduction,
    shape,
    special,
    splash_attention,
    upsample,
    views,
)
from torchtpu.ops.registry import TABLE, Lowering, aten, lowers  # noqa: E402

__all__ = ["TABLE", "Lowering", "aten", "lowers"]
