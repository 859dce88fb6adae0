"""Strict's programs compile in the background; the ops that wait for them are queued.

Note [Strict compiles in the background]
    A first step in Strict meets a program to compile at almost every op (a small
    model's step, ~20-30; a library model's, hundreds), and compiled them one after
    another in the calling thread: on the CPU backend three quarters of the demo MLP's
    first step was XLA's compiler (0.75 of 1.06 s, 21 programs), on a TPU v5e 4.7 of
    5.0 s. XLA's compiler releases the GIL. So an op whose program is not compiled yet
    is traced and lowered in the calling thread (torch's and torchtpu's state are that
    thread's, and a lowering's errors still surface at the op), its compile is handed to
    a pool of `config.compile_threads` workers, and the op is *queued*: its outputs are
    `Pending` values, as DeferAndFuse's are, and Python goes on with the step. An op
    whose inputs are queued is queued too, compiled or not; any other op runs at once.

    A queue of this kind is never fused: when it runs, each op runs its own program
    (the one Strict runs for it every later step, found in ``jax.jit``'s cache), in the
    order recorded, after waiting for that program's compile. It runs once none of its
    compiles is outstanding (checked as ops are queued), and at whatever makes
    DeferAndFuse's queues run: a value read, ``torch.tpu.synchronize()``, a mode change,
    a host op, a full queue. Every later step finds its programs compiled and runs op by
    op as before, with nothing queued.

    What this changes for a Strict user: an op's errors from its lowering and torch's
    checks still raise at the op; an error while compiling or running a queued op (an
    out-of-memory) raises at the read that waits for it, naming the op and its line, as
    DeferAndFuse does (a Strict op's run was asynchronous already). Debug mode compiles
    and runs each op before it returns, as before; ``config.background_compiles =
    False`` makes Strict do so too.
"""

from __future__ import annotations

import concurrent.futures
import os

from torchtpu import config, memory
from torchtpu.dispatch import checks, defer
from torchtpu.dispatch.pending import Pending
from torchtpu.dispatch.scalars import as_array
from torchtpu.observe import metrics, perf_warnings, progress
from torchtpu.runtime import jax, sharding
from torchtpu.tensor import backward_on_calling_thread

# Non-empty queues of this kind, over all threads: while there are none (every step
# after the first), Strict's hot path checks only this number.
queued = 0

# id(program) -> (program, Future of its compile): programs compiling, or compiled and
# not yet run (the first run counts the compile).
_compiling: dict[int, tuple] = {}

_pool: concurrent.futures.ThreadPoolExecutor | None = None


# On a TPU v5e's 13-core host, a small Llama's first Strict step took 7.7 s with 4
# compiling threads and 9.7 s with 8 (one run each, docs/performance.md): XLA's TPU
# compiler uses threads of its own, and more compiles at once only slowed each.
_MOST_THREADS = 4


def threads() -> int:
    """How many programs compile at once: ``config.compile_threads``, or one fewer than
    the host's cores (the calling thread traces while they compile), at least one and
    at most `_MOST_THREADS`."""
    if config.compile_threads > 0:
        return config.compile_threads
    return max(1, min(_MOST_THREADS, (os.cpu_count() or 2) - 1))


def compiler() -> concurrent.futures.ThreadPoolExecutor:
    """The pool XLA's compiles run in (Strict's programs here; a compiled graph's
    backward ahead of its first call, compile/program.py)."""
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads(), thread_name_prefix="torchtpu-compile"
        )
    return _pool


def is_compiling(program) -> bool:
    """Whether ``program``'s compile is under way or done and not yet run (a failed
    one is forgotten: the next call compiles it again)."""
    entry = _compiling.get(id(program))
    if entry is None:
        return False
    future = entry[1]
    if future.done() and future.exception() is not None:
        del _compiling[id(program)]
        return False
    return True


def inputs(device: int) -> dict:
    """The arrays this thread's queue on ``tpu:device`` holds as inputs, by id."""
    q = defer._threads.background_by_device.get(device)
    return q.external_slot if q is not None else {}


