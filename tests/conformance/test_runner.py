"""The report's runner: worker processes, and a worker that dies costs its op only."""

from __future__ import annotations

import pytest
import torch

from torchtpu.conformance import harness, runner

pytestmark = pytest.mark.allow_fallback


def test_a_dying_worker_costs_its_op_and_the_run_goes_on():
    # An unknown entry makes the worker raise out of its loop and exit, as a native
    # crash would end it; the next entry runs in a fresh worker.
    doomed = harness.Case("no.such.op", "op", torch.float32, "forward", "strict")
    fine = harness.Case("abs", "op", torch.float32, "forward", "strict")
    results = runner.run_cases([(doomed, 1), (fine, 1)], jobs=1, progress=False)
    assert [r.case for r in results] == [doomed, fine]
    assert results[0].outcome == "fail"
    assert "worker process died" in results[0].detail
    assert results[1].outcome == "pass" and results[1].samples == 1
