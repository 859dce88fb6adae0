"""The compiled paths: torch.compile(backend="tpu") and torchtpu.jit, against CPU eager."""

from __future__ import annotations

import copy
import gc
import importlib.metadata
import math
import os
import subprocess
import sys
import weakref

import jax
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchtpu
import torchtpu.compile.backend  # noqa: F401  (the Dynamo options it sets apply from here)
from conftest import assert_same
from test_training import _CNN, _Block, _mlp, _mlp_batch
from torchtpu import _compat
from torchtpu.dispatch import modes

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _cnn_batch():
    g = torch.Generator().manual_seed(2)
    return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)


def _block_batch():
    tokens = torch.randint(1, 50, (2, 8), generator=torch.Generator().manual_seed(3))
    tokens[0, :2] = 0
    return (tokens,)


MODELS = {
    "mlp": (
        _mlp,
        _mlp_batch,
        lambda m, x, y: F.cross_entropy(m(x), y),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ),
    "cnn": (
        _CNN,
        _cnn_batch,
        lambda m, x, y: F.cross_entropy(m(x), y),
        lambda p: torch.optim.Adam(p, lr=1e-2),
    ),
    "block": (
        _Block,
        _block_batch,
        lambda m, t: F.nll_loss(m(t).flatten(0, 1), t.flatten(), ignore_index=0),
        lambda p: torch.optim.AdamW(p, lr=1e-2, eps=1e-6),
    ),
}


def _train(name, device, steps, wrap_model=None, wrap_step=None):
    """``steps`` training steps of a MODELS entry; (losses, final state on the CPU)."""
    make_model, make_batch, loss_fn, make_opt = MODELS[name]
    torch.manual_seed(0)
    model = make_model().to(device)
    batch = [t.to(device) for t in make_batch()]
    opt = make_opt(model.parameters())
    run = wrap_model(model) if wrap_model else model

    def step(*batch):
        opt.zero_grad()
        loss = loss_fn(run, *batch)
        loss.backward()
        opt.step()
        return loss

    if wrap_step:
        step = wrap_step(step)
    losses = [step(*batch).item() for _ in range(steps)]
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _assert_trains_like_cpu(
    name, steps, *, loss_atol=1e-5, state_rtol=1e-4, state_atol=1e-5, **wrap
):
    tpu_losses, tpu_state = _train(name, "tpu", steps, **wrap)
    cpu_losses, cpu_state = _train(name, "cpu", steps)
    torch.testing.assert_close(
        torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=0, atol=loss_atol
    )
    for key, value in cpu_state.items():
        torch.testing.assert_close(
            tpu_state[key],
            value,
            rtol=state_rtol,
            atol=state_atol,
            msg=lambda m, k=key: f"{k}: {m}",
        )


# -- torch.compile ------------------------------------------------------------------


def test_backend_is_found_by_name_through_its_entry_point():
    names = importlib.metadata.entry_points(group="torch_dynamo_backends").names
    assert "tpu" in names
    from torchtpu.compile.backend import tpu_backend

    assert torch._dynamo.lookup_backend("tpu") is tpu_backend
    assert "tpu" in torch._dynamo.list_backends()


@pytest.mark.parametrize("name", MODELS)
def test_models_compile_without_graph_breaks(name):
    make_model, make_batch, _, _ = MODELS[name]
    model = make_model().to("tpu")
    explanation = torch._dynamo.explain(model)(make_batch()[0].to("tpu"))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("name", MODELS)
def test_compiled_training_matches_cpu(name):
    """Forward and backward compiled (two XLA programs), the optimizer eager."""
    # XLA fuses the compiled backward's reductions in its own order: after three SGD
    # steps a bias of the block differs from the CPU's by up to ~2.5e-5 (float32
    # rounding, not a wrong gradient; the eager paths match to 1e-5).
    _assert_trains_like_cpu(
        name, 3, state_atol=5e-5, wrap_model=lambda m: torch.compile(m, backend="tpu")
    )
    metrics = torchtpu.metrics()
    assert metrics["compiles"]["graph"] == 2  # one forward, one backward
    assert metrics["compiled_calls"]["graph"] == 6
    assert "fallback" not in metrics


def test_compiled_matches_eager_in_every_mode(mode):
    torch.manual_seed(0)
    model = _CNN().to("tpu")  # BatchNorm: its running stats are written by the graph
    x = _cnn_batch()[0].to("tpu")
    eager_model = _CNN().to("tpu")
    eager_model.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="tpu")
    torch.testing.assert_close(compiled(x).cpu(), eager_model(x).cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.bn.running_mean.cpu(), eager_model.bn.running_mean.cpu())
    assert int(model.bn.num_batches_tracked.item()) == 1


# -- a whole training step compiled, optimizer included ----------------------------------

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}


def _small_step(model, opt):
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def _small_training(device, optimizer, compiled, eager_steps=0, steps=3, backend="tpu"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)
    opt = OPTIMIZERS[optimizer](model.parameters())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 6, generator=g).to(device), torch.randint(0, 3, (5,), generator=g)
    y = y.to(device)
    step = _small_step(model, opt)
    losses = [step(x, y).item() for _ in range(eager_steps)]
    if compiled:
        step = torch.compile(step) if backend is None else torch.compile(step, backend=backend)
    losses += [step(x, y).item() for _ in range(steps)]
    return losses, model, opt


def test_the_default_backend_compiles_tpu_graphs_as_tpu():
    """``torch.compile(f)`` is Inductor, whose code generation for a "tpu" device needs
    Google's torch_tpu package (ModuleNotFoundError); tpu graphs go to backend="tpu"."""
    losses, model, _ = _small_training("tpu", "adamw", compiled=True, backend=None)
    expected, cpu_model, _ = _small_training("cpu", "adamw", compiled=False)
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-5)
    assert torchtpu.metrics()["compiles"]["graph"] >= 2  # forward and backward


