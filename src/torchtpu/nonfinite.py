"""Find the first op that makes a NaN or an Inf from finite inputs: ``torchtpu.detect_nonfinite()``.

Under the context manager, after every aten op on tpu tensors whose results are floating
point, one more op computes on the device a flag per floating result: whether all the
op's floating inputs (and Python numbers) were finite, and if so whether the result has
a NaN or an Inf. The first op whose flag is set raises `TPUNonFiniteError` (or warns,
``action="warn"``) naming the aten op, the user's line, the inputs' shapes and dtypes
and which result holds the NaN or Inf. A value that was non-finite already when it
reached an op is not blamed on it: the op that made it was named before.

How often the flags are read depends on the eager mode:

- Strict and Debug: the flag op runs after the op (fused in one small jitted function)
  and is read at once: one small host read per op.
- DeferAndFuse: the flag ops are recorded in the queue like any op, so they run inside
  the chunk, next to the ops they check (an intermediate XLA never materialises is
  still checked). The chunk's flags are read once when it has run (a hook of
  ``defer._run``): one host read per flush, naming the first offending op and the line
  that recorded it.

In-place ops (``add_``, an optimizer's ``_foreach_`` updates) overwrite their inputs,
so their inputs' finiteness is computed before the op runs. Backward ops are checked
too, named with the forward line that created them (anomaly mode's forward tracebacks
are on inside, as in ``check_against_cpu``); an error found during ``backward()`` is
raised by the next tpu op or read after it (Note [Why backward errors are deferred]).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchtpu import tracing
from torchtpu.dispatch import backward_errors, defer, modes
from torchtpu.dispatch.modes import EagerMode
from torchtpu.dispatch.pending import Pending
from torchtpu.dispatch.values import materialize
from torchtpu.observe import metrics
from torchtpu.observe.locations import describe, op_location
from torchtpu.ops.registry import lowers
from torchtpu.runtime import jax
from torchtpu.tensor import TPUTensor

aten = torch.ops.aten


class TPUNonFiniteError(RuntimeError):
    """An op made a NaN or an Inf from finite inputs (``torchtpu.detect_nonfinite()``)."""


class TPUNonFiniteWarning(UserWarning):
    """``detect_nonfinite(action="warn")``: an op made a NaN or an Inf from finite inputs."""


# -- the flag ops: torch custom ops lowered in the one table ----------------------------------

_library = torch.library.Library("torchtpu_debug", "DEF")
_library.define("all_finite(Tensor[] tensors) -> Tensor")
_library.define("nonfinite_flags(Tensor[] inputs, Tensor[] outputs) -> Tensor")
_all_finite = torch.ops.torchtpu_debug.all_finite.default
_nonfinite_flags = torch.ops.torchtpu_debug.nonfinite_flags.default


@torch.library.register_fake("torchtpu_debug::all_finite", lib=_library)
def _all_finite_meta(tensors):
    return torch.empty((), dtype=torch.bool)


@torch.library.register_fake("torchtpu_debug::nonfinite_flags", lib=_library)
def _nonfinite_flags_meta(inputs, outputs):
    return torch.empty((len(outputs),), dtype=torch.int8)


def _finite(arrays):
    """Whether every input is finite; a bool input is an `all_finite` taken before."""
    jnp = jax().numpy
    ok = jnp.bool_(True)
    for a in arrays:
        ok = ok & (jnp.all(a) if a.dtype == jnp.bool_ else jnp.all(jnp.isfinite(a)))
    return ok


@lowers(_all_finite)
def _all_finite_lowering(tensors):
    return _finite(tensors)


_NAN, _INF = 1, 2  # the bits of a flag


@lowers(_nonfinite_flags)
def _nonfinite_flags_lowering(inputs, outputs):
    """Per output: 0, or NaN (1) | Inf (2) where the inputs were all finite."""
    jnp = jax().numpy
    codes = jnp.stack(
        [
            jnp.any(jnp.isnan(o)).astype(jnp.int8) * _NAN
            + jnp.any(jnp.isinf(o)).astype(jnp.int8) * _INF
            for o in outputs
        ]
    )
    return jnp.where(_finite(inputs), codes, jnp.int8(0))


# -- the mode ---------------------------------------------------------------------------------

# Ops that allocate or read rather than compute (their values are not results to judge).
_NOT_COMPUTATIONS = frozenset(
    {
        aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
        aten.new_empty.default, aten.new_empty_strided.default, aten.resize_.default,
        aten.set_.source_Tensor, aten.lift_fresh.default, aten._local_scalar_dense.default,
    }
)  # fmt: skip


def _inexact(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


class _Check:
    """One op's flags and what the message needs."""

    __slots__ = ("flags", "op", "where", "inputs", "labels", "outputs")

    def __init__(self, flags, op, where, inputs, labels, outputs):
        self.flags, self.op, self.where, self.inputs = flags, op, where, inputs
        self.labels, self.outputs = labels, outputs  # per flag: its name, dtype and shape


