"""FlexAttention with a block mask and no score_mod as JAX's splash kernel
(compile/flex_splash.py, ops/splash_attention.py): forward and gradients against a
float64 reference on the CPU, in every eager mode, and the calls the kernel does not
take. Off a TPU the kernel runs in Pallas's interpret mode (``flash_attention="on"``);
on a TPU (``auto``) compiled by Mosaic.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

import torchtpu
from conftest import tpu

B, H, L, E = 2, 2, 256, 64
BLOCK = 128


def _document():
    # Three documents, the second ending inside a block: jagged partial blocks.
    return torch.tensor([0] * 100 + [1] * 90 + [2] * 66)


def _mask_mod(name: str, device: str):
    if name == "causal":
        return lambda b, h, q, kv: q >= kv
    if name == "sliding_window":
        return lambda b, h, q, kv: (q >= kv) & (q - kv < 100)
    if name == "prefix_lm":
        return lambda b, h, q, kv: (kv < 100) | (q >= kv)
    if name == "document":
        document = _document().to(device)
        return lambda b, h, q, kv: (document[q] == document[kv]) & (q >= kv)
    if name == "per_head_with_empty_rows":
        # head 1 of batch 1 attends nowhere from query 200 and from the whole first block
        return lambda b, h, q, kv: (q >= kv) & ~((b == 1) & (h == 1) & ((q == 200) | (q < 128)))
    raise AssertionError(name)


def _mask(name: str, device: str):
    """mask_mod on ``device``, and the dense [B or 1, H or 1, L, L] mask it stands for."""
    b, h, q, kv = (
        torch.arange(n).view([-1 if d == i else 1 for d in range(4)])
        for i, n in enumerate((B, H, L, L))
    )
    return _mask_mod(name, device), _mask_mod(name, "cpu")(b, h, q, kv)


def _reference(q, k, v, dense):
    """(out, lse) over the dense score matrix, in q's dtype (float64)."""
    groups = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-2, -1) * q.size(-1) ** -0.5).masked_fill(~dense, -math.inf)
    lse = scores.logsumexp(-1)
    weights = torch.where(lse[..., None] == -math.inf, 0.0, (scores - lse[..., None]).exp())
    return weights @ v, lse


def _inputs(kv_heads=H, kv_batch=B):
    torch.manual_seed(0)
    q = torch.randn(B, H, L, E, dtype=torch.float64)
    k = torch.randn(kv_batch, kv_heads, L, E, dtype=torch.float64)
    v = torch.randn(kv_batch, kv_heads, L, E, dtype=torch.float64)
    # the bfloat16 values, so that the reference sees what the kernel sees
    return [t.to(torch.bfloat16).double() for t in (q, k, v)]


def _weights(out):
    return torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape).to(out.device)


def _run(inputs, attend, through_lse=False):
    """Output, log-sum-exp and the gradients of q, k and v of ``sum(out * weights)``
    (+ ``sum(lse)`` where asked), as float32 on the CPU."""
    q, k, v = (t.detach().requires_grad_() for t in inputs)
    out, lse = attend(q, k, v)
    loss = (out * _weights(out)).sum()
    if through_lse:
        loss = loss + torch.where(lse == -math.inf, 0.0, lse).sum()
    loss.backward()
    return [t.detach().float().cpu() for t in (out, lse, q.grad, k.grad, v.grad)]


def _expected(inputs, dense, through_lse=False):
    return _run(inputs, lambda q, k, v: _reference(q, k, v, dense), through_lse)


def _on_tpu(inputs, mask_mod, through_lse=False, block=BLOCK, dtype=torch.bfloat16, **options):
    block_mask = create_block_mask(mask_mod, B, H, L, L, device="tpu", BLOCK_SIZE=block)

    def attend(q, k, v):
        q, k, v = (tpu(t.to(dtype)) for t in (q, k, v))
        return flex_attention(q, k, v, block_mask=block_mask, return_lse=True, **options)

    return _run(inputs, attend, through_lse)


