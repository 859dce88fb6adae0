"""``torchtpu.jit(step_fn)``: a whole training step as ONE XLA program.

No Dynamo: the step's own eager code is the tracer. ``step_fn`` runs once on
TPUTensors whose storages hold JAX tracers inside ``jax.jit`` (tracing.py), so its
forward, loss, ``backward()``, optimizer ``step()`` and ``zero_grad()`` all become one
program. Later calls replay that program on the current arrays without running
Python.

The program's inputs and outputs are *storages*, not Python objects:

- **State**: the storages the step touches that outlive it (parameters, optimizer
  state, gradients it accumulates into). The first call runs eagerly and watches which
  storages its ops touch (`_Watch`); those still alive afterwards, other than the
  results' and the optimizers' gradients, are the state. It also creates the
  optimizer state, so its structure is stable from then on. A traced call that
  touches a storage outside the state adds it and traces again.
- **Arguments**: tensors, and Python numbers, which the step receives as 0-d tpu
  tensors (as ``jax.jit`` traces numbers), so a new value never recompiles.
  ``static_argnums`` keeps an argument a Python value (part of the program's key).
- **Outputs**: the state storages the step rebinds, the storages it creates that
  outlive it (new ``.grad`` tensors: Python never reruns, so the objects made while
  tracing keep receiving each run's values), and the step's results.

What the trace takes as constants is guarded, and a change traces a new variant
(with a recompile warning after ``TORCHTPU_RECOMPILE_WARN_AFTER``): the optimizers'
hyperparameters (a scheduler's new ``lr``) and 0-d CPU tensors the step reads as
numbers.

Optimizers: torch.optim keeps Adam's step counter on the CPU and reads it with
``.item()``, which a program cannot do; after the first call, optimizers that have a
``capturable`` option switch to it and their step counters move to the tpu device,
as torch does for CUDA graphs. The update is the same math, with the bias corrections
computed in float32 on the device instead of in Python floats (last-digit differences).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import weakref

import torch
import torch.utils._pytree as pytree
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torchtpu import tracing
from torchtpu.compile.program import Program, tensor_of
from torchtpu.dispatch import core as dispatch
from torchtpu.dispatch import defer, modes
from torchtpu.dispatch.values import materialize
from torchtpu.observe import metrics, perf_warnings
from torchtpu.observe.locations import user_frame
from torchtpu.runtime import jax
from torchtpu.storage import Storage
from torchtpu.tensor import TPUTensor


def jit(fn=None, *, static_argnums: tuple[int, ...] = ()):
    """Compile ``fn`` (a training step, or any function of tpu tensors) into one XLA
    program; usable as ``@torchtpu.jit`` or ``@torchtpu.jit(static_argnums=(2,))``."""
    if fn is None:
        return functools.partial(jit, static_argnums=static_argnums)
    return StepFunction(fn, tuple(static_argnums))


class _Rediscover(Exception):
    """Raised out of a trace that touched state it was not given."""


# Traces in a row that may find new state before torchtpu.jit gives up.
_MAX_REDISCOVERIES = 4


class _Watch:
    """Collects the storages of the TPUTensors every op touches (a dispatch watcher).

    It holds them weakly: the step's temporaries (activations, the old arrays of what
    it rebinds) die as the step goes, so what is alive at its end is what outlives it.
    Held strongly, every temporary would have become program state (a 4-layer GPT's
    first call kept 519 storages, 5.2 GiB, where its state is 212, 0.79 GiB)."""

    def __init__(self):
        self.storages = weakref.WeakValueDictionary()  # id -> storage, while alive
        self.versions: dict[int, int] = {}  # each storage's version when first touched

    def __call__(self, args, kwargs) -> None:
        for leaf in pytree.tree_leaves((args, kwargs)):
            if type(leaf) is TPUTensor and leaf._inner is None:
                s = leaf._storage
                if id(s) not in self.storages:  # new (or a dead one's id, reused)
                    self.storages[id(s)] = s
                    self.versions[id(s)] = s.version

    def __enter__(self):
        dispatch.watchers.append(self)
        return self

    def __exit__(self, *exc):
        dispatch.watchers.remove(self)


def _fused_first_call():
    """Note [The first call runs fused]
    The first call runs eagerly to find the step's state. In Strict it compiled a
    program per op and held what Strict holds at its peak: an MLP's AdamW step,
    the `_foreach_` update's list of moment-sized temporaries, 1.18x torch's peak
    on a TPU v5e where the traced step later needs 1.0x. Run in DeferAndFuse, the
    step is a few fused chunks (compiled sooner than Strict's per-op programs:
    DeferAndFuse's first step is 0.3-0.5x Strict's) that donate what they replace.
    Debug keeps its own mode: its errors point at the user's line."""
    return (
        modes.set_eager_mode("defer")
        if modes.current() is modes.EagerMode.DEFER_NEVER
        else contextlib.nullcontext()
    )


