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

import functools
import sys
import time
import weakref

import numpy as np

from torchtpu import config
from torchtpu.dispatch import checks
from torchtpu.dispatch.pending import Pending
from torchtpu.observe import metrics, perf_warnings
from torchtpu.observe.locations import user_frame
from torchtpu.runtime import jax


class _Queue:
    """The ops recorded since the last flush, as parallel lists (one entry per op)."""

    def __init__(self):
        self.plans: list = []
        self.refs: list[tuple] = []  # per op: (0, external slot, 0) or (1, op, output)
        self.outputs: list[list] = []  # per op: weak references to its Pendings
        self.wheres: list = []  # per op: the user's line, where an error may need it
        # The chunk's cache key, built while recording (Note [Chunk keys]).
        self.key: list = []
        self.externals: list = []  # arrays and scalars, the chunk's inputs
        self.external_slot: dict[int, int] = {}  # id(array) -> position in externals


_queue = _Queue()


def pending_count() -> int:
    return len(_queue.plans)


def record(plan, args: list, out_avals: list, where: str | None) -> list[Pending]:
    """Queue one op: ``args`` are the plan's arguments (arrays, Pendings, scalars);
    returns a Pending per output of the plan's function (new tensors, then written
    bases). ``where`` names the user's line, when an error may need it."""
    q = _queue
    position = len(q.plans)
    refs = []
    externals = q.externals
    for a in args:
        if type(a) is Pending:
            if a.queue is q and a.value is None:
                refs.append((1, a.node, a.index))
                continue
            if a.value is None and a.error is None:
                raise RuntimeError("torchtpu internal error: a pending value from another queue")
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
    q.plans.append(plan)
    q.refs.append(refs)
    q.wheres.append(where)
    q.key.append(plan.uid)
    q.key.append(refs)
    if position + 1 >= config.defer_max_ops:
        flush("queue full")
    return outputs


# -- flushing ---------------------------------------------------------------------------------


class _Chunk:
    """A compiled chunk: the jitted function and what its outputs mean."""

    __slots__ = ("call", "flag_owners", "compiled")

    def __init__(self, nodes_spec, live, donated: tuple):
        self.flag_owners: list[tuple[int, int]] = []  # (node position, check index) per flag
        self.compiled = False

        def chunk(*externals):
            metrics.count("compiles", "chunk")
            results = []
            flags = []
            owners = []
            for position, (plan, refs) in enumerate(nodes_spec):
                args = [externals[a] if kind == 0 else results[a][b] for kind, a, b in refs]
                try:
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

        self.call = jax().jit(chunk, donate_argnums=donated)


class _NodeError(Exception):
    def __init__(self, position: int, cause: Exception):
        super().__init__(str(cause))
        self.position, self.cause = position, cause


_CHUNKS = metrics.LRUCache("chunk_cache", lambda: config.chunk_cache_size)


def flush(reason: str) -> None:
    """Run every queued op as one chunk and hand out the values still referenced."""
    global _queue
    q = _queue
    if not q.plans:
        return
    _queue = _Queue()  # reentrancy: anything recorded from here on is a new chunk
    metrics.count("flushes", reason)
    perf_warnings.note_read()
    where = user_frame()
    if reason == "value read":
        perf_warnings.note_flush(reason, where)
    live, live_pendings = [], []
    total = 0
    for position, refs in enumerate(q.outputs):
        total += len(refs)
        for index, ref in enumerate(refs):
            pending = ref()
            if pending is not None:
                live.append((position, index))
                live_pendings.append(pending)
    metrics.count("chunk_values", "outputs", len(live))
    if total > len(live):
        metrics.count("chunk_values", "dropped", total - len(live))
    if not live_pendings:
        return
    donated = _donatable(q.externals, live_pendings)
    key = (tuple(q.key), tuple(live), donated)
    chunk = _CHUNKS.lookup(key)
    compiled = chunk is None
    if compiled:
        chunk = _Chunk(list(zip(q.plans, q.refs)), live, donated)
        _CHUNKS.insert(key, chunk)
        perf_warnings.note_compile("a DeferAndFuse chunk", where, (q.plans, live), _describe_change)

    def record_event(failed: bool) -> None:
        metrics.event(
            "flush", reason=reason, where=where, ops=len(q.plans), outputs=len(live),
            compiled=compiled, failed=failed,
        )  # fmt: skip

    try:
        start = time.perf_counter()
        values, flags = chunk.call(*q.externals)
        if not chunk.compiled:
            chunk.compiled = True
            metrics.count("compile_seconds", "chunk", time.perf_counter() - start)
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


# sys.getrefcount of an external array that only the queue holds: the queue's list,
# the loop variable in `_donatable`, and getrefcount's own argument.
_HELD_ONLY_BY_THE_QUEUE = 3


@functools.cache
def _array_type() -> type:
    """The type of JAX's concrete arrays (``jax.Array`` is an abstract class)."""
    return type(jax().numpy.zeros(()))


def _donatable(externals: list, live_pendings: list) -> tuple:
    """Positions of the external arrays the chunk may reuse for its outputs.

    Note [Donating dead inputs]
        An array that only the queue still holds (its storage was rebound by an
        in-place op, as an optimizer rebinds every parameter) is dead once the chunk
        runs: donating it lets XLA write an output of the same shape and dtype into
        its buffer instead of allocating a new one. On the CPU a fresh buffer of a few
        MB costs as much as the step's arithmetic (page faults), so a training step
        runs up to twice as fast. Only as many arrays as there are live outputs of
        each shape and dtype are donated, so every donation is used. An array anybody
        else holds -- a tensor, an array the user took with ``materialize``, another
        storage sharing it -- has more references and is never donated.
    """
    wanted: dict = {}
    for p in live_pendings:
        key = (p.shape, np.dtype(p.dtype))
        wanted[key] = wanted.get(key, 0) + 1
    donated = []
    array = _array_type()
    for i in range(len(externals)):  # (enumerate's result tuple would hold a reference)
        a = externals[i]
        if (
            type(a) is array
            and sys.getrefcount(a) <= _HELD_ONLY_BY_THE_QUEUE
            and wanted.get((a.shape, a.dtype), 0) > 0
        ):
            wanted[(a.shape, a.dtype)] -= 1
            donated.append(i)
    return tuple(donated)


def _describe_change(old, new) -> str:
    """What differs between two chunks compiled from the same line."""
    from torchtpu.dispatch.signature import describe_change

    (old_plans, old_live), (new_plans, new_live) = old, new
    for position, (a, b) in enumerate(zip(old_plans, new_plans)):
        if a is b:
            continue
        if a.op != b.op:
            return f"op #{position + 1} of the chunk: {a.op} -> {b.op}"
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
        where = q.wheres[exc.position] or "an unknown line"
        cause.add_note(
            f"torchtpu: raised by {q.plans[exc.position].op} recorded at {where} (DeferAndFuse)"
        )
        return cause
    exc.add_note(f"torchtpu: raised while running a DeferAndFuse chunk of {len(q.plans)} ops")
    return exc
