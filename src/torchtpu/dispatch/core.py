"""The body of ``TPUTensor.__torch_dispatch__``: choose how an aten op runs, and run it.

For each op overload, once, a *handler* is chosen (`_choose`), in this order:

1. a special handler: moving data between devices, reading a value, allocation,
   metadata-only ops (``detach``, ``alias``) -- the few ops that are not computations;
2. the op's lowering: a view op makes a tensor that shares storage (`_view`),
   any other op runs as a compiled plan (plans.py);
3. for a mutating op, its functional variant: for an in-place op (``add_``,
   ``_foreach_mul_``) its lowering, with the write-back compiled into the same
   function; for an ``out=`` op (``add.out``), torch's meta checks and resizing of the
   out tensors, the functional variant, then ``copy_`` into them;
4. a decomposition: torch's own CompositeImplicitAutograd definition, else one from
   ``torch._decomp``, into ops that have lowerings;
5. for a mutating op, its functional variant's decomposition followed by ``copy_``;
6. the CPU fallback (fallback.py): counted, warned once per op, or an error.
"""

from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_map

from torchtpu import tensor as tensor_module
from torchtpu.dispatch import backward_errors, modes, out_tensors, plans, schema
from torchtpu.dispatch.checks import to_host
from torchtpu.dispatch.fallback import run_on_cpu
from torchtpu.dispatch.plans import OutMeta, materialize, meta_values, wrap
from torchtpu.observe import metrics
from torchtpu.observe.locations import name_op
from torchtpu.ops import TABLE
from torchtpu.runtime.transfer import to_device
from torchtpu.storage import ViewStep
from torchtpu.tensor import TPUTensor

aten = torch.ops.aten

_HANDLERS: dict = {}


# Callables shown every op's (args, kwargs) before it runs: torchtpu.jit's watchers
# of which storages a step touches (compile/jit.py). Almost always empty.
watchers: list = []


def dispatch(func, args, kwargs):
    if backward_errors._raised and not backward_errors.in_backward():
        backward_errors.raise_deferred()
    for watch in watchers:
        watch(args, kwargs)
    handler = _HANDLERS.get(func)
    if handler is None:
        handler = _HANDLERS[func] = _choose(func)
        if func in _TAKES_INDICES:
            handler = _HANDLERS[func] = _integer_indices(handler)
        if func in _BATCH_NORM_TRAINING_ARG:
            handler = _HANDLERS[func] = _empty_stats_in_eval(handler, func)
        if func in _FACTORS_BY_LAYOUT:
            handler = _HANDLERS[func] = _factor_as_laid_out(handler)
        if func not in _SPECIAL and any(a.name == "device" for a in func._schema.arguments):
            handler = _HANDLERS[func] = _on_host_when_asked(handler)
    try:
        return handler(func, args, kwargs)
    except Exception as exc:
        if not backward_errors.in_backward():
            raise
        # Note [Why backward errors are deferred]
        return backward_errors.poisoned(func, args, kwargs, exc)


# Ops whose LU output is that of A^T for a contiguous real A and that of A otherwise
# (LAPACK is column-major), with backward formulas that ask A.is_contiguous() which it
# was. Lowerings see values, not strides: they always factor A^T, so a non-contiguous
# real A is passed as the contiguous B = A^T-laid-out copy, whose B^T is A.
_FACTORS_BY_LAYOUT = {aten._linalg_det.default, aten._linalg_slogdet.default}


def _factor_as_laid_out(handler):
    def as_laid_out(func, args, kwargs):
        a = args[0]
        if not a.is_complex() and not a.is_contiguous():
            args = (a.mT.contiguous(),) + tuple(args[1:])
        return handler(func, args, kwargs)

    return as_laid_out


