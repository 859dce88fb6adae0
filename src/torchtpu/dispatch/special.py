"""The ops that are not computations: moving data between devices, reading a value,
allocating, metadata-only ops, and the few ops torch's schema describes dishonestly.
Each is a handler ``(func, args, kwargs)``; `SPECIAL` maps ops to them.
"""

from __future__ import annotations

import functools
import math

import torch
from torch._prims_common import make_contiguous_strides_for, suggest_memory_format
from torch.utils._pytree import tree_map

from torchtpu import storage as storage_module
from torchtpu import tensor as tensor_module
from torchtpu.dispatch import checks, defer, nested, plans, saved_values, schema
from torchtpu.dispatch.meta import on_meta
from torchtpu.dispatch.values import (
    OutMeta,
    from_cpu,
    host_value,
    materialize,
    move,
    to_host,
    upload,
    wrap,
)
from torchtpu.observe.locations import name_op
from torchtpu.ops import TABLE
from torchtpu.runtime import current_index
from torchtpu.tensor import TPUTensor

aten = torch.ops.aten


@functools.cache
def _lowered(op, lowered_as):
    """The handler running ``op`` with the lowering of ``lowered_as``."""
    return plans.lowered_handler(plans.Entry(op, TABLE[lowered_as], schema.info(op)))


def run_on_host(func, args, kwargs):
    """Ops asked to make their result on the CPU (``device="cpu"``), from tpu inputs
    copied to the host. (Not the CPU fallback: the CPU is where the result was asked for.)"""

    def host(x):
        return host_value(x) if isinstance(x, TPUTensor) else x

    return func(*tree_map(host, args), **tree_map(host, kwargs))


def _same_storage(func, args, kwargs):
    """detach, alias, lift_fresh: a new tensor object on the same data, same view."""
    x = args[0]
    return TPUTensor(x._storage, x._chain, *x._meta[:4])


# -- data movement and reading values ------------------------------------------------------


def _to_copy(func, args, kwargs):
    x = args[0]
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        host = host_value(x)
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
        index = target.index if target.index is not None else current_index()
        if index != x._storage.device_index:
            moved = move(x, index)
            kwargs = {k: v for k, v in kwargs.items() if k != "device"}
            return func(moved, *args[1:], **kwargs)
    out = _lowered(func, func)(func, args, kwargs)
    saved_values.note_widening(x, out)
    return out


def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, TPUTensor):
        # tpu -> cpu
        if type(src) is torch.Tensor and hasattr(src, "_jax"):
            # A compiled graph's result (a handle: compile/handles.py) written back into
            # a CPU input the graph mutated, by AOTAutograd's epilogue: the CPU ``step``
            # of an optimizer whose state was made before torch.compile saw it.
            return dst.copy_(to_host(defer.resolve(src._jax, "copy to the CPU")))
        return dst.copy_(host_value(src))
    whole = (
        not dst._chain
        and tuple(dst.shape) == tuple(src.shape)
        and tuple(dst.shape) == dst._storage.shape
    )
    if whole and not isinstance(src, TPUTensor):
        # The common `cpu_tensor.to("tpu")`: the transferred array becomes the base,
        # nothing to compile. (The host does the dtype conversion, as torch would.)
        host = src.to(dst.dtype)
        dst._storage.set(upload(host, dst._storage.device_index))
        if host.numel() * host.element_size() <= storage_module.HOST_COPY_BYTES:
            host = host.resolve_conj().resolve_neg().clone()
            storage_module.keep_host_copy(dst._storage, host)
        return dst
    src = _source_on_device_of(dst, src)
    if whole and src.dtype == dst.dtype and not src._chain and src._storage.array is not None:
        # JAX arrays (and pending values) are immutable: the destination can share it.
        dst._storage.set(src._storage.array)
        return dst
    return _lowered(func, aten.copy.default)(func, (dst, src) + tuple(args[2:]), kwargs)


def _copy(func, args, kwargs):
    """``copy``, the functional ``copy_`` (AOTAutograd's graphs hold it for ``copy_``):
    as for ``copy_``, the source may be on another device."""
    dst, src = args[0], args[1]
    if not isinstance(dst, TPUTensor):  # a CPU result from tpu values
        return func(dst, host_value(src), *args[2:], **kwargs)
    src = _source_on_device_of(dst, src)
    return _lowered(func, aten.copy.default)(func, (dst, src) + tuple(args[2:]), kwargs)


def _source_on_device_of(dst: TPUTensor, src) -> TPUTensor:
    """A copy's source, which may be a CPU tensor or on another tpu, on ``dst``'s device."""
    if not isinstance(src, TPUTensor):
        return from_cpu(src, dst._storage.device_index)
    if src._storage.device_index != dst._storage.device_index:
        return move(src, dst._storage.device_index)
    return src


def _local_scalar_dense(func, args, kwargs):
    x = args[0]
    if x._chain:  # x[i].item(): no program per index (Note [Views read on the host])
        return host_value(x).item()
    return checks.item(materialize(x))


