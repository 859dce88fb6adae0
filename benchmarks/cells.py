"""A table's cell measured in a fresh process: the script run again with its arguments,
reporting one JSON object as its last such line of output."""

from __future__ import annotations

import json
import subprocess
import sys


def run_cell(script: str, arguments: list, env: dict, cwd: str) -> dict:
    """The cell's result, or ``{"error": ...}`` with the last line it wrote to stderr."""
    run = subprocess.run(
        [sys.executable, script, *arguments],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=3600,
    )  # fmt: skip
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not lines:
        return {"error": (run.stderr.strip().splitlines() or ["no output"])[-1][:120]}
    return json.loads(lines[-1])
