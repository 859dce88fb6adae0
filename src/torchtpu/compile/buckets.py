"""A graph with dynamic sizes, compiled once per bucket of sizes instead of once per size.

Note [Shape buckets]
    XLA's programs have static shapes, so a graph Dynamo traced with symbolic sizes
    (``torch.compile(..., dynamic=True)``, ``torch._dynamo.mark_dynamic`` or
    `torchtpu.mark_dynamic`, or Dynamo's automatic dynamic shapes after a second size)
    compiled one program per concrete size: a text loop over 20 prompt lengths, 20
    programs. Here an inference graph runs *padded*: each size symbol that is a dim of
    an input tensor takes the next bucket (a power of two, at least
    ``config.shape_bucket_min``, at most the symbol's upper bound), the inputs are padded
    with zeros to it, and the true size enters the program as a traced integer. One
    program per bucket then serves every size in it.

    Padding changes values only where elements of a padded dim are *combined*. So the
    graph is checked, before it compiles, node by node, for where each of its tensors'
    dims is padded (`_Dim`: a dim is a row-major product of factors, each a static size
    or a size linear in one symbol, whose first ``a*n + c`` positions hold the values and
    the rest garbage -- a ``view`` of [b, s, d] as [b*s, d] interleaves them), and what
    each op needs:
    - ops that treat elements independently along a padded dim (pointwise ops, views,
      products over other dims, layer norm over static dims, causal attention over one
      padded length) need nothing: the garbage stays in the padding;
    - ops that combine along one (reductions, softmax, the contracted dim of a product,
      attention's keys) see the padding masked with their identity (0 for a sum, -inf
      for a max or a softmax, False for ``any``); a mean divides by the true count;
    - indices read from a padded tensor (an embedding's) are masked to 0, so that the
      garbage never indexes out of range; ``x[:, -1]`` on a padded dim reads position
      n-1, not the padding's last;
    - a size used as a value (``x / x.shape[1]``), an op this table does not know
      that touches a padded dim, an output whose padded dim is a product of factors,
      refuse the whole graph: it compiles per size, as before, with one warning that
      names the op.
    Outputs are sliced back to their true sizes. The padding of inputs and the slicing
    of outputs are single-op programs that compile per size (cheap next to a model's
    program); ``torchtpu.metrics()["compiles"]["padding"]`` counts them.

    Only inference graphs (no autograd: under ``torch.no_grad()`` or for inputs and
    parameters that need no gradient) are bucketed: a training graph's saved
    activations would cross from the forward program to the backward one padded.
"""

from __future__ import annotations

import functools
import math
import operator
import warnings
from typing import NamedTuple

import numpy as np
import sympy
import torch

from torchtpu import config
from torchtpu.compile.program import Program, flatten_values, tensor_of, unflatten_values
from torchtpu.observe import metrics, perf_warnings
from torchtpu.ops.attention import attention_op
from torchtpu.runtime import jax

aten = torch.ops.aten


class _Dyn(NamedTuple):
    """A factor of padded size ``a*B + c`` holding ``a*n + c`` values, B the bucket and n
    the true size of ``symbol``."""

    symbol: sympy.Symbol
    a: int
    c: int

    def padded(self, buckets: dict) -> int:
        return self.a * buckets[self.symbol] + self.c


# A dim: its factors, outermost first; a static factor is an int.
_Dim = tuple


class Refused(Exception):
    """The graph cannot run padded; the message says which op and why."""


def _static(dim: _Dim) -> bool:
    return all(type(f) is int for f in dim)


def _padded(structure) -> bool:
    """Whether a tensor's dims (a tuple of _Dim) have any padded factor."""
    return structure is not None and not all(_static(d) for d in structure)


