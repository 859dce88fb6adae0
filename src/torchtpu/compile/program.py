"""A Program: torch code traced into one jitted XLA program per input signature.

Both compiled paths hand a Program a *trace function*: given a hashable ``static``
description of the inputs and their arrays (JAX tracers at trace time), it runs torch
ops on TPUTensors holding those arrays and returns its output arrays and a *layout*
(how to rebuild the Python results). The Program runs it inside ``jax.jit`` under
`trace`, so the random ops' seed and offset are program inputs and value
checks are program outputs, and after each run it advances the RNG and files the
checks as eager ops do (checks.py).

Note [Collectives in compiled programs]
    A torch.distributed collective is a program over the group's devices, one per
    process. A traced function that calls one (a ``dist.all_reduce`` in a
    ``torchtpu.jit`` step, a functional collective in a ``torch.compile`` graph) is
    therefore compiled as ONE SPMD program over those devices: the first trace stops at
    the collective (`tracing.NeedsMesh`) -- or, for torchtpu.jit, whose first call runs
    eagerly, that call's collectives tell before any trace (`tracing.eager_collectives`)
    -- and the Program traces inside
    ``shard_map`` over a 1-D mesh (axis ``"r"``, as collectives.py uses). Each
    process's arrays are its blocks of global arrays, the body computes on its own
    block as before, and the collective is the same ``lax`` body the eager collective
    runs -- now fused with the computation around it. Every process must call the
    compiled function (the rule of docs/distributed.md); a program without
    collectives stays a program of this process alone.

Note [Compiled graphs in DeferAndFuse chunks]
    In DeferAndFuse a call of a signature that ran before is not run: it is recorded in
    the queue as ONE op (`QueuedProgram`), whose function calls the jitted program, and
    its outputs are Pending values like any op's. So a ``torch.compile`` model's forward
    and backward graphs, the eager loss between them and the optimizer's ops after
    them become one chunk per step -- one XLA program with the parameters' buffers
    donated, as ``torchtpu.jit`` makes of a whole step -- instead of a wait at each
    graph and a chunk for each stretch of eager ops between them. Inside the chunk the
    program is a nested ``jax.jit``: its jaxpr is reused, its RNG seed and offset are
    inputs of the op, its value checks flags of the op, filed as a recorded op's are.
    A new signature runs at once (tracing it tells the outputs' shapes), as does a
    program over a mesh (its arrays are blocks of global arrays).

Note [Compiling the backward while the forward compiles]
    AOTAutograd compiles a graph's backward when the backward first runs, so a training
    step's first call compiles its forward program, runs it, then compiles its backward
    program: on a TPU v5e each of GPT-2 small's takes ~12 s of XLA's compiler, one
    after the other. Asked to (compile/backend.py), AOTAutograd hands the backward graph
    over with the forward, its inputs' shapes known. The backward's Program is given
    them (`compile_ahead`), and the next call of any Program -- the forward's first --
    traces it and hands the XLA compile to a worker thread before compiling its own.
    XLA's compiler releases the GIL, so the two compile at once. The backward's first
    call waits for its compile, and ``jax.jit`` finds the program in its cache as if it
    had compiled it. A call whose signature turns out different, or a compile that
    failed, compiles as before, in the call. Tracing stays on the thread that calls:
    torch's dispatcher state and torchtpu's tracing state are the caller's. A small
    backward graph (`backend.AHEAD_MIN_OPS`) is left to compile when it first runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from torchtpu import memory, rng, tracing
from torchtpu.dispatch import background, checks, defer, modes
from torchtpu.dispatch.values import materialize
from torchtpu.observe import metrics, perf_warnings, progress
from torchtpu.observe.locations import user_frame
from torchtpu.runtime import jax
from torchtpu.storage import Storage, _contiguous_strides
from torchtpu.tensor import TPUTensor


@contextlib.contextmanager
def trace(seed, offset):
    """Run the body as a trace (see tracing.py); yields the `Trace`. Nothing may be
    queued (Program.__call__ flushes before JAX traces)."""
    previous, previous_mode = tracing._active, modes._current
    tracing._active = tracing.Trace(seed, offset)
    modes._current = modes.EagerMode.DEFER_NEVER
    try:
        # JAX's tracing state is per thread: a backward() inside the traced code must
        # run on this thread, not on autograd's device thread.
        with torch.autograd.set_multithreading_enabled(False):
            yield tracing._active
    finally:
        tracing._active, modes._current = previous, previous_mode


class _Traced(NamedTuple):
    """What tracing one signature found out, besides the program itself."""

    layout: object
    draws: int  # random ops: the RNG offset advances by this much per run
    check_infos: list  # (exception type, message, op) per check flag output
    # Note [A program returns its unchanged inputs as they are]: (output position,
    # input position) of each output that is an input's array, by output position
    forwarded: tuple = ()

    def outputs(self, returned: list, arrays) -> list:
        """The program's outputs: what it ``returned``, with each forwarded input's array
        from the call's ``arrays`` put back in its place."""
        outputs = list(returned)
        for k, i in self.forwarded:  # in order of k: each lands where it was
            outputs.insert(k, arrays[i])
        return outputs


