"""PyTorch's own device-generic test files, run on the CPU and on tpu.

    python -m torchtpu.conformance.upstream --pytorch /path/to/pytorch \\
        test_indexing.py test_view_ops.py --out docs/upstream-tests.md

PyTorch's test files that call ``instantiate_device_type_tests`` make a test class for
every registered device, a PrivateUse1 backend included (``TestIndexingTPU``, its
tests ending in ``_tpu``). For each file this runs pytest twice in ``<pytorch>/test``
(so the files' relative imports work), once with
``PYTORCH_TESTING_DEVICE_ONLY_FOR=cpu`` and once with ``=tpu``, each writing a JUnit
XML file, then matches the two runs' tests by name with the device suffix stripped.
Only tests that pass on the CPU count: the CPU run is the baseline, the tpu run's
result on each of them is pass, fail (classified by exception type and message, see
``classify``), skip or missing. The checkout only supplies the test files; they import
``torch.testing._internal`` from the installed torch.

The XML files and wall times stay in ``--work``; ``--report-only`` writes the page from
them without running anything (a file's later run replaces its earlier one).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

DEVICES = ("cpu", "tpu")
_DEVICE_SUFFIX = re.compile(r"(CPU|TPU|PRIVATEUSE1)$")
_DEVICE_TOKEN = re.compile(r"_(cpu|tpu|privateuse1)(?=_|$)")


@dataclasses.dataclass
class Outcome:
    """One test's result in one run."""

    status: str  # "pass", "fail", "skip"
    message: str = ""  # the exception's first line (fail) or the skip reason
    text: str = ""  # the traceback's last lines (fail)


def test_key(classname: str, name: str) -> str:
    """A test's name with its device stripped: the same on the CPU and on tpu.

    >>> test_key("test_indexing.TestIndexingTPU", "test_take_tpu_float32")
    'test_indexing.TestIndexing::test_take_float32'
    """
    cls = _DEVICE_SUFFIX.sub("", classname)
    tokens = list(_DEVICE_TOKEN.finditer(name))
    if tokens:  # the device comes before the dtype suffixes: strip the last one
        t = tokens[-1]
        name = name[: t.start()] + name[t.end() :]
    return f"{cls}::{name}"


def read_junit(path: Path) -> dict[str, Outcome]:
    """The outcomes of one pytest run, by test_key."""
    outcomes: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        key = test_key(case.get("classname", ""), case.get("name", ""))
        status, message, text = "pass", "", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status = "fail"
                message = (child.get("message") or "").strip()
                text = child.text or ""
                break
            if child.tag == "skipped":
                status, message = "skip", (child.get("message") or "").strip()
        outcomes[key] = Outcome(status, message, text)
    return outcomes


# Failure classes, first match wins: (class, pattern searched in the message and the
# traceback's end). The class names are what the page groups by.
_CLASSES: list[tuple[str, str]] = [
    ("timeout", r"Failed: Timeout"),
    ("zero-element tensor viewed as a wider dtype (ZeroDivisionError)", r"ZeroDivisionError"),
    ("invalid input accepted (the CPU raises)", r"AssertionError: \w+ not raised|DID NOT RAISE"),
    (
        "warning count or text differs",
        r"warnings? (not triggered|were not triggered)|AssertionError: \d+ != \d+ : .*warn|"
        r"UserWarning not triggered",
    ),
    ("warning count differs (uint8 mask deprecation)", r"assertEqual\(len\(w\)"),
    ("error message differs", r"AssertionError: \".*\" does not match \""),
    ("storage / data_ptr identity", r"data_ptr|untyped_storage|storage\(\)|set_\("),
    ("unsupported dtype (complex32, quantized)", r"complex32|ComplexHalf|quint|qint|quantized"),
    ("sparse layout", r"[Ss]parse|SparseTPU|sparse_coo|to_sparse"),
    ("values differ", r"Tensor-likes are not (close|equal)|Scalars are not (close|equal)"),
    (
        "metadata differs (stride, dtype, shape, is_conj/is_neg)",
        r"AssertionError: (False|True) is not (true|false)|"
        r"The values for attribute '(stride|dtype|shape|device)' do not match|"
        r"AssertionError: torch\.\w+ != torch\.\w+|AssertionError: \(.*\) != \(.*\)",
    ),
    ("runs on the CPU instead (fallback)", r"TPUFallbackError|CPU fallback"),
    ("not implemented", r"NotImplementedError"),
]
_EXC = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Warning|Failed|Interrupt))\b")


