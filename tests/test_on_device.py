"""tests/on_device.py, the suite's runner for a lent accelerator: outcomes written as
tests end, a process abort recorded against its test on the next run, and a rerun
resuming where the last one stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

TESTS = """
import os

def test_passes():
    assert True

def test_aborts():
    if not os.environ.get("SECOND_RUN"):
        os.abort()

def test_fails():
    assert 1 == 2
"""


def _run(tmp_path, results, *extra, **env):
    return subprocess.run(
        [sys.executable, os.path.join(HERE, "on_device.py"), "--results", str(results), *extra],
        cwd=tmp_path,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_an_abort_is_recorded_and_the_run_resumes(tmp_path):
    (tmp_path / "test_sample.py").write_text(TESTS)
    (tmp_path / "conftest.py").write_text("")
    results = tmp_path / "results.jsonl"
    first = _run(tmp_path, results, str(tmp_path / "test_sample.py"))
    assert first.returncode != 0  # the process aborted in test_aborts
    second = _run(tmp_path, results, str(tmp_path / "test_sample.py"), SECOND_RUN="1")
    assert "1 deselected" in second.stdout or "deselected" in second.stdout, second.stdout

    sys.path.insert(0, HERE)
    import on_device

    records = on_device.load(str(results))
    outcomes = {nodeid.split("::")[-1]: row["outcome"] for nodeid, row in records.items()}
    assert outcomes == {"test_passes": "passed", "test_aborts": "aborted", "test_fails": "failed"}
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert sum(1 for r in rows if r["outcome"] == "passed") == 1  # not run twice
    report = on_device.report(records, baseline={i: {"outcome": "passed"} for i in records})
    assert "3 ran here; 1 pass, 2 do not" in report