class Program:
    def __init__(
        self, trace_fn: Callable, kind: str, donate: tuple = (), mesh=None, options=None
    ):
        self._trace_fn = trace_fn
        self.kind = kind  # "graph" (torch.compile) or "step" (torchtpu.jit), for metrics
        # ``donate``: positions of the arrays whose buffers the program may reuse for
        # its outputs (Note [Donating the step's state] in jit.py). ``options``: XLA's
        # compiler options, None for its defaults; JAX takes them only for a program it
        # compiles, not one nested in another's trace (a DeferAndFuse chunk's, a
        # torchtpu.jit step's), which ``_nested`` is for.
        donate_argnums = tuple(3 + i for i in donate)
        self._jitted = jax().jit(
            self._traced, static_argnums=0, donate_argnums=donate_argnums,
            compiler_options=options,
        )  # fmt: skip
        self._nested = (
            jax().jit(self._traced, static_argnums=0, donate_argnums=donate_argnums)
            if options
            else self._jitted
        )
        self._donate = donate
        self._signatures: dict = {}
        self._avals: dict = {}  # signature -> (shape, dtype) of each output
        # signature -> XLA's account of its memory (Note [A program's memory is known
        # before it runs]); None where the backend gives none
        self._memory: dict = {}
        self._queued: dict = {}  # signature -> its QueuedProgram
        # Note [Compiling the backward while the forward compiles]
        self._ahead: dict = {}  # signature -> (_Traced, Future of its compiled program)
        self._last: _Traced | None = None
        self._mesh: tuple | None = None  # Note [Collectives in compiled programs]
        if mesh is not None:
            self._over_mesh(mesh)

    def _traced(self, static, seed, offset, *arrays):
        with trace(seed, offset) as t:
            t.mesh = self._mesh
            outputs, layout = self._trace_fn(static, arrays)
        # Note [A program returns its unchanged inputs as they are]
        donated = set(self._donate)
        inputs = {id(a): i for i, a in enumerate(arrays) if i not in donated}
        forwarded = tuple(
            (k, inputs[id(o)]) for k, o in enumerate(outputs) if id(o) in inputs
        )
        kept = [o for o in outputs if id(o) not in inputs]
        self._last = _Traced(
            layout, t.draws, [(e, m, op) for _, e, m, op in t.checks], forwarded
        )
        return kept, [flag for flag, *_ in t.checks]

    def _over_mesh(self, devices: tuple) -> None:
        """From now on, trace and run as one SPMD program over ``devices``."""
        self._mesh = devices
        self._jitted = self._nested = _SPMD(self._traced, devices, self._donate)
        self._signatures.clear()
        self._queued.clear()

    def __call__(self, static, arrays: list, device: int = 0):
        """Run on concrete ``arrays``; returns (output arrays, layout)."""
        # Queued eager ops run first, and outside the program: under JAX's trace, a chunk
        # run by a flush would be staged into the program and its results leak as tracers.
        defer.flush("compiled call")
        if tracing._active is None:  # inside a trace, a program is part of the trace's
            _start_compiles_ahead()
        signature = (static, tuple((a.shape, a.dtype) for a in arrays))
        traced = self._signatures.get(signature)
        ahead = self._ahead.pop(signature, None) if traced is None else None
        seed, offset = rng.peek(device)
        start = time.perf_counter()
        compiling = (
            progress.compiling(f"a compiled {self.kind}", user_frame())
            if traced is None
            else contextlib.nullcontext()
        )
        with compiling:
            try:
                if tracing._active is None and self._mesh is None:
                    self._before_run(signature, ahead, static, seed, offset, arrays, device)
                jitted = self._jitted if tracing._active is None else self._nested
                outputs, flags = jitted(static, seed, offset, *arrays)
            except tracing.NeedsMesh as need:
                self._over_mesh(need.devices)
                traced = None
                outputs, flags = self._jitted(static, seed, offset, *arrays)
            except Exception as exc:
                error = memory.out_of_memory(exc, f"a compiled {self.kind}", device)
                if error is exc:
                    raise
                raise error from exc
        if traced is None:
            # A new signature: this call traced and compiled (or loaded from JAX's
            # persistent cache) a program, or waited for its compile ahead. The seconds
            # include its first run.
            traced = self._signatures[signature] = self._last if ahead is None else ahead[0]
            outputs = traced.outputs(outputs, arrays)
            self._avals[signature] = [(tuple(o.shape), o.dtype) for o in outputs]
            where, seconds = user_frame(), time.perf_counter() - start
            metrics.count("compiles", self.kind)
            metrics.count("compile_seconds", self.kind, seconds)
            metrics.event("compile", op=f"compiled {self.kind}", where=where)
        else:
            outputs = traced.outputs(outputs, arrays)
            where = None
        metrics.count("compiled_calls", self.kind)
        rng.advance(device, traced.draws)
        if traced.check_infos:
            if modes.is_debug():
                checks.raise_now(flags, traced.check_infos, f"in a compiled {self.kind}")
            else:
                checks.defer(flags, traced.check_infos, f"in a compiled {self.kind}")
        elif modes.is_debug():
            jax().block_until_ready(outputs)
        if where is not None:  # last: a compile budget's error leaves the state consistent
            perf_warnings.note_compile_time(where, seconds, f"a compiled {self.kind}")
        return outputs, traced.layout

    def _before_run(self, signature, ahead, static, seed, offset, arrays, device) -> None:
        """Know the program's memory before it runs, and check it (Note [A program's
        memory is known before it runs]); a new signature is compiled here (or its
        compile ahead waited for), and the call finds it in ``jax.jit``'s cache."""
        first = signature not in self._memory
        if first:
            if ahead is not None and ahead[1].exception() is None:
                compiled = ahead[1].result()
            else:  # had the compile ahead failed, this compile says why
                compiled = self._jitted.lower(static, seed, offset, *arrays).compile()
            self._memory[signature] = memory.program_bytes(compiled)
        what = f"a compiled {self.kind}"
        memory.before_run(self._memory[signature], self.kind, what, None, device, first)

    def compile_ahead(self, static, specs: list, device: int = 0) -> None:
        """Compile the signature of ``specs`` (``jax.ShapeDtypeStruct``s, as placed as
        the call's arrays will be) on a worker thread, from the next call of any Program
        on (Note [Compiling the backward while the forward compiles])."""
        _to_compile_ahead.append((self, static, specs, device))

    def _start_compile_ahead(self, static, specs: list, device: int) -> None:
        signature = (static, tuple((s.shape, s.dtype) for s in specs))
        if self._mesh is not None or signature in self._signatures or signature in self._ahead:
            return
        seed, offset = rng.peek(device)  # traced: only their types matter
        try:
            lowered = self._jitted.lower(static, seed, offset, *specs)
        except Exception:
            return  # the call traces again, and raises where the user sees it
        self._ahead[signature] = (self._last, background.compiler().submit(lowered.compile))

    def record(self, static, arrays: list, device: int = 0):
        """DeferAndFuse: queue this call as one op of the next chunk (Note [Compiled
        graphs in DeferAndFuse chunks]); ``arrays`` may be Pending. Returns (Pending
        outputs, layout), or None for a call that must run now."""
        if self._mesh is not None:
            return None
        signature = (static, tuple((a.shape, a.dtype) for a in arrays))
        op = self._queued.get(signature)
        if op is None:
            traced = self._signatures.get(signature)
            if traced is None:
                return None
            op = self._queued[signature] = QueuedProgram(
                self, static, traced, self._avals[signature]
            )
        seed, offset = rng.peek(device)
        where = user_frame() if op.check_infos else None  # a stack walk: only when needed
        outputs = defer.record(op, [seed, offset, *arrays], op.avals, where, device)
        rng.advance(device, op.draws)
        metrics.count("compiled_calls", self.kind)
        return outputs, op.layout


