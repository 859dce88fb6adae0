"""Storage and views: PyTorch's aliasing on top of immutable JAX arrays.

A `Storage` is a mutable cell holding the base array of a family of aliasing tensors,
plus a version number. Every TPUTensor is a Storage plus a *view chain*: the view ops
(with their static arguments) that lead from the base to the tensor. A plain tensor
has an empty chain.

- Reading a tensor applies its chain to the current base (``read`` in
  ops/view_chains.py, as everything that runs inside jitted code).
- Writing a tensor (an in-place op, ``copy_``, an ``out=`` op) computes its new value
  and writes it back through the chain (``write``): each view op has an inverse that
  puts a new view value back into the array it was taken from. Index-like views
  (slices, select, diagonal, unfold, as_strided, ...) share one generic inverse, a
  scatter at the positions the view reads; reshape-, permute- and dtype-like views
  register exact inverses with their lowering (``@lowers(..., view_inverse=...)``).
  As in torch, a tensor with a zero stride (``expand``) cannot be written to, though
  a view of it that holds one copy of each element can.

Both run inside the jitted function of the op that reads or writes, so a view costs
nothing extra at run time and XLA sees the whole computation.

See Note [Storage strides] for ``as_strided``.
"""

from __future__ import annotations

import math
import weakref
from typing import NamedTuple

import torch

from torchtpu import tracing


class ViewStep(NamedTuple):
    """One view op on the way from a base array to a tensor.

    ``op`` is the aten view op, ``args`` its static arguments after the tensor, and
    ``index`` selects one output of a multi-output view op (split, unbind).
    """

    op: torch._ops.OpOverload
    args: tuple
    index: int | None = None


class DynamicStep(NamedTuple):
    """A ``select``, ``slice`` or ``narrow`` step whose position is an input of the
    program rather than a constant: how a plan's key holds such a view, so that
    ``cache[:, :, t] = k`` or ``x[t]`` with a new ``t`` runs the same program
    (Note [Positions are inputs], dispatch/signature.py). ``dim`` is non-negative;
    ``length`` is the slice's (None for ``select``)."""

    op: torch._ops.OpOverload
    dim: int
    length: int | None


ViewChain = tuple  # tuple[ViewStep | DynamicStep, ...]


class Storage:
    """A mutable cell holding the base array shared by a tensor and its views.

    ``array`` is a JAX array of ``shape`` and ``dtype``, or None while the storage is
    uninitialised (``torch.empty``): it then reads as zeros, and nothing is allocated
    until something reads it.

    Note [Storage strides]: ``array`` is the *logical* value of the tensor that
    created the storage, while ``strides`` are the strides torch reports for it (from
    the meta kernel, e.g. transposed strides for ``a.t() + 1``). Only ``as_strided``,
    which addresses raw storage, needs them: it lays the array out in memory order
    first (`physical`).
    """

    __slots__ = (
        "array",
        "shape",
        "strides",
        "dtype",
        "device_index",
        "version",
        "_torch_storage",
        "handle_holders",
        "__weakref__",
    )

    def __init__(self, array, shape, strides, dtype: torch.dtype, device_index: int):
        self.array = array
        self.shape = tuple(shape)
        self.strides = tuple(strides)
        self.dtype = dtype
        self.device_index = device_index
        self.version = 0
        self._torch_storage = None
        # Weak references to the tensors whose torch.compile handle of this array is
        # cached (compile/handles.py), or None.
        self.handle_holders = None
        if tracing._active is not None:
            tracing._active.created.append(weakref.ref(self))

    def set(self, array) -> None:
        """Replace the base array (after a write)."""
        self.array = array
        self.version += 1
        if self.handle_holders is not None:
            self._drop_handles()

    def _drop_handles(self) -> None:
        """Forget the cached handles of the array just replaced: held there, the old
        array would outlive the write and could not be donated to the chunk that
        computes the new one (Note [Donating dead inputs] in defer.py), a parameter's
        buffer after each optimizer step of a torch.compile model."""
        for ref in self.handle_holders:
            t = ref()
            if t is not None:
                t.__dict__.pop("_handle_cache", None)
        self.handle_holders = None

    def torch_storage(self) -> torch.UntypedStorage:
        """The torch storage tensors on this Storage report (Note [Storage addresses])."""
        if self._torch_storage is None:
            nbytes = _extent(self.shape, self.strides) * self.dtype.itemsize
            address = _address_range(nbytes)
            self._torch_storage = torch._C._construct_storage_from_data_pointer(
                address, torch.device("tpu", self.device_index), nbytes
            )
            _OWNERS[address] = self
        return self._torch_storage

    def holds(self, offset: int, numel: int) -> bool:
        """Whether ``numel`` elements from ``offset`` fit: where resize_ keeps a tensor."""
        return offset + numel <= math.prod(self.shape)

    def __repr__(self) -> str:
        state = "uninitialised" if self.array is None else "initialised"
        return f"Storage({self.shape}, {self.dtype}, tpu:{self.device_index}, {state}, v{self.version})"


