"""Device memory as ``torch.tpu.memory_allocated`` and friends report it, and
``torch.accelerator``'s memory functions for the tpu accelerator.

JAX owns device memory: an array's buffer is freed when its last reference goes, and
there is no cache of free blocks for torch to empty. The numbers come from the JAX
device's own statistics where the backend keeps them (TPU, GPU: ``bytes_in_use``,
``peak_bytes_in_use``, ``bytes_limit``), and from torchtpu's count of the live JAX
arrays on the device where it does not (the CPU backend); ``memory_stats()["source"]``
says which. Counted are buffers that exist: an uninitialised ``torch.empty`` tensor holds
none until it is written, and a DeferAndFuse value none until its chunk runs.

torch 2.13's ``torch.accelerator.empty_cache()`` and ``memory_*`` ask the C++ allocator
of the current accelerator, which a Python backend cannot provide (an INTERNAL ASSERT:
"Allocator for tpu is not a DeviceAllocator"); with tpu the current accelerator,
`route_accelerator_functions` makes them answer with these.
"""

from __future__ import annotations

import os

import torch

from torchtpu.runtime import devices, jax
from torchtpu.runtime import index_of as _index

# Peaks of the live-array count, per device index, since the last reset (the CPU
# backend keeps no peak of its own: this one is the largest count seen by a call).
_peaks: dict[int, int] = {}


def memory_stats(device=None) -> dict:
    """Statistics of a device's memory, with torch's key names where they apply."""
    index = _index(device)
    chip = devices()[index]
    stats = chip.memory_stats()
    if stats:
        current = int(stats.get("bytes_in_use", 0))
        peak = int(stats.get("peak_bytes_in_use", current))
        reserved = int(stats.get("bytes_reserved", current))
        limit = int(stats.get("bytes_limit", 0))
        source = "jax"
    else:
        current = sum(
            a.nbytes for a in jax().live_arrays() if not a.is_deleted() and chip in a.devices()
        )
        peak, reserved, limit, source = current, current, 0, "live arrays"
    peak = _peaks[index] = max(_peaks.get(index, 0), peak, current)
    return {
        "allocated_bytes.all.current": current,
        "allocated_bytes.all.peak": peak,
        "reserved_bytes.all.current": reserved,
        "bytes_limit": limit,
        "source": source,
    }


def memory_allocated(device=None) -> int:
    """Bytes of the device's memory held by arrays now."""
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device=None) -> int:
    """The largest `memory_allocated` since the start or `reset_peak_memory_stats` (on
    the CPU backend: the largest seen by a call of these functions)."""
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device=None) -> int:
    """Bytes the backend's allocator holds (as allocated where it keeps no reserve)."""
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device=None) -> int:
    return max(memory_reserved(device), max_memory_allocated(device))


def reset_peak_memory_stats(device=None) -> None:
    _peaks.pop(_index(device), None)


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the device: from JAX's limit where the backend reports
    one, else the host's memory (the CPU backend's arrays live there)."""
    stats = memory_stats(device)
    if stats["bytes_limit"]:
        return stats["bytes_limit"] - stats["allocated_bytes.all.current"], stats["bytes_limit"]
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def empty_cache() -> None:
    """Nothing to release: JAX frees a buffer when its last array goes."""


def memory_summary(device=None) -> str:
    stats = memory_stats(device)
    mib = 1 << 20
    return (
        f"tpu:{_index(device)} memory ({stats['source']}): "
        f"{stats['allocated_bytes.all.current'] / mib:.1f} MiB allocated, "
        f"{stats['allocated_bytes.all.peak'] / mib:.1f} MiB peak, "
        f"{stats['reserved_bytes.all.current'] / mib:.1f} MiB reserved"
    )


# torch.accelerator's memory functions and the ones answering for tpu.
_ACCELERATOR = {
    "empty_cache": empty_cache,
    "memory_stats": memory_stats,
    "memory_allocated": memory_allocated,
    "max_memory_allocated": max_memory_allocated,
    "memory_reserved": memory_reserved,
    "max_memory_reserved": max_memory_reserved,
    "reset_peak_memory_stats": reset_peak_memory_stats,
    "reset_accumulated_memory_stats": lambda device=None: None,
    "get_memory_info": mem_get_info,
}


def route_accelerator_functions() -> None:
    """``torch.accelerator.<memory function>`` answers with torchtpu's while tpu is the
    current accelerator (see the module docstring); otherwise torch's own runs."""
    for name, ours in _ACCELERATOR.items():
        torchs = getattr(torch.accelerator, name, None)
        if torchs is None or getattr(torchs, "_torchtpu", False):
            continue

        def routed(*args, _ours=ours, _torchs=torchs, **kwargs):
            current = torch.accelerator.current_accelerator()
            if current is not None and current.type == "tpu":
                return _ours(*args, **kwargs)
            return _torchs(*args, **kwargs)

        routed._torchtpu = True
        routed.__name__ = routed.__qualname__ = name
        routed.__doc__ = torchs.__doc__
        setattr(torch.accelerator, name, routed)
        if hasattr(torch.accelerator, "memory"):
            setattr(torch.accelerator.memory, name, routed)