def _on_host_when_asked(handler):
    """Ops with a ``device`` argument make their result where it says: ``x.new_zeros(2,
    device="cpu")`` and ``torch.linspace(tpu_start, 5, 4, device="cpu")`` are CPU
    tensors, computed from tpu inputs copied to the host. (Not the CPU fallback: the
    CPU is where the result was asked for.)"""

    def on_host_when_asked(func, args, kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cpu":
            return _run_on_host(func, args, kwargs)
        return handler(func, args, kwargs)

    return on_host_when_asked


def _run_on_host(func, args, kwargs):
    def host(x):
        return to_host(materialize(x)) if isinstance(x, TPUTensor) else x

    return func(*tree_map(host, args), **tree_map(host, kwargs))


# Batch norm ops and the position of their `training` argument (None: always eval).
# In eval mode torch's CPU and CUDA kernels return the saved mean and invstd empty,
# while the meta kernels (our shape oracle) size them (C,).
_BATCH_NORM_TRAINING_ARG = {
    aten._native_batch_norm_legit.default: 5,
    aten._native_batch_norm_legit_no_training.default: None,
    aten._batch_norm_no_update.default: None,
}


def _empty_stats_in_eval(handler, func):
    position = _BATCH_NORM_TRAINING_ARG[func]
    info = schema.info(func)

    def with_empty_stats(func, args, kwargs):
        result = handler(func, args, kwargs)
        if position is not None and info.bind(args, kwargs)[position]:
            return result
        out, mean, invstd, *rest = result
        return (out, mean.new_empty((0,)), invstd.new_empty((0,)), *rest)

    return with_empty_stats


# Ops taking a list of indices, where torch turns a boolean mask into the integer
# indices of its True elements before indexing. That count depends on values, so it
# happens here, op by op (nonzero), and the op itself stays compiled.
_TAKES_INDICES = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}


def _integer_indices(handler):
    def with_integer_indices(func, args, kwargs):
        indices = args[1]
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            expanded = []
            for i in indices:
                if i is not None and i.dtype in (torch.bool, torch.uint8):
                    expanded.extend(aten.nonzero.default(i).unbind(1))
                else:
                    expanded.append(i)
            args = (args[0], expanded) + tuple(args[2:])
        return handler(func, args, kwargs)

    return with_integer_indices


def _choose(func):
    special = _SPECIAL.get(func)
    if special is not None:
        return special
    info = schema.info(func)
    lowering = TABLE.get(func)
    if lowering is not None:
        if lowering.view:
            return _view_handler(info, lowering)
        return _lowered_handler(info, lowering)
    functional = schema.functional_variant(func)
    if functional is not None and (
        info.out_args or not schema.same_argument_order(func, functional)
    ):
        # ``add.out`` (torch's meta kernel checks and resizes the out tensors first), or
        # arguments to pass by name (``polygamma_``).
        return _functional_then_copy_handler(info, functional)
    if functional is not None and functional in TABLE:
        if TABLE[functional].view:
            return _inplace_view_handler(functional)
        return _lowered_handler(info, TABLE[functional])
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        # Ops torch defines in terms of other ops (reshape, linear, ...) reach us only
        # when called from inside a dispatch; their own definition is the decomposition.
        return _decomposed_handler(func.decompose)
    decomposition = _decompositions().get(func)
    if decomposition is not None:
        return _decomposed_handler(decomposition)
    if functional is not None:
        decomposition = _decompositions().get(functional)
        if decomposition is not None or functional in _SPECIAL:
            return _functional_then_copy_handler(info, functional)
    return run_on_cpu


# -- computing -----------------------------------------------------------------------------


def _lowered_handler(info, lowering):
    op = info.op

    def handler(func, args, kwargs):
        mode = modes.current()
        metrics.count("ops", mode.value)
        values = info.bind(args, kwargs)
        return plans.run(op, lowering, info, values, mode)

    return handler


_decomposition_table = None


def _decompositions() -> dict:
    global _decomposition_table
    if _decomposition_table is None:
        from torch._decomp import core_aten_decompositions, decomposition_table

        table = dict(decomposition_table)
        table.update(core_aten_decompositions())
        _decomposition_table = table
    return _decomposition_table


def _decomposed_handler(decomposition):
    def handler(func, args, kwargs):
        metrics.count("decomposed", str(func))
        return decomposition(*args, **kwargs)

    return handler