class _Optimizers:
    """The torch.optim optimizers that step inside a block (a global step pre-hook)."""

    def __enter__(self):
        self.found: dict[int, torch.optim.Optimizer] = {}
        self._hook = register_optimizer_step_pre_hook(
            lambda opt, args, kwargs: self.found.setdefault(id(opt), opt) and None
        )
        return self

    def __exit__(self, *exc):
        self._hook.remove()


def _make_capturable(opt: torch.optim.Optimizer) -> None:
    """Switch an optimizer to its capturable form: step counters on its params' device."""
    for group in opt.param_groups:
        if group.get("capturable") is False:
            group["capturable"] = True
            for p in group["params"]:
                for name, value in opt.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                        opt.state[p][name] = value.to(p.device)


def _hyperparameters(opt: torch.optim.Optimizer) -> tuple:
    """The values a trace bakes into the program from ``opt.param_groups``."""
    return tuple(
        tuple(
            (k, v.item() if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v)
            for k, v in group.items()
            if k != "params" and not (isinstance(v, torch.Tensor) and v.device.type != "cpu")
        )
        for group in opt.param_groups
    )


class _Variant:
    """One traced program and the constants it assumed."""

    def __init__(self, program: Program):
        self.program = program
        self.optimizers: list = []  # (weakref to optimizer, hyperparameters)
        self.cpu_scalars: list = []  # (weakref to a 0-d CPU tensor, its version)
        self.layout = None  # set by the trace

    def holds(self) -> bool:
        for ref, values in self.optimizers:
            opt = ref()
            if opt is None or _hyperparameters(opt) != values:
                return False
        # A CPU scalar that died with the trace was a temporary; a live one must be
        # unchanged since (its version counts in-place writes).
        return all(
            (t := ref()) is None or t._version == version for ref, version in self.cpu_scalars
        )


# Note [Donating the step's state]
#     The state a step rebinds (parameters after the optimizer, its moment buffers, the
#     new grads) is dead once the program has run: its storages take the outputs. So
#     the program donates those inputs, and XLA writes the new values into their
#     buffers instead of allocating new ones (on the CPU a fresh buffer of a few MB
#     costs about as much as the step's arithmetic). Which state is donated is decided
#     once, from the storages the first (eager) call wrote; each such storage takes the
#     program's output even if a later trace leaves it unchanged. An array that someone
#     else also holds (another storage, an array the user took) is copied first, so
#     only the copy is given up.


