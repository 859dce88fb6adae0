"""torch dtypes and their JAX counterparts.

torchtpu runs JAX with ``jax_enable_x64`` so int64, float64 and complex128 are real;
every lowering keeps dtypes explicit (DESIGN.md §3).
"""

from __future__ import annotations

import numpy as np
import torch

# ml_dtypes ships with jaxlib; it gives numpy the extra float types.
import ml_dtypes

_TORCH_TO_NUMPY: dict[torch.dtype, np.dtype] = {
    torch.bool: np.dtype(np.bool_),
    torch.uint8: np.dtype(np.uint8),
    torch.uint16: np.dtype(np.uint16),
    torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
}
_NUMPY_TO_TORCH = {v: k for k, v in _TORCH_TO_NUMPY.items()}

SUPPORTED = frozenset(_TORCH_TO_NUMPY)


def check_supported(dtype: torch.dtype, what: str = "tensor") -> torch.dtype:
    """Raise a TypeError naming the dtype if tpu tensors cannot hold it."""
    if dtype not in _TORCH_TO_NUMPY:
        supported = ", ".join(sorted(str(d).replace("torch.", "") for d in SUPPORTED))
        raise TypeError(
            f"torchtpu: dtype {dtype} is not supported for a tpu {what}; supported dtypes: {supported}"
        )
    return dtype


def to_jax(dtype: torch.dtype) -> np.dtype:
    """The numpy/JAX dtype for a torch dtype."""
    try:
        return _TORCH_TO_NUMPY[dtype]
    except KeyError:
        check_supported(dtype)
        raise


def to_torch(dtype) -> torch.dtype:
    """The torch dtype for a numpy/JAX dtype."""
    return _NUMPY_TO_TORCH[np.dtype(dtype)]


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch's CPU kernels compute in: float32 for the 16-bit floats."""
    if dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.float32
    return dtype
