"""torchtpu: ordinary PyTorch on XLA devices (TPU, GPU or CPU) through JAX.

Importing it (or just ``import torch``, through torch's backend autoload) makes
``"tpu"`` a torch device::

    import torch
    x = torch.randn(4, 4, device="tpu")
    print((x @ x).cpu())

    model = MyModel().to("tpu")            # or torchtpu.to_tpu(model)
    torch.tpu.set_eager_mode("debug")      # errors point at your line
"""

from __future__ import annotations

import sys

import torch

from torchtpu import config, device, huggingface
from torchtpu.dispatch.fallback import TPUFallbackWarning
from torchtpu.dispatch.host import TPUHostComputeWarning
from torchtpu.dispatch.modes import EagerMode, set_eager_mode
from torchtpu.dispatch.synchronize import sync
from torchtpu.matmul_precision import Precision, precision
from torchtpu.observe.explain import Explanation, explain_call
from torchtpu.observe.metrics import metrics, metrics_report, reset_metrics
from torchtpu.observe.perf_warnings import (
    TPUCompileBudgetError,
    TPUCompileBudgetWarning,
    TPUCompileTimeWarning,
    TPUFlushWarning,
    TPUPerformanceWarning,
    TPURecompileWarning,
)
from torchtpu.tensor import TPUTensor

__version__ = "0.1.0"

__all__ = [
    "EagerMode",
    "Explanation",
    "Precision",
    "TPUCompileBudgetError",
    "TPUCompileBudgetWarning",
    "TPUCompileTimeWarning",
    "TPUFallbackWarning",
    "TPUHostComputeWarning",
    "TPUFlushWarning",
    "TPUPerformanceWarning",
    "TPURecompileWarning",
    "TPUTensor",
    "bounded",
    "config",
    "explain",
    "from_dlpack",
    "from_jax",
    "jax_op",
    "jit",
    "mark_dynamic",
    "metrics",
    "metrics_report",
    "precision",
    "reset_metrics",
    "set_eager_mode",
    "sync",
    "to_jax",
    "to_tpu",
    "check_against_cpu",
    "TPUDivergenceError",
    "TPUDivergenceWarning",
    "detect_nonfinite",
    "TPUNonFiniteError",
    "TPUNonFiniteWarning",
    "profile",
    "Profile",
]

device.register()
huggingface.install()  # Note [Transformers' flex_attention check]

# torch.compile(backend="tpu") finds the backend through its entry point; if Dynamo is
# already loaded (importing it costs seconds, so it is never imported here), register
# it now as well.
if "torch._dynamo" in sys.modules:
    import torchtpu.compile.backend  # noqa: F401


def jit(fn=None, *, static_argnums=()):
    """Compile a training step (forward, ``backward()``, optimizer ``step()``) or any
    function of tpu tensors into ONE XLA program. See torchtpu/compile/jit.py."""
    from torchtpu.compile.jit import jit as _jit

    return _jit(fn, static_argnums=static_argnums)


def bounded(size: int):
    """``with torchtpu.bounded(size):`` states the size of the variable-size results in
    the block -- ``nonzero`` and boolean indexing (rows), ``masked_select``, ``unique``
    and ``unique_consecutive`` -- so that they run without waiting for values: inside a
    DeferAndFuse chunk, a background compile or a `torchtpu.jit` program. The size is
    checked on the device; a wrong one raises RuntimeError at the next read. See
    Note [Sizes the user states], torchtpu/dispatch/bounded.py."""
    from torchtpu.dispatch.bounded import bounded as _bounded

    return _bounded(size)


def mark_dynamic(tensor: torch.Tensor, dim, *, min: int | None = None, max: int | None = None):
    """Mark ``tensor``'s ``dim`` (an int or a list of them) as a size that changes from
    call to call, for ``torch.compile(backend="tpu")``: its inference graphs then compile
    one program per bucket of sizes, a power of two up to ``max`` (Note [Shape buckets],
    compile/buckets.py). It is ``torch._dynamo.mark_dynamic``; ``max`` also caps the
    buckets, so the largest program is no larger than needed."""
    import torch._dynamo

    if max is not None and min is None:
        min = 2  # Dynamo's own least dynamic size; torch 2.13 and 2.14 fail a max alone
    torch._dynamo.mark_dynamic(tensor, dim, min=min, max=max)


# JAX interop (torchtpu/interop/, docs/jax-interop.md). Imported on first use: the
# dispatcher it needs imports JAX, and ``import torch`` imports this module.


