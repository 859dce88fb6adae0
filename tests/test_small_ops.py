"""Note [Small ops of changing shapes run on the CPU] (dispatch/small_ops.py): a line
that keeps meeting new shapes of small tensors stops compiling a program for each."""

from __future__ import annotations

import pytest
import torch

import torchtpu
from torchtpu import config
from torchtpu.dispatch import small_ops


@pytest.fixture(autouse=True)
def _small_ops_on_cpu(monkeypatch):
    monkeypatch.setattr(config, "small_ops_on_cpu", True)  # the default; conftest's is off


def _compiles() -> int:
    compiles = torchtpu.metrics().get("compiles", {})
    return compiles.get("op", 0) + compiles.get("chunk", 0)


def _growing(device, steps=24, start=(3, 1, 4)):
    """A decoding loop's bookkeeping: ids one longer each step, read each step."""
    ids = torch.tensor([start], device=device)
    positions = torch.arange(len(start), device=device)[None]
    finished = []
    for t in range(steps):
        nxt = (ids.sum(-1, keepdim=True) * 7 + t) % 11
        ids = torch.cat([ids, nxt], dim=-1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=-1)
        finished.append(bool((nxt == 0).any()))  # a read each step, as generate()'s
    return ids, positions, finished


@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_a_growing_sequence_stops_compiling_and_matches_the_cpu(mode):
    torchtpu.reset_metrics()
    with torch.tpu.set_eager_mode(mode):
        ids, positions, finished = _growing("tpu")
    expected = _growing("cpu")
    torch.testing.assert_close(ids.cpu(), expected[0])
    torch.testing.assert_close(positions.cpu(), expected[1])
    assert finished == expected[2]
    assert ids.device.type == "tpu" and ids.dtype == torch.int64
    # 24 steps, each with new shapes for ~5 ops: a program or two for the first steps only
    assert _compiles() <= 16
    assert sum(torchtpu.metrics()["small_ops_on_cpu"].values()) >= 60


def test_turned_off_every_shape_compiles(monkeypatch):
    monkeypatch.setattr(config, "small_ops_on_cpu", False)
    torchtpu.reset_metrics()
    start = (2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5)  # shapes no other test made
    ids, _, _ = _growing("tpu", steps=8, start=start)
    torch.testing.assert_close(ids.cpu(), _growing("cpu", steps=8, start=start)[0])
    assert _compiles() >= 2 * 8
    assert "small_ops_on_cpu" not in torchtpu.metrics()


def test_a_shape_that_recurs_compiles_again():
    """After the shapes settle, a call of one shape in every step compiles once, and
    then runs on the device."""
    torchtpu.reset_metrics()
    results = []
    for n in [*range(2, 9), *([9] * 8)]:
        x = torch.arange(n, device="tpu", dtype=torch.float32) * 0.5  # new shapes, then 9
        results.append(x.exp().sum().item())
    expected = [(torch.arange(n, dtype=torch.float32) * 0.5).exp().sum().item()
                for n in [*range(2, 9), *([9] * 8)]]  # fmt: skip
    assert results == pytest.approx(expected, rel=1e-6)
    on_cpu = torchtpu.metrics()["small_ops_on_cpu"]
    assert 0 < on_cpu["aten.exp.default"] <= 6 + small_ops.RECUR  # sizes 3-8, then 9
    before = dict(on_cpu)
    x = torch.arange(9, device="tpu", dtype=torch.float32) * 0.5
    x.exp().sum().item()
    assert torchtpu.metrics()["small_ops_on_cpu"] == before  # settled: on the device


def test_random_written_and_large_ops_always_compile():
    torchtpu.reset_metrics()
    for n in range(2, 8):
        torch.rand(n, device="tpu").sum().item()  # random: the CPU's stream differs
        torch.zeros(n, device="tpu").add_(1).sum().item()  # writes into its argument
        torch.ones(n, 4096, device="tpu").neg().sum().item()  # 16 KiB and more
    on_cpu = torchtpu.metrics().get("small_ops_on_cpu", {})
    for op in ("aten.uniform_.default", "aten.add_.Tensor", "aten.neg.default"):
        assert op not in on_cpu
    assert on_cpu  # the small reductions of the same lines did run on the CPU


def test_an_error_on_the_cpu_is_the_cpus():
    table = torch.randn(10, 3)
    tpu_table = table.to("tpu")
    for n in range(1, 5):
        index = torch.arange(n)
        torch.testing.assert_close(tpu_table.index_select(0, index.to("tpu")).cpu(),
                                   table.index_select(0, index))  # fmt: skip
    with pytest.raises(IndexError):
        tpu_table.index_select(0, torch.tensor([0, 1, 2, 3, 11], device="tpu")).cpu()


def test_a_static_cache_generate_compiles_nothing_per_token():
    transformers = pytest.importorskip("transformers")
    config_ = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config_).eval()
    prompt = torch.randint(0, 128, (1, 5))

    def generate(model, prompt, tokens):
        with torch.no_grad():
            return model.generate(
                prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                cache_implementation="static",
            )  # fmt: skip

    expected = generate(model, prompt, 24)
    tpu_model = model.to("tpu")
    generate(tpu_model, prompt.to("tpu"), 4)  # the model's programs compile here
    torchtpu.reset_metrics()
    out = generate(tpu_model, prompt.to("tpu"), 24)
    assert torch.equal(out.cpu(), expected)
    # 20 new lengths: before, ~4 programs each (cat of the ids and positions, ...)
    assert _compiles() <= 12
