"""Warnings about slow patterns: a line that keeps recompiling, a loop that flushes.

Each warns once per cause (the user's line), after a threshold, so a notebook shows
one actionable line instead of a flood. The CPU fallback's own warning lives in
fallback.py.

Note [What counts as recompiling]
    A line may legitimately compile many programs at once: ``opt.step()`` runs
    ``add_`` once per parameter shape, and a MobileNet's ``model(x)`` compiles 64
    batch norms of different shapes in its first step. What is slow is a line that
    compiles again and again *over time*. Time here is counted in epochs, which end
    at each read of a value (``.item()``, ``.cpu()``, a DeferAndFuse flush) and each
    ``optimizer.step()``: a training step reads its loss or steps. So a (op, line)
    recompiles when it compiles in another epoch than the one it last compiled in; it
    warns after ``config.recompile_warn_after`` such epochs, or after eight times as
    many compiles outside its first epoch (a loop whose epochs hold several compiles
    each). A loop that neither reads nor steps is one epoch: its compiles are not told
    from a first step's. A read torch's own code asks for does not end an epoch for
    the line it was made from: TorchTitan initialises each parameter from one line
    with ``nn.init.trunc_normal_``, whose rejection loop reads ``mask.any()``, so each
    parameter's shape compiled ``normal_`` "in another epoch" and the line warned
    after 8 shapes, compiled once each.
"""

from __future__ import annotations

import collections
import time
import warnings

from torch.optim.optimizer import register_optimizer_step_post_hook

from torchtpu import config
from torchtpu.observe import metrics, progress
from torchtpu.observe.locations import user_stacklevel


class TPUPerformanceWarning(UserWarning):
    """Something makes tpu code slow; the message says what and how to avoid it."""


class TPURecompileWarning(TPUPerformanceWarning):
    """The same line keeps compiling new XLA programs."""


class TPUFlushWarning(TPUPerformanceWarning):
    """DeferAndFuse flushes its queue from the same line again and again."""


class TPUCompileBudgetWarning(TPUPerformanceWarning):
    """One line compiled more XLA programs, or for longer, than the compile budget
    (``config.compile_budget_programs``, ``config.compile_budget_seconds``) allows."""


class TPUCompileBudgetError(RuntimeError):
    """The same, with ``config.compile_budget_action = "error"`` (for CI)."""


# Reads of values and optimizer steps so far: the clock of Note [What counts as
# recompiling].
epoch = 0
# Optimizer steps ended, and values the program read (DeferAndFuse's own flushes are
# not reads): the ends of a loop's steps, for Note [Compiling while warming up].
optimizer_steps = 0
reads = 0

# (kind, user line) -> [compiles, epochs with a compile, epoch of the last, last key,
# compiles outside the first epoch with a compile, reads torch made from that line
# when it last compiled]
_compiles: dict[tuple[str, str], list] = {}
# user line -> the epochs ended by reads torch's own code made from it (Note [What
# counts as recompiling]).
_reads_by_torch: dict[str, int] = {}
_warned_lines: set[str] = set()
# user line -> [flushes, warned]
_flushes: dict[str, list] = {}
# user line -> [programs compiled, seconds compiling, over budget already]
_budgets: dict[str, list] = {}
# user line -> what changed at its last few recompiles (Note [A compile budget])
_changes: dict[str, collections.deque] = {}


def note_read(value_read: bool = True, by_torch_at: str | None = None) -> None:
    """A value was read (``value_read``; asked by torch's own code from user line
    ``by_torch_at``, where it was), or DeferAndFuse ran a chunk for another reason."""
    global epoch, reads
    epoch += 1
    # Reads that end a loop's steps (Note [Compiling while warming up]): not torch's own.
    reads += value_read and by_torch_at is None
    if by_torch_at is not None:
        _reads_by_torch[by_torch_at] = _reads_by_torch.get(by_torch_at, 0) + 1
    progress.note_read()  # a burst of compiles ends at a read too


def _end_of_step(optimizer, args, kwargs) -> None:
    global epoch, optimizer_steps
    epoch += 1
    optimizer_steps += 1


register_optimizer_step_post_hook(_end_of_step)


