"""``@torchtpu.jax_op``: a function of jax arrays as a function of tpu tensors, in every
mode, differentiable, and one node in compiled graphs.

Each decorated function becomes two torch custom ops, ``torch.ops.torchtpu_jax.<name>``
and its backward ``torch.ops.torchtpu_jax.<name>_vjp``, with the schemas::

    <name>(Tensor[] tensors, Scalar[] numbers, str spec) -> Tensor[]
    <name>_vjp(Tensor[] tensors, Tensor[] cotangents, Scalar[] numbers, str spec) -> Tensor[]

The call's pytrees are flattened into the tensors, the traced Python numbers, and a
*spec*: the tree structure and the static leaves, interned per function and named by
a short string, so it is a static argument of the op (part of its cache key). Each op
has:

- a lowering in the one op table (ops/registry.py ``lowers``), so the dispatcher runs
  it as any other op: one jitted call in Strict, recorded and fused into the chunk in
  DeferAndFuse, traced into the program under ``torchtpu.jit`` and ``torch.compile``;
- a fake (meta) kernel from ``jax.eval_shape``: the dispatcher's meta oracle and
  torch.compile size its outputs with it, and a JAX error about shapes or dtypes is
  raised there, at the call, naming the function and the user's line;
- a CPU kernel (JAX's CPU backend), so the function also takes CPU tensors;
- an autograd formula (``torch.library.register_autograd``) calling the ``_vjp`` op,
  whose lowering is ``jax.vjp`` of the function (or the user's ``backward``).

Note [Static and traced numbers]
    A Python number in the arguments is static by default: a Python value when the
    function runs, part of the op's key, so each new value compiles anew (the
    recompile warning names it). That is what an axis, a block size or a shape needs,
    and what works for every JAX function. Arguments named in ``traced=`` pass their
    numbers as traced 0-d arrays instead (weakly typed, as ``jax.jit`` passes numbers):
    a temperature or a learning rate that changes every step then never recompiles.
    Everything else that is not a tensor (strings, dtypes, None) is static.

Note [Numbers under torch.compile]
    Dynamo passes a float that changed between calls as a symbolic number. A jax_op
    specializes it to a Python number (a guard on its value), whether it is static or
    traced: JAX needs a value or an array, and the graph would otherwise read a traced
    0-d tensor's value. So under torch.compile a new number recompiles the graph; in
    eager code and under ``torchtpu.jit`` a traced number never recompiles.

Note [Complex gradients]
    For complex values torch's autograd passes and returns the conjugates of the
    cotangents ``jax.vjp`` takes and gives (torch: the conjugate Wirtinger derivative;
    JAX: the plain one), so the default backward conjugates both sides. A user's
    ``backward`` gets and returns torch's convention.

Note [Matmul precision in JAX functions]
    A product inside the function (``x @ w``, ``jnp.einsum``, a convolution) without a
    ``precision=`` of its own computes at torch's float32 matmul precision, as torch's
    own ops on tpu tensors do (matmul_precision.py): exact float32 at torch's default
    "highest", where JAX's own default on a TPU is one bfloat16 pass. The function is
    traced under ``jax.default_matmul_precision``, and the setting is part of the op's
    cache key, so ``torch.set_float32_matmul_precision("medium")`` gives it bfloat16
    passes too. A ``precision=`` written in the function wins.

Note [Backward recomputes the forward]
    The ``_vjp`` op takes the primal inputs, not JAX's residuals (torch saves tensors,
    and a residual has no torch type), so ``jax.vjp`` traces the forward again inside
    the backward. In one program (``torchtpu.jit``, a DeferAndFuse chunk holding both)
    XLA shares the two; across programs the forward runs twice. A function with its own
    ``jax.custom_vjp`` keeps it: ``jax.vjp`` calls the custom rule.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import re
import sys
import threading
from collections.abc import Callable, Sequence

import torch

from torchtpu import dtypes
from torchtpu.dispatch.signature import hashable, plain
from torchtpu.observe.locations import place, user_frame
from torchtpu.ops.registry import lowers
from torchtpu.runtime import jax

__all__ = ["JaxFunction", "jax_op"]

NAMESPACE = "torchtpu_jax"
_SHOWN = 120  # characters of a spec's name that show its static values
_NUMBERS = (bool, int, float)
# Symbolic numbers (torch.compile) and the Python type each is specialized to.
_SYMBOLIC = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}
_KEYWORDS = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)

_library: torch.library.Library | None = None


def jax_op(
    fn: Callable | None = None,
    *,
    name: str | None = None,
    traced: Sequence[str] = (),
    backward: Callable | None = None,
):
    """Turn a function of jax arrays into a function of torch tensors.

    ``fn`` takes pytrees (tuples, lists, dicts) of jax arrays and Python values and
    returns a pytree of jax arrays; the result takes the same pytrees with tensors in
    place of arrays and returns tensors in place of arrays. It runs on tpu tensors in
    every eager mode, inside ``torch.compile(backend="tpu")`` (no graph break) and
    ``torchtpu.jit``, and also on CPU tensors (JAX's CPU backend).

    - ``name``: the op is ``torch.ops.torchtpu_jax.<name>`` (default: ``fn.__name__``,
      with a numeric suffix if that name is taken).
    - ``traced``: names of arguments whose Python numbers are traced inputs rather
      than static values (Note [Static and traced numbers]).
    - ``backward``: ``backward(grad_out, *args, **kwargs)`` returns the gradients of
      the positional arguments (a tuple with one entry per positional argument, each
      shaped as that argument, None where there is none); ``grad_out`` is shaped as the
      output. By default the gradient is ``jax.vjp`` of ``fn``.

    Example::

        @torchtpu.jax_op
        def logdet(a):
            return jnp.linalg.slogdet(a)[1]

        a = torch.randn(3, 3, device="tpu", requires_grad=True)
        logdet(a @ a.T + torch.eye(3, device="tpu")).backward()
    """
    if fn is None:
        return functools.partial(jax_op, name=name, traced=traced, backward=backward)
    function = JaxFunction(fn, name=name, traced=tuple(traced), backward=backward)

    # A plain function (what Dynamo marks as an opaque call, `_mark`), carrying its ops.
    @functools.wraps(fn)
    def call(*args, **kwargs):
        return function(*args, **kwargs)

    call.jax_function, call.op, call.vjp_op = function, function.op, function.vjp_op
    _allow_in_compiled_graphs(call)
    return call


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The static part of one call: how to rebuild the arguments from the flat lists.

    ``leaves`` has per leaf ``("t", i)`` (tensor i), ``("n", i)`` (traced number i) or
    ``("s", value)`` (a static value); ``trees`` the tree structure of each bound
    argument, ``names`` their parameter names, ``n_positional`` how many leaves belong
    to the positional arguments (those a user's backward returns gradients for)."""

    names: tuple
    trees: tuple
    leaves: tuple
    n_positional: int


class JaxFunction:
    """What ``@jax_op`` makes of a function: call it with tensors."""

    def __init__(self, fn: Callable, *, name: str | None, traced: tuple, backward):
        self.fn = fn
        self.backward = backward
        self.traced = frozenset(traced)
        try:
            self.signature = inspect.signature(fn)
        except (TypeError, ValueError):
            self.signature = inspect.Signature(
                [
                    inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                    inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
                ]
            )
        params = list(self.signature.parameters.values())
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        # What a call of positional arguments only may bind without inspect (`_bind`).
        self._positional = [p.name for p in params if p.kind in positional]
        self._required = sum(
            1 for p in params if p.kind in positional and p.default is inspect.Parameter.empty
        )
        self._simple = all(
            p.kind in positional or p.default is not inspect.Parameter.empty for p in params
        ) and not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
        unknown = self.traced - set(self.signature.parameters)
        if unknown:
            raise TypeError(f"jax_op: traced= names {sorted(unknown)}, not arguments of {fn!r}")
        self.qualname = getattr(fn, "__qualname__", repr(fn))
        code = getattr(fn, "__code__", None)
        self.defined_at = place(code.co_filename, code.co_firstlineno) if code else "<unknown>"
        self.specs: list[_Spec] = []
        self._spec_ids: dict[_Spec, str] = {}
        self._lock = threading.Lock()
        self._abstract: dict = {}
        self._trees: dict = {}
        self._cpu: dict = {}
        self.op, self.vjp_op = _define(self, name)

    def __repr__(self) -> str:
        return f"<jax_op {self.qualname} as torch.ops.{self.op._schema.name.replace('::', '.')}>"

    # -- the torch side: flatten, call the op, unflatten --------------------------------

    def __call__(self, *args, **kwargs):
        tensors, numbers, spec = self._flatten(args, kwargs)
        if not tensors:
            raise TypeError(
                f"jax_op {self.qualname}: needs at least one tensor argument (its device "
                "says where the function runs)"
            )
        outputs = self.op(tensors, numbers, spec)
        key = (spec, tuple((t.shape, t.dtype) for t in tensors), tuple(map(type, numbers)))
        out_tree = self._trees.get(key)
        if out_tree is None:
            out_tree = self._trees[key] = self.abstract(spec, _avals(tensors), numbers)[1]
        return jax().tree_util.tree_unflatten(out_tree, list(outputs))

    def _bind(self, args, kwargs):
        """``(parameter name -> value, how many of them make up the positional
        arguments)``, as ``inspect.BoundArguments`` has them."""
        if not kwargs and self._simple and self._required <= len(args) <= len(self._positional):
            return dict(zip(self._positional, args)), len(args)
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"jax_op {self.qualname}: {exc}") from None
        n = 0
        for p in self.signature.parameters.values():
            if p.kind in _KEYWORDS or p.name not in bound.arguments:
                break
            n += 1
        return bound.arguments, n

    def _flatten(self, args, kwargs):
        arguments, n_args = self._bind(args, kwargs)
        tree_util = jax().tree_util
        tensors, numbers, leaves, names, trees, statics = [], [], [], [], [], []
        n_positional = 0
        for position, (pname, value) in enumerate(arguments.items()):
            flat, tree = tree_util.tree_flatten(value)
            names.append(pname)
            trees.append(tree)
            if position < n_args:
                n_positional += len(flat)
            for leaf in flat:
                if type(leaf) in _SYMBOLIC:
                    leaf = _SYMBOLIC[type(leaf)](leaf)  # Note [Numbers under torch.compile]
                if isinstance(leaf, torch.Tensor):
                    leaves.append(("t", len(tensors)))
                    tensors.append(leaf)
                elif pname in self.traced and type(leaf) in _NUMBERS:
                    leaves.append(("n", len(numbers)))
                    numbers.append(leaf)
                else:
                    leaves.append(("s", _static(self, pname, leaf)))
                    statics.append((pname, leaf))
        spec = _Spec(tuple(names), tuple(trees), tuple(leaves), n_positional)
        spec_id = self._spec_ids.get(spec)
        if spec_id is None:
            with self._lock:
                spec_id = self._spec_ids.get(spec)
                if spec_id is None:
                    # Its number, then what it holds, for the recompile warning to show.
                    self.specs.append(spec)
                    shown = ", ".join(f"{n}={v!r}" for n, v in statics)
                    spec_id = f"{len(self.specs) - 1}: {shown}"[:_SHOWN]
                    self._spec_ids[spec] = spec_id
        return tensors, numbers, spec_id

    # -- the JAX side: rebuild the arguments and call the function ----------------------

    def _arguments(self, spec_id: str, arrays, numbers):
        spec = self.specs[int(spec_id.partition(":")[0])]
        tree_util = jax().tree_util
        values = []
        for kind, payload in spec.leaves:
            if kind == "t":
                values.append(arrays[payload])
            elif kind == "n":
                values.append(numbers[payload])
            else:
                values.append(plain(payload))
        leaves = iter(values)
        arguments = {}
        for pname, tree in zip(spec.names, spec.trees):
            arguments[pname] = tree_util.tree_unflatten(
                tree, [next(leaves) for _ in range(tree.num_leaves)]
            )
        bound = inspect.BoundArguments(self.signature, arguments)
        return spec, bound.args, bound.kwargs

    def forward(self, spec_id: str, arrays, numbers) -> list:
        """The function on flat lists: its output leaves (the ``<name>`` op's lowering)."""
        return self._call(spec_id, arrays, numbers)[0]

    def _call(self, spec_id: str, arrays, numbers):
        _, args, kwargs = self._arguments(spec_id, arrays, numbers)
        leaves, tree = jax().tree_util.tree_flatten(self.fn(*args, **kwargs))
        for i, leaf in enumerate(leaves):
            if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
                raise TypeError(
                    f"output leaf {i} is a {type(leaf).__name__}; a jax_op returns jax arrays "
                    "(or pytrees of them)"
                )
        return leaves, tree

    def vjp(self, spec_id: str, arrays, cotangents, numbers) -> list:
        """Gradients of the floating inputs (the ``<name>_vjp`` op's lowering)."""
        jx = jax()
        jnp = jx.numpy
        diff = [i for i, a in enumerate(arrays) if _inexact(a.dtype)]
        if self.backward is not None:
            return self._user_vjp(spec_id, arrays, cotangents, numbers, diff)

        def of_differentiable(*values):
            full = list(arrays)
            for i, v in zip(diff, values):
                full[i] = v
            return self.forward(spec_id, full, numbers)

        outs, pullback = jx.vjp(of_differentiable, *[arrays[i] for i in diff])
        # Note [Complex gradients]: torch's gradient is the conjugate of JAX's cotangent.
        cots = [
            jnp.conj(jnp.asarray(c, o.dtype)) if _inexact(o.dtype) else _float0_zeros(o.shape)
            for c, o in zip(cotangents, outs)
        ]
        return [jnp.conj(g) if jnp.iscomplexobj(g) else g for g in pullback(cots)]

    def _user_vjp(self, spec_id, arrays, cotangents, numbers, diff) -> list:
        jx = jax()
        spec, args, kwargs = self._arguments(spec_id, arrays, numbers)
        _, out_tree = self.abstract(spec_id, _avals(arrays), numbers)
        grad_out = jx.tree_util.tree_unflatten(out_tree, list(cotangents))
        grads = self.backward(grad_out, *args, **kwargs)
        if not isinstance(grads, tuple):
            grads = (grads,)
        structure = jx.tree_util.tree_structure(tuple(args))
        try:
            flat = structure.flatten_up_to(grads)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"the backward of jax_op {self.qualname} must return one gradient per "
                f"positional argument, shaped as the arguments: {exc}"
            ) from None
        by_tensor = {}
        for (kind, payload), g in zip(spec.leaves[: spec.n_positional], flat):
            if kind == "t" and g is not None:
                by_tensor[payload] = g
        out = []
        for i in diff:
            a = arrays[i]
            g = by_tensor.get(i)
            g = jx.numpy.zeros(a.shape, a.dtype) if g is None else jx.numpy.asarray(g, a.dtype)
            out.append(jx.numpy.broadcast_to(g, a.shape))
        return out

    # -- shapes: jax.eval_shape, once per signature ---------------------------------------

    def abstract(self, spec_id: str, avals: tuple, numbers):
        """``(output ShapeDtypeStructs, output tree)`` for inputs of these shapes."""
        key = (spec_id, avals, tuple(type(n) for n in numbers))
        known = self._abstract.get(key)
        if known is None:
            jx = jax()
            structs = [jx.ShapeDtypeStruct(s, d) for s, d in avals]
            trees = []

            def shaped(arrays, nums):
                leaves, tree = self._call(spec_id, arrays, nums)
                trees.append(tree)
                return leaves

            try:
                outs = jx.eval_shape(shaped, structs, [type(n)(0) for n in numbers])
            except Exception as exc:
                raise self.error(exc) from None
            known = self._abstract[key] = (outs, trees[0])
        return known

    def error(self, exc: Exception) -> Exception:
        """``exc`` (raised by the function while JAX traced it) naming the function, where
        it is defined and the user's line that called it; same type."""
        message = (
            f"jax_op {self.qualname} (defined at {self.defined_at}) failed for its "
            f"arguments, called from {user_frame()}: {exc}"
        )
        try:
            new = type(exc)(message)
        except Exception:
            new = TypeError(message)
        return new.with_traceback(exc.__traceback__)

    def cpu(self, key: str, spec_id: str):
        """A jitted function of the flat lists, run on JAX's CPU backend (CPU tensors)."""
        fn = self._cpu.get((key, spec_id))
        if fn is None:
            method = self.forward if key == "forward" else self.vjp
            fn = self._cpu[(key, spec_id)] = jax().jit(functools.partial(method, spec_id))
        return fn