class Plan:
    """What running a graph padded takes: the symbols bucketed, where their true sizes
    are read, and the nodes that need something done (`_Action`)."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs):
        self.gm = gm
        self.symbols: dict = {}  # symbol -> (input position, dim) holding its size
        self.upper: dict = {}  # symbol -> its largest size, where Dynamo knows one
        self.structures: dict = {}  # node -> structure of its value
        self.actions: dict = {}  # node -> _Action
        self.sizes: list = []  # (position, expression) of each size input
        self._same: dict = {}  # symbol -> the symbol of the same size the graph's tensors use
        self.inputs: list = []  # per input: its dims (tensors) or None
        self.outputs: list = []  # per output value: its dims (tensors) or None
        self._find_symbols(example_inputs)
        if not self.symbols:
            return
        for node in gm.graph.nodes:
            self._plan(node)
        self._check_sizes_used_as_sizes()

    # -- symbols -----------------------------------------------------------------

    def _find_symbols(self, example_inputs) -> None:
        shape_env = None
        for i, value in enumerate(example_inputs):
            if isinstance(value, torch.Tensor):
                for d, size in enumerate(value.shape):
                    if isinstance(size, torch.SymInt):
                        expr, shape_env = size.node.expr, size.node.shape_env
                        if isinstance(expr, sympy.Symbol) and expr not in self.symbols:
                            self.symbols[expr] = (i, d)
                            upper = shape_env.var_to_range[expr].upper
                            if upper.is_Integer:
                                self.upper[expr] = int(upper)
        if shape_env is not None:
            self._same = _wrapper_sizes(shape_env)

    def _expr(self, size) -> sympy.Expr:
        """A symbolic size in the symbols of the graph's tensors."""
        return sympy.expand(size.node.expr.xreplace(self._same))

    def _function(self, expr: sympy.Expr):
        """``expr`` as a function of a dict of the symbols' values (sympy's own ``subs``
        would cost ~0.15 ms a size on each call)."""
        symbols = tuple(self.symbols)
        f = sympy.lambdify(symbols, expr, modules="math")
        return lambda values: int(f(*(values[s] for s in symbols)))

    def _dim(self, size, op) -> _Dim:
        """The single factor of a size as torch's metadata gives it."""
        if type(size) is int:
            return (size,)
        expr = self._expr(size)
        if expr.is_Integer:
            return (int(expr),)
        if len(expr.free_symbols) == 1:
            (symbol,) = expr.free_symbols
            if symbol in self.symbols:
                a, c = expr.coeff(symbol), expr.subs(symbol, 0)
                if (
                    a.is_Integer
                    and c.is_Integer
                    and a > 0
                    and sympy.expand(a * symbol + c - expr) == 0
                ):
                    return (_Dyn(symbol, int(a), int(c)),)
        raise Refused(f"{op}: a size {expr} that is not linear in one dynamic size")

    def _dims(self, value, op) -> tuple:
        return tuple(self._dim(s, op) for s in value.shape)

    # -- nodes -------------------------------------------------------------------

    def _structure(self, arg):
        if isinstance(arg, torch.fx.Node):
            return self.structures.get(arg)
        if isinstance(arg, (list, tuple)):
            return [self._structure(a) for a in arg]
        return None

    def _plan(self, node: torch.fx.Node) -> None:
        value = node.meta.get("val")
        if node.op == "placeholder":
            if isinstance(value, torch.Tensor):
                dims = self._dims(value, "an input")
                self.structures[node] = dims
                self.inputs.append(dims)
            else:
                if isinstance(value, torch.SymInt) and not value.node.expr.is_Integer:
                    expr = self._expr(value)
                    if not expr.free_symbols <= set(self.symbols):
                        raise Refused(f"a size input {expr} that is no input tensor's size")
                    self.sizes.append((len(self.inputs), self._function(expr)))  # given padded
                self.inputs.append(None)
            return
        if node.op == "output":
            for arg in node.args[0]:
                size = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
                if isinstance(size, torch.SymInt):
                    # a size or stride of an output, for AOTAutograd's wrapper: the true one
                    self.outputs.append(self._function(self._expr(size)))
                    continue
                s = self._structure(arg)
                if isinstance(s, tuple) and any(len(d) > 1 and not _static(d) for d in s):
                    raise Refused("an output whose padded dim is a product of sizes")
                self.outputs.append(s if isinstance(s, tuple) else None)
            return
        if node.op == "get_attr":
            attr = getattr(self.gm, node.target)
            if isinstance(attr, torch.Tensor):
                self.structures[node] = tuple((n,) for n in attr.shape)
            return
        if node.op != "call_function":
            raise Refused(f"a {node.op} node")
        if node.target is operator.getitem:
            parent = self._structure(node.args[0])
            if isinstance(parent, list):
                self.structures[node] = parent[node.args[1]]
            elif isinstance(value, torch.Tensor):
                raise Refused(f"a tensor taken from {node.args[0].target}'s results")
            return
        if not isinstance(value, (torch.Tensor, list, tuple)):
            return  # a size computed from sizes: its uses are checked later
        op = node.target
        ins = [self._structure(a) for a in node.args]
        padded_in = any(_padded(s) for s in _tensor_structures(ins))
        rule = _RULES.get(op)
        if rule is None and _pointwise(op):
            rule = _pointwise_rule
        if rule is None:
            if padded_in:
                raise Refused(f"{op} on a padded dim")
            out = _static_structure(self, value, op)
            if any(_padded(s) for s in _tensor_structures([out])):
                raise Refused(f"{op} makes a tensor of a dynamic size")
            self.structures[node] = out
            return
        out = rule(self, node, ins, value)
        self.structures[node] = out

    def _check_sizes_used_as_sizes(self) -> None:
        """A size (a symbol, or arithmetic of sizes) may shape tensors; used as a value
        it would be the padded size, not the true one."""
        for node in self.gm.graph.nodes:
            value = node.meta.get("val")
            if not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                continue
            if not (value.node.expr.xreplace(self._same).free_symbols & set(self.symbols)):
                continue
            for user in node.users:
                if user.op == "output":
                    if not isinstance(value, torch.SymInt):
                        raise Refused("the graph returns a dynamic value")
                    continue  # returned as the true size (Bucketed)
                target = user.target
                if user.op != "call_function":
                    raise Refused(f"a dynamic size used by a {user.op} node")
                if not isinstance(target, torch._ops.OpOverload):
                    if getattr(target, "__module__", None) in _ARITHMETIC:
                        continue  # arithmetic of sizes: its own uses are checked
                    raise Refused(f"a dynamic size given to {target}")
                for name in _argument_names(user, node):
                    if (target, name) not in _SIZE_ARGUMENTS and name not in _SIZES:
                        raise Refused(f"{target}: a dynamic size as its {name!r}")


