"""Device memory as ``torch.tpu.memory_allocated`` and friends report it, and
``torch.accelerator``'s memory functions for the tpu accelerator.

JAX owns device memory: an array's buffer is freed when its last reference goes, and
there is no cache of free blocks for torch to empty. As torch's, the numbers mean:

- allocated: the bytes of the arrays that exist on the device now (torch: "memory
  occupied by tensors"), counted from JAX's live arrays on every platform. A device's
  own ``bytes_in_use`` is not this: it also holds loaded programs, and on a TPU a
  buffer is counted from when its program runs and until the device has finished with
  it, so a tensor just made or just deleted moved it by 0 bytes on a v5e.
- reserved: what the device's allocator holds where the backend keeps statistics
  (TPU, GPU): its ``bytes_in_use`` and its ``bytes_reserved``, else allocated. A TPU
  keeps compiled programs' temporaries apart from buffers, as reserved bytes held for
  as long as the programs are loaded (a whole-step program's activations are there:
  5.4 GiB for GPT-2 small's step at 8x1024 tokens on a v5e, where its arrays'
  ``peak_bytes_in_use`` was 1.9 GiB).
- peak: the largest of allocated seen by a call since the last reset and, where the
  device keeps one, its peak (``peak_bytes_in_use`` plus ``peak_bytes_reserved``: a
  bound, the two peaks may come at different times) once it has grown past its value
  at the reset: that peak includes what a step holds while it runs (activations,
  temporaries, the old and new parameters of an update), which no call between steps
  can see. Each run of a DeferAndFuse chunk or compiled program counts too: the bytes
  in use then plus what XLA says the program adds (Note [A program's memory is known
  before it runs]), which is how a step's inner peak is seen on the CPU backend, which
  keeps no peak, and after a reset on a TPU; Strict's inner peak on the CPU backend is
  seen only by the calls of these functions.

Counted are buffers that exist: an uninitialised ``torch.empty`` tensor holds none
until it is written, and a DeferAndFuse value none until its chunk runs;
``memory_stats()["source"]`` says whether the device's statistics were read.

Out of memory is torch's ``torch.OutOfMemoryError``, as on CUDA, so that a loop that
backs off from a batch too large works unchanged: the device's own RESOURCE_EXHAUSTED
(an op's program, a DeferAndFuse chunk, a compiled program) is raised as one
(`out_of_memory`), and `set_per_process_memory_fraction` sets a limit that torchtpu's
own count enforces before an eager op makes an output or a CPU tensor is copied to the
device (`check_room`), and before a chunk or compiled program runs (`before_run`, which
also raises for a program that cannot fit in the device's memory).

torch 2.13's ``torch.accelerator.empty_cache()`` and ``memory_*`` ask the C++ allocator
of the current accelerator, which a Python backend cannot provide (an INTERNAL ASSERT:
"Allocator for tpu is not a DeviceAllocator"); with tpu the current accelerator,
`route_accelerator_functions` makes them answer with these.
"""

from __future__ import annotations

import math
import os
import re
from typing import NamedTuple

import torch

from torchtpu.observe import metrics
from torchtpu.observe.locations import user_frame
from torchtpu.runtime import devices, jax
from torchtpu.runtime import index_of as _index

# Per device index: the largest allocated count a call has seen since the last reset,
# and the device's own peak at that reset (a TPU's peak cannot be reset, only compared).
_peaks: dict[int, int] = {}
_device_peak_at_reset: dict[int, int] = {}
# Per device index: the largest reserved count a call has seen since the last reset,
# and the torch.OutOfMemoryErrors raised (CUDA's allocator reports both; training
# loops' monitors read them, TorchTitan's among them).
_reserved_peaks: dict[int, int] = {}
_out_of_memory_errors: dict[int, int] = {}
# Per device index: the bytes `set_per_process_memory_fraction` allows (read by the
# dispatcher on every op: empty unless a user set one).
limits: dict[int, int] = {}
# Outputs smaller than this are not checked against a limit: counting the arrays that
# exist walks all of them, and an op making less cannot pass a limit by much.
CHECKED_FROM = 1 << 20


# Called before memory is counted: Strict's ops queued while their programs compile
# run first (dispatch/background.py), so that a tensor an op made is counted at once, as
# torch's allocator counts it.
before_stats: list = []


