"""DeferAndFuse after a failure: an error while an op is recorded or while a chunk
runs leaves the queue, every Storage and every pending value consistent (issue #31).

Random programs run on tpu in DeferAndFuse and on the CPU, side by side, with a
failure injected into some of them: in the middle of recording an op (the op raises
and leaves no trace), or into one op of a chunk when it runs (the read that flushed it
raises; every tensor the chunk would have written raises when read, naming the
error; everything else, and everything recorded afterwards, matches the CPU).
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import assert_same
from torchtpu import config
from torchtpu.dispatch import defer

N_VARIABLES = 4
SHAPE = (4, 3)
WEIGHT = torch.linspace(-1, 1, 9).reshape(3, 3)


class Injected(RuntimeError):
    """The failure a test injects."""


# (name, program step): each reads variables v[i], v[j] and writes v[k], the same on
# the CPU and on tpu; `w` is WEIGHT on the variables' device.
def _add(v, i, j, k, w):
    v[k] = v[i] + v[j]


def _mul(v, i, j, k, w):
    v[k] = v[i] * v[j]


def _sin(v, i, j, k, w):
    v[k] = torch.sin(v[i])


def _matmul(v, i, j, k, w):
    v[k] = v[i] @ w


def _column_sums(v, i, j, k, w):
    v[k] = v[i].sum(0, keepdim=True).expand(SHAPE).clone()


def _add_(v, i, j, k, w):
    v[k].add_(v[i])


def _scale_(v, i, j, k, w):
    v[k].mul_(0.5)


def _add_to_rows_(v, i, j, k, w):  # an in-place op on a view writes its base
    v[k].narrow(0, 1, 2).add_(v[j].narrow(0, 0, 2))


def _transpose_mul_(v, i, j, k, w):
    v[k].t().mul_(-1.0)


def _where(v, i, j, k, w):
    v[k] = torch.where(v[i] > 0, v[i], v[j])


def _fill_uninitialised(v, i, j, k, w):  # the op of issue #31's first item
    v[k] = torch.empty(SHAPE, device=v[i].device).zero_() + v[i]


STEPS = [
    _add, _mul, _sin, _matmul, _column_sums, _add_, _scale_, _add_to_rows_,
    _transpose_mul_, _where, _fill_uninitialised,
]  # fmt: skip


class _RecordFault:
    """Armed, makes the next op fail in the middle of being recorded: after its inputs
    became chunk inputs and its outputs were made, when the queue takes them."""

    def __init__(self, monkeypatch):
        self.armed = False
        fault = self

        class weakref:  # defer's module, as recording uses it
            @staticmethod
            def ref(value):
                if fault.armed:
                    fault.armed = False
                    raise Injected("injected while recording")
                return defer_weakref.ref(value)

        defer_weakref = defer.weakref
        monkeypatch.setattr(defer, "weakref", weakref)


class _RunFault:
    """Armed, makes one op of the next chunk of two or more ops fail when it runs."""

    def __init__(self, monkeypatch):
        self.armed = False
        self.fired = False
        real = defer._Chunk.__init__
        fault = self

        def chunk_init(chunk, nodes_spec, live, donated, device):
            if fault.armed and len(nodes_spec) > 1:
                fault.armed = False
                position = random.randrange(len(nodes_spec))
                plan, refs = nodes_spec[position]
                nodes_spec = list(nodes_spec)
                nodes_spec[position] = (_FailingOnce(plan, fault), refs)
            real(chunk, nodes_spec, live, donated, device)

        monkeypatch.setattr(defer._Chunk, "__init__", chunk_init)


class _FailingOnce:
    """A plan whose function raises the first time a chunk traces it."""

    def __init__(self, plan, fault: _RunFault):
        self._plan, self._fault, self._failed = plan, fault, False

    def __getattr__(self, name):
        return getattr(self._plan, name)

    def fn(self, *args):
        if not self._failed:
            self._failed = self._fault.fired = True
            raise Injected("injected while running")
        return self._plan.fn(*args)


def _read_all(cpu, tpu, dirty, failed_run: bool):
    """Compare every variable with the CPU; after a failed run, the ones it would have
    written raise when read, and are uploaded again from the CPU's values."""
    for k in range(N_VARIABLES):
        if failed_run and k in dirty:
            with pytest.raises(RuntimeError, match="never computed: Injected.*raised by"):
                tpu[k].cpu()
            tpu[k] = cpu[k].to("tpu")
        else:
            assert_same(tpu[k], cpu[k])
    dirty.clear()