def classify(outcome: Outcome) -> str:
    """The failure class of a failed test (``_CLASSES``), else its exception type."""
    tail = "\n".join(outcome.text.strip().splitlines()[-40:])
    hay = f"{outcome.message}\n{tail}"
    for name, pattern in _CLASSES:
        # A chained cause can sit above the traceback's last lines: the zero-element
        # class is searched in the whole text.
        where = outcome.text if name.startswith("zero-element") else hay
        if re.search(pattern, where):
            return name
    m = _EXC.match(outcome.message)
    return f"other {m.group(1)}" if m else "other"


def _pytest_command(
    file: str, xml: Path, timeout: float | None, jobs: int, extra: list[str]
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        file,
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
    ]
    # An upstream conftest.py is written for its own pytest version and CI (reruns,
    # shards): the files run without it.
    cmd.append("--noconftest")
    if timeout and importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append(f"--timeout={timeout:g}")
    if jobs > 1:
        cmd += ["-n", str(jobs)]
    return cmd + extra


def run_file(pytorch: Path, file: str, device: str, work: Path, args: argparse.Namespace) -> dict:
    """Runs one test file for one device; returns what the page needs of the run."""
    stem = Path(file).stem
    xml = work / f"{stem}.{device}.xml"
    log = work / f"{stem}.{device}.log"
    xml.unlink(missing_ok=True)
    env = dict(os.environ, PYTORCH_TESTING_DEVICE_ONLY_FOR=device)
    cmd = _pytest_command(file, xml, args.timeout, args.jobs, args.pytest_arg or [])
    start = time.perf_counter()
    with log.open("w") as out:
        try:
            proc = subprocess.run(
                cmd,
                cwd=pytorch / "test",
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=args.run_timeout,
            )
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "killed after --run-timeout"
    wall = time.perf_counter() - start
    sys.stderr.write(f"{file} [{device}]: exit {rc}, {wall:.0f} s, log {log}\n")
    return {"file": file, "device": device, "xml": str(xml), "wall_s": round(wall, 1), "rc": rc}


@dataclasses.dataclass
class FileReport:
    file: str
    walls: dict[str, float]
    baseline: int  # tests passing on the CPU
    passed: int
    skipped: list[tuple[str, str]]
    missing: list[str]
    failures: list[tuple[str, str, str]]  # (test, class, message)
    cpu_not_passing: int
    broken: str = ""  # a run that wrote no XML


def compare(file: str, runs: dict[str, dict]) -> FileReport:
    walls = {d: runs[d]["wall_s"] for d in DEVICES if d in runs}
    for d in DEVICES:
        if d not in runs or not Path(runs[d]["xml"]).exists():
            rc = runs.get(d, {}).get("rc", "not run")
            return FileReport(
                file, walls, 0, 0, [], [], [], 0, broken=f"{d} run wrote no results (exit {rc})"
            )
    cpu = read_junit(Path(runs["cpu"]["xml"]))
    tpu = read_junit(Path(runs["tpu"]["xml"]))
    baseline = sorted(k for k, o in cpu.items() if o.status == "pass")
    passed, skipped, missing, failures = 0, [], [], []
    for key in baseline:
        o = tpu.get(key)
        if o is None:
            missing.append(key)
        elif o.status == "pass":
            passed += 1
        elif o.status == "skip":
            skipped.append((key, o.message))
        else:
            failures.append((key, classify(o), o.message))
    return FileReport(
        file, walls, len(baseline), passed, skipped, missing, failures, len(cpu) - len(baseline)
    )


def _short(text: str, n: int = 160) -> str:
    line = " ".join(text.split())
    line = line.replace("|", "\\|")
    return line if len(line) <= n else line[: n - 1] + "…"


def _rate(r: FileReport) -> str:
    ran = r.baseline - len(r.skipped) - len(r.missing)
    pct = 100.0 * r.passed / ran if ran else 0.0
    return f"{pct:.1f}% ({r.passed}/{ran})"


