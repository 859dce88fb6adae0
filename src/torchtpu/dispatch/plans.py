"""Running an op call as its compiled plan: the hot path of every lowered op.

`lowered_handler` scans the call (signature.py: its key and feed in one pass), looks the key up in
the op cache and, in Strict and Debug, calls the plan's jitted function with the feed;
in DeferAndFuse it records the call in the queue instead (defer.py). Only a cache miss
binds the arguments to the schema and builds a plan (builder.py). The results are
wrapped from metadata the plan computed once.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time

import numpy as np
import torch

from torchtpu import config, dtypes, memory, rng, tracing
from torchtpu import matmul_precision as _precision
from torchtpu.dispatch import background, bounded, checks, defer, host, modes, small_ops
from torchtpu.dispatch import meta as oracle
from torchtpu.dispatch.builder import Plan, build, eager_program, flatten_result
from torchtpu.dispatch.modes import EagerMode
from torchtpu.dispatch.pending import Pending
from torchtpu.dispatch.scalars import as_arrays
from torchtpu.dispatch.schema import SchemaInfo
from torchtpu.dispatch.signature import Rules, describe_change, rules, scan
from torchtpu.dispatch.values import (
    OutMeta,
    contiguous,
    materialize,
    to_host,
    wrap,
)
from torchtpu.observe import metrics, perf_warnings, progress
from torchtpu.observe.locations import add_context, user_frame
from torchtpu.runtime import array_type, current_index, jax, policy
from torchtpu.storage import Storage
from torchtpu.tensor import TPUTensor, tpu_device

_STRICT, _DEBUG, _DEFER = (
    EagerMode.DEFER_NEVER,
    EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
    EagerMode.DEFER_AND_FUSE,
)


class Entry:
    """An op with the lowering that computes it: what its handler needs, computed once."""

    __slots__ = ("op", "lowering", "info", "rules")

    def __init__(self, op, lowering, info: SchemaInfo):
        self.op, self.lowering, self.info = op, lowering, info
        self.rules: Rules = rules(info, lowering.static)


_PLANS = metrics.LRUCache("op_cache", lambda: config.op_cache_size)


def lowered_handler(entry: Entry):
    """The dispatcher's handler for an op computed by a lowering.

    This is the hot path of every such op, so the common case -- a cache hit whose
    plan makes one new tensor -- runs inline, with what it needs of ``entry`` held in
    the closure; everything else is a call away."""
    op, lowering, info = entry.op, entry.lowering, entry.info
    op_rules = entry.rules
    uses_precision = lowering.precision
    returns_numbers = not info.all_tensor_returns
    mode_value = {m: m.value for m in EagerMode}
    ops_run = metrics.counter("ops")
    op_cache = metrics.counter("op_cache")
    plans, get_default_dtype, record = _PLANS, torch.get_default_dtype, defer.record
    large = memory.CHECKED_FROM  # outputs from this size may wait (_wait_if_large)

    if lowering.dynamic_shape:
        at_size = bounded.AT_SIZE.get(op)

        def dynamic_handler(func, args, kwargs):
            if at_size is not None and (size := bounded.stated()) is not None:
                self, *rest = info.bind(args, kwargs)
                return at_size(self, size, *rest)  # Note [Sizes the user states]
            ops_run[mode_value[modes._current or modes.current()]] += 1
            defer.flush("data-dependent shape")
            return _run_dynamic(entry, info.bind(args, kwargs))

        return dynamic_handler

    def handler(func, args, kwargs):
        mode = modes._current or modes.current()
        ops_run[mode_value[mode]] += 1
        if mode is _DEFER and returns_numbers:
            defer.flush("value read")  # the op returns a Python number: run it now
            mode = _STRICT
        values = info.bind(args, kwargs) if kwargs else args
        call = scan(op, op_rules, values)
        # The default dtype decides the dtype of factories and of float scalars' promotion.
        key = (
            entry,
            call.key,
            get_default_dtype(),
            _precision.current() if uses_precision else None,
        )
        plan = plans.get(key)
        if plan is None:
            plan = _miss(entry, values, key, mode)
        else:
            plans.move_to_end(key)
            op_cache["hit"] += 1
        device = call.device
        if device is None:
            device = _factory_device(info, values)
        if memory.limits and tracing._active is None:  # set_per_process_memory_fraction
            memory.check_room(plan.output_bytes, op, device or 0)
        single = plan.single
        if plan.fast and not device:
            # The usual op: one new tensor, nothing written back, checked or drawn.
            try:
                if mode is _DEFER:
                    value = record(plan, call.arrays + call.scalars, plan.avals, None, 0)[0]
                elif (
                    mode is _STRICT
                    and plan.compiled
                    and tracing._active is None
                    and not background.queued  # Note [Strict compiles in the background]
                ):
                    if plan.output_bytes >= large:
                        _wait_if_large(plan, call.arrays, 0)
                    scalars = call.scalars
                    value = plan.call(*call.arrays, *(as_arrays(scalars) if scalars else ()))[
                        single
                    ]
                else:
                    value = None
            except Exception as exc:
                raise add_context(memory.out_of_memory(exc, op, device or 0), op, values) from None
            if value is not None:
                out, meta = plan.fresh[single]
                shape, strides, dtype = out
                t = _make_wrapper(TPUTensor, shape, strides=strides, dtype=dtype, device=_TPU0)
                t._storage, t._chain, t._meta = Storage(value, shape, strides, dtype, 0), (), meta
                return t
        if plan.on_cpu is not None and tracing._active is None:
            # Note [Small ops of changing shapes run on the CPU] (small_ops.py)
            result = small_ops.run(plan, func, args, kwargs)
            if result is not None:
                return result
        try:
            queued = None
            if (
                mode is _STRICT
                and (background.queued or not plan.compiled)
                and tracing._active is None
            ):
                # Note [Strict compiles in the background] (background.py)
                queued = _in_background(plan, call, device)
            if queued is not None:
                outputs, bases = queued
            elif mode is not _DEFER:
                if background.queued and any(type(a) is Pending for a in call.arrays):
                    call = _resolved(op, op_rules, values, call)
                outputs, bases = _execute(plan, call, device, mode is _DEBUG)
            elif plan.host_rule is None:
                outputs, bases = _record(plan, call, device)
            else:  # run on the host now, from the queue's values (dispatch/host.py)
                defer.flush("host op")
                call = _resolved(op, op_rules, values, call)
                outputs, bases = _execute(plan, call, device, False)
        except Exception as exc:
            exc = memory.out_of_memory(_as_torch_error(exc, op, info, values), op, device or 0)
            raise add_context(exc, op, values) from None
        if bases:
            storages = call.storages
            for slot, base in zip(plan.written_slots, bases):
                storages[slot].set(base)
        if single is not None:
            return _fresh(outputs[single], plan.fresh[single], device)
        return _assemble(plan, values, outputs, device)

    handler.builds_plans = True  # builder.py makes its checks once per signature
    return handler


_make_wrapper = torch.Tensor._make_wrapper_subclass
_TPU0 = tpu_device(0)


def _miss(entry: Entry, values, key, mode) -> Plan:
    """Bind the call, build its plan (the meta oracle runs here) and cache it."""
    metrics.count("op_cache", "miss")
    op = entry.op
    bound = entry.info.bind(values, {}) if len(values) < len(entry.info.args) else list(values)
    plan = build(op, entry.lowering, entry.info, entry.rules, bound, scan(op, entry.rules, bound))
    plan.key = key
    _PLANS.insert(key, plan)
    if tracing._active is None and small_ops.route(plan, bound):
        return plan  # it runs on the CPU: nothing compiles
    # In DeferAndFuse chunks compile, and in a trace the program does.
    if mode is not _DEFER and tracing._active is None:
        where = user_frame()
        metrics.event("compile", op=str(op), where=where)
        perf_warnings.note_compile(
            str(op), where, key, lambda old, new: describe_change(plan.names, old, new)
        )
    return plan


def _in_background(plan: Plan, call, device: int):
    """Strict, for a plan not compiled yet or while ops are queued: queue this call if
    its program is not compiled yet (its compile starts on a worker) or is compiling, or
    if an input is queued; returns its (outputs, written
    bases) as `_record` does, or None to run it now (Note [Strict compiles in the
    background], background.py)."""
    waits = background.queued and any(type(a) is Pending for a in call.arrays)
    if (
        not config.background_compiles
        or plan.host_rule is not None
        or any(kind == "scalar" for kind, _ in plan.returns)  # read at once
    ):
        return None
    args = call.arrays + call.scalars
    # Note [Strict writes reuse their buffers]
    donated = _dead_written(plan, args, background.inputs(device)) if plan.written_arrays else ()
    if donated or device or plan.written_arrays:  # as _donating finds them
        variants = plan.donating
        program = variants.get((donated, device))
        fresh = program is None or not plan.compiled
        if program is None:
            program = variants[donated, device] = (
                eager_program(plan.fn, device, donated, plan.options)
                if donated
                else plan.placed(device)
            )
    else:
        program, fresh = plan.call, not plan.compiled
    compiling = background.is_compiling(program)
    if not (waits or fresh or compiling):
        return None
    if plan.output_bytes >= memory.CHECKED_FROM and _allocates_much(plan, device, donated, args):
        return None  # Note [Strict waits before a large allocation]: it runs now
    if plan.random:
        args.extend(rng.take(device))
    where = None
    if fresh and not compiling:
        where = user_frame()
        background.start_compile(program, args, device, str(plan.op), where)
    if donated:
        metrics.count("donated", "op", len(donated))
    return _record(plan, call, device, args, where, program)


def _resolved(op, op_rules, values, call):
    """The call scanned again after the queues computing its Pending inputs ran."""
    for a in call.arrays:
        if type(a) is Pending:
            defer.resolve(a, "value read")
    return scan(op, op_rules, values)


def _execute(plan: Plan, call, device: int, debug: bool):
    """Strict and Debug: call the plan's jitted function now (asynchronously)."""
    # Note [Numbers as arrays]; in a trace they are the program's constants, and on the
    # host numbers (a float64's 1e300 must not pass through the device on the way)
    host_run = plan.host_rule is not None
    traced = tracing._active is not None
    scalars = call.scalars if traced or host_run else as_arrays(call.scalars)
    args = call.arrays + scalars
    if plan.random:
        args.extend(rng.take(device))
    if traced:  # traced into the program: compiles nothing
        if plan.traced_rule is not None:
            raise host.refused(plan)
        flat = plan.traceable(*args)  # inlined into the program, which places it
        donated = ()
    else:
        # Note [Strict writes reuse their buffers]
        donated = _dead_written(plan, args) if plan.written_arrays and not host_run else ()
        if plan.output_bytes >= memory.CHECKED_FROM and not (debug or host_run):
            _wait_if_large(plan, call.arrays, device, donated, args)
        if not plan.compiled:
            start, where = time.perf_counter(), user_frame()
            with progress.compiling(str(plan.op), where):
                flat = _call(plan, args, device, donated)
            plan.compiled = True
            plan.note_fast()
            seconds = time.perf_counter() - start
            perf_warnings.compiled("op", seconds, where, str(plan.op))
        elif host_run or device:
            flat = _call(plan, args, device, donated)
        elif plan.written_arrays:
            flat = _donating(plan, donated, args, 0)
        else:
            flat = plan.call(*args)
    if donated:
        metrics.count("donated", "op", len(donated))
    n_out = len(plan.outputs)
    n_written = len(plan.written_slots)
    if debug:
        jax().block_until_ready(flat)
        if plan.mismatch is not None:  # Note [Lowering results in Debug mode]
            raise RuntimeError(f"{plan.op}: {plan.mismatch} (called from {user_frame()})")
    if plan.check_infos:
        flags = flat[n_out + n_written :]
        where = f"called from {user_frame()}"
        if debug:
            checks.raise_now(flags, plan.check_infos, where)
        else:
            checks.defer(flags, plan.check_infos, where)
    if n_written:
        return flat[:n_out], flat[n_out : n_out + n_written]
    return flat, ()