class StepFunction:
    def __init__(self, fn, static_argnums: tuple[int, ...]):
        self.fn = fn
        self.static_argnums = static_argnums
        self._state: list | None = None  # state storages, in program input order
        self._donated: tuple = ()  # positions in _state: Note [Donating the step's state]
        self._variants: dict = {}  # argument signature -> [_Variant]
        # The devices of the step's collectives, found by the first call: the programs
        # run over them (Note [Collectives in compiled programs] in program.py).
        self._mesh: tuple | None = None
        functools.update_wrapper(self, fn)

    # -- arguments ------------------------------------------------------------------

    def _split(self, args, kwargs):
        """(static signature, argument arrays): what the program takes from a call."""
        leaves, treedef = pytree.tree_flatten((args, kwargs))
        # Which leaves belong to a static argument: flatten the arguments one by one.
        static = []
        for i, arg in enumerate(args):
            static += [i in self.static_argnums] * len(pytree.tree_leaves(arg))
        static += [False] * (len(leaves) - len(static))
        specs, arrays = [], []
        for leaf, is_static in zip(leaves, static):
            if isinstance(leaf, TPUTensor):
                specs.append(("tensor", leaf.dtype))
                arrays.append(materialize(leaf))
            elif type(leaf) in (int, float, bool) and not is_static:
                dtype = _number_dtype(leaf)
                specs.append(("number", dtype))
                arrays.append(jax().numpy.asarray(leaf, _jax_dtype(dtype)))
            elif isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"torchtpu.jit: arguments must be tpu tensors, got a {leaf.device} tensor"
                )
            else:
                specs.append(("static", leaf))
        return (treedef, tuple(specs)), arrays

    @staticmethod
    def _rebuild(signature, arrays):
        """The call's arguments with ``arrays`` (tracers) as the tensors' values."""
        treedef, specs = signature
        values, arrays = [], iter(arrays)
        for kind, payload in specs:
            values.append(tensor_of(next(arrays), payload) if kind != "static" else payload)
        return pytree.tree_unflatten(values, treedef)

    # -- calls ----------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        if self._state is None:
            return self._first_call(args, kwargs)
        signature, arg_arrays = self._split(args, kwargs)
        for _ in range(_MAX_REDISCOVERIES):
            variants = self._variants.setdefault(signature, [])
            variant = next((v for v in variants if v.holds()), None)
            if variant is None:
                variant = self._trace(signature, variants)
            state = list(self._state)
            inputs = [materialize_storage(s) for s in state]
            for i in self._donated:
                # Its storage, this list and getrefcount's argument: nobody else holds it.
                if sys.getrefcount(inputs[i]) > 3:
                    inputs[i] = jax().numpy.array(inputs[i], copy=True)
                    metrics.count("copied_to_donate", "step")
            inputs += arg_arrays
            released = _release_created(variant.layout)
            try:
                outputs, _ = variant.program(signature, inputs)
            except _Rediscover:
                self._variants.clear()  # the state grew: every program takes new inputs
            except BaseException:
                _drop_released_grads(variant.layout, released)
                raise
            else:
                return self._write_back(variant.layout, state, outputs)
            # The abandoned trace's frames hold the state's arrays in reference cycles
            # with its exception; alive, they would make the next call copy what it
            # donates (Note [Donating the step's state]): 3x an MLP's parameters at its
            # peak. They are collectable once the exception is handled.
            del inputs, state
            gc.collect()
        raise RuntimeError(
            f"torchtpu.jit: each trace of {self.fn} touched tensors that existed before it "
            "but that no earlier call had used; pass such tensors as arguments"
        )

    def _first_call(self, args, kwargs):
        """Run eagerly, finding the state and the optimizers (see the module doc)."""
        signature, arg_arrays = self._split(args, kwargs)
        call_args, call_kwargs = self._rebuild(signature, arg_arrays)
        collectives_before = tracing.eager_collectives[0]
        with _Watch() as watch, _Optimizers() as optimizers, _fused_first_call():
            result = self.fn(*call_args, **call_kwargs)
        if tracing.eager_collectives[0] != collectives_before:
            # Note [Collectives in compiled programs] in program.py
            self._mesh = tracing.eager_collectives[1]
        for opt in optimizers.found.values():
            _make_capturable(opt)
        own = {
            id(t._storage)
            for t in pytree.tree_leaves((call_args, call_kwargs, result))
            if isinstance(t, TPUTensor)
        }
        # The optimizers' gradients are not state either: a step that sets them anew
        # (zero_grad) never reads these, which would stay alive as inputs the program
        # ignores (a gradient-sized copy of the model); one that accumulates into them
        # touches them when traced, which adds them (_Rediscover).
        own |= {
            id(p.grad._storage)
            for opt in optimizers.found.values()
            for group in opt.param_groups
            for p in group["params"]
            if isinstance(p.grad, TPUTensor)
        }
        self._state = [s for key, s in list(watch.storages.items()) if key not in own]
        self._donated = tuple(
            i for i, s in enumerate(self._state) if watch.versions[id(s)] != s.version
        )
        return result

    def _trace(self, signature, variants: list) -> _Variant:
        variant = _Variant(None)
        variant.program = Program(
            functools.partial(self._trace_step, variant),
            "step",
            donate=self._donated,
            mesh=self._mesh,
        )
        variants.append(variant)
        perf_warnings.note_compile(
            f"torchtpu.jit({getattr(self.fn, '__qualname__', self.fn)})",
            user_frame(),
            ("jit", id(self), signature, len(variants)),
            lambda old, new: (
                "a new argument shape or dtype, or a changed constant (an "
                "optimizer hyperparameter such as lr, or a CPU scalar tensor)"
            ),
        )
        return variant

    def _trace_step(self, variant: _Variant, signature, arrays):
        """The trace function of a variant's Program (program.py)."""
        state = self._state
        saved = [s.array for s in state]
        inputs = {id(s) for s in state}
        for s, tracer in zip(state, arrays):
            s.array = tracer
        missing = {}  # id -> (storage, its array before this trace touched it)
        # The storages made by this trace: a tensor made from a host value inside the
        # step (``torch.tensor(2.0, device="tpu")``) holds a constant, not a tracer.
        made, created, counted = set(), tracing.active().created, [0]

        state_leaves = {}  # id -> weak reference: the state's autograd leaves (parameters)

        def watch_state(args, kwargs):
            # Every storage an op touches must be state or made by this trace.
            for leaf in pytree.tree_leaves((args, kwargs)):
                if type(leaf) is TPUTensor and leaf._inner is None:
                    s = leaf._storage
                    if id(s) in inputs:
                        if leaf.requires_grad and leaf.is_leaf and id(leaf) not in state_leaves:
                            state_leaves[id(leaf)] = weakref.ref(leaf)
                        continue
                    if isinstance(s.array, jax().core.Tracer):
                        continue
                    if counted[0] < len(created):
                        made.update(id(ref()) for ref in created[counted[0] :])
                        counted[0] = len(created)
                    if id(s) not in made:
                        missing.setdefault(id(s), (s, s.array))

        dispatch.watchers.append(watch_state)
        try:
            call_args, call_kwargs = self._rebuild(signature, arrays[len(state) :])
            with _Optimizers() as optimizers:
                result = self.fn(*call_args, **call_kwargs)
            if missing:
                self._state = state + [s for s, _ in missing.values()]
                raise _Rediscover()
            _refuse_written_arguments(call_args, call_kwargs)
            for opt in optimizers.found.values():
                variant.optimizers.append((weakref.ref(opt), _hyperparameters(opt)))
            variant.cpu_scalars = [
                (weakref.ref(t), t._version) for t in tracing.active().cpu_scalars
            ]
            outputs, written = [], []
            donated = set(self._donated)
            for i, (s, tracer) in enumerate(zip(state, arrays)):
                # A donated array's storage always takes the program's output, even
                # when the step left it unchanged: its old buffer is gone.
                if s.array is not tracer or i in donated:
                    written.append(i)
                    outputs.append(s.array)
            leaves, treedef = pytree.tree_flatten(result)
            result_arrays, result_specs = [], []
            for leaf in leaves:
                if isinstance(leaf, TPUTensor):
                    result_arrays.append(materialize(leaf))
                    result_specs.append(("tensor", leaf.dtype))
                else:
                    result_specs.append(("value", leaf))
            # Dropping the results frees their autograd graph: what stays alive of the
            # storages made while tracing is kept by the program's caller (new grads).
            del result, leaves, call_args, call_kwargs
            created = [
                s
                for ref in tracing.active().created
                if (s := ref()) is not None and id(s) not in inputs and s.array is not None
            ]
            outputs.extend(s.array for s in created)
            outputs.extend(result_arrays)
            variant.layout = (
                written,
                [weakref.ref(s) for s in created],
                _new_grads(state_leaves, created),
                treedef,
                result_specs,
            )
            return outputs, None
        finally:
            dispatch.watchers.remove(watch_state)
            for s, array in [*zip(state, saved), *missing.values()]:
                s.array = array

    @staticmethod
    def _write_back(layout, state, outputs):
        written, created, new_grads, treedef, result_specs = layout
        outputs = iter(outputs)
        for i in written:
            state[i].set(next(outputs))
        created_arrays = []
        for ref in created:
            array = next(outputs)
            created_arrays.append(array)
            s = ref()
            if s is not None:
                s.set(array)
        for ref, i, storage, (chain, *view) in new_grads:
            param = ref()
            if param is not None and param.grad is None:
                # Its gradient was dropped since (``zero_grad()`` outside the step): the
                # step's gradient is a new tensor, as an eager backward() makes.
                grad = Storage(created_arrays[i], *storage)
                param.grad = TPUTensor(grad, chain, *view)
        leaves = [
            tensor_of(next(outputs), payload) if kind == "tensor" else payload
            for kind, payload in result_specs
        ]
        return pytree.tree_unflatten(leaves, treedef)


