"""The JAX runtime behind the tpu device (backend.py) and moving values between the
host and it (transfer.py). Nothing here imports JAX at import time."""

from torchtpu.runtime.backend import (
    array_type,
    current_index,
    device,
    device_name,
    devices,
    index_of,
    jax,
    launched_rank,
    platform,
    set_current_index,
    sharding,
    started,
)

__all__ = [
    "array_type",
    "current_index",
    "device",
    "device_name",
    "devices",
    "index_of",
    "jax",
    "launched_rank",
    "platform",
    "set_current_index",
    "sharding",
    "started",
]