def test_the_default_backend_compiles_a_graph_that_only_makes_tpu_tensors():
    """A graph with no tensor inputs that builds tpu tensors also goes to backend="tpu":
    ``create_block_mask(..., device="tpu", _compile=True)``, as Transformers calls it,
    went to Inductor and raised ModuleNotFoundError: No module named 'torch_tpu'."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q, k):
        return q >= k

    made = create_block_mask(causal, 1, 1, 256, 256, device="tpu", _compile=True)
    expected = create_block_mask(causal, 1, 1, 256, 256, device="cpu")
    assert made.kv_num_blocks.device.type == "tpu"
    for actual, want in zip(made.as_tuple(), expected.as_tuple()):
        if isinstance(want, torch.Tensor):
            assert torch.equal(actual.cpu(), want), (actual, want)
    assert torchtpu.metrics()["compiles"]["graph"] >= 1


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_whole_step_compiles_with_its_optimizer(mode, optimizer):
    """loss, backward and ``opt.step()`` in one compiled function. AdamW's ``step``
    state was a 0-d CPU tensor the graph wrote back through a storage-less handle
    (AttributeError: no ``_storage``); it now counts on the device, as on CUDA."""
    losses, model, opt = _small_training("tpu", optimizer, compiled=True)
    expected, cpu_model, cpu_opt = _small_training("cpu", optimizer, compiled=False)
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-5)
    if optimizer != "sgd":
        step = opt.state[next(model.parameters())]["step"]
        assert step.device.type == "tpu" and step.item() == 3


def test_a_compiled_step_reuses_the_state_it_overwrites(mode):
    """Note [Compiled graphs reuse the inputs they overwrite]: the optimizer graph's old
    parameters and moments are donated in Strict and Debug; in DeferAndFuse the graph
    joins the step's chunk, which donates them itself."""
    torchtpu.reset_metrics()
    losses, model, _ = _small_training("tpu", "adamw", compiled=True)
    expected, cpu_model, _ = _small_training("cpu", "adamw", compiled=False)
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-5)
    donated = torchtpu.metrics().get("donated", {}).get("graph", 0)
    if mode == "defer":
        assert donated == 0
    else:  # steps 2 and 3 at least: 4 parameters, their two moments
        assert donated >= 2 * 4 * 3


def test_a_compiled_step_never_donates_a_parameter_held_elsewhere():
    torch.manual_seed(0)
    model = nn.Linear(6, 3).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(5, 6, device="tpu")

    @torch.compile(backend="tpu")
    def step():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    step(), step()
    held = torchtpu.to_jax(model.weight)  # the weight's array itself
    before = model.weight.detach().cpu()
    torchtpu.reset_metrics()
    step()
    assert not held.is_deleted()
    torch.testing.assert_close(torch.from_numpy(np.asarray(held)), before)
    assert torchtpu.metrics()["donated"]["graph"] >= 2  # the bias and the momenta were
    assert not torch.equal(model.weight.detach().cpu(), before)  # the step still updated it


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_jit_step_copies_none_of_the_state_it_donates(micro_batches):
    """Note [Donating the step's state] (jit.py): a step's first trace finds state its
    eager call did not (gradients accumulated, AdamW's moments: a second trace); the
    abandoned trace's frames held the state's arrays until a garbage collection, so the
    next call copied every array it donates: 3x an MLP's parameters at its peak."""

    def train(device):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(micro_batches, 5, 6, generator=g).to(device)

        def step():
            opt.zero_grad()
            for i in range(micro_batches):
                loss = model(x[i]).square().mean() / micro_batches
                loss.backward()
            opt.step()
            return loss

        if device == "tpu":
            step = torchtpu.jit(step)
        return [step().item() for _ in range(4)], model

    torchtpu.reset_metrics()
    losses, model = train("tpu")
    expected, cpu_model = train("cpu")
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-5)
    assert torchtpu.metrics()["compiles"]["step"] >= 1
    assert "copied_to_donate" not in torchtpu.metrics()


def test_a_compiled_forward_keeps_its_weights_for_the_backward_without_copying_them(mode):
    """Note [A program returns its unchanged inputs as they are] (program.py): the
    forward graph returns the weights its backward multiplies by; they are the
    parameters' own arrays, not copies held until the backward (an MLP's compiled step
    held 0.86x its parameters' bytes more at its peak)."""
    torch.manual_seed(0)
    width = 256  # a weight is 256 KiB; the activations of a batch of 4, 4 KiB each
    cpu_model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    model = copy.deepcopy(cpu_model).to("tpu")
    x = torch.randn(4, width)
    forward = torch.compile(lambda m, x: m(x).square().mean(), backend="tpu")
    xt = x.to("tpu")
    forward(model, xt).backward()  # compiles the forward and the backward
    model.zero_grad(set_to_none=True)
    torch.tpu.synchronize()
    before = torch.tpu.memory_allocated()
    loss = forward(model, xt)
    loss.item()
    held = torch.tpu.memory_allocated() - before  # what the forward keeps for the backward
    assert held < width * width * 4 // 2
    loss.backward()
    expected = cpu_model(x).square().mean()
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach())
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6)


def test_the_backward_recomputes_what_is_cheap(monkeypatch, forward_graph_outputs):
    """Note [The backward recomputes what is cheap]: a compiled language-model loss
    keeps one float32 [tokens, vocabulary] array for its backward, where AOTAutograd's
    default partition (``compile_recompute = False``) keeps ``log_softmax``'s result
    and an alias of it, each an array of its own in an XLA program; both train as
    the CPU does."""
    kept = forward_graph_outputs
    tokens, width, vocab = 64, 32, 512
    torch.manual_seed(0)
    cpu_head = nn.Linear(width, vocab)
    x, target = torch.randn(tokens, width), torch.randint(0, vocab, (tokens,))
    F.cross_entropy(cpu_head(x), target).backward()
    expected = [p.grad for p in cpu_head.parameters()]
    logits_kept = {}
    for recompute in (True, False):
        monkeypatch.setattr(torchtpu.config, "compile_recompute", recompute)
        torch._dynamo.reset()
        kept.clear()
        head = copy.deepcopy(cpu_head).to("tpu")
        head.zero_grad()
        loss = torch.compile(F.cross_entropy, backend="tpu")(head(x.to("tpu")), target.to("tpu"))
        loss.backward()
        assert_same([p.grad for p in head.parameters()], expected, rtol=1e-5, atol=1e-6)
        logits_kept[recompute] = sum(tuple(v.shape) == (tokens, vocab) for v in kept)
    assert logits_kept == {True: 1, False: 2}


