"""Instructions per op and per step, counted by valgrind: a measure the machine's noise
cannot move.

    python benchmarks/instructions.py                    # every workload, Strict and Defer
    python benchmarks/instructions.py add chain --modes defer
    python benchmarks/instructions.py --src ../old/src   # another checkout's torchtpu

Wall times on a shared 2-core VM move by 20-50% between runs (docs/performance.md),
which hides a change of a few percent. Instructions executed do not move: each
workload runs under ``valgrind --tool=callgrind`` with counting switched on
(``callgrind_control -i on``) only around its timed loop, after the warm-up that
compiles everything, and the table gives instructions per iteration, all threads
together (Python, torch, JAX's dispatch and XLA's execution: a count, not a time --
XLA's worker threads spinning for work are counted too). Needs valgrind (Debian's
``valgrind`` package). Slow: about a minute per cell.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (what it runs, iterations counted)
WORKLOADS = {
    "add": ("one 64x64 add and a read of its value", 300),
    "chain": ("the 11-op elementwise chain at 64x64, then a read", 200),
    "mlp": ("the MLP SGD step at batch 8, reading its loss", 40),
    "transformer": ("the transformer step, reading its loss", 10),
}


def child(workload: str, mode: str, n: int, signals: str) -> None:
    """Run under valgrind: warm up, say so, wait for counting to start, run ``n``
    iterations, say so, wait for counting to stop."""
    import warnings

    import jax
    import torch

    import torchtpu
    from benchmarks.eager_modes import chain, mlp_step_fn, transformer_step_fn

    warnings.simplefilter("ignore", torchtpu.TPUPerformanceWarning)
    x = torch.randn(64, 64, device="tpu")

    def read(t):
        jax.block_until_ready(torchtpu.dispatch.values.materialize(t))

    fn = {
        "add": lambda: read(x + x),
        "chain": lambda: read(chain(x)),
        "mlp": mlp_step_fn("tpu", 8),
        "transformer": transformer_step_fn("tpu"),
    }[workload]
    torch.tpu.set_eager_mode(mode)
    for _ in range(5):
        fn()
    _touch(signals, "ready")
    _wait_for(signals, "on")
    for _ in range(n):
        fn()
    _touch(signals, "done")
    _wait_for(signals, "off")


def _touch(folder: str, name: str) -> None:
    open(os.path.join(folder, name), "w").close()


def _wait_for(folder: str, name: str, timeout: float = 3600) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(folder, name)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {name!r} signal")
        time.sleep(0.05)


def count(workload: str, mode: str, src: str) -> float:
    """Instructions per iteration of ``workload`` in ``mode``, torchtpu from ``src``."""
    n = WORKLOADS[workload][1]
    with tempfile.TemporaryDirectory() as signals:
        out = os.path.join(signals, "callgrind.%p")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, ROOT]))
        command = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
            sys.executable, __file__, "--child", workload, mode, str(n), signals,
        ]  # fmt: skip
        proc = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            _wait_for(signals, "ready")
            subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True,
                           capture_output=True)  # fmt: skip
            _touch(signals, "on")
            _wait_for(signals, "done")
            subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True,
                           capture_output=True)  # fmt: skip
            _touch(signals, "off")
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"{workload} ({mode}) failed under valgrind")
        finally:
            if proc.poll() is None:
                proc.kill()
        total = 0
        for path in glob.glob(os.path.join(signals, "callgrind.*")):
            with open(path) as f:  # (a summary line may come first, counting nothing)
                total += max(
                    (
                        int(line.split()[1])
                        for line in f
                        if line.startswith(("summary:", "totals:"))
                    ),
                    default=0,
                )
    return total / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # (No choices=: Python 3.11's argparse checks an empty nargs="*" list against them.)
    parser.add_argument("workloads", nargs="*", help=f"some of {', '.join(WORKLOADS)} (all)")
    parser.add_argument("--modes", nargs="+", default=["strict", "defer"])
    parser.add_argument("--src", default=os.path.join(ROOT, "src"), help="torchtpu's src/")
    args = parser.parse_args()
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    print(f"`python {' '.join(sys.argv)}`: instructions per iteration (callgrind, all threads)\n")
    print("| workload | " + " | ".join(args.modes) + " |")
    print("|---|" + "---|" * len(args.modes))
    for workload in args.workloads or list(WORKLOADS):
        cells = [f"{count(workload, mode, args.src) / 1e3:,.0f}k" for mode in args.modes]
        print(f"| {WORKLOADS[workload][0]} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        workload, mode, n, signals = sys.argv[2:6]
        child(workload, mode, int(n), signals)
    else:
        main()
