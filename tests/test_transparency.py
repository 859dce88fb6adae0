"""Nothing slow is silent: recompile and flush warnings, explain(), metrics, and the
persistent compilation cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import torchtpu
from torchtpu import config
from torchtpu.observe import perf_warnings


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    perf_warnings.reset()
    monkeypatch.setattr(config, "recompile_warn_after", 4)
    monkeypatch.setattr(config, "flush_warn_after", 5)
    yield
    perf_warnings.reset()


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if issubclass(w.category, torchtpu.TPUPerformanceWarning)]


def test_recompiling_line_warns_once_naming_the_change_and_the_line():
    # Shapes no other test sums (a plan cached already would shift the count).
    xs = [torch.ones(n, 7).to("tpu") for n in range(1, 9)]

    def loop():
        for x in xs:
            x.sum().item()  # the line that recompiles

    caught = _caught(loop)
    assert len(caught) == 1
    w = caught[0]
    assert w.category is torchtpu.TPURecompileWarning
    assert w.filename == __file__
    assert "keeps compiling aten.sum.default" in str(w.message)
    assert "argument `self`: float32[3, 7] -> float32[4, 7]" in str(w.message)
    assert _caught(loop) == []  # once per line


def test_constant_change_is_named():
    x = torch.ones(4, 4, 4, 4, device="tpu")

    def loop():
        for dim in range(4):
            x.sum(dim).cpu()

    (w,) = _caught(loop)
    assert "argument `dim`: the constant (2,) -> the constant (3,)" in str(w.message)


def test_stable_shapes_and_changing_floats_do_not_warn():
    x = torch.ones(8, 8, device="tpu")

    def loop():
        for step in range(20):
            (x * (0.1 * step) + step).sum().item()


def test_many_shapes_compiled_once_each_do_not_warn():
    # opt.step() compiles add_ once per parameter shape, then reuses them.
    params = [torch.zeros(n, 2).to("tpu") for n in range(1, 20)]

    def loop():
        for _ in range(10):
            for p in params:
                p.add_(1.0)
            params[0].sum().item()

    assert _caught(loop) == []

    assert _caught(loop) == []


def test_a_first_step_compiling_many_shapes_once_each_does_not_warn():
    """A first step may compile one op in many shapes from one line (a MobileNet's
    model(x): 64 batch norms); later steps compile none. No warning: the compiles are
    all in the step's first epoch (it warned "keeps compiling" at 8 x the limit)."""
    norms = [torch.nn.BatchNorm1d(c).to("tpu") for c in range(1, 41)]  # 40 shapes
    xs = [torch.randn(4, c).to("tpu") for c in range(1, 41)]
    opt = torch.optim.SGD([p for n in norms for p in n.parameters()], lr=0.1)

    def steps():
        for _ in range(3):
            loss = sum(norm(x).square().mean() for norm, x in zip(norms, xs))  # one line
            loss.backward()
            opt.step()
            opt.zero_grad()
        loss.item()

    assert [w for w in _caught(steps) if w.category is torchtpu.TPURecompileWarning] == []


@pytest.mark.parametrize("eager_mode", ["strict", "defer"])
def test_initialising_parameters_of_many_shapes_from_one_line_does_not_warn(eager_mode):
    """TorchTitan initialises each parameter from one line with nn.init.trunc_normal_,
    whose rejection loop reads ``mask.any()``: torch's own reads, which end no epoch for
    that line (Note [What counts as recompiling]); each shape compiles once. It warned
    "keeps compiling aten.normal_.default" after 8 shapes (in DeferAndFuse "a
    DeferAndFuse chunk": the flush before the read counted as an epoch of its own)."""
    params = [torch.empty(n, 3, device="tpu") for n in range(1, 13)]

    def init():
        with torch.tpu.set_eager_mode(eager_mode):
            for p in params:
                torch.nn.init.trunc_normal_(p, std=0.02)  # one line, a new shape each time

    assert [w for w in _caught(init) if w.category is torchtpu.TPURecompileWarning] == []
    assert all(p.abs().max().item() <= 2.0 for p in params)  # trunc_normal_'s bounds


def test_a_line_compiling_in_every_step_warns_without_reads():
    """Steps end at optimizer.step() too: a loop that never reads a value but compiles a
    new shape in every step warns."""
    w = torch.zeros(3, device="tpu", requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)

    def steps():
        for n in range(1, 9):
            (torch.ones(n, 3, device="tpu") * w).sum().backward()  # a new shape each step
            opt.step()
            opt.zero_grad()

    caught = [x for x in _caught(steps) if x.category is torchtpu.TPURecompileWarning]
    assert len(caught) == 1 and caught[0].filename == __file__


def test_deferred_chunk_recompiles_warn_with_the_op_that_changed():
    xs = [torch.ones(n, 2).to("tpu") for n in range(1, 7)]

    def loop():
        with torch.tpu.set_eager_mode("defer"):
            for x in xs:
                (x * 2).sum().item()

    caught = [w for w in _caught(loop) if w.category is torchtpu.TPURecompileWarning]
    assert len(caught) == 1
    assert "DeferAndFuse chunk" in str(caught[0].message)
    message = str(caught[0].message)
    assert (
        "op #1 of the chunk (aten.mul.Tensor): argument `self`: float32[3, 2] -> float32[4, 2]"
        in message
    )
    assert caught[0].filename == __file__


