"""What the dispatcher needs to know about an aten op's schema, computed once per op."""

from __future__ import annotations

import enum
import functools
from typing import NamedTuple

import torch

aten = torch.ops.aten


class Kind(enum.Enum):
    TENSOR = "Tensor"  # Tensor or Tensor?
    TENSOR_LIST = "Tensor[]"  # Tensor[], Tensor?[], Tensor[]?
    SCALAR = "Scalar"  # Scalar or Scalar?: a traced input unless the lowering wants it static
    SCALAR_LIST = "Scalar[]"  # each element a traced input (per-parameter step sizes)
    STATIC = "static"  # everything else: ints, lists of ints, dtypes, strings, ...


class Arg(NamedTuple):
    name: str
    kind: Kind
    default: object
    kwarg_only: bool
    mutable: bool  # written by the op (Tensor(a!))
    has_default: bool


class Return(NamedTuple):
    is_tensor: bool  # Tensor or Tensor[]
    is_list: bool
    aliases: int | None  # index of the argument this return aliases, if any


class SchemaInfo(NamedTuple):
    op: torch._ops.OpOverload
    args: tuple[Arg, ...]
    returns: tuple[Return, ...]
    mutable: tuple[int, ...]  # indices of mutable args
    out_args: tuple[int, ...]  # indices of the mutable args that are ``out=`` tensors
    is_view: bool  # returns alias an input without writing it
    all_tensor_returns: bool  # no Python numbers among the returns

    def bind(self, args: tuple, kwargs: dict) -> list:
        """The op's arguments in schema order, defaults filled in."""
        values = list(args)
        for arg in self.args[len(args) :]:
            if arg.name in kwargs:
                values.append(kwargs[arg.name])
            elif arg.has_default:
                values.append(arg.default)
            else:
                raise TypeError(f"{self.op}: missing required argument {arg.name!r}")
        return values

    def returned_written(self, args: tuple, kwargs: dict):
        """For an op that returns exactly the arguments it writes (``add_``, ``out=``
        ops): those arguments, as the op returns them. None for any other op."""
        if (
            not self.mutable
            or len(self.returns) != len(self.mutable)
            or any(r.aliases is None for r in self.returns)
        ):
            return None
        values = self.bind(args, kwargs)
        written = [values[i] for i in self.mutable]
        return written[0] if len(written) == 1 else tuple(written)

    def split(self, values: list) -> tuple[list, dict]:
        """Inverse of `bind`: positional args and kwarg-only args for calling the op."""
        args, kwargs = [], {}
        for arg, value in zip(self.args, values):
            if arg.kwarg_only:
                kwargs[arg.name] = value
            else:
                args.append(value)
        return args, kwargs


def _kind(t) -> Kind:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch.TensorType):
        return Kind.TENSOR
    if isinstance(t, torch.ListType):
        element = t.getElementType()
        if isinstance(element, torch.OptionalType):
            element = element.getElementType()
        if isinstance(element, torch.TensorType):
            return Kind.TENSOR_LIST
        if isinstance(element, torch.NumberType):
            return Kind.SCALAR_LIST
    if isinstance(t, torch.NumberType):
        return Kind.SCALAR
    return Kind.STATIC


@functools.cache
def info(op: torch._ops.OpOverload) -> SchemaInfo:
    schema = op._schema
    args = []
    alias_sets = []
    for a in schema.arguments:
        mutable = a.alias_info is not None and a.alias_info.is_write
        alias_sets.append(a.alias_info.before_set if a.alias_info is not None else None)
        args.append(
            Arg(
                name=a.name,
                kind=_kind(a.type),
                default=a.default_value if a.has_default_value() else None,
                kwarg_only=a.kwarg_only,
                mutable=mutable,
                has_default=a.has_default_value(),
            )
        )
    returns = []
    any_write = any(arg.mutable for arg in args)
    aliases_input = False
    for r in schema.returns:
        aliased = None
        if r.alias_info is not None:
            for i, s in enumerate(alias_sets):
                if s is not None and s == r.alias_info.before_set:
                    aliased = i
                    break
            aliases_input = aliases_input or aliased is not None
        k = _kind(r.type)
        returns.append(
            Return(
                is_tensor=k in (Kind.TENSOR, Kind.TENSOR_LIST),
                is_list=k is Kind.TENSOR_LIST,
                aliases=aliased,
            )
        )
    mutable = tuple(i for i, a in enumerate(args) if a.mutable)
    return SchemaInfo(
        op=op,
        args=tuple(args),
        returns=tuple(returns),
        mutable=mutable,
        out_args=tuple(i for i in mutable if schema.arguments[i].is_out),
        is_view=aliases_input and not any_write,
        all_tensor_returns=all(r.is_tensor for r in returns),
    )