def note_compile(kind: str, where: str, key, describe_change) -> None:
    """Called on every compilation of a ``kind`` ("aten.add.Tensor", "a DeferAndFuse
    chunk") from user line ``where``; ``describe_change(old_key, new_key)`` says what
    differs. Warns once per line."""
    if where == "<unknown>":  # e.g. the backward pass, on autograd's thread
        return
    entry = _compiles.get((kind, where))
    own_reads = _reads_by_torch.get(where, 0)
    if entry is None:
        _compiles[(kind, where)] = [1, 1, epoch, key, 0, own_reads]
        return
    entry[0] += 1
    if config.compile_budget_programs or config.compile_budget_seconds:
        changes = _changes.setdefault(where, collections.deque(maxlen=3))
        changes.append(f"{kind}: {describe_change(entry[3], key)}")
    if epoch - entry[2] > own_reads - entry[5]:  # an epoch ended not by torch's reads here
        entry[1] += 1
    entry[2], entry[5] = epoch, own_reads
    if entry[1] > 1:
        entry[4] += 1
    limit = config.recompile_warn_after
    if (entry[1] >= limit or entry[4] >= 8 * limit) and where not in _warned_lines:
        _warned_lines.add(where)
        change = describe_change(entry[3], key)
        warnings.warn(
            f"torchtpu: {where} keeps compiling {kind} ({entry[0]} programs so far); the "
            f"last compile was caused by {change}. Each new shape, dtype or constant "
            "compiles a new XLA program: keep shapes fixed (pad or bucket them) and pass "
            "changing numbers as tensors or Python floats.",
            TPURecompileWarning,
            stacklevel=user_stacklevel(),
        )
    entry[3] = key


def compile_started(kind: str, where: str) -> None:
    """A compile of ``kind`` for user line ``where`` began on a worker thread
    (dispatch/background.py): counted now, its seconds when it is done (`compiled`)."""
    metrics.count("compiles", kind)
    metrics.count("compiles_by_line", where)


def compiled(kind: str, seconds: float, where: str, what: str, started: bool = False) -> None:
    """An XLA program of ``kind`` ("op", "graph") compiled in ``seconds`` for user line
    ``where``: its counters (unless `compile_started` counted it) and the line's budget."""
    if not started:
        metrics.count("compiles", kind)
    metrics.count("compile_seconds", kind, seconds)
    note_compile_time(where, seconds, what, counted=started)


def note_compile_time(where: str, seconds: float, what: str, counted: bool = False) -> None:
    """Note [A compile budget]
        Called after each XLA program compiled for user line ``where`` (an op's, a
        DeferAndFuse chunk's, a compiled graph's or step's: ``what``) with its seconds.
        ``metrics()`` counts them by line (``compiles_by_line``; progress.py counts
        ``compile_seconds_by_line``). A line that compiles more programs than
        ``config.compile_budget_programs``, or for longer than
        ``config.compile_budget_seconds`` (0: no budget, the default), gets one
        TPUCompileBudgetWarning naming it, its programs and seconds, and what changed at
        its last recompiles; with ``config.compile_budget_action = "error"`` it raises
        TPUCompileBudgetError instead, so that a CI run fails where a change made a
        line compile more than it should."""
    if not counted:
        metrics.count("compiles_by_line", where)  # and their seconds: progress.py
    programs, limit = config.compile_budget_programs, config.compile_budget_seconds
    if not (programs or limit):
        return
    entry = _budgets.setdefault(where, [0, 0.0, False])
    entry[0] += 1
    entry[1] += seconds
    if entry[2] or not ((programs and entry[0] > programs) or (limit and entry[1] > limit)):
        return
    entry[2] = True
    parts = [f"{programs} programs"] if programs else []
    if limit:
        parts.append(f"{limit:g} s")
    budget = " and ".join(parts)
    changes = "; ".join(_changes.get(where, ())) or f"the last was {what}"
    message = (
        f"torchtpu: {where} compiled {entry[0]} XLA programs in {entry[1]:.1f} s, over the "
        f"compile budget of {budget} a line. What changed: {changes}. Keep shapes fixed "
        "(pad or bucket them; torch.compile(dynamic=True) buckets sizes for inference) and "
        "pass changing numbers as tensors."
    )
    if config.compile_budget_action == "error":
        raise TPUCompileBudgetError(message)
    warnings.warn(message, TPUCompileBudgetWarning, stacklevel=user_stacklevel())


def note_flush(reason: str, where: str) -> None:
    """Called on a DeferAndFuse flush caused by reading a value at ``where``."""
    entry = _flushes.get(where)
    if entry is None:
        _flushes[where] = [1, False]
        return
    entry[0] += 1
    if entry[0] >= config.flush_warn_after and not entry[1]:
        entry[1] = True
        warnings.warn(
            f"torchtpu: {where} has flushed the DeferAndFuse queue {entry[0]} times "
            f"({reason}). Each flush waits for the device and ends a fused chunk: read "
            "values less often (e.g. log loss.item() every N steps, or accumulate "
            "losses in a tensor and read it once).",
            TPUFlushWarning,
            stacklevel=user_stacklevel(),
        )


