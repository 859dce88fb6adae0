"""The dispatcher's hot path: what is cached, what is built once, and what Debug mode
checks of a lowering's result."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import torchtpu
from conftest import assert_same, tpu
from torchtpu.dispatch import core, defer, plans
from torchtpu.ops import TABLE

aten = torch.ops.aten


def _counts(category):
    """Hits and misses (an LRU cache full from earlier tests also evicts)."""
    counts = torchtpu.metrics().get(category, {})
    return {k: v for k, v in counts.items() if k != "evicted"}


def test_a_repeated_call_is_one_cache_hit_and_no_build(monkeypatch):
    x = torch.randn(8, 8, device="tpu")
    y = torch.randn(8, 8, device="tpu")
    x + y  # the first call builds and compiles its plan
    built = []
    original = plans.build
    monkeypatch.setattr(plans, "build", lambda *a: built.append(a) or original(*a))
    torchtpu.reset_metrics()
    for _ in range(5):
        x + y
    assert built == []
    assert _counts("op_cache") == {"hit": 5}
    assert "compiles" not in torchtpu.metrics()


def test_aliasing_arguments_get_their_own_plan():
    """``x + x`` reads one storage twice; ``x + y`` two: different programs, same values."""
    plans._PLANS.clear()  # an earlier test may have built either plan already
    x = torch.arange(4.0, device="tpu")
    y = torch.arange(4.0, device="tpu")
    torchtpu.reset_metrics()
    assert_same(x + y, torch.arange(4.0) * 2)
    assert_same(x + x, torch.arange(4.0) * 2)
    assert _counts("op_cache") == {"miss": 2}
    x.add_(x)  # written and read through the same storage
    assert_same(x, torch.arange(4.0) * 2)


def test_changing_a_traced_scalar_reuses_the_plan_but_the_default_is_static():
    x = torch.ones(3, device="tpu")
    torch.add(x, x, alpha=2)
    torchtpu.reset_metrics()
    assert_same(torch.add(x, x, alpha=3), torch.full((3,), 4.0))
    assert _counts("op_cache") == {"hit": 1}
    assert_same(torch.add(x, x, alpha=1), torch.full((3,), 2.0))  # the default: static
    assert _counts("op_cache") == {"hit": 1, "miss": 1}


def test_defaults_left_out_or_given_compute_the_same():
    x = torch.randn(4, 5)
    t = x.to("tpu")
    assert_same(torch.sum(t, 1), torch.sum(x, 1))
    assert_same(torch.sum(t, 1, False), torch.sum(x, 1, False))
    assert_same(torch.sum(t, dim=1, keepdim=True), torch.sum(x, dim=1, keepdim=True))


def _plant(monkeypatch, op, fn):
    """Replace ``op``'s lowering by ``fn`` for one test (and forget cached plans)."""
    monkeypatch.setitem(TABLE, op, dataclasses.replace(TABLE[op], fn=fn))
    # A table of handlers without the op's, put back whole after the test: the handler
    # built from the planted lowering must not outlive it (deleting the op's entry only
    # left that handler in place when the op had none before).
    handlers = dict(core._HANDLERS)
    handlers.pop(op, None)
    monkeypatch.setattr(core, "_HANDLERS", handlers)
    plans._PLANS.clear()  # (a cache: emptying it changes nothing but speed)


def test_debug_mode_names_a_lowering_of_the_wrong_shape(monkeypatch):
    jnp = torchtpu.runtime.jax().numpy
    _plant(monkeypatch, aten.exp.default, lambda x: jnp.exp(x[:1]))  # wrong: drops rows
    x = torch.zeros(3, 2, device="tpu")
    with torch.tpu.set_eager_mode("debug"):
        line = sys._getframe().f_lineno + 2
        with pytest.raises(RuntimeError) as info:
            torch.exp(x)
    message = str(info.value)
    assert "aten.exp.default" in message and "shape [1, 2]" in message and "[3, 2]" in message
    assert f"test_dispatch_core.py:{line}" in message


def test_debug_mode_names_a_lowering_of_the_wrong_kind_of_dtype(monkeypatch):
    _plant(monkeypatch, aten.exp.default, lambda x: x > 0)  # wrong: a bool result
    x = torch.zeros(3, device="tpu")
    with torch.tpu.set_eager_mode("debug"):
        with pytest.raises(RuntimeError, match="aten.exp.default: .* is bool where torch's"):
            torch.exp(x)


