"""``torchtpu.profile(log_dir)``: a trace of a block of code, for TensorBoard and Perfetto.

Inside the block JAX's profiler records what XLA compiles and runs, host and device,
and torchtpu names it:

- every aten op on tpu tensors is a host event ``aten.mm.default (train.py:12 in
  forward)``: the op and the user's line (a backward op: ``backward of MmBackward0``).
  In Strict and Debug it spans the op's launch (and, on the CPU backend, its run); in
  DeferAndFuse its recording, with ``queued=opN``: its position in the next chunk;
- every DeferAndFuse flush is a host event ``DeferAndFuse chunk: 12 ops (value read at
  train.py:20 in <module>)`` spanning the chunk's run (and its compilation, with
  ``compiled=True``);
- on the device, each op's program is the XLA module ``jit_aten.mm.default`` and its
  instructions carry the op in their metadata: ``jit(aten.mm.default)/aten.mm.default/
  dot_general``, and in a chunk ``jit(chunk)/op3/aten.mm.default/dot_general`` (Note
  [Profiles name aten ops] in dispatch/builder.py). TensorBoard's profile plugin and
  Perfetto show these names on TPU and GPU; the CPU backend's trace names its work by
  module (``hlo_module``) and fused instruction.

Files go where ``jax.profiler.trace`` puts them: ``<log_dir>/plugins/profile/<run>/``
holds ``<host>.xplane.pb`` (TensorBoard: ``tensorboard --logdir <log_dir>`` with the
``tensorboard-plugin-profile`` package), ``<host>.trace.json.gz`` (Chrome trace format)
and, unless ``perfetto=False``, ``perfetto_trace.json.gz`` (https://ui.perfetto.dev).
Writing them needs nothing beyond jaxlib.

Note [Why JAX's profiler, not torch.profiler]
    torch.profiler learns about a PrivateUse1 device's work only from C++: a Kineto
    activity profiler or the profiler stubs `registerPrivateUse1Methods` takes. A
    device registered from Python can give neither, so torch.profiler sees tpu ops as
    CPU events (the dispatcher's RecordFunction) and nothing of what XLA compiles or
    runs. JAX's profiler records both, with the annotations torchtpu adds; the two can
    run together, each writing its own trace.

Per-op events come from the thread that entered the block (and autograd's threads for
its backward passes: torch's dispatch modes are per thread); chunks and device work are
recorded whichever thread runs them.

Costs: with no profile running, nothing (the op names are fixed when a program is
first traced, and a flush calls one no-op hook). Inside the block, each op costs an
annotation and a look at the stack for the user's line, so host time grows; device time
does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchtpu import tracing
from torchtpu.dispatch import defer, modes
from torchtpu.dispatch.modes import EagerMode
from torchtpu.dispatch.synchronize import sync
from torchtpu.observe.locations import op_location, user_frame
from torchtpu.runtime import jax
from torchtpu.tensor import TPUTensor


@dataclasses.dataclass
class Profile:
    """What ``torchtpu.profile`` wrote: ``files`` is filled when the block ends."""

    log_dir: str
    files: list[str] = dataclasses.field(default_factory=list)

    def _one(self, suffix: str) -> str | None:
        return next((f for f in self.files if f.endswith(suffix)), None)

    @property
    def xplane_file(self) -> str | None:
        """The ``*.xplane.pb`` TensorBoard's profile plugin reads."""
        return self._one(".xplane.pb")

    @property
    def trace_file(self) -> str | None:
        """The ``*.trace.json.gz`` in Chrome's trace event format."""
        return self._one(".trace.json.gz")

    @property
    def perfetto_file(self) -> str | None:
        """The ``perfetto_trace.json.gz`` for https://ui.perfetto.dev."""
        return self._one("perfetto_trace.json.gz")


def _on_tpu(args, kwargs) -> bool:
    for v in tree_leaves((args, kwargs)):
        if isinstance(v, TPUTensor) or (isinstance(v, torch.device) and v.type == "tpu"):
            return True
    return False


def _label(text: str) -> str:
    # JAX encodes an annotation's arguments after a '#' in its name.
    return text.replace("#", "")


class _Annotate(TorchDispatchMode):
    """Each aten op on tpu tensors in a host annotation: the op and the user's line."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile'd code keeps running compiled inside the block (Dynamo runs a
        # frame eagerly under any other dispatch mode): its program is one event.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if tracing._active is not None or not _on_tpu(args, kwargs):
            return func(*args, **kwargs)
        deferring = (modes._current or modes.current()) is EagerMode.DEFER_AND_FUSE
        before = defer.pending_count() if deferring else 0
        with jax().profiler.TraceAnnotation(_label(f"{func} ({op_location()})")) as note:
            result = func(*args, **kwargs)
            if deferring:
                after = defer.pending_count()
                if after > before:  # recorded, not run: where it is in the next chunk
                    last = f"op{after - 1}"
                    note.set_metadata(queued=last if after == before + 1 else f"op{before}-{last}")
        return result


def _chunk_annotation(q, reason: str, where: str | None, compiled: bool):
    """The host event a DeferAndFuse chunk runs (and compiles) in."""
    where = where or user_frame()  # a flush takes the line only where it needs it
    return jax().profiler.TraceAnnotation(
        _label(f"DeferAndFuse chunk: {len(q.plans)} ops ({reason} at {where})"),
        compiled="yes" if compiled else "no",
    )


def _written_since(log_dir: str, start: float) -> list[str]:
    found = []
    for folder, _, names in os.walk(log_dir):
        for name in names:
            path = os.path.join(folder, name)
            if os.path.getmtime(path) >= start:
                found.append(path)
    return sorted(found)


@contextlib.contextmanager
def profile(log_dir, *, perfetto: bool = True, python: bool = False):
    """Record a trace of the block into ``log_dir`` (see the module docstring); yields a
    `Profile` whose ``files`` list what was written once the block ends.

    Work queued before the block finishes first, and the block's own work is waited
    for at its end, so the trace holds exactly the block's. ``python=True`` also
    records every Python function call (JAX's Python tracer: large and slow)."""
    log_dir = os.fspath(log_dir)
    jx = jax()
    sync()
    options = jx.profiler.ProfileOptions()
    options.python_tracer_level = 1 if python else 0
    start = time.time() - 1.0  # file times may be rounded down to the second
    jx.profiler.start_trace(log_dir, create_perfetto_trace=perfetto, profiler_options=options)
    result = Profile(log_dir)
    previous = defer.annotate_run
    defer.annotate_run = _chunk_annotation
    try:
        with _Annotate():
            yield result
            sync()
    finally:
        defer.annotate_run = previous
        jx.profiler.stop_trace()
        result.files = _written_since(log_dir, start)
