"""scaled_dot_product_attention by JAX's Pallas flash kernels (ops/flash_attention.py).

On a TPU the kernels compile with Mosaic; here (``config.flash_attention = "on"``) they
run in Pallas's interpret mode, block by block, which checks what they compute: forward
and gradients against torch's CPU result, in every mode and compiled, and which calls
keep the dense lowering and why.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from conftest import assert_same, tpu
from torchtpu import config

BF16 = torch.bfloat16
# bfloat16 outputs of sums over 128-256 keys: a few units of bfloat16's last place
TOLERANCE = dict(rtol=2e-2, atol=2e-2)


@pytest.fixture
def flash(monkeypatch):
    monkeypatch.setattr(config, "flash_attention", "on")
    torchtpu.reset_metrics()


def _inputs(batch=1, heads=2, kv_heads=None, length=128, kv_length=None, size=64):
    torch.manual_seed(0)
    kv_heads, kv_length = kv_heads or heads, kv_length or length
    q = torch.randn(batch, heads, length, size, dtype=BF16)
    k = torch.randn(batch, kv_heads, kv_length, size, dtype=BF16)
    v = torch.randn(batch, kv_heads, kv_length, size, dtype=BF16)
    return q, k, v


def _run(q, k, v, device, **kwargs):
    """Output and gradients of q, k, v for a fixed output gradient."""
    q, k, v = (x.detach().to(device).requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    (out.float() * _output_grad(out.shape).to(device)).sum().backward()
    return out, q.grad, k.grad, v.grad


def _output_grad(shape):
    return torch.linspace(-1, 1, shape.numel()).reshape(shape)


@pytest.mark.parametrize(
    "shape, kwargs",
    [
        (dict(), dict()),
        (dict(), dict(is_causal=True)),
        (dict(batch=2, length=256), dict(is_causal=True, scale=0.3)),
        (dict(length=128, kv_length=256), dict(is_causal=True)),  # top-left aligned
        (dict(heads=4, kv_heads=2), dict(is_causal=True, enable_gqa=True)),
    ],
    ids=["plain", "causal", "causal-scale", "causal-longer-keys", "gqa"],
)
def test_flash_matches_the_cpu(flash, shape, kwargs):
    q, k, v = _inputs(**shape)
    ours = _run(q, k, v, "tpu", **kwargs)
    assert torchtpu.metrics()["attention"] == {"flash": 2}  # the forward and the backward
    for a, e in zip(ours, _run(q, k, v, "cpu", **kwargs)):
        assert_same(a, e, **TOLERANCE)


MODES = ["debug", "defer", "compile", "jit"]


@pytest.mark.parametrize("mode", MODES)
def test_flash_in_every_mode(flash, mode):
    # a batch size of its own: the choice is counted when a program is built
    q, k, v = _inputs(batch=3 + MODES.index(mode))
    expected = _run(q, k, v, "cpu", is_causal=True)
    if mode in ("debug", "defer"):
        with torchtpu.set_eager_mode(mode):
            got = _run(q, k, v, "tpu", is_causal=True)
    else:
        grad = _output_grad(q.shape).to("tpu")
        # as a model's parameters are: state the step reads, not arguments
        params = [x.to("tpu").requires_grad_() for x in (q, k, v)]

        def step():
            out = F.scaled_dot_product_attention(*params, is_causal=True)
            (out.float() * grad).sum().backward()
            return out

        compiled = torch.compile(step, backend="tpu") if mode == "compile" else torchtpu.jit(step)
        for _ in range(2):  # torchtpu.jit traces on its second call
            for x in params:
                x.grad = None
            out = compiled()
        got = (out, *(x.grad for x in params))
    for a, e in zip(got, expected):
        assert_same(a, e, **TOLERANCE)
    assert torchtpu.metrics()["attention"].get("flash", 0) >= 2


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(dtype=torch.float32), "not bfloat16"),
        (dict(mask=True), "an attn_mask"),
        (dict(length=96), "a length not a multiple of 128"),
        (dict(size=32), "a head size other than 64 or 128"),
    ],
)
def test_other_calls_keep_the_dense_lowering_and_say_why(flash, change, reason):
    q, k, v = _inputs(length=change.get("length", 128), size=change.get("size", 64))
    dtype = change.get("dtype", BF16)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    mask = (
        torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril() if "mask" in change else None
    )
    ours = _run(q, k, v, "tpu", attn_mask=None if mask is None else tpu(mask))
    assert torchtpu.metrics()["attention"] == {f"dense: {reason}": 2}
    for a, e in zip(ours, _run(q, k, v, "cpu", attn_mask=mask)):
        assert_same(a, e, **TOLERANCE)


def test_off_a_tpu_auto_keeps_the_dense_lowering(monkeypatch):
    monkeypatch.setattr(config, "flash_attention", "auto")
    torchtpu.reset_metrics()
    q, k, v = _inputs(batch=7)
    _run(q, k, v, "tpu")
    (reason,) = torchtpu.metrics()["attention"]
    expected = "flash" if torchtpu.runtime.platform() == "tpu" else "dense: no Pallas flash"
    assert reason.startswith(expected)


@pytest.fixture
def cudnn(monkeypatch):
    """cuDNN's path as on a GPU, with JAX choosing its own implementation on the CPU:
    the choice, the layout and the backward are ours; the kernel is JAX's."""
    from torchtpu.ops import cudnn_attention

    monkeypatch.setattr(cudnn_attention, "offered", lambda: True)
    monkeypatch.setattr(cudnn_attention, "IMPLEMENTATION", None)
    torchtpu.reset_metrics()


@pytest.mark.parametrize(
    "shape, kwargs",
    [
        (dict(length=24, size=40), dict()),
        (dict(batch=2, length=40, size=32), dict(is_causal=True, scale=0.3)),
        (dict(heads=4, kv_heads=2, length=48, size=16), dict(is_causal=True, enable_gqa=True)),
    ],
    ids=["plain", "causal-scale", "gqa"],
)
def test_on_a_gpu_cudnns_kernel_takes_the_call_and_matches_the_cpu(cudnn, shape, kwargs):
    q, k, v = _inputs(**shape)
    ours = _run(q, k, v, "tpu", **kwargs)
    assert torchtpu.metrics()["attention"] == {"cudnn": 2}  # the forward and the backward
    for a, e in zip(ours, _run(q, k, v, "cpu", **kwargs)):
        assert_same(a, e, **TOLERANCE)


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(dtype=torch.float32), "not bfloat16 or float16"),
        (dict(mask=True), "an attn_mask"),
        (dict(size=12), "a head size not a multiple of 8 up to 128"),
        (dict(kv_length=32, causal=True), "causal with more or fewer keys than queries"),
    ],
    ids=["float32", "mask", "head-size", "causal-longer-keys"],
)
def test_on_a_gpu_other_calls_keep_the_dense_lowering_and_say_why(cudnn, change, reason):
    q, k, v = _inputs(length=24, kv_length=change.get("kv_length"), size=change.get("size", 16))
    q, k, v = (x.to(change.get("dtype", BF16)) for x in (q, k, v))
    mask = torch.ones(24, k.shape[-2], dtype=torch.bool).tril() if "mask" in change else None
    kwargs = dict(is_causal=change.get("causal", False))
    ours = _run(q, k, v, "tpu", attn_mask=None if mask is None else tpu(mask), **kwargs)
    assert torchtpu.metrics()["attention"] == {f"dense: {reason}": 2}
    for a, e in zip(ours, _run(q, k, v, "cpu", attn_mask=mask, **kwargs)):
        assert_same(a, e, **TOLERANCE)
