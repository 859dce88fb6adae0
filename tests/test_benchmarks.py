"""The benchmarks that CI does not time still run: each in its smoke size on the CPU
backend, so that a change cannot break a table that is only measured on a device."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpt_benchmark_fills_every_row():
    run = subprocess.run(
        [sys.executable, "benchmarks/gpt.py", "--tiny", "--dtype", "autocast",
         "--steps", "1", "--repeat", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    rows = {
        line.split("|")[1].strip(): line
        for line in run.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| path")
    }
    assert set(rows) == {"jax", "strict", "defer", "compile", "jit"}, run.stdout
    for line in rows.values():  # each path in its own process, with its peak memory
        assert "failed" not in line and " ms " in line and " GiB " in line, line
        # the first step cold, then in a second process with the cache the first filled
        cold, warm = (float(cell.strip().removesuffix(" s")) for cell in line.split("|")[2:4])
        assert cold > 0 and warm > 0, line
    for path in ("strict", "defer", "compile", "jit"):  # each counts its programs
        assert rows[path].split("|")[4].strip().isdigit(), rows[path]


def test_attention_benchmark_fills_its_row():
    run = subprocess.run(
        [sys.executable, "benchmarks/attention.py", "--lengths", "512", "--repeats", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    (row,) = [line for line in run.stdout.splitlines() if line.startswith("| 512 ")]
    assert row.count(" ms ") == 2 and "MiB" in row, run.stdout


def test_step_profile_counts_one_read_a_step(tmp_path):
    run = subprocess.run(
        [sys.executable, "benchmarks/step_profile.py", "--workloads", "mlp",
         "--paths", "jax,strict,jit", "--profile", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    rows = [line.split("|") for line in run.stdout.splitlines() if line.startswith("| mlp ")]
    assert [r[2].strip() for r in rows] == ["jax", "strict", "jit"], run.stdout
    # Each step reads its loss once: the pending checks' flags come in the same read.
    assert [r[5].strip() for r in rows[1:]] == ["1", "1"], run.stdout
    assert sorted(os.listdir(tmp_path)) == ["mlp_jax.txt", "mlp_jit.txt", "mlp_strict.txt"]


def test_first_steps_benchmark_fills_its_rows():
    run = subprocess.run(
        [sys.executable, "benchmarks/first_steps.py", "--tiny", "--workloads", "mlp",
         "--paths", "cpu,strict"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    rows = {line.split("|")[2].strip(): line.split("|") for line in run.stdout.splitlines()
            if line.startswith("| mlp ")}  # fmt: skip
    assert set(rows) == {"cpu", "strict"}, run.stdout
    strict = rows["strict"]
    # cold and warm first steps, the programs the cold one compiled
    assert strict[3].strip().endswith(" s") and strict[4].strip().endswith(" s"), run.stdout
    assert int(strict[6]) > 0, run.stdout


def test_shape_buckets_benchmark_compiles_one_graph_per_bucket():
    pytest.importorskip("transformers")
    run = subprocess.run(
        [sys.executable, "benchmarks/shape_buckets.py", "--tiny", "--paths", "cpu,pow2,off",
         "--lengths", "9,5,12,17"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    rows = {line.split("|")[1].strip(): line.split("|") for line in run.stdout.splitlines()
            if line.startswith("| torch")}  # fmt: skip
    assert set(rows) == {"torch CPU", "torch.compile, buckets", "torch.compile, one per length"}
    # 5 in a bucket of 8, 9 and 12 in 16, 17 in 32; without buckets one graph per length
    assert rows["torch.compile, buckets"][3].strip() == "3", run.stdout
    assert rows["torch.compile, one per length"][3].strip() == "4", run.stdout
    for row in rows.values():
        assert float(row[7]) < 1e-4, run.stdout