@pytest.mark.parametrize("cast", ["float", "to", "float then view"])
def test_a_compiled_loss_of_upcast_logits_keeps_the_16_bit_logits(forward_graph_outputs, cast):
    """Note [A compiled loss of upcast logits]: ``F.cross_entropy(logits.float(), t)``
    of bfloat16 logits keeps the bfloat16 logits for the backward, not a float32
    [tokens, vocabulary] array; loss and gradients as the CPU's. Where the float32 copy
    is also returned, it is computed as written."""
    kept = forward_graph_outputs
    batch, length, width, vocab = 2, 16, 32, 256
    torch.manual_seed(0)
    cpu_head = nn.Linear(width, vocab)
    x = torch.randn(batch, length, width)
    target = torch.randint(0, vocab, (batch, length))
    target[0, :3] = -100  # ignored positions

    def upcast(logits):  # as gpt.py, and as Transformers' ForCausalLMLoss
        if cast == "float then view":
            return logits.float().view(-1, vocab)
        logits = logits.reshape(-1, vocab)
        return logits.float() if cast == "float" else logits.to(torch.float32)

    def loss_of(head, x, target, also_logits=False):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            logits = head(x)
        logits = upcast(logits)
        loss = F.cross_entropy(logits, target.reshape(-1), label_smoothing=0.1)
        return (loss, logits) if also_logits else loss

    for also_logits in (False, True):
        torch._dynamo.reset()
        kept.clear()
        expected = loss_of(cpu_head, x, target, also_logits)
        (expected[0] if also_logits else expected).backward()
        expected_grads = [p.grad for p in cpu_head.parameters()]
        head = copy.deepcopy(cpu_head).to("tpu")
        cpu_head.zero_grad()
        head.zero_grad()
        compiled = torch.compile(loss_of, backend="tpu")
        result = compiled(head, x.to("tpu"), target.to("tpu"), also_logits)
        (result[0] if also_logits else result).backward()
        assert_same(result, expected, rtol=1e-5, atol=1e-5)
        # As written, XLA may fold the logits' gradient's float32 -> bfloat16 rounding
        # into the head's backward matmul: bfloat16's tolerance.
        tolerance = dict(rtol=1.6e-2, atol=1e-3) if also_logits else dict(rtol=1e-5, atol=1e-6)
        assert_same([p.grad for p in head.parameters()], expected_grads, **tolerance)
        wide = [v for v in kept if v.dtype == torch.float32 and v.dim() == 2]
        assert bool(wide) == also_logits, [(tuple(v.shape), v.dtype) for v in kept]


def test_a_compiled_step_after_eager_steps_matches_cpu():
    """Eager steps make AdamW's state first, its ``step`` a 0-d CPU tensor; Dynamo
    moves it to the parameters' device when it compiles the step, as on CUDA."""
    losses, model, opt = _small_training("tpu", "adamw", compiled=True, eager_steps=2)
    expected, cpu_model, _ = _small_training("cpu", "adamw", compiled=False, eager_steps=2)
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    step = opt.state[next(model.parameters())]["step"]
    assert step.device.type == "tpu" and step.item() == 5
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-5)


def test_a_compiled_function_writes_a_cpu_counter_back(mode):
    """A 0-d CPU tensor the graph mutates is written back from the graph's result, a
    storage-less handle (AttributeError: no ``_storage`` before)."""
    counter = torch.tensor(0.0)

    @torch.compile(backend="tpu")
    def f(x, counter):
        counter.add_(1)
        return x * counter

    x = torch.ones(3, device="tpu")
    outs = [f(x, counter).cpu() for _ in range(3)]
    assert counter.device.type == "cpu" and counter.item() == 3
    assert [o.tolist() for o in outs] == [[1.0] * 3, [2.0] * 3, [3.0] * 3]


# -- torch.compile in DeferAndFuse: graphs join the step's chunk ------------------------


@pytest.mark.parametrize("name", MODELS)
def test_compiled_training_in_defer_mode_is_one_chunk_per_step(name):
    """Note [Compiled graphs in DeferAndFuse chunks]: from the second step on, the
    forward and backward graphs, the eager loss and the optimizer are recorded and run
    as one chunk per step; the model trains exactly as on the CPU."""
    make_model, make_batch, loss_fn, make_opt = MODELS[name]
    results = {}
    for device in ("cpu", "tpu"):
        torch.manual_seed(0)
        model = make_model().to(device)
        batch = [t.to(device) for t in make_batch()]
        opt = make_opt(model.parameters())
        run = torch.compile(model, backend="tpu") if device == "tpu" else model
        losses = []
        with torchtpu.set_eager_mode("defer" if device == "tpu" else "strict"):
            for step in range(5):
                if step == 3:
                    torchtpu.reset_metrics()
                opt.zero_grad()
                loss = loss_fn(run, *batch)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            metrics = torchtpu.metrics()  # of the last two steps
        results[device] = losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.testing.assert_close(
        torch.tensor(results["tpu"][0]), torch.tensor(results["cpu"][0]), rtol=0, atol=1e-5
    )
    for key, value in results["cpu"][1].items():
        torch.testing.assert_close(results["tpu"][1][key], value, rtol=1e-4, atol=5e-5)
    assert sum(metrics["flushes"].values()) == 2  # at the optimizer step or the loss's read
    assert metrics["compiled_calls"]["graph"] == 4  # forward and backward, each step
    assert metrics["chunk_cache"] == {"hit": 2}  # nothing compiled
    assert "compiles" not in metrics and "fallback" not in metrics


def test_queued_step_lets_go_of_the_replaced_parameters():
    """Once the optimizer replaced a parameter's array, the handle torch.compile cached
    of it is dropped by the write, so the chunk donates the old buffer (Note [Donating
    dead inputs])."""
    model = nn.Linear(64, 64).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="tpu")
    x = torch.randn(8, 64).to("tpu")
    with torchtpu.set_eager_mode("defer"):
        for _ in range(3):
            old = weakref.ref(torchtpu.dispatch.values.materialize(model.weight))
            opt.zero_grad()
            compiled(x).square().mean().backward()
            opt.step()
            torchtpu.sync()
    assert old() is None or old().is_deleted()  # freed, or its buffer donated


def _linear_then_cross_entropy(w, x, target):
    return F.cross_entropy(x @ w, target)


def test_value_check_in_a_queued_graph_is_raised_at_the_next_read():
    """A graph's check (a class label out of range) recorded in a chunk is raised as
    a check of an eager op is: at the next read, naming the op and the user's line."""
    compiled = torch.compile(_linear_then_cross_entropy, backend="tpu")
    w, x = torch.randn(4, 3).to("tpu"), torch.randn(2, 4).to("tpu")
    with torchtpu.set_eager_mode("defer"):
        compiled(w, x, torch.tensor([0, 2]).to("tpu")).item()  # traced and compiled
        loss = compiled(w, x, torch.tensor([0, 7]).to("tpu"))  # recorded
        assert torchtpu.dispatch.defer.pending_count() == 1
        with pytest.raises(IndexError, match="Target is out of bounds") as info:
            loss.item()
    notes = "\n".join(info.value.__notes__)
    assert "nll_loss" in notes and "test_compile.py" in notes