# Note [Compiling the backward while the forward compiles]
_to_compile_ahead: list = []  # (Program, static, specs, device), started by the next call


def _start_compiles_ahead() -> None:
    while _to_compile_ahead:
        program, static, specs, device = _to_compile_ahead.pop()
        program._start_compile_ahead(static, specs, device)


class QueuedProgram(defer.FunctionOp):
    """One signature of a Program as an op of a DeferAndFuse queue (Note [Compiled graphs
    in DeferAndFuse chunks])."""

    __slots__ = ("layout", "draws")

    def __init__(self, program: Program, static, traced: _Traced, avals: list):
        def caller(jitted):
            def run(seed, offset, *arrays):
                outputs, flags = jitted(static, seed, offset, *arrays)
                return (*traced.outputs(outputs, arrays), *flags)

            return run

        # Alone, the program compiled already is what runs; inside a chunk's trace, the
        # same program as a nested jit (which takes no compiler options).
        super().__init__(
            f"a compiled {program.kind}", caller(program._nested), caller(program._jitted),
            avals, traced.check_infos,
        )  # fmt: skip
        self.layout, self.draws = traced.layout, traced.draws


class _SPMD:
    """``traced`` as one ``jax.jit(shard_map(...))`` over ``devices`` (one per process,
    in group-rank order), called like the single-process program: with this process's
    arrays, returning its own outputs (Note [Collectives in compiled programs])."""

    def __init__(self, traced, devices: tuple, donate: tuple):
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        self.n = len(devices)
        axis = tracing.MESH_AXIS
        mesh = Mesh(np.array(devices, dtype=object), (axis,))
        self.sharding = NamedSharding(mesh, P(axis))
        self.local = next(d for d in devices if d.process_index == jax().process_index())
        self.scalar_outputs: dict = {}  # static -> which outputs are 0-d (found tracing)

        def program(static, seed, offset, *arrays):
            def blocks(seed, offset, *arrays):
                # a block of a 0-d value carries a leading axis of 1 (see _block)
                values = [a[0] for a in (seed, offset)]
                values += [a if len(s) else a[0] for a, s in zip(arrays, static[1], strict=True)]
                outputs, flags = traced(static[0], *values)
                self.scalar_outputs[static] = [o.ndim == 0 for o in outputs]
                return [o if o.ndim else o[None] for o in outputs], [f[None] for f in flags]

            mapped = jax().shard_map(
                blocks, mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=False
            )
            return mapped(seed, offset, *arrays)

        self.jitted = jax().jit(
            program, static_argnums=0, donate_argnums=tuple(3 + i for i in donate)
        )

    def _block(self, value, dtype=None):
        """This process's ``value`` as its block of a global array sharded over the mesh."""
        a = jax().numpy.asarray(value, dtype) if dtype is not None else value
        a = jax().device_put(a, self.local) if dtype is not None else a
        block = a if a.ndim else a.reshape(1)
        shape = (self.n * block.shape[0], *block.shape[1:])
        return jax().make_array_from_single_device_arrays(shape, self.sharding, [block])

    def __call__(self, static, seed, offset, *arrays):
        int64 = jax().numpy.int64
        inputs = [self._block(seed, int64), self._block(offset, int64)]
        inputs += [self._block(a) for a in arrays]
        key = (static, tuple(tuple(a.shape) for a in arrays))
        outputs, flags = self.jitted(key, *inputs)
        scalars = self.scalar_outputs[key]
        outputs = [
            o.addressable_data(0).reshape(()) if scalar else o.addressable_data(0)
            for o, scalar in zip(outputs, scalars, strict=True)
        ]
        return outputs, [f.addressable_data(0).reshape(()) for f in flags]


