"""Write the model-zoo report: ``python -m torchtpu.zoo --out docs/models.md``.

Runs every check of every architecture in every mode (``--only`` and ``--modes``
narrow it) and writes a Markdown table: pass or failure, max abs diff against the
CPU, graph breaks under torch.compile, why a check does not apply, the reason for
each failure, and ops that ran on the CPU fallback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings

from torchtpu.zoo import ARCHS, BY_NAME
from torchtpu.zoo.check import MODES, Outcome, columns, not_applicable, run
from torchtpu.zoo.libraries import keep_block

_TITLES = {
    "forward": "forward",
    "train": "train",
    "generate": "generate",
    "generate_static": "generate static",
    "compile": "torch.compile",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtpu.zoo", description=__doc__)
    parser.add_argument("--out", help="the Markdown file to write (default: stdout)")
    parser.add_argument("--only", help="comma-separated architecture names")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated eager modes")
    parser.add_argument("--checks", help="comma-separated checks (default: all)")
    parser.add_argument(
        "--update",
        action="store_true",
        help="rerun only --only (and --checks) and keep the other results of the last run "
        "(from the .json written next to --out)",
    )
    args = parser.parse_args(argv)
    selected = [BY_NAME[n] for n in args.only.split(",")] if args.only else ARCHS
    wanted = [
        (check, mode)
        for check, mode in columns(args.modes.split(","))
        if not args.checks or check in args.checks.split(",")
    ]
    results = _results_path(args.out)
    kept = _load(results) if args.update and results else []
    rerun = {arch.name for arch in selected}
    kept = [o for o in kept if o.arch not in rerun or (o.check, o.mode) not in wanted]
    # The report gives the time of the run that wrote it; an --update keeps that.
    seconds = _load_seconds(results) if args.update and results else None

    warnings.simplefilter("ignore")  # fallbacks are counted in the report instead
    outcomes: list[Outcome] = []
    start = time.perf_counter()
    for arch in selected:
        for check, mode in wanted:
            if not_applicable(arch, check):
                continue
            outcome = run(arch, check, mode)
            outcomes.append(outcome)
            status = "pass" if outcome.passed else f"FAIL {outcome.reason}"
            if outcome.graph_breaks:
                status += f" ({outcome.graph_breaks} graph breaks: {outcome.break_reasons[:2]})"
            print(
                f"{arch.name} {check} {mode}: {status} [{outcome.seconds:.1f}s]",
                file=sys.stderr,
                flush=True,
            )
        if args.out:  # written after each architecture: a long run's progress is kept
            _write(args.out, results, kept + outcomes, seconds or time.perf_counter() - start)
    if not args.out:
        _write(None, None, kept + outcomes, time.perf_counter() - start)
    return 0


def _write(out, results, outcomes, seconds) -> None:
    archs = [arch for arch in ARCHS if any(o.arch == arch.name for o in outcomes)]
    modes = [m for m in MODES if any(o.mode == m and o.check != "compile" for o in outcomes)]
    text = report(archs, modes, outcomes, seconds)
    if not out:
        print(text)
        return
    text = keep_block(out, text)  # the report of python -m torchtpu.zoo.libraries, if any
    with open(out, "w") as f:
        f.write(text)
    with open(results, "w") as f:
        json.dump(
            {"seconds": seconds, "outcomes": [dataclasses.asdict(o) for o in outcomes]},
            f,
            indent=0,
        )


def _results_path(out: str | None) -> str | None:
    return out.rsplit(".", 1)[0] + ".json" if out else None


def _read(path: str):
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {"outcomes": data}  # the older list format


def _load(path: str) -> list[Outcome]:
    return [Outcome(**o) for o in _read(path).get("outcomes", [])]


def _load_seconds(path: str) -> float:
    return float(_read(path).get("seconds", 0.0))


def _cell(arch, check: str, outcome: Outcome | None) -> str:
    reason = not_applicable(arch, check)
    if reason:
        return reason
    if outcome is None:
        return "not run"
    if outcome.crashed:
        return "**crash**"
    breaks = f", {outcome.graph_breaks} breaks" if outcome.graph_breaks is not None else ""
    if outcome.passed:
        return f"pass {outcome.max_abs_diff:.1e}{breaks}"
    return f"**diff** {outcome.max_abs_diff:.1e}{breaks}"


def _summary(archs, cols, by_key) -> list[str]:
    """Per column: crash-free and matching architectures among those it applies to."""
    lines = ["| check | architectures | crash-free | matching the CPU |", "|---|---|---|---|"]
    for check, mode in cols:
        ran = [by_key[(a.name, check, mode)] for a in archs if (a.name, check, mode) in by_key]
        if not ran:
            continue
        n = len(ran)
        crash_free = sum(not o.crashed for o in ran)
        matching = sum(o.passed for o in ran)
        lines.append(
            f"| {_TITLES[check]} ({mode}) | {n} | {crash_free} ({100 * crash_free / n:.1f}%) "
            f"| {matching} ({100 * matching / n:.1f}%) |"
        )
    return lines


def report(archs, modes, outcomes: list[Outcome], seconds: float) -> str:
    import torch
    import transformers

    by_key = {(o.arch, o.check, o.mode): o for o in outcomes}
    cols = columns(modes)
    compiled = [by_key.get((a.name, *cols[-1])) for a in archs]
    compiled = [o for o in compiled if o is not None]
    unbroken = sum(not o.crashed and o.graph_breaks == 0 for o in compiled)
    archs_clean = sum(all(not by_key[k].crashed for k in by_key if k[0] == a.name) for a in archs)
    fallback_ops = sorted({op for o in outcomes for op in o.fallbacks})
    lines = [
        "# Hugging Face Transformers model zoo",
        "",
        "Generated by `python -m torchtpu.zoo --out docs/models.md` "
        f"(transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{seconds / 60:.0f} minutes on the CPU backend of a 2-core machine). Each "
        "architecture is a "
        "tiny randomly initialized model built from its config (`src/torchtpu/zoo/__init__.py`), "
        "run on tpu and on the CPU: **forward** compares eval-mode logits and loss; **train** "
        "compares the train-mode loss and logits, every parameter's gradient after "
        "`loss.backward()` and every parameter after one `torch.optim.AdamW` step; "
        "**generate** compares the tokens of greedy `generate()` (causal LMs and "
        "encoder-decoders) with the default KV cache, **generate static** with "
        '`cache_implementation="static"` (with it, Transformers compiles the decoding steps '
        'on tpu with `torch.compile(backend="tpu")`); each runs in Strict and DeferAndFuse. '
        '**torch.compile** compares the eval-mode forward of `torch.compile(model, backend="tpu")` '
        "with the CPU's eager forward and counts Dynamo's graph breaks. Each cell is the max "
        "abs difference from the CPU, or the failure, or why the check does not apply.",
        "",
        "## Summary",
        "",
        f"- Architectures: {len(archs)}; checks run: {len(outcomes)}",
        f"- Architectures with no crash in any column: {archs_clean}/{len(archs)} = "
        f"{100 * archs_clean / max(len(archs), 1):.1f}%",
        f"- torch.compile forward with zero graph breaks: {unbroken}/{len(compiled)} = "
        f"{100 * unbroken / max(len(compiled), 1):.1f}%",
        f"- Ops that ran on the CPU fallback: {', '.join(fallback_ops) or 'none'}",
        "",
        *_summary(archs, cols, by_key),
        "",
        "## Results",
        "",
    ]
    lines.append(
        "| architecture | family | " + " | ".join(f"{_TITLES[c]} ({m})" for c, m in cols) + " |"
    )
    lines.append("|---" * (len(cols) + 2) + "|")
    failures = []
    for arch in archs:
        cells = []
        for check, mode in cols:
            outcome = by_key.get((arch.name, check, mode))
            cells.append(_cell(arch, check, outcome))
            if outcome is not None and not outcome.passed:
                failures.append(outcome)
        lines.append(f"| {arch.name} | {arch.family} | " + " | ".join(cells) + " |")
    lines += ["", "## Failures", ""]
    if not failures:
        lines.append("None.")
    for o in failures:
        lines.append(f"- **{o.arch}** {_TITLES[o.check]} ({o.mode}): {o.reason}")
    broken = [o for o in outcomes if o.graph_breaks]
    lines += ["", "## Graph breaks under torch.compile", ""]
    if not broken:
        lines.append("None.")
    for o in broken:
        reasons = "; ".join(o.break_reasons[:3])
        lines.append(f"- **{o.arch}**: {o.graph_breaks} breaks, {o.graphs} graphs: {reasons}")
    fallbacks = [o for o in outcomes if o.fallbacks]
    lines += ["", "## CPU fallbacks", ""]
    if not fallbacks:
        lines.append("None: every op ran on tpu.")
    for o in fallbacks:
        ops = ", ".join(f"{op} ×{n}" for op, n in sorted(o.fallbacks.items()))
        lines.append(f"- {o.arch} {_TITLES[o.check]} ({o.mode}): {ops}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
