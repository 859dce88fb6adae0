"""Find the first op whose tpu result differs from the CPU's: ``torchtpu.check_against_cpu()``.

Under the context manager every aten op on tpu tensors also runs on the CPU, on host
copies of the same inputs taken before the op, and its results are compared as the
conformance harness compares them (observe/compare.py): torch's dtype-aware tolerances; a
16-bit result judged against a float64 run (it passes when it is no further from the
float64 result than the CPU's is); random ops, and the indices of ops whose ties may
break either way (``sort``, ``max(dim)``), by shape and dtype only. The first op that
differs raises `TPUDivergenceError` (or warns, ``action="warn"``) naming the aten op,
the user's line, the inputs' shapes and dtypes, and the largest absolute and relative
errors.

Backward ops are checked too, named with the forward line that created them (as
``torch.autograd.detect_anomaly`` does, whose forward tracebacks this turns on); the
error of a backward op is raised when ``backward()`` has finished, by the next tpu op
or value read (Note [Why backward errors are deferred]). Each
op runs at once, as in Strict mode, whatever the eager mode: a value that DeferAndFuse
would leave pending is computed and compared where the op is called. It is a debugging
tool: every op costs a host copy of its inputs and a CPU run.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from torchtpu.dispatch import backward_errors
from torchtpu.observe import compare
from torchtpu.observe.locations import op_location
from torchtpu.tensor import TPUTensor

aten = torch.ops.aten


class TPUDivergenceError(RuntimeError):
    """A tpu op's result differs from the CPU's for the same inputs."""


class TPUDivergenceWarning(UserWarning):
    """``check_against_cpu(action="warn")``: a tpu op's result differs from the CPU's."""


# Ops that move or allocate rather than compute, whose results the next op's check covers.
_NOT_COMPUTATIONS = frozenset(
    {
        aten._to_copy.default, aten.copy_.default, aten.detach.default, aten.alias.default,
        aten.lift_fresh.default, aten.empty.memory_format, aten.empty_strided.default,
        aten.empty_like.default, aten.new_empty.default, aten.new_empty_strided.default,
        aten.resize_.default, aten._local_scalar_dense.default, aten.set_.source_Tensor,
    }
)  # fmt: skip


class _AgainstCPU(TorchDispatchMode):
    def __init__(self, action: str):
        super().__init__()
        self.action = action

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        if func in _NOT_COMPUTATIONS or not any(isinstance(t, TPUTensor) for t in leaves):
            return func(*args, **kwargs)
        on_cpu = tree_map(_host_copy, (args, kwargs))
        result = func(*args, **kwargs)
        try:
            expected = func(*on_cpu[0], **on_cpu[1])
        except Exception:
            return result  # the CPU refuses what tpu computed: not a value to compare
        problem = _difference(func, result, expected, on_cpu)
        if problem is not None:
            self._report(func, leaves, problem)
        return result

    def _report(self, func, leaves, problem: str) -> None:
        inputs = ", ".join(
            f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            for t in leaves
            if isinstance(t, torch.Tensor)
        )
        message = (
            f"torchtpu: {func} at {op_location()} differs from the CPU for the same inputs "
            f"({inputs}): {problem}"
        )
        if self.action == "warn":
            warnings.warn(message, TPUDivergenceWarning, stacklevel=2)
        elif backward_errors.in_backward():
            # Raised by the next tpu op or read on the user's thread (Note [Why
            # backward errors are deferred]); the backward pass runs to its end.
            backward_errors.record(TPUDivergenceError(message))
        else:
            raise TPUDivergenceError(message)


def _host_copy(value):
    if isinstance(value, TPUTensor):
        return value.detach().cpu().clone()
    if isinstance(value, torch.device) and value.type == "tpu":
        return torch.device("cpu")
    return value


def _difference(func, result, expected, on_cpu) -> str | None:
    """What differs between tpu's and the CPU's results, or None."""
    name = func._schema.name.split("::")[-1].rstrip("_")
    random = torch.Tag.nondeterministic_seeded in func.tags
    ours = tree_map(lambda t: t.cpu() if isinstance(t, TPUTensor) else t, result)
    cpus = expected
    if name in compare.TIE_AMBIGUOUS_INDICES:  # the harness's ops: indices of ties
        ours, cpus = _values_only(ours), _values_only(cpus)
    try:
        compare.compare(ours, cpus, random)
        return None
    except compare.Mismatch as mismatch:
        low_precision = [
            t for t in tree_flatten(cpus)[0] if isinstance(t, torch.Tensor)
            and t.dtype in compare.JUDGED_BY_FLOAT64
        ]  # fmt: skip
        if random or not low_precision:
            return f"{mismatch}{_errors(ours, cpus)}"
    # 16-bit results: as accurate as the CPU's against float64?
    widened = tree_map(
        lambda t: (
            t.double()
            if isinstance(t, torch.Tensor) and t.dtype in compare.JUDGED_BY_FLOAT64
            else t
        ),
        on_cpu,
    )
    try:
        exact = func(*widened[0], **widened[1])
        compare.judge_by_float64(ours, cpus, exact, low_precision[0].dtype)
        return None
    except compare.Mismatch as mismatch:
        return f"{mismatch}{_errors(ours, cpus)}"
    except Exception:
        return f"differs from the CPU{_errors(ours, cpus)}"


def _values_only(value):
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if not (isinstance(t, torch.Tensor) and not t.is_floating_point())]


def _errors(ours, cpus) -> str:
    worst_abs, worst_rel = 0.0, 0.0
    for a, e in zip(tree_flatten(ours)[0], tree_flatten(cpus)[0]):
        if not (isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor)):
            continue
        if a.shape != e.shape or not (a.is_floating_point() or a.is_complex()):
            continue
        diff = (a.double() - e.double()).abs()
        finite = torch.isfinite(diff)
        if finite.any():
            worst_abs = max(worst_abs, diff[finite].max().item())
            rel = diff[finite] / e.double().abs()[finite].clamp_min(1e-30)
            worst_rel = max(worst_rel, rel.max().item())
    if worst_abs == 0.0 and worst_rel == 0.0:
        return ""
    return f" (max absolute error {worst_abs:.3g}, max relative error {_fmt(worst_rel)})"


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


@contextlib.contextmanager
def check_against_cpu(action: str = "raise"):
    """Run every tpu op on the CPU too and raise (``action="raise"``) or warn
    (``"warn"``) at the first whose result differs (see the module docstring)."""
    if action not in ("raise", "warn"):
        raise ValueError(f"check_against_cpu: action must be 'raise' or 'warn', got {action!r}")
    from torchtpu.dispatch import defer

    defer.flush("mode change")
    with torch.autograd.set_detect_anomaly(True, check_nan=False), _AgainstCPU(action):
        yield
