"""DeferAndFuse: ops are recorded, not run; each run of them becomes ONE jitted chunk.

Recording an op costs what Strict costs minus running it: the op's `Plan` (meta
oracle, cached per signature) gives its outputs' shapes and dtypes at once, and the
outputs are `Pending` values in their Storages. Reading a value (``.item()``,
``.cpu()``, ``print``), a CPU fallback, an op whose output shape depends on values, a
mode change, ``torch.tpu.synchronize()`` or a full queue *flushes*: the recorded
ops run as one function of their external inputs (arrays and traced scalars), jitted
once per chunk signature, so a training loop compiles its step once and then runs
one call per step.

Note [Chunk keys]
    A chunk's cache key is the sequence of (plan, how its arguments are wired) of its
    ops, plus which outputs are live. Recording appends each op's part to the queue's
    key list, so a flush turns it into a tuple at once instead of walking the ops.

Note [Live outputs]
    A node holds only weak references to its Pending outputs; Storages hold the
    strong ones. At a flush, a Pending still alive is referenced by some tensor the
    program can reach, so it becomes an output of the chunk; the others are
    intermediates XLA never materialises.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
import weakref

import numpy as np
import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from torchtpu import config, memory, tracing
from torchtpu.dispatch import checks, effort
from torchtpu.dispatch.pending import Pending
from torchtpu.dispatch.scalars import as_array
from torchtpu.dispatch.schema import FACTORIES
from torchtpu.observe import metrics, perf_warnings, progress
from torchtpu.observe.locations import user_frame
from torchtpu.runtime import array_type, jax, sharding
from torchtpu.tensor import backward_on_calling_thread


class _Queue:
    """The ops recorded since the last flush on one device by one thread, as parallel
    lists (one entry per op)."""

    def __init__(self, device: int, home: dict):
        self.device = device
        self.home = home  # the recording thread's queues, by device
        # Note [An optimizer's new state is made apart]
        self.makes_state = type(home) is _StateQueues
        # Note [Strict compiles in the background] (background.py): its ops run one by
        # one, each its own program (``programs``), after the compiles it waits for.
        self.op_by_op = type(home) is _BackgroundQueues
        self.programs: list = []
        self.compiles: list = []  # Futures of the compiles its ops wait for
        self.plans: list = []
        self.refs: list[tuple] = []  # per op: (0, external slot, 0) or (1, op, output)
        self.outputs: list[list] = []  # per op: weak references to its Pendings
        self.wheres: list = []  # per op: the user's line, where an error may need it
        # The chunk's cache key, built while recording (Note [Chunk keys]).
        self.key: list = []
        self.externals: list = []  # arrays and scalars, the chunk's inputs
        self.external_slot: dict[int, int] = {}  # id(array) -> position in externals
        # external slot -> (op, output): the new base an in-place op wrote over that
        # array's storage (Note [Donating dead inputs])
        self.replaced_by: dict[int, tuple[int, int]] = {}


# Note [A queue per thread and device]
#     Each thread records into its own queues, so two threads running their own
#     models never interleave ops in one chunk; and each device has its own, so a
#     chunk's inputs and ops are all on one device (JAX runs a program on one).
#     A value recorded in another queue is taken as that queue's output: the other
#     queue is flushed first. Any thread may flush any queue (a value read on one
#     thread of a tensor another made), so recording and flushing hold one lock.


class _StateQueues(dict):
    """A thread's queues of an optimizer's new state, by device (Note [An optimizer's
    new state is made apart])."""


class _BackgroundQueues(dict):
    """A thread's queues of Strict ops waiting for their programs' compiles, by device
    (Note [Strict compiles in the background], background.py)."""


class _ThreadQueues(threading.local):
    """This thread's queues, by device (Note [A queue per thread and device])."""

    def __init__(self):
        self.by_device: dict[int, _Queue] = {}
        # Note [An optimizer's new state is made apart]
        self.state_by_device: dict[int, _Queue] = _StateQueues()
        self.background_by_device: dict[int, _Queue] = _BackgroundQueues()
        self.in_optimizer_step = False
        self.recording_backward = False  # Note [The backward starts a chunk]
        self.runs = 0  # chunks this thread has run
        self.runs_at_step_end = 0  # ... when the last optimizer step ended
        self.full_runs = 0  # chunks run because the queue was full
        self.full_runs_at_step_end = 0
        self.ops_run = 0  # ops in the chunks this thread has run
        self.ops_run_at_step_end = 0