def test_dropout_in_a_queued_graph_draws_as_a_run_graph_does():
    """The RNG seed and offset of a recorded graph are inputs of its op: the numbers it
    draws are those the same call draws in Strict, and each call draws new ones."""
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5)).to("tpu")
    compiled = torch.compile(model, backend="tpu")
    x = torch.randn(8, 16).to("tpu")
    draws = {}
    for mode in ("strict", "defer"):
        torch.manual_seed(0)
        with torchtpu.set_eager_mode(mode):
            draws[mode] = [compiled(x).detach().cpu() for _ in range(3)]
    for strict, deferred in zip(draws["strict"], draws["defer"], strict=True):
        torch.testing.assert_close(deferred, strict)
    assert not torch.equal(draws["defer"][1] == 0, draws["defer"][2] == 0)


def test_graph_with_a_read_runs_at_once_in_defer_mode():
    """A graph that reads a value inside (segments.py) is not queued: it runs, with the
    queue's pending inputs computed first."""
    compiled = torch.compile(_item_then_shape, backend="tpu")
    x = torch.randn(6, 4)
    with torchtpu.set_eager_mode("defer"):
        for _ in range(2):
            pending = x.to("tpu") * 1  # queued
            for got, expected in zip(compiled(pending), _item_then_shape(x), strict=True):
                torch.testing.assert_close(got.cpu(), expected)


def test_graph_input_viewing_a_pending_value_in_defer_mode():
    """A graph argument that is a view of a value still queued (a shifted sequence, the
    gradient of a flattened output) is read by an op recorded in the same queue: the
    add, both reads and the graph run as one chunk."""
    compiled = torch.compile(lambda a, b: (a * b).sum(0), backend="tpu")
    x = torch.randn(4, 6)
    with torchtpu.set_eager_mode("defer"):
        for call in range(2):
            y = x.to("tpu") + 1
            result = compiled(y.t()[:5], y.t()[1:])
            if call:
                assert torchtpu.dispatch.defer.pending_count() == 4
            expected = (x + 1).t()
            torch.testing.assert_close(result.cpu(), (expected[:5] * expected[1:]).sum(0))


@pytest.mark.parametrize("buckets", ["pow2", "off"])
def test_new_input_shape_compiles_once_then_is_cached(buckets, monkeypatch):
    monkeypatch.setattr(torchtpu.config, "shape_buckets", buckets)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to("tpu")
    compiled = torch.compile(model, backend="tpu")

    def run(batches):
        with torch.no_grad():
            for batch in batches:
                x = torch.randn(batch, 8).to("tpu")
                torch.testing.assert_close(compiled(x).cpu(), model(x).cpu())
        return torchtpu.metrics()["compiles"]["graph"]

    # Batch 3 compiles a static graph; at batch 5 Dynamo retraces with symbolic sizes
    # (its automatic dynamic shapes), and that graph compiles once per bucket of sizes
    # (Note [Shape buckets]: 5 and 7 are padded to 8, 3 to 4) or, with buckets off, once
    # per concrete shape: 5, 7, then 3 again.
    compiles = 3 if buckets == "pow2" else 4  # pow2: 3, then 5 and 7 in 8, 3 in 4
    assert run([3, 5, 7, 3]) == compiles
    assert run([5, 7, 3, 5, 3, 7]) == compiles  # every shape is cached from then on


@pytest.mark.parametrize("buckets", ["pow2", "off"])
def test_dynamic_true_compiles_one_program_per_bucket_or_shape(buckets, monkeypatch):
    monkeypatch.setattr(torchtpu.config, "shape_buckets", buckets)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh()).to("tpu")
    compiled = torch.compile(model, backend="tpu", dynamic=True)
    with torch.no_grad():
        for batch in (5, 6, 5, 7, 20):
            x = torch.randn(batch, 8).to("tpu")
            torch.testing.assert_close(compiled(x).cpu(), model(x).cpu())
    # pow2: 5, 6 and 7 in a bucket of 8, 20 in 32
    assert torchtpu.metrics()["compiles"]["graph"] == (2 if buckets == "pow2" else 4)


def test_dynamic_true_trains_over_changing_batch_sizes(mode):
    """A function and a module compiled with dynamic=True, trained over batch sizes 2, 6
    and 3, match the CPU in every mode (DeferAndFuse raised ConcretizationTypeError)."""

    def f(x):
        return (x.sin() * 2).sum(0)

    compiled_f = torch.compile(f, backend="tpu", dynamic=True)
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    tpu = copy.deepcopy(cpu).to("tpu")
    compiled = torch.compile(tpu, backend="tpu", dynamic=True)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (cpu, tpu)]
    for batch in (2, 6, 3):
        x = torch.randn(batch, 4)
        torch.testing.assert_close(compiled_f(x.to("tpu")).cpu(), f(x))
        for model, x_, opt in ((cpu, x, optimizers[0]), (compiled, x.to("tpu"), optimizers[1])):
            loss = model(x_).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    for p_cpu, p_tpu in zip(cpu.parameters(), tpu.parameters()):
        torch.testing.assert_close(p_tpu.cpu(), p_cpu)


@pytest.mark.allow_fallback
def test_op_without_lowering_in_a_graph_raises_naming_it(monkeypatch):
    from torchtpu.dispatch import core as dispatch
    from torchtpu.dispatch import fallback

    monkeypatch.setitem(dispatch._HANDLERS, aten.tanh.default, fallback.run_on_cpu)
    compiled = torch.compile(lambda x: torch.tanh(x) * 2, backend="tpu")
    with pytest.raises(RuntimeError, match=r"aten\.tanh\.default: it has no tpu lowering"):
        compiled(torch.randn(3).to("tpu"))


def test_dropout_in_a_graph_draws_new_numbers_each_call():
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5)).to("tpu")
    compiled = torch.compile(model, backend="tpu")
    x = torch.randn(8, 16).to("tpu")
    a, b = compiled(x).detach().cpu(), compiled(x).detach().cpu()
    assert not torch.equal(a == 0, b == 0)
    assert 0.3 < (a == 0).float().mean() < 0.7


def test_value_read_in_a_compiled_function_is_a_graph_break_not_an_error():
    def f(x):
        y = x * 2
        if y.sum().item() > 0:  # branching on a value: Dynamo breaks the graph here
            return y + 1
        return y - 1

    x = torch.randn(5)
    compiled = torch.compile(f, backend="tpu")
    torch.testing.assert_close(compiled(x.to("tpu")).cpu(), f(x))


def _item_then_shape(x):
    n = (x > 0).sum().item()  # a number read from values, then used as a size
    return x * 2 + n, torch.zeros(n, device=x.device) + x.max().item()