def _functional_then_copy_handler(info, functional):
    """Mutating op without a fused lowering: run its functional variant, then copy_."""

    def handler(func, args, kwargs):
        values = info.bind(args, kwargs)
        out_tensors.check(info, values)
        functional_info = schema.info(functional)
        names = [a.name for a in functional_info.args]
        by_name = {a.name: v for a, v in zip(info.args, values)}
        fargs, fkwargs = functional_info.split([by_name[n] for n in names])
        result = dispatch(functional, tuple(fargs), fkwargs)
        produced = list(result) if isinstance(result, (tuple, list)) else [result]
        n_fresh = sum(1 for r in info.returns if r.aliases is None)
        fresh, new_values = produced[:n_fresh], produced[n_fresh:]
        targets = []
        for i in info.mutable:
            v = values[i]
            if isinstance(v, (list, tuple)):
                targets.extend(v)
            elif v is not None:
                targets.append(v)
        flat_new = []
        for v in new_values:
            flat_new.extend(v if isinstance(v, (list, tuple)) else [v])
        for target, value in zip(targets, flat_new):
            aten.copy_.default(target, value)
        out = []
        fresh_iter = iter(fresh)
        for r in info.returns:
            out.append(values[r.aliases] if r.aliases is not None else next(fresh_iter))
        return out[0] if len(out) == 1 else (tuple(out) if out else None)

    return handler


# -- views ------------------------------------------------------------------------------------

_VIEW_PLANS: dict = {}


def _view_handler(info, lowering):
    op = info.op

    def handler(func, args, kwargs):
        values = info.bind(args, kwargs)
        x = values[0]
        static = tuple(plans._hashable(v) for v in values[1:])
        key = (op, x._meta, static)
        views = _VIEW_PLANS.get(key)
        if views is None:
            views = _VIEW_PLANS[key] = _plan_view(op, info, x, values, plans._plain(static))
        outs = [_make_view(x, *view) for view in views]
        return outs if info.returns[0].is_list else outs[0]

    return handler


def _plan_view(op, info, x, values, static) -> list:
    """[(restart, step, OutMeta, storage offset)] for each output of a view op."""
    if op is aten.as_strided.default:
        return [_plan_as_strided(op, x, static)]
    sig = plans.Signature(info, values, frozenset(a.name for a in info.args))
    args, kwargs = info.split(meta_values(info, sig))
    try:
        out = op(*args, **kwargs)
    except Exception as exc:
        raise name_op(exc, op) from None
    if isinstance(out, (list, tuple)):
        return [
            (False, ViewStep(op, static, i), _out_meta(o), o.storage_offset())
            for i, o in enumerate(out)
        ]
    return [(False, ViewStep(op, static, None), _out_meta(out), out.storage_offset())]


def _plan_as_strided(op, x, static):
    """as_strided addresses the storage, so its chain restarts at the base
    (Note [Storage strides])."""
    s = x._storage
    if x.dtype != s.dtype:
        raise NotImplementedError(f"{op}: as_strided of a tensor viewed as another dtype")
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


def _inplace_view_handler(view_op):
    """transpose_, squeeze_, as_strided_, ...: the tensor itself becomes the view."""

    def handler(func, args, kwargs):
        x = args[0]
        view = dispatch(view_op, args, kwargs)
        _restride(x, view.shape, view.stride(), view.storage_offset())
        x._chain, x._meta = view._chain, view._meta
        return x

    return handler


def _restride(x: TPUTensor, shape, strides, offset: int) -> None:
    """Change the sizes and strides torch sees for ``x`` (its TensorImpl), bypassing
    ``__torch_dispatch__``: torch's generic as_strided_ kernel does exactly that."""
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
        aten.as_strided_.default(x, tuple(shape), tuple(strides), offset)


def _same_storage(func, args, kwargs):
    """detach, alias, lift_fresh: a new tensor object on the same data, same view."""
    x = args[0]
    return TPUTensor(x._storage, x._chain, *x._meta[:4])


# -- data movement and reading values ------------------------------------------------------