def test_recording_builds_the_chunk_key_as_it_goes():
    with torch.tpu.set_eager_mode("defer"):
        x = torch.ones(4, device="tpu")
        x.cpu()
        y = x * 2 + 1
        q = defer._queue(0)
        assert len(q.plans) == 2 and len(q.key) == 4  # (plan, wiring) per op
        assert_same(y, torch.full((4,), 3.0))
        assert defer.pending_count() == 0


def test_a_chunk_takes_each_external_array_once():
    with torch.tpu.set_eager_mode("defer"):
        x = torch.ones(4, device="tpu")
        x.cpu()
        y = x * x + x - x
        assert len(defer._queue(0).externals) == 1
        assert_same(y, torch.ones(4))


def test_a_chunk_reuses_the_buffers_of_dead_inputs_but_never_of_live_ones():
    """Note [Donating dead inputs]: the optimizer's old parameter arrays are donated."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    batch = torch.randn(8, 64)
    expected = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        loss = model(batch).square().mean()
        loss.backward()
        opt.step()
        expected.append(loss.item())
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).to("tpu")
    batch = batch.to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.tpu.set_eager_mode("defer"):
        first_weight = model.weight.detach().clone()  # a tensor of its own
        before = first_weight.cpu()
        held = torchtpu.dispatch.values.materialize(model.weight)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = model(batch).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        donated = [key[2] for key in defer._CHUNKS if key[2]]
        assert donated, "no chunk donated the old parameter arrays"
        assert not held.is_deleted()  # an array the user holds is never donated
        assert_same(first_weight, before)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected))


def test_a_donated_parameter_buffer_holds_its_updated_value_not_its_gradient():
    """Note [Donating dead inputs]: JAX gives a donated input to the first output of its
    shape; the gradient (same shape, written by a matmul while the old weight is still
    read) would make XLA copy the weight. The chunk lists the optimizer's outputs first."""
    model = torch.nn.Linear(48, 40, bias=False).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(8, 48, device="tpu")
    with torch.tpu.set_eager_mode("defer"):
        for _ in range(2):
            opt.zero_grad()
            model(batch).square().mean().backward()
            opt.step()
        taken = {}
        run = defer._run

        def spy(q, reason, needed=()):
            taken["externals"] = [a.copy() if hasattr(a, "shape") else a for a in q.externals]
            return run(q, reason, needed)

        defer._run = spy
        try:
            opt.zero_grad()
            model(batch).square().mean().backward()
            opt.step()
        finally:
            defer._run = run
    key, chunk = next((k, c) for k, c in reversed(defer._CHUNKS.items()) if k[2])
    hlo = chunk.call.lower(*taken["externals"]).compile().as_text()
    copies = [line for line in hlo.splitlines() if " copy(" in line and "f32[40,48]" in line]
    assert not copies, copies


def _donated():
    return torchtpu.metrics().get("donated", {}).get("op", 0)


@pytest.mark.parametrize("mode", ["strict", "debug"])
def test_an_in_place_write_reuses_its_buffer_when_nothing_else_holds_it(mode):
    """Note [Strict writes reuse their buffers]: the replaced base array is donated,
    through a view too, and in a loop that is one program."""
    cpu = torch.arange(12.0).reshape(3, 4)
    with torch.tpu.set_eager_mode(mode):
        x = cpu.to("tpu")
        torchtpu.reset_metrics()
        for _ in range(4):
            x.add_(1.5)
        x[1].mul_(2)  # through a view: the storage's base is still its own
        cpu.add_(6.0)
        cpu[1].mul_(2)
        assert _donated() == 5
        # add_ once and the view's mul_ (none where an earlier test compiled them)
        assert torchtpu.metrics().get("compiles", {}).get("op", 0) <= 2
        assert_same(x, cpu)


def test_single_op_programs_compile_with_the_op_compiler_options(monkeypatch):
    """config.op_compiler_options reach XLA for an op's program, placed or donating: an
    option XLA does not know fails the op's compile, which names it, and leaves the
    tensor as it was (compiled in the call: in the background, the error would raise
    at the read, tests/test_background.py)."""
    monkeypatch.setattr(torchtpu.config, "background_compiles", False)
    x = torch.ones(7, 13, device="tpu")
    monkeypatch.setattr(torchtpu.config, "op_compiler_options", {"no_such_option": 1})
    with pytest.raises(Exception, match="no_such_option"):
        x * 3.25  # a new program (a shape no other test compiles)
    with pytest.raises(Exception, match="no_such_option"):
        x.add_(0.75)  # donates x's buffer: its own program
    assert_same(x, torch.ones(7, 13))