class _DetectNonFinite(TorchDispatchMode):
    def __init__(self, action: str):
        super().__init__()
        self.action = action
        self.waiting: list[_Check] = []  # DeferAndFuse: checks of ops not flushed yet

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NOT_COMPUTATIONS or func.is_view or tracing._active is not None:
            return func(*args, **kwargs)
        arguments = func._schema.arguments
        written, outs = [], set()  # tensors the op writes; the out= ones are not inputs
        for i, a in enumerate(arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                value = kwargs.get(a.name) if (a.kwarg_only or i >= len(args)) else args[i]
                for t in tree_leaves(value):
                    if isinstance(t, TPUTensor):
                        written.append((a.name, t))
                        if a.kwarg_only:
                            outs.add(id(t))
        leaves = tree_leaves((args, kwargs))
        inputs = [t for t in leaves if _inexact(t) and id(t) not in outs]
        if not any(isinstance(t, TPUTensor) for t in leaves) or not _finite_on_host(leaves, inputs):
            return func(*args, **kwargs)
        inputs = [t for t in inputs if isinstance(t, TPUTensor)]
        with torch.no_grad():
            if any(t is w for _, w in written for t in inputs):
                inputs = [_all_finite(inputs)]  # in place: the inputs' values before the op
            result = func(*args, **kwargs)
            outputs, labels, seen = [], [], set()
            returned = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
            for i, t in enumerate(returned):
                if isinstance(t, TPUTensor) and _inexact(t) and id(t) not in seen:
                    seen.add(id(t))
                    outputs.append(t)
                    labels.append("its result" if len(returned) == 1 else f"result {i}")
            for name, t in written:
                if _inexact(t) and id(t) not in seen:
                    seen.add(id(t))
                    outputs.append(t)
                    labels.append(f"argument `{name}` (written in place)")
            if not outputs:
                return result
            flags = _nonfinite_flags(inputs, outputs)
        metrics.count("nonfinite_checks", "ops")
        check = _Check(
            flags, func, op_location(), describe(leaves), labels,
            [describe([t]).strip("()") for t in outputs],
        )  # fmt: skip
        if (modes._current or modes.current()) is EagerMode.DEFER_AND_FUSE:
            self.waiting.append(check)  # read when its chunk has run (`after_flush`)
        else:
            self._judge([check])
        return result

    def after_flush(self, reason: str) -> None:
        """DeferAndFuse: read the flags of the ops a chunk just ran, at once."""
        done, waiting = [], []
        for check in self.waiting:
            value = check.flags._storage.array
            if type(value) is Pending and not value.node_done():
                waiting.append(check)
            elif not (type(value) is Pending and value.error is not None):
                done.append(check)
        self.waiting = waiting
        if done:
            # A full queue is flushed from inside recording an op, halfway through
            # requeueing its tail: its error waits for the next tpu op or read.
            self._judge(done, defer_error=reason == "queue full")

    def _judge(self, checks: list[_Check], defer_error: bool = False) -> None:
        """Read the flags of ``checks`` in one host read; report the first set one."""
        jnp = jax().numpy
        arrays = [materialize(c.flags) for c in checks]
        codes = np.asarray(arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays))
        metrics.count("nonfinite_checks", "host_reads")
        if not codes.any():
            return
        start = 0
        for check in checks:
            own = codes[start : start + len(check.labels)]
            start += len(check.labels)
            if own.any():
                self._report(check, own, defer_error)
                return

    def _report(self, check: _Check, codes, defer_error: bool) -> None:
        bad = [
            f"{label} {shape} has {_kind(int(code))}"
            for label, shape, code in zip(check.labels, check.outputs, codes)
            if code
        ]
        message = (
            f"torchtpu: {check.op} at {check.where} made {_kind(int(max(codes)))} from finite "
            f"inputs {check.inputs}: {'; '.join(bad)}"
        )
        if self.action == "warn":
            warnings.warn(message, TPUNonFiniteWarning, stacklevel=2)
        elif defer_error or backward_errors.in_backward():
            # Raised by the next tpu op or read on the user's thread (Note [Why
            # backward errors are deferred]); the backward pass runs to its end.
            backward_errors.record(TPUNonFiniteError(message))
        else:
            raise TPUNonFiniteError(message)


def _kind(code: int) -> str:
    return {_NAN: "NaN", _INF: "Inf"}.get(code, "NaN and Inf")


def _finite_on_host(leaves, inputs) -> bool:
    """Whether the op's Python numbers and CPU tensors (a scalar, a copy's source) are
    finite: a NaN fill value or a NaN copied in is not the op's doing."""
    for v in leaves:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if isinstance(v, complex) and not (math.isfinite(v.real) and math.isfinite(v.imag)):
            return False
    return all(bool(torch.isfinite(t).all()) for t in inputs if not isinstance(t, TPUTensor))


_active: list[_DetectNonFinite] = []


def _after_flush(reason: str) -> None:
    for mode in list(_active):
        mode.after_flush(reason)


@contextlib.contextmanager
def detect_nonfinite(action: str = "raise"):
    """Raise (``action="raise"``) or warn (``"warn"``) at the first op that makes a NaN
    or an Inf from finite inputs (see the module docstring)."""
    if action not in ("raise", "warn"):
        raise ValueError(f"detect_nonfinite: action must be 'raise' or 'warn', got {action!r}")
    defer.flush("mode change")  # ops recorded before are not checked
    mode = _DetectNonFinite(action)
    _active.append(mode)
    if len(_active) == 1:
        defer.after_run.append(_after_flush)
    try:
        with torch.autograd.set_detect_anomaly(True, check_nan=False), mode:
            yield
            defer.flush("mode change")  # the ops recorded inside are checked here
    finally:
        _active.remove(mode)
        if not _active:
            defer.after_run.remove(_after_flush)