def test_item_in_a_compiled_region_is_no_graph_break():
    """Note [Values read inside a compiled graph]: ``.item()`` is captured into the graph,
    which runs as a program, the reads on the host, and a program after them; a new
    value (here a new size) gives the right result."""
    torchtpu.reset_metrics()
    x = torch.randn(6, 4)
    result = _compiled_without_breaks(_item_then_shape, x.to("tpu"))
    for got, expected in zip(result, _item_then_shape(x), strict=True):
        torch.testing.assert_close(got.cpu(), expected)
    # one program before the read, one after; the float read that only feeds a tensor
    # op stays a tensor (AOTAutograd's graph adds the 0-d max itself): no read
    assert torchtpu.metrics()["compiles"]["graph"] == 2
    assert torchtpu.metrics()["graph_reads"] == {"aten._local_scalar_dense.default": 1}
    compiled = torch.compile(_item_then_shape, backend="tpu")
    for _ in range(2):
        x = torch.randn(6, 4)
        for got, expected in zip(compiled(x.to("tpu")), _item_then_shape(x), strict=True):
            torch.testing.assert_close(got.cpu(), expected)


def test_reads_that_do_not_depend_on_each_other_share_one_stop():
    """A MoE router's expert counts: every read that depends only on the first program
    is taken after it, then one program runs the rest (not a program per read)."""

    def f(x):
        sizes = [(x > t).sum().item() for t in (-1.0, 0.0, 1.0)]
        return torch.cat([x.flatten()[:s] * i for i, s in enumerate(sizes)])

    torchtpu.reset_metrics()
    x = torch.randn(6, 4)
    torch.testing.assert_close(_compiled_without_breaks(f, x.to("tpu")).cpu(), f(x))
    assert torchtpu.metrics()["compiles"]["graph"] == 2
    assert torchtpu.metrics()["graph_reads"] == {"aten._local_scalar_dense.default": 3}


def test_a_constant_of_the_graph_reaches_the_program_after_a_read():
    """A CPU tensor the graph holds (an index made inside the region) passes from the
    graph to the program after the read as part of its static description: new values
    read compile new programs, which JAX tells apart from the earlier ones."""

    def f(x):
        n = (x > 0).sum().item()
        return x.flatten()[: n + 2][torch.tensor([0, 1])] * 2

    compiled = torch.compile(f, backend="tpu")
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(4, 4)
        torch.testing.assert_close(compiled(x.to("tpu")).cpu(), f(x))


def test_slice_from_a_position_computed_from_a_read_value():
    """MPT's attention with a static cache: torch 2.13 raises PendingUnbackedSymbolNotFound
    tracing this on any backend unless its soft switch (set by the backend) is on."""

    def f(bias, length):
        start = max(0, bias.size(1) - (1 + length))
        return bias[:, start:, 3:] * 2

    bias, length = torch.randn(4, 16, 16), torch.tensor(5)
    compiled = torch.compile(f, backend="tpu")
    torch.testing.assert_close(compiled(bias.to("tpu"), length.to("tpu")).cpu(), f(bias, length))


def test_item_in_a_compiled_training_step_matches_cpu():
    def loss_of(w, x):
        scale = x.abs().max().item()
        return (torch.tanh(w * x / scale) ** 2).sum()

    w, x = torch.randn(5, requires_grad=True), torch.randn(5)
    w_tpu = w.detach().to("tpu").requires_grad_()
    loss = _compiled_without_breaks(loss_of, w_tpu, x.to("tpu"))
    loss.backward()
    expected = loss_of(w, x)
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach())
    torch.testing.assert_close(w_tpu.grad.cpu(), w.grad)


def test_assert_on_an_item_in_a_compiled_region_raises_when_false():
    """XLM's ``assert lengths.max().item() <= slen``: Dynamo makes it a runtime assert,
    checked after the value is read."""

    source = "def f(x, lengths):\n    assert lengths.max().item() <= x.shape[0]\n    return x + 1\n"
    namespace = {}
    exec(source, namespace)  # a plain assert: pytest rewrites those of this file
    compiled = torch.compile(namespace["f"], backend="tpu")
    x = torch.zeros(4).to("tpu")
    assert compiled(x, torch.tensor([2, 4]).to("tpu")).cpu().tolist() == [1.0] * 4
    with pytest.raises(RuntimeError, match="Runtime assertion failed"):
        compiled(x, torch.tensor([9]).to("tpu"))


def test_loading_the_backend_keeps_a_users_choice_of_capturing_items():
    code = (
        "import torch._dynamo, torchtpu.compile.backend;"
        "print(torch._dynamo.config.capture_scalar_outputs)"
    )
    for env, expected in ((None, "True"), ("0", "False")):
        environ = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_CAPTURE_SCALAR_OUTPUTS"}
        if env is not None:
            environ["TORCHDYNAMO_CAPTURE_SCALAR_OUTPUTS"] = env
        run = subprocess.run(
            [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
        )
        assert run.stdout.strip() == expected


def test_backend_rejects_unknown_options():
    with pytest.raises(Exception, match="takes no options"):
        torch.compile(lambda x: x + 1, backend="tpu", options={"foo": 1})(torch.ones(2).to("tpu"))


# -- torchtpu.jit ---------------------------------------------------------------------


def _square_loss_step(model, opt):
    def step(x):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    return step


@pytest.mark.parametrize("name", MODELS)
def test_jit_training_matches_cpu(name):
    # Adam's capturable form computes its bias corrections in float32 on the device,
    # not in Python floats: its states differ from the CPU's in the last digits.
    tolerance = {} if name == "mlp" else dict(loss_atol=5e-5, state_rtol=1e-3, state_atol=1e-4)
    _assert_trains_like_cpu(name, 5, wrap_step=torchtpu.jit, **tolerance)
    metrics = torchtpu.metrics()
    assert metrics["compiles"]["step"] == 1
    assert metrics["compiled_calls"]["step"] == 4  # the first call runs eagerly
    assert "fallback" not in metrics


def test_jit_in_every_mode(mode):
    def run(device, jit):
        torch.manual_seed(0)
        model = nn.Linear(4, 2).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).to(device)

        step = _square_loss_step(model, opt)
        step = torchtpu.jit(step) if jit else step
        return [step(x).item() for _ in range(4)]

    torch.testing.assert_close(run("tpu", True), run("cpu", False))