_threads = _ThreadQueues()
_lock = threading.RLock()
_UIDS = itertools.count()


def new_uid() -> int:
    """A number naming one op in chunk keys (Note [Chunk keys]): a plan's, or a
    `FunctionOp`'s."""
    return next(_UIDS)


class FunctionOp:
    """A JAX function recorded as one op of a queue, for what is not an aten op with a
    plan (a compiled graph's call, compile/program.py; the read of a view of a pending
    value, values.py): the attributes of a Plan the queue reads. ``fn`` returns its
    outputs, then the flags of its value checks (``check_infos``)."""

    __slots__ = (
        "op", "uid", "fn", "call", "avals", "outputs", "written_slots", "written_arrays",
        "check_infos", "compiled", "names",
    )  # fmt: skip

    def __init__(self, name: str, fn, call, avals: list, check_infos=()):
        self.op, self.uid = name, new_uid()
        self.fn = fn  # called inside a chunk's trace
        self.call = call  # called alone: a queue of this one op (Note [A chunk of one op])
        self.avals = avals  # (shape, dtype) of each output
        self.outputs = avals
        self.written_slots = self.written_arrays = ()
        self.check_infos = list(check_infos)
        self.compiled = True  # ``call`` runs programs compiled (and counted) elsewhere
        self.names = None  # no schema (see _describe_change)

    def placed(self, index: int):
        """Plan.placed's counterpart: ``call`` reads the arrays it is given, and its
        outputs are committed where they are."""
        return self.call


def _queue(device: int, queues: dict | None = None) -> _Queue:
    """This thread's queue on ``device`` (of ``queues``, its ordinary ones by default)."""
    if queues is None:
        queues = _threads.by_device
    q = queues.get(device)
    if q is None:
        q = queues[device] = _Queue(device, queues)
        # The backward of the ops this thread records must record here too, not on
        # autograd's device thread: forward and backward then fuse into one chunk.
        backward_on_calling_thread()
    return q


def pending_count() -> int:
    """The ops this thread has queued, on every device."""
    return sum(len(q.plans) for q in _threads.by_device.values())


def record(plan, args: list, out_avals: list, where: str | None, device: int) -> list[Pending]:
    """Queue one op on ``tpu:device``: ``args`` are the plan's arguments (arrays,
    Pendings, scalars); returns a Pending per output of the plan's function (new
    tensors, then written bases). ``where`` names the user's line, when an error may
    need it."""
    with _lock:
        queues = _threads.by_device
        if (
            _threads.in_optimizer_step
            and getattr(plan, "op", None) in FACTORIES
            and not any(type(a) is Pending for a in args)
        ):
            queues = _threads.state_by_device  # Note [An optimizer's new state is made apart]
        q = queues.get(device) or _queue(device, queues)
        # Note [The backward starts a chunk]
        backward = _current_autograd_node() is not None
        if backward is not _threads.recording_backward:
            _threads.recording_backward = backward
            if backward and len(q.plans) >= config.defer_split_ops and not q.makes_state:
                _flush(q, "backward begins")
                q = queues.get(device) or _queue(device, queues)
        position = len(q.plans)
        n_externals = len(q.externals)
        try:
            outputs = _append(q, plan, args, out_avals, where, position)
        except BaseException:
            _forget(q, position, n_externals)  # an op that failed to record left no trace
            raise
        if position + 1 >= config.defer_max_ops:
            _flush_full(q)
        return outputs


_current_autograd_node = torch._C._current_autograd_node