def _to_copy(func, args, kwargs):
    x = args[0]
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        host = to_host(materialize(x))
        dtype = kwargs.get("dtype") or x.dtype
        memory_format = kwargs.get("memory_format")
        out = host.to(dtype=dtype)
        if memory_format not in (None, torch.preserve_format):
            return out.contiguous(memory_format=memory_format)
        # preserve_format keeps dense layouts (a transpose) and makes others (an
        # expand) contiguous: ask torch which strides that gives.
        strides = torch.empty_like(
            torch.empty_strided(x.shape, x.stride(), dtype=dtype, device="meta")
        ).stride()
        if strides != out.stride():
            out = torch.empty_strided(x.shape, strides, dtype=dtype).copy_(out)
        return out
    if device is not None:
        target = torch.device(device)
        index = target.index if target.index is not None else _current_device()
        if index != x._storage.device_index:
            moved = _move(x, index)
            kwargs = {k: v for k, v in kwargs.items() if k != "device"}
            return dispatch(func, (moved,) + tuple(args[1:]), kwargs)
    return _lowered_handler(schema.info(func), TABLE[func])(func, args, kwargs)


def _move(x: TPUTensor, index: int) -> TPUTensor:
    from torchtpu.runtime import device as jax_device
    from torchtpu.runtime import jax

    array = jax().device_put(materialize(x), jax_device(index))
    meta = OutMeta(tuple(x.shape), plans._contiguous(x.shape), x.dtype)
    return wrap(array, meta, index)


def _current_device() -> int:
    from torchtpu.runtime import current_index

    return current_index()


def from_cpu(t: torch.Tensor, index: int) -> TPUTensor:
    """A new TPUTensor holding a copy of CPU tensor ``t``."""
    array = to_device(t, index)
    meta = OutMeta(tuple(t.shape), plans._contiguous(t.shape), t.dtype)
    return wrap(array, meta, index)


def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, TPUTensor):
        # tpu -> cpu
        host = to_host(materialize(src))
        return dst.copy_(host)
    whole = (
        not dst._chain
        and tuple(dst.shape) == tuple(src.shape)
        and tuple(dst.shape) == dst._storage.shape
    )
    if not isinstance(src, TPUTensor):
        if whole:
            # The common `cpu_tensor.to("tpu")`: the transferred array becomes the base,
            # nothing to compile. (The host does the dtype conversion, as torch would.)
            dst._storage.set(to_device(src.to(dst.dtype), dst._storage.device_index))
            return dst
        src = from_cpu(src, dst._storage.device_index)
    elif src._storage.device_index != dst._storage.device_index:
        src = _move(src, dst._storage.device_index)
    if whole and src.dtype == dst.dtype and not src._chain and src._storage.array is not None:
        # JAX arrays (and pending values) are immutable: the destination can share it.
        dst._storage.set(src._storage.array)
        return dst
    info = schema.info(func)
    return _lowered_handler(info, TABLE[aten.copy.default])(
        func, (dst, src) + tuple(args[2:]), kwargs
    )


def _local_scalar_dense(func, args, kwargs):
    return to_host(materialize(args[0])).item()


def _allocate(func, args, kwargs):
    """empty_like and friends: an uninitialised storage (reads as zeros)."""
    info = schema.info(func)
    values = info.bind(args, kwargs)
    sig = plans.Signature(info, values, frozenset(a.name for a in info.args))
    margs = meta_values(info, sig)
    a, k = info.split(margs)
    try:
        out = func(*a, **k)
    except Exception as exc:
        raise name_op(exc, func) from None
    device = sig.device
    explicit = kwargs.get("device")
    if explicit is not None:
        explicit = torch.device(explicit)
        if explicit.type == "cpu":
            return _run_on_host(func, args, kwargs)
        device = explicit.index if explicit.index is not None else device
    meta = OutMeta(tuple(out.shape), tuple(out.stride()), out.dtype)
    return wrap(None, meta, device if device is not None else _current_device())


