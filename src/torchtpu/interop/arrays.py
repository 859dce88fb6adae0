"""tpu tensors to and from ``jax.Array`` (``torchtpu.to_jax``, ``torchtpu.from_jax``),
and the DLPack protocol of TPUTensor.

Note [What costs a copy]
    A tpu tensor's data is a Storage holding a base array (storage.py). A tensor that
    *is* its storage's base (no view chain: what an op, a factory or ``from_jax`` made)
    hands out that very array: ``to_jax`` copies nothing, and ``from_jax`` wraps the
    array it is given in a new Storage, copying nothing either. A view (a slice, a
    transpose, a reshape of another tensor) is read through its chain by one jitted
    call, which makes a new, contiguous array: JAX has no strided views, and even a
    reshape is a new buffer outside a jitted program. A DeferAndFuse value still in
    the queue is computed first (a flush with reason "to_jax").

Note [Aliasing between tensors and arrays]
    JAX arrays are immutable and torch tensors are not. An in-place op on a tpu tensor
    rebinds its Storage to a new array: an array handed out before by ``to_jax`` keeps
    the old values, and the tensor made by ``from_jax(a)`` stops sharing ``a`` at its
    first in-place write. Views of that tensor do follow it, as views do. Nothing
    written through JAX can reach a tensor (JAX cannot write), so the only aliasing
    that is visible is the one DLPack hands to a mutable consumer: on the CPU backend
    ``torch.from_dlpack(tpu_tensor)`` is a CPU tensor on the same host memory, and
    writing to it changes the tpu tensor, as ``torch.from_dlpack(jax_array)`` would.
"""

from __future__ import annotations

import torch

from torchtpu import dtypes, tracing
from torchtpu import tensor as tensor_module
from torchtpu.dispatch import defer
from torchtpu.dispatch.pending import Pending
from torchtpu.dispatch.values import OutMeta, contiguous, materialize, wrap
from torchtpu.observe import metrics
from torchtpu.runtime import current_index, devices, jax, policy
from torchtpu.tensor import TPUTensor

__all__ = ["from_dlpack", "from_jax", "to_jax"]


def to_jax(tensor: torch.Tensor):
    """The value of tpu tensor ``tensor`` as a ``jax.Array`` on the same device.

    No copy when the tensor is its storage's whole base array (Note [What costs a
    copy]); a view is made contiguous first. A pending DeferAndFuse value is computed
    first. Autograd does not follow the array: use `torchtpu.jax_op` for a JAX
    computation that torch should differentiate. Example::

        x = torch.randn(4, 4, device="tpu")
        a = torchtpu.to_jax(x)              # the array x holds, not a copy
        b = torchtpu.to_jax(x.T)            # a view: one jitted read, a new array
    """
    if not isinstance(tensor, TPUTensor):
        raise TypeError(
            f"to_jax: expected a tpu tensor, got a {_describe(tensor)}; move it with "
            "t.to('tpu') first (or use jax.dlpack.from_dlpack(t) for a CPU tensor)"
        )
    if tensor._inner is not None:
        raise RuntimeError(
            "to_jax: this tensor is traced by torch.compile and has no value; wrap the JAX "
            "code in @torchtpu.jax_op to call it inside a compiled function"
        )
    s = tensor._storage
    if type(s.array) is Pending and not s.array.node_done():
        defer.flush_pending(s.array, "to_jax")
    copied = bool(tensor._chain) or s.array is None
    metrics.count("interop", "to_jax copied" if copied else "to_jax zero-copy")
    return materialize(tensor)


def from_jax(array) -> torch.Tensor:
    """A tpu tensor holding ``array`` (a ``jax.Array`` on one device), without a copy.

    The tensor is on the tpu device of the array's device; its dtype is the torch
    dtype of the array's. Writing to the tensor in place afterwards leaves ``array``
    unchanged (Note [Aliasing between tensors and arrays]). Example::

        a = jax.numpy.linspace(0, 1, 5)
        t = torchtpu.from_jax(a)            # tensor([0.0000, 0.2500, ...], device='tpu:0')
    """
    jx = jax()
    if not isinstance(array, jx.Array):
        raise TypeError(
            f"from_jax: expected a jax.Array, got {type(array).__name__}; use "
            "jax.numpy.asarray(x) first (or torchtpu.from_dlpack for a DLPack producer)"
        )
    try:
        dtype = dtypes.to_torch(array.dtype)
    except (KeyError, TypeError):
        raise TypeError(f"from_jax: torch has no dtype for a jax array of {array.dtype}") from None
    index = _device_index(array, dtype)
    if dtype in policy.host_dtypes() and array.devices() != {policy.host_device()}:
        array = jx.device_put(array, policy.host_device())  # where such tensors live
    shape = tuple(array.shape)
    metrics.count("interop", "from_jax zero-copy")
    return wrap(array, OutMeta(shape, contiguous(shape), dtype), index)