# Note [The backward starts a chunk]
#     A training step's forward and backward recorded as one chunk leave the chip idle
#     while the host records them: the chunk runs only when the loss is read. Where the
#     forward is sizeable -- at least ``defer_split_ops`` ops queued when the first op
#     of a backward pass is recorded (autograd is then running a node) -- that queue
#     runs at once, and the chip computes the forward while the host records the
#     backward. The cut falls at the same op every step, so each chunk is compiled
#     once. On a TPU v5e, GPT-2 small's step (8x1024 tokens, autocast) took 139.3 ms as
#     one chunk of 342 ops, the chip busy 104 ms of it, and 127.3 ms cut here
#     (docs/performance.md). The price is memory: the activations the backward reads
#     are the forward chunk's outputs, which autograd holds until the backward ends,
#     where inside one chunk XLA freed each after its last use (that step's peak: 9.26
#     -> 9.87 GiB).


def _append(q: _Queue, plan, args: list, out_avals: list, where, position: int) -> list:
    """Add one op to ``q``: its references to inputs, its Pendings, its part of the key."""
    refs = []
    externals = q.externals
    for a in args:
        if type(a) is Pending:
            if a.queue is q and a.value is None:
                refs.append((1, a.node, a.index))
                continue
            if a.value is None and a.error is None:
                flush_pending(
                    a,
                    "optimizer's new state"
                    if a.queue is not None and a.queue.makes_state
                    else "value from another queue",
                )
            a = a.resolved()
        if hasattr(a, "shape"):  # a concrete array: one chunk input however often used
            slot = q.external_slot.get(id(a))
            if slot is None:
                # externals keeps the array alive, so its id() stays its own
                slot = q.external_slot[id(a)] = len(externals)
                externals.append(a)
            refs.append((0, slot, 0))
        else:  # a traced Python scalar
            refs.append((0, len(externals), 0))
            externals.append(a)
    refs = tuple(refs)
    if len(out_avals) == 1:
        shape, dtype = out_avals[0]
        outputs = [Pending(position, 0, shape, dtype, q)]
        q.outputs.append([weakref.ref(outputs[0])])
    else:
        outputs = [Pending(position, i, s, d, q) for i, (s, d) in enumerate(out_avals)]
        q.outputs.append([weakref.ref(p) for p in outputs])
    if plan.written_arrays:
        n_out = len(plan.outputs)
        for j, argument in enumerate(plan.written_arrays):
            if argument is None:  # an uninitialised storage: no input array to replace
                continue
            kind, a, _ = refs[argument]
            if kind == 0:
                q.replaced_by.setdefault(a, (position, n_out + j))
    q.plans.append(plan)
    q.refs.append(refs)
    q.wheres.append(where)
    q.key.append(plan.uid)
    q.key.append(refs)
    return outputs


def _forget(q: _Queue, position: int, n_externals: int) -> None:
    """Drop what recording the op at ``position`` added to ``q`` before it failed: the
    queue's lists stay parallel, one entry per op (issue #31: a half-recorded op
    shifted every later op's outputs)."""
    for name in ("plans", "refs", "outputs", "wheres"):
        del getattr(q, name)[position:]
    del q.key[2 * position :]
    del q.externals[n_externals:]
    for key, slot in list(q.external_slot.items()):
        if slot >= n_externals:
            del q.external_slot[key]
    for slot, node in list(q.replaced_by.items()):
        if node[0] >= position:
            del q.replaced_by[slot]


# -- flushing ---------------------------------------------------------------------------------


class _Chunk:
    """A compiled chunk: the jitted function and what its outputs mean."""

    __slots__ = ("call", "flag_owners", "compiled", "memory")

    def __init__(self, nodes_spec, live, donated: tuple, device: int):
        self.flag_owners: list[tuple[int, int]] = []  # (node position, check index) per flag
        self.compiled = False
        # XLA's account of its memory (Note [A program's memory is known before it runs])
        self.memory: memory.ProgramBytes | None = None

        def chunk(*externals):
            metrics.count("compiles", "chunk")
            scope = jax().named_scope
            results = []
            flags = []
            owners = []
            for position, (plan, refs) in enumerate(nodes_spec):
                args = [externals[a] if kind == 0 else results[a][b] for kind, a, b in refs]
                try:
                    with scope(f"op{position}"):  # Note [Profiles name aten ops]
                        out = plan.fn(*args)
                except Exception as exc:
                    raise _NodeError(position, exc) from exc
                results.append(out)
                n = len(plan.outputs) + len(plan.written_slots)
                for k, flag in enumerate(out[n:]):
                    flags.append(flag)
                    owners.append((position, k))
            self.flag_owners = owners
            return tuple(results[n][i] for n, i in live), tuple(flags)

        # Its outputs committed to the queue's device, as every tensor's array is (Note
        # [Every array is committed to its device] in builder.py): a chunk of factories
        # alone would otherwise make uncommitted ones.
        self.call = jax().jit(
            chunk, donate_argnums=donated, out_shardings=sharding(device),
            # Note [The least effort for programs without products] (effort.py)
            compiler_options=effort.compiler_options(plan.op for plan, _ in nodes_spec),
        )  # fmt: skip


