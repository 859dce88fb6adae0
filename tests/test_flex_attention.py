"""FlexAttention on tpu (compile/flex_attention.py): score_mods and block masks in every
eager mode, under torch.compile and in torchtpu.jit.

The expected values come from a float64 reference on the CPU that applies the same
score_mod and mask_mod to the whole score matrix by broadcasting (torch's FlexAttention
has no backward on the CPU in eager mode); where torch's CPU forward can run, the
results are also checked against it (fully masked rows, the log-sum-exp).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import torchtpu
from conftest import assert_same, tpu

B, H, L, E = 2, 4, 64, 16
BLOCK = 16  # blocks of 16 of 64 positions: the masks below leave blocks out


def reference(q, k, v, score_mod=None, mask_mod=None, scale=None, enable_gqa=False):
    """Attention over the dense score matrix: (output, log-sum-exp) in q's dtype."""
    if enable_gqa:
        k = k.repeat_interleave(q.size(1) // k.size(1), 1)
        v = v.repeat_interleave(q.size(1) // v.size(1), 1)
    scale = q.size(-1) ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    b, h, m, n = (
        torch.arange(size).view([-1 if d == i else 1 for d in range(4)])
        for i, size in enumerate(scores.shape)
    )
    if score_mod is not None:
        scores = score_mod(scores, b, h, m, n)
    if mask_mod is not None:
        scores = scores.masked_fill(~mask_mod(b, h, m, n).expand(scores.shape), float("-inf"))
    lse = scores.logsumexp(-1)
    weights = torch.where(lse[..., None] == float("-inf"), 0.0, (scores - lse[..., None]).exp())
    return weights @ v, lse


def causal(b, h, q, kv):
    return q >= kv


def sliding_window(b, h, q, kv):
    return (q >= kv) & (q - kv <= 20)


def prefix_lm(b, h, q, kv):
    return (kv < 24) | (q >= kv)


def softcap(score, b, h, q, kv):
    return 5.0 * torch.tanh(score / 5.0)


# Each case, for a device and dtype: (score_mod, mask_mod, the tensors score_mod
# captures whose gradients are checked).
def _case(name, device, dtype):
    torch.manual_seed(1)
    if name == "causal":
        return None, causal, []
    if name == "sliding_window":
        return None, sliding_window, []
    if name == "document":
        document = torch.tensor([0] * 20 + [1] * 30 + [2] * 14, device=device)
        return None, lambda b, h, q, kv: document[q] == document[kv], []
    if name == "alibi":
        slopes = (2.0 ** -torch.arange(1, H + 1, dtype=torch.float64)).to(device, dtype).requires_grad_()
        return (lambda s, b, h, q, kv: s + slopes[h] * (kv - q)), causal, [slopes]
    if name == "softcap":
        return softcap, causal, []
    if name == "relative_bias":
        bias = torch.randn(2 * L - 1, dtype=torch.float64).to(device, dtype).requires_grad_()
        return (lambda s, b, h, q, kv: s + bias[q - kv + L - 1]), None, [bias]
    if name == "prefix_lm":
        return None, prefix_lm, []
    if name == "fixed_bias":  # captured, needing no gradient
        bias = torch.randn(L, L, dtype=torch.float64).to(device, dtype)
        return (lambda s, b, h, q, kv: s + bias[q, kv]), causal, []
    if name == "learned_bias":
        bias = torch.randn(H, L, L, dtype=torch.float64).to(device, dtype).requires_grad_()
        return (lambda s, b, h, q, kv: s + bias[h, q, kv]), sliding_window, [bias]
    raise AssertionError(name)


CASES = [
    "causal", "sliding_window", "document", "alibi", "softcap", "relative_bias",
    "prefix_lm", "fixed_bias", "learned_bias",
]  # fmt: skip


def _inputs(kv_heads=H):
    torch.manual_seed(0)
    return (
        torch.randn(B, H, L, E, dtype=torch.float64),
        torch.randn(B, kv_heads, L, E, dtype=torch.float64),
        torch.randn(B, kv_heads, L, E, dtype=torch.float64),
    )


def _block_mask(mask_mod, device):
    if mask_mod is None:
        return None
    return create_block_mask(mask_mod, None, None, L, L, device=device, BLOCK_SIZE=BLOCK)


def _expected(name, inputs, **options):
    """Output, log-sum-exp and the gradients of q, k, v and the captured tensors of
    ``sum(out * weights) + sum(lse)`` in float64 on the CPU, rounded to float32."""
    score_mod, mask_mod, captured = _case(name, "cpu", torch.float64)
    q, k, v = (t.clone().requires_grad_() for t in inputs)
    out, lse = reference(q, k, v, score_mod, mask_mod, **options)
    _loss(out, lse).backward()
    values = [out, lse, q.grad, k.grad, v.grad, *(c.grad for c in captured)]
    return [t.detach().float() for t in values]


def _choices() -> dict:
    """The attention choices counted, less the splash kernel's refusals (on a TPU these
    float32 calls count "flex: no splash: not bfloat16"; tests/test_flex_splash.py)."""
    return {k: n for k, n in torchtpu.metrics()["attention"].items() if "no splash" not in k}


def _loss(out, lse):
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    finite = torch.where(lse == float("-inf"), 0.0, lse)
    return (out * weights.to(out.device)).sum() + finite.sum()


def _on_tpu(name, inputs, attend=flex_attention, **options):
    score_mod, mask_mod, captured = _case(name, "tpu", torch.float32)
    q, k, v = (tpu(t.float()).requires_grad_() for t in inputs)
    if attend is _jitted_flex:
        options["captured"] = captured
    out, lse = attend(
        q, k, v, score_mod=score_mod, block_mask=_block_mask(mask_mod, "tpu"), return_lse=True,
        **options,
    )  # fmt: skip
    if attend is not _jitted_flex:  # whose step takes the gradients itself
        _loss(out, lse).backward()
    return [out, lse, q.grad, k.grad, v.grad, *(c.grad for c in captured)]


@pytest.mark.parametrize("blocks", ["on", "off"])
@pytest.mark.parametrize("name", CASES)
def test_score_mods_and_masks_match_the_cpu(name, mode, blocks, monkeypatch):
    """Forward and gradients, over the listed blocks only (compile/flex_blocks.py) and
    over every score (torch's dense implementation)."""
    monkeypatch.setattr(torchtpu.config, "flex_blocks", blocks)
    inputs = _inputs()
    assert_same(_on_tpu(name, inputs), _expected(name, inputs), atol=2e-5, rtol=2e-5)
    choices = _choices()
    if blocks == "off":
        assert set(choices) == {"flex: dense: config.flex_blocks is 'off'"}
    elif name == "relative_bias":  # no block mask: one block holds every key
        assert list(choices) == ["flex: dense: one block holds every key (no mask, or a block as long as the keys)"]
    else:
        assert choices == {"flex: blocks": 2}  # forward and backward


@pytest.mark.parametrize("shape", ["gqa and a broadcast batch", "lengths not multiples of a block", "more keys than queries"])
def test_blocks_visited_match_the_cpu_in_other_shapes(shape, monkeypatch):
    """Grouped heads with one key batch for all query batches, lengths that end inside a
    block (padded queries and keys are masked), and L != S: forward and gradients of
    the blockwise path against the float64 reference."""
    monkeypatch.setattr(torchtpu.config, "flex_blocks", "on")
    torch.manual_seed(4)
    q_len, kv_len, kv_batch, kv_heads = {
        "gqa and a broadcast batch": (L, L, 1, 2),
        "lengths not multiples of a block": (57, 57, B, H),
        "more keys than queries": (40, 72, B, H),
    }[shape]
    q = torch.randn(B, H, q_len, E, dtype=torch.float64)
    k, v = (torch.randn(kv_batch, kv_heads, kv_len, E, dtype=torch.float64) for _ in range(2))

    def window(b, h, qi, kv):
        return (kv <= qi + kv_len - q_len) & (qi + kv_len - q_len - kv <= 20)

    slopes = 2.0 ** -torch.arange(1, H + 1, dtype=torch.float64)

    def expected_and_actual(device, dtype):
        inputs = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        s = slopes.to(device, dtype).requires_grad_()

        def alibi(score, b, h, qi, kv):
            return score + s[h] * (kv - qi)

        if device == "cpu":
            qq, kk, vv = inputs
            kk = kk.expand(B, -1, -1, -1).repeat_interleave(H // kv_heads, 1)
            vv = vv.expand(B, -1, -1, -1).repeat_interleave(H // kv_heads, 1)
            out, lse = reference(qq, kk, vv, alibi, window)
        else:
            mask_batch = None if kv_batch == B else B  # torch asks for q's batch then
            mask = create_block_mask(window, mask_batch, None, q_len, kv_len, device=device, BLOCK_SIZE=BLOCK)
            out, lse = flex_attention(
                *inputs, score_mod=alibi, block_mask=mask, return_lse=True, enable_gqa=kv_heads != H
            )
        _loss(out, lse).backward()
        return [t.detach().float() for t in (out, lse, *(i.grad for i in inputs), s.grad)]

    assert_same(expected_and_actual("tpu", torch.float32), expected_and_actual("cpu", torch.float64), atol=2e-5, rtol=2e-5)
    assert _choices() == {"flex: blocks": 2}


def test_blocks_are_counted_once_per_block_mask(monkeypatch):
    """The most blocks a query block visits is read from the device once per block mask
    and kept while its tensors are unchanged: four calls with one mask read it once."""
    from torchtpu.compile import flex_blocks

    monkeypatch.setattr(torchtpu.config, "flex_blocks", "on")
    reads = []
    real_most = flex_blocks._most
    monkeypatch.setattr(flex_blocks, "_most", lambda *a: reads.append(a) or real_most(*a))
    cache_reads = []
    monkeypatch.setattr(flex_blocks.torch, "stack", _counting(torch.stack, cache_reads))
    q, k, v = (tpu(t.float()) for t in _inputs())
    mask = _block_mask(sliding_window, "tpu")
    for _ in range(4):
        flex_attention(q, k, v, block_mask=mask)
    assert len(reads) == 4 and len(cache_reads) == 1
    mask.kv_num_blocks.add_(0)  # a new version: read again
    flex_attention(q, k, v, block_mask=mask)
    assert len(cache_reads) == 2


def _counting(fn, calls):
    def counted(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)

    return counted


def _compiled_flex(q, *args, **kwargs):
    # Dynamo keeps its graphs per code object, flex_attention's here: a new score_mod
    # is a recompile, and Dynamo stops at 8 (on every device); each test starts afresh.
    # A graph of flex_attention alone runs eagerly (Note [A compiled flex_attention
    # alone runs eagerly]): the clone makes it a graph that is traced.
    torch._dynamo.reset()

    def attend(q, *args, **kwargs):
        return flex_attention(q.clone(), *args, **kwargs)

    return torch.compile(attend, backend="tpu", fullgraph=True)(q, *args, **kwargs)


def _jitted_flex(q, k, v, score_mod=None, block_mask=None, captured=(), **options):
    """flex_attention inside a torchtpu.jit step that also takes the gradients,
    called three times (eager, traced, replayed): the last call's results."""

    @torchtpu.jit
    def step():  # q, k and v are state, as parameters are (arguments are data)
        out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, **options)
        _loss(out, lse).backward()
        return out, lse

    for _ in range(3):
        for t in (q, k, v, *captured):
            t.grad = None
        out, lse = step()
    assert torchtpu.metrics()["compiles"]["step"] == 1
    return out, lse


@pytest.mark.parametrize("blocks", ["on", "auto"])
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("path", ["compiled", "jit"])
def test_score_mods_and_masks_compiled_match_the_cpu(name, path, blocks, monkeypatch):
    """In a trace the program loops over the block mask's lists ("on"; Note [Blockwise
    FlexAttention in a trace]) or scores every key ("auto" at these lengths)."""
    monkeypatch.setattr(torchtpu.config, "flex_blocks", blocks)
    inputs = _inputs()
    attend = _compiled_flex if path == "compiled" else _jitted_flex
    assert_same(_on_tpu(name, inputs, attend), _expected(name, inputs), atol=2e-5, rtol=2e-5)
    traced = {k: n for k, n in torchtpu.metrics()["attention"].items() if "traced" in k or "loop" in k}
    if name == "relative_bias":  # no block mask: one block holds every key
        assert not traced
    elif blocks == "on":
        assert traced == {"flex: blocks, looped in the program": 2}  # forward and backward
    else:
        assert traced == {"flex: dense: traced, the keys span fewer than 16 blocks": 2}


@pytest.mark.parametrize("path", ["eager", "compiled", "jit"])
def test_grouped_query_attention_and_options(path):
    inputs = _inputs(kv_heads=2)
    options = dict(enable_gqa=True, scale=0.3)
    expected = _expected("alibi", inputs, **options)
    attend = {"eager": flex_attention, "compiled": _compiled_flex, "jit": _jitted_flex}[path]
    actual = _on_tpu("alibi", inputs, attend, kernel_options={"PRESCALE_QK": False}, **options)
    assert_same(actual, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_fully_masked_rows_are_zeros_as_on_the_cpu(mode, path):
    def late(b, h, q, kv):
        return (q >= 8) & (kv <= q)

    q, k, v = (t.float() for t in _inputs())
    expected = flex_attention(q, k, v, block_mask=_block_mask(late, "cpu"), return_lse=True)
    attend = flex_attention if path == "eager" else _compiled_flex
    actual = attend(tpu(q), tpu(k), tpu(v), block_mask=_block_mask(late, "tpu"), return_lse=True)
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)
    assert actual[0][:, :, :8].cpu().eq(0).all()
    assert actual[1][:, :, :8].cpu().eq(float("-inf")).all()


def test_a_block_mask_made_on_tpu_is_the_cpus():
    for mask_mod in (causal, sliding_window, prefix_lm):
        on_cpu, on_tpu = _block_mask(mask_mod, "cpu"), _block_mask(mask_mod, "tpu")
        for actual, expected in zip(on_tpu.as_tuple()[2:-1], on_cpu.as_tuple()[2:-1]):
            if isinstance(expected, torch.Tensor):
                assert_same(actual, expected)
            else:
                assert actual == expected


class Block(torch.nn.Module):
    """Self-attention with a learned ALiBi slope per head and a sliding window."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(E, 3 * H * E)
        self.slopes = torch.nn.Parameter(torch.linspace(0.1, 0.5, H))

    def forward(self, x, attend, block_mask=None):
        q, k, v = self.qkv(x).view(B, L, 3, H, E).permute(2, 0, 3, 1, 4)
        slopes = self.slopes

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        if attend is reference:
            return reference(q, k, v, alibi, sliding_window)[0].sum()
        return attend(q, k, v, score_mod=alibi, block_mask=block_mask).sum()


def _model_and_expected():
    torch.manual_seed(2)
    model, x = Block(), torch.randn(B, L, E)
    reference_model = Block().double()
    reference_model.load_state_dict(model.state_dict())
    loss = reference_model(x.double(), reference)
    loss.backward()
    grads = [p.grad.float() for p in reference_model.parameters()]
    return model.to("tpu"), tpu(x), loss.float(), grads


def _program_temporaries(monkeypatch) -> list:
    """XLA's count of each compiled program's temporary bytes, as its programs run."""
    from torchtpu.compile import program
    from torchtpu.runtime import jax

    temporaries = []
    real_call = program.Program.__call__

    def measured(self, static, arrays, device=0):
        specs = [jax().ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
        seed, offset = torchtpu.rng.peek(device)
        compiled = self._jitted.lower(static, seed, offset, *specs).compile()
        temporaries.append(compiled.memory_analysis().temp_size_in_bytes)
        return real_call(self, static, arrays, device)

    monkeypatch.setattr(program.Program, "__call__", measured)
    return temporaries


@pytest.mark.parametrize("path", ["compiled", "jit"])
def test_a_compiled_sliding_window_holds_its_blocks_not_every_score(path, monkeypatch):
    """In a compiled program a block mask's lists are looped over (Note [Blockwise
    FlexAttention in a trace]): a window of 128 keys over 2048 holds [B, H, L, 128]
    scores an iteration, where torch's dense implementation holds [B, H, L, 2048]
    (8 MiB here); both match the CPU."""
    length, window_size = 2048, 128
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 1, length, 8) for _ in range(3))

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window_size)

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    expected = reference(q64, k64, v64, mask_mod=window)[0]
    expected.sum().backward()
    mask = create_block_mask(window, None, None, length, length, device="tpu", BLOCK_SIZE=128)
    temporaries = {}
    for blocks in ("auto", "off"):
        monkeypatch.setattr(torchtpu.config, "flex_blocks", blocks)
        measured = _program_temporaries(monkeypatch)
        inputs = [tpu(t).requires_grad_() for t in (q, k, v)]

        def attend(inputs=inputs):
            out = flex_attention(*inputs, block_mask=mask)
            out.sum().backward()
            return out

        attend = torch.compile(attend, backend="tpu") if path == "compiled" else torchtpu.jit(attend)
        torch._dynamo.reset()
        for _ in range(1 if path == "compiled" else 2):  # torchtpu.jit traces at its second call
            for t in inputs:
                t.grad = None
            out = attend()
        assert_same(out, expected.float(), atol=1e-5, rtol=1e-5)
        assert_same([t.grad for t in inputs], [t.grad.float() for t in (q64, k64, v64)], atol=1e-4, rtol=1e-4)
        temporaries[blocks] = max(measured)
    assert torchtpu.metrics()["attention"]["flex: blocks, looped in the program"] == 2
    # XLA:TPU's memory_analysis reported no temporaries for either program (v5e, JAX
    # 0.10.2); there benchmarks/attention.py --path compile measures the device's peak.
    if temporaries["off"]:
        assert temporaries["off"] >= length * length * 4 > 4 * temporaries["auto"]


@pytest.mark.parametrize("blocks", ["on", "off"])
def test_an_index_out_of_range_in_a_compiled_score_mod_raises(blocks, monkeypatch):
    """A value check stated inside the program's loop over the lists (Note [Blockwise
    FlexAttention in a trace]) is or-ed over its iterations and raised at the read, as
    the dense implementation's is: a bias one short of the queries."""
    monkeypatch.setattr(torchtpu.config, "flex_blocks", blocks)
    torch._dynamo.reset()
    q, k, v = (tpu(t.float()) for t in _inputs())
    bias = tpu(torch.randn(L - 1))

    def attend(q):
        return flex_attention(
            q.clone(), k, v, score_mod=lambda s, b, h, qi, kv: s + bias[qi],
            block_mask=_block_mask(sliding_window, "tpu"),
        )  # fmt: skip

    out = torch.compile(attend, backend="tpu")(q)
    with pytest.raises(IndexError, match="out of bounds"):
        out.sum().item()
    choice = "flex: blocks, looped in the program" if blocks == "on" else "flex: dense: config.flex_blocks is 'off'"
    assert _choices() == {choice: 1}


