"""PyTorch's OpInfo database as our correctness instrument (see torchtpu.conformance).

The default run checks float32 forward samples of every op and variant in Strict
mode; ``TORCHTPU_CONFORMANCE=full`` adds every dtype, gradients, error inputs and
every eager mode.
"""

from __future__ import annotations

import pytest
import torch

from torchtpu import config
from torchtpu.conformance import expectations, harness

# Ops that reach the CPU fallback are reported by the harness, not failed here.
pytestmark = pytest.mark.allow_fallback

if config.conformance_scope == "full":
    CASES = list(harness.cases())
else:
    CASES = list(harness.cases(dtypes=(torch.float32,), checks=("forward",), modes=("strict",)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_opinfo(case):
    expected = expectations.lookup(case.op_name, case.variant, case.dtype, case.check, case.mode)
    if expected is not None and expected.kind == "skip":
        pytest.skip(expected.reason)
    tolerance = (
        (expected.rtol, expected.atol)
        if expected is not None and expected.kind == "tolerance"
        else (None, None)
    )
    result = harness.run(case, tolerance)
    # A silent wrong answer is never expected: it fails whatever the table says.
    assert result.outcome != "mismatch", f"silent mismatch: {result.detail}"
    if expected is not None and expected.kind == "xfail":
        if result.outcome == "pass":
            pytest.fail(
                f"stale expectation: {case.id} passes now; remove its entry ({expected.reason})"
            )
        pytest.xfail(expected.reason)
    assert result.outcome == "pass", result.detail
