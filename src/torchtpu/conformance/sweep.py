"""The platform sweep: every OpInfo op in every dtype torch supports on CUDA, on this
machine's device, each op's cases in a worker process.

``python -m torchtpu.conformance.sweep --results sweep.jsonl --out docs/tpu-sweep.md``

Its question is narrower than the conformance report's: for each op x dtype, does the
device run it (``ran``), take another correct route (the CPU fallback, or a route of
the platform policy, platform.py: ``route``), refuse it with a Python error
(``error``), return a different value (``mismatch``), or kill the process
(``abort``)? An abort costs the worker, never the run: the parent records it and starts
another worker (runner.py). On a TPU, one process at a time can hold the chip, so run
one worker (``--jobs 1``): the parent never opens the chip, the worker does.

On a machine without a TPU, ``--compile-for-tpu`` also compiles every program of every
case for a TPU v5e (xla_tpu.py, needs libtpu) and records what XLA:TPU refuses or aborts
on: the compile-time half of the question, answered without a chip.

A sweep outlasts one command on a lent machine, so it is resumable: ``--results`` is a
JSON-lines file each op's results are appended to as they come; a rerun skips the cases
it holds, and ``--minutes`` stops starting new ops after that long. ``--report-only``
writes the page from the file alone.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time

import torch

from torchtpu.conformance import harness, runner

#: The dtypes swept: those a tpu tensor holds that torch supports on CUDA (complex32
#: and the unsigned 16-64-bit integers have no tpu storage; float8 has no OpInfo samples).
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)

SHORT = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.complex64: "c64",
    torch.complex128: "c128",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}

#: How a case ended, in the order the report lists them.
OUTCOMES = ("ran", "route", "error", "mismatch", "abort", "skip")


def cases(dtypes=DTYPES) -> list[harness.Case]:
    """The forward case of every op (its function variant, Strict) in every swept dtype
    that torch supports for it on both the CPU (the reference) and CUDA."""
    selected = []
    for op in harness.op_db():
        supported = op.supported_dtypes("cpu") & op.supported_dtypes("cuda")
        for dtype in dtypes:
            if dtype in supported:
                selected.append(harness.Case(harness.op_name(op), "op", dtype, "forward", "strict"))
    return selected


def outcome(result: harness.Result) -> str:
    """The sweep's word for a conformance result."""
    if result.outcome == "skip":
        return "skip"
    if result.outcome == "fail" and "worker process died" in result.detail:
        return "abort"
    if result.outcome == "pass":
        return "route" if result.fallbacks or result.routes else "ran"
    return "error" if result.outcome == "fail" else "mismatch"


def compile_outcome(result: harness.Result) -> str:
    """What XLA:TPU made of the case's programs: "abort" if it aborted on any, "error"
    if it refused any, "ok" otherwise (or if they were not compiled for it)."""
    kinds = {entry.split(": ")[1] for entry in result.tpu_compile if ": " in entry}
    return "abort" if "abort" in kinds else "error" if "error" in kinds else "ok"


# -- results file -------------------------------------------------------------------------


def _row(result: harness.Result) -> dict:
    row = dataclasses.asdict(result)
    row["case"]["dtype"] = str(result.case.dtype).replace("torch.", "")
    return row


def load(path: str) -> list[harness.Result]:
    """The results a file holds; where a case appears twice, its later result."""
    latest: dict[str, harness.Result] = {}
    if not os.path.exists(path):
        return []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            fields = row.pop("case")
            case = harness.Case(**{**fields, "dtype": getattr(torch, fields["dtype"])})
            row = {k: tuple(v) if isinstance(v, list) else v for k, v in row.items()}
            latest[case.id] = harness.Result(case, **row)
    return list(latest.values())


# -- the report ---------------------------------------------------------------------------


