"""A progress line while XLA compiles: a long first step is never silent.

On a TPU every first call compiles (an op's program, a DeferAndFuse chunk, a compiled
graph or step), and a first training step can compile for a minute with nothing on the
screen. Compiles are grouped into *bursts*: from the first compile after a value was
read (``.item()``, ``.cpu()``, a flush: perf_warnings' clock) to the next read. Once a
burst has spent ``config.compile_progress_after`` seconds compiling, one line goes to
stderr, another every ``_EVERY`` seconds while it lasts, and a last one when the next
value is read::

    torchtpu: compiling XLA programs since Cell In[4], line 3: 37 done in 2.1 s, now aten.mm.default
    torchtpu: compiled 412 XLA programs in 41.3 s (a new process reuses them: JAX's persistent cache)

A compile releases the GIL, so a watcher thread can speak while one long compile runs;
the compiling thread speaks too, after each compile, so a burst of short ones is
reported without waiting for the watcher. Strict's compiles run on worker threads, several
at once (dispatch/background.py): a burst's seconds are the wall time during which any
compile ran. ``config.compile_progress = False`` turns it off.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time

from torchtpu import config
from torchtpu.observe import metrics

_EVERY = 10.0  # seconds between two lines of one burst
_POLL = 0.25  # how often the watcher looks

_lock = threading.Lock()
_KEYS = itertools.count()
# The burst under way: None, or a dict (see _start_burst).
_burst: dict | None = None
_watcher: threading.Thread | None = None


def _start_burst(where: str) -> dict:
    # "seconds": wall time during which at least one compile ran (compiles on the
    # background workers overlap: background.py), up to "busy_since", when the running
    # ones began; "running": what each compile under way compiles, by its token.
    return {
        "where": where, "programs": 0, "seconds": 0.0, "busy_since": None, "running": {},
        "shown_at": None,
    }  # fmt: skip


@contextlib.contextmanager
def compiling(what: str, where: str):
    """Around one compile of ``what`` (an op, "a DeferAndFuse chunk", ...) from ``where``:
    its seconds counted by user line (``torchtpu.metrics()["compile_seconds_by_line"]``),
    and the progress line shown while a burst of compiles runs long."""
    token = started(what, where)
    try:
        yield
    finally:
        seconds = finished(token)
        metrics.count("compile_seconds_by_line", where or "<unknown>", seconds)


def started(what: str, where: str) -> tuple:
    """A compile of ``what`` from ``where`` began: returns the token to give `finished`,
    from any thread, when it ends."""
    global _burst
    burst, key = None, next(_KEYS)
    if config.compile_progress:
        with _lock:  # (the compiling threads start it too: background.py)
            _ensure_watcher()
            if _burst is None:
                _burst = _start_burst(where)
            burst = _burst
            if not burst["running"]:
                burst["busy_since"] = time.perf_counter()
            burst["running"][key] = what
    return burst, key, what, time.perf_counter()


def finished(token) -> float:
    """The compile ``token`` names (from `started`) ended: returns its seconds. Any
    thread may call it (a background compile's worker: dispatch/background.py); it
    counts nothing in ``metrics()``, which the calling thread does."""
    burst, key, what, start = token
    now = time.perf_counter()
    if burst is not None:
        with _lock:
            if burst["running"].pop(key, None) is not None:
                burst["programs"] += 1
                if not burst["running"]:
                    burst["seconds"] += now - burst["busy_since"]
                    burst["busy_since"] = None
                if burst is _burst:
                    _maybe_show(burst, what)
    return now - start


def note_read() -> None:
    """A value was read: the burst, if any, ends (with its last line if it showed one)."""
    global _burst
    if _burst is None:  # every read passes here: no lock when nothing compiled
        return
    with _lock:
        burst, _burst = _burst, None
    if burst is not None and burst["shown_at"] is not None:
        reuse = " (a new process reuses them: JAX's persistent cache)"
        _say(
            f"compiled {burst['programs']} XLA program{'s' if burst['programs'] != 1 else ''} "
            f"in {burst['seconds']:.1f} s{reuse if config.compile_cache_dir else ''}"
        )


def _maybe_show(burst: dict, what: str) -> None:
    """Under the lock: one line if the burst has compiled long enough and the last
    line is old enough."""
    now = time.perf_counter()
    since = burst["busy_since"]
    seconds = burst["seconds"] + (now - since if since is not None else 0.0)
    if seconds < config.compile_progress_after:
        return
    if burst["shown_at"] is not None and now - burst["shown_at"] < _EVERY:
        return
    burst["shown_at"] = now
    _say(
        f"compiling XLA programs since {burst['where']}: {burst['programs']} done in "
        f"{seconds:.1f} s, now {what}"
    )


def _say(text: str) -> None:
    print(f"torchtpu: {text}", file=sys.stderr, flush=True)


def _ensure_watcher() -> None:
    global _watcher
    if _watcher is None:
        _watcher = threading.Thread(target=_watch, name="torchtpu-compile-progress", daemon=True)
        _watcher.start()


def _watch() -> None:
    while True:
        time.sleep(_POLL)
        with _lock:
            burst = _burst
            if burst is not None and burst["running"]:
                _maybe_show(burst, next(reversed(burst["running"].values())))