def from_dlpack(obj) -> torch.Tensor:
    """A tpu tensor from any DLPack producer (a CPU torch tensor, a numpy array, a jax
    array, a tpu tensor) or a legacy DLPack capsule (``torch.utils.dlpack.to_dlpack``).

    ``jax.dlpack.from_dlpack`` imports it: no copy where JAX can share the memory (host
    memory on the CPU backend); otherwise it is copied to the device. Example::

        t = torchtpu.from_dlpack(torch.utils.dlpack.to_dlpack(tpu_tensor))
    """
    if isinstance(obj, TPUTensor):
        return from_jax(to_jax(obj))
    if type(obj).__name__ == "PyCapsule":  # legacy capsule: torch reads it, JAX cannot
        obj = torch.utils.dlpack.from_dlpack(obj)
    jx = jax()
    array = jx.dlpack.from_dlpack(obj)
    target = devices()[current_index()]
    if array.devices() != {target}:
        array = jx.device_put(array, target)
    return from_jax(array)


def _device_index(array, dtype: torch.dtype) -> int:
    if tracing._active is not None and isinstance(array, jax().core.Tracer):
        return current_index()  # an array of the program being traced (torchtpu.jit)
    placed = array.devices()
    if len(placed) != 1:
        raise ValueError(
            f"from_jax: the array is sharded over {len(placed)} devices; a tpu tensor lives "
            "on one (jax.device_put(array, device) gathers it)"
        )
    (where,) = placed
    if where in devices():
        return devices().index(where)
    if dtype in policy.host_dtypes() and where == policy.host_device():
        # float64 and complex128 tensors keep their arrays on the host on a TPU
        # (runtime/policy.py): this is what to_jax hands out for one.
        return current_index()
    raise ValueError(
        f"from_jax: the array is on {where}, which is not a tpu device (those are "
        f"{list(devices())}); jax.device_put(array, jax.devices()[0]) moves it"
    )


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.device} tensor"
    return type(value).__name__


# -- the DLPack protocol of TPUTensor (tensor.py calls these through its hooks) ------------


def dlpack_capsule(tensor: TPUTensor, kwargs: dict):
    """``tensor.__dlpack__(**kwargs)``: the capsule of its jax array (`to_jax`)."""
    if tensor.requires_grad:
        raise BufferError("Can't export tensors that require gradient, use tensor.detach()")
    array = _exportable(to_jax(tensor))
    return array.__dlpack__(**{k: v for k, v in kwargs.items() if v is not None})


def dlpack_device(tensor: TPUTensor):
    """``tensor.__dlpack_device__()``: the DLPack device of its jax array."""
    return _exportable(to_jax(tensor)).__dlpack_device__()


# The platforms whose memory JAX exports through DLPack.
_DLPACK_PLATFORMS = ("cpu", "cuda", "rocm", "gpu")


def _exportable(array):
    """``array``, if DLPack can share its memory; else a BufferError saying what to do.
    (JAX exports host and GPU memory only: on a TPU it raises a BufferError or an
    XLA error, depending on the call, that names neither the tensor nor a way out.)"""
    (where,) = array.devices()
    if where.platform not in _DLPACK_PLATFORMS:
        raise BufferError(
            f"a tpu tensor on {where.platform.upper()} memory cannot be shared through "
            "DLPack (JAX exports CPU and GPU memory only): copy it with t.cpu(), or hand "
            "it to JAX with torchtpu.to_jax(t)"
        )
    return array


tensor_module.hooks.dlpack_capsule = dlpack_capsule
tensor_module.hooks.dlpack_device = dlpack_device