def _allocate(func, args, kwargs):
    """empty_like and friends: an uninitialised storage (reads as zeros)."""
    a, k = on_meta(args, kwargs)
    try:
        out = func(*a, **k)
    except Exception as exc:
        raise name_op(exc, func) from None
    device = next((t._storage.device_index for t in args if isinstance(t, TPUTensor)), None)
    explicit = kwargs.get("device")
    if explicit is not None:
        explicit = torch.device(explicit)
        if explicit.type == "cpu":
            return run_on_host(func, args, kwargs)
        device = explicit.index if explicit.index is not None else device
    meta = OutMeta(tuple(out.shape), tuple(out.stride()), out.dtype)
    return wrap(None, meta, device if device is not None else current_index())


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
        fresh, offset = (
            tensor_module.empty_tensor(size, meta.stride(), x.dtype, x._storage.device_index),
            0,
        )
        keep = min(x.numel(), fresh.numel())
        if keep and x._storage.array is not None:
            fresh.view(-1)[:keep].copy_(x.reshape(-1)[:keep])
    # x's TensorImpl takes fresh's (data-less) storage too: torch checks sizes against
    # it. Setting a storage has no tpu kernel; the Meta one is generic TensorImpl code.
    aten.set_.source_Storage_storage_offset.redispatch(
        torch._C.DispatchKeySet(torch._C.DispatchKey.Meta),
        x,
        torch.Tensor.untyped_storage(fresh),  # its data-less one, which Meta may resize
        offset,
        size,
        meta.stride(),
    )
    x._storage, x._chain, x._meta = fresh._storage, fresh._chain, fresh._meta
    x.__dict__.pop("_addressed", None)  # its TensorImpl holds fresh's storage now
    return x


def _resize_as_(func, args, kwargs):
    """resize_as_ is resize_ to the template's shape (torch's own definition);
    ``preserve_format`` takes the template's memory format."""
    x, template = args[0], args[1]
    memory_format = kwargs.get("memory_format") or (args[2] if len(args) > 2 else None)
    if memory_format == torch.preserve_format:
        memory_format = suggest_memory_format(template)
    return _resize_(aten.resize_.default, (x, template.shape, memory_format), {})


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


def _cannot_pin(func, args, kwargs):
    # As for a CUDA tensor: only host memory can be pinned.
    raise RuntimeError(f"cannot pin '{args[0].type()}' only dense CPU tensors can be pinned")


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


def _set_source_storage(func, args, kwargs):
    """``x.set_(y.untyped_storage(), offset, size, stride)``: x becomes an as_strided
    view of the Storage behind that torch storage (found by its address, Note [Storage
    addresses]), aliasing y as on the CPU."""
    values = schema.info(func).bind(args, kwargs)
    x, source = values[0], values[1]
    if func is aten.set_.source_Storage:
        size, offset = (source.nbytes() // x.dtype.itemsize,), 0
        stride = None
    else:
        offset, size, stride = values[2], tuple(values[3]), values[4]
    stride = tuple(stride) if stride else make_contiguous_strides_for(size)
    owner = storage_module.owner_of(source) if source.device.type == "tpu" else None
    if owner is None:
        if source.device != x.device:
            raise RuntimeError(
                f'Attempted to set the storage of a tensor on device "{x.device}" to a '
                f'storage on different device "{source.device}".  This is no longer '
                "allowed; the devices must match."
            )
        raise RuntimeError(f"{func}: this tpu storage belongs to no live tpu tensor")
    if owner.dtype != x.dtype:
        raise NotImplementedError(
            f"{func}: a {x.dtype} tpu tensor can only be set to a storage of {x.dtype} "
            f"tensors, not one of {owner.dtype} (tpu storages are typed)"
        )
    held = math.prod(owner.shape)
    if _extent(size, stride, offset) > held:
        # Before anything changes: the CPU would grow its storage, a tpu storage keeps its size.
        raise RuntimeError(
            f"{func}: Trying to resize storage that is not resizable: sizes {list(size)}, "
            f"strides {list(stride)} and storage offset {offset} need "
            f"{_extent(size, stride, offset)} elements; the storage holds {held}"
        )
    base = TPUTensor(owner, (), owner.shape, owner.strides, 0, owner.dtype)
    # The TensorImpl's storage, sizes and strides are set by generic TensorImpl code.
    aten.set_.source_Storage_storage_offset.redispatch(
        _CPU_KEYS, x, owner.torch_storage(), offset, size, stride
    )
    view = base.as_strided(size, stride, offset)
    x._storage, x._chain, x._meta = view._storage, view._chain, view._meta
    x._addressed = owner
    return x


_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _torch_kernel_for_every_device(func, args, kwargs):
    """torch's own kernel, which it defines for every device in torch ops
    (CompositeExplicitAutograd), run on tpu as on CUDA. ``_pack_padded_sequence`` reads
    its CPU ``lengths`` and makes ``batch_sizes`` on the CPU, where PackedSequence and
    the packed RNN kernels read it; its data comes from slices and a cat of the input,
    on the device. (The CPU fallback would move ``batch_sizes`` to tpu.)"""
    return func.redispatch(_PRIVATEUSE1_KEYS, *args, **kwargs)


_PRIVATEUSE1_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)


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


SPECIAL = {
    aten.native_batch_norm.default: _native_batch_norm,
    aten._pack_padded_sequence.default: _torch_kernel_for_every_device,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten.copy.default: _copy,
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
    aten.resize_as_.default: _resize_as_,
    aten.is_pinned.default: _no_op_false,
    aten._pin_memory.default: _cannot_pin,
    aten.record_stream.default: lambda func, args, kwargs: None,
    aten.set_.source_Tensor: _set_source_tensor,
    aten.set_.source_Storage: _set_source_storage,
    aten.set_.source_Storage_storage_offset: _set_source_storage,
    aten.as_strided_scatter.default: _as_strided_scatter,
    # Note [No nested tensors on tpu] (nested.py)
    aten._nested_tensor_from_mask_left_aligned.default: nested.not_left_aligned,
    aten._nested_tensor_from_mask.default: nested.refuse_nested_tensors,
}


def register(op, handler) -> None:
    """Give ``op`` a handler from a layer above the dispatcher (the distributed
    package's functional collectives). Registering an op twice raises."""
    if op in SPECIAL:
        raise ValueError(f"{op} already has a special handler")
    SPECIAL[op] = handler