def _wait_if_large(plan: Plan, inputs: list, device: int, donated=(), args=()) -> None:
    """Note [Strict waits before a large allocation]
        Strict launches ops ahead of the device. A TPU allocates an op's outputs when
        it is launched and frees a buffer Python dropped only once the programs reading
        it ran, so launched far ahead, a step's large ops hold the buffers of ops not
        yet run beside their own: GPT-2 small's step at 8x1024 tokens peaked at 10.2 GiB
        on a TPU v5e where, each op waited for (Debug), it peaked at 7.5 GiB -- the
        excess in the last launch or two before the loss's backward and the logits'
        casts, 1.5-2.3 GiB each. So an op whose new outputs take a large share of the
        device's memory (``config.strict_wait_fraction``, 1/32) first waits for its
        inputs: the ops before the last of them have run, and what they dropped is
        free when it allocates. An in-place op whose buffer is donated allocates
        nothing new (the optimizer's update) and does not wait. The price is what the
        device had queued at each wait: GPT-2 small waits 4 times a step (the head,
        the logits' casts, the loss's backward) and peaks at 8.3 GiB, its step 159.8
        against 153.5 ms without them (4%); waiting for every op cost 7% of the step and
        peaked at 8.7 GiB."""
    if _allocates_much(plan, device, donated, args):
        metrics.count("strict_waits", str(plan.op))
        array = array_type()
        jax().block_until_ready([a for a in inputs if type(a) is array])