def _wrapper_sizes(shape_env) -> dict:
    """Dynamo gives a TPUTensor's sizes symbols of their own, apart from those of the
    handle it wraps (its ``_handle``, the tensor the graph computes on), and where
    ``mark_dynamic`` keeps Dynamo from sharing a symbol between equal sizes of two
    inputs, nothing says they are equal but their sources: ``L['x'].size()[1]`` is
    ``L['x']._handle.size()[1]``. Each wrapper's symbol -> its handle's."""
    by_source = {}
    for symbol, sources in shape_env.var_to_sources.items():
        for source in sources:
            name = source.name() if callable(source.name) else source.name
            by_source[name] = symbol
    same = {}
    for name, symbol in by_source.items():
        inner = by_source.get(name.replace(".size()", "._handle.size()", 1))
        if ".size()" in name and "._handle." not in name and inner is not None:
            same[symbol] = shape_env.replacements.get(inner, inner)
    return same


def _argument_names(user: torch.fx.Node, node: torch.fx.Node) -> list:
    schema = user.target._schema
    names = []
    for i, arg in enumerate(user.args):
        if arg is node or (isinstance(arg, (list, tuple)) and node in arg):
            names.append(schema.arguments[i].name)
    names += [
        k
        for k, v in user.kwargs.items()
        if v is node or (isinstance(v, (list, tuple)) and node in v)
    ]
    return names


_SIZES = ("size", "sizes", "shape", "stride")  # shaping or laying out tensors
# Modules of the functions the graph computes sizes with (operator.mul, math.floor,
# torch.sym_max, ...)
_ARITHMETIC = ("_operator", "operator", "math", "builtins", "torch")
_SIZE_ARGUMENTS = {
    (aten.slice.Tensor, "end"),
    (aten.arange.default, "end"),
    (aten.arange.start, "end"),
    (aten.arange.start_step, "end"),
}


def _tensor_structures(ins):
    for s in ins:
        if isinstance(s, tuple):
            yield s
        elif isinstance(s, list):
            yield from (t for t in s if isinstance(t, tuple))


def _static_structure(plan: Plan, value, op):
    if isinstance(value, torch.Tensor):
        return plan._dims(value, op)
    return [plan._dims(v, op) if isinstance(v, torch.Tensor) else None for v in value]


def _pointwise(op) -> bool:
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags


# -- rules: (plan, node, structures of the args, the node's fake value) -> structure --


def _broadcast(plan: Plan, node, structures, shape) -> tuple:
    """The dims of a result of ``shape`` broadcast from ``structures``: each padded dim
    must be padded alike in every input that has it (not broadcast from size 1)."""
    rank = len(shape)
    dims = []
    for d in range(rank):
        found = None
        for s in structures:
            k = d - (rank - len(s))
            if k < 0 or s[k] == (1,):
                continue
            if found is None:
                found = s[k]
            elif found != s[k]:
                raise Refused(f"{node.target}: inputs padded differently")
        dims.append(found if found is not None else plan._dim(shape[d], node.target))
    return tuple(dims)


def _pointwise_rule(plan, node, ins, value):
    structures = list(_tensor_structures(ins))
    divisor = ins[1] if len(ins) > 1 else None
    if node.target in _INTEGER_DIVISIONS and _padded(divisor) and not value.dtype.is_floating_point:
        # Integer division by a padded 0 would raise: the padding divides by 1.
        plan.actions[node] = _Action("mask", ((1, _all_dims, "one"),))
    return _broadcast(plan, node, structures, value.shape)


def _same(plan, node, ins, value):
    return ins[0]