def test_flushing_every_step_from_one_line_warns():
    x = torch.ones(4, device="tpu")

    def loop():
        with torch.tpu.set_eager_mode("defer"):
            for _ in range(10):
                (x + 1).sum().item()

    caught = [w for w in _caught(loop) if w.category is torchtpu.TPUFlushWarning]
    assert len(caught) == 1
    assert caught[0].filename == __file__
    assert "loss.item() every N steps" in str(caught[0].message)


def test_chunk_compiles_taking_most_of_the_time_warn_once(monkeypatch):
    monkeypatch.setattr(config, "compile_warn_seconds", 0.0)
    xs = [torch.ones(n, 3).to("tpu") for n in range(1, 7)]

    def loop():
        with torch.tpu.set_eager_mode("defer"):
            for x in xs:  # a new shape each time: every flush compiles a chunk
                (x * 2 + 1).exp().sum().item()

    caught = [w for w in _caught(loop) if w.category is torchtpu.TPUCompileTimeWarning]
    assert len(caught) == 1
    assert issubclass(torchtpu.TPUCompileTimeWarning, torchtpu.TPUPerformanceWarning)
    assert "compiling 3 chunks" in str(caught[0].message)
    assert caught[0].filename == __file__


def test_a_training_loops_first_steps_compiling_do_not_warn(monkeypatch):
    # Note [Compiling while warming up]: the first step compiles its chunks (several:
    # a small defer_max_ops cuts it) and the second its optimizer's; later steps reuse
    # them. (Counted from the first step, this warned in the first step.)
    monkeypatch.setattr(config, "compile_warn_seconds", 0.0)
    monkeypatch.setattr(config, "defer_max_ops", 6)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 11), torch.nn.Tanh(), torch.nn.Linear(11, 3)
    ).to("tpu")
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(9, 5).to("tpu"), torch.randn(9, 3).to("tpu")

    def loop():
        with torch.tpu.set_eager_mode("defer"):
            for p in model.parameters():  # torch's own reads (its rejection loop): no step
                torch.nn.init.trunc_normal_(p, std=0.1)
            for _ in range(6):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                loss.item()

    torchtpu.reset_metrics()
    caught = [w for w in _caught(loop) if w.category is torchtpu.TPUCompileTimeWarning]
    assert caught == []
    assert torchtpu.metrics()["compiles"]["chunk"] >= 3


@pytest.mark.parametrize("first_step_chunks", [3, 30])
def test_a_large_first_step_compiling_for_a_minute_does_not_warn(monkeypatch, first_step_chunks):
    # GPT-2 small's first DeferAndFuse steps on a TPU v5e, as the warning sees them:
    # three chunks of ~15 s in the first step, the optimizer's chunk again in the
    # second, then nothing. (Counted from the first step, this warned in it.)
    # TorchTitan's first step compiled 30 chunks before its optimizer stepped: more
    # than WARM_UP_CHUNKS, each different ops (it warned then).
    clock = [0.0]
    monkeypatch.setattr(perf_warnings.time, "perf_counter", lambda: clock[0])
    optimizer = torch.optim.SGD([torch.zeros(1)])

    chunks = iter(range(100))  # each chunk different ops, as a large step's are

    def compile_for(seconds):
        clock[0] += seconds
        perf_warnings.note_chunk_compile(seconds, (next(chunks),) * 512, "gpt.py:77")

    def steps():
        for step in range(6):
            for _ in range({0: first_step_chunks, 1: 1}.get(step, 0)):
                compile_for(15.0)
            clock[0] += 0.2  # the step runs
            perf_warnings._end_of_step(optimizer, (), {})
            perf_warnings.note_read()  # loss.item()

    assert [w for w in _caught(steps) if w.category is torchtpu.TPUCompileTimeWarning] == []


def test_chunk_compiles_without_reads_or_steps_warn_after_warming_up(monkeypatch):
    monkeypatch.setattr(config, "compile_warn_seconds", 0.0)
    monkeypatch.setattr(config, "defer_max_ops", 2)
    xs = [torch.ones(n, 5).to("tpu") for n in range(1, 15)]

    def loop():
        with torch.tpu.set_eager_mode("defer"):
            for x in xs:  # a new shape each time, cut by the full queue: never read
                x.mul_(2).add_(1)

    caught = [w for w in _caught(loop) if w.category is torchtpu.TPUCompileTimeWarning]
    assert len(caught) == 1  # with no step to tell, once more than 8 chunks compiled
    assert "compiling 9 chunks" in str(caught[0].message)


def test_explain_accounts_for_flushes_compiles_and_fallbacks():
    model = torch.nn.Linear(8, 4).to("tpu")

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        return loss.item()

    with torch.tpu.set_eager_mode("defer"):
        account = torchtpu.explain(step, torch.randn(2, 8, device="tpu"))
    assert isinstance(account.result, float)
    assert account.metrics["ops"]["defer"] > 5
    (flush,) = [f for f in account.flushes if f["reason"] == "value read"]
    assert flush["where"].startswith(f"{__file__}:") and "in step" in flush["where"]
    assert flush["compiled"] and flush["ops"] > 5
    text = str(account)
    assert "value read at" in text and "CPU fallbacks: none" in text