class _NodeError(Exception):
    def __init__(self, position: int, cause: Exception):
        super().__init__(str(cause))
        self.position, self.cause = position, cause


_CHUNKS = metrics.LRUCache("chunk_cache", lambda: config.chunk_cache_size)

# Runs a queue of Strict ops op by op: background.run, set when that module loads (it
# imports this one).
run_op_by_op = None

# Called after each chunk has run and its values are handed out (the NaN finder,
# nonfinite.py, reads its flags there: one host read per flush). Empty almost always.
after_run: list = []


def _no_annotation(q, reason: str, where: str, compiled: bool):
    return _NOTHING


_NOTHING = contextlib.nullcontext()

# Called at each flush with (queue, reason, user line or None where it was not taken,
# whether the chunk compiles): the context manager its run happens in. torchtpu.profile()
# (profiling.py) sets it to name the chunk in the trace; otherwise it costs a call per
# flush.
annotate_run = _no_annotation


def flush(reason: str) -> None:
    """Run every op this thread queued: one chunk per device (and one of an optimizer's
    new state, Note [An optimizer's new state is made apart])."""
    for queues in (_threads.state_by_device, _threads.by_device):
        for q in list(queues.values()):
            if q.plans:
                _flush(q, reason)


def _end_of_step(optimizer, args, kwargs) -> None:
    """After ``optimizer.step()``: the end of a training step is the natural end of a
    chunk, so a loop that reads no value still runs one cached chunk per step (Note
    [Where a full queue is cut] covers loops without an optimizer). A step during which
    a chunk ran already (the loop read its loss) is bounded by those reads: its
    optimizer ops join the next step's chunk, one flush per step rather than two.
    Except when a chunk ran because the queue was full (a step of more ops than
    ``defer_max_ops``): then the step ends with a flush too, so the next one starts
    its queue where this one did and is cut at the same ops -- otherwise the cuts
    drift through the step, step after step, and each new phase compiles anew."""
    if torch.compiler.is_compiling() or tracing._active is not None:
        return  # a traced step: its ops are in the program, not in a queue
    state = _threads
    state.in_optimizer_step = False
    if (
        state.runs == state.runs_at_step_end
        or state.full_runs != state.full_runs_at_step_end
        # Note [The optimizer's step is a chunk of its own]
        or state.ops_run - state.ops_run_at_step_end >= config.defer_split_ops
    ):
        flush("optimizer step")
    state.ops_run_at_step_end = state.ops_run
    state.runs_at_step_end = state.runs
    state.full_runs_at_step_end = state.full_runs


def _start_of_step(optimizer, args, kwargs) -> None:
    """Before ``optimizer.step()``: a queue of at least ``defer_split_ops`` ops (the
    forward and backward of a sizeable model) runs now, and the optimizer's ops run as
    a chunk of their own when its step ends (`_end_of_step`).

    Note [The optimizer's step is a chunk of its own]
        An optimizer makes its state in its first step (AdamW's moments: ``zeros_like``
        per parameter), so the first step's ops differ from every later step's. With
        the optimizer's ops in the step's chunk, the second step compiled a second
        chunk as large as the first (a Llama's second step cost 0.86x its first; a loop
        reading its loss before ``optimizer.step()`` compiled three, the optimizer's
        ops joining the next step's forward). So where the step's other ops are many
        (``defer_split_ops``: queued when the step begins, or run already by a read),
        the optimizer's ops are a chunk of their own: the forward and backward chunk is
        the same every step, and so is the optimizer's (its first step makes its state
        apart: Note [An optimizer's new state is made apart]). It
        costs a chunk launch a step, so small steps, where a launch is a visible share
        of the step and compiling is quick, keep one chunk."""
    if torch.compiler.is_compiling() or tracing._active is not None:
        return
    if any(len(q.plans) >= config.defer_split_ops for q in _threads.by_device.values()):
        flush("optimizer step begins")
    _threads.in_optimizer_step = True  # Note [An optimizer's new state is made apart]