def _allocates_much(plan: Plan, device: int, donated: tuple, args: list) -> bool:
    """Whether ``plan``'s new outputs (less the buffers it is ``donated``) take
    ``config.strict_wait_fraction`` of the device's memory or more."""
    fraction = config.strict_wait_fraction
    new_bytes = plan.output_bytes - sum(_nbytes(args[i]) for i in donated)
    return bool(fraction) and new_bytes >= fraction * memory.capacity(device or 0)


def _nbytes(a) -> int:
    if type(a) is Pending:
        return math.prod(a.shape) * np.dtype(a.dtype).itemsize
    return a.nbytes


def _call(plan: Plan, args, device: int, donated: tuple = ()):
    if plan.host_rule is not None:
        return host.call(plan, args, device)
    if plan.written_arrays:
        return _donating(plan, donated, args, device)
    return plan.placed(device)(*args)


# sys.getrefcount of a written array that only its storage holds, as `_dead_written`
# sees it: the Storage, the call's array list, `_execute`'s argument list, the loop's
# variable and getrefcount's own argument.
_HELD_ONLY_BY_ITS_STORAGE = 5


def _dead_written(plan: Plan, args: list, queued: dict | None = None) -> tuple:
    """The positions in ``args`` of the arrays this in-place call replaces and nobody
    else holds: dead once it runs. ``queued``: the inputs (by id) of the queue the call
    joins, which holds them too and runs its ops in order (background.py).

    Note [Strict writes reuse their buffers]
        An in-place op (``add_``, an optimizer's ``_foreach_*_`` update, ``copy_`` or an
        index write into a buffer) computes its storage's new base array; the old one
        dies when the storage takes the new. Donated to the op's program, its buffer
        holds the new base, so a write into a large buffer (the optimizer's moments,
        a KV cache) needs no second copy of it at its peak, as DeferAndFuse's chunks
        donate dead inputs (Note [Donating dead inputs] in defer.py). An array anyone
        else holds -- another storage sharing it, a JAX array the user took with
        ``torchtpu.to_jax``, a compiled graph's cached handle, a queued DeferAndFuse
        value -- has more references and is not donated. A storage's new base always
        has its old base's shape and dtype, so XLA always finds the buffer a use.
        A plan compiles a donating variant per set of donated positions (_donating):
        in a loop the same arrays are dead each time, so that is one program."""
    array = array_type()
    dead = []
    for position in plan.written_arrays:
        if position is not None:
            a = args[position]
            # (a Pending: a queued value, donated when its op runs: background.py)
            kind = type(a)
            if kind is not array and kind is not Pending:
                continue
            held = _HELD_ONLY_BY_ITS_STORAGE + (queued is not None and id(a) in queued)
            if sys.getrefcount(a) <= held:
                dead.append(position)
    return tuple(dead)


