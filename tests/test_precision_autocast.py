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


# The error each setting may make, relative to the largest value of the float64 result:
# one bfloat16 pass ("medium") keeps 8 bits of each operand, three ("high") about 16,
# "highest" is float32's. On the CPU backend every setting computes in float32; on a
# TPU v5e a 4096-wide product measured 2.1e-3, 1.2e-5 and 4.9e-7 (docs/tpu.md).
_BOUNDS = {"highest": 1e-5, "high": 2e-4, "medium": 1e-2}


@pytest.mark.parametrize("setting", list(_BOUNDS))
def test_each_precision_setting_against_float64(setting, restore_precision):
    torch.manual_seed(0)
    a, b = torch.randn(256, 512), torch.randn(512, 128)
    x, w = torch.randn(2, 8, 16, 16), torch.randn(4, 8, 3, 3)
    exact_mm = (a.double() @ b.double()).float()
    exact_conv = F.conv2d(x.double(), w.double()).float()
    torch.set_float32_matmul_precision(setting)
    for actual, exact in (
        ((a.to("tpu") @ b.to("tpu")).cpu(), exact_mm),
        (F.conv2d(x.to("tpu"), w.to("tpu")).cpu(), exact_conv),
    ):
        error = ((actual - exact).abs().max() / exact.abs().max()).item()
        assert error <= _BOUNDS[setting], (setting, error)


_GPU_SWITCHES = r"""
import torch
from torchtpu import matmul_precision as m
torch.backends.cuda.matmul.allow_tf32 = True
assert m.current() is m.Precision.HIGH, m.current()
torch.backends.cuda.matmul.allow_tf32 = False
assert m.current() is m.Precision.HIGHEST
torch.backends.cuda.matmul.fp32_precision = "tf32"  # the newer API: torch's legacy getter raises
assert m.current() is m.Precision.HIGH, m.current()
torch.backends.cuda.matmul.fp32_precision = "none"
torch.backends.fp32_precision = "bf16"
assert m.current() is m.Precision.MEDIUM, m.current()
x = torch.randn(4, 4, device="tpu")
x @ x  # matmuls run whatever the state of torch's switches
print("ok")
"""


def test_gpu_precision_switches_map(tmp_path):
    import os
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _GPU_SWITCHES],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ,
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


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