class TPUCompileTimeWarning(TPUPerformanceWarning):
    """Compiling DeferAndFuse chunks takes most of the program's time."""


# Chunk compiles: [seconds in all, count, time of the first, warned, (optimizer steps,
# reads) at the first, compiles of ops an earlier chunk compiled had]
_chunk_compiles = [0.0, 0, None, False, (0, 0), 0]
# A hash of the ops of each chunk compiled (Note [Compiling while warming up]): the
# tuples themselves (up to defer_max_ops ops each) would be kept for the process's life.
_chunk_ops: set[int] = set()
# Chunk compiles with no step ending that may still be a loop's first steps.
WARM_UP_CHUNKS = 8


def _warmed_up(entry) -> bool:
    """Note [Compiling while warming up]
    A loop's first two steps compile chunks that later steps reuse: the first step's
    forward and backward (a large one in several chunks of ``defer_max_ops``), the
    second step's optimizer chunk (its state exists from then on). On a TPU a
    GPT-2-sized model spends most of a minute in them, which is most of the time so far
    but says nothing of the loop. So TPUCompileTimeWarning waits until two steps have
    ended since the first chunk compiled, and compiles go on. Steps end at
    ``optimizer.step()``; where no optimizer has stepped since then, at each read of a
    value that code outside torch asked for (a training loop that reads its loss as well
    ends one step per iteration; ``nn.init.trunc_normal_``'s reads while a model is
    initialised do not).
    A loop that neither steps nor reads has no steps to tell: once ``WARM_UP_CHUNKS``
    chunks compiled the ops of an earlier chunk again (the same code at new shapes),
    its compiles are the pattern. A first step's chunks hold different ops each: a
    large model's step is cut by the full queue, and TorchTitan's first step compiled
    30 chunks before its optimizer stepped."""
    steps_then, reads_then = entry[4]
    steps = optimizer_steps - steps_then or reads - reads_then
    return steps >= 2 or (steps == 0 and entry[5] >= WARM_UP_CHUNKS)


def note_chunk_compile(seconds: float, ops: tuple, where: str) -> None:
    """Called after each DeferAndFuse chunk compiled (its ``ops``, flushed at
    ``where``). Warns once when compiling has taken more than half of the time since
    the first chunk compiled, and ``config.compile_warn_seconds`` in all, over at
    least three compiles (one long compile of a big step is not a pattern), after
    warming up (Note [Compiling while warming up])."""
    entry = _chunk_compiles
    now = time.perf_counter()
    if entry[2] is None:
        entry[2] = now - seconds
        entry[4] = (optimizer_steps, reads)
    entry[0] += seconds
    entry[1] += 1
    if hash(ops) in _chunk_ops:
        entry[5] += 1
    else:
        _chunk_ops.add(hash(ops))
    if (
        entry[3]
        or entry[1] < 3
        or entry[0] < config.compile_warn_seconds
        or entry[0] < 0.5 * (now - entry[2])
        or not _warmed_up(entry)
    ):
        return
    entry[3] = True
    warnings.warn(
        f"torchtpu: DeferAndFuse has spent {entry[0]:.1f} s of the last {now - entry[2]:.1f} s "
        f"compiling {entry[1]} chunks (the last: {len(ops)} ops, flushed at {where}). Large "
        "chunks compile slowly: call optimizer.step() or read a value once per step so "
        "that each step becomes one cached chunk, or lower torchtpu.config.defer_max_ops.",
        TPUCompileTimeWarning,
        stacklevel=user_stacklevel(),
    )


def first_difference(old, new, path: tuple = ()) -> tuple[tuple, object, object] | None:
    """The path to the first leaf where two nested tuples differ, and both leaves."""
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            found = first_difference(a, b, path + (i,))
            if found is not None:
                return found
        return None
    if old == new:
        return None
    return path, old, new


def reset() -> None:
    """Forget what was counted (each cause may warn again)."""
    _compiles.clear()
    _reads_by_torch.clear()
    _warned_lines.clear()
    _flushes.clear()
    _chunk_compiles[:] = [0.0, 0, None, False, (0, 0), 0]
    _chunk_ops.clear()
    _budgets.clear()
    _changes.clear()