def render(reports: list[FileReport], source: str, command: str, reasons: dict[str, str]) -> str:
    lines = [
        "# PyTorch's device-generic tests on tpu",
        "",
        "Generated by",
        "",
        f"    {command}",
        "",
        f"Test files: {source}. Installed torch supplies `torch.testing._internal`.",
        "",
        "Each file runs twice under pytest (`PYTORCH_TESTING_DEVICE_ONLY_FOR=cpu`, then `=tpu`);",
        "only the tests that pass on the CPU count. The rate is the share of those that pass",
        "on tpu, among the ones the tpu run does not skip (decorators such as",
        "`onlyNativeDeviceTypes` or `onlyCPU` skip a test on a PrivateUse1 device).",
        "",
        "| file | CPU passing | tpu passes | tpu skips | not instantiated on tpu | wall CPU / tpu (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in reports:
        if r.broken:
            lines.append(f"| {r.file} | {r.broken} | | | | |")
            continue
        walls = " / ".join(f"{r.walls.get(d, 0):.0f}" for d in DEVICES)
        lines.append(
            f"| {r.file} | {r.baseline} | {_rate(r)} | {len(r.skipped)} | {len(r.missing)} | {walls} |"
        )
    lines += [
        "",
        "## Failure classes",
        "",
        "| class | " + " | ".join(r.file for r in reports) + " |",
    ]
    lines.append("|---|" + "---|" * len(reports))
    counts = {r.file: Counter(c for _, c, _ in r.failures) for r in reports}
    classes = sorted(
        {c for cnt in counts.values() for c in cnt},
        key=lambda c: -sum(cnt[c] for cnt in counts.values()),
    )
    for c in classes:
        lines.append(f"| {c} | " + " | ".join(str(counts[r.file][c] or "") for r in reports) + " |")
    for r in reports:
        if not r.failures:
            continue
        lines += ["", f"## {r.file}: failures", "", "| test | class | reason |", "|---|---|---|"]
        for key, cls, message in sorted(r.failures, key=lambda f: (f[1], f[0])):
            test = key.split("::", 1)[1]
            lines.append(f"| `{test}` | {cls} | {_short(reasons.get(test) or message)} |")
    skips = Counter(_short(msg, 100) for r in reports for _, msg in r.skipped)
    if skips:
        lines += [
            "",
            "## Skipped on tpu (passing on the CPU)",
            "",
            "| reason | tests |",
            "|---|---|",
        ]
        lines += [f"| {reason or '(none given)'} | {n} |" for reason, n in skips.most_common()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m torchtpu.conformance.upstream", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "files", nargs="+", help="test files under <pytorch>/test, e.g. test_indexing.py"
    )
    p.add_argument(
        "--pytorch", type=Path, required=True, help="a PyTorch source checkout (only test/ is read)"
    )
    p.add_argument(
        "--out", type=Path, help="the Markdown page to write (e.g. docs/upstream-tests.md)"
    )
    p.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "torchtpu-upstream",
        help="where the JUnit XML, logs and wall times are kept",
    )
    p.add_argument(
        "--devices", nargs="+", default=list(DEVICES), choices=DEVICES, help="which runs to (re)do"
    )
    p.add_argument(
        "--timeout", type=float, default=300, help="seconds per test (pytest-timeout), 0 for none"
    )
    p.add_argument("--run-timeout", type=float, default=None, help="seconds per pytest run")
    p.add_argument("--jobs", type=int, default=1, help="pytest-xdist workers per run")
    p.add_argument("--pytest-arg", action="append", help="one more pytest argument (repeatable)")
    p.add_argument("--report-only", action="store_true", help="write the page from the kept runs")
    p.add_argument(
        "--source", help="how the page names the test files' origin (default: the checkout's path)"
    )
    p.add_argument(
        "--reasons", type=Path, help="JSON {test name: reason} overriding the listed messages"
    )
    args = p.parse_args(argv)

    args.work.mkdir(parents=True, exist_ok=True)
    index_path = args.work / "runs.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    if not args.report_only:
        for file in args.files:
            if not (args.pytorch / "test" / file).exists():
                p.error(f"no {args.pytorch / 'test' / file}")
            for device in args.devices:
                index.setdefault(file, {})[device] = run_file(
                    args.pytorch, file, device, args.work, args
                )
                index_path.write_text(json.dumps(index, indent=1))
    reports = [compare(f, index.get(f, {})) for f in args.files]
    for r in reports:
        sys.stderr.write(f"{r.file}: {r.broken or _rate(r)}\n")
    if args.out:
        reasons = json.loads(args.reasons.read_text()) if args.reasons else {}
        given = f"--reasons {args.reasons} --out {args.out} " if args.reasons else ""
        command = (
            "python -m torchtpu.conformance.upstream --pytorch <pytorch> "
            + given
            + " ".join(args.files)
        )
        args.out.write_text(render(reports, args.source or str(args.pytorch), command, reasons))
    return 0


if __name__ == "__main__":
    sys.exit(main())