# -- registration ---------------------------------------------------------------------------


_TAKEN: set[str] = set()
_counter = itertools.count(1)


def _op_name(fn, name: str | None) -> str:
    if name is not None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or name.endswith("_vjp"):
            raise ValueError(f"jax_op: name {name!r} is not an identifier (or ends in _vjp)")
        if name in _TAKEN:
            raise RuntimeError(f"jax_op: torch.ops.{NAMESPACE}.{name} is defined already")
        return name
    base = re.sub(r"\W", "_", getattr(fn, "__name__", "fn")) or "fn"
    if base == "<lambda>" or not base[0].isalpha():
        base = "fn_" + base.strip("_<>")
    candidate = base
    while candidate in _TAKEN:  # a function of the same name (a notebook cell re-run)
        candidate = f"{base}_{next(_counter)}"
    return candidate


def _define(function: JaxFunction, name: str | None):
    global _library
    if _library is None:
        _library = torch.library.Library(NAMESPACE, "DEF")
    op_name = _op_name(function.fn, name)
    _TAKEN.add(op_name)
    vjp_name = f"{op_name}_vjp"
    _library.define(f"{op_name}(Tensor[] tensors, Scalar[] numbers, str spec) -> Tensor[]")
    _library.define(
        f"{vjp_name}(Tensor[] tensors, Tensor[] cotangents, Scalar[] numbers, str spec) -> Tensor[]"
    )
    qualified, vjp_qualified = f"{NAMESPACE}::{op_name}", f"{NAMESPACE}::{vjp_name}"
    op = getattr(torch.ops, NAMESPACE).__getattr__(op_name).default
    vjp_op = getattr(torch.ops, NAMESPACE).__getattr__(vjp_name).default

    # The fake kernels: shapes from jax.eval_shape (errors raised here name the function).
    def fake(tensors, numbers, spec):
        outs, _ = function.abstract(spec, _avals(tensors), numbers)
        return [_empty_like(tensors, o) for o in outs]

    def vjp_fake(tensors, cotangents, numbers, spec):
        return [t.new_empty(t.shape) for t in tensors if _inexact_torch(t.dtype)]

    torch.library.register_fake(qualified, fake, lib=_library)
    torch.library.register_fake(vjp_qualified, vjp_fake, lib=_library)

    # CPU tensors: the same function on JAX's CPU backend.
    def cpu(tensors, numbers, spec):
        _check_shapes(function, tensors, numbers, spec)
        outs = function.cpu("forward", spec)(_cpu_arrays(tensors), list(numbers))
        return [torch.from_dlpack(o) for o in outs]

    def vjp_cpu(tensors, cotangents, numbers, spec):
        fn = function.cpu("vjp", spec)
        outs = fn(_cpu_arrays(tensors), _cpu_arrays(cotangents), list(numbers))
        return [torch.from_dlpack(o) for o in outs]

    _library.impl(op_name, cpu, "CPU")
    _library.impl(vjp_name, vjp_cpu, "CPU")

    # tpu tensors: lowerings in the one op table; the dispatcher does the rest.
    # Note [Matmul precision in JAX functions]: a product in the function is torch's.
    @lowers(op, precision=True)
    def forward(tensors, numbers, spec, *, precision):
        with jax().default_matmul_precision(precision.name.lower()):
            return function.forward(spec, tensors, numbers)

    @lowers(vjp_op, precision=True)
    def vjp(tensors, cotangents, numbers, spec, *, precision):
        with jax().default_matmul_precision(precision.name.lower()):
            return function.vjp(spec, tensors, cotangents, numbers)

    forward.__name__ = forward.__qualname__ = op_name
    vjp.__name__ = vjp.__qualname__ = vjp_name

    torch.library.register_autograd(
        qualified, _backward(vjp_op), setup_context=_setup_context, lib=_library
    )
    return op, vjp_op


