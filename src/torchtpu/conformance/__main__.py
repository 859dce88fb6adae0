"""Write the conformance report: ``python -m torchtpu.conformance --out docs/conformance.md``.

Runs the report's scopes (harness.REPORT_SCOPES) unless told otherwise, in ``--jobs``
worker processes, and writes a Markdown table per op x dtype x
mode with the summary lines. ``--save`` keeps the raw results, and ``--load`` writes a
report from saved results (of several runs, merged) without running anything.
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

from torchtpu.conformance import expectations, harness, runner

_SHORT = {
    torch.float32: "f32",
    torch.int64: "i64",
    torch.bool: "bool",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float64: "f64",
    torch.complex64: "c64",
}
_MARK = {"pass": "✓", "fail": "✗", "mismatch": "≠", "skip": "–"}


def _cell(results: list[harness.Result]) -> str:
    """One table cell: the worst outcome over the variants of an op/dtype/mode."""
    for outcome in ("mismatch", "fail", "skip", "pass"):
        if any(r.outcome == outcome for r in results):
            mark = _MARK[outcome]
            fallback = any(r.fallbacks for r in results)
            return mark + ("ᶜ" if fallback and outcome == "pass" else "")
    return ""


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}% ({part}/{whole})" if whole else "n/a"


def report(results: list[harness.Result], runs: list[tuple[str, float]]) -> str:
    """The Markdown page for ``results``, produced by ``runs`` (command, seconds)."""
    by_op = collections.defaultdict(list)
    for r in results:
        by_op[_base_name(r.case.op_name)].append(r)
    modes = sorted({r.case.mode for r in results}, key=harness.MODES.index)
    dtypes = [
        d
        for d in harness.REQUIRED_DTYPES + harness.EXTRA_DTYPES
        if any(r.case.dtype == d for r in results)
    ]

    def passes(rs, **where):
        chosen = [r for r in rs if all(getattr(r.case, k) == v for k, v in where.items())]
        return bool(chosen) and all(r.outcome == "pass" for r in chosen)

    def native(rs):
        return not any(r.fallbacks for r in rs)

    lines = ["# Conformance with PyTorch's OpInfo database", ""]
    lines.append(f"Generated with torch {torch.__version__} by")
    lines.append("")
    for command, seconds in runs:
        lines.append(f"- `{command}` ({seconds / 60:.1f} minutes)")
    lines.append("")
    lines.append(
        "Each OpInfo sample runs on the CPU and on tpu and is compared: values (torch's default"
    )
    lines.append(
        "tolerances), dtype, shape; for error inputs, the exception type. ✓ pass, ✗ loud failure"
    )
    lines.append(
        "(an exception), ≠ silent mismatch, – skipped, ᶜ passes only through the CPU fallback."
    )
    lines.append("")
    lines.append("Which cases each scope runs, and how many samples of each (harness.SCOPES):")
    lines.append("")
    for name in harness.REPORT_SCOPES:
        parts = [
            f"{'every sample' if cap is None else f'the first {cap} samples'} of "
            f"{len(list(harness.cases(**selection)))} cases"
            for selection, cap in harness.SCOPES[name]
        ]
        lines.append(f"- `{name}`: " + "; ".join(parts))
    lines.append("")
    lines.append("## Summary")
    lines.append("")
    names = sorted(by_op)
    f32 = [
        n
        for n in names
        if any(r.case.dtype == torch.float32 and r.case.check == "forward" for r in by_op[n])
    ]
    strict_f32 = [
        n for n in f32 if passes(by_op[n], dtype=torch.float32, check="forward", mode="strict")
    ]
    native_f32 = [
        n for n in strict_f32 if native([r for r in by_op[n] if r.case.check == "forward"])
    ]
    lines.append(
        f"- op names fully passing float32 forward (Strict), without the CPU fallback: {_percent(len(native_f32), len(f32))}"
    )
    lines.append(
        f"- ... including ops that pass only through the CPU fallback: {_percent(len(strict_f32), len(f32))}"
    )
    graded = [n for n in names if any(r.case.check == "grad" for r in by_op[n])]
    grad_ok = [
        n
        for n in graded
        if passes(by_op[n], check="grad", mode="strict")
        and native([r for r in by_op[n] if r.case.check == "grad"])
    ]
    lines.append(
        f"- op names passing the gradient check (Strict), without the CPU fallback: {_percent(len(grad_ok), len(graded))}"
    )
    for dtype in dtypes:
        having = [
            n
            for n in names
            if any(r.case.dtype == dtype and r.case.check == "forward" for r in by_op[n])
        ]
        ok = [n for n in having if passes(by_op[n], dtype=dtype, check="forward", mode="strict")]
        lines.append(
            f"- {dtype}: {_percent(len(ok), len(having))} of op names pass forward (Strict)"
        )
    for mode in modes:
        ok = [n for n in f32 if passes(by_op[n], dtype=torch.float32, check="forward", mode=mode)]
        lines.append(
            f"- mode {mode}: {_percent(len(ok), len(f32))} of op names pass float32 forward"
        )
    errors = [n for n in names if any(r.case.check == "errors" for r in by_op[n])]
    errors_ok = [n for n in errors if passes(by_op[n], check="errors")]
    lines.append(
        f"- error inputs raise the CPU's exception type: {_percent(len(errors_ok), len(errors))} of op names"
    )
    fallback_ops = sorted({f for r in results for f in r.fallbacks})
    lines.append(f"- aten ops that ran on the CPU fallback: {len(fallback_ops)}")
    mismatches = [r for r in results if r.outcome == "mismatch"]
    lines.append(f"- silent mismatches: {len(mismatches)}")
    judged = [r for r in results if r.by_float64]
    lines.append(
        f"- cases of 16-bit floats that differ from the CPU's but are as close to float64 "
        f"(compare.JUDGED_BY_FLOAT64): {len(judged)}"
    )
    stale = _stale_entries(results)
    lines.append(f"- stale expectations entries: {len(stale)}")
    lines.append("")
    lines.append("## Per op")
    lines.append("")
    columns = [  # the (dtype, mode) pairs some forward case ran in
        (d, m)
        for d in dtypes
        for m in modes
        if any(
            r.case.dtype == d and r.case.mode == m and r.case.check == "forward" for r in results
        )
    ]
    header = ["op"] + [f"{_SHORT[d]} {m}" for d, m in columns] + ["grad", "errors", "notes"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for name in names:
        rs = by_op[name]
        row = [f"`{name}`"]
        for d, m in columns:
            row.append(
                _cell(
                    [
                        r
                        for r in rs
                        if r.case.dtype == d and r.case.mode == m and r.case.check == "forward"
                    ]
                )
            )
        row.append(_cell([r for r in rs if r.case.check == "grad"]))
        row.append(_cell([r for r in rs if r.case.check == "errors"]))
        notes = sorted(
            {
                f"{r.case.variant}/{_SHORT[r.case.dtype]}/{r.case.check}: {r.detail}"
                for r in rs
                if r.outcome != "pass"
            }
        )
        fallbacks = sorted({f for r in rs for f in r.fallbacks})
        if fallbacks:
            notes.insert(0, "CPU fallback: " + ", ".join(fallbacks))
        row.append("<br>".join(n.replace("|", "\\|")[:200] for n in notes[:4]))
        lines.append("| " + " | ".join(row) + " |")
    if stale:
        lines += ["", "## Stale expectations entries", ""] + [
            f"- `{key}`: {why}" for key, why in stale.items()
        ]
    if fallback_ops:
        lines += ["", "## Ops that ran on the CPU fallback", ""] + [
            f"- `{f}`" for f in fallback_ops
        ]
    return "\n".join(lines) + "\n"


def _stale_entries(results: list[harness.Result]) -> dict:
    """Expectations entries that no case of these results needed: key -> why."""
    by_key = collections.defaultdict(list)
    for r in results:
        c = r.case
        key = expectations.matching_key(c.op_name, c.variant, c.dtype, c.check, c.mode)
        if key is not None and r.outcome != "skip":
            by_key[key].append(r)
    return {key: rs[0].stale for key, rs in by_key.items() if all(r.stale for r in rs)}


def _base_name(name: str) -> str:
    """OpInfo entries sharing a name (``max.reduction_with_dim``) count as one op name."""
    op = harness.find(name)
    return op.name


def _save(path: str, command: str, seconds: float, results: list[harness.Result]) -> None:
    rows = []
    for r in results:
        row = dataclasses.asdict(r)
        row["case"]["dtype"] = str(r.case.dtype).replace("torch.", "")
        rows.append(row)
    with open(path, "w") as f:
        json.dump({"command": command, "seconds": seconds, "results": rows}, f)


def _load(path: str) -> tuple[str, float, list[harness.Result]]:
    with open(path) as f:
        saved = json.load(f)
    results = []
    for row in saved["results"]:
        case = row.pop("case")
        case = harness.Case(**{**case, "dtype": getattr(torch, case["dtype"])})
        results.append(harness.Result(case, **{**row, "fallbacks": tuple(row["fallbacks"])}))
    return saved["command"], saved["seconds"], results


def _merge(results: list[harness.Result]) -> list[harness.Result]:
    """One result per case: where runs overlap, the later one's (a rerun of some ops)."""
    latest: dict[str, harness.Result] = {}
    for r in results:
        latest.pop(r.case.id, None)
        latest[r.case.id] = r
    return list(latest.values())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="OpInfo conformance report for torchtpu")
    parser.add_argument("--out", default="docs/conformance.md")
    parser.add_argument(
        "--scope",
        nargs="+",
        choices=sorted(harness.SCOPES),
        default=list(harness.REPORT_SCOPES),
        help="one or more scopes (harness.SCOPES); their cases are run and reported together "
        f"(default: {' '.join(harness.REPORT_SCOPES)}, the committed report's)",
    )
    parser.add_argument("--ops", nargs="*", help="only these OpInfo names")
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="worker processes (default: one per CPU; 0 runs in this process, unisolated)",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds one OpInfo entry may take"
    )
    parser.add_argument("--save", metavar="JSON", help="also write the raw results here")
    parser.add_argument(
        "--load",
        nargs="+",
        metavar="JSON",
        help="write the report from these saved results instead of running (where they "
        "overlap, the later file's results count)",
    )
    args = parser.parse_args(argv)
    if args.load:
        runs = [_load(path) for path in args.load]
        results = _merge([r for _, _, rs in runs for r in rs])
        runs = [(command, seconds) for command, seconds, _ in runs]
    else:
        selected = [chosen for name in args.scope for chosen in harness.scope(name)]
        if args.ops:
            selected = [
                (c, cap)
                for c, cap in selected
                if c.op_name in args.ops or harness.find(c.op_name).name in args.ops
            ]
        start = time.perf_counter()
        results = runner.run_cases(selected, jobs=args.jobs, timeout=args.timeout)
        seconds = time.perf_counter() - start
        command = "python -m torchtpu.conformance " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        runs = [(command.strip(), seconds)]
        if args.save:
            _save(args.save, runs[0][0], seconds, results)
    text = report(results, runs)
    with open(args.out, "w") as f:
        f.write(text)
    print(text.split("## Per op")[0])


if __name__ == "__main__":
    main()
