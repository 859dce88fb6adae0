"""Noticing that another rank is gone, instead of waiting for it for ever.

Note [Liveness]
A collective waits for the other ranks of its group twice: for their keys in the c10d
store (the shape check, ``process_group._agree``) and inside its JAX program (gloo on
the CPU). A rank that is gone never comes, and the wait would last the group's timeout
(30 minutes) or for ever. A rank whose program ended early (``sys.exit``) is not even
gone: it waits in JAX's shutdown barrier for the ranks that wait for it, so no launcher
sees it end either.

Each process of a multi-process run keeps, in the key-value store of JAX's coordination
service (which lives as long as JAX's runtime, after ``destroy_process_group`` too):
- a heartbeat: a watcher thread adds 1 to ``torchtpu/beat/<rank>`` every tick (a
  quarter of ``config.distributed_liveness_timeout``, at most 1 s);
- a notice of how it left, ``torchtpu/left/<rank>``: set when its program ends (before
  JAX's shutdown barrier) or it dies of an uncaught exception (launch.py).

While the main thread waits in a collective, the watcher reads both on every tick. A rank
of the group that left, or whose heartbeat has not moved for the timeout (killed, or its
host lost), is gone:
- a wait for store keys ends at once: the watcher writes each key a gone rank owes
  (``compare_set``: only if it is still missing) as a `Gone`, and every rank waiting
  for it raises DistBackendError naming it;
- a program that fails (gloo sees the peer's connection close) raises DistBackendError
  naming the gone rank, once the heartbeats tell which (up to the timeout: only for
  errors that read like a lost peer, so that other errors are not delayed);
- a program cannot be interrupted: one still running a timeout after a rank of its group
  went (the check is off, or a recv from a rank that exited) makes the watcher log the
  error and end the process with status 1, as NCCL's watchdog does.

Only eager collectives are watched: a compiled program (torchtpu.jit, torch.compile)
that holds a collective waits inside it like any other program, unwatched.

A rank whose program ends waits, before JAX's shutdown barrier, until every other rank
has left too (at most 300 s, as that barrier); if one fails or is gone instead, it exits
with status 1 at once rather than wait at the barrier for a rank that never comes. A
failing rank 0 lingers up to two ticks first: its end (JAX's coordination service's)
aborts the other processes, and those waiting for it should raise their own error
(launch.py, Note [A failing rank exits at once]).
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from contextlib import contextmanager
from typing import NamedTuple

import torch.distributed as dist

from torchtpu import _compat, config

__all__ = ["EXITED", "Gone", "error", "leave", "linger", "start", "wait_for_the_others", "waiting"]

log = logging.getLogger(__name__)

_BEATS, _LEFT = "torchtpu/beat/", "torchtpu/left/"

#: How a rank left whose program ended (or called ``sys.exit``).
EXITED = "exited"

# How long a rank whose program ended waits for the others: as long as JAX's shutdown
# barrier would (a peer stuck in a compiled program that holds a collective, which
# nothing here watches, is released when this process ends).
_EXIT_WAIT = 300.0

# Words of a failed program's error that mean a peer may be gone (gloo's "Connection
# closed by peer", a key-value store "DEADLINE_EXCEEDED"): worth waiting to know which.
_LOST_PEER = ("gloo", "connection", "peer", "deadline_exceeded", "unavailable")


class Gone(NamedTuple):
    """Written into a store key a rank waits for, by the watcher, in place of the value
    that the gone rank ``rank`` will never write."""

    rank: int
    how: str


class _Wait(NamedTuple):
    what: str  # the collective: "all_reduce"
    ranks: tuple  # the global ranks of its group
    store: object  # the store holding ``keys``; None inside a program
    keys: tuple  # ((global rank, key), ...): what each rank owes


class _Watcher:
    def __init__(self, client, rank: int, size: int, timeout: float):
        self.client, self.rank, self.size, self.timeout = client, rank, size, timeout
        self.tick = min(1.0, timeout / 4)
        self.pid = os.getpid()  # a forked child is not the rank
        self.wait: _Wait | None = None  # set by the main thread while it waits
        self.left = False
        client.key_value_increment(f"{_BEATS}{rank}", 1)
        threading.Thread(target=self._run, name="torchtpu-liveness", daemon=True).start()

    def _run(self) -> None:
        current, seen, gone_since, store, warned = None, {}, None, None, False
        while True:
            time.sleep(self.tick)
            if self.left:
                return
            try:
                self.client.key_value_increment(f"{_BEATS}{self.rank}", 1)
                wait = self.wait
                if wait is None:
                    continue
                if wait is not current:
                    current, seen, gone_since, store = wait, {}, None, None
                gone = self.gone(wait.ranks, seen)
                if not gone:
                    continue
                if wait.store is not None:
                    store = store or wait.store.clone()  # the main thread's is in use
                    for r, key in wait.keys:
                        if r in gone:
                            store.compare_set(key, "", pickle.dumps(Gone(r, gone[r])))
                elif gone_since is None:
                    gone_since = time.monotonic()
                elif time.monotonic() - gone_since > self.timeout:
                    self._abandon(wait, gone)
            except Exception as exc:  # unreachable for now; for good, JAX ends the process
                if not warned:
                    log.warning(
                        "torchtpu: rank %d cannot watch the other ranks: %s", self.rank, exc
                    )
                warned = True

    def notices(self) -> dict[int, str]:
        """How each rank that left went."""
        return {_rank_of(k): v for k, v in self.client.key_value_dir_get(_LEFT)}

    def gone(self, ranks, seen: dict, exited: bool = True, left=None) -> dict[int, str]:
        """How each rank of ``ranks`` (other than this one) that is gone went: its notice
        (a normal exit only if ``exited``), or a heartbeat that has not moved for the
        timeout. ``seen`` (rank -> (beat, when it was first read)) is kept between the
        calls of one wait; ``left``: the notices, if just read."""
        left = self.notices() if left is None else left
        beats = {_rank_of(k): v for k, v in self.client.key_value_dir_get(_BEATS)}
        now, out = time.monotonic(), {}
        for r in ranks:
            if r == self.rank:
                continue
            if r in left:
                if exited or left[r] != EXITED:
                    out[r] = left[r]
                continue
            beat = beats.get(r)
            if r not in seen or seen[r][0] != beat:
                seen[r] = (beat, now)
            elif now - seen[r][1] >= self.timeout:
                quiet = now - seen[r][1]
                out[r] = f"stopped: no heartbeat for {quiet:.0f} s (killed, or its host is lost)"
        return out

    def _abandon(self, wait: _Wait, gone: dict[int, str]) -> None:
        message = (
            f"{error(self.rank, gone, wait.what)}. The collective's program cannot be "
            "interrupted: this process exits with status 1."
        )
        log.error("%s", message)
        leave(f"failed: {message}")
        os._exit(1)


_watcher: _Watcher | None = None


def start(rank: int, world_size: int) -> None:
    """Start this process's heartbeat and watcher (after ``jax.distributed.initialize``)."""
    global _watcher
    timeout = config.distributed_liveness_timeout
    if world_size > 1 and timeout > 0 and _watcher is None:
        _watcher = _Watcher(_compat.jax_distributed_client(), rank, world_size, timeout)