# Note [Host copies of uploads]
#     A small tensor just copied from the host (``torch.tensor([1, 5], device="tpu")``,
#     ``idx.to("tpu")``) keeps a private host copy of its values while its Storage
#     holds the array made from them; any write makes a new array, which the copy no
#     longer matches. Index ops check such index tensors against the indexed sizes at
#     once, as the CPU does, where a tensor computed on the device is checked by a
#     deferred value check (ops/value_checks.py).
_HOST_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
HOST_COPY_BYTES = 1 << 16


def keep_host_copy(storage: Storage, host: torch.Tensor) -> None:
    """Note that ``storage``'s current array holds ``host``'s values (a private copy).
    The array is held weakly: a strong reference would keep DeferAndFuse from donating
    it (Note [Donating dead inputs] counts references)."""
    _HOST_COPIES[storage] = (weakref.ref(storage.array), host)


def host_copy(storage: Storage) -> torch.Tensor | None:
    """The host copy of ``storage``'s values, if it still holds them (Note [Host copies
    of uploads])."""
    kept = _HOST_COPIES.get(storage)
    return kept[1] if kept is not None and kept[0]() is storage.array else None


# Note [Storage addresses]
#     torch code tells tensors apart, and finds those that share memory, by address:
#     ``t.data_ptr()``, ``t.untyped_storage().data_ptr()`` and ``nbytes()`` (safetensors
#     and Transformers' check for shared or tied weights, torch.save's deduplication).
#     A JAX buffer has no address torch could use, so each Storage gets a range of
#     addresses of its own, never reused in the process, as a CUDA allocation has one:
#     a torch storage on the tpu device with that (fake) data pointer, which no code
#     dereferences (a device pointer is not host memory). A tensor takes its Storage's
#     torch storage when Python first asks for an address (tensor.py); until then its
#     TensorImpl keeps the data-less one it was made with, so making a tensor costs
#     nothing more.
_next_address = [1 << 44]
_ALIGNMENT = 512  # as CUDA's caching allocator rounds


# The Storage each address range was given to, while it lives: ``set_(storage, ...)``
# finds the Storage behind a torch storage by its data pointer.
_OWNERS: weakref.WeakValueDictionary[int, Storage] = weakref.WeakValueDictionary()


def owner_of(storage: torch.UntypedStorage) -> Storage | None:
    """The Storage whose torch storage (Note [Storage addresses]) ``storage`` is."""
    return _OWNERS.get(storage.data_ptr())


def _address_range(nbytes: int) -> int:
    start = _next_address[0]
    _next_address[0] = start + max(_ALIGNMENT, -(-nbytes // _ALIGNMENT) * _ALIGNMENT)
    return start


def _extent(shape, strides) -> int:
    """Elements the layout spans: the numel for a dense layout, more for one with gaps
    (a compiled graph's result that views part of an intermediate, ``y[..., :3]``)."""
    if 0 in shape:
        return 0
    return max(math.prod(shape), 1 + sum((n - 1) * s for n, s in zip(shape, strides)))


def physical(base, strides):
    """``base`` laid out as a flat array in memory order (Note [Storage strides])."""
    from torchtpu.runtime import jax

    jnp = jax().numpy
    shape = base.shape
    contiguous = _contiguous_strides(shape)
    if tuple(strides) == contiguous or base.ndim == 0:
        return base.reshape(-1)
    size = 1 + sum((n - 1) * s for n, s in zip(shape, strides) if n > 0)
    position = jnp.zeros(shape, jnp.int64)
    for dim, (n, s) in enumerate(zip(shape, strides)):
        axis = [1] * len(shape)
        axis[dim] = n
        position = position + (jnp.arange(n, dtype=jnp.int64) * s).reshape(axis)
    return jnp.zeros(size, base.dtype).at[position.reshape(-1)].set(base.reshape(-1))


def from_physical(flat, shape, strides):
    """Inverse of `physical`: the logical array stored in ``flat``."""
    from torchtpu.runtime import jax

    jnp = jax().numpy
    if len(shape) == 0:
        return flat[0]
    if tuple(strides) == _contiguous_strides(shape):
        return flat[: _numel(shape)].reshape(shape)
    position = jnp.zeros(shape, jnp.int64)
    for dim, (n, s) in enumerate(zip(shape, strides)):
        axis = [1] * len(shape)
        axis[dim] = n
        position = position + (jnp.arange(n, dtype=jnp.int64) * s).reshape(axis)
    return flat[position]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))
