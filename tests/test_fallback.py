"""Ops without a lowering or decomposition run on the CPU: counted, warned once, or
refused with NotImplementedError naming the op."""

from __future__ import annotations

import warnings

import pytest
import torch

import torchtpu
from conftest import assert_same

# The op these tests treat as having no lowering: its handler is forced to be the CPU
# fallback (whatever the lowering table has for it), so the tests stay meaningful as
# coverage grows.
NO_LOWERING = torch.ops.aten._cdist_forward.default


def _call():
    a, b = torch.randn(4, 3), torch.randn(5, 3)
    return NO_LOWERING(a.to("tpu"), b.to("tpu"), 2.0, None), NO_LOWERING(a, b, 2.0, None)


@pytest.fixture
def fallback_on(monkeypatch):
    from torchtpu.dispatch import core as dispatch
    from torchtpu.dispatch import fallback

    monkeypatch.setattr(torchtpu.config, "cpu_fallback", True)
    monkeypatch.setitem(dispatch._HANDLERS, NO_LOWERING, fallback.run_on_cpu)
    fallback._warned.discard(NO_LOWERING)
    yield


@pytest.mark.allow_fallback
def test_fallback_runs_on_cpu_is_counted_and_warns_once(fallback_on):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual, expected = _call()
        _call()
    assert_same(actual, expected)
    fallback_warnings = [w for w in caught if issubclass(w.category, torchtpu.TPUFallbackWarning)]
    assert len(fallback_warnings) == 1
    assert "aten._cdist_forward.default" in str(fallback_warnings[0].message)
    assert fallback_warnings[0].filename == __file__  # points at the caller
    assert torchtpu.metrics()["fallback"] == {"aten._cdist_forward.default": 2}


def test_fallback_can_be_turned_into_an_error(fallback_on):
    torchtpu.config.cpu_fallback = False
    with pytest.raises(NotImplementedError, match="aten._cdist_forward.default"):
        _call()


@pytest.mark.allow_fallback
def test_fallback_writes_mutated_arguments_back(fallback_on):
    from torchtpu.dispatch.fallback import run_on_cpu

    x = torch.zeros(3, device="tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = run_on_cpu(torch.ops.aten.add_.Tensor, (x, torch.ones(3, device="tpu")), {})
    assert out is x
    assert torch.equal(x.cpu(), torch.ones(3))


def test_decompositions_are_counted():
    from torch._decomp import decomposition_table

    from torchtpu.ops import TABLE

    candidates = [
        torch.ops.aten.hardshrink.default,
        torch.ops.aten.softshrink.default,
        torch.ops.aten.logaddexp.default,
    ]
    op = next(c for c in candidates if c not in TABLE and c in decomposition_table)
    x = torch.randn(3, 4)
    args = (x, x * 2) if op is torch.ops.aten.logaddexp.default else (x, 0.5)
    assert_same(op(*[a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args]), op(*args))
    assert torchtpu.metrics()["decomposed"][str(op)] == 1


_LIBRARY = torch.library.Library("torchtpu_test", "DEF")
_LIBRARY.define("scaled_sum(Tensor x, float k) -> Tensor")


@torch.library.impl(_LIBRARY, "scaled_sum", "CompositeExplicitAutograd")
def _scaled_sum(x, k):
    return (x * k).sum(0)


def test_a_library_kernel_for_every_backend_runs_on_the_device():
    # A library's op with a CompositeExplicitAutograd kernel written in torch ops (torch
    # 2.15's fsdp.record_grad_output_stream) runs on tpu tensors, not on the fallback.
    x = torch.randn(3, 4)
    assert_same(torch.ops.torchtpu_test.scaled_sum(x.to("tpu"), 2.0), _scaled_sum(x, 2.0))
    assert not torchtpu.metrics().get("fallback")