def memory_stats(device=None) -> dict:
    """Statistics of a device's memory, with torch's key names where they apply."""
    for hook in before_stats:
        hook()
    index = _index(device)
    chip = devices()[index]
    current = sum(_bytes_on(a, chip) for a in jax().live_arrays() if not a.is_deleted())
    peak = _peaks[index] = max(_peaks.get(index, 0), current)
    stats = _device_stats(chip)
    if stats:
        reserved = int(stats.get("bytes_in_use", current)) + int(stats.get("bytes_reserved", 0))
        device_peak = _device_peak(stats) or reserved
        if device_peak > _device_peak_at_reset.get(index, 0):
            peak = max(peak, device_peak)
        limit, source = int(stats.get("bytes_limit", 0)), "jax"
    else:
        reserved, limit, source = current, 0, "live arrays"
    reserved = max(reserved, current)
    reserved_peak = _reserved_peaks[index] = max(_reserved_peaks.get(index, 0), reserved, peak)
    return {
        "allocated_bytes.all.current": current,
        "allocated_bytes.all.peak": peak,
        # No caching allocator stands between tensors and the device's buffers: every
        # allocated byte is active, and an allocation is never retried after freeing.
        "active_bytes.all.current": current,
        "active_bytes.all.peak": peak,
        "reserved_bytes.all.current": reserved,
        "reserved_bytes.all.peak": reserved_peak,
        "num_alloc_retries": 0,
        "num_ooms": _out_of_memory_errors.get(index, 0),
        "bytes_limit": limit,
        "source": source,
    }


def _device_stats(chip) -> dict | None:
    """The device's own statistics (None on the CPU backend)."""
    return chip.memory_stats()


def _device_peak(stats: dict) -> int:
    """The device's peak bytes: its arrays' and, on a TPU, its programs' temporaries'."""
    return int(stats.get("peak_bytes_in_use", 0)) + int(stats.get("peak_bytes_reserved", 0))


def _bytes_on(array, chip) -> int:
    """The bytes of ``array`` that ``chip`` holds (a sharded array's share only)."""
    held = array.devices()
    if chip not in held:
        return 0
    if len(held) == 1:
        return array.nbytes
    return sum(s.data.nbytes for s in array.addressable_shards if s.device == chip)


def memory_allocated(device=None) -> int:
    """Bytes of the device's memory held by arrays now."""
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device=None) -> int:
    """The most bytes held since the start or `reset_peak_memory_stats`: the device's
    peak where it keeps one (a TPU's includes what a step holds while it runs), else the
    largest `memory_allocated` a call of these functions has seen."""
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device=None) -> int:
    """Bytes the device's allocator holds (programs and buffers not yet released
    included), at least allocated."""
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device=None) -> int:
    return max(memory_reserved(device), max_memory_allocated(device))


def reset_peak_memory_stats(device=None) -> None:
    index = _index(device)
    _peaks.pop(index, None)
    _reserved_peaks.pop(index, None)
    _device_peak_at_reset[index] = _device_peak(_device_stats(devices()[index]) or {})


_capacities: dict[int, int] = {}


