"""torch dtypes and their JAX counterparts.

torchtpu runs JAX with ``jax_enable_x64`` so int64, float64 and complex128 are real;
every lowering keeps dtypes explicit (DESIGN.md §3).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

_NAMES = {
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}

SUPPORTED = frozenset(_NAMES)


@functools.cache
def _torch_to_numpy() -> dict[torch.dtype, np.dtype]:
    # ml_dtypes (shipped with jaxlib) gives numpy bfloat16 and float8; importing it
    # costs ~25 ms, so not at `import torch` time.
    import ml_dtypes

    def resolve(name):
        return np.dtype(getattr(ml_dtypes, name, None) or name)

    return {t: resolve(name) for t, name in _NAMES.items()}


@functools.cache
def _numpy_to_torch() -> dict[np.dtype, torch.dtype]:
    return {v: k for k, v in _torch_to_numpy().items()}


def check_supported(dtype: torch.dtype, what: str = "tensor") -> torch.dtype:
    """Raise a TypeError naming the dtype if tpu tensors cannot hold it."""
    if dtype not in SUPPORTED:
        supported = ", ".join(sorted(str(d).replace("torch.", "") for d in SUPPORTED))
        raise TypeError(
            f"torchtpu: dtype {dtype} is not supported for a tpu {what}; supported dtypes: {supported}"
        )
    return dtype


def to_jax(dtype: torch.dtype) -> np.dtype:
    """The numpy/JAX dtype for a torch dtype."""
    try:
        return _torch_to_numpy()[dtype]
    except KeyError:
        check_supported(dtype)
        raise


def to_torch(dtype) -> torch.dtype:
    """The torch dtype for a numpy/JAX dtype."""
    return _numpy_to_torch()[np.dtype(dtype)]


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch's CPU kernels compute in: float32 for the 16-bit floats."""
    if dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.float32
    return dtype
