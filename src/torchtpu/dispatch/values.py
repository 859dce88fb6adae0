"""Tensors and their values at the dispatcher's edge: wrapping a result array in a
new TPUTensor, reading a tensor's current value (`materialize`), and copying between
the host and a device.

Wrapping is on every op's path, so it is kept to one Storage and one wrapper tensor
built from metadata the plan computed once (`OutMeta`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchtpu import dtypes, storage
from torchtpu.dispatch import defer
from torchtpu.dispatch.checks import to_host
from torchtpu.dispatch.pending import Pending
from torchtpu.ops import view_chains
from torchtpu.runtime import jax
from torchtpu.runtime.transfer import to_device
from torchtpu.storage import Storage
from torchtpu.tensor import TPUTensor

__all__ = ["OutMeta", "from_cpu", "materialize", "move", "to_host", "wrap"]


class OutMeta(NamedTuple):
    """What a new tensor looks like: torch's sizes, strides and dtype for it."""

    shape: tuple
    strides: tuple
    dtype: torch.dtype

    @property
    def meta(self) -> tuple:
        """The ``TPUTensor._meta`` of a fresh tensor like this (no offset, no view)."""
        return (self.shape, self.strides, 0, self.dtype, ())


# An output whose meta kernel is missing: sized by jax.eval_shape instead.
UNKNOWN = OutMeta((), (), torch.float32)


def contiguous(shape) -> tuple:
    return storage._contiguous_strides(tuple(shape))


def wrap(array, meta: OutMeta, device: int) -> TPUTensor:
    """A new TPUTensor owning ``array`` (a fresh Storage)."""
    if device != 0 and type(array) is not Pending:
        array = _on_device(array, device)
    s = Storage(array, meta.shape, meta.strides, meta.dtype, device)
    return TPUTensor(s, (), meta.shape, meta.strides, 0, meta.dtype)


def _on_device(array, device: int):
    if array is None:
        return None
    from torchtpu.runtime import device as jax_device

    target = jax_device(device)
    if array.devices() != {target}:
        array = jax().device_put(array, target)
    return array


def from_cpu(t: torch.Tensor, index: int) -> TPUTensor:
    """A new TPUTensor holding a copy of CPU tensor ``t``."""
    array = to_device(t, index)
    return wrap(array, OutMeta(tuple(t.shape), contiguous(t.shape), t.dtype), index)


def move(x: TPUTensor, index: int) -> TPUTensor:
    """A copy of ``x`` on ``tpu:index``."""
    from torchtpu.runtime import device as jax_device

    array = jax().device_put(materialize(x), jax_device(index))
    return wrap(array, OutMeta(tuple(x.shape), contiguous(x.shape), x.dtype), index)


_READERS: dict = {}


def materialize(t: TPUTensor):
    """The JAX array holding ``t``'s current value (its view chain applied)."""
    s = t._storage
    if type(s.array) is Pending:
        if not s.array.node_done():
            defer.flush_pending(s.array, "value read")
        s.array = s.array.resolved()
    if not t._chain and s.array is not None:
        return s.array
    key = (t._meta, None if s.array is not None else (s.shape, s.dtype))
    reader = _READERS.get(key)
    if reader is None:
        chain = t._chain
        if s.array is None:
            shape, dtype = s.shape, dtypes.to_jax(s.dtype)
            jnp = jax().numpy

            def read():
                return view_chains.read(jnp.zeros(shape, dtype), chain)

        else:

            def read(base):
                return view_chains.read(base, chain)

        reader = _READERS[key] = jax().jit(read)
    if s.array is None:
        if s.device_index != 0:
            from torchtpu.runtime import device as jax_device

            with jax().default_device(jax_device(s.device_index)):
                return reader()
        return reader()
    return reader(s.array)
