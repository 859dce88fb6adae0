"""A Program: torch code traced into one jitted XLA program per input signature.

Both compiled paths hand a Program a *trace function*: given a hashable ``static``
description of the inputs and their arrays (JAX tracers at trace time), it runs torch
ops on TPUTensors holding those arrays and returns its output arrays and a *layout*
(how to rebuild the Python results). The Program runs it inside ``jax.jit`` under
`trace`, so the random ops' seed and offset are program inputs and value
checks are program outputs, and after each run it advances the RNG and files the
checks as eager ops do (checks.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from torchtpu import rng, tracing
from torchtpu.dispatch import checks, defer, modes
from torchtpu.observe import metrics
from torchtpu.observe.locations import user_frame
from torchtpu.runtime import jax
from torchtpu.storage import Storage, _contiguous_strides
from torchtpu.tensor import TPUTensor


@contextlib.contextmanager
def trace(seed, offset):
    """Run the body as a trace (see tracing.py); yields the `Trace`."""
    defer.flush("compiled call")  # queued eager ops run first, outside the program
    previous, previous_mode = tracing._active, modes._current
    tracing._active = tracing.Trace(seed, offset)
    modes._current = modes.EagerMode.DEFER_NEVER
    try:
        # JAX's tracing state is per thread: a backward() inside the traced code must
        # run on this thread, not on autograd's device thread.
        with torch.autograd.set_multithreading_enabled(False):
            yield tracing._active
    finally:
        tracing._active, modes._current = previous, previous_mode


class _Traced(NamedTuple):
    """What tracing one signature found out, besides the program itself."""

    layout: object
    draws: int  # random ops: the RNG offset advances by this much per run
    check_infos: list  # (exception type, message, op) per check flag output


class Program:
    def __init__(self, trace_fn: Callable, kind: str, donate: tuple = ()):
        self._trace_fn = trace_fn
        self.kind = kind  # "graph" (torch.compile) or "step" (torchtpu.jit), for metrics
        # ``donate``: positions of the arrays whose buffers the program may reuse for
        # its outputs (Note [Donating the step's state] in jit.py).
        self._jitted = jax().jit(
            self._traced, static_argnums=0, donate_argnums=tuple(3 + i for i in donate)
        )
        self._signatures: dict = {}
        self._last: _Traced | None = None

    def _traced(self, static, seed, offset, *arrays):
        with trace(seed, offset) as t:
            outputs, layout = self._trace_fn(static, arrays)
        self._last = _Traced(layout, t.draws, [(e, m, op) for _, e, m, op in t.checks])
        return list(outputs), [flag for flag, *_ in t.checks]

    def __call__(self, static, arrays: list, device: int = 0):
        """Run on concrete ``arrays``; returns (output arrays, layout)."""
        signature = (static, tuple((a.shape, a.dtype) for a in arrays))
        traced = self._signatures.get(signature)
        seed, offset = rng.peek(device)
        start = time.perf_counter()
        outputs, flags = self._jitted(static, seed, offset, *arrays)
        if traced is None:
            # A new signature: this call traced and compiled (or loaded from JAX's
            # persistent cache) a program. The seconds include its first run.
            traced = self._signatures[signature] = self._last
            metrics.count("compiles", self.kind)
            metrics.count("compile_seconds", self.kind, time.perf_counter() - start)
            metrics.event("compile", op=f"compiled {self.kind}", where=user_frame())
        metrics.count("compiled_calls", self.kind)
        rng.advance(device, traced.draws)
        if traced.check_infos:
            if modes.is_debug():
                checks.raise_now(flags, traced.check_infos, f"in a compiled {self.kind}")
            else:
                checks.defer(flags, traced.check_infos, f"in a compiled {self.kind}")
        elif modes.is_debug():
            jax().block_until_ready(outputs)
        return outputs, traced.layout


def tensor_of(array, dtype: torch.dtype) -> TPUTensor:
    """A contiguous TPUTensor owning ``array`` (a tracer while tracing)."""
    shape = tuple(array.shape)
    strides = _contiguous_strides(shape)
    return TPUTensor(Storage(array, shape, strides, dtype, 0), (), shape, strides, 0, dtype)
