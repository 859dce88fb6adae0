"""Small ops whose shapes keep changing run on the CPU instead of compiling.

Note [Small ops of changing shapes run on the CPU]
    XLA compiles a program for each shape. A line that meets a new shape of small
    tensors again and again -- a decoding loop's ``torch.cat([input_ids, next_tokens],
    -1)`` and its position ids, one longer each token -- compiled a program for each: in
    a Transformers ``generate()`` with a static cache, four a token, ~1,000 for 256
    tokens, each taking XLA's compiler tens to hundreds of milliseconds on a TPU (and on
    the CPU backend its memory: the loaded programs were most of that generate's peak).
    Their values are a few bytes: torch's CPU kernel computes them in microseconds, and
    copying them to the host and back costs a wait for the device, which such a loop
    makes each token anyway (to test whether it has finished).

    So at a plan cache miss (a new signature), a call whose tensors are all small
    (`SMALL_BYTES` each, its outputs too) from an (op, user line) whose calls took
    `CHANGING` signatures, each first met after another of the program's reads of values
    or optimizer steps (a line that meets new shapes over a loop's steps, not a first
    step or a model's initialisation compiling many shapes at once, nor a training loop
    whose second step runs a few programs more; cf. Note [What counts as recompiling]) runs on
    the CPU through torch's own kernel, exactly as the CPU fallback runs an op
    (fallback.py `compute_on_cpu`). Its plan is marked, so a later call of that
    signature from such a line runs on the CPU too -- until the signature recurs often
    (`RECUR` times in a row within `RECUR_WITHIN` runs of small ops on the CPU: a loop
    at a fixed shape) or a line whose shapes do not change calls it, when it compiles
    as any op does. Never routed: ops drawing random numbers (the CPU's
    stream is not the device's), ops writing into their arguments, ops the platform
    keeps on the host already, ops with no CPU kernel (torchtpu's own), and ops inside a
    compiled program; nor are results torch lays out other than contiguously (the copy
    back is contiguous). A call the CPU kernel refuses (a dtype it lacks, a bad index)
    takes the op's own path, which says what the device says. In DeferAndFuse such
    an op ends the chunk (its inputs are read), which also keeps the growing shape out
    of the chunk's signature: the chunk before it compiles once, not once a token.
    Counted by op in ``metrics()["small_ops_on_cpu"]``; ``config.small_ops_on_cpu``
    (``TORCHTPU_SMALL_OPS_ON_CPU=0``) turns it off.
"""

from __future__ import annotations

import torch

from torchtpu import config
from torchtpu.dispatch import defer, fallback
from torchtpu.dispatch.values import contiguous
from torchtpu.observe import metrics, perf_warnings
from torchtpu.observe.locations import user_frame
from torchtpu.tensor import TPUTensor

# The largest tensor (input or output, in bytes) of a call that may run on the CPU.
SMALL_BYTES = 1 << 14
# A plan on the CPU compiles after RECUR runs in a row, each within RECUR_WITHIN runs
# of small ops on the CPU of its previous one.
RECUR, RECUR_WITHIN = 3, 64

# An (op, line) is changing once its calls took CHANGING signatures, each first at a
# different time (a training loop's first and second steps run different programs from
# some lines: two).
CHANGING = 3
# (op, user line) -> [uid of the plan it last called, the time it changed to it, how
# many different times it changed]
_lines: dict[tuple, list] = {}
_runs = 0  # small ops run on the CPU so far: the clock of a plan's recurrences


def reset() -> None:
    """Forget which lines change signatures (a fresh program's state: the tests' own)."""
    _lines.clear()


def _changing(plan, where: str) -> bool:
    """Note that ``where`` calls ``plan``; whether that line keeps changing signatures."""
    # Time, here, is the values the program read and its optimizer steps: a loop's
    # steps. DeferAndFuse's own flushes and torch's own reads (nn.init's) are not.
    now = perf_warnings.reads + perf_warnings.optimizer_steps
    line = _lines.get((plan.op, where))
    if line is None:
        _lines[(plan.op, where)] = [plan.uid, now, 1]
        return False
    if line[0] != plan.uid:
        line[2] += line[1] != now
        line[0], line[1] = plan.uid, now
    return line[2] >= CHANGING


def route(plan, values) -> bool:
    """At ``plan``'s cache miss: whether it runs on the CPU; marks it so."""
    op = plan.op
    if (
        not config.small_ops_on_cpu
        or plan.random
        or plan.written_slots
        or plan.host_rule is not None
        or plan.output_bytes > SMALL_BYTES
        or any(r.alias_info is not None for r in op._schema.returns)  # views, out=
        or not torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), "CPU")
        or not _small(values)
        or any(o is not None and o.strides != contiguous(o.shape) for o in plan.outputs)
    ):
        return False
    where = user_frame()
    if where == "<unknown>" or not _changing(plan, where):  # "<unknown>": autograd's thread
        return False
    plan.on_cpu = [None, 0]  # the clock at its last run, its recurrences in a row
    return True


def _small(values) -> bool:
    for v in values:
        if isinstance(v, (list, tuple)):
            if not _small(v):
                return False
        elif isinstance(v, TPUTensor) and v.numel() * v.element_size() > SMALL_BYTES:
            return False
    return True


def run(plan, func, args, kwargs):
    """Run a marked plan's call on the CPU; None where it recurs enough to compile."""
    global _runs
    if not config.small_ops_on_cpu:  # turned off since the plan was marked
        plan.on_cpu = None
        return None
    last, recurred = plan.on_cpu
    recurred = recurred + 1 if last is not None and _runs - last <= RECUR_WITHIN else 0
    if recurred >= RECUR or not _changing(plan, user_frame()):
        # it recurs (a loop at a fixed shape), or a line that keeps its shapes calls it
        plan.on_cpu = None
        return None
    _runs += 1
    plan.on_cpu = [_runs, recurred]
    defer.flush("small op on the cpu")
    try:
        result = fallback.compute_on_cpu(func, args, kwargs)
    except Exception:
        # The CPU refused it (a dtype its kernel lacks: histc of integers) or found an
        # error: the op's own path says what the device says, as it always would.
        plan.on_cpu = None
        return None
    metrics.count("small_ops_on_cpu", str(func))
    return result
