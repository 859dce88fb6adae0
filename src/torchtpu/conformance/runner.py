"""Run many conformance cases, in worker processes: a crash or a hang costs one op, not
the run.

A report run takes an hour or more, and one op that aborts the process (a native
crash) or never returns would otherwise lose everything before it. So the cases are
grouped by OpInfo entry and handed, one group at a time, to worker processes; a worker
that dies or overruns its time is replaced, and its group's cases are recorded as
loud failures saying so. With ``jobs=0`` everything runs in this process instead.
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import sys
import time

from torchtpu.conformance import expectations, harness

#: A worker is replaced after this many groups, so that compiled functions and other
#: per-process state do not grow without bound over a long run.
GROUPS_PER_WORKER = 100


def run_case(case: harness.Case, max_samples: int | None) -> harness.Result:
    """One case, as the expectations table says to run it (skip, tolerance, xfail)."""
    expected = expectations.lookup(case.op_name, case.variant, case.dtype, case.check, case.mode)
    if expected is not None and expected.kind == "skip":
        return harness.Result(case, "skip", expected.reason)
    tolerance = (
        (expected.rtol, expected.atol)
        if expected is not None and expected.kind == "tolerance"
        else (None, None)
    )
    result = harness.run(case, tolerance, max_samples)
    if expected is not None and expected.kind == "xfail":
        if result.outcome == "fail":
            result.detail = f"{expected.reason} ({result.detail})"
        elif result.outcome == "pass" and max_samples is None:
            result.stale = "passes: its xfail entry is stale"
    if expected is not None and expected.kind == "tolerance" and result.outcome == "pass":
        if harness.run(case, (None, None), max_samples).outcome == "pass":
            result.stale = "passes with torch's default tolerances: its tolerance entry is stale"
    return result


def run_cases(
    selected: list[tuple[harness.Case, int | None]],
    jobs: int = 1,
    timeout: float = 900.0,
    progress: bool = True,
) -> list[harness.Result]:
    """Results of ``(case, max_samples)`` pairs, in their order.

    ``jobs`` worker processes run one OpInfo entry's cases at a time (0: run here, with
    no isolation); an entry taking longer than ``timeout`` seconds is stopped.
    """
    groups = collections.defaultdict(list)
    for index, (case, cap) in enumerate(selected):
        groups[case.op_name].append((index, case, cap))
    results: list[harness.Result | None] = [None] * len(selected)
    done = 0

    def record(group, group_results):
        nonlocal done
        for (index, _, _), result in zip(group, group_results):
            results[index] = result
            _report_progress(result, progress)
        previous, done = done, done + len(group)
        if progress and previous // 100 != done // 100:
            print(f"  {done}/{len(selected)} cases", file=sys.stderr, flush=True)

    if jobs == 0:
        for group in groups.values():
            record(group, [run_case(case, cap) for _, case, cap in group])
    else:
        _Pool(jobs, timeout).run(list(groups.values()), record)
    return results


def _report_progress(result: harness.Result, progress: bool) -> None:
    # As they happen, so a long run can be read (and acted on) before it ends.
    if progress and (result.outcome != "pass" or result.fallbacks):
        fallbacks = f" [CPU fallback: {', '.join(result.fallbacks)}]" if result.fallbacks else ""
        print(
            f"  {result.case.id}: {result.outcome} {result.detail}{fallbacks}",
            file=sys.stderr,
            flush=True,
        )


def _worker(conn) -> None:
    """A worker's loop: receive a group of (index, case, cap), send back its results."""
    while True:
        group = conn.recv()
        if group is None:
            return
        conn.send([run_case(case, cap) for _, case, cap in group])


class _Worker:
    def __init__(self, context):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.group = None
        self.started = 0.0
        self.groups_run = 0

    def give(self, group) -> None:
        self.group, self.started = group, time.monotonic()
        self.groups_run += 1
        self.conn.send(group)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


class _Pool:
    def __init__(self, jobs: int, timeout: float):
        # spawn, not fork: the parent has started JAX's and torch's threads.
        self.context = multiprocessing.get_context("spawn")
        self.jobs = jobs
        self.timeout = timeout

    def run(self, groups, record) -> None:
        pending = collections.deque(groups)
        workers = [_Worker(self.context) for _ in range(min(self.jobs, len(pending)))]
        try:
            for w in workers:
                w.give(pending.popleft())
            while any(w.group is not None for w in workers):
                busy = [w for w in workers if w.group is not None]
                ready = multiprocessing.connection.wait(
                    [w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=5.0
                )
                for i, w in enumerate(workers):
                    if w.group is None:
                        continue
                    failure = None
                    if w.conn in ready:
                        try:
                            record(w.group, w.conn.recv())
                        except EOFError:
                            failure = f"the worker process died (exit code {_exit_code(w)})"
                        else:
                            w.group = None
                    elif w.process.sentinel in ready:
                        failure = f"the worker process died (exit code {_exit_code(w)})"
                    elif time.monotonic() - w.started > self.timeout:
                        failure = f"timed out after {self.timeout:.0f} s"
                    if failure is not None:
                        record(w.group, [_lost(case, failure) for _, case, _ in w.group])
                        w.group = None
                        w.stop()
                        w = workers[i] = _Worker(self.context)
                    elif w.group is None and w.groups_run >= GROUPS_PER_WORKER and pending:
                        w.conn.send(None)
                        w.stop()
                        w = workers[i] = _Worker(self.context)
                    if w.group is None and pending:
                        w.give(pending.popleft())
        finally:
            for w in workers:
                w.stop()


def _exit_code(worker: _Worker) -> int | None:
    worker.process.join(timeout=5.0)
    return worker.process.exitcode


def _lost(case: harness.Case, why: str) -> harness.Result:
    return harness.Result(case, "fail", f"{why} while running this op's cases")
