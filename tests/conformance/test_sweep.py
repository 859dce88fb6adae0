"""The platform sweep (conformance/sweep.py): what each case's result is called, the
report's counts, and a resumable results file."""

from __future__ import annotations

import json

import pytest
import torch

from torchtpu.conformance import harness, sweep

pytestmark = pytest.mark.allow_fallback


def _result(op, dtype, outcome="pass", **fields):
    return harness.Result(harness.Case(op, "op", dtype, "forward", "strict"), outcome, **fields)


def test_outcomes_and_the_report():
    results = [
        _result("abs", torch.float32),
        _result("abs", torch.float64, routes=("aten.abs.default",)),
        _result("mm", torch.int64, fallbacks=("aten.mm.default",)),
        _result("sin", torch.float32, "fail", detail="the worker process died (exit code -6)"),
        _result("cos", torch.float32, "fail", detail="RuntimeError: no"),
        _result("tan", torch.float32, "mismatch", detail="not close"),
        _result(
            "div",
            torch.complex128,
            tpu_compile=("aten.div.Tensor: abort: the compiler process died",),
            compiled_for_tpu=True,
        ),
    ]
    assert [sweep.outcome(r) for r in results] == [
        "ran", "route", "route", "abort", "error", "mismatch", "ran",
    ]  # fmt: skip
    assert sweep.compile_outcome(results[-1]) == "abort"
    text = sweep.report(results, "T", [])
    f32 = next(line for line in text.splitlines() if line.startswith("| f32 |"))
    assert f32 == "| f32 | 1 | 0 | 1 | 1 | 1 | 0 | 0 | 0 |"
    assert "## Aborts (1)" in text and "## Programs XLA:TPU aborts on (1)" in text
    assert "- platform policy `aten.abs.default`: 1 cases" in text


def test_a_sweep_resumes_from_its_results_file(tmp_path, capsys):
    results = tmp_path / "sweep.jsonl"
    args = ["--results", str(results), "--ops", "abs", "--dtypes", "f32", "i64", "--jobs", "0"]
    sweep.main(args)
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted(r["case"]["dtype"] for r in rows) == ["float32", "int64"]
    assert all(r["outcome"] == "pass" for r in rows)
    capsys.readouterr()
    sweep.main(args + ["--out", str(tmp_path / "sweep.md")])
    assert "2 cases done, 0 to run" in capsys.readouterr().err
    assert "| all | **2** |" in (tmp_path / "sweep.md").read_text()