def start_compile(program, args: list, device: int, op: str, where: str) -> None:
    """Trace and lower ``program`` for ``args`` (arrays, numbers, Pendings) here, and
    compile it on a worker (``op``'s program, for user line ``where``). A lowering's
    error raises here, at the op."""
    place = sharding(device)
    specs = [
        jax().ShapeDtypeStruct(a.shape, a.dtype, sharding=place)
        if type(a) is Pending
        else as_array(a)
        for a in args
    ]
    lowered = program.lower(*specs)
    _compiling[id(program)] = (program, compiler().submit(_compile, lowered, op, where))
    perf_warnings.compile_started("op", where)


def _compile(lowered, op: str, where: str) -> tuple:
    """On a worker: XLA's compile. Returns the compiled program (kept until its first
    run, so that ``jax.jit`` finds it) and its seconds."""
    token = progress.started(op, where)
    try:
        compiled = lowered.compile()
    finally:
        seconds = progress.finished(token)
    return compiled, seconds


def record(plan, program, args: list, avals: list, where: str | None, device: int) -> list:
    """Queue ``plan``'s call (its ``args``; ``program``: the jitted function that runs
    it) on ``tpu:device``; returns a Pending per output, as `defer.record` does."""
    global queued
    with defer._lock:
        home = defer._threads.background_by_device
        q = home.get(device)
        if q is None:
            q = home[device] = defer._Queue(device, home)
            # Forward and backward in one queue: the backward on this thread too.
            backward_on_calling_thread()
        if not q.plans:
            queued += 1
        position, n_externals = len(q.plans), len(q.externals)
        try:
            outputs = defer._append(q, plan, args, avals, where, position)
        except BaseException:
            defer._forget(q, position, n_externals)
            if not q.plans:
                queued -= 1
            raise
        q.programs.append(program)
        entry = _compiling.get(id(program))
        if entry is not None:
            q.compiles.append(entry[1])
        q.compiles = [f for f in q.compiles if not f.done()]
        if not q.compiles:  # nothing left to wait for: it runs now
            try:
                defer._flush(q, "compiled")
            except Exception:
                pass  # every value of the queue holds the error: reading one raises it
        elif len(q.plans) >= config.defer_max_ops:
            defer._flush(q, "queue full")
        return outputs


def run(q, reason: str) -> None:
    """Run a queue of this kind: each op its own program, in order (Note [Strict
    compiles in the background]). Called by defer's flush, under its lock."""
    global queued
    queued -= 1
    metrics.count("background_runs", reason)
    externals, refs, plans = q.externals, q.refs, q.plans
    # The last op reading each op's outputs: its values are dropped after it.
    last_reader = {}
    for position, op_refs in enumerate(refs):
        for kind, a, _ in op_refs:
            if kind == 1:
                last_reader[a] = position
    results: list = [None] * len(plans)
    for position, plan in enumerate(plans):
        args = [as_array(externals[a]) if kind == 0 else results[a][b] for kind, a, b in refs[position]]
        program = q.programs[position]
        entry = _compiling.get(id(program))
        try:
            if entry is not None:
                _wait(plan, program, entry[1], q.wheres[position])
            flat = program(*args)
        except Exception as exc:
            raise defer._annotate(defer._NodeError(position, exc), q) from None
        results[position] = flat
        for ref, value in zip(q.outputs[position], flat):
            pending = ref()
            if pending is not None:
                pending.value = value
        if plan.check_infos:
            n = len(plan.outputs) + len(plan.written_slots)
            checks.defer(list(flat[n:]), plan.check_infos, f"called from {q.wheres[position]}")
        for kind, a, _ in refs[position]:
            if kind == 1 and last_reader[a] == position:
                results[a] = None
    for hook in defer.after_run:
        hook(reason)


def _wait(plan, program, future, where: str | None) -> None:
    """The first run of ``program``: wait for its compile, and count it."""
    where = where or "<unknown>"
    try:
        _, seconds = future.result()
    finally:
        del _compiling[id(program)]  # (a failed compile starts again at the op's next call)
    plan.compiled = True
    plan.note_fast()
    metrics.count("compile_seconds_by_line", where, seconds)
    perf_warnings.compiled("op", seconds, where, str(plan.op), started=True)


def run_queued(reason: str = "memory stats") -> None:
    """Run this thread's queues of this kind now (their compiles waited for)."""
    for q in list(defer._threads.background_by_device.values()):
        if q.plans:
            defer._flush(q, reason)


defer.run_op_by_op = run
memory.before_stats.append(run_queued)
