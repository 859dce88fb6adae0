"""``torch.compile(model, backend="tpu")``: Dynamo graphs as jitted XLA programs.

1. Dynamo captures the model on TPUTensors, which it treats as tensors because they
   are traceable wrapper subclasses of a storage-less *handle* (handles.py).
2. AOTAutograd (with core ATen decompositions, minus the ops our table lowers
   directly) splits the graph into a forward and a backward graph of aten ops on
   handles, with functionalized mutations.
3. Each graph becomes a `Program`: the graph runs through the eager dispatcher on
   TPUTensors holding JAX tracers (tracing.py), inside one ``jax.jit``. So compiled
   and eager code share every lowering, view rule and promotion rule.

Shapes: each distinct input shape gets its own XLA program (counted in
``torchtpu.metrics()["compiles"]["graph"]``). Dynamo's own recompiles work as usual;
with ``dynamic=True`` (or Dynamo's automatic dynamic shapes) the graph's size inputs
are concrete ints at run time and pick the program, so a new shape compiles once and
is then cached -- or, for an inference graph, a new bucket of shapes (buckets.py, Note
[Shape buckets]).

The backend is registered under the name "tpu" through the ``torch_dynamo_backends``
entry point (Dynamo finds it by name without importing torchtpu first) and when this
module is imported.
"""

from __future__ import annotations

import functools
import logging
import sys

import torch
import torch.fx.experimental._config
from functorch.compile import min_cut_rematerialization_partition
from torch._dynamo import trace_rules as _trace_rules
from torch._dynamo.backends import registry as _registry
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import register_backend

from torchtpu import _compat, config, dtypes, tracing
from torchtpu.compile import buckets, flex_attention, handles, upcast_loss
from torchtpu.compile.program import Program, flatten_values, unflatten_values
from torchtpu.compile.segments import Segmented, reads_values
from torchtpu.dispatch import backward_errors, defer, effort, modes, nested
from torchtpu.interop import functions as jax_functions
from torchtpu.observe import metrics
from torchtpu.runtime import array_type, jax, sharding

aten = torch.ops.aten


@functools.cache
def _decompositions() -> dict:
    """Core ATen decompositions, except for ops with a lowering of their own (which
    XLA compiles at least as well as their decomposition)."""
    from torch._decomp import core_aten_decompositions

    from torchtpu.ops import TABLE

    return {op: fn for op, fn in core_aten_decompositions().items() if op not in TABLE}


