"""View ops: a new TPUTensor on the same Storage, one view step further down its
chain (storage.py). Nothing is computed; the step's output sizes, strides and offset
come from torch's meta kernel, once per (op, input layout, static arguments).
"""

from __future__ import annotations

import torch

from torchtpu.dispatch.meta import meta_tensor
from torchtpu.dispatch.signature import hashable, plain
from torchtpu.dispatch.values import OutMeta
from torchtpu.observe.locations import name_op
from torchtpu.ops import unsupported
from torchtpu.ops.views import slice_bounds
from torchtpu.storage import ViewStep
from torchtpu.tensor import TPUTensor

aten = torch.ops.aten

_VIEW_PLANS: dict = {}


def view_handler(info, lowering):
    op = info.op
    is_list = info.returns[0].is_list

    def handler(func, args, kwargs):
        x = args[0]
        if kwargs:
            key = (op, x._meta, tuple(hashable(v) for v in info.bind(args, kwargs)[1:]))
        else:
            key = (op, x._meta, tuple(hashable(v) for v in args[1:]))
        views = _VIEW_PLANS.get(key)
        if views is None:
            views = _VIEW_PLANS[key] = _plan_view(op, info, x, info.bind(args, kwargs))
        if is_list:
            return [_make_view(x, *view) for view in views]
        return _make_view(x, *views[0])

    return handler


def _plan_view(op, info, x, values) -> list:
    """[(restart, step, OutMeta, storage offset)] for each output of a view op."""
    static = plain(tuple(hashable(v) for v in values[1:]))
    if op is aten.as_strided.default:
        return [_plan_as_strided(op, x, static)]
    args, kwargs = info.split([meta_tensor(x._meta), *values[1:]])
    try:
        out = op(*args, **kwargs)
    except Exception as exc:
        raise name_op(exc, op) from None
    if isinstance(out, (list, tuple)):
        return [
            (False, ViewStep(op, static, i), _out_meta(o), o.storage_offset())
            for i, o in enumerate(out)
        ]
    static = _canonical(op, x.shape, static)
    return [(False, ViewStep(op, static, None), _out_meta(out), out.storage_offset())]


def _canonical(op, shape, static: tuple) -> tuple:
    """A position's arguments as the lowering resolves them (a non-negative dim, start
    and index; a slice's bounds clamped): the form in which the dispatcher can pass the
    position to a program instead of compiling it in (Note [Positions are inputs])."""
    if op is aten.select.int:
        dim, index = static
        dim %= len(shape)
        return (dim, index % shape[dim])
    if op is aten.slice.Tensor:
        dim, start, end, step = static
        dim %= len(shape)
        return (dim, *slice_bounds(shape[dim], start, end, step))
    if op is aten.narrow.default:
        dim, start, length = static
        dim %= len(shape)
        return (dim, start + shape[dim] if start < 0 else start, length)
    return static


def _plan_as_strided(op, x, static):
    """as_strided addresses the storage, so its chain restarts at the base
    (Note [Storage strides])."""
    s = x._storage
    if x.dtype != s.dtype:
        unsupported.refuse("as_strided: dtype view")
    size, stride, offset = static[0], static[1], static[2]
    if offset is None:
        offset = x.storage_offset()
    numel = 1
    for n in s.shape:
        numel *= n
    extent = 1 + sum((n - 1) * st for n, st in zip(s.shape, s.strides) if n > 0) if numel else 0
    needed = 1 + offset + sum((n - 1) * st for n, st in zip(size, stride)) if all(size) else 0
    if needed > extent:  # meta tensors do not check this; torch's CPU kernel does
        itemsize = torch.empty((), dtype=s.dtype).element_size()
        raise RuntimeError(
            f"{op}: setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset}, "
            f"and itemsize {itemsize} requiring a storage size of {needed * itemsize} are out of "
            f"bounds for storage of size {extent * itemsize}"
        )
    try:
        out = torch.empty(extent, dtype=s.dtype, device="meta").as_strided(size, stride, offset)
    except Exception as exc:
        raise name_op(exc, op) from None
    step = ViewStep(op, (tuple(size), tuple(stride), offset, s.strides), None)
    return (True, step, _out_meta(out), offset)


def _out_meta(t) -> OutMeta:
    return OutMeta(tuple(t.shape), tuple(t.stride()), t.dtype)


def _make_view(x: TPUTensor, restart: bool, step, meta: OutMeta, offset: int) -> TPUTensor:
    chain = (step,) if restart else x._chain + (step,)
    return TPUTensor(x._storage, chain, meta.shape, meta.strides, offset, meta.dtype)


def inplace_view_handler(view_op):
    """transpose_, squeeze_, as_strided_, ...: the tensor itself becomes the view."""

    def handler(func, args, kwargs):
        x = args[0]
        view = view_op(*args, **kwargs)
        restride(x, view.shape, view.stride(), view.storage_offset())
        x._chain, x._meta = view._chain, view._meta
        return x

    return handler


def restride(x: TPUTensor, shape, strides, offset: int) -> None:
    """Change the sizes and strides torch sees for ``x`` (its TensorImpl), bypassing
    ``__torch_dispatch__``: torch's generic as_strided_ kernel does exactly that."""
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
        aten.as_strided_.default(x, tuple(shape), tuple(strides), offset)