# Note [The step's own tensors are released before it runs]
#     The storages a step creates that outlive it (the gradients ``backward()`` makes
#     after ``zero_grad()``) are outputs of its program and never inputs: each run
#     replaces their arrays whole. Kept until then, last step's arrays would be alive
#     while the program runs beside the new ones -- a gradient-sized copy of the model
#     at the peak that the eager step, whose ``zero_grad()`` dropped them first, never
#     has (0.61 GiB for GPT-2 small's float32 gradients). So a replay drops them
#     before it runs. Should the program fail, the gradients it was to write are
#     gone, as after an eager step that failed past its ``zero_grad()``: those
#     parameters' ``.grad`` becomes None rather than a storage read as zeros.


def _release_created(layout) -> list:
    """Drop the arrays of the storages a replay of ``layout`` will replace whole; the
    storages dropped (Note [The step's own tensors are released before it runs])."""
    if layout is None:  # the variant's first call traces: it may read them
        return []
    defer.flush("compiled call")  # queued writes into them land first
    released = []
    for ref in layout[1]:
        s = ref()
        if s is not None and s.array is not None:
            s.set(None)
            released.append(s)
    return released


def _drop_released_grads(layout, released: list) -> None:
    """After a failed replay: the parameters whose gradient was released have none."""
    if not released:
        return
    ids = {id(s) for s in released}
    for ref, *_ in layout[2]:
        param = ref()
        if param is not None and type(param.grad) is TPUTensor and id(param.grad._storage) in ids:
            param.grad = None


