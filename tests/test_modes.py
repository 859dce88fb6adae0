"""Eager modes: selection, Debug's immediate errors pointing at the user's line."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import torchtpu
from torchtpu import EagerMode


def _mode_in_subprocess(**env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTPU_", "TORCH_TPU_"))}
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; torch.ones(1, device='tpu'); print(torch.tpu.eager_mode.name)",
        ],
        capture_output=True,
        text=True,
        env={**clean, **env},
        timeout=300,
    )


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, "DEFER_NEVER"),
        ({"TORCHTPU_EAGER_MODE": "strict"}, "DEFER_NEVER"),
        ({"TORCHTPU_EAGER_MODE": "debug"}, "DEFER_NEVER_AND_LAUNCH_BLOCKING"),
        ({"TORCH_TPU_LAUNCH_BLOCKING": "1"}, "DEFER_NEVER_AND_LAUNCH_BLOCKING"),
        ({"TORCHTPU_EAGER_MODE": "defer"}, "DEFER_AND_FUSE"),
        ({"TORCH_TPU_DEFER_AND_FUSE": "1"}, "DEFER_AND_FUSE"),
    ],
)
def test_mode_from_environment(env, expected):
    result = _mode_in_subprocess(**env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


def test_set_eager_mode_is_a_context_manager_and_a_setter():
    assert torch.tpu.eager_mode is EagerMode.DEFER_NEVER
    with torch.tpu.set_eager_mode("debug"):
        assert torch.tpu.eager_mode is EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
        torch.ones(2, device="tpu").add(1)
    assert torch.tpu.eager_mode is EagerMode.DEFER_NEVER
    torch.tpu.eager_mode = EagerMode.DEBUG
    try:
        assert torch.tpu.eager_mode is EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    finally:
        torch.tpu.eager_mode = "strict"
    with pytest.raises(ValueError, match="unknown eager mode"):
        torch.tpu.set_eager_mode("fast")


def test_ops_are_counted_per_mode():
    x = torch.ones(4, device="tpu")
    torchtpu.reset_metrics()
    x + 1
    with torch.tpu.set_eager_mode("debug"):
        x * 2
        x - 3
    with torch.tpu.set_eager_mode("defer"):
        x / 4
    counts = torchtpu.metrics()["ops"]
    assert counts == {"strict": 1, "debug": 2, "defer": 1}


def test_debug_mode_raises_at_the_op_naming_it_and_the_user_line():
    x = torch.arange(3.0, device="tpu")
    bad = torch.tensor([5], device="tpu")
    with torch.tpu.set_eager_mode("debug"):
        with pytest.raises(IndexError) as info:
            x[bad]  # this line
    line = sys._getframe().f_lineno - 1
    text = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    assert "aten.index.Tensor" in text
    assert "float32[3]" in text and "int64[1]" in text
    assert f"{__file__}:{line}" in text


def test_strict_mode_raises_the_same_error_at_the_next_read():
    x = torch.arange(3.0, device="tpu")
    # An index computed on the device is checked there, at the next read (one uploaded
    # from the host is checked at once: Note [Host copies of uploads]).
    y = x[torch.full((1,), 5, device="tpu")]
    line = sys._getframe().f_lineno - 1
    with pytest.raises(IndexError) as info:
        y.cpu()
    notes = "\n".join(info.value.__notes__)  # torch's message; the op and line in a note
    assert "aten.index.Tensor" in notes and f"{__file__}:{line}" in notes
    torch.tpu.synchronize()  # the failed check was consumed


def test_lowering_errors_name_the_op_in_both_modes(mode):
    with pytest.raises(RuntimeError, match="aten.mm.default"):
        torch.ones(2, 3, device="tpu") @ torch.ones(4, 5, device="tpu")


def test_strict_waits_for_the_inputs_of_an_op_with_large_outputs(monkeypatch):
    """Note [Strict waits before a large allocation]: in Strict an op whose new outputs
    take ``strict_wait_fraction`` of the device's memory or more first waits for its
    inputs. An in-place op whose old buffer it donates allocates nothing new and does
    not, nor do smaller ops, Debug (which waits after every op) or DeferAndFuse; one
    whose buffer is held elsewhere does. The values are the CPU's."""
    from torchtpu import memory

    monkeypatch.setattr(torchtpu.config, "strict_wait_fraction", 2**20 / memory.capacity(0))
    a = torch.randn(512, 512)  # 1 MiB
    x = a.to("tpu")
    torchtpu.reset_metrics()
    y = x @ x  # waits
    small = x[:8] * 2  # 16 KiB: does not
    y.add_(1)  # y's buffer is donated: does not
    held = torchtpu.to_jax(y)
    y.mul_(2)  # y's buffer is held: a new one, waits
    with torch.tpu.set_eager_mode("debug"):
        x * 3
    with torch.tpu.set_eager_mode("defer"):
        x * 4
    assert torchtpu.metrics()["strict_waits"] == {"aten.mm.default": 1, "aten.mul_.Tensor": 1}
    torch.testing.assert_close(y.cpu(), (a @ a + 1) * 2, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(torch.from_numpy(np.asarray(held)), a @ a + 1, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(small.cpu(), a[:8] * 2)
    monkeypatch.setattr(torchtpu.config, "strict_wait_fraction", 0.0)
    x @ x
    assert sum(torchtpu.metrics()["strict_waits"].values()) == 2
