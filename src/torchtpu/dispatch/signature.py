"""An op call taken apart: its *key* (what a compiled plan depends on) and its *feed*
(the arrays and traced scalars the plan is called with), in one pass over the
arguments.

The key holds, per argument: for a tensor its ``_meta`` (shape, strides, offset,
dtype, view chain), or ``(slot, _meta)`` when it shares the storage of an earlier
argument (aliasing changes the program), or ``(None, _meta, shape, dtype)`` for an
uninitialised storage (the plan makes its base); the Python type of each traced
scalar; every static argument's value. It is built from the arguments as torch passes
them, without binding them to the schema: `scan` is on every op's path, so it costs a
few attribute reads per argument.

Note [Traced and static scalars]
    A Python number where the schema says Scalar (``add(x, y, alpha=2)``, an lr) is a
    traced input of the compiled function, so a new value never recompiles; the
    schema's default (``alpha=1``) and the arguments a lowering names ``static`` stay
    constants. A number where the schema says Tensor (``x + 1``) is traced too, and
    so is a 0-d CPU tensor (torch lets it join ops on any device, as a scalar).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchtpu import dtypes, tracing
from torchtpu.dispatch.pending import Pending
from torchtpu.dispatch.schema import Kind, SchemaInfo
from torchtpu.ops.view_chains import meta_without_positions
from torchtpu.tensor import TPUTensor

# Rules: how `scan` reads the argument at each position.
TENSOR, TENSOR_LIST, SCALAR, SCALAR_LIST, STATIC = range(5)
_NUMBERS = (int, float, bool, complex)


class Rules(NamedTuple):
    """Per argument position: the rule, and the schema default of a traced scalar."""

    kinds: tuple
    defaults: tuple
    names: tuple


def rules(info: SchemaInfo, static: frozenset) -> Rules:
    kinds, defaults = [], []
    for arg in info.args:
        if arg.kind is Kind.TENSOR:
            kinds.append(TENSOR)
        elif arg.kind is Kind.TENSOR_LIST:
            kinds.append(TENSOR_LIST)
        elif arg.kind is Kind.SCALAR and arg.name not in static:
            kinds.append(SCALAR)
        elif arg.kind is Kind.SCALAR_LIST and arg.name not in static:
            kinds.append(SCALAR_LIST)
        else:
            kinds.append(STATIC)
        defaults.append(arg.default)
    return Rules(tuple(kinds), tuple(defaults), tuple(a.name for a in info.args))


class Call:
    """One op call: ``key`` and the feed (``arrays``, ``scalars``), the distinct
    ``storages`` of its tensor arguments in order, and the ``device`` they are on."""

    __slots__ = ("key", "arrays", "scalars", "storages", "device")


def scan(op, rules: Rules, values) -> Call:
    """Take apart ``values`` (the op's arguments in schema order; trailing defaults
    may be left out)."""
    key = []
    arrays = []
    scalars = []
    storages = []
    call = Call()
    call.device = None
    kinds, defaults = rules.kinds, rules.defaults
    views = None  # the arguments that are views: Note [Positions are inputs]
    listed = None  # the bases' shapes of views in lists: Note [A view's base is in its key]
    for i, value in enumerate(values):
        kind = kinds[i]
        if kind is TENSOR:
            if type(value) is TPUTensor:
                s = value._storage
                for slot, seen in enumerate(storages):
                    if seen is s:
                        key.append((slot, value._meta))
                        break
                else:
                    _new_storage(op, call, storages, arrays, key, s, value._meta)
                    if value._chain and s.array is not None and tracing._active is None:
                        views = views or []
                        views.append(i)
            elif value is None:
                key.append(None)
            else:
                key.append(_other_tensor(op, call, storages, arrays, scalars, value))
        elif kind is SCALAR:
            if value is None:
                key.append(None)
            else:
                default = defaults[i]
                if value is default or (type(value) is type(default) and value == default):
                    key.append((type(value), value))
                else:
                    scalars.append(value)
                    key.append(type(value))
        elif kind is STATIC:
            key.append(hashable(value))
        elif kind is TENSOR_LIST:
            if value is None:
                key.append(None)
            else:
                listed = [] if listed is None else listed
                key.append(_list_key(op, call, storages, arrays, scalars, value, listed))
        elif value is None:  # SCALAR_LIST
            key.append(None)
        else:
            scalars.extend(value)
            key.append(("sl",) + tuple(type(v) for v in value))
    if views is not None:
        _positions_as_inputs(key, scalars, kinds, values, views)
    if views is not None or listed:
        bases = [values[i]._storage.shape for i in views or ()] + (listed or [])
        key.append((_BASES, *bases))
    call.key = tuple(key)
    call.arrays, call.scalars, call.storages = arrays, scalars, storages
    return call


# Note [A view's base is in its key]
#     A view's ``_meta`` (its shape, strides, offset and chain) does not fix the shape of
#     the storage it reads: ``ids[:, -1:]`` of ids one longer each step has the same meta
#     every step once its position is an input (Note [Positions are inputs]), and so
#     does ``x[:, :4]`` of a base that grows. The plan's program takes the base array,
#     so ``jax.jit`` compiled it again for every new base shape -- unseen: a hit in the
#     op cache, no compile counted, no warning (a static-cache ``generate()`` compiled a
#     program a token this way in Strict, and a DeferAndFuse chunk a token). So the
#     shapes of the bases of a call's views (of initialised storages, outside a trace)
#     end its key, after the arguments: a new base shape is a new plan, counted, and
#     the small-ops rule (small_ops.py) sees it. The builder and the meta oracle read
#     the key argument by argument and never reach it.
_BASES = "bases of views"


# Note [Positions are inputs]
#     ``cache[:, :, t] = k``, ``x[t]``, ``x.narrow(0, t, 4)``: a view's position is part
#     of its chain, and a chain in a key made every new ``t`` compile a new program (a
#     64-token decoding loop compiled 62). So where an argument is a view whose chain
#     selects or slices, the key holds the chain with those positions taken out
#     (`view_chains.positions_as_inputs`: `DynamicStep` s, which read with
#     ``dynamic_slice`` and write with ``dynamic_update_slice``: a cost proportional to
#     what is written, not to the base) and the storage offset as 0, and the positions
#     go to the end of the call's traced scalars, in argument order. The sizes stay in
#     the key: a slice of another length is another program. Only for a storage that no
#     other argument of the call reaches: with two views of one storage, whether they
#     overlap depends on their positions, and torch's overlap checks run once per key.
#     In a trace (torch.compile, torchtpu.jit) positions stay constants of the program.


def _positions_as_inputs(key: list, scalars: list, kinds, values, views: list) -> None:
    counts: dict = {}
    for kind, value in zip(kinds, values):
        if kind is TENSOR and type(value) is TPUTensor:
            counts[id(value._storage)] = counts.get(id(value._storage), 0) + 1
        elif kind is TENSOR_LIST and value is not None:
            for t in value:
                if isinstance(t, TPUTensor):
                    counts[id(t._storage)] = counts.get(id(t._storage), 0) + 1
    for i in views:
        if counts[id(values[i]._storage)] != 1:
            continue
        taken = meta_without_positions(key[i])
        if taken is not None:
            key[i] = taken[0]
            scalars.extend(taken[1])


def _new_storage(op, call, storages, arrays, key, s, meta) -> None:
    if call.device is None:
        call.device = s.device_index
    elif call.device != s.device_index:
        raise RuntimeError(
            f"{op}: Expected all tensors to be on the same device, but found at least "
            f"two devices, tpu:{call.device} and tpu:{s.device_index}!"
        )
    storages.append(s)
    array = s.array
    if array is None:
        # The plan makes the missing base from the storage's shape and dtype, which a
        # view's meta does not determine (two buckets of different sizes, one view).
        key.append((None, meta, s.shape, s.dtype))
        return
    if type(array) is Pending and array.node_done():
        array = s.array = array.resolved()
    arrays.append(array)
    key.append(meta)


def _list_key(op, call, storages, arrays, scalars, tensors, bases: list) -> tuple:
    """The key of a tensor list. Its storages are found by a dict, not the scan a
    single tensor's takes: a ``_foreach_*`` op over a model's parameters has hundreds,
    and the scan made recording one quadratic (a 12-layer GPT's AdamW step: a fifth of
    DeferAndFuse's host time)."""
    slot_of = {id(s): slot for slot, s in enumerate(storages)}
    parts: list = ["l"]
    for t in tensors:
        if type(t) is TPUTensor:
            s = t._storage
            slot = slot_of.get(id(s))
            if slot is None:
                slot_of[id(s)] = len(storages)
                _new_storage(op, call, storages, arrays, parts, s, t._meta)
                if t._chain and s.array is not None and tracing._active is None:
                    bases.append(s.shape)  # Note [A view's base is in its key]
            else:
                parts.append((slot, t._meta))
        else:
            parts.append(_other_tensor(op, call, storages, arrays, scalars, t))
    return tuple(parts)


def _other_tensor(op, call, storages, arrays, scalars, t):
    """The key of a tensor argument that is not a plain TPUTensor (or is in a list)."""
    if t is None:
        return None
    if isinstance(t, TPUTensor):
        s = t._storage
        for slot, seen in enumerate(storages):
            if seen is s:
                return (slot, t._meta)
        parts: list = []
        _new_storage(op, call, storages, arrays, parts, s, t._meta)
        return parts[0]
    if type(t) in _NUMBERS:
        scalars.append(t)
        return type(t)
    if isinstance(t, torch.Tensor):
        if t.dim() == 0 and t.device.type == "cpu":
            scalars.append(t.item())
            if tracing._active is not None:  # a constant of the program: guarded
                tracing._active.cpu_scalars.append(t)
            return ("c", t.dtype)
        where = "tpu" if call.device is None else f"tpu:{call.device}"
        raise RuntimeError(
            f"{op}: Expected all tensors to be on the same device, but found at least "
            f"two devices, {where} and {t.device}!"
        )
    raise TypeError(f"{op}: expected a Tensor, got {type(t).__name__}")


class Number(NamedTuple):
    """A static number in a key: 4 and 4.0 (and 1 and True) are equal and hash alike
    in Python, but are different constants to torch (``arange(4)`` is int64,
    ``arange(4.0)`` float32)."""

    type: type
    value: object

    def __repr__(self) -> str:
        return repr(self.value)


def hashable(value):
    """A static argument as a key element."""
    if type(value) in _NUMBERS:
        return Number(type(value), value)
    if isinstance(value, torch.dtype) and value not in dtypes.SUPPORTED:
        dtypes.check_supported(value, "result")
    if isinstance(value, list):
        return tuple(hashable(v) for v in value)
    if isinstance(value, torch.Generator):
        raise RuntimeError(
            f"Expected a 'tpu' device type for generator but found '{value.device.type}'"
        )
    return value


def plain(value):
    """A static value from a key as the lowering takes it (undoing `Number`)."""
    if type(value) is Number:
        return value.value
    if type(value) is tuple:
        return tuple(plain(v) for v in value)
    return value


# -- reading a key -----------------------------------------------------------------------


def tensor_meta(part):
    """The ``_meta`` of a tensor's key element, else None."""
    if type(part) is tuple and len(part) == 5:
        return part
    if type(part) is tuple and len(part) in (2, 4) and (part[0] is None or type(part[0]) is int):
        return part[1] if type(part[1]) is tuple and len(part[1]) == 5 else None
    return None


def describe_change(names, old: tuple, new: tuple) -> str:
    """What differs between two plan keys of one op, in the user's terms."""
    (_, old_args, old_dtype, old_precision) = old
    (_, new_args, new_dtype, new_precision) = new
    old_args, old_bases = _without_bases(old_args)
    new_args, new_bases = _without_bases(new_args)
    for name, a, b in zip(names, old_args, new_args):
        if a != b:
            before, after = _describe(a), _describe(b)
            if before == after:
                return f"argument `{name}`: its strides or view changed ({after})"
            return f"argument `{name}`: {before} -> {after}"
    if len(old_args) != len(new_args):
        return "which arguments were passed"
    if old_bases != new_bases:
        shapes = [list(shape) for shape in new_bases[1:]] if new_bases else []
        return f"the shape of the tensor a view argument was taken from (now {shapes})"
    if old_dtype != new_dtype:
        return f"the default dtype: {old_dtype} -> {new_dtype}"
    if old_precision != new_precision:
        return f"the matmul precision: {old_precision} -> {new_precision}"
    return "a signature seen before (it was dropped from the full op cache)"


def _without_bases(args: tuple) -> tuple:
    """A key's arguments, and the shapes of its views' bases, if any (Note [A view's
    base is in its key])."""
    if args and type(args[-1]) is tuple and args[-1][:1] == (_BASES,):
        return args[:-1], args[-1]
    return args, None


def _describe(part) -> str:
    if part is None:
        return "None"
    meta = tensor_meta(part)
    if meta is not None:
        shape, _, _, dtype, _ = meta
        return f"{str(dtype).replace('torch.', '')}{list(shape)}"
    if type(part) is type:
        return f"a traced {part}"
    if type(part) is tuple and part and part[0] == "l":
        return "[" + ", ".join(_describe(p) for p in part[1:]) + "]"
    if type(part) is tuple and part and part[0] == "sl":
        return f"traced {part[1:]}"
    if type(part) is tuple and part and part[0] == "c":
        return f"a 0-d CPU tensor of {part[1]}"
    if type(part) is tuple and len(part) == 2 and type(part[0]) is type:
        return f"the constant {part[1]!r}"
    return f"the constant {part!r}"
