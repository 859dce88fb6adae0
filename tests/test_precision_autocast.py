"""Matmul precision follows torch's setting; autocast runs matmuls in bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_same
from torchtpu import matmul_precision
from torchtpu.dispatch import plans


def _mm_precisions():
    return {key[-1] for key in plans._PLANS if key[0].op is torch.ops.aten.mm.default}


@pytest.fixture
def restore_precision():
    previous = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(previous)


def test_matmul_precision_follows_torch_and_the_override(restore_precision):
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    ta, tb = a.to("tpu"), b.to("tpu")
    assert torch.get_float32_matmul_precision() == "highest"  # torch's default, and ours
    assert matmul_precision.current() is torch.tpu.Precision.HIGHEST
    assert_same(ta @ tb, a @ b)
    torch.set_float32_matmul_precision("medium")
    assert matmul_precision.current() is torch.tpu.Precision.MEDIUM
    ta @ tb
    with torch.tpu.precision("high"):
        assert matmul_precision.current() is torch.tpu.Precision.HIGH
        ta @ tb
    assert matmul_precision.current() is torch.tpu.Precision.MEDIUM
    assert {
        torch.tpu.Precision.HIGHEST,
        torch.tpu.Precision.MEDIUM,
        torch.tpu.Precision.HIGH,
    } <= _mm_precisions()
    with pytest.raises(ValueError, match="unknown precision"):
        torch.tpu.precision("ultra")


def test_autocast_bfloat16():
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    tx, tw = x.to("tpu"), w.to("tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        out = F.linear(tx, tw)
        mm = tx @ tw.t()
        soft = torch.softmax(out, dim=-1)
        added = tx + 1  # not listed: unchanged
    assert out.dtype == torch.bfloat16 and mm.dtype == torch.bfloat16
    assert soft.dtype == torch.float32
    assert added.dtype == torch.float32
    expected = F.linear(x.bfloat16(), w.bfloat16())
    torch.testing.assert_close(out.cpu(), expected, rtol=1.6e-2, atol=1e-2)


def test_autocast_training_step():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(
        "tpu"
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8, device="tpu"), torch.tensor([0, 1, 0, 1], device="tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    assert loss.dtype == torch.float32
    loss.backward()
    opt.step()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