def _signature(op, skip_mutable: bool) -> tuple:
    return tuple(
        (a.name, str(a.type))
        for a in op._schema.arguments
        if not (skip_mutable and a.alias_info is not None and a.alias_info.is_write and a.is_out)
    )


def same_argument_order(op: torch._ops.OpOverload, functional: torch._ops.OpOverload) -> bool:
    """Whether ``functional_variant(op)`` takes op's arguments (but ``out=``) in op's order."""
    return _signature(op, skip_mutable=True) == _signature(functional, skip_mutable=False)


@functools.cache
def functional_variant(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The op that computes what a mutating op writes, without writing.

    ``add_.Tensor`` -> ``add.Tensor``; ``add.out`` -> ``add.Tensor``;
    ``_foreach_mul_.Scalar`` -> ``_foreach_mul.Scalar``;
    ``_native_batch_norm_legit.default`` -> ``_native_batch_norm_legit_functional.default``.
    Its outputs are the op's non-aliased returns followed by the new values of the
    op's mutable arguments, in schema order.
    """
    if not info(op).mutable:
        return None
    name = op._schema.name.split("::", 1)[1]
    is_out = any(a.is_out for a in op._schema.arguments)
    wanted = _signature(op, skip_mutable=True)
    candidates = [name[:-1]] if name.endswith("_") and not is_out else []
    candidates += [name, name + "_functional"]
    for packet_name in candidates:
        packet = getattr(aten, packet_name, None)
        if packet is None:
            continue
        for overload_name in packet.overloads():
            candidate = getattr(packet, overload_name)
            if candidate is op or info(candidate).mutable:
                continue
            # The same arguments, maybe in another order (polygamma_(self, n) computes
            # polygamma(n, self)).
            if sorted(_signature(candidate, skip_mutable=False)) == sorted(wanted):
                return candidate
    return None


# What a factory takes that its out= form gets from the out tensor.
_TENSOR_OPTIONS = frozenset({"dtype", "layout", "device", "pin_memory"})


@functools.cache
def factory_variant(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The factory an ``out=`` op fills its out tensor with, which `functional_variant`
    does not find because it also takes tensor options: ``rand.out`` -> ``rand.default``,
    ``randint.low_generator_out`` -> ``randint.low_generator``, ``rand_like.out`` ->
    ``rand_like.default``. Its arguments are the op's (but ``out``) and tensor options."""
    if not info(op).out_args:
        return None
    wanted = set(_signature(op, skip_mutable=True))
    packet = getattr(aten, op._schema.name.split("::", 1)[1], None)
    for overload_name in packet.overloads() if packet is not None else ():
        candidate = getattr(packet, overload_name)
        if info(candidate).mutable:
            continue
        signature = _signature(candidate, skip_mutable=False)
        names = {name for name, _ in signature}
        if "device" in names and {a for a in signature if a[0] not in _TENSOR_OPTIONS} == wanted:
            return candidate
    return None


#: Ops that make a tensor from no value (a shape, a fill value, another tensor's shape
#: and dtype): an optimizer's new state (defer.py) and programs without products
#: (effort.py) are told by them.
FACTORIES = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "zeros_like", "ones_like", "full_like", "empty_like", "zeros", "ones", "full",
        "scalar_tensor", "new_zeros", "new_ones", "new_full",
    )
)  # fmt: skip