def _donating(plan: Plan, donated: tuple, args: list, device: int):
    """Run an in-place ``plan`` on ``tpu:device`` with the arrays at ``donated`` (maybe
    none) given to XLA for its outputs: each set of positions is a program of its own."""
    variants = plan.donating
    call = variants.get((donated, device))
    if call is None:
        call = variants[donated, device] = (
            eager_program(plan.fn, device, donated, plan.options)
            if donated
            else plan.placed(device)
        )
        if plan.compiled:  # not the plan's first program: counted here
            start, where = time.perf_counter(), user_frame()
            with progress.compiling(str(plan.op), where):
                flat = call(*args)
            seconds = time.perf_counter() - start
            perf_warnings.compiled("op", seconds, where, str(plan.op))
            return flat
    return call(*args)


def _record(plan: Plan, call, device: int, args=None, where=None, program=None):
    """DeferAndFuse: queue the call; its results are Pending values (defer.py). With
    ``program``, Strict's queue of ops waiting for compiles instead (background.py),
    ``args`` taken already."""
    if args is None:
        args = call.arrays + call.scalars
        if plan.random:
            args.extend(rng.take(device))
    if not plan.traced:
        # Trace it now, abstractly (once per plan): a lowering's error about this call
        # then surfaces at the op, as in Strict, not at a later flush.
        abstract = [
            jax().ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a for a in args
        ]
        jax().eval_shape(plan.fn, *abstract)
        plan.note_fast()
    # The user's line costs a stack walk: only kept where an error may need it.
    if where is None and plan.check_infos:
        where = user_frame()
    n_out = len(plan.outputs)
    avals = plan.avals
    if plan.writes_views:
        # A written base's shape is this call's: a key fixes the views an op reads, not
        # always the base they are taken from (x[1] of a 4x6 and of a 5x6 base).
        storages = call.storages
        avals = avals[:n_out] + [
            (storages[s].shape, dtypes.to_jax(storages[s].dtype)) for s in plan.written_slots
        ]
    if program is None:
        pending = defer.record(plan, args, avals, where, device)
    else:
        pending = background.record(plan, program, args, avals, where, device)
    if plan.written_slots:
        return pending[:n_out], pending[n_out:]
    return pending, ()


