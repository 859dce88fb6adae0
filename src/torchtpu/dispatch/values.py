"""Tensors and their values at the dispatcher's edge: wrapping a result array in a
new TPUTensor, reading a tensor's current value (`materialize`), and copying between
the host and a device.

Wrapping is on every op's path, so it is kept to one Storage and one wrapper tensor
built from metadata the plan computed once (`OutMeta`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from torchtpu import config, dtypes, memory, storage
from torchtpu.dispatch import defer, schema
from torchtpu.dispatch.checks import to_host
from torchtpu.dispatch.pending import Pending
from torchtpu.observe import metrics
from torchtpu.ops import view_chains
from torchtpu.runtime import jax, policy
from torchtpu.runtime.transfer import to_device
from torchtpu.storage import Storage
from torchtpu.tensor import TPUTensor

__all__ = ["OutMeta", "from_cpu", "host_value", "materialize", "move", "to_host", "upload", "wrap"]


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
    if (device != 0 or policy.active()) and type(array) is not Pending:
        array = _on_device(array, device, meta.dtype)
    s = Storage(array, meta.shape, meta.strides, meta.dtype, device)
    return TPUTensor(s, (), meta.shape, meta.strides, 0, meta.dtype)


def _on_device(array, device: int, dtype: torch.dtype):
    """``array`` where a storage of ``dtype`` on ``tpu:device`` keeps it."""
    if array is None:
        return None
    target = _home(device, dtype)
    if array.devices() != {target}:
        array = jax().device_put(array, target)
    return array


def from_cpu(t: torch.Tensor, index: int) -> TPUTensor:
    """A new TPUTensor holding a copy of CPU tensor ``t``."""
    array = upload(t, index)
    return wrap(array, OutMeta(tuple(t.shape), contiguous(t.shape), t.dtype), index)


def upload(t: torch.Tensor, index: int):
    """A JAX array on ``tpu:index`` holding a copy of CPU tensor ``t``; out of memory
    (the device's, or past ``set_per_process_memory_fraction``) is torch's
    OutOfMemoryError, as for an op."""
    if memory.limits:  # set_per_process_memory_fraction
        memory.check_room(t.numel() * t.element_size(), _copy_named(t), index)
    try:
        return to_device(t, index)
    except Exception as exc:
        error = memory.out_of_memory(exc, _copy_named(t), index)
        if error is exc:
            raise
        raise error from exc


def _copy_named(t: torch.Tensor) -> str:
    return f"a copy of a {t.dtype} tensor of shape {tuple(t.shape)} to tpu"


def _home(index: int, dtype: torch.dtype):
    """The JAX device a storage of ``dtype`` on ``tpu:index`` keeps its array on: the
    host for a dtype the platform policy keeps there (runtime/policy.py)."""
    if dtype in policy.host_dtypes():
        return policy.host_device()
    from torchtpu.runtime import device as jax_device

    return jax_device(index)


def move(x: TPUTensor, index: int) -> TPUTensor:
    """A copy of ``x`` on ``tpu:index``."""
    array = jax().device_put(materialize(x), _home(index, x.dtype))
    return wrap(array, OutMeta(tuple(x.shape), contiguous(x.shape), x.dtype), index)


# Programs reading a view through its chain, by (view, uninitialised base); counted
# as compiles "read".
_READERS = metrics.LRUCache("read_cache", lambda: config.op_cache_size)


def _base(s: Storage):
    """The storage's current base array (a pending one computed first), or None."""
    if type(s.array) is Pending:
        s.array = defer.resolve(s.array, "value read")
    return s.array


def materialize(t: TPUTensor):
    """The JAX array holding ``t``'s current value (its view chain applied)."""
    s = t._storage
    base = _base(s)
    if not t._chain and base is not None:
        return base
    if t.dtype in policy.host_dtypes() and s.dtype not in policy.host_dtypes():
        # A float64 view of int64 device memory: read on the host (runtime/policy.py)
        host = policy.host_device()
        if base is None:
            return _reader(t, host)()
        return _reader(t, None)(jax().device_put(base, host))
    if base is None:
        return _reader(t, _home(s.device_index, s.dtype))()
    return _reader(t, None)(base)


def _reader(t: TPUTensor, zeros_on):
    """The jitted read of ``t``'s view from its storage's base (or, for an uninitialised
    storage, from zeros made on the JAX device ``zeros_on``, committed there: Note
    [Every array is committed to its device] in builder.py), compiled once per layout;
    a view's positions are its arguments (Note [Positions are inputs], signature.py),
    so ``x[t]`` read for each ``t`` compiles once."""
    s = t._storage
    uninitialised = zeros_on is not None
    meta, positions = view_chains.meta_without_positions(t._meta) or (t._meta, ())
    chain = meta[4]
    # (the base's shape: a view's meta does not fix it, Note [A view's base is in its
    # key] in signature.py)
    key = (meta, s.shape, (s.dtype, zeros_on) if uninitialised else None)
    reader = _READERS.lookup(key)
    if reader is None:
        if uninitialised:
            shape, dtype = s.shape, dtypes.to_jax(s.dtype)
            jnp = jax().numpy

            def read(*positions):
                return view_chains.read(jnp.zeros(shape, dtype), chain, positions)

        else:

            def read(base, *positions):
                return view_chains.read(base, chain, positions)

        placed = jax().sharding.SingleDeviceSharding(zeros_on) if uninitialised else None
        reader = jax().jit(read, out_shardings=placed)
        _READERS.insert(key, reader)
        metrics.count("compiles", "read")
    if not positions:
        return reader
    return lambda *base: reader(*base, *positions)


_READ_OPS = metrics.LRUCache("read_op_cache", lambda: config.op_cache_size)


def queued_value(t: TPUTensor):
    """``t``'s value as an argument of a function DeferAndFuse records (a compiled
    graph's call): its base array, or the Pending value the queue will compute, and
    for a view of such a value the read of the view, recorded in that queue -- nothing
    runs now. Otherwise as `materialize`."""
    s = t._storage
    base = s.array
    if type(base) is Pending:
        if base.node_done():
            base = s.array = base.resolved()
        elif t._chain:
            key = (t._meta, s.shape)  # a chunk's key names ops, not the shapes they read
            op = _READ_OPS.lookup(key)
            if op is None:
                reader = _reader(t, None)

                def read(base, reader=reader):
                    return (reader(base),)

                aval = (tuple(t.shape), dtypes.to_jax(t.dtype))
                op = defer.FunctionOp("a view's read", read, read, [aval])
                _READ_OPS.insert(key, op)
            return defer.record(op, [base], op.avals, None, s.device_index)[0]
    if not t._chain and base is not None:
        return base
    return materialize(t)


# Note [Views read on the host]
#     Reading a view's values (``x[i].item()``, ``x.t().cpu()``, ``tolist()``) on the
#     device takes a program per view -- a new compile for every index, slice or
#     permutation a loop reads. Where the whole base is small (`_HOST_VIEW_BYTES`), it is
#     copied to the host instead and the view is taken there by torch's own CPU view ops
#     on that private copy: no program, and the strides are torch's. A view of a large
#     base is read on the device, so only its own bytes cross.
_HOST_VIEW_BYTES = 1 << 20


def host_value(t: TPUTensor) -> torch.Tensor:
    """A CPU tensor of ``t``'s current value, owning its memory: laid out as
    ``clone(memory_format=torch.preserve_format)`` lays it out (Note [Views read on the
    host]); pending value checks are raised first."""
    s = t._storage
    if not t._chain or math.prod(s.shape) * s.dtype.itemsize > _HOST_VIEW_BYTES:
        return to_host(materialize(t))
    base = _base(s)
    x = torch.zeros(s.shape, dtype=s.dtype) if base is None else to_host(base)
    for step in t._chain:
        x = _host_step(x, step)
    return x.clone(memory_format=torch.preserve_format)


def _host_step(x: torch.Tensor, step) -> torch.Tensor:
    op = step.op
    if op is torch.ops.aten.as_strided.default:
        # It addresses the storage laid out in memory (Note [Storage strides]).
        size, stride, offset, storage_strides = step.args
        memory = torch.empty_strided(x.shape, storage_strides, dtype=x.dtype)
        return memory.copy_(x).as_strided(size, stride, offset)
    args, kwargs = schema.info(op).split([x, *step.args])
    out = op(*args, **kwargs)
    out = out if step.index is None else out[step.index]
    # tpu computes conj and neg views (`_conj`, `_neg_view`): later steps see values.
    return out.resolve_conj().resolve_neg()
