"""torchtpu.detect_nonfinite(): the first op that makes a NaN or an Inf from finite inputs;
and torch.autograd.detect_anomaly on tpu tensors, as on the CPU."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchtpu

MODES = ["strict", "debug", "defer"]


def _line() -> int:
    """The line number of the caller's line."""
    return inspect.currentframe().f_back.f_lineno


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).to(
        "tpu"
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_planted_nan_is_named_with_op_and_line(mode):
    model = _mlp()
    x = torch.randn(5, 4, device="tpu")
    with torch.tpu.set_eager_mode(mode):
        with pytest.raises(torchtpu.TPUNonFiniteError) as info:
            with torchtpu.detect_nonfinite():
                h = model[1](model[0](x))
                # An intermediate (never a chunk output in DeferAndFuse) has the NaN.
                line = _line() + 1
                bad = torch.log(h - 1).sum()
                model[2](h).sum() + bad
                torchtpu.sync()
    message = str(info.value)
    assert (
        f"aten.log.default at {__file__}:{line} in test_a_planted_nan_is_named_with_op_and_line"
        in message
    )
    assert "made NaN from finite inputs (float32[5, 8])" in message
    assert "its result float32[5, 8] has NaN" in message


@pytest.mark.parametrize("mode", MODES)
def test_a_backward_op_is_named_with_the_forward_line(mode):
    x = torch.zeros(3, device="tpu", requires_grad=True)
    with torch.tpu.set_eager_mode(mode):
        with pytest.raises(torchtpu.TPUNonFiniteError) as info:
            with torchtpu.detect_nonfinite():
                line = _line() + 1
                y = torch.sqrt(x)
                y.sum().backward()  # d sqrt(x)/dx at 0: Inf
                x.grad.sum().item()
    message = str(info.value)
    assert "aten.div.Tensor" in message
    assert (
        f"{__file__}:{line} in test_a_backward_op_is_named_with_the_forward_line "
        "(backward of the op created there)"
    ) in message
    assert "made Inf" in message


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_in_the_inputs_is_not_blamed_on_the_op_using_it(mode):
    model = _mlp()
    x = torch.randn(5, 4, device="tpu")
    x[2, 1] = float("nan")  # made outside: the finder's first op is already non-finite
    scores = torch.randn(2, 3, device="tpu")
    mask = torch.tensor([[True, False, False], [False, False, True]], device="tpu")
    with torch.tpu.set_eager_mode(mode), torchtpu.detect_nonfinite():
        y = model(x).sum() * 2
        # -inf given as a fill value is an input, not the op's doing; softmax then
        # makes finite values from it.
        p = scores.masked_fill(mask, float("-inf")).softmax(-1)
        h = torch.full((2,), float("nan"), device="tpu")
        h.add_(1)  # in place, on a value that was NaN before the op
        assert y.isnan().item() and p.isfinite().all().item()


@pytest.mark.parametrize("mode", MODES)
def test_an_in_place_op_making_inf_is_named(mode):
    with torch.tpu.set_eager_mode(mode):
        h = torch.ones(4, device="tpu")
        with pytest.raises(torchtpu.TPUNonFiniteError, match=r"aten\.mul_.* has Inf"):
            with torchtpu.detect_nonfinite():
                h.mul_(1e30).mul_(1e30)
                torchtpu.sync()


@pytest.mark.parametrize("mode", MODES)
def test_a_clean_training_step_raises_nothing(mode):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(5, 4, device="tpu")
    target = torch.tensor([0, 1, 2, 0, 1], device="tpu")
    torchtpu.reset_metrics()
    with torch.tpu.set_eager_mode(mode), torchtpu.detect_nonfinite():
        for _ in range(2):
            loss = F.cross_entropy(model(x), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
        x.argmax()  # an integer result: nothing to check
        assert torch.isfinite(loss).item()
    assert torchtpu.metrics()["nonfinite_checks"]["ops"] > 20


def test_defer_reads_the_flags_once_per_flush():
    model = _mlp()
    x = torch.randn(5, 4, device="tpu")
    with torch.tpu.set_eager_mode("defer"):
        torchtpu.sync()
        torchtpu.reset_metrics()
        with torchtpu.detect_nonfinite():
            loss = model(x).pow(2).mean()
            loss.backward()
            loss.item()
            (model[0].weight.grad * 2).sum().item()
        m = torchtpu.metrics()
    flushes = sum(m["flushes"].values())
    assert m["nonfinite_checks"]["ops"] > 10
    assert m["nonfinite_checks"]["host_reads"] == flushes
    assert flushes <= 3  # the two reads, and the check of nothing at the exit


def test_warn_goes_on():
    x = torch.zeros(2, device="tpu")
    with pytest.warns(torchtpu.TPUNonFiniteWarning, match=r"aten\.div\.Tensor .* has NaN"):
        with torchtpu.detect_nonfinite(action="warn"):
            y = (x / x).sum()
    assert y.isnan().item()


def test_action_is_checked():
    with pytest.raises(ValueError, match="action"):
        with torchtpu.detect_nonfinite(action="ignore"):
            pass


class _NanBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _anomaly(device: str):
    x = torch.ones(3, device=device, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught, torch.autograd.detect_anomaly():
        warnings.simplefilter("always")
        try:
            _NanBackward.apply(x).sum().backward()
        except Exception as exc:  # noqa: BLE001 (compared with the CPU's)
            return exc, [str(w.message) for w in caught]
    return None, [str(w.message) for w in caught]


@pytest.mark.parametrize("mode", MODES)
def test_detect_anomaly_is_the_cpus(mode):
    expected, cpu_warnings = _anomaly("cpu")
    with torch.tpu.set_eager_mode(mode):
        got, tpu_warnings = _anomaly("tpu")
    assert type(got) is type(expected) is RuntimeError
    assert (
        str(got)
        == str(expected)
        == "Function '_NanBackwardBackward' returned nan values in its 0th output."
    )
    # The same warnings (anomaly mode on; the forward traceback), and no fallback.
    assert [w.split("\n")[0] for w in tpu_warnings] == [w.split("\n")[0] for w in cpu_warnings]