@pytest.mark.parametrize("mode", ["strict", "debug"])
def test_jit_first_call_runs_fused_unless_debugging(mode):
    """Note [The first call runs fused] (jit.py): in Strict, the eager first call runs as
    DeferAndFuse chunks, not a program per op; Debug keeps its op-by-op errors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torchtpu.jit(_square_loss_step(model, opt))
    x = torch.randn(8, 4).to("tpu")
    torchtpu.reset_metrics()
    with torchtpu.set_eager_mode(mode):
        step(x).item()
        assert modes.current() is modes.to_mode(mode)  # given back
    compiles = torchtpu.metrics()["compiles"]
    if mode == "strict":
        assert compiles.get("op", 0) == 0 and compiles["chunk"] >= 1
    else:
        assert compiles["op"] >= 8 and "chunk" not in compiles


def test_jit_state_is_what_outlives_the_step(mode):
    """The program's state is what outlives the first (eager) call and the step reads:
    the parameters and the optimizer's state -- not the activations and other
    temporaries it also touched (kept alive by the watch, they were state too), nor
    the first call's gradients, which the step's zero_grad drops."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    model = model.to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torchtpu.jit(_square_loss_step(model, opt))
    x = torch.randn(8, 4).to("tpu")
    step(x).item()
    params = list(model.parameters())
    for _ in range(2):
        step(x).item()
    expected = {id(p._storage) for p in params}
    for p in params:
        expected |= {id(v._storage) for v in opt.state[p].values()}  # moments, step
    assert {id(s) for s in step._state} == expected
    assert len(step._state) == 4 * len(params)
    per_parameter = sum(p.numel() * p.element_size() for p in params)
    state_bytes = sum(math.prod(s.shape) * s.dtype.itemsize for s in step._state)
    assert state_bytes == 3 * per_parameter + 4 * len(params)


def test_jit_replay_drops_last_steps_gradients_before_it_runs(monkeypatch):
    """Note [The step's own tensors are released before it runs]: when a replay
    launches, last step's gradients (which its zero_grad() drops) are no longer alive
    beside the ones it makes. A replay that fails leaves those parameters without a
    gradient, as an eager step failing past its zero_grad(), and the next call makes
    them again: the losses are the CPU's without the failed step."""
    from torchtpu.compile import program

    live_at_launch, fail = [], [False]
    call = program.Program.__call__

    def launch(self, static, arrays, device=0):
        jax.effects_barrier()
        live_at_launch.append(sum(a.nbytes for a in jax.live_arrays()))
        if fail[0]:
            raise RuntimeError("the device gave up")
        return call(self, static, arrays, device)

    monkeypatch.setattr(program.Program, "__call__", launch)

    def run(device, jit):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(device)
        step = _square_loss_step(model, opt)
        return model, (torchtpu.jit(step) if jit else step), x

    model, step, x = run("tpu", True)
    losses = [step(x).item() for _ in range(3)]  # eager, traced, replayed
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    jax.effects_barrier()
    before = sum(a.nbytes for a in jax.live_arrays())
    losses.append(step(x).item())
    assert live_at_launch[-1] <= before - grad_bytes + x.numel() * x.element_size()

    fail[0] = True
    with pytest.raises(RuntimeError, match="the device gave up"):
        step(x)
    assert all(p.grad is None for p in model.parameters())
    fail[0] = False
    losses.append(step(x).item())
    assert all(p.grad is not None for p in model.parameters())

    cpu_model, cpu_step, cpu_x = run("cpu", False)
    expected = [cpu_step(cpu_x).item() for _ in range(5)]
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-6)


def test_jit_step_that_accumulates_gradients_keeps_them_as_state():
    """Without zero_grad the step reads the gradients: tracing finds them and takes
    them as state, and the sums match the CPU's."""

    def run(device, jit):
        torch.manual_seed(0)
        model = nn.Linear(4, 2).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).to(device)

        def step(x):
            loss = model(x).square().mean()
            loss.backward()  # accumulates: no zero_grad
            opt.step()
            return loss

        step = torchtpu.jit(step) if jit else step
        losses = [step(x).item() for _ in range(4)]
        return losses, model.weight.grad.cpu()

    (losses, grad), (expected, expected_grad) = run("tpu", True), run("cpu", False)
    torch.testing.assert_close(losses, expected)
    torch.testing.assert_close(grad, expected_grad)


def test_jit_gradients_dropped_between_calls_come_back():
    """``zero_grad()`` outside the step sets every ``.grad`` to None; each call's
    backward() makes them again, traced and replayed calls too."""

    def run(device, jit):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(device)
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1)).to(device)

        def step(x, scale):
            loss = model(x * scale).square().mean()
            loss.backward()
            return loss

        step = torchtpu.jit(step) if jit else step
        grads = []
        for i in range(4):
            model.zero_grad(set_to_none=True)
            step(x, 1.0 + i)
            grads.append([p.grad.cpu() for p in model.parameters()])
        return grads

    for actual, expected in zip(run("tpu", True), run("cpu", False)):
        torch.testing.assert_close(actual, expected)


def test_jit_step_may_make_tensors_from_host_values():
    model = nn.Linear(4, 2).to("tpu")

    @torchtpu.jit
    def step(x):
        return model(x) * torch.tensor([2.0, -1.0], device="tpu") + torch.ones(2, device="tpu")

    x = torch.randn(3, 4)
    expected = model.cpu()(x) * torch.tensor([2.0, -1.0]) + 1
    model.to("tpu")
    for _ in range(3):
        torch.testing.assert_close(step(x.to("tpu")).detach().cpu(), expected.detach())
    assert torchtpu.metrics()["compiles"]["step"] == 1


def test_jit_replays_without_running_python_ops():
    model = nn.Linear(4, 2).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    step = torchtpu.jit(_square_loss_step(model, opt))
    x = torch.randn(3, 4).to("tpu")
    step(x), step(x)
    ops_before = sum(torchtpu.metrics()["ops"].values())
    step(x)
    assert sum(torchtpu.metrics()["ops"].values()) == ops_before


def test_jit_number_arguments_are_inputs():
    @torchtpu.jit
    def scale(x, factor):
        return x * factor + 1

    x = torch.randn(4)
    for factor in (2.0, 3.0, 0.5, 4.0):
        torch.testing.assert_close(scale(x.to("tpu"), factor).cpu(), x * factor + 1)
    assert torchtpu.metrics()["compiles"]["step"] == 1


def test_jit_static_argument_is_part_of_the_key():
    @torchtpu.jit(static_argnums=(1,))
    def power(x, n):
        for _ in range(n):
            x = x * 2
        return x

    x = torch.ones(2)
    for n in (1, 2, 3, 2):
        power(x.to("tpu"), n)
        torch.testing.assert_close(power(x.to("tpu"), n).cpu(), x * 2**n)
    assert torchtpu.metrics()["compiles"]["step"] == 3