def test_a_compiled_model_is_one_graph_and_matches_the_cpu():
    model, x, loss, grads = _model_and_expected()
    block_mask = _block_mask(sliding_window, "tpu")
    compiled = torch.compile(model, backend="tpu", fullgraph=True)
    for _ in range(2):
        model.zero_grad()
        actual = compiled(x, flex_attention, block_mask)
        actual.backward()
        assert_same(actual, loss, atol=1e-4, rtol=1e-5)
        assert_same([p.grad for p in model.parameters()], grads, atol=1e-4, rtol=1e-4)
    assert torchtpu.metrics()["compiles"]["graph"] == 2  # forward and backward, once


def test_a_jitted_step_matches_the_cpu():
    model, x, loss, grads = _model_and_expected()
    block_mask = _block_mask(sliding_window, "tpu")

    @torchtpu.jit
    def step(x):
        loss = model(x, flex_attention, block_mask)
        loss.backward()
        return loss

    for _ in range(3):  # eager, traced, replayed
        model.zero_grad(set_to_none=True)
        assert_same(step(x), loss, atol=1e-4, rtol=1e-5)
        assert_same([p.grad for p in model.parameters()], grads, atol=1e-4, rtol=1e-4)
    assert torchtpu.metrics()["compiles"]["step"] == 1