def _views_as_reshapes(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Note [Views in a compiled graph]: AOTAutograd's graphs are functional, and the
    strides they assume are those of its trace: functionalization gives the result of
    an in-place write into a view (``slice_scatter``) the strides of the tensor written
    to, where the op run for real (as here, through the eager dispatcher, with the
    strides torch's meta kernels give) makes a contiguous tensor. A ``view`` that the
    trace allowed can then be impossible at run time (Funnel's relative attention). In
    a functional graph a view and a reshape differ only in aliasing, which nothing in
    it can observe, and XLA copies neither: each ``view`` runs as ``reshape``."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.view.default:
            node.target = aten.reshape.default
            changed = True
    if changed:
        gm.recompile()
    return gm


def _graph_program(gm: torch.fx.GraphModule, donate: tuple = ()) -> Program:
    """The graph run through the eager dispatcher, as a Program (program.py)."""
    gm = _views_as_reshapes(gm)

    def trace_graph(static, arrays):
        # outputs besides tensors: None, or an int (a size the backward needs)
        return flatten_values(gm(*unflatten_values(static, arrays)))

    return Program(trace_graph, "graph", donate, options=_compiler_options(gm))


def _compiler_options(gm: torch.fx.GraphModule):
    # Note [The least effort for programs without products] (dispatch/effort.py)
    ops = (node.target for node in gm.graph.nodes if node.op == "call_function")
    return effort.compiler_options(ops)


def _written_back(gm: torch.fx.GraphModule, example_inputs) -> frozenset:
    """The graph inputs that AOTAutograd overwrites with a graph output after each call
    (an optimizer's parameters and moments, BatchNorm's running statistics): their
    positions, from AOTAutograd's metadata of the graph being compiled (_compat), each
    checked against the output that replaces it."""
    overwritten = _compat.aot_inputs_overwritten()
    if overwritten is None or overwritten[0] != len(example_inputs):
        return frozenset()
    outputs = _output_values(gm)
    written = set()
    for i, k in overwritten[1]:
        example, out = example_inputs[i], outputs[k] if k < len(outputs) else None
        if (
            isinstance(example, torch.Tensor)
            and isinstance(out, torch.Tensor)
            and example.shape == out.shape
            and example.dtype == out.dtype
        ):
            written.add(i)
    return frozenset(written)


# sys.getrefcount, in `_dead_written_back`, of an input array that only its tensor holds:
# its Storage, the tensor's cached handle (the array and the handle's ``_jax``:
# compile/handles.py), `run`'s list of arrays, the loop's variable and getrefcount's
# own argument.
_HELD_ONLY_BY_ITS_TENSOR = 6


def _dead_written_back(written: list, arrays: list) -> tuple:
    """Note [Compiled graphs reuse the inputs they overwrite]
        AOTAutograd's graphs are functional: an optimizer's compiled step returns new
        parameters and moments, which AOTAutograd's epilogue then copies into the
        inputs (a copy that only rebinds the storage: dispatch/special.py ``_copy_``).
        Run as it is, the program holds old and new state at once: 2.7x torch's peak
        memory for an MLP's AdamW step. An input the epilogue overwrites and nobody
        else holds is dead once the program has read it, so it is donated: XLA writes
        the new value into its buffer. Anyone else holding the array (a JAX array taken
        with ``torchtpu.to_jax``, another tensor's cached handle) shows as a reference
        more, and that input is not donated. Only Strict and Debug calls donate: in
        DeferAndFuse the graph joins a chunk, which donates dead inputs itself (Note
        [Donating dead inputs] in defer.py). Each set of donated inputs is a program
        of its own; in a loop that is one."""
    array = array_type()
    dead = []
    for i in written:
        a = arrays[i]
        if type(a) is array and sys.getrefcount(a) <= _HELD_ONLY_BY_ITS_TENSOR:
            dead.append(i)
    return tuple(dead)


def _compile_graph(
    gm: torch.fx.GraphModule, example_inputs, forward: bool = False, inference: bool = False
):
    """AOTAutograd's forward/backward compiler: a boxed function of handles."""
    # Note [Values read inside a compiled graph]
    program = Segmented(gm, _graph_program) if reads_values(gm) else _graph_program(gm)
    # Note [Compiled graphs reuse the inputs they overwrite]
    written = (
        _written_back(gm, example_inputs) if forward and type(program) is Program else ()
    )
    # Note [Shape buckets] (buckets.py)
    padded = None
    if inference and type(program) is Program and not written:
        plan = buckets.plan(_views_as_reshapes(gm), example_inputs)
        if plan is not None:
            padded = buckets.Bucketed(plan, options=_compiler_options(gm))
    if not forward and type(program) is Program and _ops(gm) >= AHEAD_MIN_OPS:
        # Note [Compiling the backward while the forward compiles] (program.py)
        abstract = _abstract_inputs(example_inputs)
        if abstract is not None:
            program.compile_ahead(*abstract)
    donating: dict = {(): program}

    def run(args: list):
        static, arrays = [], []
        written_arrays = [] if written else None  # positions in `arrays` of written inputs
        shapes = [getattr(a, "shape", None) for a in args] if padded is not None else None
        for n, a in enumerate(args):
            if handles.is_handle(a):
                static.append(a.dtype)
                if written_arrays is not None and n in written:
                    written_arrays.append(len(arrays))
                arrays.append(handles.array_of(a))
            elif isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() == 0:
                # A Python number Dynamo made a graph input (a float that changed
                # between calls: a temperature, a scale): a traced 0-d input, so a new
                # value does not recompile. 0-d tensors promote alike on either device.
                static.append(a.dtype)
                arrays.append(jax().numpy.asarray(a.item(), dtypes.to_jax(a.dtype)))
            elif isinstance(a, torch.Tensor):
                raise RuntimeError(
                    f"torch.compile(backend='tpu'): a graph input is a {a.device} tensor "
                    f"of shape {tuple(a.shape)}; every tensor in a compiled region must be "
                    "on the tpu device"
                )
            else:
                static.append(a)  # a size (SymInt at trace time): part of the signature
        args.clear()  # boxed calling convention: let the inputs be freed early
        static = tuple(static)
        try:
            # Note [Compiled graphs in DeferAndFuse chunks] (program.py)
            queued = (
                program.record(static, arrays)
                if type(program) is Program
                and padded is None
                and modes.is_deferring()
                and tracing._active is None
                else None
            )
            if queued is not None:
                outputs, layout = queued
            elif padded is not None:
                arrays = [defer.resolve(a, "compiled call") for a in arrays]
                outputs, layout = padded(static, arrays, shapes)
            else:
                deferring = modes.is_deferring() or tracing._active is not None
                arrays = [defer.resolve(a, "compiled call") for a in arrays]
                donated = (
                    _dead_written_back(written_arrays, arrays)
                    if written_arrays and not deferring
                    else ()
                )
                run_program = donating.get(donated)
                if run_program is None:
                    run_program = donating[donated] = _graph_program(gm, donated)
                outputs, layout = run_program(static, arrays)
                if donated:
                    metrics.count("donated", "graph", len(donated))
        except Exception as exc:
            if not backward_errors.in_backward():
                raise
            # Note [Why backward errors are deferred]
            return _poisoned_handles(exc, _output_values(gm))
        return unflatten_values(layout, outputs, handles.make_handle)

    run._boxed_call = True
    return run


# A backward graph of fewer ops compiles when the backward first runs, as AOTAutograd
# would have it: its compile is short, and a model called with gradients on but never
# differentiated (evaluated without torch.no_grad()) does not pay for it.
AHEAD_MIN_OPS = 256


def _ops(gm: torch.fx.GraphModule) -> int:
    return sum(node.op == "call_function" for node in gm.graph.nodes)


def _abstract_inputs(example_inputs) -> tuple | None:
    """(static, array specs, device) of the call `_compile_graph`'s ``run`` will make
    with real inputs like these fake ones, or None where a size is symbolic."""
    static, specs, index = [], [], 0
    for a in example_inputs:
        if isinstance(a, torch.Tensor):
            if not all(type(n) is int for n in a.shape):
                return None
            static.append(a.dtype)
            if a.device.type == "tpu":  # a handle's array: committed to its device
                index = a.device.index or 0
                specs.append((tuple(a.shape), a.dtype, index))
            elif a.device.type == "cpu" and a.dim() == 0:
                specs.append(((), a.dtype, None))  # a number made an array: uncommitted
            else:
                return None
        elif type(a) is int:
            static.append(a)
        else:
            return None
    ShapeDtypeStruct = jax().ShapeDtypeStruct
    specs = [
        ShapeDtypeStruct(shape, dtypes.to_jax(dtype), sharding=None if i is None else sharding(i))
        for shape, dtype, i in specs
    ]
    return tuple(static), specs, index


def _output_values(gm: torch.fx.GraphModule) -> list:
    """The graph's outputs as traced (fake tensors, ints or None)."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    return [n.meta.get("val") if isinstance(n, torch.fx.Node) else n for n in output.args[0]]


def _aot_backend():
    """AOTAutograd with torchtpu's graph compilers.

    Note [The backward recomputes what is cheap]
        AOTAutograd traces forward and backward as one joint graph and partitions it:
        what the forward graph returns for the backward is held between the two
        programs. Its default partition keeps every intermediate the backward reads,
        and an alias of one as well, which a program returns as an array of its own:
        at a language model's loss, ``log_softmax``'s float32 [tokens, vocabulary]
        result twice. The min-cut partition (Inductor's, the same call) keeps the
        least it can and has the backward recompute cheap pointwise ops (casts,
        activations, ``exp``) from what it keeps: inside an XLA program those
        recomputations fuse into the backward's kernels, as in Inductor's. Products,
        reductions and random ops are never recomputed, nor are torchtpu's own ops
        (linear, attention). ``config.compile_recompute`` chooses; torch's own
        ``torch._functorch.config`` settings (``activation_memory_budget``) apply."""
    options = {}
    if config.compile_recompute:
        options["partition_fn"] = min_cut_rematerialization_partition
    return aot_autograd(
        fw_compiler=functools.partial(_compile_graph, forward=True),
        bw_compiler=_compile_graph,
        inference_compiler=functools.partial(_compile_graph, forward=True, inference=True),
        decompositions=_decompositions(),
        **options,
    )


def tpu_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """The Dynamo backend: ``torch.compile(model, backend="tpu")``."""
    if options:
        raise TypeError(f"torch.compile(backend='tpu') takes no options, got {sorted(options)}")
    if flex_attention.runs_eagerly(gm):
        return gm  # Note [A compiled flex_attention alone runs eagerly]
    gm = upcast_loss.rewrite(gm)  # Note [A compiled loss of upcast logits]
    # Note [Compiling the backward while the forward compiles] (program.py)
    with _compat.aot_compiles_backward_with_forward():
        return _tpu_tensors_out(_aot_backend()(gm, example_inputs))


def _tpu_tensors_out(compiled):
    """``compiled`` with each output that is a bare handle made a TPUTensor.

    AOTAutograd rebuilds the outputs it traced as TPUTensors from their handles, but
    hands back as they are those it traced as plain tensors: a tensor a factory made
    inside the region (``torch.arange(n, device="tpu")``) that leaves it, as a result
    or across a graph break, would reach the user as a storage-less handle.
    """

    def run(*args):
        outputs = compiled(*args)
        return type(outputs)(_tpu_tensor(o) for o in outputs)

    return torch._dynamo.disable(run, reason="torchtpu's wrapper of an AOT-compiled graph")


def _tpu_tensor(output):
    if handles.is_handle(output) and not output.requires_grad:
        return handles.unflatten(output, output.shape, output.stride())
    return output


# Nor JAX's, which the dispatcher calls while Dynamo's frame hook may be active (DDP's
# forward under torch.compile runs eagerly inside it): Dynamo's tracing of JAX's array
# checks rejects JAX's own tracers ("transpose requires ndarray ... got
# DynamicJaxprTracer").
_trace_rules.add("jax")

# Dynamo must never trace torchtpu's own code (the dispatcher behind a graph break,
# ``.item()``): it runs as it is, like torch's C++ kernels.
_trace_rules.add("torchtpu")

# Nor a frame of the logging module entered from them: JAX logs (``logger.debug``)
# while it compiles an eager op, and Dynamo took each such call for a frame to compile,
# and counted a graph break ("logging.Logger method not supported") that no model
# graph has. torch treats ``copy`` the same way: skipped as a frame of its own,
# inlined as before when traced code calls it.
_trace_rules.add("logging")
_compat.dynamo_inline_when_called(_trace_rules, logging)
# Nor flex_attention's device check, which must be traced, as torch's is, for a model
# calling flex_attention to compile as one graph.
_compat.dynamo_inline_when_called(_trace_rules, flex_attention)
# And nn.TransformerEncoder's forward, which dispatch/nested.py wraps.
_compat.dynamo_inline_when_called(_trace_rules, nested)

# A @torchtpu.jax_op function is one node of Dynamo's graph (Dynamo must not trace
# JAX's pytree code); AOTAutograd traces it into its custom ops. Those made before
# Dynamo was loaded are marked here, later ones when they are made.
jax_functions.mark_for_dynamo()

# Note [Values read inside a compiled graph] (segments.py): ``x.item()`` in a compiled
# region becomes a node of the graph rather than a graph break. Dynamo offers no way to
# set this for one backend only (torch.compile's wrapper of a named backend drops a
# ``backend_ctx_ctor``), so it is set when the backend loads; a user who set
# TORCHDYNAMO_CAPTURE_SCALAR_OUTPUTS, or sets the option after this, keeps their choice.
# With it, torch 2.13's fake tensors fail a slice whose start is computed from a read
# value (``x[:, max(0, n - t.item()):]``, as MPT's attention does with a static cache)
# with PendingUnbackedSymbolNotFound, on any backend; torch's own switch makes that a
# logged warning, and the graph is right (tests/test_compile.py).
if config.compile_capture_scalars:
    torch._dynamo.config.capture_scalar_outputs = True
    torch.fx.experimental._config.soft_pending_unbacked_not_found_error = True

# A compiled optimizer step counts its steps on the device, as on CUDA (_compat.py).
_compat.dynamo_makes_optimizers_capturable_on("tpu")

# FlexAttention's higher-order ops reach their tpu kernels on a compiled function's
# first call too (_compat.py).
_compat.higher_order_ops_pass_the_aliasing_check(*flex_attention.OPS)

# Found through the entry point, Dynamo registers it itself once this module loads
# (and would refuse a second registration); imported directly, it registers here.
if "tpu" not in _registry._BACKENDS:
    register_backend(tpu_backend, name="tpu")


def _poisoned_handles(exc: BaseException, values: list) -> list:
    """A compiled backward graph's outputs (handles.py) that raise ``exc`` when read."""
    exc.add_note("torchtpu: raised by a compiled backward graph")
    backward_errors._raised.append(exc)
    return [
        handles.make_handle(backward_errors.failed(v.shape, v.dtype, exc), v.dtype)
        if isinstance(v, torch.Tensor)
        else v
        for v in values
    ]