@pytest.mark.parametrize("seed", range(10))
def test_random_programs_with_failures_match_the_cpu(seed, monkeypatch):
    rng = random.Random(seed)
    random.seed(seed)
    record_fault, run_fault = _RecordFault(monkeypatch), _RunFault(monkeypatch)
    # 1,000 programs in all over the seeds, each in its own queue.
    for _ in range(100):
        cpu = [torch.randn(SHAPE) for _ in range(N_VARIABLES)]
        with torch.tpu.set_eager_mode("defer"):
            tpu = [t.to("tpu") for t in cpu]
            dirty: set[int] = set()  # written since the last flush
            fail_at = rng.randrange(8) if rng.random() < 0.3 else None
            run_fault.armed, run_fault.fired = rng.random() < 0.3, False
            for n in range(8):
                step = rng.choice(STEPS)
                i, j, k = (rng.randrange(N_VARIABLES) for _ in range(3))
                after = [t.clone() for t in cpu]
                try:
                    step(after, i, j, k, WEIGHT)
                except RuntimeError:  # refused (overlapping memory): refused on tpu too
                    with pytest.raises(RuntimeError, match="memory location"):
                        step(tpu, i, j, k, WEIGHT.to("tpu"))
                    continue
                if n == fail_at:
                    record_fault.armed = True
                    with pytest.raises(Injected):
                        step(tpu, i, j, k, WEIGHT.to("tpu"))
                    record_fault.armed = False
                    continue  # the op left no trace: the CPU's does not count either
                cpu[:] = after
                step(tpu, i, j, k, WEIGHT.to("tpu"))
                dirty.add(k)
                if rng.random() < 0.25:
                    _flush_and_check(cpu, tpu, dirty, run_fault)
            _flush_and_check(cpu, tpu, dirty, run_fault)
            assert defer.pending_count() == 0


def _flush_and_check(cpu, tpu, dirty, run_fault):
    try:
        torch.tpu.synchronize()  # flushes the queue
    except Injected as error:
        assert run_fault.fired
        assert any("raised by" in note for note in error.__notes__)  # names the op
    _read_all(cpu, tpu, dirty, run_fault.fired)
    run_fault.fired = False


def test_an_op_reading_a_value_of_a_failed_chunk_raises_and_leaves_the_queue_whole(
    monkeypatch,
):
    run_fault = _RunFault(monkeypatch)
    with torch.tpu.set_eager_mode("defer"):
        good = torch.ones(3, device="tpu") * 2
        good.cpu()
        bad = good + 1
        bad = bad * 3
        run_fault.armed = True
        with pytest.raises(Injected):
            bad.cpu()
        kept = good + 5  # recorded before the next failure
        with pytest.raises(RuntimeError, match="never computed"):
            bad + 1  # raises at the op, recording nothing
        after = kept * 2
        assert_same(after, (torch.ones(3) * 2 + 5) * 2)


def test_a_failure_in_a_full_queue_reaches_the_ops_after_its_cut(monkeypatch):
    """A full queue runs its head and keeps its tail queued; when the head fails, the
    tail's values (which read the head's) hold the error too."""
    monkeypatch.setattr(config, "defer_max_ops", 8)
    run_fault = _RunFault(monkeypatch)
    with torch.tpu.set_eager_mode("defer"):
        x = torch.zeros(3, device="tpu")
        x.cpu()
        values = []
        run_fault.armed = True
        with pytest.raises(Injected):
            for _ in range(12):
                x = x + 1
                values.append(x)
        for value in values:
            with pytest.raises(RuntimeError, match="never computed"):
                value.cpu()
        assert_same(torch.ones(2, device="tpu") + 1, torch.full((2,), 2.0))


def test_zero_of_an_uninitialised_tensor_in_defer():
    with torch.tpu.set_eager_mode("defer"):
        x = torch.empty(4, device="tpu").zero_()
        y = torch.empty(3, device="tpu").fill_(2.0)
        assert_same(x, torch.zeros(4))
        assert_same(y, torch.full((3,), 2.0))