def test_jit_follows_a_changing_learning_rate():
    """A scheduler changes lr between steps: each value is a new program, never a stale one."""

    def run(device, jit):
        torch.manual_seed(0)
        model = nn.Linear(4, 1).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)).to(device)

        step = _square_loss_step(model, opt)
        step = torchtpu.jit(step) if jit else step
        losses = []
        for _ in range(4):
            losses.append(step(x).item())
            sched.step()
        return losses, model.weight.detach().cpu()

    (tpu_losses, tpu_w), (cpu_losses, cpu_w) = run("tpu", True), run("cpu", False)
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses))
    torch.testing.assert_close(tpu_w, cpu_w)


def test_jit_dropout_draws_new_numbers_each_call():
    drop = nn.Dropout(0.5)
    step = torchtpu.jit(lambda x: drop(x))
    x = torch.ones(64).to("tpu")
    masks = [step(x).cpu() == 0 for _ in range(4)]
    assert not torch.equal(masks[2], masks[3])  # both replays of the compiled program


def test_jit_value_read_inside_raises_clearly():
    @torchtpu.jit
    def f(x):
        return x * x.sum().item()

    x = torch.randn(3).to("tpu")
    f(x)  # the first call runs eagerly
    with pytest.raises(RuntimeError, match="reading a tensor's values"):
        f(x)


def test_jit_refuses_an_in_place_write_to_an_argument():
    @torchtpu.jit
    def f(x):
        x.add_(1)
        return x.sum()

    x = torch.zeros(3).to("tpu")
    f(x)
    with pytest.raises(RuntimeError, match="wrote to one of its tensor arguments"):
        f(x)


def test_error_in_backward_is_raised_not_aborted(monkeypatch):
    """Note [Why backward errors are deferred]: the error surfaces at the next op."""
    from torchtpu.dispatch import core as dispatch

    def broken(func, args, kwargs):
        raise ValueError("lowering failed")

    x = torch.randn(3).to("tpu").requires_grad_()
    y = x.sin().sum()
    monkeypatch.setitem(dispatch._HANDLERS, aten.cos.default, broken)
    y.backward()
    monkeypatch.undo()
    with pytest.raises(ValueError, match="lowering failed"):
        torch.ones(1, device="tpu") + 1
    (torch.ones(1, device="tpu") + 1).cpu()  # raised once; the device works on


def test_error_in_a_compiled_backward_is_raised_not_aborted(monkeypatch):
    from torchtpu.dispatch import core as dispatch

    def broken(func, args, kwargs):
        raise ValueError("lowering failed")

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).to("tpu")
    compiled = torch.compile(model, backend="tpu")
    # The backward graph is traced ahead, at the forward's first call (Note [Compiling
    # the backward while the forward compiles]); failing there, it is traced again at
    # its own first call, inside backward(), and raises there.
    monkeypatch.setitem(dispatch._HANDLERS, aten.threshold_backward.default, broken)
    loss = compiled(torch.randn(2, 4).to("tpu")).sum()
    loss.backward()
    monkeypatch.undo()
    with pytest.raises(ValueError, match="lowering failed"):
        model[0].weight.grad.cpu()


def test_several_tensor_arguments_and_attributes():
    class Holder:
        pass

    holder = Holder()
    holder.k = torch.full((1, 4), 3).to("tpu")
    a, b = torch.ones(1, 4, dtype=torch.long).to("tpu"), torch.arange(4).view(1, 4).to("tpu")
    compiled = torch.compile(lambda x, y: x + y * holder.k, backend="tpu")
    assert compiled(a, b).cpu().tolist() == [[1, 4, 7, 10]]
    assert compiled(x=b, y=a).cpu().tolist() == [[3, 4, 5, 6]]
    a.add_(1)  # a new value of an argument: the next call reads it
    assert compiled(a, b).cpu().tolist() == [[2, 5, 8, 11]]


def _compiled_without_breaks(fn, *args):
    """fn compiled with the tpu backend, run once: its result; asserts one graph."""
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    return torch.compile(fn, backend="tpu")(*args)


@pytest.mark.parametrize("data", [[], 1.5, [[1.0, -2.0, 3.0]]])
def test_tensor_made_from_data_inside_a_compiled_region(data):
    """``torch.tensor(data, device=x.device)`` inside the region (Transformers'
    DynamicCache starts each layer's cache as ``torch.tensor([], device=...)``): torch
    made a real tpu tensor, which the fake mode took as an unknown subclass (a graph
    break per layer, or an error). Note [Tracing never makes a real tpu tensor]."""

    def f(x):
        t = torch.tensor(data, dtype=x.dtype, device=x.device)
        return torch.cat([t.reshape(-1), (x * 2).reshape(-1)]) + t.sum()

    x = torch.randn(2, 3)
    torch.testing.assert_close(_compiled_without_breaks(f, x.to("tpu")).cpu(), f(x))


def test_cpu_constant_moved_to_tpu_inside_a_compiled_region():
    """A small CPU tensor made in the region and moved to tpu (Transformers' sliding
    window cache: ``torch.tensor(window).to(device)``): the fake mode ran the move for
    real to keep a constant, and failed on the real tpu tensor it got."""

    def f(x):
        window = torch.tensor(2)
        return torch.minimum(x, window.to(x.device)) * 3

    x = torch.randn(2, 3) * 4
    torch.testing.assert_close(_compiled_without_breaks(f, x.to("tpu")).cpu(), f(x))


def test_empty_tensor_argument_to_a_compiled_region():
    """Fakifying an empty tensor resizes its storage to 0 bytes, which a tpu storage
    cannot do (no C++ PrivateUse1 hooks): traced wrappers of empty tensors report a
    meta storage."""

    def f(x, y):
        return torch.cat([x, y * 2])

    x, y = torch.randn(0, 3), torch.randn(2, 3)
    result = _compiled_without_breaks(f, x.to("tpu"), y.to("tpu"))
    torch.testing.assert_close(result.cpu(), f(x, y))


def test_functional_copy_from_a_cpu_tensor():
    """``aten.copy`` (AOTAutograd's functional ``copy_``) takes a source on another
    device, as ``copy_`` does."""
    dst, src = torch.zeros(2, 3), torch.randn(2, 3, dtype=torch.float64)
    expected = aten.copy.default(dst, src)
    torch.testing.assert_close(aten.copy.default(dst.to("tpu"), src).cpu(), expected)
    back = aten.copy.default(dst, src.to("tpu"))
    assert back.device.type == "cpu"
    torch.testing.assert_close(back, expected)