def capacity(index: int) -> int:
    """The bytes of device ``index``'s memory: its limit where the backend reports one,
    else the host's (the CPU backend's arrays live there). Looked up once: the
    dispatcher asks on ops with large outputs."""
    found = _capacities.get(index)
    if found is None:
        stats = _device_stats(devices()[index]) or {}
        found = int(stats.get("bytes_limit", 0))
        if not found:
            found = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        _capacities[index] = found
    return found


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the device: its limit less what its allocator holds where
    the backend reports one, else the host's memory (the CPU backend's arrays live
    there)."""
    stats = memory_stats(device)
    if stats["bytes_limit"]:
        return stats["bytes_limit"] - stats["reserved_bytes.all.current"], stats["bytes_limit"]
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    """As ``torch.cuda.set_per_process_memory_fraction``: an op whose outputs (or a copy
    to the device whose bytes) would take the arrays on the device past ``fraction`` of
    its memory raises
    ``torch.OutOfMemoryError`` before it runs. Checked by torchtpu's count of the arrays
    that exist, for ops making 1 MiB or more; in DeferAndFuse as each op is recorded
    (values of the queue not computed yet are not counted)."""
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if not 0 <= fraction <= 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    index = _index(device)
    if fraction == 1.0:
        limits.pop(index, None)  # the whole device: nothing for the count to check
    else:
        limits[index] = int(fraction * mem_get_info(index)[1])


def get_per_process_memory_fraction(device=None) -> float:
    index = _index(device)
    return limits[index] / mem_get_info(index)[1] if index in limits else 1.0


def check_room(nbytes: int, what, device: int) -> None:
    """Raise torch.OutOfMemoryError if ``nbytes`` more on ``device`` would pass the
    limit `set_per_process_memory_fraction` set."""
    limit = limits.get(device)
    if limit is None or nbytes < CHECKED_FROM:
        return
    if memory_allocated(device) + nbytes > limit:
        why = f"{_size(limit)} allowed to this process (set_per_process_memory_fraction)"
        raise _refused(what, nbytes, device, why)


def _refused(what, nbytes: int | None, device: int, why: str) -> torch.OutOfMemoryError:
    """The torch.OutOfMemoryError for ``what``, counted as CUDA's allocator counts its
    out-of-memory errors (``memory_stats()["num_ooms"]``)."""
    _out_of_memory_errors[device] = _out_of_memory_errors.get(device, 0) + 1
    return torch.OutOfMemoryError(_message(what, nbytes, device, why))


def out_of_memory(exc: BaseException, what, device: int) -> BaseException:
    """``exc`` as ``torch.OutOfMemoryError`` where it is the device running out of
    memory (XLA's RESOURCE_EXHAUSTED), else ``exc`` itself."""
    text = str(exc)
    if "RESOURCE_EXHAUSTED" not in text or isinstance(exc, torch.OutOfMemoryError):
        return exc
    error = _refused(what, _asked(text), device, text.splitlines()[0])
    error.__cause__ = exc
    return error


def _asked(text: str) -> int | None:
    """The bytes an XLA out-of-memory message says were asked for, where it says."""
    match = re.search(r"allocating (\d+) bytes", text)
    if match:
        return int(match.group(1))
    match = re.search(r"allocate ([\d.]+)([KMGT])", text)  # TPU: "allocate 1.00G"
    if match:
        return int(float(match.group(1)) * 1024 ** ("KMGT".index(match.group(2)) + 1))
    return None


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "an unknown size"
    if nbytes < 1 << 20:
        return f"{nbytes} bytes"
    power = min(int(math.log(nbytes, 1024)), 4)  # 2 .. 4
    return f"{nbytes / 1024**power:.2f} {dict(enumerate('KMGT', 1))[power]}iB"


def _message(what, nbytes: int | None, device: int, why: str) -> str:
    allocated = memory_allocated(device)
    total = mem_get_info(device)[1]
    return (
        f"tpu out of memory: {what} tried to allocate {_size(nbytes)}. tpu:{device} has a "
        f"total capacity of {_size(total)}, of which {_size(allocated)} is allocated by "
        f"tensors; {why.rstrip('.')}. Free the tensors you no longer need (del) or use a "
        "smaller batch."
    )


class ProgramBytes(NamedTuple):
    """A compiled program's memory, from XLA's analysis of it (Note [A program's memory
    is known before it runs])."""

    arguments: int
    outputs: int
    aliased: int  # of the outputs, the bytes written into donated arguments' buffers
    temporaries: int

    @property
    def new(self) -> int:
        """What running it adds to the device: its outputs not written into donated
        arguments, and its temporaries."""
        return self.outputs - self.aliased + self.temporaries

    def parts(self) -> str:
        """Its parts, largest first: "4.02 GiB of temporaries (the largest), 1.82 GiB of
        arguments and 0.61 GiB of new outputs"."""
        named = sorted(
            [(self.temporaries, "temporaries"), (self.outputs - self.aliased, "new outputs"),
             (self.arguments, "arguments")],
            key=lambda part: -part[0],
        )  # fmt: skip
        first, second, third = (f"{_size(n)} of {name}" for n, name in named)
        return f"{first} (the largest), {second} and {third}"


def program_bytes(compiled) -> ProgramBytes | None:
    """XLA's memory analysis of ``compiled`` (a ``jax.stages.Compiled``); None where the
    backend gives none."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # a backend without the analysis (it is optional in PJRT)
        return None
    if analysis is None:
        return None
    return ProgramBytes(
        analysis.argument_size_in_bytes, analysis.output_size_in_bytes,
        analysis.alias_size_in_bytes, analysis.temp_size_in_bytes,
    )  # fmt: skip


# Per kind of program, its names in metrics()["program_bytes"] (made once: before_run
# runs at every chunk's and compiled program's run).
_part_names: dict[str, tuple[str, str, str]] = {}


def before_run(
    program: ProgramBytes | None, kind: str, what: str, where, device: int, first: bool
) -> None:
    """Called before a DeferAndFuse chunk or a compiled program of ``kind`` ("chunk",
    "graph", "step") runs, ``what`` naming it and ``where`` the user's line if known
    (``first``: its first run, just compiled).

    Note [A program's memory is known before it runs]
        XLA knows a compiled program's memory before it runs: its arguments, outputs
        (and which of them are written into donated arguments) and temporaries
        (``Compiled.memory_analysis()``). A chunk or compiled program (``torch.compile``
        graph, ``torchtpu.jit`` step) is compiled ahead of its first run to ask
        (``jax.jit`` then finds it in its cache), and torchtpu uses the answer three ways:
        - a program that cannot fit raises ``torch.OutOfMemoryError`` before it runs,
          naming its largest part: its new bytes on top of the arrays that exist would
          pass the limit ``set_per_process_memory_fraction`` set (checked at every run,
          as eager ops are) or the device's own memory (at its first run: the arrays
          and the program need not fit, whatever else happens);
        - the peak (`max_memory_allocated`) counts, at each run of a program adding
          1 MiB or more, the bytes in use then plus what it adds, so a fused or
          compiled step's inner peak -- activations, temporaries, old and new
          parameters -- is seen: on the CPU backend, which keeps no peak, and after a
          reset on a TPU, whose own peak cannot be reset. The bytes in use are the
          device's count where it keeps one (a call), else the live arrays' (a walk);
          a TPU holds a program's temporaries for as long as it is loaded, counted in
          its ``bytes_reserved`` (module docstring), so there they are not added again;
        - ``metrics()["program_bytes"]`` keeps the largest parts of the programs of
          each kind run since its reset, and ``torchtpu.explain`` lists each run's.
        Strict's per-op programs are not analysed: their temporaries are small, and
        the dispatcher's own check sees their outputs."""
    if program is None:
        return
    largest = metrics.counter("program_bytes")
    names = _part_names.get(kind) or _part_names.setdefault(
        kind, (f"{kind} arguments", f"{kind} outputs", f"{kind} temporaries")
    )
    for name, nbytes in zip(names, (program.arguments, program.outputs, program.temporaries)):
        if nbytes > largest.get(name, -1):
            largest[name] = nbytes
    if metrics._recorders:
        metrics.event("program", what=what, where=where or user_frame(), bytes=program)
    limit = limits.get(device)
    tracked = program.new >= CHECKED_FROM  # its run may be the peak
    if not (tracked or first or limit is not None):
        return
    stats = _device_stats(devices()[device]) or {}
    if limit is None and first:
        limit = int(stats.get("bytes_limit", 0)) or None
    walk = limit is not None or (tracked and "bytes_in_use" not in stats)
    allocated = memory_allocated(device) if walk else None
    if tracked:
        if "bytes_reserved" in stats:  # a TPU: loaded programs' temporaries are reserved
            running = int(stats["bytes_in_use"]) + int(stats["bytes_reserved"])
            running += program.outputs - program.aliased
        else:
            running = int(stats.get("bytes_in_use", allocated)) + program.new
        _peaks[device] = max(_peaks.get(device, 0), running)
        _reserved_peaks[device] = max(_reserved_peaks.get(device, 0), running)
    if limit is not None and allocated + program.new > limit:
        why = f"it needs {program.parts()} (its arguments exist already); {_size(limit)} " + (
            "is allowed to this process (set_per_process_memory_fraction)"
            if device in limits
            else "is the device's memory"
        )
        raise _refused(f"{what} ({where or user_frame()})", program.new, device, why)


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