@pytest.mark.parametrize("length", [256, 512])
@pytest.mark.parametrize("blocks", ["auto", "off"])
def test_a_compiled_flex_attention_alone_runs_eagerly_or_loops(mode, blocks, length, monkeypatch):
    """``torch.compile(flex_attention)`` (how Transformers and TorchTitan call it) is
    traced where the program would loop over the block mask's lists (16 blocks of 32
    keys and more), else runs eagerly, so that its blocks are scored where they pay
    rather than the whole score matrix traced (Note [A compiled flex_attention alone
    runs eagerly])."""
    monkeypatch.setattr(torchtpu.config, "flex_blocks", blocks)
    torch._dynamo.reset()
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 2, length, 16, dtype=torch.float64) for _ in range(3))

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 32)

    inputs = [tpu(t.float()).requires_grad_() for t in (q, k, v)]
    mask = create_block_mask(window, None, None, length, length, device="tpu", BLOCK_SIZE=32)
    out, lse = torch.compile(flex_attention, backend="tpu")(*inputs, block_mask=mask, return_lse=True)
    (out.sum() + lse.sum()).backward()
    q64, k64, v64 = (t.detach().requires_grad_() for t in (q, k, v))
    out64, lse64 = reference(q64, k64, v64, mask_mod=window)
    (out64.sum() + lse64.sum()).backward()
    assert_same((out, lse), (out64.float(), lse64.float()), atol=1e-5, rtol=1e-5)
    assert_same([t.grad for t in inputs], [t.grad.float() for t in (q64, k64, v64)], atol=1e-4, rtol=1e-4)
    graphs = torchtpu.metrics().get("compiles", {}).get("graph", 0)
    if blocks == "off":
        choice = "flex: dense: config.flex_blocks is 'off'"
    else:
        choice = "flex: blocks" if length == 256 else "flex: blocks, looped in the program"
    assert graphs == (2 if "looped" in choice else 0)  # forward and backward, or none
    assert _choices() == {choice: 2}


