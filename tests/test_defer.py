"""DeferAndFuse: same results as Strict and CPU, one compiled chunk per training step,
flushes where values are read, only live values materialised."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchtpu
from conftest import assert_same
from torchtpu.dispatch import defer


@pytest.fixture
def deferred():
    with torch.tpu.set_eager_mode("defer"):
        yield
    assert defer.pending_count() == 0  # leaving the mode flushed the queue


def _flushes():
    return torchtpu.metrics().get("flushes", {})


def test_selecting_the_mode():
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        assert torch.tpu.eager_mode is torch.tpu.EagerMode.DEFER_AND_FUSE
    torch.tpu.eager_mode = "defer"
    try:
        assert torch.tpu.eager_mode is torch.tpu.EagerMode.DEFER_AND_FUSE
    finally:
        torch.tpu.eager_mode = "strict"


def test_ops_are_recorded_not_run_and_metadata_does_not_flush(deferred):
    x = torch.randn(4, 3, device="tpu")
    y = (x * 2 + 1).t().sum(0, keepdim=True)
    assert defer.pending_count() > 0
    assert y.shape == (1, 4) and y.dtype == torch.float32 and y.device == torch.device("tpu:0")
    assert y.stride() == (4, 1) and y.requires_grad is False and y.dim() == 2
    assert "flushes" not in torchtpu.metrics()
    assert_same(y, (x.cpu() * 2 + 1).t().sum(0, keepdim=True))
    assert _flushes() == {"value read": 1}


@pytest.mark.parametrize(
    "read, reason",
    [
        (lambda t: t.item(), "value read"),
        (lambda t: t.cpu(), "value read"),
        (lambda t: t.to("cpu"), "value read"),
        (lambda t: t.tolist(), "value read"),
        (lambda t: t.numpy(), "value read"),
        (lambda t: bool(t > 0), "value read"),
        (lambda t: float(t), "value read"),
        (lambda t: repr(t), "value read"),
        (lambda t: f"{t:.3f}", "value read"),
        (lambda t: torch.nonzero(t.reshape(1)), "data-dependent shape"),
        (lambda t: t.reshape(1)[t.reshape(1) > 0], "data-dependent shape"),
        (lambda t: torch.tpu.synchronize(), "sync"),
        (lambda t: torchtpu.sync(), "sync"),
        (lambda t: torch.tpu.set_eager_mode("strict"), "mode change"),
    ],
)
def test_flush_points(read, reason):
    with torch.tpu.set_eager_mode("defer"):
        t = torch.ones((), device="tpu") * 3
        torchtpu.reset_metrics()
        read(t)
        assert _flushes() == {reason: 1}
        torch.tpu.set_eager_mode("defer")


@pytest.mark.allow_fallback
@pytest.mark.filterwarnings("ignore::torchtpu.TPUFallbackWarning")
def test_cpu_fallback_flushes(deferred, monkeypatch):
    from torchtpu.dispatch import core as dispatch
    from torchtpu.dispatch import fallback

    # Pretend sin has no lowering, so it runs on the CPU fallback.
    monkeypatch.setitem(dispatch._HANDLERS, torch.ops.aten.sin.default, fallback.run_on_cpu)
    a = torch.randn(4, 3, device="tpu") + 1
    torchtpu.reset_metrics()
    out = a.sin()
    assert _flushes().get("cpu fallback") == 1
    assert_same(out, a.cpu().sin())


def test_queue_bound_flushes(deferred, monkeypatch):
    monkeypatch.setattr(torchtpu.config, "defer_max_ops", 8)
    x = torch.zeros(3, device="tpu")
    for _ in range(20):
        x = x + 1
    assert _flushes() == {"queue full": 2}
    assert_same(x, torch.full((3,), 20.0))


@pytest.mark.parametrize("layers", [8, 13, 21])
def test_a_step_longer_than_the_queue_compiles_nothing_after_step_two(monkeypatch, layers):
    """A step of more ops than ``defer_max_ops`` flushes as the queue fills, and ends
    with a flush too: each step starts its queue where the last did, the cuts fall on
    the same ops, and the chunks repeat. (Without the step-end flush the cuts drifted
    through the step and new phases compiled for several steps.)"""
    monkeypatch.setattr(torchtpu.config, "defer_max_ops", 32)
    torch.manual_seed(0)
    blocks = [m for _ in range(layers) for m in (nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU())]
    model = nn.Sequential(*blocks).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8, device="tpu")
    compiles = []
    with torch.tpu.set_eager_mode("defer"):
        for _ in range(7):
            torchtpu.reset_metrics()
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            loss.item()
            compiles.append(torchtpu.metrics().get("compiles", {}).get("chunk", 0))
            assert _flushes().get("queue full", 0) > 0
    assert compiles[2:] == [0] * 5, compiles


def test_only_live_values_are_outputs(deferred):
    x = torch.randn(8, device="tpu")
    a = x * 2
    b = a + 1
    c = b.exp()
    del a, b  # dead intermediates: never materialised
    c.cpu()
    # x (still referenced) and c come out of the chunk; x * 2 and + 1 stay inside XLA.
    assert torchtpu.metrics()["chunk_values"] == {"outputs": 2, "dropped": 2}


def test_a_queue_of_one_op_runs_as_that_ops_program():
    """Note [A chunk of one op]: a value read after one op runs the op's own program,
    the one Strict compiled, and compiles no chunk."""
    x = torch.randn(5, 7, device="tpu")
    assert_same(x * 3, x.cpu() * 3)  # Strict compiles the op
    with torch.tpu.set_eager_mode("defer"):
        torchtpu.reset_metrics()
        for _ in range(3):
            assert_same(x * 3, x.cpu() * 3)
        y = x.clone()
        assert_same(y, x.cpu())
        y.mul_(2)  # an in-place op: its written base is the queue's output
        assert_same(y, x.cpu() * 2)
        assert defer.pending_count() == 0
    metrics = torchtpu.metrics()
    assert metrics["flushes"] == {"value read": 5}
    assert "chunk" not in metrics.get("compiles", {})


def test_error_in_a_queue_of_one_op_names_the_op_and_line(deferred):
    x = torch.arange(3.0, device="tpu")
    index = torch.full((1,), 7, device="tpu")  # computed on the device: checked there
    torchtpu.sync()
    bad = x[index]  # the line to be named
    line = sys._getframe().f_lineno - 1
    assert defer.pending_count() == 1
    with pytest.raises(IndexError) as info:
        bad.cpu()
    notes = "\n".join(info.value.__notes__)
    assert "aten.index.Tensor" in notes and f"{__file__}:{line}" in notes


def test_mutation_order_and_views(deferred):
    base = torch.zeros(3, 4, device="tpu")
    row = base[1]
    col = base[:, 2]
    row.add_(1)
    col.fill_(5)
    first = base.clone()
    base.mul_(2)
    row.sub_(1)
    expected = torch.zeros(3, 4)
    expected[1].add_(1)
    expected[:, 2].fill_(5)
    expected_first = expected.clone()
    expected.mul_(2)
    expected[1].sub_(1)
    assert_same(first, expected_first)
    assert_same(base, expected)
    assert_same(col, expected[:, 2])


def _train(mode, steps, scheduler=False, dropout=0.0):
    torch.manual_seed(0)
    with torch.tpu.set_eager_mode(mode):
        model = nn.Sequential(
            nn.Linear(32, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 10)
        ).to("tpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.9) if scheduler else None
        x = torch.randn(16, 32, device="tpu")
        y = torch.randint(0, 10, (16,), device="tpu")
        losses, compiles = [], []
        for _ in range(steps):
            before = torchtpu.metrics().get("compiles", {}).get("chunk", 0)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if sched:
                sched.step()
            losses.append(loss.item())
            compiles.append(torchtpu.metrics().get("compiles", {}).get("chunk", 0) - before)
    return losses, compiles


def test_training_matches_strict_and_compiles_once():
    strict, _ = _train("strict", 20)
    torchtpu.reset_metrics()
    deferred, compiles = _train("defer", 20, scheduler=False)
    torch.testing.assert_close(torch.tensor(deferred), torch.tensor(strict), rtol=0, atol=1e-6)
    assert sum(compiles[2:]) == 0, compiles  # warm after the first steps: one cached chunk per step
    # The step ends its chunk (the optimizer hook); loss.item() then reads an output.
    assert torchtpu.metrics()["flushes"] == {"optimizer step": 20}


def test_changing_learning_rate_does_not_recompile():
    _, compiles = _train("defer", 10, scheduler=True)
    assert sum(compiles[2:]) == 0, compiles


def test_dropout_differs_per_step_without_recompiling():
    losses, compiles = _train("defer", 8, dropout=0.5)
    assert len(set(losses)) == len(losses)
    assert sum(compiles[2:]) == 0, compiles


def test_error_in_a_chunk_names_the_op_and_line_and_spares_other_tensors(deferred):
    keep = torch.arange(4.0, device="tpu") + 1
    keep.cpu()
    x = torch.arange(3.0, device="tpu")
    bad = x[torch.full((1,), 7, device="tpu")]  # the line to be named
    line = sys._getframe().f_lineno - 1
    other = keep * 2
    with pytest.raises(IndexError) as info:
        bad.cpu()
    notes = "\n".join(info.value.__notes__)  # torch's message; the op and line in a note
    assert "aten.index.Tensor" in notes and f"{__file__}:{line}" in notes
    assert_same(keep, torch.arange(4.0) + 1)
    assert_same(other, (torch.arange(4.0) + 1) * 2)


def test_a_large_step_runs_its_optimizer_as_a_chunk_of_its_own(monkeypatch):
    """Note [The optimizer's step is a chunk of its own]: a queue of at least
    ``defer_split_ops`` ops runs when ``optimizer.step()`` begins, and the optimizer's
    ops when it ends. The first step makes AdamW's moments in a chunk of their own
    (Note [An optimizer's new state is made apart]), so the forward and backward chunk
    and the optimizer's chunk compiled in step 1 serve every later step."""
    monkeypatch.setattr(torchtpu.config, "defer_split_ops", 8)
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(9, 17), nn.GELU(), nn.Linear(17, 3))
    x, y = torch.randn(5, 9), torch.randint(0, 3, (5,))

    def run(model, x, y, device):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def step():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss.item()

        if device == "cpu":
            return [step() for _ in range(4)], []
        accounts = [torchtpu.explain(step) for _ in range(4)]
        return [a.result for a in accounts], [a.flushes for a in accounts]

    expected, _ = run(cpu_model, x, y, "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 17), nn.GELU(), nn.Linear(17, 3)).to("tpu")
    with torch.tpu.set_eager_mode("defer"):
        losses, flushes = run(model, x.to("tpu"), y.to("tpu"), "tpu")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=0, atol=1e-5)
    reasons = [[f["reason"] for f in step] for step in flushes]
    assert reasons[0] == ["optimizer step begins", "optimizer's new state", "optimizer step"]
    assert reasons[1:] == [["optimizer step begins", "optimizer step"]] * 3, reasons
    compiled = [[f["ops"] for f in step if f["compiled"]] for step in flushes]
    forward_backward, moments, optimizer_chunk = compiled[0]
    assert compiled[1:] == [[], [], []], compiled
    assert moments == 2 * len(list(model.parameters()))  # zeros_like: exp_avg, exp_avg_sq
    assert optimizer_chunk < forward_backward


def test_a_large_forward_runs_when_its_backward_begins(monkeypatch):
    """Note [The backward starts a chunk]: a queue of at least ``defer_split_ops`` ops
    runs when the first op of ``loss.backward()`` is recorded, so the device computes
    the forward while the backward is recorded; the cut is at the same op every step
    (nothing compiles after the first) and the results are the CPU's."""
    monkeypatch.setattr(torchtpu.config, "defer_split_ops", 6)

    def make():
        torch.manual_seed(0)
        layers = [nn.Linear(9, 9) if i % 2 == 0 else nn.GELU() for i in range(9)]
        return nn.Sequential(*layers, nn.Linear(9, 3))

    x, y = torch.randn(5, 9), torch.randint(0, 3, (5,))

    def run(model, x, y):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def step():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss.item()

        return [torchtpu.explain(step) for _ in range(4)]

    expected = [a.result for a in run(make(), x, y)]
    with torch.tpu.set_eager_mode("defer"):
        accounts = run(make().to("tpu"), x.to("tpu"), y.to("tpu"))
    losses = [a.result for a in accounts]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=0, atol=1e-5)
    reasons = [[f["reason"] for f in a.flushes] for a in accounts]
    assert reasons[0][0] == "backward begins", reasons
    assert reasons[1:] == [["backward begins", "optimizer step begins", "optimizer step"]] * 3
    # the forward: 6 linear layers, 4 GELUs, the loss and backward()'s seed, ones_like
    assert accounts[1].flushes[0]["ops"] == 12
    compiled = [[f["ops"] for f in a.flushes if f["compiled"]] for a in accounts]
    assert compiled[1:] == [[], [], []], compiled


def test_a_large_step_read_before_its_optimizer_compiles_two_chunks(monkeypatch):
    """The loss read between backward and ``optimizer.step()``: the optimizer's ops run
    alone at the step's end instead of joining the next step's forward (which made
    steps 1, 2 and 3 three different chunks)."""
    monkeypatch.setattr(torchtpu.config, "defer_split_ops", 8)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 19), nn.GELU(), nn.Linear(19, 3)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(5, 9).to("tpu"), torch.randint(0, 3, (5,)).to("tpu")
    compiled = []
    with torch.tpu.set_eager_mode("defer"):
        for _ in range(5):
            before = torchtpu.metrics().get("compiles", {}).get("chunk", 0)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            loss.item()
            opt.step()
            compiled.append(torchtpu.metrics().get("compiles", {}).get("chunk", 0) - before)
    # step 1: forward and backward, the optimizer's new state, its update; nothing after
    assert compiled == [3, 0, 0, 0, 0], compiled


