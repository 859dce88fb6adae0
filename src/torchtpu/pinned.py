"""Pinned host memory for the tpu device: ``tensor.pin_memory()``, ``is_pinned()``.

Registering "tpu" makes it torch's current accelerator, and torch then pins for it:
``pin_memory()`` (and ``DataLoader(pin_memory=True)``) ask the PrivateUse1 hooks for a
pinned-memory allocator. torch 2.13's Python hooks (``torch._C._acc.PrivateUse1Hooks``)
let Python override only ``is_available``, ``is_built`` and ``has_primary_context``;
``getPinnedMemoryAllocator`` and ``isPinnedPtr`` keep the base class's "not
implemented" / ``False``. So the two ops that reach them, ``_pin_memory`` and
``is_pinned``, get Python kernels on the CPU key here instead.

JAX copies host buffers to the device through its own staging, so page-locked memory
would buy nothing: a pinned tensor is a copy in ordinary memory whose storage this
module remembers, so that ``is_pinned()`` is true for it and its views, and
``pin_memory()`` of it returns it unchanged, as on CUDA. Pinning for another device
(``pin_memory("cuda")``, deprecated in torch) keeps torch's own kernels.

Nothing here imports JAX.
"""

from __future__ import annotations

import weakref

import torch

# Data pointers of the live pinned buffers. An entry leaves when its buffer is freed
# (the finalizer runs as the array is deallocated, before its memory can be reused),
# so a later ordinary allocation at the same address is never taken for pinned.
_live: set[int] = set()

_COMPOSITE = torch._C.DispatchKey.CompositeExplicitAutograd


def _for_tpu(device) -> bool:
    # None means the current accelerator, which is tpu once tpu is registered: torch
    # prefers a registered PrivateUse1 backend to every other accelerator.
    return device is None or torch.device(device).type == "tpu"


def pin_memory(self: torch.Tensor, device=None) -> torch.Tensor:
    """Kernel of ``aten::_pin_memory`` for CPU tensors."""
    if not _for_tpu(device):
        return torch.ops.aten._pin_memory.default._op_dk(_COMPOSITE, self, device)
    import numpy

    # As torch's kernel: same sizes and strides, storage offset 0.
    nbytes = 0
    if self.numel():
        extent = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride()))
        nbytes = extent * self.element_size()
    buffer = numpy.empty(max(nbytes, 1), dtype=numpy.uint8)
    address = buffer.ctypes.data
    _live.add(address)
    weakref.finalize(buffer, _live.discard, address)
    # The storage keeps ``buffer`` alive until torch frees it.
    storage = torch.from_numpy(buffer).untyped_storage()
    pinned = torch.empty(0, dtype=self.dtype).set_(storage, 0, self.shape, self.stride())
    return pinned.copy_(self)


def is_pinned(self: torch.Tensor, device=None) -> bool:
    """Kernel of ``aten::is_pinned`` for CPU tensors."""
    if not _for_tpu(device):
        return torch.ops.aten.is_pinned.default._op_dk(_COMPOSITE, self, device)
    return self.untyped_storage().data_ptr() in _live


def register(library: torch.library.Library) -> None:
    library.impl("_pin_memory", pin_memory, "CPU")
    library.impl("is_pinned", is_pinned, "CPU")
