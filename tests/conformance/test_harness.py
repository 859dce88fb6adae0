"""The conformance rules themselves: judging 16-bit floats against float64, tied indices, and
reporting stale expectations entries."""

from __future__ import annotations

import pytest
import torch

from torchtpu.conformance import __main__ as report
from torchtpu.conformance import harness
from torchtpu.observe import compare

BF16 = torch.bfloat16


def _bf16(*values):
    return torch.tensor(values, dtype=BF16)


def test_a_16_bit_result_closer_to_float64_than_the_cpus_passes():
    exact = torch.tensor([95.2360, 0.5], dtype=torch.float64)
    cpu, ours = _bf16(95.5, 0.5), _bf16(95.0, 0.5)  # 0.26 and 0.24 off
    compare.judge_by_float64(ours, cpu, exact, BF16)


def test_a_16_bit_result_further_from_float64_than_the_cpus_is_a_mismatch():
    exact = torch.tensor([95.2360, 0.5], dtype=torch.float64)
    cpu, ours = _bf16(95.0, 0.5), _bf16(97.0, 0.5)
    with pytest.raises(compare.Mismatch, match="off the float64 result"):
        compare.judge_by_float64(ours, cpu, exact, BF16)


def test_judging_by_float64_keeps_nans_dtypes_and_integer_outputs_exact():
    exact = torch.tensor([1.0, float("nan")], dtype=torch.float64)
    with pytest.raises(compare.Mismatch, match="NaN"):
        compare.judge_by_float64(_bf16(1.0, 2.0), _bf16(1.0, float("nan")), exact, BF16)
    with pytest.raises(compare.Mismatch, match="dtype"):
        compare.judge_by_float64(torch.tensor([1.0, 2.0]), _bf16(1.0, 2.0), exact, BF16)
    values, indices = _bf16(1.0), torch.tensor([3])
    with pytest.raises(compare.Mismatch, match="not equal"):
        compare.judge_by_float64(
            (values, torch.tensor([2])), (values, indices), (exact[:1], indices), BF16
        )


def test_tied_indices_are_compared_by_the_values_they_point_at():
    from torch.testing._internal.opinfo.core import SampleInput

    sample = SampleInput(torch.tensor([[3.0, 1.0, 3.0]]), args=(1, True))  # mode(dim=1)
    one = compare.pointed_values(sample, (torch.tensor([[3.0]]), torch.tensor([[0]])), 0, 1)
    other = compare.pointed_values(sample, (torch.tensor([[3.0]]), torch.tensor([[2]])), 0, 1)
    compare.compare(one, other, random=False)
    wrong = compare.pointed_values(sample, (torch.tensor([[3.0]]), torch.tensor([[1]])), 0, 1)
    with pytest.raises(compare.Mismatch):
        compare.compare(wrong, one, random=False)


def test_an_entry_is_stale_only_if_none_of_its_cases_needed_it():
    def result(variant, stale):
        case = harness.Case("addbmm", variant, torch.float32, "forward", "strict")
        return harness.Result(case, "pass", stale=stale)

    key = ("addbmm", "*", "float32", "*", "*")
    assert report._stale_entries([result("op", "not needed"), result("method", "")]) == {}
    stale = report._stale_entries([result("op", "not needed"), result("method", "not needed")])
    assert stale == {key: "not needed"}


def test_float32_products_traced_below_highest_precision_are_recorded():
    import jax
    import jax.numpy as jnp

    from torchtpu.conformance import products

    a = jnp.ones((4, 4), jnp.float32)
    image, kernel = jnp.ones((1, 1, 5, 5), jnp.float32), jnp.ones((1, 1, 3, 3), jnp.float32)
    with products.watch() as found:
        jax.jit(lambda x: x @ x)(a)
        jax.jit(lambda x: jax.lax.conv(x, kernel, (1, 1), "VALID"))(image)
        jax.jit(lambda x: jnp.matmul(x, x, precision=jax.lax.Precision.HIGHEST))(a)
        jax.jit(lambda x: x @ x)(a.astype(jnp.bfloat16))  # not float32: one pass is right
    assert [f.split("(")[0] for f in found] == ["dot_general", "conv_general_dilated"]
    with products.watch() as found:
        jax.jit(lambda x: x @ x * 2)(a)  # watching ends with the block
    assert len(found) == 1 and "float32[4,4]" in found[0]


def test_a_lowering_whose_float32_product_ignores_the_precision_is_a_mismatch(monkeypatch):
    import jax
    import jax.numpy as jnp

    from torchtpu.dispatch import plans
    from torchtpu.ops import linalg_solvers

    # linalg.pinv as it was before the v5e showed it 3e-3 off: the product at XLA's default
    class DefaultPrecision:
        def __getattr__(self, name):
            return getattr(jnp, name)

        @staticmethod
        def matmul(a, b, precision=None):
            return jnp.matmul(a, b)

    monkeypatch.setattr(linalg_solvers, "jnp", DefaultPrecision())
    case = harness.Case("linalg.pinv.hermitian", "op", torch.float32, "forward", "strict")
    plans._PLANS.clear()  # programs traced before would hide the lowering's products
    try:
        result = harness.run(case, max_samples=2)
    finally:
        plans._PLANS.clear()  # nor may the shim's programs outlive the test
    # a TPU computes the product in one bfloat16 pass: the values are 3e-3 off there;
    # on the CPU they are right and the watch on the products says what the chip would do
    assert result.outcome == "mismatch"
    if jax.default_backend() == "cpu":
        assert "below float32 precision" in result.detail