def _close(actual, expected, scale=1.0):
    """Within bfloat16's rounding of the inputs and the kernel's bfloat16 products."""
    for a, e in zip(actual, expected):
        assert a.shape == e.shape
        torch.testing.assert_close(
            a, e.float(), atol=3e-2 * scale, rtol=3e-2 * scale, equal_nan=True
        )


@pytest.fixture
def kernels(monkeypatch):
    """The kernel wherever the test runs (interpreted off a TPU)."""
    monkeypatch.setattr(torchtpu.config, "flash_attention", "on")


MASKS = ["causal", "sliding_window", "prefix_lm", "document", "per_head_with_empty_rows"]


@pytest.mark.parametrize("name", MASKS)
def test_masks_run_as_the_splash_kernel_and_match_the_cpu(name, kernels):
    inputs = _inputs()
    mask_mod, dense = _mask(name, "tpu")
    _close(_on_tpu(inputs, mask_mod), _expected(inputs, dense))
    assert torchtpu.metrics()["attention"] == {"flex: splash": 1, "flex: splash (backward)": 1}


def test_the_kernel_runs_in_every_mode(mode, kernels):
    name = "document"
    inputs = _inputs()
    mask_mod, dense = _mask(name, "tpu")
    _close(_on_tpu(inputs, mask_mod), _expected(inputs, dense))
    assert torchtpu.metrics()["attention"] == {"flex: splash": 1, "flex: splash (backward)": 1}


