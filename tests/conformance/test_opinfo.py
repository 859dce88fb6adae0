"""PyTorch's OpInfo database as our correctness instrument (see torchtpu.conformance).

The default run checks the first float32 forward samples of every op in Strict mode
and the gradient of its first sample (the "ci" scope of harness.SCOPES): no silent
mismatch, and no loud failure the expectations table does not name.
``TORCHTPU_CONFORMANCE=forward`` checks every
float32 forward sample of every variant, ``TORCHTPU_CONFORMANCE=full`` adds every
dtype, gradients, error inputs and every eager mode.
"""

from __future__ import annotations

import pytest

from torchtpu import _compat, config
from torchtpu.conformance import expectations, harness

# Ops that reach the CPU fallback are reported by the harness, not failed here.
pytestmark = pytest.mark.allow_fallback

CASES = [
    pytest.param(case, cap, id=case.id) for case, cap in harness.scope(config.conformance_scope)
]


@pytest.mark.parametrize("case,max_samples", CASES)
def test_opinfo(case, max_samples):
    expected = expectations.lookup(case.op_name, case.variant, case.dtype, case.check, case.mode)
    if expected is not None and expected.kind == "skip":
        pytest.skip(expected.reason)
    tolerance = (
        (expected.rtol, expected.atol)
        if expected is not None and expected.kind == "tolerance"
        else (None, None)
    )
    result = harness.run(case, tolerance, max_samples)
    # A silent wrong answer is never expected: it fails whatever the table says.
    assert result.outcome != "mismatch", f"silent mismatch: {result.detail}"
    if expected is not None and expected.kind == "xfail":
        if result.outcome == "pass" and max_samples is None:
            # (With capped samples the failing sample may not have run.)
            pytest.fail(
                f"stale expectation: {case.id} passes now; remove its entry ({expected.reason})"
            )
        pytest.xfail(expected.reason)
    assert result.outcome == "pass", result.detail


def test_every_expectation_names_real_cases():
    """An entry whose op, variant, dtype, check or mode matches no case is stale."""
    every = list(harness.cases())
    for key, expected in expectations.EXPECTATIONS.items():
        if key[0] in _compat.OPINFO_FROM and not _compat.torch_at_least(
            *_compat.OPINFO_FROM[key[0]]
        ):
            continue  # an OpInfo entry of a later torch release
        matching = [
            c
            for c in every
            if all(
                k == "*" or k == v
                for k, v in zip(
                    key,
                    (c.op_name, c.variant, str(c.dtype).replace("torch.", ""), c.check, c.mode),
                )
            )
        ]
        assert matching, f"stale expectation {key}: no such case ({expected.reason})"
