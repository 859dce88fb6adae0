"""Counters of everything that costs time: nothing slow is silent.

`metrics()` returns a snapshot; `metrics_report()` formats it; `reset_metrics()`
zeroes it. Counters are keyed by a category and a name, e.g.
``("ops", "strict")``, ``("fallback", "aten.foo.default")``, ``("compiles", "op")``.
"""

from __future__ import annotations

import collections
import time

_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def count(category: str, name: str, n: float = 1) -> None:
    _counts[category][name] += n


def counter(category: str) -> collections.Counter:
    """The live counter of ``category``, for code on every op's path to increment
    directly (``ops[name] += 1``); `reset_metrics` zeroes it in place."""
    return _counts[category]


# Event logs being recorded (torchtpu.explain); empty almost always, so `event` is cheap.
_recorders: list[list] = []


def event(kind: str, **details) -> None:
    """Note an event (a flush, a compile, a fallback) for any running explain()."""
    for log in _recorders:
        log.append((kind, details))


class LRUCache(collections.OrderedDict):
    """A dict keeping the ``capacity()`` most recently used entries; evictions are
    counted as ``<name>/evicted``."""

    def __init__(self, name: str, capacity):
        super().__init__()
        self.name, self.capacity = name, capacity

    def lookup(self, key):
        value = self.get(key)
        if value is None:
            count(self.name, "miss")
        else:
            self.move_to_end(key)
            count(self.name, "hit")
        return value

    def insert(self, key, value) -> None:
        self[key] = value
        while len(self) > self.capacity():
            self.popitem(last=False)
            count(self.name, "evicted")


def metrics() -> dict[str, dict[str, float]]:
    """A snapshot of all counters: ``{category: {name: value}}``.

    Categories: ``ops`` (ops run, by eager mode), ``op_cache`` (hit/miss of the
    per-op compiled functions), ``compiles`` (XLA compilations, by kind),
    ``compile_seconds``, ``compiles_by_line`` and ``compile_seconds_by_line`` (the same,
    by the user's line that caused each compile: a first op, a flush, a compiled call),
    ``shape_buckets`` (torch.compile graphs run padded, and refused), ``fallback`` (ops
    run on the CPU, by op),
    ``decomposed`` (ops run through torch._decomp, by op), ``transfer_bytes``
    (``to_device``/``to_host``), ``collectives`` and ``collective_bytes``
    (torch.distributed collectives by kind, and the bytes this rank contributed),
    ``program_bytes`` (the largest arguments, outputs and temporaries XLA reported for
    a program of each kind run: ``"chunk temporaries"``, ``"graph outputs"``, ``"step
    arguments"``; not a sum).
    """
    return {category: dict(counter) for category, counter in _counts.items() if counter}


def reset_metrics() -> None:
    """Zero every counter."""
    for c in _counts.values():
        c.clear()


def metrics_report() -> str:
    """The counters as readable text, one section per category."""
    snapshot = metrics()
    if not snapshot:
        return "torchtpu metrics: nothing recorded"
    lines = ["torchtpu metrics"]
    for category in sorted(snapshot):
        lines.append(f"  {category}:")
        for name, value in sorted(snapshot[category].items(), key=lambda kv: (-kv[1], kv[0])):
            shown = (
                f"{value:.3f}"
                if isinstance(value, float) and not value.is_integer()
                else f"{int(value)}"
            )
            lines.append(f"    {name:<48} {shown}")
    return "\n".join(lines)


class timer:
    """Context manager adding the seconds spent inside to ``category/name``."""

    def __init__(self, category: str, name: str):
        self.category, self.name = category, name

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        count(self.category, self.name, time.perf_counter() - self.start)
