"""benchmarks/device_check.py, the one command that checks a device, runs here on the CPU
backend in its smoke size, so that it still works when a TPU is lent."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_device_check_smoke(tmp_path):
    out = tmp_path / "check.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/device_check.py", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = [line for line in run.stdout.splitlines() if line.startswith("SUMMARY")]
    assert summary and summary[0].startswith("SUMMARY PASS"), run.stdout[-2000:]
    import json

    results = json.loads(out.read_text())
    assert results["policy"]["float64"] and results["policy"]["complex128"]
    assert results["suite"]["counts"].get("passed", 0) > 0
    assert set(results["speed"]["MLP step, batch 64"]) == {"Strict", "Defer", "jax.jit"}