def tensor_of(array, dtype: torch.dtype) -> TPUTensor:
    """A contiguous TPUTensor owning ``array`` (a tracer while tracing)."""
    shape = tuple(array.shape)
    strides = _contiguous_strides(shape)
    return TPUTensor(Storage(array, shape, strides, dtype, 0), (), shape, strides, 0, dtype)


def flatten_values(values) -> tuple[list, tuple]:
    """A graph's inputs or outputs as ``(arrays, layout)``: the array of each TPUTensor,
    and a layout holding each tensor's dtype in its place and anything else (a size,
    None) as it is. A Program's trace function receives and returns this form."""
    arrays, layout = [], []
    for v in values:
        if isinstance(v, TPUTensor):
            arrays.append(materialize(v))
            layout.append(v.dtype)
        elif isinstance(v, torch.Tensor):
            layout.append(_Constant(v))
        else:
            layout.append(v)
    return arrays, tuple(layout)


def unflatten_values(layout, arrays, tensor=tensor_of) -> list:
    """The values `flatten_values` describes, each array made a tensor by ``tensor(array,
    dtype)``: a contiguous TPUTensor, or a handle (handles.py)."""
    arrays = iter(arrays)
    values = []
    for spec in layout:
        if isinstance(spec, torch.dtype):
            values.append(tensor(next(arrays), spec))
        else:
            values.append(spec.tensor if isinstance(spec, _Constant) else spec)
    return values


class _Constant:
    """A tensor that is not a tpu tensor (a CPU constant a graph holds, passed from one
    of its programs to the next): part of the layout by identity, so JAX can hash and
    compare it as a static argument."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __eq__(self, other):
        return isinstance(other, _Constant) and other.tensor is self.tensor

    def __hash__(self):
        return id(self.tensor)