def test_a_compiled_function_takes_a_strided_activation_that_requires_grad():
    """Fakifying a non-view, non-contiguous tensor with autograd history kept its
    strides only on the CPU: on tpu Dynamo raised "Attempted to set the storage of a
    tensor on device tpu:0 to a storage on different device meta" (Note [A traced
    wrapper keeps its strides]); Transformers' queries into flex_attention are such."""
    torch.manual_seed(3)
    w, x = torch.randn(E, E) * 0.2, torch.randn(B, L, E)

    def queries(x, w):  # a head layout transposed, then scaled: strided, not a view
        return (x @ w).view(B, L, H, E // H).transpose(1, 2) * 2

    w64 = w.double().requires_grad_()
    q64 = queries(x.double(), w64)
    expected = reference(q64, q64, q64)[0]
    expected.sum().backward()
    w_tpu = tpu(w).requires_grad_()
    q = queries(tpu(x), w_tpu)
    assert not q._is_view() and not q.is_contiguous()
    actual = torch.compile(lambda q: flex_attention(q, q, q), backend="tpu")(q)
    actual.sum().backward()
    assert_same(actual, expected.float(), atol=1e-5, rtol=1e-4)
    assert_same(w_tpu.grad, w64.grad.float(), atol=1e-4, rtol=1e-4)


def test_transformers_offers_flex_attention_beside_torchtpu():
    """Transformers 5.x turns flex_attention off when the accelerator is "tpu" (Google's
    torch_tpu refuses it), which with torchtpu installed was every machine, CPU models
    included (Note [Transformers' flex_attention check]); in either import order."""
    import os
    import subprocess
    import sys

    pytest.importorskip("transformers", reason="the test extra installs transformers")
    for imports in ("import torch, transformers", "import transformers, torch"):
        script = (
            f"{imports}\n"
            "import transformers.masking_utils as masks\n"
            "from transformers.utils import is_torch_flex_attn_available\n"
            "from torch.nn.attention.flex_attention import BlockMask\n"
            "assert torch.accelerator.current_accelerator().type == 'tpu'\n"
            "print(is_torch_flex_attn_available(), masks.BlockMask is BlockMask)\n"
        )
        env = dict(os.environ, JAX_PLATFORMS="cpu")  # the parent may hold the chip
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
        assert out.stdout.split() == ["True", "True"], (imports, out.stderr[-2000:])


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_transformers_models_train_with_flex_attention_as_on_the_cpu(name, mode, monkeypatch):
    """``attn_implementation="flex_attention"`` on tpu: Transformers makes its block
    masks on tpu and compiles flex_attention with torch.compile's default backend
    (which runs it eagerly: Note [A compiled flex_attention alone runs eagerly]).
    Gemma 2 adds a sliding window and tanh soft-capping (a score_mod).

    Trained (loss, gradients, an AdamW step) against Transformers' eager attention on
    the CPU, with no padding: torch's CPU flex_attention has no backward when compiled,
    and where a left-padded query sees no key, eager attention averages the values and
    flex_attention gives zeros. The padded batch's forward is checked against
    Transformers' flex_attention on the CPU."""
    import copy

    pytest.importorskip("transformers", reason="the test extra installs transformers")
    from transformers.integrations import flex_attention as flex_integration

    from torchtpu.zoo import BY_NAME

    arch = BY_NAME[name]
    model = arch.build()
    padded = arch.batch(model.config)  # the second row is left-padded
    batch = {"input_ids": padded["input_ids"], "labels": padded["labels"]}

    def on(device, attention):
        copied = copy.deepcopy(model).to(device)
        copied.set_attn_implementation(attention)
        return copied

    def train(model, batch):
        output = model.train()(**batch)
        output.loss.backward()
        grads = [p.grad for p in model.parameters()]
        torch.optim.AdamW(model.parameters(), lr=1e-2).step()
        return output.loss, grads, [p.detach() for p in model.parameters()]

    def forward(model, batch):
        with torch.no_grad():
            return model.eval()(**batch).logits

    assert_same(
        train(on("tpu", "flex_attention"), tpu(batch)),
        train(on("cpu", "eager"), batch),
        atol=2e-5,
        rtol=1e-4,
    )
    actual = forward(on("tpu", "flex_attention"), tpu(padded))
    # The reference calls flex_attention as Transformers does inside a compiled model:
    # uncompiled (Inductor's CPU flex_attention is not what is under test).
    monkeypatch.setattr(flex_integration, "is_torchdynamo_compiling", lambda: True)
    assert_same(actual, forward(on("cpu", "flex_attention"), padded), atol=1e-5, rtol=1e-4)
    # The attention metrics count flex_attention's calls from every test alike; the
    # model says which implementation it ran.
    assert on("tpu", "flex_attention").config._attn_implementation == "flex_attention"


def test_score_mods_gradient_graphs_are_made_once_per_score_mod(mode, monkeypatch):
    """Eager calls reuse score_mod's forward and gradient graphs (Note [score_mod's
    gradient graphs, made once]); another score_mod gets its own, and every result
    matches the CPU."""
    from torchtpu.compile import flex_attention as tpu_flex

    hop = tpu_flex._hop
    torchs = hop.create_fw_bw_graph.torchs
    made = []

    def counting(score_mod, index_values, other_buffers):
        if index_values[0]._inner is None:  # not Dynamo's trace of the call: its own
            made.append(score_mod)
        return torchs(score_mod, index_values, other_buffers)

    monkeypatch.setattr(hop, "create_fw_bw_graph", tpu_flex._graphs_made_once(counting))
    monkeypatch.setattr(tpu_flex, "_gradient_graphs", {})
    inputs = _inputs()

    def halved(score, b, h, q, kv):
        return score / 2

    for score_mod, calls in ((softcap, 3), (halved, 2)):
        for _ in range(calls):
            q, k, v = (tpu(t.float()).requires_grad_() for t in inputs)
            out = flex_attention(q, k, v, score_mod=score_mod, block_mask=_block_mask(causal, "tpu"))
            out.sum().backward()
            ref_q = inputs[0].clone().requires_grad_()
            expected, _ = reference(ref_q, *inputs[1:], score_mod, causal)
            expected.sum().backward()
            assert_same(out, expected.float(), atol=2e-5, rtol=2e-5)
            assert_same(q.grad, ref_q.grad.float(), atol=2e-5, rtol=2e-5)
    assert len(made) == 2 and made[0] is not made[1]  # once per score_mod
