"""Moving values between torch's CPU tensors and JAX device arrays.

DLPack is zero-copy both ways on the CPU backend, which would make a JAX array and a
torch tensor share memory: a later in-place op on either would change the other. So
each direction copies exactly once.
"""

from __future__ import annotations

import numpy as np
import torch

from torchtpu import dtypes, tracing
from torchtpu.observe import locations, metrics, perf_warnings
from torchtpu.runtime import device, jax, platform, policy


def to_device(cpu_tensor: torch.Tensor, index: int):
    """A JAX array on ``tpu:index`` holding a copy of ``cpu_tensor``'s values (on the
    host, for a dtype the platform policy keeps there: runtime/policy.py)."""
    if cpu_tensor.device.type != "cpu":  # a meta tensor has no values to copy
        raise NotImplementedError(f"Cannot copy out of {cpu_tensor.device.type} tensor; no data!")
    t = cpu_tensor.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    # The copy becomes the JAX array's buffer; nothing else holds it.
    private = t.clone(memory_format=torch.contiguous_format)
    jx = jax()
    array = jx.dlpack.from_dlpack(private)
    target = policy.host_device() if t.dtype in policy.host_dtypes() else device(index)
    if array.devices() != {target}:
        array = jx.device_put(array, target)
    metrics.count("transfer_bytes", "to_device", private.numel() * private.element_size())
    return array


def note_read(array) -> None:
    """Account for reading ``array``'s values on the host (refused inside a trace)."""
    if tracing._active is not None and isinstance(array, jax().core.Tracer):
        tracing.refuse("reading a tensor's values (.item(), .cpu(), print, bool(), ...)")
    perf_warnings.note_read(by_torch_at=locations.read_by_torch())
    metrics.count("transfer_bytes", "to_host", array.size * array.dtype.itemsize)


def to_host(array) -> torch.Tensor:
    """A CPU tensor holding a copy of ``array``'s values (waits for them). The
    dispatcher raises failed value checks first (dispatch/checks.py ``to_host``)."""
    note_read(array)
    jx = jax()
    (dev,) = array.devices()
    if dev.platform != "cpu":
        array = jx.device_put(array, jx.local_devices(backend="cpu")[0])
    metrics.count("reads", "waits")
    return torch.from_dlpack(array).clone()


# Values up to this size are read as NumPy arrays together with the flags of pending
# checks (dispatch/checks.py): a loss, a metric, a printed tensor. Larger ones take
# to_host's path after the flags: their copy dominates, and a NumPy read would leave a
# host copy cached on the JAX array for as long as it lives.
_READ_WITH_CHECKS_BYTES = 1 << 16


def reads_with_checks(array) -> bool:
    """Whether ``array`` is read in one round trip with the pending checks' flags."""
    return array.size * array.dtype.itemsize <= _READ_WITH_CHECKS_BYTES


def from_numpy(value: np.ndarray) -> torch.Tensor:
    """A CPU tensor of a value `read_all` returned (a copy: NumPy's may be read-only)."""
    if value.dtype.isbuiltin == 2:  # ml_dtypes' bfloat16, float8_*: torch reads their bits
        # (np.require, not np.ascontiguousarray: that makes a 0-d value 1-d.)
        bits = np.require(value, requirements="C").view(f"u{value.dtype.itemsize}")
        return torch.from_numpy(bits.copy()).view(dtypes.to_torch(value.dtype))
    return torch.from_numpy(np.array(value, copy=True))


def read_all(arrays: list) -> list:
    """The values of ``arrays`` as NumPy arrays (waits for them), e.g. the flags of
    pending value checks.

    On the CPU backend an array's buffer is host memory already: ``np.asarray`` reads it
    in about a microsecond, while ``jax.device_get`` first starts a host copy of each
    (``copy_to_host_async``, 10-15 us an array there, paid at every read of a value
    that has a check pending). Elsewhere all copies are started first, so they
    overlap."""
    metrics.count("reads", "waits")
    if platform() == "cpu":
        return [np.asarray(a) for a in arrays]
    return jax().device_get(list(arrays))