def report(results: list[harness.Result], title: str, header: list[str]) -> str:
    by_dtype = collections.defaultdict(collections.Counter)
    compiled = collections.defaultdict(collections.Counter)
    any_compiled = any(r.compiled_for_tpu for r in results)
    for r in results:
        by_dtype[r.case.dtype][outcome(r)] += 1
        compiled[r.case.dtype][compile_outcome(r)] += 1
    dtypes = [d for d in DTYPES if d in by_dtype]
    lines = [f"# {title}", "", *header, ""]
    columns = list(OUTCOMES) + (["XLA:TPU refuses", "XLA:TPU aborts"] if any_compiled else [])
    lines.append("| dtype | " + " | ".join(columns) + " |")
    lines.append("|---|" + "---|" * len(columns))
    total = collections.Counter()
    total_compiled = collections.Counter()
    for d in dtypes:
        cells = [str(by_dtype[d][o]) for o in OUTCOMES]
        if any_compiled:
            cells += [str(compiled[d]["error"]), str(compiled[d]["abort"])]
        total.update(by_dtype[d])
        total_compiled.update(compiled[d])
        lines.append(f"| {SHORT[d]} | " + " | ".join(cells) + " |")
    cells = [f"**{total[o]}**" for o in OUTCOMES]
    if any_compiled:
        cells += [f"**{total_compiled['error']}**", f"**{total_compiled['abort']}**"]
    lines.append("| all | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "`ran`: matches the CPU, computed on the device; `route`: matches the CPU through "
        "another route (the CPU fallback, or a route of the platform policy); `error`: a "
        "Python exception where the CPU returns a value; `mismatch`: a value different "
        "from the CPU's; `abort`: the process died."
    )
    for kind, pick in (
        ("Aborts", lambda r: outcome(r) == "abort"),
        ("Mismatches", lambda r: outcome(r) == "mismatch"),
        ("Errors", lambda r: outcome(r) == "error"),
        ("Programs XLA:TPU aborts on", lambda r: compile_outcome(r) == "abort"),
        ("Programs XLA:TPU refuses", lambda r: compile_outcome(r) == "error"),
    ):
        chosen = [r for r in results if pick(r)]
        lines += ["", f"## {kind} ({len(chosen)})", ""]
        if not chosen:
            lines.append("None.")
        for r in sorted(chosen, key=lambda r: r.case.id):
            detail = r.detail if not kind.startswith("Programs") else "; ".join(r.tpu_compile)
            detail = detail.replace("\n", " ").replace("|", "\\|")[:400]
            lines.append(f"- `{r.case.op_name}` {SHORT[r.case.dtype]}: {detail}")
    routes = collections.Counter(route for r in results for route in r.routes)
    fallbacks = collections.Counter(f for r in results for f in r.fallbacks)
    lines += ["", "## Routes taken", ""]
    if not routes and not fallbacks:
        lines.append("None.")
    for name, count in sorted(routes.items()):
        lines.append(f"- platform policy `{name}`: {count} cases")
    for name, count in sorted(fallbacks.items()):
        lines.append(f"- CPU fallback `{name}`: {count} cases")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="every op x dtype on this device, isolated")
    parser.add_argument("--results", required=True, help="JSON lines, appended to and resumed")
    parser.add_argument("--out", help="write the Markdown report here")
    parser.add_argument("--samples", type=int, default=1, help="samples per case (default 1)")
    parser.add_argument("--dtypes", nargs="*", help="only these (f64 i64 c128 ...)")
    parser.add_argument("--ops", nargs="*", help="only these OpInfo names")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (1 on a TPU)")
    parser.add_argument("--minutes", type=float, help="start no new op after this long")
    parser.add_argument("--compile-for-tpu", action="store_true", help="see xla_tpu.py")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--title", default="Platform sweep")
    args = parser.parse_args(argv)

    if not args.report_only:
        by_short = {v: k for k, v in SHORT.items()}
        dtypes = tuple(by_short[d] for d in args.dtypes) if args.dtypes else DTYPES
        done = {r.case.id for r in load(args.results)}
        todo = [c for c in cases(dtypes) if c.id not in done]
        if args.ops:
            todo = [c for c in todo if c.op_name in args.ops]
        print(f"{len(done)} cases done, {len(todo)} to run", file=sys.stderr, flush=True)
        start = time.monotonic()
        with open(args.results, "a") as out:

            def write(group_results):
                for r in group_results:
                    out.write(json.dumps(_row(r)) + "\n")
                out.flush()

            deadline = None if args.minutes is None else start + 60 * args.minutes
            runner.run_cases(
                [(c, args.samples) for c in todo],
                jobs=args.jobs,
                compile_for_tpu=args.compile_for_tpu,
                on_group=write,
                deadline=deadline,
            )
    if args.out:
        results = load(args.results)
        header = [
            f"torch {torch.__version__}; {len(results)} cases: the first {args.samples} "
            "OpInfo sample(s) of each op's forward, Strict mode, against the CPU.",
        ]
        with open(args.out, "w") as f:
            f.write(report(results, args.title, header))


if __name__ == "__main__":
    main()