def test_rows_attending_nowhere_are_zeros_with_an_lse_of_minus_infinity(kernels):
    """As torch's flex_attention gives them (its CPU forward)."""
    mask_mod, _ = _mask("per_head_with_empty_rows", "tpu")
    q, k, v = (t.to(torch.bfloat16) for t in _inputs())
    block_mask = create_block_mask(mask_mod, B, H, L, L, device="tpu", BLOCK_SIZE=BLOCK)
    out, lse = flex_attention(tpu(q), tpu(k), tpu(v), block_mask=block_mask, return_lse=True)
    out, lse = out.cpu(), lse.cpu()
    assert torch.equal(out[1, 1, :128], torch.zeros_like(out[1, 1, :128]))
    assert torch.equal(out[1, 1, 200], torch.zeros_like(out[1, 1, 200]))
    assert bool((lse[1, 1, :128] == -math.inf).all()) and lse[1, 1, 200] == -math.inf
    assert bool(torch.isfinite(lse[0]).all()) and bool(out.isfinite().all())
    cpu_mask = create_block_mask(
        _mask("per_head_with_empty_rows", "cpu")[0], B, H, L, L, device="cpu"
    )
    cpu_out, cpu_lse = flex_attention(
        q.float(), k.float(), v.float(), block_mask=cpu_mask, return_lse=True
    )
    torch.testing.assert_close(out.float(), cpu_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse.float(), cpu_lse, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("shape", ["grouped heads", "one key batch"])
def test_grouped_heads_and_a_broadcast_key_batch(shape, kernels):
    kv_heads, kv_batch = (1, B) if shape == "grouped heads" else (H, 1)
    inputs = _inputs(kv_heads, kv_batch)
    mask_mod, dense = _mask("sliding_window", "tpu")
    actual = _on_tpu(inputs, mask_mod, enable_gqa=kv_heads != H)
    _close(actual, _expected(inputs, dense))
    assert torchtpu.metrics()["attention"]["flex: splash (backward)"] == 1


@pytest.mark.parametrize(
    "case, reason",
    [
        ("through the lse", "a gradient through the log-sum-exp"),
        ("a score_mod", "a score_mod"),
        ("float32", "not bfloat16"),
        ("blocks of 64", "blocks not multiples of 128"),
        ("maximum scores", "the maximum scores asked for"),
    ],
)
def test_what_the_kernel_does_not_take_runs_on_the_blocks(case, reason, kernels):
    """The reason is counted, and the values are still right."""
    inputs = _inputs()
    mask_mod, dense = _mask("sliding_window", "tpu")
    expected = _expected(inputs, dense, through_lse=case == "through the lse")
    if case == "through the lse":
        actual = _on_tpu(inputs, mask_mod, through_lse=True)
        assert torchtpu.metrics()["attention"]["flex: splash"] == 1  # the forward took it
    elif case == "a score_mod":
        actual = _on_tpu(inputs, mask_mod, score_mod=lambda s, b, h, q, kv: s * 1.0)
    elif case == "float32":
        actual = _on_tpu(inputs, mask_mod, dtype=torch.float32)
    elif case == "blocks of 64":
        actual = _on_tpu(inputs, mask_mod, block=64)
    else:

        def attend(q, k, v):
            q, k, v = (tpu(t.to(torch.bfloat16)) for t in (q, k, v))
            block_mask = create_block_mask(mask_mod, B, H, L, L, device="tpu", BLOCK_SIZE=BLOCK)
            out, aux = flex_attention(
                q, k, v, block_mask=block_mask, return_aux=AuxRequest(lse=True, max_scores=True)
            )
            assert aux.max_scores.shape == (B, H, L)
            return out, aux.lse

        actual = _run(inputs, attend)
    _close(actual, expected)
    assert torchtpu.metrics()["attention"][f"flex: no splash: {reason}"] >= 1


def test_off_a_tpu_the_kernel_is_not_offered():
    """``auto`` on the CPU backend: the block path, no splash reason counted."""
    if torchtpu.runtime.platform() == "tpu":
        pytest.skip("on a TPU `auto` offers the kernel")
    inputs = _inputs()
    mask_mod, dense = _mask("sliding_window", "tpu")
    _close(_on_tpu(inputs, mask_mod), _expected(inputs, dense))
    assert not any("splash" in choice for choice in torchtpu.metrics()["attention"])


def test_a_block_masks_layout_is_made_once_for_every_layer_and_the_backward(kernels, monkeypatch):
    """A model's layers attend with one block mask: its slots and element masks are
    made once (the forward's and the transposed), then again after the mask changes."""
    from torchtpu.compile import flex_splash

    made = []
    original = flex_splash._partial_masks
    monkeypatch.setattr(
        flex_splash, "_partial_masks", lambda *a, **k: made.append(a[-1]) or original(*a, **k)
    )
    inputs = _inputs()
    mask_mod, dense = _mask("document", "tpu")
    block_mask = create_block_mask(mask_mod, B, H, L, L, device="tpu", BLOCK_SIZE=BLOCK)
    q, k, v = (tpu(t.to(torch.bfloat16)).requires_grad_() for t in inputs)
    out = q
    for _ in range(3):  # three layers
        out = flex_attention(out, k, v, block_mask=block_mask)
    out.float().sum().backward()
    assert made == [False, True]
    block_mask.kv_num_blocks.add_(0)  # changed in place: made again
    flex_attention(q, k, v, block_mask=block_mask)
    assert made == [False, True, False]


def test_block_lists_too_large_for_the_kernels_scalar_memory_keep_the_blocks(kernels, monkeypatch):
    from torchtpu.compile import flex_splash

    monkeypatch.setattr(flex_splash, "SCALAR_MEMORY_BUDGET", 64)
    inputs = _inputs()
    mask_mod, dense = _mask("causal", "tpu")
    _close(_on_tpu(inputs, mask_mod), _expected(inputs, dense))
    reason = "flex: no splash: block lists too large for the kernel's scalar memory"
    assert torchtpu.metrics()["attention"][reason] == 2


def test_explain_says_which_attention_ran_and_why(kernels):
    inputs = _inputs()
    mask_mod, _ = _mask("causal", "tpu")
    block_mask = create_block_mask(mask_mod, B, H, L, L, device="tpu", BLOCK_SIZE=BLOCK)
    q, k, v = (tpu(t.to(torch.bfloat16)) for t in inputs)

    def both(q, k, v):
        flex_attention(q, k, v, block_mask=block_mask)
        return flex_attention(q.float(), k.float(), v.float(), block_mask=block_mask)

    text = str(torchtpu.explain(both, q, k, v))
    assert "  attention:\n" in text
    assert "flex: splash: 1" in text
    assert "flex: no splash: not bfloat16: 1" in text