def _regroup(plan, node, ins, value):
    """A view or reshape: the input's factors regrouped into the output's dims."""
    factors = [f for d in ins[0] for f in d if f != 1]
    factors.reverse()  # a stack: outermost last
    out = []
    for size in value.shape:
        target = sympy.Integer(size) if type(size) is int else plan._expr(size)
        dim, product = [], sympy.Integer(1)
        while sympy.expand(product - target) != 0:
            if not factors:
                raise Refused(f"{node.target}: a padded dim split")
            f = factors.pop()
            need = sympy.simplify(target / product)
            if type(f) is int and need.is_Integer and f > need and f % int(need) == 0:
                factors.append(f // int(need))  # a static factor split in two
                f = int(need)
            dim.append(f)
            product = product * (f if type(f) is int else f.a * f.symbol + f.c)
        out.append(tuple(dim) if dim else (1,))
    if factors:
        raise Refused(f"{node.target}: factors left over")
    return tuple(out)


def _permute(plan, node, ins, value):
    order = [d % len(ins[0]) for d in node.args[1]]
    return tuple(ins[0][d] for d in order)


def _transpose(plan, node, ins, value):
    dims = list(ins[0])
    if node.target is aten.t.default:
        return tuple(reversed(dims))
    a, b = node.args[1] % len(dims), node.args[2] % len(dims)
    dims[a], dims[b] = dims[b], dims[a]
    return tuple(dims)


def _unsqueeze(plan, node, ins, value):
    dims = list(ins[0])
    dims.insert(node.args[1] % (len(dims) + 1), (1,))
    return tuple(dims)


def _squeeze(plan, node, ins, value):
    source = node.args[0].meta["val"]
    if len(node.args) > 1:
        asked = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        asked = {d % max(source.dim(), 1) for d in asked}
    else:
        asked = set(range(source.dim()))
    return tuple(d for i, d in enumerate(ins[0]) if not (i in asked and d == (1,)))


def _expand(plan, node, ins, value):
    rank = value.dim()
    source = ins[0]
    dims = []
    for d in range(rank):
        k = d - (rank - len(source))
        if k >= 0 and source[k] != (1,):
            dims.append(source[k])
        else:
            dims.append(plan._dim(value.shape[d], node.target))
    return tuple(dims)


def _slice(plan, node, ins, value):
    source = ins[0]
    dim = _argument(node, 1, "dim", 0) % len(source)
    start, step = _argument(node, 2, "start"), _argument(node, 4, "step", 1)
    dims = list(source)
    if _static(source[dim]):
        dims[dim] = plan._dim(value.shape[dim], node.target)
        return tuple(dims)
    if len(source[dim]) > 1 or step != 1 or isinstance(start, torch.fx.Node):
        raise Refused(f"{node.target}: a slice of a padded dim from its end or by steps")
    if start is not None and start < 0:
        raise Refused(f"{node.target}: a slice of a padded dim from its end")
    dims[dim] = plan._dim(value.shape[dim], node.target)
    return tuple(dims)


def _select(plan, node, ins, value):
    source = ins[0]
    dim, index = node.args[1] % len(source), node.args[2]
    if not _static(source[dim]):
        if len(source[dim]) > 1 or isinstance(index, torch.fx.Node):
            raise Refused(f"{node.target}: an index into a padded dim")
        if index < 0:
            plan.actions[node] = _Action("from_end", (dim, index, source[dim][0]))
    return tuple(d for i, d in enumerate(source) if i != dim)


def _split(plan, node, ins, value):
    source = ins[0]
    dim = _argument(node, 2, "dim", 0) % len(source)
    if not _static(source[dim]):
        raise Refused(f"{node.target}: a split of a padded dim")
    out = []
    for v in value:
        dims = list(source)
        dims[dim] = plan._dim(v.shape[dim], node.target)
        out.append(tuple(dims))
    return out


def _cat(plan, node, ins, value):
    # empty tensors add nothing (a cache's first step joins its keys to an empty one)
    structures = [
        s
        for s, t in zip(ins[0], node.args[0])
        if s is not None and len(s) == value.dim() and (0,) not in s
    ]
    if len(structures) == 1:
        return structures[0]
    dim = _argument(node, 1, "dim", 0) % value.dim()
    if not all(_static(s[dim]) for s in structures):
        raise Refused(f"{node.target}: a padded dim joined")
    others = [tuple((1,) if i == dim else d for i, d in enumerate(s)) for s in structures]
    dims = list(_broadcast(plan, node, others, value.shape))
    dims[dim] = plan._dim(value.shape[dim], node.target)
    return tuple(dims)


def _factory(plan, node, ins, value):
    return plan._dims(value, node.target)


def _arange(plan, node, ins, value):
    step = node.args[2] if node.target is aten.arange.start_step else 1
    if step != 1:
        raise Refused(f"{node.target}: a dynamic range by steps")
    return plan._dims(value, node.target)


# Reductions: op -> (the identity its padding is masked with, position of the dims
# argument or None for all dims, position of keepdim or None; either may be passed by
# name instead)
_REDUCTIONS = {
    aten.sum.dim_IntList: ("zero", 1, 2),
    aten.sum.default: ("zero", None, None),
    aten.mean.dim: ("zero", 1, 2),
    aten.mean.default: ("zero", None, None),
    aten.prod.dim_int: ("one", 1, 2),
    aten.prod.default: ("one", None, None),
    aten.amax.default: ("lowest", 1, 2),
    aten.amin.default: ("highest", 1, 2),
    aten.max.dim: ("lowest", 1, 2),
    aten.min.dim: ("highest", 1, 2),
    aten.max.default: ("lowest", None, None),
    aten.min.default: ("highest", None, None),
    aten.argmax.default: ("lowest", 1, 2),
    aten.argmin.default: ("highest", 1, 2),
    aten.any.dim: ("false", 1, 2),
    aten.any.dims: ("false", 1, 2),
    aten.any.default: ("false", None, None),
    aten.all.dim: ("true", 1, 2),
    aten.all.dims: ("true", 1, 2),
    aten.all.default: ("true", None, None),
    aten.logsumexp.default: ("lowest", 1, 2),
    # over static dims only (`_reduction` refuses a padded one: no identity masks it)
    aten.var.correction: (None, 1, 3),
    aten.std.correction: (None, 1, 3),
    aten.var_mean.correction: (None, 1, 3),
}
_INDEX_RESULTS = (aten.argmax.default, aten.argmin.default, aten.max.dim, aten.min.dim)


def _argument(node, position, name: str, default=None):
    if position is None:
        return default
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _reduced_dims(node, rank: int, position) -> list:
    arg = _argument(node, position, "dim")
    if arg is None or arg == []:
        return list(range(rank))
    arg = arg if isinstance(arg, (list, tuple)) else [arg]
    return sorted({d % max(rank, 1) for d in arg})


def _reduction(plan, node, ins, value):
    identity, dims_at, keep_at = _REDUCTIONS[node.target]
    source = ins[0]
    reduced = _reduced_dims(node, len(source), dims_at)
    keepdim = bool(_argument(node, keep_at, "keepdim", False))
    masked = [d for d in reduced if not _static(source[d])]
    if masked and identity is None:
        raise Refused(f"{node.target} over a padded dim")
    if masked:
        if node.target in _INDEX_RESULTS and (
            len(reduced) != 1 or len(source[reduced[0]]) > 1 or dims_at is None
        ):
            raise Refused(f"{node.target}: an index into a padded dim of several sizes")
        kind = "mean" if node.target in (aten.mean.dim, aten.mean.default) else "mask"
        plan.actions[node] = _Action(kind, ((0, tuple(masked), identity),))
    dims = tuple(
        (1,) if i in reduced else d for i, d in enumerate(source) if keepdim or i not in reduced
    )
    if isinstance(value, (list, tuple)):
        return [dims] * len(value)
    return dims


def _softmax(plan, node, ins, value):
    source = ins[0]
    dim = node.args[1] % len(source)
    if not _static(source[dim]):
        plan.actions[node] = _Action("mask", ((0, (dim,), "lowest"),))
    return source


def _cumulative(plan, node, ins, value):
    source = ins[0]
    dim = node.args[1] % len(source)
    if len(source[dim]) > 1 and not _static(source[dim]):
        raise Refused(f"{node.target}: a running total over a padded dim of several sizes")
    return source


def _layer_norm(plan, node, ins, value):
    source = ins[0]
    k = len(node.args[1])
    if not all(_static(d) for d in source[len(source) - k :]):
        raise Refused(f"{node.target}: normalising over a padded dim")
    stats = source[: len(source) - k] + ((1,),) * k
    return [source, stats, stats]


def _embedding(plan, node, ins, value):
    weight, indices = ins[0], ins[1]
    if _padded(weight):
        raise Refused(f"{node.target}: a padded table")
    if _padded(indices):
        plan.actions[node] = _Action("mask", ((1, _all_dims, "zero"),))
    return indices + (weight[-1],)


def _index_select(plan, node, ins, value):
    source, dim, index = ins[0], node.args[1] % len(ins[0]), ins[2]
    if len(source[dim]) > 1 and not _static(source[dim]):
        raise Refused(f"{node.target}: an index into a padded dim of several sizes")
    if _padded(index):
        plan.actions[node] = _Action("mask", ((2, _all_dims, "zero"),))
    dims = list(source)
    dims[dim] = index[0]
    return tuple(dims)


def _index(plan, node, ins, value):
    """``x[i, j]`` with integer index tensors (None where a dim is taken whole): the
    indexed dims must hold their values first (a lone padded factor), and the indices'
    padding, which may be anything, is masked to 0."""
    source, indices = ins[0], ins[1]
    given = [i for i, index in enumerate(node.args[1]) if index is not None]
    if any(node.args[1][i].meta["val"].dtype in (torch.bool, torch.uint8) for i in given):
        raise Refused(f"{node.target}: a boolean mask")
    if any(len(source[i]) > 1 and not _static(source[i]) for i in given):
        raise Refused(f"{node.target}: an index into a padded dim of several sizes")
    structures = [indices[i] for i in given]
    shape = torch.broadcast_shapes(*(node.args[1][i].meta["val"].shape for i in given))
    broadcast = _broadcast(plan, node, structures, shape)
    if given == list(range(given[0], given[-1] + 1)):
        dims = source[: given[0]] + broadcast + source[given[-1] + 1 :]
    else:
        dims = broadcast + tuple(d for i, d in enumerate(source) if i not in given)
    padded = tuple(i for i in given if _padded(indices[i]))
    if padded:
        plan.actions[node] = _Action("indices", (padded,))
    return dims


def _contraction(plan, node, a: int, b: int, ins, batch: bool):
    """mm-like products of args ``a`` [.., m, k] and ``b`` [.., k, n]: a padded k is
    masked with 0 in both."""
    left, right = ins[a], ins[b]
    k = left[-1]
    if k != right[-2] and not (_static(k) and _static(right[-2])):
        raise Refused(f"{node.target}: operands padded differently")
    if batch and left[0] != right[0]:
        raise Refused(f"{node.target}: batches padded differently")
    if not _static(k):
        plan.actions[node] = _Action(
            "mask", ((a, (len(left) - 1,), "zero"), (b, (len(right) - 2,), "zero"))
        )
    return ((left[0],) if batch else ()) + (left[-2], right[-1])


def _mm(plan, node, ins, value):
    return _contraction(plan, node, 0, 1, ins, batch=False)


def _bmm(plan, node, ins, value):
    return _contraction(plan, node, 0, 1, ins, batch=True)


def _addmm(plan, node, ins, value):
    out = _contraction(plan, node, 1, 2, ins, batch=node.target is aten.baddbmm.default)
    return _broadcast(plan, node, [out, ins[0]], value.shape)


def _attention(plan, node, ins, value):
    query, key, val = ins[0], ins[1], ins[2]
    is_causal = node.args[4]
    keys = key[-2]
    if not _static(keys):
        same = query[-2] == keys and len(keys) == 1
        if is_causal and not same:
            raise Refused(f"{node.target}: causal attention between lengths padded differently")
        if not is_causal:  # the padded keys are masked out
            plan.actions[node] = _Action("keys", (keys,))
    elif _padded(ins[3]) and not _static(ins[3][-1]):
        raise Refused(f"{node.target}: a mask padded over keys that are not")
    return query[:-1] + (val[-1],)


_all_dims = "all"
_INTEGER_DIVISIONS = {
    aten.div.Tensor_mode,
    aten.floor_divide.default,
    aten.remainder.Tensor,
    aten.fmod.Tensor,
}

_RULES = {
    **dict.fromkeys(
        [
            aten.view.default,
            aten.reshape.default,
            aten._unsafe_view.default,
            aten.view_copy.default,
        ],
        _regroup,
    ),
    **dict.fromkeys(
        [
            aten.clone.default,
            aten._to_copy.default,
            aten.alias.default,
            aten.detach.default,
            aten.lift_fresh_copy.default,
            aten.contiguous.default,
            aten.full_like.default,
            aten.zeros_like.default,
            aten.ones_like.default,
            aten.empty_like.default,
            aten.copy.default,
            torch.ops.prims.convert_element_type.default,
        ],
        _same,
    ),
    aten.permute.default: _permute,
    aten.transpose.int: _transpose,
    aten.t.default: _transpose,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.default: _squeeze,
    aten.squeeze.dim: _squeeze,
    aten.squeeze.dims: _squeeze,
    aten.expand.default: _expand,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.cat.default: _cat,
    **dict.fromkeys(
        [
            aten.full.default,
            aten.zeros.default,
            aten.ones.default,
            aten.empty.memory_format,
            aten.scalar_tensor.default,
            aten.new_zeros.default,
            aten.new_ones.default,
            aten.new_empty.default,
            aten.new_full.default,
        ],
        _factory,
    ),
    aten.arange.default: _arange,
    aten.arange.start: _arange,
    aten.arange.start_step: _arange,
    **dict.fromkeys(_REDUCTIONS, _reduction),
    aten._softmax.default: _softmax,
    aten._log_softmax.default: _softmax,
    aten.cumsum.default: _cumulative,
    aten.native_layer_norm.default: _layer_norm,
    aten.embedding.default: _embedding,
    aten.index_select.default: _index_select,
    aten.index.Tensor: _index,
    aten.mm.default: _mm,
    aten.bmm.default: _bmm,
    aten.addmm.default: _addmm,
    aten.baddbmm.default: _addmm,
    attention_op: _attention,
}
for _op in (aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor, *_INTEGER_DIVISIONS):
    _RULES[_op] = _pointwise_rule  # elementwise, though not all tagged so


# -- running padded --------------------------------------------------------------


class _Action(NamedTuple):
    kind: str  # "mask", "mean", "from_end", "keys"
    what: tuple


class _Padded(torch.fx.Interpreter):
    """Runs the graph on padded tensors (in a trace), doing each node's `_Action`."""

    def __init__(self, plan: Plan, buckets: dict, lengths: dict):
        super().__init__(plan.gm)
        self.plan, self.buckets, self.lengths = plan, buckets, lengths

    def run_node(self, n):
        action = self.plan.actions.get(n)
        if action is None:
            return super().run_node(n)
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return getattr(self, "_" + action.kind)(n, list(args), kwargs, *action.what)

    # -- masks ----------------------------------------------------------------

    def _length(self, factor: _Dyn):
        return self.lengths[factor.symbol] * factor.a + factor.c

    def _valid(self, dim: _Dim, size: int, device):
        """Which of a padded dim's ``size`` positions hold values: a bool [size]."""
        position = torch.arange(size, device=device)
        valid, inner = None, size
        for i, factor in enumerate(dim):
            extent = factor if type(factor) is int else factor.padded(self.buckets)
            inner //= extent
            if type(factor) is int:
                continue
            index = position // inner if inner > 1 else position
            if i > 0:
                index = index % extent
            v = index < self._length(factor)
            valid = v if valid is None else valid & v
        return valid

    def _masked(self, x, structure, dims, identity):
        if dims == _all_dims:
            dims = range(len(structure))
        keep = None
        for d in dims:
            if _static(structure[d]):
                continue
            v = self._valid(structure[d], x.shape[d], x.device)
            v = v.reshape([-1 if i == d else 1 for i in range(x.dim())])
            keep = v if keep is None else keep & v
        if keep is None:
            return x
        return x.masked_fill(~keep, _identity(identity, x.dtype))

    def _mask(self, n, args, kwargs, *masks):
        for position, dims, identity in masks:
            structure = self.plan._structure(n.args[position])
            args[position] = self._masked(args[position], structure, dims, identity)
        return n.target(*args, **kwargs)

    def _mean(self, n, args, kwargs, mask):
        position, dims, identity = mask
        structure = self.plan._structure(n.args[0])
        x = self._masked(args[0], structure, dims, identity)
        reduced = _reduced_dims(n, x.dim(), 1 if n.target is aten.mean.dim else None)
        keepdim = bool(_argument(n, 2 if n.target is aten.mean.dim else None, "keepdim", False))
        result = n.meta["val"].dtype
        # accumulated as torch's mean does: low precision floats in float32
        wide = torch.float32 if result in (torch.bfloat16, torch.float16) else result
        total = torch.sum(x, reduced, keepdim=keepdim, dtype=wide)
        count = 1
        for d in reduced:
            for factor in structure[d]:
                count = count * (factor if type(factor) is int else self._length(factor))
        return (total / count).to(result)

    def _indices(self, n, args, kwargs, padded):
        indices = list(args[1])
        for i in padded:
            structure = self.plan._structure(n.args[1][i])
            indices[i] = self._masked(indices[i], structure, _all_dims, "zero")
        args[1] = indices
        return n.target(*args, **kwargs)

    def _from_end(self, n, args, kwargs, dim, index, factor):
        x = args[0]
        position = (self._length(factor) + index).reshape(1)
        return torch.index_select(x, dim, position).squeeze(dim)

    def _keys(self, n, args, kwargs, keys):
        key = args[1]
        valid = self._valid(keys, key.shape[-2], key.device)
        mask = args[3]
        if mask is None:
            args[3] = valid
        elif mask.dtype == torch.bool:
            args[3] = mask & valid
        else:
            args[3] = mask.masked_fill(~valid, -math.inf)
        return n.target(*args, **kwargs)


def _identity(kind: str, dtype: torch.dtype):
    """The value that padding is masked with so that ``kind`` of reduction ignores it."""
    if dtype is torch.bool:
        return kind in ("one", "true", "highest")
    if kind in ("zero", "false"):
        return 0
    if kind in ("one", "true"):
        return 1
    floating = dtype.is_floating_point or dtype.is_complex
    if kind == "lowest":
        return -math.inf if floating else torch.iinfo(dtype).min
    return math.inf if floating else torch.iinfo(dtype).max


def bucket(n: int, upper: int | None) -> int:
    """The padded size of a dynamic dim of ``n``: the next power of two, at least
    ``config.shape_bucket_min``, at most ``upper``."""
    size = max(n, config.shape_bucket_min)
    size = 1 << (size - 1).bit_length()
    return max(n, min(size, upper)) if upper is not None else size


class Bucketed:
    """An inference graph's compiled function that runs it padded to its buckets."""

    def __init__(self, plan: Plan, options=None):
        self.plan = plan
        self._program = Program(self._trace, "graph", options=options)

    def _trace(self, static, arrays):
        graph_static, sizes = static
        n_inputs = sum(isinstance(s, torch.dtype) for s in graph_static)
        values = unflatten_values(graph_static, arrays[:n_inputs])
        lengths = {
            symbol: tensor_of(a, torch.int32)
            for symbol, a in zip(self.plan.symbols, arrays[n_inputs:])
        }
        buckets = dict(zip(self.plan.symbols, sizes))
        out = _Padded(self.plan, buckets, lengths).run(*values)
        return flatten_values(out)

    def __call__(self, static: list, arrays: list, shapes: list):
        """``static`` and ``arrays`` as backend.py's run makes them; ``shapes``: each
        input's shape (None for sizes)."""
        sizes = {s: shapes[i][d] for s, (i, d) in self.plan.symbols.items()}
        buckets = {s: bucket(n, self.plan.upper.get(s)) for s, n in sizes.items()}
        static = list(static)
        for position, size in self.plan.sizes:
            static[position] = size(buckets)
        arrays = list(arrays)  # one per tensor input
        targets = [
            tuple(d[0] if type(d[0]) is int else d[0].padded(buckets) for d in dims)
            for dims in self.plan.inputs
            if dims is not None
        ]
        _resize(arrays, range(len(targets)), targets, "pad")
        # committed to the inputs' device, as every array torchtpu makes (builder.py)
        device = next(iter(arrays[0].sharding.device_set)) if arrays else None
        lengths = [jax().device_put(np.int32(sizes[s]), device) for s in self.plan.symbols]
        key = (tuple(static), tuple(buckets[s] for s in self.plan.symbols))
        outputs, layout = self._program(key, arrays + lengths)
        outputs, true_layout, padded, targets = list(outputs), [], [], []
        k = 0
        for spec, dims in zip(layout, self.plan.outputs):
            if callable(dims):  # a size the layout holds padded
                spec = dims(sizes)
            true_layout.append(spec)
            if not isinstance(spec, torch.dtype):
                continue
            if dims is not None and _padded(dims):
                padded.append(k)
                targets.append(
                    tuple(
                        d[0] if _static(d) else d[0].a * sizes[d[0].symbol] + d[0].c for d in dims
                    )
                )
            k += 1
        _resize(outputs, padded, targets, "slice")
        return outputs, tuple(true_layout)


def _resize(arrays: list, positions: list, targets: list, how: str) -> None:
    """Pad (or slice) ``arrays[i]`` to ``targets`` for each i in ``positions``, in place,
    by one program for all of them, compiled once per set of shapes."""
    changed = [(i, t) for i, t in zip(positions, targets) if tuple(arrays[i].shape) != t]
    if not changed:
        return
    key = tuple((tuple(arrays[i].shape), t, arrays[i].dtype) for i, t in changed)
    resized = _resizer(key, how)(*(arrays[i] for i, _ in changed))
    for (i, _), a in zip(changed, resized):
        arrays[i] = a


# A single-op program per new size, compiled with the least effort, as Strict's ops are
# (config.py ``op_compiler_options``): a new size pays for it, not for the model's.
@functools.lru_cache(maxsize=1024)
def _resizer(key: tuple, how: str):
    metrics.count("compiles", "padding")
    jnp = jax().numpy

    def resize(*arrays):
        if how == "pad":
            return [jnp.pad(a, [(0, t - n) for n, t in zip(shape, target)])
                    for a, (shape, target, _) in zip(arrays, key)]  # fmt: skip
        return [a[tuple(slice(0, t) for t in target)] for a, (_, target, _) in zip(arrays, key)]

    return jax().jit(resize, compiler_options=config.op_compiler_options or None)


def plan(gm: torch.fx.GraphModule, example_inputs) -> Plan | None:
    """The graph's Plan, or None where it has no dynamic dims or cannot run padded (with
    a warning naming what refused)."""
    if config.shape_buckets == "off":
        return None
    try:
        p = Plan(gm, example_inputs)
    except Refused as exc:
        warnings.warn(
            f"torch.compile(backend='tpu'): this graph compiles one program per size of its "
            f"dynamic dims, not one per bucket (Note [Shape buckets]): {exc}",
            perf_warnings.TPUPerformanceWarning,
            stacklevel=2,
        )
        metrics.count("shape_buckets", "refused")
        return None
    if not p.symbols:
        return None
    metrics.count("shape_buckets", "graphs")
    return p
