"""Plot the benchmark tables: docs/performance.png.

    python benchmarks/plot.py                              # run both benchmarks (--quick), then plot
    python benchmarks/plot.py eager.txt compiled.txt       # plot tables printed earlier
    python benchmarks/plot.py --out figure.png eager.txt   # elsewhere

Reads the Markdown tables that ``benchmarks/eager_modes.py`` and
``benchmarks/compiled.py`` print (any text file holding them: saved output, or a
docs page that quotes it) and draws, for the per-step workloads, the time of each way
of running them relative to ``jax.jit`` (the floor: the same computation written in
JAX under one ``jax.jit``). Lower is faster; 1 is the floor.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_time(cell: str) -> float | None:
    """'148us' / '13.0ms' / '1.28 s' -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(us|ms|s)\s*", cell)
    if not m:
        return None
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def parse_tables(text: str) -> dict[str, dict[str, float]]:
    """Every Markdown table with a `jax.jit` column, as {workload: {column: time / jax.jit
    time}}. Each ratio is taken within its own table (one run); where two tables have
    the same workload and column, the later one wins."""
    ratios: dict[str, dict[str, float]] = {}
    header: list[str] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if set("".join(cells)) <= set("-: ") or "jax.jit" not in header:
            continue
        if header[0] == "per op":  # the cost of one op, not of a step
            continue
        times = {name: parse_time(cell) for name, cell in zip(header[1:], cells[1:])}
        floor = times.get("jax.jit")
        if not floor:
            continue
        row = ratios.setdefault(cells[0], {})
        for name, seconds in times.items():
            if seconds is not None:
                row[name] = seconds / floor
    return ratios


def run_benchmarks() -> str:
    out = []
    for script in ("eager_modes.py", "compiled.py"):
        print(f"running benchmarks/{script} --quick ...", file=sys.stderr, flush=True)
        result = subprocess.run(
            [sys.executable, os.path.join(HERE, script), "--quick"],
            check=True,
            capture_output=True,
            text=True,
        )
        print(result.stdout, file=sys.stderr)
        out.append(result.stdout)
    return "\n".join(out)


COLUMNS = ["torch CPU", "Strict", "Debug", "Defer", "torch.compile", "torchtpu.jit"]
COLORS = {
    "torch CPU": "#999999",
    "Strict": "#4c72b0",
    "Debug": "#8172b2",
    "Defer": "#55a868",
    "torch.compile": "#dd8452",
    "torchtpu.jit": "#c44e52",
}


def plot(rows: dict[str, dict[str, float]], out: str) -> None:
    """Grouped bars of {workload: {column: time / jax.jit time}}, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w, r in rows.items() if "jax.jit" in r and len(r) > 2]
    columns = [c for c in COLUMNS if any(c in rows[w] for w in workloads)]
    width = 0.8 / len(columns)
    fig, ax = plt.subplots(figsize=(10, 4.8))
    for i, column in enumerate(columns):
        xs, ys = [], []
        for j, w in enumerate(workloads):
            if column in rows[w]:
                xs.append(j + (i - (len(columns) - 1) / 2) * width)
                ys.append(rows[w][column])
        ax.bar(xs, ys, width, label=column, color=COLORS.get(column))
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.text(-0.45, 1.0, "jax.jit = 1", va="bottom", ha="left", fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels([w.replace(", ", ",\n") for w in workloads], fontsize=8)
    ax.set_ylabel("time per step / jax.jit time (log; lower is faster)")
    ax.set_title("torchtpu: eager modes and compiled paths against jax.jit (JAX CPU backend)")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tables", nargs="*", help="text files holding the printed tables")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "performance.png"))
    args = parser.parse_args(argv)
    if args.tables:
        text = "\n".join(open(path).read() for path in args.tables)
    else:
        text = run_benchmarks()
    rows = parse_tables(text)
    if not rows:
        sys.exit("no benchmark table with a jax.jit column found")
    plot(rows, args.out)


if __name__ == "__main__":
    main()
