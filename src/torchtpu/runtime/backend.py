"""The JAX runtime: started on first use, never at import; which device is current.

``import torch`` autoloads torchtpu, so nothing here may import JAX at module level;
`jax()` does it once, the first time a tpu tensor needs a device.
"""

from __future__ import annotations

import functools
import os
import sys
import threading

from torchtpu import config


@functools.cache
@functools.cache
def array_type() -> type:
    """The type of JAX's concrete arrays (``jax.Array`` is an abstract class): what a
    buffer donation may take, where a Pending or a tracer may not."""
    return type(jax().numpy.zeros(()))


def jax():
    """Import and configure JAX (x64 on, CPU async dispatch and the persistent
    compilation cache per config); return the module."""
    import jax as _jax

    # int64/float64 must be real: without x64 JAX silently narrows them (DESIGN.md §8).
    _jax.config.update("jax_enable_x64", True)
    _jax.config.update("jax_cpu_enable_async_dispatch", config.cpu_async_dispatch)
    if config.compile_cache_dir:
        _jax.config.update("jax_compilation_cache_dir", config.compile_cache_dir)
        _jax.config.update(
            "jax_persistent_cache_min_compile_time_secs", config.compile_cache_min_seconds
        )
        _jax.config.update("jax_compilation_cache_max_size", config.compile_cache_max_bytes)
    return _jax


@functools.cache
def devices() -> tuple:
    """This process's JAX devices of the default backend; ``tpu:i`` is ``devices()[i]``.

    With several processes (``jax.distributed``), ``jax.devices()`` lists every
    process's devices; a process can only compute on its own, so ``tpu:0`` on rank 1
    is rank 1's first device, as ``cuda:0`` is each process's first visible GPU."""
    return tuple(jax().local_devices())


def launched_rank() -> int | None:
    """This process's local rank when a launcher (torchrun, ``mp.spawn`` with the
    environment set, Lightning's DDP) started it as one of several (``WORLD_SIZE`` > 1),
    each computing on one device; None otherwise. Read from the environment: it does
    not start JAX (Note [One device per launched process] in device.py)."""
    world = os.environ.get("WORLD_SIZE", "")
    if not world.isdigit() or int(world) <= 1:
        return None
    local = os.environ.get("LOCAL_RANK", "0")
    return int(local) if local.isdigit() else 0


def started() -> bool:
    """Whether JAX's backend has started (after which ``jax.distributed`` cannot be
    initialised). False until a tpu tensor needed a device."""
    if "jax" not in sys.modules:
        return False
    from torchtpu import _compat

    return _compat.jax_backends_started()


# The index of the current device (``torch.tpu.set_device``): where ``"tpu"`` without
# an index puts a tensor. Per thread, as CUDA's (``torch.cuda.set_device`` is per host
# thread): a thread starts on tpu:0.
_current = threading.local()


def current_index() -> int:
    return getattr(_current, "index", 0)


def set_current_index(index: int) -> None:
    _current.index = index


def index_of(device) -> int:
    """The index a ``device`` argument of ``torch.tpu``'s functions names: None or
    ``"tpu"`` is the current device; an int, ``"tpu:1"`` or a ``torch.device``."""
    import torch

    if device is None:
        return current_index()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "tpu":
        raise ValueError(f"expected a tpu device, got {device}")
    return device.index if device.index is not None else current_index()


def device(index: int | None):
    """The JAX device behind ``tpu:index`` (index None means the current device)."""
    if index is None:
        index = current_index()
    devs = devices()
    if not 0 <= index < len(devs):
        raise RuntimeError(
            f"tpu:{index} does not exist: JAX sees {len(devs)} device(s) "
            f"({devs[0].platform}), so valid indices are 0..{len(devs) - 1}"
        )
    return devs[index]


_SHARDINGS: dict = {}


def sharding(index: int):
    """``tpu:index`` as a JAX sharding: a program's outputs placed (committed) there
    (Note [Every array is committed to its device] in dispatch/builder.py)."""
    placed = _SHARDINGS.get(index)
    if placed is None:
        placed = _SHARDINGS[index] = jax().sharding.SingleDeviceSharding(device(index))
    return placed


def platform() -> str:
    """The JAX backend behind the tpu device: "tpu", "gpu" or "cpu"."""
    return devices()[0].platform


def device_name(index: int | None = None) -> str:
    """A truthful name: the chip kind (e.g. "TPU v5 lite"), or "cpu (XLA)" on the CPU backend."""
    dev = device(index)
    if dev.platform == "cpu":
        return "cpu (XLA)"
    return dev.device_kind
