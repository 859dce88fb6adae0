"""Failure classes found by PyTorch's device-generic tests (docs/upstream-tests.md)."""

import pytest
import torch

from torchtpu.conformance import upstream


def test_messages_are_torchs_and_the_op_is_a_note():
    # PyTorch's tests anchor messages: assertRaisesRegex(RuntimeError, "^Integer division")
    a = torch.ones(3, dtype=torch.int64)
    for device in ("cpu", "tpu"):
        x = a.to(device)
        with pytest.raises(RuntimeError) as info:
            torch.addcdiv(x, x, x)
        assert str(info.value).startswith("Integer division with addcdiv is no longer supported")
        if device == "tpu":
            assert any("aten.addcdiv.default" in n for n in info.value.__notes__)


def test_a_failed_value_check_keeps_torchs_wording():
    x = torch.arange(3.0, device="tpu")
    with pytest.raises(IndexError) as info:
        x[torch.tensor([5], device="tpu")].cpu()
    assert not str(info.value).startswith("aten.")
    assert any(n.startswith("torchtpu: raised by aten.index.Tensor") for n in info.value.__notes__)


def test_tests_match_across_devices_by_name():
    cpu = upstream.test_key("test_indexing.TestIndexingCPU", "test_take_cpu_float32")
    tpu = upstream.test_key("test_indexing.TestIndexingPRIVATEUSE1", "test_take_tpu_float32")
    assert cpu == tpu == "test_indexing.TestIndexing::test_take_float32"
    assert upstream.test_key("m.TestTPU", "test_cpu_only_tpu") == "m.Test::test_cpu_only"


def test_failures_are_classified():
    def cls(message, text=""):
        return upstream.classify(upstream.Outcome("fail", message, text))

    assert cls("AssertionError: RuntimeError not raised by <lambda>").startswith("invalid input")
    assert cls('AssertionError: "^Integer" does not match "aten.x: Integer"') == (
        "error message differs"
    )
    assert cls("Failed: Timeout (>120.0s) from pytest-timeout.") == "timeout"
    assert cls("KeyError: 3") == "other KeyError"
