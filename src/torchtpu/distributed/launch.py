"""Starting JAX's multi-process runtime from what torch.distributed was given.

``init_process_group("tpu")`` reaches `initialize` with the group's rank, size and
c10d store. torchrun's ``MASTER_ADDR``/``MASTER_PORT`` (or the setting
``config.distributed_coordinator``) say where JAX's coordinator listens; without
either (``mp.spawn`` with ``init_method="tcp://..."``), rank 0 binds a free port on
the store's host and publishes the address through the store.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
from datetime import timedelta

from torchtpu import config, runtime
from torchtpu.distributed import liveness

_COORDINATOR_KEY = "torchtpu/jax_coordinator"

# (world size, rank) of the JAX runtime this process initialised; None before.
_initialized: tuple[int, int] | None = None


def initialize(store, rank: int, world_size: int, timeout: timedelta) -> None:
    """Initialise ``jax.distributed`` for ``world_size`` processes (once per process).

    Raises RuntimeError if JAX's backend already started: it cannot become
    multi-process afterwards."""
    global _initialized
    if _initialized is not None:
        if _initialized != (world_size, rank):
            raise RuntimeError(
                f"torchtpu's JAX runtime was initialised as rank {_initialized[1]} of "
                f"{_initialized[0]}; it cannot be re-initialised as rank {rank} of {world_size} "
                "in the same process"
            )
        return
    if world_size > 1 and runtime.started():
        raise RuntimeError(
            'torch.distributed.init_process_group("tpu") must be called before any tpu '
            "tensor is created (or any other JAX computation runs): JAX's runtime has "
            "already started in this process as a single process, and it cannot join "
            f"{world_size} processes afterwards. Call init_process_group first, at the top "
            "of the script."
        )
    if world_size > 1:
        jax = runtime.jax()
        kwargs = {}
        local_ids = _local_device_ids()
        if local_ids is not None:
            kwargs["local_device_ids"] = local_ids
        jax.distributed.initialize(
            coordinator_address=_coordinator(store, rank, timeout),
            num_processes=world_size,
            process_id=rank,
            initialization_timeout=max(int(timeout.total_seconds()), 1),
            **kwargs,
        )
        # Start the backend now, while every rank is here: on the CPU its start waits
        # for every process's topology, so a rank that leaves right after
        # init_process_group would hold the others' first tpu tensor for minutes.
        runtime.devices()
        liveness.start(rank, world_size)
        _exit_at_once_on_failure(rank)
        if os.environ.get("TORCHELASTIC_RUN_ID") is not None:
            # Note [SIGTERM under torchrun]: JAX's runtime catches SIGTERM (a notice of
            # preemption, for its preemption sync), so a rank torchrun stops after a
            # peer failed would live on until torchrun's SIGKILL 30 s later.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _initialized = (world_size, rank)


def _exit_at_once_on_failure(rank: int) -> None:
    """Note [A failing rank exits at once]
    At exit, ``jax.distributed`` waits for every process at a shutdown barrier (up to
    300 s). A rank leaving with an uncaught exception would wait there for peers that
    are themselves waiting for it in a collective, and the launch would hang instead
    of torchrun seeing the failure and stopping the others. So after an uncaught
    exception (its traceback printed as usual) the process tells the other ranks how it
    failed and exits with status 1 before JAX's exit handler runs. A rank whose program
    ends tells them it exited and waits until they have all left before it reaches the
    barrier; if one of them fails or is gone first, it exits with status 1 at once
    (Note [Liveness] in liveness.py: the ranks still waiting for it raise an error).
    Rank 0 hosts JAX's coordination service, whose end aborts the other processes: a
    failing rank 0 first lingers a moment, so that they can raise their own error."""
    previous = sys.excepthook
    failed = []

    def hook(kind, value, tb):
        failed.append(kind)
        previous(kind, value, tb)
        liveness.leave(f"raised {kind.__name__}: {str(value)[:500]}")

    def leave() -> None:
        if not failed:
            liveness.leave(liveness.EXITED)
            if liveness.wait_for_the_others():
                return
        elif rank == 0:
            liveness.linger()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    sys.excepthook = hook
    atexit.register(leave)  # after JAX's own handler, so it runs before it


def _coordinator(store, rank: int, timeout: timedelta) -> str:
    if config.distributed_coordinator:
        return config.distributed_coordinator
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        # torchrun's store listens on MASTER_PORT; the coordinator takes the next one.
        return f"{addr}:{int(port) + 1}"
    if rank == 0:
        host = _store_host(store)
        with socket.socket() as s:  # a port free now; JAX binds it a moment later
            s.bind((host, 0))
            address = f"{host}:{s.getsockname()[1]}"
        store.set(_COORDINATOR_KEY, address)
        return address
    store.wait([_COORDINATOR_KEY], timeout)
    return store.get(_COORDINATOR_KEY).decode()


def _store_host(store) -> str:
    """The host rank 0's store listens on (the ``tcp://`` address): reachable by every
    rank, so the coordinator can listen there too."""
    while hasattr(store, "underlying_store"):  # PrefixStore
        store = store.underlying_store
    host = getattr(store, "host", None)
    if host:
        return host
    return socket.gethostbyname(socket.gethostname())


def _local_device_ids() -> list[int] | None:
    """The devices this process takes on a GPU host: the one of its LOCAL_RANK, as DDP
    does with CUDA (one process per GPU). Elsewhere JAX's own default: on a TPU host
    the TPU_* variables (docs/distributed.md) choose the chip before libtpu loads; on
    the CPU each process has one device."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and ("cuda" in platforms or "gpu" in platforms):
        return [int(local_rank)]
    return None


def initialized() -> tuple[int, int] | None:
    """(world size, rank) once `initialize` ran in this process, else None."""
    return _initialized