def test_chunks_and_graphs_without_products_compile_with_the_op_compiler_options(monkeypatch):
    """Note [The least effort for programs without products] (dispatch/effort.py): a
    DeferAndFuse chunk or a torch.compile graph of pointwise ops compiles with
    ``config.op_compiler_options`` (an option XLA does not know fails its compile and
    is named); one with a matrix product keeps XLA's defaults and runs."""
    monkeypatch.setattr(torchtpu.config, "op_compiler_options", {"no_such_option": 1})
    x, w = torch.randn(11, 5), torch.randn(5, 3)
    with torch.tpu.set_eager_mode("defer"):
        light = x.to("tpu") * 3.5 + 1.25
        with pytest.raises(Exception, match="no_such_option"):
            light.cpu()
        heavy = x.to("tpu") @ w.to("tpu") + 1.25
        assert_same(heavy, x @ w + 1.25)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="no_such_option"):
        torch.compile(lambda a: a * 2.5 - 1, backend="tpu")(torch.randn(3, 17).to("tpu"))
    y = torch.randn(3, 17)
    product = torch.compile(lambda a: (a @ a.T) * 2.5 - 1, backend="tpu")(y.to("tpu"))
    torch.testing.assert_close(product.cpu(), (y @ y.T) * 2.5 - 1)
