"""Every setting of torchtpu, declared once.

Each setting has one environment variable, read here and nowhere else. Code reads
``config.<name>``; tests and users may assign to it at run time.
"""

from __future__ import annotations

import os


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def _env_mode() -> str:
    """The default eager mode: TORCHTPU_EAGER_MODE, or TorchTPU's own variables."""
    mode = os.environ.get("TORCHTPU_EAGER_MODE", "").strip().lower()
    if mode:
        return mode
    if _env_flag("TORCH_TPU_DEFER_AND_FUSE", False):
        return "defer"
    if _env_flag("TORCH_TPU_LAUNCH_BLOCKING", False):
        return "debug"
    return "strict"


#: Name of the eager mode a new process starts in: "strict", "debug" or "defer".
eager_mode: str = _env_mode()

#: Run ops that have neither a lowering nor a decomposition on the CPU (counted and
#: warned once per op). When False such ops raise NotImplementedError naming the op.
cpu_fallback: bool = _env_flag("TORCHTPU_CPU_FALLBACK", True)

#: JAX's asynchronous dispatch on its CPU backend. It gains nothing for small ops and
#: costs a lot under contention (DESIGN.md §8), so it is off unless asked for. It only
#: takes effect before the JAX backend starts.
cpu_async_dispatch: bool = _env_flag("TORCHTPU_CPU_ASYNC_DISPATCH", False)

#: Deferred device-side checks (an index out of range) are checked at the latest when
#: this many are pending, even without a read of values.
max_pending_checks: int = int(os.environ.get("TORCHTPU_MAX_PENDING_CHECKS", "256"))

#: Which OpInfo conformance cases the test suite runs: "ci" (float32 forward of every
#: op and variant, in Strict) or "full" (every dtype, gradients, error inputs, every
#: mode). ``python -m torchtpu.conformance`` always runs the full set.
conformance_scope: str = os.environ.get("TORCHTPU_CONFORMANCE", "ci").strip().lower()