def _fresh(array, fresh, device: int) -> TPUTensor:
    """A new TPUTensor owning ``array``, laid out as ``fresh`` (OutMeta, its _meta)."""
    out, meta = fresh
    shape, strides, dtype = out
    if device != 0 and type(array) is not Pending:
        return wrap(array, out, device)
    s = Storage(array, shape, strides, dtype, device)
    t = torch.Tensor._make_wrapper_subclass(
        TPUTensor, shape, strides=strides, dtype=dtype, device=tpu_device(device)
    )
    t._storage, t._chain, t._meta = s, (), meta
    return t


def _assemble(plan: Plan, values, outputs, device: int):
    results = []
    for kind, payload in plan.returns:
        if kind == "alias":
            results.append(values[payload])
        elif kind == "tensor":
            results.append(_fresh(outputs[payload], plan.fresh[payload], device))
        elif kind == "list":
            results.append([_fresh(outputs[i], plan.fresh[i], device) for i in payload])
        elif kind == "none":
            results.append(None)
        else:  # "scalar": a Python number, read back now
            results.append(to_host(outputs[payload]).item())
    if len(results) == 1:
        return results[0]
    if not results:
        return None
    return tuple(results)


def _as_torch_error(exc: Exception, op, info: SchemaInfo, values) -> Exception:
    """The CPU kernel's exception for a call whose lowering refused it at trace time.

    JAX refuses what torch's CPU kernels refuse too (a complex ``floor``), with its own
    TypeError or ValueError, where the meta kernel let the call through. Such a call
    is replayed on small CPU zeros (meta.py) and raises what the CPU raises; a call the
    CPU accepts keeps the lowering's error. Only on the error path, never per op."""
    if type(exc) not in (TypeError, ValueError):
        return exc
    args, kwargs = oracle.on_meta(*info.split(list(values)))
    return oracle.as_on_cpu(op, args, kwargs, exc)


