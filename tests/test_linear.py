"""``F.linear`` on tpu is one op forward and one backward, autocast's casts inside
(ops/linear.py): values, gradients and dtypes as torch's composite on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from conftest import assert_same, tpu

# Under autocast the products are bfloat16s, and so are their float32 gradients
# values: XLA may skip a rounding to bfloat16 inside a program (its excess precision),
# so they are compared as bfloat16 values.
AUTOCAST_TOLERANCE = {"rtol": 1.6e-2, "atol": 2e-2}

# (input shape, bias): a 1-d input is one row; more dims are rows of rows.
CASES = [((8,), True), ((4, 8), True), ((4, 8), False), ((2, 3, 8), True), ((2, 2, 3, 8), False)]


def _ops_run():
    return torchtpu.metrics().get("ops", {}).get("strict", 0)


def _run(device, x, w, b, autocast, grad_out, ops=None):
    """Forward and backward on ``device``; ``ops``, a list: the tpu ops they ran."""
    x, w = (t.detach().to(device).requires_grad_() for t in (x, w))
    b = None if b is None else b.detach().to(device).requires_grad_()
    dtype = torch.bfloat16 if autocast or x.dtype == torch.bfloat16 else torch.float32
    grad_out = grad_out.to(device=device, dtype=dtype)
    before = _ops_run()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        out = F.linear(x, w, b)
    out.backward(grad_out)
    if ops is not None:
        ops.append(_ops_run() - before)
    return out, x.grad, w.grad, None if b is None else b.grad


def _inputs(shape, bias, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    w = torch.randn(5, shape[-1], dtype=dtype)
    b = torch.randn(5, dtype=dtype) if bias else None
    grad_out = torch.randn(*shape[:-1], 5)
    return x, w, b, grad_out


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "shape,bias", CASES, ids=[f"{len(s)}d-{'bias' if b else 'nobias'}" for s, b in CASES]
)
def test_linear_and_its_gradients_match_the_cpu(shape, bias, dtype, autocast):
    x, w, b, grad_out = _inputs(shape, bias, dtype)
    expected = _run("cpu", x, w, b, autocast, grad_out)
    ops = []
    actual = _run("tpu", x, w, b, autocast, grad_out, ops)
    tolerance = AUTOCAST_TOLERANCE if autocast else {}
    for a, e in zip(actual, expected):
        if e is None:
            assert a is None
        else:
            assert_same(a, e, **tolerance)
    # One op forward, one backward: the casts, transposes, products and the bias's
    # sum of torch's composite run inside them.
    assert ops == [2]


def test_linear_in_every_mode_matches_the_cpu(mode):
    x, w, b, grad_out = _inputs((2, 3, 8), True, torch.float32)
    expected = _run("cpu", x, w, b, True, grad_out)
    actual = _run("tpu", x, w, b, True, grad_out)
    assert_same(actual, expected, **AUTOCAST_TOLERANCE)


def test_a_frozen_weight_or_input_gets_no_gradient():
    x, w, b, grad_out = _inputs((4, 8), True, torch.float32)
    for frozen in ("input", "weight"):
        grads = {}
        for device in ("cpu", "tpu"):
            xs, ws, bs = (t.detach().to(device) for t in (x, w, b))
            (xs if frozen == "weight" else ws).requires_grad_()
            bs.requires_grad_()
            with torch.autocast(device, dtype=torch.bfloat16):
                out = F.linear(xs, ws, bs)
            out.backward(grad_out.to(device=device, dtype=out.dtype))
            grads[device] = (xs.grad, ws.grad, bs.grad)
        for a, e in zip(grads["tpu"], grads["cpu"]):
            if e is None:
                assert a is None
            else:
                assert_same(a, e, **AUTOCAST_TOLERANCE)


def test_a_gradient_penalty_differentiates_the_backward():
    """``create_graph=True`` (a WGAN-GP's penalty): the backward runs as torch ops,
    which autograd records."""
    x, w, b, _ = _inputs((4, 8), True, torch.float32)
    results = {}
    for device in ("cpu", "tpu"):
        xs, ws, bs = (t.detach().to(device).requires_grad_() for t in (x, w, b))
        out = F.linear(xs, ws, bs).pow(2)  # products only: no transcendental's error
        (grad_x,) = torch.autograd.grad(out.sum(), xs, create_graph=True)
        grad_x.pow(2).sum().backward()
        results[device] = (grad_x, ws.grad, bs.grad)
    # Second-order sums of products, summed in another order than the CPU's.
    assert_same(results["tpu"], results["cpu"], rtol=1e-4, atol=1e-4)


def test_bad_calls_raise_as_on_the_cpu():
    x, w = torch.randn(4, 8), torch.randn(5, 8, dtype=torch.bfloat16)
    for args in ((x, w), (x, torch.randn(5, 7)), (x, torch.randn(5, 8), torch.randn(4))):
        with pytest.raises(RuntimeError):
            F.linear(*args)
        with pytest.raises(RuntimeError):
            F.linear(*tpu(args))


def test_a_compiled_model_keeps_torchs_composite():
    """Under torch.compile the arguments are fake tensors: the graph holds aten's ops,
    which XLA fuses itself."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 5)
    x = torch.randn(4, 8)
    expected = model(x)
    compiled = torch.compile(model.to("tpu"), backend="tpu")
    assert_same(compiled(tpu(x)), expected)


def test_a_second_order_gradient_reaches_earlier_layers_under_autocast():
    """MAML's pattern under autocast: the gradient of a later layer's weight is
    differentiated again, and reaches an earlier layer's weight through the input the
    later layer kept in bfloat16 (as it does through autocast's cast on the CPU)."""
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(4, 8), torch.randn(6, 8) * 0.3, torch.randn(5, 6) * 0.3
    results = {}
    for device in ("cpu", "tpu"):
        xs = x.to(device)
        w1s, w2s = (w.detach().to(device).requires_grad_() for w in (w1, w2))
        with torch.autocast(device, dtype=torch.bfloat16):
            hidden = torch.tanh(F.linear(xs, w1s)).float()  # float32: cast by the next
            out = F.linear(hidden, w2s)
        (grad_w2,) = torch.autograd.grad(out.float().pow(2).sum(), w2s, create_graph=True)
        grad_w2.pow(2).sum().backward()
        results[device] = (grad_w2, w1s.grad, w2s.grad)
    # A second-order gradient of bfloat16 values (tanh's among them, which a TPU rounds
    # its own way): on a TPU v5e one element of 48 was 2.0% off the CPU's.
    assert_same(results["tpu"], results["cpu"], rtol=4e-2, atol=4e-2)