def to_jax(tensor: torch.Tensor):
    """The value of a tpu tensor as a ``jax.Array``: no copy for a tensor that is its
    whole storage, one for a view. See torchtpu/interop/arrays.py."""
    from torchtpu.interop.arrays import to_jax as _to_jax

    return _to_jax(tensor)


def from_jax(array) -> torch.Tensor:
    """A tpu tensor holding a ``jax.Array`` (no copy). See torchtpu/interop/arrays.py."""
    from torchtpu.device import load_runtime
    from torchtpu.interop.arrays import from_jax as _from_jax

    load_runtime()  # the tensor may be the process's first: its ops need the dispatcher
    return _from_jax(array)


def from_dlpack(obj) -> torch.Tensor:
    """A tpu tensor from any DLPack producer or legacy capsule. See
    torchtpu/interop/arrays.py."""
    from torchtpu.device import load_runtime
    from torchtpu.interop.arrays import from_dlpack as _from_dlpack

    load_runtime()  # as from_jax
    return _from_dlpack(obj)


def jax_op(fn=None, *, name=None, traced=(), backward=None):
    """Make a function of jax arrays a differentiable function of tensors, in every mode
    and in compiled code (``@torchtpu.jax_op``). See torchtpu/interop/functions.py."""
    from torchtpu.interop.functions import jax_op as _jax_op

    return _jax_op(fn, name=name, traced=traced, backward=backward)


def to_tpu(obj, device: str | int | torch.device = "tpu"):
    """Move tensors, modules, and any pytree of them (lists, dicts, tuples, ...) to tpu.

    Modules move in place, as ``module.to`` does; tensors are copied. Other leaves
    are returned unchanged. Example::

        batch = torchtpu.to_tpu({"x": torch.randn(8, 3), "y": torch.arange(8)})
        model = torchtpu.to_tpu(model)
    """
    target = torch.device("tpu", device) if isinstance(device, int) else torch.device(device)
    if target.type != "tpu":
        raise ValueError(f"to_tpu: expected a tpu device, got {target}")

    import optree

    def move(leaf):
        if isinstance(leaf, (torch.Tensor, torch.nn.Module)):
            return leaf.to(target)
        return leaf

    return optree.tree_map(move, obj, none_is_leaf=True)


def check_against_cpu(action: str = "raise"):
    """Context manager: every tpu op also runs on the CPU, and the first whose result
    differs raises `TPUDivergenceError` (``action="warn"``: warns) naming the op, your
    line, the shapes and dtypes, and the errors. Forward and backward. Example::

        with torchtpu.check_against_cpu():
            loss = model(batch).loss
            loss.backward()
    """
    from torchtpu.divergence import check_against_cpu as check

    return check(action)


def detect_nonfinite(action: str = "raise"):
    """Context manager: the first tpu op that makes a NaN or an Inf from finite inputs
    raises `TPUNonFiniteError` (``action="warn"``: warns) naming the op, your line, the
    shapes and dtypes, and which result holds it. Forward and backward, every eager
    mode (DeferAndFuse reads the flags once per flush). Example::

        with torchtpu.detect_nonfinite():
            loss = model(batch).loss
            loss.backward()
    """
    from torchtpu.nonfinite import detect_nonfinite as detect

    return detect(action)


def profile(log_dir, *, perfetto: bool = True, python: bool = False):
    """Context manager: record a trace of the block into ``log_dir`` for TensorBoard and
    Perfetto, each aten op named with your line, each DeferAndFuse chunk with its size
    and cause (JAX's profiler; see torchtpu/profiling.py). Yields a `Profile` whose
    ``files`` are known when the block ends. Example::

        with torchtpu.profile("runs/profile") as prof:
            train_step(batch)
        print(prof.trace_file)
    """
    from torchtpu.profiling import profile as record

    return record(log_dir, perfetto=perfetto, python=python)


def __getattr__(name: str):
    if name in ("TPUDivergenceError", "TPUDivergenceWarning"):
        from torchtpu import divergence

        return getattr(divergence, name)
    if name == "Profile":
        from torchtpu.profiling import Profile

        return Profile
    if name in ("TPUNonFiniteError", "TPUNonFiniteWarning"):
        from torchtpu import nonfinite

        return getattr(nonfinite, name)
    raise AttributeError(f"module 'torchtpu' has no attribute {name!r}")


def explain(fn, *args, **kwargs) -> Explanation:
    """Run ``fn(*args, **kwargs)`` once, finish its work (``torchtpu.sync()``), and return
    an `Explanation`: ops per mode, flushes with reasons and user lines, compilations,
    fallbacks. Its ``result`` is what ``fn`` returned. Example::

        print(torchtpu.explain(train_step, batch))
    """
    return explain_call(fn, args, kwargs, finish=sync)
