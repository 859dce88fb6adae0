"""Tracing: eager torch code run on JAX tracers, so that it becomes one XLA program.

Both compiled paths (``torch.compile(backend="tpu")`` and `torchtpu.jit`) build their
programs the same way: inside ``jax.jit``, they run torch ops through the ordinary
dispatcher on TPUTensors whose storages hold JAX tracers. Lowerings, views, in-place
writes and type promotion are then exactly eager's, from the same table.

This module is the trace *slot*: whether one is active and what it collects. It sits
at the bottom of the package because the eager machinery below the compilers (random
keys, storages, value checks, host reads) consults it; the compilers start and end
traces (compile/program.py ``trace``).

While a trace is active:

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


class Trace:
    """What one trace collects besides the program's outputs."""

    def __init__(self, seed, offset):
        self.seed, self.offset = seed, offset
        self.draws = 0  # random ops traced; the RNG offset advances by this per run
        self.checks: list[tuple] = []  # (flag tracer, exception type, message, op)
        self.created: list = []  # weak references to the storages made while tracing
        self.cpu_scalars: list = []  # 0-d CPU tensors read as constants
        # The devices (one per process) the program runs over as one SPMD program, when
        # it holds collectives (Note [Collectives in compiled programs]); else None.
        self.mesh: tuple | None = None

    def draw(self):
        """(seed, offset) of the next random op: traced values, offset by its rank."""
        n = self.draws
        self.draws += 1
        return self.seed, self.offset + n


_active: Trace | None = None


# The mesh axis of programs over several processes' devices: torch.distributed
# collectives (distributed/collectives.py) and the compiled programs that hold them.
MESH_AXIS = "r"

# [collectives of tpu values run outside traces so far, the devices of the last]: how
# torchtpu.jit's eager first call learns that its step holds collectives, so that it
# traces the step over their devices at once (a trace stopped half-way by `NeedsMesh`
# would leave DDP's reducer, which counts the gradients it has seen, half-way too).
eager_collectives: list = [0, None]


class NeedsMesh(Exception):
    """Raised out of a trace that met a torch.distributed collective: the program must be
    traced again as one SPMD program over ``devices``, the collective's devices in
    group-rank order (Note [Collectives in compiled programs] in compile/program.py)."""

    def __init__(self, devices: tuple):
        super().__init__("a collective needs the program traced over its group's devices")
        self.devices = devices


def active() -> Trace | None:
    return _active


def refuse(what: str, op=None) -> None:
    """Raise the error for something a compiled program cannot do (``op``: the aten op)."""
    raise RuntimeError(
        ("" if op is None else f"{op}: ")
        + f"{what}, which a compiled program (torch.compile(backend='tpu') or "
        "torchtpu.jit) cannot do: its values exist only when the program runs. Move this "
        "out of the compiled function, or run it eagerly."
    )