@contextmanager
def waiting(what: str, ranks, store=None, keys=()):
    """The main thread waits for ``ranks`` in the collective ``what``: for the ``keys``
    of ``store`` (``(global rank, key)`` pairs), or inside its program (no store). A
    program that fails while a rank of ``ranks`` is gone raises DistBackendError naming it."""
    w = _watcher
    if w is None:
        yield
        return
    w.wait = _Wait(what, tuple(ranks), store, tuple(keys))
    try:
        yield
    except Exception as exc:
        w.wait = None
        if store is None and (gone := _gone_after_failure(w, ranks, exc)):
            raise error(w.rank, gone, what) from exc
        raise
    finally:
        w.wait = None


def _gone_after_failure(w: _Watcher, ranks, exc: Exception) -> dict[int, str]:
    """The gone ranks after a program failed: at once from the notices; from the
    heartbeats (up to the timeout) only if the error reads like a lost peer."""
    seen: dict = {}
    gone = w.gone(ranks, seen)
    if gone or not any(word in str(exc).lower() for word in _LOST_PEER):
        return gone
    deadline = time.monotonic() + w.timeout + w.tick
    while not gone and time.monotonic() < deadline:
        time.sleep(w.tick)
        gone = w.gone(ranks, seen)
    return gone


def error(me: int, gone: dict[int, str], what: str) -> dist.DistBackendError:
    """The error of rank ``me``, waiting in ``what`` for ranks that are ``gone``."""
    hows = "; ".join(f"rank {r} {_describe(how)}" for r, how in sorted(gone.items()))
    them = "it" if len(gone) == 1 else "them"
    return dist.DistBackendError(
        f"rank {me}: {hows}, while rank {me} waits for {them} in {what}. Every rank of "
        "the group must run the same collectives (docs/distributed.md)"
    )