def _resize_(func, args, kwargs):
    """resize_ (also how ``out=`` tensors of the wrong size are resized), as torch does:
    within its storage where that holds the new size, else in a new storage of the new
    size keeping its leading values. (torch grows the shared storage then; here the
    other views of the old storage no longer alias the grown tensor.)"""
    x, size = args[0], tuple(args[1])
    memory_format = kwargs.get("memory_format") or (args[2] if len(args) > 2 else None)
    if tuple(x.shape) == size and memory_format in (
        None,
        torch.contiguous_format,
        torch.preserve_format,
    ):
        return x
    meta = torch.empty(
        size, dtype=x.dtype, device="meta", memory_format=memory_format or torch.contiguous_format
    )
    offset = x.storage_offset()
    if x._storage.holds(offset, meta.numel()):
        # The storage holds the new size: x stays in it, as on the CPU, still aliasing
        # the other views of it.
        fresh = x.as_strided(size, meta.stride(), offset)
    else:
        from torchtpu.tensor import empty_tensor

        fresh, offset = empty_tensor(size, meta.stride(), x.dtype, x._storage.device_index), 0
        keep = min(x.numel(), fresh.numel())
        if keep and x._storage.array is not None:
            fresh.view(-1)[:keep].copy_(x.reshape(-1)[:keep])
    # x's TensorImpl takes fresh's (data-less) storage too: torch checks sizes against
    # it. Setting a storage has no tpu kernel; the Meta one is generic TensorImpl code.
    aten.set_.source_Storage_storage_offset.redispatch(
        torch._C.DispatchKeySet(torch._C.DispatchKey.Meta),
        x,
        fresh.untyped_storage(),
        offset,
        size,
        meta.stride(),
    )
    x._storage, x._chain, x._meta = fresh._storage, fresh._chain, fresh._meta
    return x


def _as_strided_scatter(func, args, kwargs):
    """torch's definition, on tpu views: a copy of ``self`` laid out with its strides
    (gaps included), ``src`` copied into its as_strided view. The memory positions are
    those of that layout, so they must be real strides, not a lowering's values."""
    x, src, size, stride, storage_offset = schema.info(func).bind(args, kwargs)
    offset = storage_offset or 0
    extent = _extent(x.shape, x.stride(), 0)
    if _extent(size, stride, offset) > extent:
        raise RuntimeError(
            f"{func}: sizes {list(size)}, strides {list(stride)} and storage offset {offset} "
            f"need {_extent(size, stride, offset)} elements; the input's layout holds {extent}"
        )
    memory = x.new_zeros(extent)
    out = memory.as_strided(x.shape, x.stride())
    out.copy_(x)
    memory.as_strided(size, stride, offset).copy_(src)
    return out


def _extent(shape, strides, offset: int) -> int:
    """How many elements of memory a strided layout spans (0 when it has none)."""
    if math.prod(shape) == 0:
        return 0
    return offset + 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def _no_op_false(func, args, kwargs):
    return False


def _identity(func, args, kwargs):
    return args[0]


def _set_source_tensor(func, args, kwargs):
    dst, src = args[0], args[1]
    if (
        not isinstance(src, TPUTensor)
        or tuple(dst.shape) != tuple(src.shape)
        or dst.dtype != src.dtype
    ):
        raise RuntimeError(
            f"{func}: tpu tensors can only be set_ to a tpu tensor of the same shape and dtype"
        )
    dst._storage, dst._chain, dst._meta = src._storage, src._chain, src._meta
    return dst


def _native_batch_norm(func, args, kwargs):
    """native_batch_norm updates the running stats in place although its schema does
    not say so; _native_batch_norm_legit is the same op with an honest schema."""
    input, weight, bias, running_mean, running_var, training, momentum, eps = schema.info(
        func
    ).bind(args, kwargs)
    if running_mean is None:
        return aten._native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)
    return aten._native_batch_norm_legit.default(
        input, weight, bias, running_mean, running_var, training, momentum, eps
    )


_SPECIAL = {
    aten.native_batch_norm.default: _native_batch_norm,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.detach.default: _same_storage,
    aten.alias.default: _same_storage,
    aten.lift_fresh.default: _same_storage,
    aten.empty_like.default: _allocate,
    aten.new_empty.default: _allocate,
    aten.new_empty_strided.default: _allocate,
    aten.empty_strided.default: _allocate,
    aten.empty.memory_format: _allocate,
    aten.resize_.default: _resize_,
    aten.is_pinned.default: _no_op_false,
    aten._pin_memory.default: _identity,
    aten.record_stream.default: lambda func, args, kwargs: None,
    aten.set_.source_Tensor: _set_source_tensor,
    aten.as_strided_scatter.default: _as_strided_scatter,
}


tensor_module.hooks.dispatch = dispatch