def _factory_device(info: SchemaInfo, values) -> int:
    for arg, value in zip(info.args, values):
        if arg.name == "device" and value is not None:
            value = torch.device(value)
            if value.type != "tpu":
                raise RuntimeError(f"{info.op}: expected a tpu device, got {value}")
            return value.index if value.index is not None else current_index()
    return current_index()


@contextlib.contextmanager
def _compiles_counted(op):
    """JAX's compiles in this thread while the block runs, counted as torchtpu's
    (``metrics()["compiles"]["dynamic shape"]``, seconds and budget by line): the jitted
    pieces of an op of data-dependent shape compile per size outside the plans' caches,
    unseen otherwise (on a v5e, ``unique`` of 100 values once took 25 s of XLA:TPU's
    compiler a new count: ops/util.py's `true_positions`)."""
    seconds, thread = [], threading.get_ident()

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration" and threading.get_ident() == thread:
            seconds.append(duration)

    monitoring = jax().monitoring
    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield
    finally:
        monitoring.unregister_event_duration_listener(listener)
        where = user_frame() if seconds else ""
        for duration in seconds:
            perf_warnings.compiled("dynamic shape", duration, where, str(op))


def _run_dynamic(entry: Entry, values: list):
    """An op whose output shape depends on values (``nonzero``): it runs op by op on
    concrete arrays, outside ``jax.jit``."""
    op, lowering, info = entry.op, entry.lowering, entry.info
    if tracing._active is not None:
        known = " (where you know it, state it: torchtpu.bounded)" if op in bounded.AT_SIZE else ""
        tracing.refuse(f"its output shape depends on the input values{known}", op)
    call = scan(op, entry.rules, values)
    jnp = jax().numpy

    def concrete(value):
        if isinstance(value, TPUTensor):
            return materialize(value)
        if isinstance(value, (list, tuple)):
            return [concrete(v) for v in value]
        if isinstance(value, torch.Tensor):
            return jnp.asarray(value.item(), dtypes.to_jax(value.dtype))
        return value

    metrics.count("dynamic_shape", str(op))
    args = [concrete(v) for v in values]
    kinds = {v.dtype for v in values if isinstance(v, TPUTensor)}
    rule = policy.rule_for_dtypes(kinds) or policy.rule_for_op(op)
    extra = {}
    if lowering.precision:
        extra["precision"] = _precision.lax_precision(_precision.current())
    try:
        if rule is None:
            with _compiles_counted(op):
                result = lowering.fn(*args, **extra)
        else:
            # The platform policy keeps this op off the device (runtime/policy.py): it
            # runs on the host; `wrap` moves results of device dtypes back.
            host.note(op, rule)
            with host.on_host():
                result = lowering.fn(*host.to_host(args), **extra)
    except Exception as exc:
        raise add_context(exc, op, values) from None
    device = call.device if call.device is not None else _factory_device(info, values)
    results = []
    for array in flatten_result(result)[: len(info.returns)]:
        meta = OutMeta(tuple(array.shape), contiguous(array.shape), dtypes.to_torch(array.dtype))
        results.append(wrap(array, meta, device))
    return results[0] if len(results) == 1 else tuple(results)
