"""FSDP2's freeing and re-allocating of a parameter's storage, for tpu tensors.

FSDP2 frees an unsharded parameter after use with ``untyped_storage().resize_(0)`` and
re-allocates it before the next all-gather with ``resize_(nbytes)``. A tpu tensor's
torch storage holds no data (its values are a JAX array in its own ``Storage``), and
torch refuses to resize it. So FSDP's two helpers are wrapped: for a tpu tensor,
freeing drops the JAX array (every view of the storage loses it, as with a resized
storage; reading it gives zeros until written), and allocating does nothing (the
next write makes a new array). Other tensors go to FSDP's own helpers.

The wrap is installed by the first collective after FSDP2's module is imported:
importing it ourselves would cost a second at every ``init_process_group``.
"""

from __future__ import annotations

import sys

from torchtpu.tensor import TPUTensor

_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param"
_installed = False


def install_if_imported() -> None:
    global _installed
    if _installed:
        return
    module = sys.modules.get(_MODULE)
    if module is None:
        return
    _installed = True
    free, alloc = module.free_storage, module.alloc_storage

    def free_storage(tensor) -> None:
        if isinstance(tensor, TPUTensor):
            tensor._storage.array = None
            return
        free(tensor)

    def alloc_storage(tensor) -> None:
        if isinstance(tensor, TPUTensor):
            return
        alloc(tensor)

    module.free_storage, module.alloc_storage = free_storage, alloc_storage
    group_module = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_param_group")
    if group_module is not None and getattr(group_module, "alloc_storage", None) is alloc:
        group_module.alloc_storage = alloc_storage
