"""torchtpu on each torch release: a virtual environment per release, the README's demo
and the whole default suite in each, and the table of what passed.

    python -m torchtpu.conformance.releases --torch 2.11.0 2.12.1 2.13.0 2.14.1 2.15.0

Each release gets ``.venvs/torch-<release>`` (kept, so each build is fetched once: a
CUDA build from PyPI is several GB), with that torch pinned and this checkout installed
editable with its test extra -- as a user installs beside a torch they already have.
pip runs without this machine's pip configuration, whose constraint file caps torch at
the releases on its disk. In the environment: ``python -m torchtpu.demo --steps 3``
and ``python -m pytest -n 2`` (the README's command). Results go to
``docs/compatibility.json`` (a row per release, replacing that release's earlier row)
and the page ``docs/compatibility.md`` is written from it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def environment(release: str, root: str = ROOT) -> str:
    """The release's virtual environment, made (and filled) if it is not there yet."""
    venv = os.path.join(root, ".venvs", f"torch-{release}")
    python = os.path.join(venv, "bin", "python")
    done = os.path.join(venv, ".installed")
    if os.path.exists(done):
        return python
    _run([sys.executable, "-m", "venv", venv], 600, check=True)
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)  # no local cap on torch releases
    pip = [python, "-m", "pip", "install", "--quiet"]
    _run(pip + ["--upgrade", "pip"], 1800, check=True, env=env)
    install = _run(pip + [f"torch=={release}", "-e", f"{root}[test]"], 7200, env=env)
    if install.returncode != 0:
        raise RuntimeError(f"installing torch {release} failed:\n{install.stderr[-3000:]}")
    open(done, "w").close()
    return python


def check(release: str, root: str = ROOT) -> dict:
    """Install (once), then run the demo and the suite on ``release``; the results row."""
    python = environment(release, root)
    versions = _run(
        [python, "-c", "import torch, jax; print(torch.__version__, jax.__version__)"], 600
    ).stdout.split()
    row = {
        "release": release,
        "torch": versions[0] if versions else "?",
        "jax": versions[1] if len(versions) > 1 else "?",
        "date": datetime.date.today().isoformat(),
        "commit": _run(["git", "rev-parse", "--short", "HEAD"], 60, cwd=root).stdout.strip(),
    }
    demo = _run([python, "-m", "torchtpu.demo", "--steps", "3"], 1800, cwd=root)
    row["demo"] = "pass" if demo.returncode == 0 else "fail: " + _last_line(demo.stderr)
    xml = os.path.join(os.path.dirname(os.path.dirname(python)), "suite.xml")
    env = dict(os.environ)
    libtpu = os.path.join(root, ".venv", "libtpu")  # .ci/run's, for tests/test_xla_tpu.py
    if os.path.isdir(libtpu):
        env.setdefault("TORCHTPU_LIBTPU_DIR", libtpu)
    start = time.monotonic()
    _run(
        [python, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", f"--junitxml={xml}"],
        5400,
        cwd=root,
        env=env,
    )
    row["suite_minutes"] = round((time.monotonic() - start) / 60, 1)
    row.update(_suite_counts(xml))
    return row


def _suite_counts(xml: str) -> dict:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    if not os.path.exists(xml):
        return {**counts, "failures": ["the suite wrote no results"]}
    for case in ET.parse(xml).getroot().iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            counts["failed"] += 1
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            failures.append(f"{name}: {(problem.get('message') or '').splitlines()[0][:200]}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures}


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def page(rows: list[dict]) -> str:
    lines = [
        "# Compatibility: torch releases",
        "",
        "Each row: a virtual environment with that torch and this checkout installed beside "
        "it, the README's demo (`python -m torchtpu.demo`) and the whole default suite "
        "(`python -m pytest -n 2`), on the CPU backend. Written by "
        "`python -m torchtpu.conformance.releases --torch <releases>`; CI runs the suite on "
        "2.13.0 and 2.14.1 at every change.",
        "",
        "| torch | jax | date | commit | demo | suite passed | failed | skipped or xfail | minutes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: tuple(int(p) for p in r["release"].split("."))):
        lines.append(
            f"| {r['torch']} | {r['jax']} | {r['date']} | {r['commit']} | {r['demo']} | "
            f"{r['passed']} | {r['failed']} | {r['skipped']} | {r.get('suite_minutes', '')} |"
        )
    failing = [r for r in rows if r["failures"]]
    if failing:
        lines += ["", "## Failures", ""]
        for r in failing:
            lines += [f"- torch {r['torch']}: `{f}`" for f in r["failures"]]
    noted = [r for r in rows if r.get("note")]  # a row's provenance, written by hand
    if noted:
        lines += ["", "## Notes", ""]
        lines += [f"- torch {r['torch']}: {r['note']}" for r in noted]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", nargs="+", required=True, metavar="RELEASE")
    parser.add_argument("--results", default=os.path.join(ROOT, "docs", "compatibility.json"))
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "compatibility.md"))
    args = parser.parse_args(argv)
    rows = []
    if os.path.exists(args.results):
        with open(args.results) as f:
            rows = json.load(f)
    for release in args.torch:
        print(f"torch {release}: installing (once) and checking", file=sys.stderr, flush=True)
        row = check(release)
        rows = [r for r in rows if r["release"] != release] + [row]
        with open(args.results, "w") as f:
            json.dump(rows, f, indent=1)
        with open(args.out, "w") as f:
            f.write(page(rows))
        print(
            f"torch {release}: demo {row['demo']}; suite {row['passed']} passed, "
            f"{row['failed']} failed, {row['skipped']} skipped",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    main()