def _describe(how: str) -> str:
    if how == EXITED:
        return "exited (its program ended, or called sys.exit)"
    return how


def leave(how: str) -> None:
    """Tell the other ranks this process leaves, and how (once; not from a forked child)."""
    w = _watcher
    if w is None or w.left or os.getpid() != w.pid:
        return
    w.left = True
    try:
        w.client.key_value_set(f"{_LEFT}{w.rank}", how, allow_overwrite=True)
    except Exception as exc:  # JAX's service is gone with rank 0: nobody left to tell
        log.warning("torchtpu: rank %d could not tell the other ranks it leaves: %s", w.rank, exc)


def wait_for_the_others() -> bool:
    """At the end of this process's program (after `leave`): wait until every other rank
    has left too. False as soon as one failed or is gone instead, or after 300 s."""
    w = _watcher
    if w is None or os.getpid() != w.pid:
        return True
    seen: dict = {}
    pause, deadline = 0.005, time.monotonic() + _EXIT_WAIT
    try:
        while True:
            left = w.notices()
            gone = w.gone(range(w.size), seen, exited=False, left=left)
            if not gone and time.monotonic() > deadline:
                late = [r for r in range(w.size) if r != w.rank and r not in left]
                gone = {r: f"has not ended in {_EXIT_WAIT:.0f} s" for r in late}
            if gone:
                hows = "; ".join(f"rank {r} {how}" for r, how in sorted(gone.items()))
                log.error("torchtpu: rank %d ends with status 1: %s", w.rank, hows)
                return False
            if len(left) >= w.size:
                return True
            time.sleep(pause)
            pause = min(2 * pause, w.tick)
    except Exception as exc:  # JAX's service is gone with rank 0
        log.warning("torchtpu: rank %d cannot tell whether the other ranks left: %s", w.rank, exc)
        return False


def linger() -> None:
    """After this process failed (and said so): give the other ranks two ticks to notice,
    or less once each of them has failed too. For rank 0, whose end (JAX's coordination
    service) aborts the others: those waiting for it raise their own error first."""
    w = _watcher
    if w is None or os.getpid() != w.pid:
        return
    deadline = time.monotonic() + 2 * w.tick
    try:
        while time.monotonic() < deadline:
            left = w.notices()
            if all(left.get(r, EXITED) != EXITED for r in range(w.size) if r != w.rank):
                return
            time.sleep(0.05)
    except Exception as exc:  # nobody left to tell
        log.warning("torchtpu: rank %d cannot tell whether the other ranks left: %s", w.rank, exc)


def _rank_of(key: str) -> int:
    return int(key.rsplit("/", 1)[1])