def test_single_ops_with_large_products_keep_xlas_default_effort(monkeypatch):
    """Note [Single ops with products compile at XLA's default effort]: a large matrix
    product's program is compiled without config.op_compiler_options (an option XLA
    does not know would fail its compile); a small product's and an elementwise op's
    with them (compiled in the call, where the error raises at once)."""
    monkeypatch.setattr(torchtpu.config, "background_compiles", False)
    large, small = torch.randn(1025, 1024), torch.randn(1024, 3)  # 2**20 + 1024 elements
    monkeypatch.setattr(torchtpu.config, "op_compiler_options", {"no_such_option": 1})
    assert_same(tpu(large) @ tpu(small), large @ small, rtol=1e-4, atol=1e-4)
    for small_op in (lambda: tpu(large[:5]) @ tpu(small[:, :2]), lambda: tpu(large) * 1.75):
        with pytest.raises(Exception, match="no_such_option"):
            small_op()  # shapes no other test compiles


def test_an_array_held_elsewhere_is_never_donated():
    x = torch.ones(6, device="tpu")
    x.add_(1)
    held = torchtpu.to_jax(x)  # the array x holds, not a copy
    twin = x.detach()  # shares the storage: not a holder of its own
    torchtpu.reset_metrics()
    x.add_(1)
    assert _donated() == 0
    assert not held.is_deleted() and held.tolist() == [2.0] * 6
    del held
    x.add_(1)
    assert _donated() == 1
    assert_same(twin, torch.full((6,), 4.0))


def test_an_optimizer_step_updates_its_state_in_place_buffers():
    """AdamW's ``_foreach_*_`` updates of parameters and moments donate their old
    arrays in Strict; the step still matches the CPU."""
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model.load_state_dict(cpu_model.state_dict())
    model.to("tpu")
    batch = torch.randn(8, 16)
    losses = {}
    for name, m, x in (("cpu", cpu_model, batch), ("tpu", model, batch.to("tpu"))):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses[name] = []
        torchtpu.reset_metrics()
        for _ in range(3):
            opt.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    # Parameters and both moments, every step but the first (which makes the moments)
    assert _donated() >= 2 * 3 * 4
    torch.testing.assert_close(torch.tensor(losses["tpu"]), torch.tensor(losses["cpu"]))
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach())


def test_numbers_are_inputs_kept_as_arrays_per_value():
    """Note [Numbers as arrays]: a Python number reaches the compiled function as a 0-d
    array made once per value, with the dtype and weak type JAX gives the number, so
    new values compile nothing and the results are the CPU's (signed zeros and NaN
    included)."""
    from torchtpu.dispatch import scalars

    x = torch.tensor([1.0, -2.0, 0.5], device="tpu")
    x.cpu()
    for mode in ("strict", "defer"):
        with torch.tpu.set_eager_mode(mode):
            (1 / (x * 3.0), 1 / (x * 3))  # a float and an int: two signatures
            torchtpu.sync()
            torchtpu.reset_metrics()
            for value in (0.25, -0.0, 0.0, float("nan"), float("inf"), 7):
                assert_same(1 / (x * value), 1 / (x.cpu() * value))
            compiles = torchtpu.metrics().get("compiles", {})
            # (DeferAndFuse: the two-op chunks of a float and of an int, once each)
            assert compiles.get("op", 0) == 0 and compiles.get("chunk", 0) <= 2
            half = torch.tensor([1.5], dtype=torch.float16, device="tpu")
            assert_same(half * 0.1, torch.tensor([1.5], dtype=torch.float16) * 0.1)
            assert_same(torch.tensor([3], device="tpu") * 2**40, torch.tensor([3]) * 2**40)
    assert scalars.as_array(-0.0) is not scalars.as_array(0.0)
    assert scalars.as_array(0.5) is scalars.as_array(0.5)
    assert scalars.as_array(True) is not scalars.as_array(1)