def _new_grads(leaves: dict, created: list) -> list:
    """For each autograd leaf of the state whose ``.grad`` this trace made: a weak
    reference to it, the index of the gradient's storage in ``created``, that storage's
    (shape, strides, dtype, device) and the gradient's (view chain, size, stride, offset,
    dtype). A replay gives the leaf its new gradient from them, even if its old one was
    dropped meanwhile."""
    index = {id(s): i for i, s in enumerate(created)}
    found = []
    for ref in leaves.values():
        param = ref()
        grad = None if param is None else param.grad
        if type(grad) is TPUTensor and id(grad._storage) in index:
            s = grad._storage
            found.append((
                ref, index[id(s)], (s.shape, s.strides, s.dtype, s.device_index),
                (grad._chain, tuple(grad.shape), grad.stride(), grad.storage_offset(), grad.dtype),
            ))  # fmt: skip
    return found


def _refuse_written_arguments(call_args, call_kwargs) -> None:
    for leaf in pytree.tree_leaves((call_args, call_kwargs)):
        if isinstance(leaf, TPUTensor) and leaf._storage.version:
            raise RuntimeError(
                "torchtpu.jit: the step wrote to one of its tensor arguments in place; "
                "return the new value instead, or keep the tensor as state (e.g. a "
                "module buffer)"
            )


def materialize_storage(s):
    """A state storage's base array, concrete (flushing DeferAndFuse if need be)."""
    from torchtpu.dispatch.pending import Pending

    if type(s.array) is Pending:
        return materialize(TPUTensor(s, (), s.shape, s.strides, 0, s.dtype))
    if s.array is None:
        return jax().numpy.zeros(s.shape, _jax_dtype(s.dtype))
    return s.array


def _number_dtype(x) -> torch.dtype:
    if type(x) is bool:
        return torch.bool
    if type(x) is int:
        return torch.int64
    return torch.get_default_dtype()


def _jax_dtype(dtype: torch.dtype):
    from torchtpu import dtypes

    return dtypes.to_jax(dtype)
