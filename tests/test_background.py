"""Note [Strict compiles in the background] (dispatch/background.py): Strict hands its
programs' compiles to worker threads and queues the ops that wait for them; values,
errors and later steps are as when each op compiled before it returned."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu import config
from torchtpu.dispatch import background
from torchtpu.dispatch.pending import Pending


@pytest.fixture(autouse=True)
def _strict():
    with torch.tpu.set_eager_mode("strict"):
        yield
    torch.tpu.synchronize()


def _compiles() -> int:
    return torchtpu.metrics().get("compiles", {}).get("op", 0)


def _queued_runs() -> int:
    return sum(torchtpu.metrics().get("background_runs", {}).values())


@pytest.fixture
def gate(monkeypatch):
    """Compiles wait until the test opens the gate: what is queued is then known."""
    opened = threading.Event()
    compile_now = background._compile

    def held(*args):
        assert opened.wait(60), "the test never opened the gate"
        return compile_now(*args)

    monkeypatch.setattr(background, "_compile", held)
    yield opened
    opened.set()


def _model_and_batch(width):
    """A small MLP and a batch (shapes of ``width``, so each test compiles its own
    programs), made on the CPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width), torch.nn.ReLU(), torch.nn.Linear(2 * width, 5)
    )
    return model, torch.randn(8, width), torch.randint(0, 5, (8,))


def _train(device, width, steps=3, made=None):
    """The MLP's AdamW steps on ``device``: the losses, final weights and programs
    compiled so far after each step."""
    model, x, y = made or _model_and_batch(width)
    model, x, y = model.to(device), x.to(device), y.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, compiled = [], []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        compiled.append(_compiles())
    return losses, [p.detach().cpu() for p in model.parameters()], compiled


def test_a_first_step_compiles_in_the_background_and_later_steps_compile_nothing():
    torchtpu.reset_metrics()
    losses, weights, compiled = _train("tpu", 37)
    expected_losses, expected_weights, _ = _train("cpu", 37)
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(weights, expected_weights):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert _queued_runs() >= 1  # the first step's ops waited in a queue
    # The programs it compiled are the ones every later step runs (the optimizer's
    # in-place updates donate the same buffers in the first step as in the others).
    assert compiled[0] >= 15 and compiled[1] == compiled[2] == compiled[0]
    assert background.queued == 0 and not background._compiling


def test_it_compiles_the_same_programs_as_compiling_in_the_call(monkeypatch):
    torchtpu.reset_metrics()
    _, weights, compiled = _train("tpu", 41, steps=2)
    monkeypatch.setattr(config, "background_compiles", False)
    torchtpu.reset_metrics()
    _, weights_off, compiled_off = _train("tpu", 43, steps=2)
    assert compiled == compiled_off
    assert _queued_runs() == 0


def test_an_op_waits_in_the_queue_only_for_a_compile_or_a_queued_input(gate):
    a = torch.randn(6, 29)
    gate.set()
    x = a.to("tpu")
    (x * 3).cpu()  # compiled and run before the gate closes
    gate.clear()
    torchtpu.reset_metrics()
    y = x.cumsum(1)  # a program no test compiled: it compiles on a worker, held
    z = y * 3  # compiled already, but its input is queued: queued too
    w = x * 3  # compiled, its input computed: runs now
    assert type(y._storage.array) is Pending and type(z._storage.array) is Pending
    assert type(w._storage.array) is not Pending
    assert background.queued == 1
    gate.set()
    torch.testing.assert_close(z.cpu(), a.cumsum(1) * 3)  # the read waits for the compile
    torch.testing.assert_close(y.cpu(), a.cumsum(1))
    torch.testing.assert_close(w.cpu(), a * 3)
    assert background.queued == 0
    assert torchtpu.metrics()["background_runs"] == {"value read": 1}
    assert _compiles() == 1


def test_in_place_ops_on_queued_values_write_where_the_cpu_writes(gate):
    a = torch.randn(5, 31)
    x = a.to("tpu")
    y = x.cumprod(1)  # held at the gate
    view = y[1:3]
    view.add_(1)  # writes through a view of a queued value
    y.mul_(2)
    expected = a.cumprod(1)
    expected[1:3] += 1
    expected *= 2
    gate.set()
    torch.testing.assert_close(y.cpu(), expected)
    torch.testing.assert_close(view.cpu(), expected[1:3])
    torch.testing.assert_close(x.cpu(), a)


def test_a_failed_compile_raises_at_the_read_naming_the_op_and_its_line(monkeypatch):
    compile_now = background._compile

    def fails(lowered, op, where):
        if op == "aten.cumsum.default":
            raise RuntimeError("XLA refused to compile")
        return compile_now(lowered, op, where)

    monkeypatch.setattr(background, "_compile", fails)
    x = torch.ones(3, 37, device="tpu")
    y = x.cumsum(0)
    line = sys._getframe().f_lineno - 1
    z = y + 1
    with pytest.raises(RuntimeError, match="XLA refused to compile") as info:
        z.cpu()
    notes = "\n".join(info.value.__notes__)
    assert "aten.cumsum.default" in notes and f"{__file__}:{line}" in notes
    with pytest.raises(RuntimeError, match="never computed"):
        y.cpu()  # the queue's values hold the error: none is left half-computed
    monkeypatch.undo()
    torch.testing.assert_close(x.cumsum(0).cpu(), torch.ones(3, 37).cumsum(0))  # compiles again
    assert background.queued == 0


def test_synchronize_waits_for_every_queued_op(gate):
    x = torch.ones(7, 23, device="tpu")
    y = x.cumsum(1)
    assert background.queued == 1
    gate.set()
    torch.tpu.synchronize()
    assert background.queued == 0 and y._storage.array.value is not None  # run, not read


def test_turned_off_an_op_compiles_before_it_returns(monkeypatch):
    monkeypatch.setattr(config, "background_compiles", False)
    x = torch.ones(9, 19, device="tpu")
    torchtpu.reset_metrics()
    y = x.cumsum(1)
    assert type(y._storage.array) is not Pending and _compiles() == 1
    assert background.queued == 0


def test_debug_mode_compiles_each_op_before_it_returns():
    with torch.tpu.set_eager_mode("debug"):
        x = torch.ones(9, 17, device="tpu")
        torchtpu.reset_metrics()
        y = x.cumsum(1)
        assert type(y._storage.array) is not Pending and _compiles() == 1
    assert _queued_runs() == 0


def test_threads_training_at_once_each_match_the_cpu():
    results = {}
    made = {width: _model_and_batch(width) for width in (47, 53)}  # torch's RNG: one thread

    def train(width):
        results[width] = _train("tpu", width, steps=2, made=made[width])

    threads = [threading.Thread(target=train, args=(w,)) for w in (47, 53)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for width in (47, 53):
        losses, weights, _ = results[width]
        expected_losses, expected_weights, _ = _train("cpu", width, steps=2)
        torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-6)
        for got, want in zip(weights, expected_weights):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_how_many_compile_at_once(monkeypatch):
    monkeypatch.setattr(config, "compile_threads", 3)
    assert background.threads() == 3
    monkeypatch.setattr(config, "compile_threads", 0)
    assert 1 <= background.threads() <= 4


def test_the_op_compiler_options_reach_its_compiles(monkeypatch):
    x = torch.ones(7, 11, device="tpu")
    monkeypatch.setattr(config, "op_compiler_options", {"no_such_option": 1})
    y = x * 3.5  # a new program, compiled on a worker with the options
    with pytest.raises(Exception, match="no_such_option"):
        y.cpu()
