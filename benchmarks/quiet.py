"""Whether a benchmark ran alone: the CPU time other processes took while it ran.

On a 2-core machine another busy process doubles or triples small timings and hides
real differences, so each table says how much of the machine others held during it,
read from the OS (``/proc/stat`` for all CPUs, ``/proc/self/stat`` for this process),
and marks itself unreliable above a threshold. ``--require-quiet`` makes a script
refuse to start on a busy machine instead.
"""

from __future__ import annotations

import os
import sys
import time

# Other processes may use this share of one core before a table is called unreliable.
THRESHOLD = 0.15
_TICK = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    """CPU seconds all processes have used since boot (every CPU, not idle or iowait)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / _TICK


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class Window:
    """Measures the load of other processes from `start` to `stop`."""

    def __init__(self):
        self.start()

    def start(self) -> None:
        self._wall, self._busy, self._own = time.monotonic(), _busy_seconds(), _own_seconds()

    def others(self) -> float:
        """Cores held by other processes on average since `start` (0.0 .. nproc)."""
        wall = max(time.monotonic() - self._wall, 1e-9)
        other = (_busy_seconds() - self._busy) - (_own_seconds() - self._own)
        return max(other, 0.0) / wall

    def verdict(self) -> str:
        load = self.others()
        text = f"other processes held {load:.2f} of {os.cpu_count()} cores during this table"
        if load > THRESHOLD:
            return f"UNRELIABLE: {text} (more than {THRESHOLD}); rerun on a quiet machine"
        return f"quiet: {text}"


def check_before_start(seconds: float = 2.0) -> None:
    """Print the machine's load now; with ``--require-quiet``, exit if it is busy."""
    w = Window()
    time.sleep(seconds)
    load = w.others()
    print(f"load before starting: other processes held {load:.2f} of {os.cpu_count()} cores")
    if load > THRESHOLD and "--require-quiet" in sys.argv:
        sys.exit(f"refusing to benchmark: the machine is busy ({load:.2f} cores used by others)")


def command() -> str:
    return "python " + " ".join(sys.argv)