# Note [An optimizer's new state is made apart]
#     An optimizer makes its state in its first step (Adam's moments: ``zeros_like``
#     per parameter) and updates it in place in the same step. Recorded with the
#     update, the zeros are ops of the chunk, where every later step takes the moments
#     as inputs: the first step's chunk was one no later step reused, and the second
#     step compiled its optimizer's chunk again (GPT-2 small's on a TPU v5e: ~10 s;
#     a small model's whole step). So inside an optimizer's step, an op that makes a
#     tensor from no value (a factory) is recorded in a queue of its own, which runs
#     when the update first uses what it made: the update then takes the new state as
#     inputs, as it will every step after, and its chunk is compiled once. That queue's
#     runs are not the step's own (`_end_of_step` counts those). A step that raises
#     leaves the flag set until the next step begins or ends; meanwhile a factory
#     outside a step runs as a chunk of its own when first used, correct as before.


register_optimizer_step_pre_hook(_start_of_step)
register_optimizer_step_post_hook(_end_of_step)


def flush_pending(pending: Pending, reason: str) -> None:
    """Run the queue that will produce ``pending``, whichever thread recorded it."""
    if pending.queue is not None:
        _flush(pending.queue, reason)


def resolve(value, reason: str):
    """``value`` as a concrete array: a Pending one after its queue ran (raising its
    chunk's error if it failed); anything else as it is."""
    if type(value) is not Pending:
        return value
    if not value.node_done():
        flush_pending(value, reason)
    return value.resolved()


def _flush(q: _Queue, reason: str) -> None:
    with _lock:
        if q.home.get(q.device) is not q or not q.plans:
            return  # flushed already, by another thread or from inside this flush
        # Reentrancy: anything recorded from here on goes to a new chunk.
        q.home[q.device] = _Queue(q.device, q.home)
        _run_or_invalidate(q, reason)


def _run_or_invalidate(q: _Queue, reason: str, needed=()) -> dict:
    """`_run`, and if it fails anywhere (tracing, compiling, running, an interrupt),
    every value of the queue not handed out yet holds the error: reading it raises,
    naming the failed op, and no tensor is left holding a value that will never come."""
    try:
        if q.op_by_op:
            run_op_by_op(q, reason)
            return {}
        return _run(q, reason, needed)
    except BaseException as exc:
        what = "queued Strict ops" if q.op_by_op else "a DeferAndFuse chunk"
        error = memory.out_of_memory(exc, f"{what} of {len(q.plans)} ops", q.device)
        _invalidate(q.outputs, error)
        if error is exc:
            raise
        raise error from exc


def _invalidate(outputs: list, error: BaseException) -> None:
    """Give ``error`` to every Pending of ``outputs`` (per op, weak references) whose
    queue will never produce it."""
    for refs in outputs:
        for ref in refs:
            pending = ref()
            if pending is not None and not pending.node_done():
                pending.error = error


# Note [Where a full queue is cut]
#     A loop that reads no value fills the queue, and XLA's compile time grows
#     faster than a chunk's size (226 ops 2.8 s, 901 ops 31 s). Cutting where the
#     queue happens to be full would make chunks of every phase of the loop, each
#     compiled anew. So a full queue is cut before the last op that is the same
#     plan as its first: the loop's body most likely starts there, the chunk holds
#     whole iterations and starts where the next one will, and the chunks repeat
#     (one compile). The ops after the cut stay queued, reading the values they need
#     from the flushed part as inputs. Without such an op, all of it is flushed.