@pytest.mark.allow_fallback
def test_explain_names_fallbacks(monkeypatch):
    from torchtpu.dispatch import core as dispatch
    from torchtpu.dispatch import fallback

    # Pretend sin has no lowering, so it runs on the CPU fallback.
    monkeypatch.setitem(dispatch._HANDLERS, torch.ops.aten.sin.default, fallback.run_on_cpu)
    x = torch.randn(6, device="tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        account = torchtpu.explain(lambda: x.sin() + 1)
    assert account.metrics["fallback"] == {"aten.sin.default": 1}
    (event,) = account.fallbacks
    assert event["where"].startswith(f"{__file__}:")
    assert "aten.sin.default: 1 calls, first from" in str(account)
    torch.testing.assert_close(account.result.cpu(), x.cpu().sin() + 1)


def test_metrics_count_bytes_and_compiles():
    torchtpu.reset_metrics()
    x = torch.randn(16, 16).to("tpu")
    (x * 3).cpu()
    m = torchtpu.metrics()
    assert m["transfer_bytes"] == {"to_device": 16 * 16 * 4, "to_host": 16 * 16 * 4}
    assert m["ops"]["strict"] >= 1
    assert "compiles" in m or m["op_cache"]["hit"] >= 1
    assert "transfer_bytes" in torchtpu.metrics_report()


def test_persistent_compile_cache_warm_starts_a_second_process(tmp_path):
    script = textwrap.dedent(
        """
        import torch, torchtpu
        x = torch.arange(12.0).reshape(3, 4).to("tpu")
        print(((x * 2).tanh() @ x.t()).sum().item())
        """
    )
    env = dict(os.environ, TORCHTPU_COMPILE_CACHE_DIR=str(tmp_path / "xla"))
    runs = [
        subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr
    assert runs[0].stdout == runs[1].stdout
    assert len(os.listdir(tmp_path / "xla")) > 0  # programs were written...
    env["TORCHTPU_COMPILE_CACHE_DIR"] = "0"
    off = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert off.returncode == 0 and off.stdout == runs[0].stdout


def _a_line_compiling_per_shape(widths):
    xs = [torch.ones(2, n).to("tpu") for n in widths]
    for x in xs:
        x.cumsum(1).cpu()  # the line: one program per shape


def test_a_line_over_the_compile_budget_warns_once_naming_what_changed(monkeypatch, mode):
    monkeypatch.setattr(config, "compile_budget_programs", 3)
    monkeypatch.setattr(config, "recompile_warn_after", 100)  # the budget speaks first
    first = {"strict": 31, "debug": 131, "defer": 231}[mode]  # shapes no other test compiles
    caught = _caught(lambda: _a_line_compiling_per_shape(range(first, first + 6)))
    caught = [w for w in caught if w.category is not torchtpu.TPUFlushWarning]  # defer's
    assert [w.category for w in caught] == [torchtpu.TPUCompileBudgetWarning], caught
    message = str(caught[0].message)
    assert caught[0].filename == __file__
    assert "compiled 4 XLA programs" in message and "budget of 3 programs" in message
    if mode == "defer":  # each read runs a queue of one op: its op's program, not a chunk
        assert "the last was aten.cumsum.default" in message, message
    else:
        change = f"argument `self`: float32[2, {first + 2}] -> float32[2, {first + 3}]"
        assert change in message, message
    line = next(k for k in torchtpu.metrics()["compiles_by_line"] if "_a_line_compiling" in k)
    assert torchtpu.metrics()["compiles_by_line"][line] >= 6
    assert torchtpu.metrics()["compile_seconds_by_line"][line] > 0


def test_a_compile_budget_of_seconds_and_its_error_mode(monkeypatch):
    monkeypatch.setattr(config, "compile_budget_seconds", 1e-9)
    monkeypatch.setattr(config, "compile_budget_action", "error")
    with pytest.raises(torchtpu.TPUCompileBudgetError, match=r"budget of 1e-09 s"):
        _a_line_compiling_per_shape([41])


def test_no_compile_budget_by_default():
    assert config.compile_budget_programs == 0 and config.compile_budget_seconds == 0
    caught = _caught(lambda: _a_line_compiling_per_shape(range(51, 54)))
    assert caught == []
    assert "compiles_by_line" in torchtpu.metrics()  # counted all the same


def test_a_compiled_graph_counts_against_its_line(monkeypatch):
    monkeypatch.setattr(config, "compile_budget_programs", 1)
    compiled = torch.compile(lambda x: x * 2, backend="tpu", dynamic=False)
    caught = _caught(lambda: [compiled(torch.ones(n).to("tpu")) for n in (61, 62)])
    assert [w.category for w in caught] == [torchtpu.TPUCompileBudgetWarning]
    assert "a compiled graph" in str(caught[0].message)
