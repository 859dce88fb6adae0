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
    compile_for_tpu: bool = False,
    on_group=None,
    deadline: float | None = None,
) -> list[harness.Result]:
    """Results of ``(case, max_samples)`` pairs, in their order.

    ``jobs`` worker processes run one OpInfo entry's cases at a time (0: run here, with
    no isolation); an entry taking longer than ``timeout`` seconds is stopped. With
    ``compile_for_tpu`` every program is also compiled for a TPU (xla_tpu.py);
    ``on_group(results)`` sees each entry's results as they come (a resumable run
    writes them down). After ``deadline`` (``time.monotonic()``) no entry is started;
    the cases of those not run are None.
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
        if on_group is not None:
            on_group(group_results)
        previous, done = done, done + len(group)
        if progress and previous // 100 != done // 100:
            print(f"  {done}/{len(selected)} cases", file=sys.stderr, flush=True)

    if jobs == 0:
        compiler = None
        if compile_for_tpu:
            from torchtpu.conformance import xla_tpu

            compiler = xla_tpu.Compiler()
        try:
            for group in groups.values():
                if deadline is not None and time.monotonic() > deadline:
                    break
                record(
                    group,
                    [
                        run_case(case, cap)
                        if compiler is None
                        else run_case_compiled_for_tpu(case, cap, compiler)
                        for _, case, cap in group
                    ],
                )
        finally:
            if compiler is not None:
                compiler.close()
    else:
        _Pool(jobs, timeout, compile_for_tpu).run(list(groups.values()), record, deadline)
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


def run_case_compiled_for_tpu(case, max_samples, compiler) -> harness.Result:
    """`run_case`, with every program it builds also compiled for a TPU (xla_tpu.py)."""
    from torchtpu.conformance import xla_tpu

    with xla_tpu.watch(compiler) as verdicts:
        result = run_case(case, max_samples)
    result.tpu_compile = tuple(
        f"{v.name}: {v.outcome}: {v.detail[:300]}" for v in verdicts if v.outcome != "ok"
    )
    result.compiled_for_tpu = True
    return result


def _worker(conn, compile_for_tpu: bool) -> None:
    """A worker's loop: receive a group of (index, case, cap), send back its results."""
    compiler = None
    if compile_for_tpu:
        from torchtpu.conformance import xla_tpu

        compiler = xla_tpu.Compiler()
    try:
        while True:
            group = conn.recv()
            if group is None:
                return
            if compiler is None:
                conn.send([run_case(case, cap) for _, case, cap in group])
            else:
                conn.send([run_case_compiled_for_tpu(c, cap, compiler) for _, c, cap in group])
    finally:
        if compiler is not None:
            compiler.close()


class _Worker:
    def __init__(self, context, compile_for_tpu: bool = False):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child, compile_for_tpu), daemon=True)
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
    def __init__(self, jobs: int, timeout: float, compile_for_tpu: bool = False):
        # spawn, not fork: the parent has started JAX's and torch's threads.
        self.context = multiprocessing.get_context("spawn")
        self.jobs = jobs
        self.timeout = timeout
        self.compile_for_tpu = compile_for_tpu

    def _new_worker(self) -> _Worker:
        return _Worker(self.context, self.compile_for_tpu)

    def run(self, groups, record, deadline: float | None = None) -> None:
        pending = collections.deque(groups)
        workers = [self._new_worker() for _ in range(min(self.jobs, len(pending)))]
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
                        w = workers[i] = self._new_worker()
                    elif w.group is None and w.groups_run >= GROUPS_PER_WORKER and pending:
                        w.conn.send(None)
                        w.stop()
                        w = workers[i] = self._new_worker()
                    if deadline is not None and time.monotonic() > deadline:
                        pending.clear()
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