def _flush_full(q: _Queue) -> None:
    """Flush a full queue, cut where the loop repeats (Note [Where a full queue is cut])."""
    with _lock:
        n = len(q.plans)
        first = q.plans[0]
        cut = next((i for i in range(n - 1, n // 4, -1) if q.plans[i] is first), None)
        if cut is None:
            _flush(q, "queue full")
            return
        head = _Queue(q.device, q.home)
        head.plans, head.refs = q.plans[:cut], q.refs[:cut]
        head.outputs, head.wheres, head.key = q.outputs[:cut], q.wheres[:cut], q.key[: 2 * cut]
        # Slots are given in order of first use: the head's inputs come first.
        used = [a for refs in head.refs for kind, a, _ in refs if kind == 0]
        head.externals = q.externals[: max(used) + 1] if used else []
        head.replaced_by = {a: node for a, node in q.replaced_by.items() if node[0] < cut}
        needed = list({(a, b): None for refs in q.refs[cut:] for kind, a, b in refs
                       if kind == 1 and a < cut})  # fmt: skip
        tail = q.home[q.device] = _Queue(q.device, q.home)
        try:
            values = _run_or_invalidate(head, "queue full", needed)
        except BaseException as exc:
            _invalidate(q.outputs[cut:], exc)  # the ops after the cut read the head's values
            raise
        for position in range(cut, n):
            refs = []
            for kind, a, b in q.refs[position]:
                if kind == 1 and a >= cut:
                    refs.append((1, a - cut, b))
                    continue
                value = q.externals[a] if kind == 0 else values[(a, b)]
                if hasattr(value, "shape"):
                    slot = tail.external_slot.get(id(value))
                    if slot is None:
                        slot = tail.external_slot[id(value)] = len(tail.externals)
                        tail.externals.append(value)
                else:
                    slot = len(tail.externals)
                    tail.externals.append(value)
                refs.append((0, slot, 0))
            for ref in q.outputs[position]:
                pending = ref()
                if pending is not None:
                    pending.node, pending.queue = position - cut, tail
            tail.plans.append(q.plans[position])
            tail.refs.append(tuple(refs))
            tail.outputs.append(q.outputs[position])
            tail.wheres.append(q.wheres[position])
            tail.key.append(q.plans[position].uid)
            tail.key.append(tail.refs[-1])


def _run(q: _Queue, reason: str, needed=()) -> dict:
    """Run ``q``'s ops as one chunk (compiled once per chunk key) and hand out the
    values still referenced; returns the values of the outputs in ``needed``
    ((op, output) pairs), which are outputs of the chunk too."""
    metrics.count("flushes", reason)
    if not q.makes_state:  # Note [An optimizer's new state is made apart]
        _threads.runs += 1
        _threads.ops_run += len(q.plans)
        if reason == "queue full":
            _threads.full_runs += 1
    if reason != "value read":  # a read counts itself (transfer.py), once
        perf_warnings.note_read(value_read=False)
    # The user's line costs a stack walk: taken where a warning, explain() or a
    # compile can use it.
    where = user_frame() if reason == "value read" or metrics._recorders else None
    if reason == "value read":
        perf_warnings.note_flush(reason, where)
    if len(q.plans) == 1 and not needed:
        _run_one(q, reason, where)
        return {}
    live, live_pendings = [], []
    total = 0
    for position in range(len(q.outputs) - 1, -1, -1):  # latest first: see _donation
        refs = q.outputs[position]
        total += len(refs)
        for index, ref in enumerate(refs):
            pending = ref()
            if pending is not None:
                live.append((position, index))
                live_pendings.append(pending)
    metrics.count("chunk_values", "outputs", len(live))
    if total > len(live):
        metrics.count("chunk_values", "dropped", total - len(live))
    outputs = set(live)
    extra = [n for n in needed if n not in outputs]
    live.extend(extra)
    if not live:
        return {}
    donated, first = _donation(q.externals, q.replaced_by, live, live_pendings)
    if first:
        chosen = set(first)
        order = first + [i for i in range(len(live)) if i not in chosen]
        live = [live[i] for i in order]
        live_pendings = [live_pendings[i] for i in order if i < len(live_pendings)]
    key = (tuple(q.key), tuple(live), donated, q.device)
    chunk = _CHUNKS.lookup(key)
    compiled = chunk is None
    if compiled:
        chunk = _Chunk(list(zip(q.plans, q.refs)), live, donated, q.device)
        _CHUNKS.insert(key, chunk)
        where = where or user_frame()
        perf_warnings.note_compile("a DeferAndFuse chunk", where, (q.plans, live), _describe_change)

    def record_event(failed: bool) -> None:
        metrics.event(
            "flush", reason=reason, where=where, ops=len(q.plans), outputs=len(live),
            compiled=compiled, failed=failed,
        )  # fmt: skip

    inputs = [as_array(x) for x in q.externals]  # Note [Numbers as arrays]
    what = f"a DeferAndFuse chunk of {len(q.plans)} ops"
    compiling = progress.compiling(what, where) if not chunk.compiled else _NOTHING
    try:
        start = time.perf_counter()
        with annotate_run(q, reason, where, compiled), compiling:  # on q.device: _Chunk
            if not chunk.compiled:  # compiled here, found in jax.jit's cache by the call
                chunk.memory = memory.program_bytes(chunk.call.lower(*inputs).compile())
            memory.before_run(chunk.memory, "chunk", what, where, q.device, not chunk.compiled)
            values, flags = chunk.call(*inputs)
        if not chunk.compiled:
            chunk.compiled = True
            seconds = time.perf_counter() - start
            metrics.count("compile_seconds", "chunk", seconds)  # counted when it was made
            perf_warnings.note_compile_time(where or user_frame(), seconds, what)
            ops = tuple(plan.op for plan in q.plans)
            perf_warnings.note_chunk_compile(seconds, ops, where)
    except Exception as exc:
        record_event(failed=True)
        error = _annotate(exc, q)
        for pending in live_pendings:
            pending.error = error
        raise error from None
    record_event(failed=False)
    for pending, value in zip(live_pendings, values):
        pending.value = value
    for flag, (position, k) in zip(flags, chunk.flag_owners):
        checks.defer(
            [flag], [q.plans[position].check_infos[k]], f"called from {q.wheres[position]}"
        )
    for hook in after_run:
        hook(reason)
    if not needed:
        return {}
    produced = dict(zip(live, values))
    return {n: produced[n] for n in needed}


def _run_one(q: _Queue, reason: str, where: str | None) -> None:
    """Run a queue of one op as that op's own compiled plan, as Strict would.

    Note [A chunk of one op]
        Reading a value right after one op (a notebook printing each result) makes a
        queue of one op. Its plan's jitted function is the chunk already: running it
        skips the chunk's cache key, donation and output bookkeeping, and compiles no
        chunk -- the program is the one Strict runs for that op, compiled once for
        both modes. Nothing is donated (Strict donates nothing either)."""
    plan, refs = q.plans[0], q.refs[0]
    externals = q.externals
    # (a one-op queue refers to no other op; numbers: Note [Numbers as arrays])
    args = [as_array(externals[a]) for _, a, _ in refs]
    pendings = [ref() for ref in q.outputs[0]]
    compiled = not plan.compiled
    metrics.event(
        "flush", reason=reason, where=where, ops=1, outputs=sum(p is not None for p in pendings),
        compiled=compiled, failed=False,
    )  # fmt: skip
    compiling = progress.compiling(str(plan.op), where or user_frame()) if compiled else _NOTHING
    try:
        start = time.perf_counter()
        with annotate_run(q, reason, where, compiled), compiling:
            flat = plan.placed(q.device)(*args)
        if compiled:
            plan.compiled = True
            seconds = time.perf_counter() - start
            perf_warnings.compiled("op", seconds, where or user_frame(), str(plan.op))
    except Exception as exc:
        error = _annotate(_NodeError(0, exc), q)
        for pending in pendings:
            if pending is not None:
                pending.error = error
        raise error from None
    for pending, value in zip(pendings, flat):
        if pending is not None:
            pending.value = value
    if plan.check_infos:
        n = len(plan.outputs) + len(plan.written_slots)
        checks.defer(list(flat[n:]), plan.check_infos, f"called from {q.wheres[0]}")
    for hook in after_run:
        hook(reason)


# sys.getrefcount of an external array that only the queue holds: the queue's list,
# the loop variable in `_donation`, and getrefcount's own argument.
_HELD_ONLY_BY_THE_QUEUE = 3


def _donation(externals: list, replaced_by: dict, live: list, live_pendings: list):
    """The external arrays the chunk may reuse for its outputs, and the outputs they go
    to: ``(donated positions, indices into live)``, the outputs in the order JAX needs.

    Note [Donating dead inputs]
        An array that only the queue still holds (its storage was rebound by an
        in-place op, as an optimizer rebinds every parameter) is dead once the chunk
        runs: donating it lets XLA write an output of the same shape and dtype into
        its buffer instead of allocating a new one. On the CPU a fresh buffer of a few
        MB costs as much as the step's arithmetic (page faults), so a training step
        runs up to twice as fast. An array anybody else holds -- a tensor, an array
        the user took with ``materialize``, another storage sharing it -- has more
        references and is never donated.

        Which output a buffer takes matters too. JAX gives the k-th donated input of a
        shape and dtype to the k-th output of that shape and dtype. Given to another
        value than the one replacing it -- a parameter's buffer to its gradient,
        written by a matmul while the old parameter is still to be read, or to
        another parameter of the same shape -- the buffer makes XLA copy the old
        value first (a 2 MB copy cost a third of an MLP step). So an array an
        in-place op wrote over (recorded in ``replaced_by``) goes to exactly that
        op's new base; another dead array to a live output of its shape that no
        donation takes, latest op first; and the chunk lists these outputs first, in
        the order of their inputs. Only arrays with an output to go to are donated.
    """
    array = array_type()
    position_in_live = None
    pairs = []  # (external position, index into live)
    taken = set()
    unpaired = []
    for i in range(len(externals)):  # (enumerate's result tuple would hold a reference)
        a = externals[i]
        if type(a) is not array or sys.getrefcount(a) > _HELD_ONLY_BY_THE_QUEUE:
            continue
        node = replaced_by.get(i)
        if node is not None:
            if position_in_live is None:
                position_in_live = {n: j for j, n in enumerate(live)}
            j = position_in_live.get(node)
            if j is not None and j < len(live_pendings):
                pairs.append((i, j))
                taken.add(j)
                continue
        unpaired.append(i)
    if unpaired:
        free: dict = {}
        for j, p in enumerate(live_pendings):  # live is latest op first
            if j not in taken:
                free.setdefault((p.shape, np.dtype(p.dtype)), []).append(j)
        for i in unpaired:
            a = externals[i]
            outputs = free.get((a.shape, a.dtype))
            if outputs:
                pairs.append((i, outputs.pop(0)))
        pairs.sort()
    return tuple(i for i, _ in pairs), [j for _, j in pairs]


def _describe_change(old, new) -> str:
    """What differs between two chunks compiled from the same line."""
    from torchtpu.dispatch.signature import describe_change

    (old_plans, old_live), (new_plans, new_live) = old, new
    for position, (a, b) in enumerate(zip(old_plans, new_plans)):
        if a is b:
            continue
        if a.op != b.op:
            return f"op #{position + 1} of the chunk: {a.op} -> {b.op}"
        if b.names is None:  # a FunctionOp
            return f"op #{position + 1} of the chunk ({b.op}): its inputs' shapes or dtypes"
        return f"op #{position + 1} of the chunk ({b.op}): " + describe_change(
            b.names, a.key, b.key
        )
    if len(old_plans) != len(new_plans):
        return f"the number of ops in the chunk: {len(old_plans)} -> {len(new_plans)}"
    if old_live != new_live:
        return "which of the chunk's values are still referenced by tensors"
    return "how the chunk's ops use each other's values"


def _annotate(exc: Exception, q: _Queue) -> Exception:
    """The error of a failed chunk, naming the op and the user line that recorded it."""
    if isinstance(exc, _NodeError):
        cause = exc.cause
        # (the line is kept only for ops with value checks: a stack walk per op costs)
        where = q.wheres[exc.position] or "a line Debug mode names"
        mode = "Strict, queued while its program compiled" if q.op_by_op else "DeferAndFuse"
        cause.add_note(f"torchtpu: raised by {q.plans[exc.position].op} recorded at {where} ({mode})")
        return cause
    exc.add_note(f"torchtpu: raised while running a DeferAndFuse chunk of {len(q.plans)} ops")
    return exc
