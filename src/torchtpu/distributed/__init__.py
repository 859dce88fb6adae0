"""torch.distributed on tpu: the ``"tpu"`` c10d backend over JAX's multi-process runtime.

::

    # torchrun --nproc_per_node=2 train.py
    import torch.distributed as dist
    dist.init_process_group("tpu")          # before any tpu tensor is made
    model = torch.nn.parallel.DistributedDataParallel(model.to("tpu"))

`register()` runs with the device's registration (so ``import torch`` alone is
enough) and imports nothing heavy: JAX starts when the first group is made.
launch.py starts JAX's runtime, process_group.py is the backend, collectives.py the
JAX programs. See docs/distributed.md.
"""

from __future__ import annotations

__all__ = ["BACKEND_NAMES", "CollectiveMismatchError", "register"]

#: The names ``init_process_group`` accepts for this backend (``"tpu_dist"`` as TorchTPU).
BACKEND_NAMES = ("tpu", "tpu_dist")

_registered = False


class CollectiveMismatchError(RuntimeError):
    """Ranks of a group called different collectives (or the same one on different
    shapes, dtypes, reduce ops or roots) at the same point. Raised on every rank."""


def register() -> None:
    """Register the backend with torch.distributed under `BACKEND_NAMES` (idempotent)."""
    global _registered
    if _registered:
        return
    import torch.distributed as dist

    if not dist.is_available():
        return
    for name in BACKEND_NAMES:
        if name.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(name, _create, extended_api=True, devices=["tpu"])
    _registered = True


def _create(options, backend_options=None):
    """The creator torch calls for a new group: starts JAX's multi-process runtime for
    the first (world) group, then makes the group."""
    from torchtpu.distributed import launch

    ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
    if launch.initialized() is None:
        launch.initialize(options.store, options.group_rank, options.group_size, options.timeout)
    # Only now: importing the dispatcher asks JAX which platform it runs on.
    from torchtpu.distributed.process_group import ProcessGroupTPU

    return ProcessGroupTPU(options.store, options.group_rank, options.group_size, ranks)
