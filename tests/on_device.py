"""Run the test suite on an accelerator in resumable shards, and tabulate the results.

On a lent TPU one command may run 10 minutes and the whole suite takes longer, one
process holds the chip, and a process abort must not lose what ran before it. So::

    python tests/on_device.py --results tpu.jsonl --minutes 9 [pytest paths or ids]
    python tests/on_device.py --results tpu.jsonl --minutes 9            # resumes
    python tests/on_device.py --results tpu.jsonl --report tpu.md --baseline cpu.jsonl

runs pytest in this one process (no ``-n``; conftest.py starts JAX before the first
test and gives subprocesses the CPU backend), appends each test's outcome to
``--results`` as it ends, and stops starting tests after ``--minutes``. A rerun skips
the tests the file holds. A test that was started but never ended -- the process died
in it -- is recorded as ``aborted`` by the next run, which skips it. ``--report``
writes a table of outcomes per test file; with ``--baseline`` (the same run's file from
the CPU backend) it lists the tests that pass there and not here, each with its error.
Set TORCHTPU_TEST_COMPILE_CACHE to a directory to share compiled programs between shards.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import pytest

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "aborted")


def load(path: str) -> dict[str, dict]:
    """nodeid -> its last record; a test started and never ended is ``aborted``."""
    records: dict[str, dict] = {}
    if not os.path.exists(path):
        return records
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if row["outcome"] == "started":
                records.setdefault(row["id"], {**row, "outcome": "aborted", "detail": ""})
            else:
                records[row["id"]] = row
    return records


class Recorder:
    """A pytest plugin: deselects recorded tests, writes each outcome as it comes,
    stops after the time budget."""

    def __init__(self, path: str, minutes: float | None):
        self.done = set(load(path))
        self.out = open(path, "a")
        self.deadline = None if minutes is None else time.monotonic() + 60 * minutes
        self.phases: dict[str, dict] = {}

    def _write(self, row: dict) -> None:
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()
        os.fsync(self.out.fileno())

    def pytest_collection_modifyitems(self, config, items):
        kept = [item for item in items if item.nodeid not in self.done]
        deselected = [item for item in items if item.nodeid in self.done]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
        items[:] = kept

    def pytest_runtest_logstart(self, nodeid, location):
        self._write({"id": nodeid, "outcome": "started"})

    def pytest_runtest_logreport(self, report):
        row = self.phases.setdefault(report.nodeid, {"id": report.nodeid, "outcome": "passed"})
        if report.when == "call" or report.outcome != "passed":
            if hasattr(report, "wasxfail"):
                outcome = "xfailed" if report.skipped else "xpassed"
            elif report.failed:
                outcome = "failed" if report.when == "call" else "error"
            else:
                outcome = report.outcome
            if row["outcome"] in ("passed", "skipped") or outcome in ("failed", "error"):
                row["outcome"] = outcome
                row["detail"] = _detail(report)
        if report.when == "call":
            row["seconds"] = round(report.duration, 3)
        if report.when == "teardown":
            self._write(self.phases.pop(report.nodeid))

    def pytest_runtest_logfinish(self, nodeid, location):
        if self.deadline is not None and time.monotonic() > self.deadline:
            # Stops after the current test, as -x does.
            self.session.shouldstop = "the time budget (--minutes) is spent"

    def pytest_sessionstart(self, session):
        self.session = session


def _detail(report) -> str:
    """One line saying why: the skip reason, or the first line of the exception."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:300]
    text = getattr(report, "longreprtext", "") or ""
    lines = [line for line in text.splitlines() if line.startswith("E ")]
    lines = lines or text.strip().splitlines()[-1:]
    return lines[0][:300] if lines else ""


def report(records: dict, baseline: dict | None) -> str:
    by_file = collections.defaultdict(collections.Counter)
    for nodeid, row in records.items():
        by_file[nodeid.split("::")[0]][row["outcome"]] += 1
    total = collections.Counter()
    lines = ["| file | " + " | ".join(OUTCOMES) + " |", "|---|" + "---|" * len(OUTCOMES)]
    for name in sorted(by_file):
        counts = by_file[name]
        total.update(counts)
        lines.append(f"| {name} | " + " | ".join(str(counts[o]) for o in OUTCOMES) + " |")
    lines.append("| **all** | " + " | ".join(f"**{total[o]}**" for o in OUTCOMES) + " |")
    if baseline is not None:
        passing = [i for i, r in baseline.items() if r["outcome"] == "passed"]
        ran = [i for i in passing if i in records]
        lost = sorted(i for i in ran if records[i]["outcome"] != "passed")
        lines += [
            "",
            f"Of {len(passing)} tests that pass on the CPU backend, {len(ran)} ran here; "
            f"{len(ran) - len(lost)} pass, {len(lost)} do not "
            f"({100.0 * len(lost) / max(len(ran), 1):.2f}%):",
            "",
        ]
        lines += [f"- `{i}`: {records[i]['outcome']}: {records[i].get('detail', '')}" for i in lost]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", required=True, help="JSON lines, appended to and resumed")
    parser.add_argument("--minutes", type=float, help="start no test after this long")
    parser.add_argument("--report", help="write the Markdown table here (runs nothing)")
    parser.add_argument("--baseline", help="the same suite's results file from the CPU")
    args, pytest_args = parser.parse_known_args(argv)
    if args.report:
        baseline = load(args.baseline) if args.baseline else None
        with open(args.report, "w") as f:
            f.write(report(load(args.results), baseline))
        return 0
    here = os.path.dirname(os.path.abspath(__file__))
    recorder = Recorder(args.results, args.minutes)
    return pytest.main(
        ["-p", "no:cacheprovider", "-q", "--rootdir", os.path.dirname(here)]
        + (pytest_args or [here]),
        plugins=[recorder],
    )


if __name__ == "__main__":
    sys.exit(main())
