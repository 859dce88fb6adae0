"""Ops the platform policy keeps off the device: run on the host CPU, by XLA:CPU.

A plan whose call touches a dtype the host keeps (float64, complex128 on a TPU), or
whose program breaks one of the policy's rules, has ``plan.host_rule`` set
(builder.py; Note [64-bit types on TPU] in runtime/policy.py). Its jitted function --
the same lowering -- then runs on the host device: its device inputs are copied to the
host, its results of device dtypes copied back, and host-kept results stay. It is slow,
so never silent: counted per op in ``torchtpu.metrics()["host_ops"]`` and warned about
once per rule, naming the first op (``TPUHostComputeWarning``). In DeferAndFuse such an
op runs at once (the queue is flushed first); in a compiled program it is refused,
naming the rule.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

from torchtpu import dtypes
from torchtpu.observe import metrics
from torchtpu.observe.locations import user_frame, user_stacklevel
from torchtpu.runtime import device as jax_device
from torchtpu.runtime import jax, policy


class TPUHostComputeWarning(UserWarning):
    """An op ran on the host CPU because the device's compiler must not be given it."""


_warned: set = set()

# Set while a host program is being compiled and run (the compile check in
# conformance/xla_tpu.py leaves such programs out: XLA:TPU never sees them).
running = threading.local()


@contextlib.contextmanager
def on_host():
    """Within: JAX computes on the host device (arrays made without inputs too)."""
    running.active = True
    try:
        with jax().default_device(policy.host_device()):
            yield
    finally:
        running.active = False


def to_host(args):
    """``args`` (a pytree) with every JAX array copied to the host device."""
    jx = jax()
    host = policy.host_device()
    return jx.tree_util.tree_map(
        lambda a: jx.device_put(a, host) if isinstance(a, jx.Array) else a, args
    )


def call(plan, args: list, device: int) -> list:
    """Run ``plan``'s jitted function on the host with ``args`` (arrays on any device,
    Python numbers); return its flat results, those of device dtypes on ``tpu:device``."""
    note(plan.op, plan.host_rule)
    with on_host():
        flat = list(plan.traceable(*to_host(args)))
    kept = policy.host_dtypes()
    target = jax_device(device)
    if target != policy.host_device():
        for i, (_, dtype) in enumerate(plan.avals):
            if dtype is not None and dtypes.to_torch(dtype) not in kept:
                flat[i] = jax().device_put(flat[i], target)
    return flat


def refused(plan) -> RuntimeError:
    """The error for a host-run op met inside a compiled program."""
    rule = plan.traced_rule
    return RuntimeError(
        f"{plan.op}: {rule.reason}. Outside a compiled program this op runs on the host "
        "CPU; a compiled program (torch.compile(backend='tpu') or torchtpu.jit) is one "
        "XLA program on the device and cannot. "
        + (f"Use {rule.instead} instead, or move" if rule.instead else "Move")
        + " it out of the compiled function."
    )


def note(op, rule) -> None:
    """Count a host run of ``op`` for ``rule``, and warn the first time for the rule."""
    metrics.count("host_ops", str(op))
    if rule.name in _warned:
        return
    _warned.add(rule.name)
    instead = f"; {rule.instead} runs on the device" if rule.instead else ""
    warnings.warn(
        f"torchtpu: {op} (called from {user_frame()}) runs on the host CPU, not the "
        f"device, as will every op with {rule.name}: {rule.reason}. Inputs are copied to "
        f"the host and results back (slow){instead}. See torchtpu.metrics()['host_ops'].",
        TPUHostComputeWarning,
        stacklevel=user_stacklevel(),
    )