def _setup_context(ctx, inputs, output):
    tensors, numbers, spec = inputs
    ctx.save_for_backward(*tensors)
    ctx.numbers, ctx.spec = list(numbers), spec
    ctx.shapes = [(o.shape, o.dtype, o.device) for o in output]


def _backward(vjp_op):
    def backward(ctx, grads):
        tensors = list(ctx.saved_tensors)
        cotangents = [
            torch.zeros(shape, dtype=dtype, device=device) if g is None else g
            for g, (shape, dtype, device) in zip(grads, ctx.shapes)
        ]
        computed = iter(vjp_op(tensors, cotangents, ctx.numbers, ctx.spec))
        tensor_grads = [next(computed) if _inexact_torch(t.dtype) else None for t in tensors]
        # torch's check of the structure takes an empty Scalar[] for a list, a full one
        # for a leaf.
        return tensor_grads, (None if ctx.numbers else []), None

    return backward


def _allow_in_compiled_graphs(function: Callable) -> None:
    """torch.compile: the call is one node of Dynamo's graph, which AOTAutograd traces
    into the custom ops (Dynamo must not trace JAX's pytree code). Marked now if Dynamo
    is loaded, else by `mark_for_dynamo` when compile/backend.py loads (importing
    Dynamo here would cost seconds)."""
    _FUNCTIONS.append(function)
    if "torch._dynamo" in sys.modules:
        _mark(function)


