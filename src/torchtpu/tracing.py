"""Tracing: eager torch code run on JAX tracers, so that it becomes one XLA program.

Both compiled paths (``torch.compile(backend="tpu")`` and `torchtpu.jit`) build their
programs the same way: inside ``jax.jit``, they run torch ops through the ordinary
dispatcher on TPUTensors whose storages hold JAX tracers. Lowerings, views, in-place
writes and type promotion are then exactly eager's, from the same table.

While a trace is active (`trace`):

- ops run at once, as in Strict: nothing is queued (DeferAndFuse) or waited on (Debug);
- random ops draw their keys from the program's seed and offset *inputs*, so each run
  of the program draws new numbers (`Trace.draw`);
- value checks (an index out of range) become program outputs, checked after each run;
- anything that needs values on the host (``.item()``, ``print``, a CPU fallback, an op
  whose output shape depends on values) raises `refuse`'s error, naming the op.

The state is process-wide, like the eager mode: autograd may run a compiled backward
on its own thread.
"""

from __future__ import annotations

import contextlib

import torch

from torchtpu import modes


class Trace:
    """What one trace collects besides the program's outputs."""

    def __init__(self, seed, offset):
        self.seed, self.offset = seed, offset
        self.draws = 0  # random ops traced; the RNG offset advances by this per run
        self.checks: list[tuple] = []  # (flag tracer, exception type, message)
        self.created: list = []  # weak references to the storages made while tracing
        self.cpu_scalars: list = []  # 0-d CPU tensors read as constants

    def draw(self):
        """(seed, offset) of the next random op: traced values, offset by its rank."""
        n = self.draws
        self.draws += 1
        return self.seed, self.offset + n


_active: Trace | None = None


def active() -> Trace | None:
    return _active


@contextlib.contextmanager
def trace(seed, offset):
    """Run the body as a trace (see the module docstring); yields the `Trace`."""
    global _active
    from torchtpu import defer

    defer.flush("compiled call")  # queued eager ops run first, outside the program
    previous, previous_mode = _active, modes._current
    _active = Trace(seed, offset)
    modes._current = modes.EagerMode.DEFER_NEVER
    try:
        # JAX's tracing state is per thread: a backward() inside the traced code must
        # run on this thread, not on autograd's device thread.
        with torch.autograd.set_multithreading_enabled(False):
            yield _active
    finally:
        _active, modes._current = previous, previous_mode


def refuse(what: str, op=None) -> None:
    """Raise the error for something a compiled program cannot do (``op``: the aten op)."""
    raise RuntimeError(
        ("" if op is None else f"{op}: ")
        + f"{what}, which a compiled program (torch.compile(backend='tpu') or "
        "torchtpu.jit) cannot do: its values exist only when the program runs. Move this "
        "out of the compiled function, or run it eagerly."
    )