def test_grouped_mm_in_float32_in_a_compiled_region():
    """torch's meta kernel of ``_grouped_mm`` takes only bfloat16 (a CUDA limit), so
    tracing the float32 product of a mixture-of-experts layer failed; tpu tensors get
    a fake kernel of their own (compile/fake_kernels.py)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 4, generator=g), torch.randn(3, 4, 8, generator=g)
    offs = torch.tensor([2, 5, 6], dtype=torch.int32)

    def f(x, w, offs):
        return torch._grouped_mm(x, w, offs=offs) * 2

    expected = f(x, w, offs)
    result = _compiled_without_breaks(f, x.to("tpu"), w.to("tpu"), offs.to("tpu"))
    torch.testing.assert_close(result.cpu(), expected)


def test_tensor_made_in_a_region_leaves_it_as_a_tpu_tensor():
    """A factory's result inside the region, returned or live across a graph break
    (MPT's ALiBi bias under generate()'s compiled decoding), used to leave as a bare
    handle: a tpu tensor with no data, on which the next eager op failed."""

    def f(x):
        bias = torch.arange(4.0, device=x.device)
        y = x + bias
        torch._dynamo.graph_break()
        return bias * 2, y[1:]

    x = torch.randn(4)
    bias, y = torch.compile(f, backend="tpu")(x.to("tpu"))
    assert type(bias) is type(y) is torchtpu.TPUTensor
    torch.testing.assert_close((bias[1:] + y).cpu(), torch.arange(4.0)[1:] * 2 + f(x)[1])


def test_assert_on_a_tensor_in_a_compiled_region():
    """torch._assert_async (Dynamo's form of ``assert`` on a tensor; DBRX's MoE routing
    asserts one) is a value check of the compiled program, not a CPU fallback, which
    a compiled program cannot run."""

    def f(x):
        torch._assert_async((x > 0).all(), "x must be positive")
        return x * 2

    compiled = torch.compile(f, backend="tpu")
    assert compiled(torch.ones(3).to("tpu")).cpu().tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(RuntimeError, match="x must be positive"):
        compiled(-torch.ones(3).to("tpu")).cpu()


def test_result_viewing_part_of_an_intermediate():
    """A compiled result with strides that skip elements (a slice of an intermediate,
    as RecurrentGemma's conv state): its storage spans the strides, so its address can
    be taken and a second compiled region can take it as an input."""
    x = torch.randn(2, 8, 4)
    y = torch.compile(lambda a: (a * 2)[..., :3], backend="tpu")(x.to("tpu"))
    if _compat.torch_at_least(2, 14):
        # torch 2.14's AOTAutograd takes a tensor subclass output's strides from its
        # inner tensor when they matched at trace time (outer_stride_from_attr), and a
        # compiled graph's inner handles are contiguous: the slice comes back contiguous.
        assert y.stride() == (24, 3, 1)
    else:
        assert y.stride() == (32, 4, 1)
    span = 1 + sum((n - 1) * s for n, s in zip(y.shape, y.stride()))
    assert y.untyped_storage().nbytes() >= span * 4
    z = torch.compile(lambda a: a + 1, backend="tpu")(y)
    torch.testing.assert_close(z.cpu(), (x * 2)[..., :3] + 1)


def test_view_after_a_write_into_a_view_in_a_compiled_region():
    """Note [Views in a compiled graph]: functionalization gives the written tensor
    (a slice_scatter) the strides of the tensor written to; run for real it is
    contiguous, so a view the trace allowed was impossible (Funnel's attention)."""

    def f(a):
        b = (a * 1).view(4, 2, 8, 16).permute(1, 0, 2, 3)
        d = b.reshape(2, 4, 16, 8)[:, :, 1:].reshape(2, 4, 8, 15)
        d[..., :8] *= 2
        return b.reshape(2, 4, 8, 16, 1).permute(1, 0, 2, 4, 3).reshape(4, 16, 16)

    x = torch.randn(4, 2, 8, 16)
    torch.testing.assert_close(torch.compile(f, backend="tpu")(x.to("tpu")).cpu(), f(x))


def test_masked_assignment_in_a_compiled_region():
    """``x[mask] = v`` stays one index_put in a graph (its shape is static); turning the
    mask into integer indices (nonzero) made the program's shapes depend on values
    (Longformer's attention mask). A mask and a broadcast value are a where()."""

    def f(x, m):
        y = x * 2
        y[y > 0] = 0.0
        y.index_put_((m,), torch.tensor([1.0, 2.0, 3.0], device=x.device), accumulate=True)
        return y

    x, m = torch.randn(4, 3), torch.tensor([True, False, True, True])
    result = _compiled_without_breaks(f, x.to("tpu"), m.to("tpu"))
    torch.testing.assert_close(result.cpu(), f(x, m))


def test_eager_code_between_graphs_adds_no_graph_break():
    """Behind a real graph break the op runs eagerly, and JAX logs as it compiles it:
    Dynamo took that logging call for a frame to compile and counted a second break
    ("logging.Logger method not supported"). Only the model's own break counts."""
    from torch._dynamo.utils import counters

    counters.clear()
    x, m = torch.randn(5, 7), torch.rand(5) > 0.5  # shapes no other test compiles

    def f(x, m):
        return x[m] * 2  # a boolean mask: a data-dependent shape, a graph break

    torch.testing.assert_close(
        torch.compile(f, backend="tpu")(x.to("tpu"), m.to("tpu")).cpu(), f(x, m)
    )
    reasons = [reason.splitlines()[0] for reason in counters["graph_break"]]
    assert reasons == ["Dynamic shape operator"], reasons


def test_a_backward_whose_compile_ahead_failed_raises_its_error(monkeypatch):
    """A backward program compiled ahead on a worker thread (Note [Compiling the backward
    while the forward compiles]) that failed there is compiled again by its first call,
    which raises the error where the user reads the gradient: never swallowed, no hang.
    Its graph (the gradient of a pointwise op, broadcast) has no product, so it compiles
    with ``config.op_compiler_options``, here an option XLA does not know; the forward
    (a sum) keeps XLA's defaults and runs."""
    from torchtpu.compile import backend

    monkeypatch.setattr(torchtpu.config, "op_compiler_options", {"no_such_option": 1})
    monkeypatch.setattr(backend, "AHEAD_MIN_OPS", 1)
    torch._dynamo.reset()
    x = torch.randn(3, 23)
    a = x.to("tpu").requires_grad_()
    out = torch.compile(lambda t: t.tanh().sum(dim=1), backend="tpu")(a)
    torch.testing.assert_close(out.cpu(), x.tanh().sum(dim=1))
    out.backward(torch.ones(3).to("tpu"))  # no eager op: they too take those options
    with pytest.raises(Exception, match="no_such_option"):
        a.grad.cpu()
