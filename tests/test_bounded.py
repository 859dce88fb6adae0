"""Variable-size results at a size the user states (Note [Sizes the user states],
dispatch/bounded.py): inside ``torchtpu.bounded(n)``, nonzero, boolean indexing,
masked_select and unique run without waiting for values -- inside a DeferAndFuse chunk
and a torchtpu.jit program -- with torch's values, and a wrong size raises."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import torchtpu
from conftest import assert_same, tpu


def _routing_mask(tokens=8, experts=4, k=2, seed=0):
    """A top-k routing mask: exactly ``k`` experts a token, so ``tokens * k`` True."""
    scores = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))
    return torch.zeros(tokens, experts, dtype=torch.bool).scatter_(
        1, scores.topk(k, dim=1).indices, True
    )


def _rows(result):
    return result.shape[0]


# name: (what the user runs, the size the user states: of the CPU result)
_CASES = {
    "boolean index": (lambda x, m: x[m] * 2, _rows),
    "boolean index put back": (lambda x, m: x.index_put((m,), x[m] + 1), lambda r: 16),
    "nonzero": (lambda x, m: m.nonzero() + 1, _rows),
    "argwhere": (lambda x, m: torch.argwhere(m), _rows),
    "where": (lambda x, m: torch.where(m)[1], _rows),
    "nonzero of a 0-d": (lambda x, m: m[0, 0].nonzero(), _rows),
    "masked_select broadcast": (lambda x, m: torch.masked_select(x, m[:1]), _rows),
    "unique": (lambda x, m: torch.unique(m.sum(1) + m.long().argmax(1)), _rows),
    "unique inverse counts": (
        lambda x, m: torch.unique(m.long().argmax(1), return_inverse=True, return_counts=True),
        lambda r: len(r[0]),
    ),
    "unique dim": (
        lambda x, m: torch.unique(m.long(), dim=-1, return_inverse=True, return_counts=True),
        lambda r: r[0].shape[-1],
    ),
    "unique_consecutive": (
        lambda x, m: torch.unique_consecutive(m.long().argmax(1), return_counts=True),
        lambda r: len(r[0]),
    ),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_a_stated_size_gives_torchs_values_without_waiting(mode, case):
    fn, size_of = _CASES[case]
    x = torch.randn(8, 4)
    mask = _routing_mask()
    expected = fn(x, mask)
    with torchtpu.bounded(size_of(expected)):
        actual = fn(tpu(x), tpu(mask))
    assert_same(actual, expected)
    metrics = torchtpu.metrics()
    assert "dynamic_shape" not in metrics  # no op ran on concrete values
    assert "data-dependent shape" not in metrics.get("flushes", {})


def test_a_bounded_routing_step_is_one_chunk():
    """DeferAndFuse: gate, select and combine in one chunk, read once."""
    x = torch.randn(8, 4)
    mask = _routing_mask()

    def route(x, mask):
        chosen = x[mask]
        return (chosen.softmax(0) * chosen).sum()

    with torchtpu.set_eager_mode("defer"):
        xt, mt = tpu(x), tpu(mask)
        torchtpu.reset_metrics()
        with torchtpu.bounded(16):
            out = route(xt, mt)
        assert_same(out, route(x, mask))
    metrics = torchtpu.metrics()
    assert metrics["flushes"] == {"value read": 1}
    assert metrics["compiles"] == {"chunk": 1}


def test_unbounded_ops_still_wait_for_their_size():
    with torchtpu.set_eager_mode("defer"):
        xt, mt = tpu(torch.randn(8, 4)), tpu(_routing_mask())
        torchtpu.reset_metrics()
        (xt * 2)[mt].cpu()
    assert torchtpu.metrics()["flushes"]["data-dependent shape"] == 1


def test_gradients_flow_through_a_bounded_selection(mode):
    x = torch.randn(8, 4, requires_grad=True)
    mask = _routing_mask()
    (x[mask].exp() * torch.masked_select(x, mask)).sum().backward()
    xt = tpu(x.detach()).requires_grad_()
    with torchtpu.bounded(16):
        (xt[tpu(mask)].exp() * torch.masked_select(xt, tpu(mask))).sum().backward()
    assert_same(xt.grad, x.grad)


def test_a_wrong_size_raises_at_the_next_read_naming_the_op():
    mask = tpu(_routing_mask())
    for mode in ("strict", "defer"):
        with torchtpu.set_eager_mode(mode):
            with torchtpu.bounded(15):
                chosen = tpu(torch.randn(8, 4))[mask]
            later = chosen.sum() + 1  # computed after the failed check: never readable
            with pytest.raises(RuntimeError, match=r"nonzero: torchtpu.bounded\(15\) stated") as info:
                later.item()
            assert "test_bounded.py" in "".join(info.value.__notes__)


def test_a_wrong_size_raises_at_the_op_in_debug():
    with torchtpu.set_eager_mode("debug"):
        with torchtpu.bounded(17), pytest.raises(RuntimeError, match="masked_select: torchtpu.bounded"):
            torch.masked_select(tpu(torch.randn(8, 4)), tpu(_routing_mask()))


def test_a_bounded_selection_is_traced_into_one_program():
    mask = _routing_mask()
    x = torch.randn(8, 4)

    def step(x, mask):
        with torchtpu.bounded(16):
            return x[mask].square().sum()

    compiled = torchtpu.jit(step)
    xt, mt = tpu(x), tpu(mask)
    for _ in range(3):
        assert_same(compiled(xt, mt), step(x, mask))
    assert torchtpu.metrics()["compiles"].get("step") == 1
    unstated = torchtpu.jit(lambda x, m: x[m].sum())
    unstated(xt, mt)  # a first call runs eagerly; the second traces
    with pytest.raises(RuntimeError, match="state it: torchtpu.bounded"):
        unstated(xt, mt)


def test_empty_inputs_and_sizes_of_zero():
    empty = tpu(torch.zeros(0, dtype=torch.long))
    with torchtpu.bounded(0):
        assert_same(torch.unique(empty), torch.unique(torch.zeros(0, dtype=torch.long)))
        assert_same(tpu(torch.zeros(3)).nonzero(), torch.zeros(3).nonzero())
    with torchtpu.bounded(1), pytest.raises(RuntimeError, match="unique: torchtpu.bounded"):
        torch.unique(empty)


def test_unique_rows_holding_nan_are_refused():
    rows = tpu(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))
    with torchtpu.bounded(2):
        values = torch.unique(rows, dim=0)
    with pytest.raises(NotImplementedError, match="rows holding NaN"):
        values.cpu()
    assert_same(torch.unique(rows, dim=0), torch.unique(rows.cpu(), dim=0))


def test_a_statement_is_per_block_and_per_thread():
    mask = tpu(_routing_mask())
    corner = int(_routing_mask()[:3].sum())
    with torchtpu.bounded(16):
        with torchtpu.bounded(corner):
            assert mask[:3].nonzero().shape[0] == corner
        seen = []
        thread = threading.Thread(target=lambda: seen.append(mask.nonzero().shape[0]))
        thread.start()
        thread.join()
        assert mask.nonzero().shape[0] == 16
    assert seen == [16]  # the other thread waited for the true size
    assert torchtpu.metrics()["dynamic_shape"] == {"aten.nonzero.default": 1}


@pytest.mark.parametrize("size", [-1, 2.0, True, None])
def test_a_size_is_a_count(size):
    with pytest.raises(ValueError, match="torchtpu.bounded: size must be an int"):
        torchtpu.bounded(size)


# -- x[mask] = rows: no count needed (dispatch/core.py, _masked_put) -----------------------


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("rows", ["one a True", "one for all"])
def test_putting_rows_back_through_a_mask_waits_for_nothing(mode, accumulate, rows):
    x = torch.randn(8, 4, 3)
    mask = _routing_mask()
    values = x[mask] * 2 if rows == "one a True" else torch.randn(1, 3)
    expected = x.clone().index_put_((mask,), values, accumulate=accumulate)
    xt, mt = tpu(x), tpu(mask)
    actual = xt.index_put_((mt,), tpu(values), accumulate=accumulate)
    assert actual is xt
    assert_same(actual, expected)
    assert torchtpu.metrics().get("dynamic_shape", {}) == {}


def test_the_backward_of_a_selection_needs_no_count():
    x = torch.randn(8, 4, requires_grad=True)
    mask = _routing_mask()
    x[mask].square().sum().backward()
    xt = tpu(x.detach()).requires_grad_()
    xt[tpu(mask)].square().sum().backward()
    assert_same(xt.grad, x.grad)
    assert torchtpu.metrics()["dynamic_shape"] == {"aten.nonzero.default": 1}  # the forward's


def test_putting_too_many_rows_raises_at_the_next_read():
    xt, mt = tpu(torch.randn(8, 4)), tpu(_routing_mask())
    xt[mt] = tpu(torch.ones(17))
    with pytest.raises(RuntimeError, match=r"shape mismatch: value tensor of shape \[17\]"):
        xt.cpu()
    with pytest.raises(RuntimeError, match="shape mismatch"):
        torch.randn(8, 4)[_routing_mask()] = torch.ones(17)  # as torch raises, at once


def test_a_size_may_be_a_numpy_or_tensor_integer():
    mask = tpu(_routing_mask())
    for size in (np.int64(16), torch.tensor(16), _routing_mask().sum()):
        with torchtpu.bounded(size):
            assert mask.nonzero().shape == (16, 2)
    assert "dynamic_shape" not in torchtpu.metrics()


def test_the_compiles_of_an_unstated_size_are_counted():
    """The jitted pieces of a data-dependent op compile per count outside the plans'
    caches: counted as "dynamic shape" compiles, once per new count."""
    x = tpu(torch.arange(12.0))

    def compiles():
        return torchtpu.metrics().get("compiles", {}).get("dynamic shape", 0)

    x[x > 3].cpu()  # 8 elements
    first = compiles()
    assert first >= 1 and torchtpu.metrics()["compile_seconds"]["dynamic shape"] > 0
    x[x > 4].cpu()  # 7: a new count
    second = compiles()
    assert second > first
    x[x < 7].cpu()  # 7 again: nothing compiles
    assert compiles() == second