_FUNCTIONS: list[Callable] = []


def mark_for_dynamo() -> None:
    """Mark every function ``jax_op`` made so far (compile/backend.py calls this)."""
    for function in _FUNCTIONS:
        _mark(function)


def _mark(function: Callable) -> None:
    """What ``torch._dynamo.nonstrict_trace`` does to the function it makes, done to
    ``function`` itself (the user already holds it): an opaque call in Dynamo's graph
    whose inputs and outputs may be any pytree (``allow_in_graph`` takes tensors and
    tuples of them only, not a dict)."""
    from torch._dynamo import trace_rules

    nonstrict = getattr(trace_rules, "_nonstrict_trace_callable_ids", None)
    if nonstrict is None:  # a torch without nonstrict_trace: tensor outputs only
        torch._dynamo.allow_in_graph(function)
        return
    trace_rules._allowed_callable_ids.add(id(function))
    nonstrict.add(id(function))


# -- helpers -------------------------------------------------------------------------------


def _static(function: JaxFunction, pname: str, leaf):
    """A static leaf as a key element: 1, 1.0 and True differ (Note [Static and traced
    numbers]), as in the dispatcher's keys."""
    value = hashable(leaf) if type(leaf) in _NUMBERS else leaf
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"jax_op {function.qualname}: argument {pname!r} holds a {type(leaf).__name__}, "
            "which is neither a tensor, a number nor hashable (static values must be hashable)"
        ) from None
    return value


def _avals(tensors) -> tuple:
    """Shapes and jax dtypes of tensors (or of jax arrays)."""
    out = []
    for t in tensors:
        dtype = dtypes.to_jax(t.dtype) if isinstance(t.dtype, torch.dtype) else t.dtype
        out.append((tuple(int(d) for d in t.shape), dtype))
    return tuple(out)


def _empty_like(tensors, struct) -> torch.Tensor:
    return tensors[0].new_empty(tuple(struct.shape), dtype=dtypes.to_torch(struct.dtype))


def _inexact(dtype) -> bool:
    jnp = jax().numpy
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _inexact_torch(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _float0_zeros(shape):
    import numpy as np

    return np.zeros(shape, dtype=jax().dtypes.float0)


def _cpu_arrays(tensors) -> list:
    return [jax().dlpack.from_dlpack(t.detach().contiguous()) for t in tensors]


def _check_shapes(function: JaxFunction, tensors, numbers, spec) -> None:
    function.abstract(spec, _avals(tensors), numbers)
