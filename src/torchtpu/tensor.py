"""TPUTensor: a torch tensor on the "tpu" device whose data is a JAX array.

A TPUTensor is a wrapper subclass: torch sees its metadata (shape, strides, dtype,
device) and routes every aten op to ``__torch_dispatch__``; the data lives in a
`Storage` (a mutable cell holding a JAX array) reached through a view chain
(see storage.py). Metadata never forces a computation.
"""

from __future__ import annotations

import torch
from torch._tensor_str import PRINT_OPTS, _add_suffixes, _tensor_str

from torchtpu import dtypes
from torchtpu.storage import Storage, ViewChain

_dispatch = None  # torchtpu.dispatch.dispatch, imported on first use (it imports JAX)

# torch.device objects, one per index, built once.
_DEVICES: dict[int, torch.device] = {}


def tpu_device(index: int) -> torch.device:
    dev = _DEVICES.get(index)
    if dev is None:
        dev = _DEVICES[index] = torch.device("tpu", index)
    return dev


class TPUTensor(torch.Tensor):
    """A tensor on the tpu device. Create one with ``torch.*(..., device="tpu")``,
    ``t.to("tpu")`` or ``torchtpu.to_tpu(t)``; never directly."""

    _storage: Storage
    _chain: ViewChain
    # (shape, strides, storage_offset, dtype, chain): what a compiled op needs to know
    # about this argument besides its base array. Hashable; part of cache keys.
    _meta: tuple

    @staticmethod
    def __new__(
        cls,
        storage: Storage,
        chain: ViewChain,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        offset: int,
        dtype: torch.dtype,
        requires_grad: bool = False,
    ):
        if dtype not in dtypes.SUPPORTED:
            dtypes.check_supported(dtype)
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=strides,
            storage_offset=offset,
            dtype=dtype,
            device=tpu_device(storage.device_index),
            requires_grad=requires_grad,
        )
        t._storage = storage
        t._chain = chain
        t._meta = (shape, strides, offset, dtype, chain)
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        global _dispatch
        if _dispatch is None:
            from torchtpu.dispatch import dispatch as _dispatch
        return _dispatch(func, args, kwargs or {})

    # ``t.data = new`` swaps torch's metadata in C++; the data must follow. (nn.Module
    # conversions such as ``model.half()`` assign ``param.data`` this way.)
    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new):
        torch._C.TensorBase.data.__set__(self, new)
        if isinstance(new, TPUTensor):
            self._storage, self._chain, self._meta = new._storage, new._chain, new._meta

    # -- reading values ---------------------------------------------------------------

    def numpy(self, *, force: bool = False):
        if not force and self.requires_grad:
            raise RuntimeError(
                "Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead."
            )
        return self.detach().cpu().numpy()

    def tolist(self):
        return self.detach().cpu().tolist()

    def __array__(self, dtype=None, copy=None):
        array = self.numpy(force=True)
        return array if dtype is None else array.astype(dtype)

    def __repr__(self, *, tensor_contents=None) -> str:
        return _repr(self)

    # -- pickling -----------------------------------------------------------------------

    def __reduce_ex__(self, protocol):
        # Save the values, not the Storage object: a loaded tensor is a fresh tpu tensor.
        rebuilt = (
            torch._utils._rebuild_device_tensor_from_cpu_tensor,
            (self.detach().cpu(), self.dtype, str(self.device), self.requires_grad),
        )
        if getattr(self, "_is_param", False):
            return (torch._utils._rebuild_parameter, (_Reduced(rebuilt), self.requires_grad, {}))
        return rebuilt


def empty_tensor(shape, strides, dtype: torch.dtype, device: int) -> TPUTensor:
    """A new tensor on an uninitialised storage (reads as zeros; allocates nothing)."""
    shape, strides = tuple(shape), tuple(strides)
    return TPUTensor(Storage(None, shape, strides, dtype, device), (), shape, strides, 0, dtype)


class _Reduced:
    """Pickles as the object a reduce tuple rebuilds (for nesting in a Parameter)."""

    def __init__(self, reduce_tuple):
        self._reduce_tuple = reduce_tuple

    def __reduce__(self):
        return self._reduce_tuple


def _repr(t: TPUTensor) -> str:
    """PyTorch's text for the same tensor on the CPU, with ``device='tpu:i'`` added.

    Mirrors ``torch._tensor_str._str_intern`` for strided dense tensors; the values are
    formatted by torch's own code.
    """
    prefix = "tensor("
    indent = len(prefix)
    suffixes = [f"device='{t.device}'"]
    default = torch.get_default_dtype()
    default_complex = torch.cdouble if default == torch.double else torch.cfloat
    has_default_dtype = t.dtype in (default, default_complex, torch.int64, torch.bool)
    with torch.no_grad():
        if t.numel() == 0:
            if t.dim() != 1:
                suffixes.append(f"size={tuple(t.shape)}")
            if t.dtype != default:
                suffixes.append(f"dtype={t.dtype}")
            contents = "[]"
        else:
            if not PRINT_OPTS.edgeitems:
                suffixes.append(f"size={tuple(t.shape)}")
            if not has_default_dtype:
                suffixes.append(f"dtype={t.dtype}")
            # Small tensors: one copy to the host. Large ones are summarised, and torch's
            # printer only reads the edges, so let it walk the device tensor.
            source = t.detach()
            if t.numel() <= PRINT_OPTS.threshold:
                source = source.cpu()
            contents = _tensor_str(source, indent)
    try:
        grad_fn = t.grad_fn
        grad_fn_name = None if grad_fn is None else type(grad_fn).__name__
    except RuntimeError:
        grad_fn_name = "Invalid"
    if grad_fn_name == "CppFunction":
        grad_fn_name = t.grad_fn.name().rsplit("::", 1)[-1]
    if grad_fn_name is not None:
        suffixes.append(f"grad_fn=<{grad_fn_name}>")
    elif t.requires_grad:
        suffixes.append("requires_grad=True")
    text = _add_suffixes(prefix + contents, suffixes, indent, force_newline=False)
    if getattr(t, "_is_param", False):
        text = "Parameter containing:\n" + text
    return text
