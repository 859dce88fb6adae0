"""Shared helpers: every test compares the tpu device against PyTorch on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

import torchtpu
from torchtpu.observe import compare

# The suite is hermetic: compiled programs are not read from (nor written to) the
# user's persistent compilation cache, here and in the subprocesses tests start.
# (Set before the JAX runtime starts.) On a lent TPU, where every compile costs
# 0.1-0.5 s, TORCHTPU_TEST_COMPILE_CACHE names a cache the shards of one run share
# (tests/on_device.py).
_shared_cache = os.environ.get("TORCHTPU_TEST_COMPILE_CACHE")
os.environ["TORCHTPU_COMPILE_CACHE_DIR"] = "0"
torchtpu.config.compile_cache_dir = _shared_cache or None
# The suite tests the lowerings: a sample loop meeting new small shapes would otherwise
# soon run torch's CPU kernels instead, comparing the CPU with itself. Note [Small ops
# of changing shapes run on the CPU] is tested where it is turned on (test_small_ops.py).
torchtpu.config.small_ops_on_cpu = False


def _start_on_accelerator() -> str | None:
    """Where JAX may find a TPU (libtpu is installed and JAX_PLATFORMS allows it), start
    its backend before the first test: a test recording every warning then does not see
    JAX's start-up warnings. One process holds a TPU at a time, so the subprocesses
    tests start run on the CPU backend (JAX_PLATFORMS=cpu), this process keeping the
    chip."""
    import importlib.util

    platforms = os.environ.get("JAX_PLATFORMS", "")
    if importlib.util.find_spec("libtpu") is None or (platforms and "tpu" not in platforms):
        return None
    from torchtpu.runtime import platform

    if platform() != "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        return platform()
    return None


_ACCELERATOR = _start_on_accelerator()


@pytest.fixture(autouse=True, scope="session")
def _platform_tolerances_everywhere():
    """On an accelerator with tolerances of its own (Note [Tolerances per platform] in
    observe/compare.py), every comparison in the suite allows for them: those written
    as ``torch.testing.assert_close`` or ``pytest.approx`` too, not only
    `assert_same`'s."""
    if _ACCELERATOR is None or not compare.platform_tolerances():
        yield
        return
    original, original_approx = torch.testing.assert_close, pytest.approx

    def assert_close(actual, expected, *, rtol=None, atol=None, **kwargs):
        dtype = _floating_dtype(expected)
        if dtype is not None:
            rtol, atol = compare.tolerance(dtype, rtol, atol)
        return original(actual, expected, rtol=rtol, atol=atol, **kwargs)

    def approx(expected, rel=None, abs=None, **kwargs):
        dtype = _floating_dtype(expected)
        if dtype is not None:
            rel, abs = compare.tolerance(dtype, rel, abs)
        return original_approx(expected, rel=rel, abs=abs, **kwargs)

    torch.testing.assert_close, pytest.approx = assert_close, approx
    try:
        yield
    finally:
        torch.testing.assert_close, pytest.approx = original, original_approx


def _floating_dtype(value):
    """The dtype of the first floating or complex value in ``value``; a Python float
    (a loss's ``.item()``) counts as the default dtype."""
    for leaf in torch.utils._pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
            return leaf.dtype
        if isinstance(leaf, float):
            return torch.get_default_dtype()
    return None

MODES = ["strict", "debug", "defer"]


@pytest.fixture(params=MODES)
def mode(request):
    """Run the test in each eager mode that exists."""
    with torchtpu.set_eager_mode(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _fresh_state(request):
    """Each test starts with zeroed metrics and no pending checks, and may not use the
    CPU fallback unless marked ``allow_fallback``: the ops the suite covers must have
    lowerings. (Checked here rather than by turning TPUFallbackWarning into an error:
    an exception raised from a warning inside autograd's engine aborts the process.)"""
    from torchtpu.dispatch import checks, small_ops

    torchtpu.reset_metrics()
    checks._pending.clear()
    small_ops.reset()  # a line of one test is not "changing" for meeting another's shapes
    yield
    checks._pending.clear()
    fallbacks = torchtpu.metrics().get("fallback")
    if fallbacks and request.node.get_closest_marker("allow_fallback") is None:
        pytest.fail(f"ops ran on the CPU fallback: {fallbacks}", pytrace=False)


def tpu(x):
    """A tpu copy of a CPU tensor (or pytree of them)."""
    return torchtpu.to_tpu(x)


def assert_same(actual, expected, *, rtol=None, atol=None, check_stride=False):
    """``actual`` (tpu) equals ``expected`` (CPU): values, dtype, shape, device type.

    Works on tensors and nested tuples/lists of them; other values compare with ==.
    """
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)), f"expected a sequence, got {type(actual)}"
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e, rtol=rtol, atol=atol, check_stride=check_stride)
        return
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"expected a tensor, got {type(actual)}"
        assert actual.device.type == "tpu", f"result is on {actual.device}, not tpu"
        assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, (
            f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        )
        if check_stride:
            assert actual.stride() == expected.stride(), (
                f"stride {actual.stride()} != {expected.stride()}"
            )
        rtol, atol = compare.tolerance(expected.dtype, rtol, atol)  # per platform
        torch.testing.assert_close(
            actual.detach().cpu(), expected.detach(), rtol=rtol, atol=atol, equal_nan=True
        )
        return
    assert actual == expected, f"{actual!r} != {expected!r}"


@pytest.fixture
def forward_graph_outputs(monkeypatch) -> list:
    """The tensors each ``torch.compile`` forward graph compiled from now on returns:
    its results and what it keeps for its backward (fake tensors, as traced)."""
    from torchtpu.compile import backend

    outputs = []
    compile_graph = backend._compile_graph

    def spy(gm, example_inputs, forward=False, inference=False):
        if forward:
            outputs.extend(v for v in backend._output_values(gm) if isinstance(v, torch.Tensor))
        return compile_graph(gm, example_inputs, forward=forward, inference=inference)

    monkeypatch.setattr(backend, "_compile_graph", spy)
    return outputs


@pytest.fixture
def xla_compiles():
    """How many programs XLA has compiled since the test began: JAX's own count, which
    sees a compile that none of torchtpu's caches counted (a cached program called
    with arguments JAX tells apart)."""
    import jax.monitoring

    count = [0]

    def listener(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield count
    jax.monitoring.unregister_event_duration_listener(listener)
