"""torchtpu.check_against_cpu(): the first op whose tpu result differs from the CPU's."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu.dispatch import core
from torchtpu.ops import TABLE

aten = torch.ops.aten


@pytest.fixture
def planted(monkeypatch):
    """Replace ``op``'s lowering by a wrong one (its result plus 0.01)."""

    def plant(op):
        right = TABLE[op]

        def wrong(*args, **kwargs):
            return right.fn(*args, **kwargs) + 0.01

        monkeypatch.setitem(TABLE, op, dataclasses.replace(right, fn=wrong))
        monkeypatch.delitem(core._HANDLERS, op, raising=False)

    yield plant
    for op in (aten.tanh.default, aten.tanh_backward.default):
        core._HANDLERS.pop(op, None)  # rebuilt from the restored lowering


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("mode", ["strict", "debug", "defer"])
def test_clean_programs_report_nothing(mode):
    model = _mlp().to("tpu")
    x = torch.randn(5, 8, device="tpu")
    with torch.tpu.set_eager_mode(mode), torchtpu.check_against_cpu():
        loss = F.cross_entropy(model(x), torch.tensor([0, 1, 2, 3, 0], device="tpu"))
        loss.backward()
        torch.optim.AdamW(model.parameters()).step()
        torch.sort(torch.tensor([1.0, 1.0, 2.0], device="tpu"))  # tied values
        (torch.randn(4, device="tpu").bfloat16() * 3).sum()  # 16-bit, judged by float64
        F.dropout(x, 0.5)  # random: by shape and dtype


@pytest.mark.parametrize("mode", ["strict", "debug", "defer"])
def test_a_wrong_lowering_is_named_with_the_line(planted, mode):
    planted(aten.tanh.default)
    x = torch.randn(3, 4, device="tpu")
    with torch.tpu.set_eager_mode(mode), torchtpu.check_against_cpu():
        y = x * 2
        with pytest.raises(torchtpu.TPUDivergenceError) as caught:
            torch.tanh(y)  # the line to name
    message = str(caught.value)
    assert "aten.tanh.default" in message
    assert f"{__file__}:" in message and "test_a_wrong_lowering_is_named_with_the_line" in message
    assert "float32[3, 4]" in message
    assert "max absolute error 0.01" in message


def test_a_wrong_backward_names_the_forward_line(planted):
    planted(aten.tanh_backward.default)
    model = _mlp().to("tpu")
    x = torch.randn(5, 8, device="tpu")
    with torchtpu.check_against_cpu():
        loss = model(x).sum()  # Tanh's forward runs here
        loss.backward()
        with pytest.raises(torchtpu.TPUDivergenceError) as caught:
            model[0].weight.grad.cpu()  # raised at the first read after backward()
    message = str(caught.value)
    assert "aten.tanh_backward.default" in message
    assert "backward of the op created there" in message
    assert "loss = model(x).sum()" not in message  # a location, not source text
    assert f"{__file__}:" in message


def test_warn_instead_of_raising(planted):
    planted(aten.tanh.default)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torchtpu.check_against_cpu(action="warn"):
            result = torch.tanh(torch.zeros(2, device="tpu"))
    assert [w.category for w in caught] == [torchtpu.TPUDivergenceWarning]
    assert torch.allclose(result.cpu(), torch.full((2,), 0.01))  # the tpu value goes on


def test_platform_tolerances_widen_what_a_test_asks_for(monkeypatch):
    # Note [Tolerances per platform]: on a TPU a float32 comparison allows at least the
    # platform's tolerance, whatever a test asks for; elsewhere what it asks for holds.
    from torchtpu.observe import compare

    monkeypatch.setattr(compare, "_platform", lambda: "tpu")
    wide = compare.PLATFORM_TOLERANCES["tpu"][torch.float32]
    assert compare.tolerance(torch.float32) == wide
    assert compare.tolerance(torch.float32, 1e-5, 0.0) == wide
    assert compare.tolerance(torch.float32, 1e-2, 1e-2) == (1e-2, 1e-2)
    assert compare.tolerance(torch.float64, 1e-7, 1e-7) == (1e-7, 1e-7)
    monkeypatch.setattr(compare, "_platform", lambda: "cpu")
    assert compare.tolerance(torch.float32, 1e-5, 0.0) == (1e-5, 0.0)
    assert compare.tolerance(torch.float32) == (None, None)
