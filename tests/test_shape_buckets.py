"""torch.compile inference graphs with dynamic sizes run padded to buckets of sizes
(compile/buckets.py, Note [Shape buckets]): one program per bucket, values as the CPU's."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchtpu
import torchtpu.compile.backend  # noqa: F401
from torchtpu.compile import buckets


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    return torchtpu.metrics()["compiles"].get("graph", 0)


class _TinyLM(nn.Module):
    """A causal LM's inference: embeddings, positions, layer norm, causal attention, a
    head; it returns the last token's distribution, the mean hidden state and every
    hidden state."""

    def __init__(self, d=32, heads=4, vocab=50):
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, d), nn.Embedding(256, d)
        self.norm, self.qkv, self.out = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.head, self.heads = nn.Linear(d, vocab), heads

    def forward(self, ids):
        b, t = ids.shape
        x = self.embed(ids) + self.position(torch.arange(t, device=ids.device))
        q, k, v = self.qkv(self.norm(x)).split(x.shape[-1], -1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(F.gelu(a.transpose(1, 2).reshape(b, t, -1)))
        return self.head(x)[:, -1].softmax(-1), x.mean(1), x


def test_a_text_loop_over_20_lengths_compiles_one_program_per_bucket(mode):
    torch.manual_seed(0)
    cpu = _TinyLM()
    compiled = torch.compile(copy.deepcopy(cpu).to("tpu"), backend="tpu", dynamic=True)
    lengths = [9, 12, 15, 16, 17, 20, 25, 31, 32, 33, 40, 47, 55, 63, 64, 65, 80, 99, 110, 120]
    with torch.no_grad():
        for t in lengths:
            ids = torch.randint(0, 50, (2, t))
            for got, want in zip(compiled(ids.to("tpu")), cpu(ids)):
                assert got.shape == want.shape and got.dtype == want.dtype
                torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    assert _graphs() == 4  # buckets of 16, 32, 64 and 128
    assert torchtpu.metrics()["shape_buckets"]["graphs"] == 1


def _reductions(x, a, b):
    t = x.shape[1]
    flat = x.reshape(-1, x.shape[-1])  # [batch * t, d]: padding between the rows
    values, indices = x.max(1)
    return [
        x.sum(1), x.mean(1), x.amax(1), x.amin(1), x.argmax(1), x.argmin(1),
        x.softmax(1), x.log_softmax(1), x.logsumexp(1), (x > 0).any(1), (x > 0).all(1),
        x.cumsum(1), x[:, -1], x[:, -3], x[:, 2:].sum(1), x[:, :-1].mean(1), x.prod(1),
        flat.sum(0), flat.mean(0), flat.amax(0), values, indices, x.sum(), x.mean(),
        x.transpose(1, 2) @ x,  # a product over the padded dim
        (a // b).sum(1),  # integer division: the padding's zeros must not divide
        x.view(x.shape[0], t, 2, -1).sum(1),
    ]  # fmt: skip


def test_reductions_over_a_padded_dim_match_the_cpu():
    compiled = torch.compile(_reductions, backend="tpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in (5, 11, 16, 17):
            x = torch.rand(3, t, 4, generator=g) * 1.5 - 0.5
            a = torch.randint(-20, 20, (3, t, 4), generator=g)
            b = torch.randint(1, 5, (3, t, 4), generator=g)
            inputs = [z.to("tpu") for z in (x, a, b)]
            for z in inputs:
                torchtpu.mark_dynamic(z, 1)
            got = compiled(*inputs)
            for i, (g_, w) in enumerate(zip(got, _reductions(x, a, b))):
                assert g_.dtype == w.dtype, i
                torch.testing.assert_close(g_.cpu(), w, atol=1e-5, rtol=1e-5, msg=f"output {i}")
    assert _graphs() == 3  # buckets of 8, 16 and 32


def test_a_size_used_as_a_value_compiles_per_size_and_says_why():
    def f(x):
        return x.sum(1) / x.shape[1]  # padded, the size would be the bucket's

    compiled = torch.compile(f, backend="tpu", dynamic=True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for t in (5, 6, 7):
            x = torch.randn(2, t)
            torch.testing.assert_close(compiled(x.to("tpu")).cpu(), f(x))
    said = [
        str(w.message) for w in caught if issubclass(w.category, torchtpu.TPUPerformanceWarning)
    ]
    assert len(said) == 1 and "one program per size" in said[0] and "aten.div" in said[0]
    assert _graphs() == 3


def test_graphs_with_gradients_compile_per_size():
    """Training graphs are not padded: their saved activations cross programs."""
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
    compiled = torch.compile(copy.deepcopy(cpu).to("tpu"), backend="tpu", dynamic=True)
    for batch in (2, 3, 5):
        x = torch.randn(batch, 4)
        compiled(x.to("tpu")).sum().backward()
    assert "shape_buckets" not in torchtpu.metrics()
    assert _graphs() == 6  # forward and backward per size


def test_mark_dynamic_caps_the_bucket_at_its_max():
    def f(x):
        return x.softmax(-1).cumsum(-1)

    compiled = torch.compile(f, backend="tpu")
    with torch.no_grad():
        for t in (33, 40, 34):
            x = torch.randn(2, t)
            on_tpu = x.to("tpu")
            torchtpu.mark_dynamic(on_tpu, 1, max=40)
            torch.testing.assert_close(compiled(on_tpu).cpu(), f(x))
    assert _graphs() == 1  # 33, 34 and 40 in one bucket of 40, not 64


def test_bucket_sizes(monkeypatch):
    assert [buckets.bucket(n, None) for n in (2, 3, 16, 17, 100, 129)] == [2, 4, 16, 32, 128, 256]
    assert (
        buckets.bucket(33, 40) == 40
        and buckets.bucket(40, 40) == 40
        and buckets.bucket(9, 40) == 16
    )
    monkeypatch.setattr(torchtpu.config, "shape_bucket_min", 16)
    assert [buckets.bucket(n, None) for n in (2, 16, 17)] == [16, 16, 32]


def test_buckets_off_compiles_per_size(monkeypatch):
    monkeypatch.setattr(torchtpu.config, "shape_buckets", "off")
    compiled = torch.compile(lambda x: x.sum(1), backend="tpu", dynamic=True)
    with torch.no_grad():
        for t in (5, 6, 7):
            compiled(torch.randn(2, t).to("tpu"))
    assert _graphs() == 3


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_transformers_causal_lm_over_prompt_lengths_compiles_per_bucket(arch):
    """A padded batch (an attention mask with padding), as generate's prefill sees it."""
    pytest.importorskip("transformers")
    from torchtpu.zoo import BY_NAME

    cpu = BY_NAME[arch].build().eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    compiled = torch.compile(tpu, backend="tpu", dynamic=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in (5, 9, 13, 17, 30):
            ids = torch.randint(3, 90, (2, t), generator=g)
            mask = torch.ones(2, t, dtype=torch.long)
            mask[0, :2] = 0
            want = cpu(input_ids=ids, attention_mask=mask).logits
            got = compiled(input_ids=ids.to("tpu"), attention_mask=mask.to("tpu")).logits
            torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)
    assert _graphs() == 3  # 8, 16 and 32
    assert torchtpu.metrics()["shape_buckets"] == {"graphs": 1}


def test_attention_with_dynamic_sizes_trains_as_on_the_cpu():
    """scaled_dot_product_attention's argument check kept a cache keyed by shapes, which
    symbolic sizes cannot be: ``dynamic=True`` raised in Dynamo."""

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()

    compiled = torch.compile(f, backend="tpu", dynamic=True)
    for t in (6, 9):
        q, k, v = (torch.randn(2, 3, t, 8, requires_grad=True) for _ in range(3))
        tq, tk, tv = (z.detach().to("tpu").requires_grad_() for z in (q, k, v))
        f(q, k, v).backward()
        loss = compiled(tq, tk, tv)
        loss.backward()
        torch.testing.assert_close(loss.cpu(), f(q, k, v).detach(), atol=1e-4, rtol=1e-4)
        for a, b in ((tq, q), (tk, k), (tv, v)):
            torch.testing.assert_close(a.grad.cpu(), b.grad, atol=1e-4, rtol=1e-4)
