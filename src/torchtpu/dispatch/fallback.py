"""The CPU fallback: an op with no lowering and no decomposition runs on the CPU.

Inputs are copied to the host, torch's CPU kernel runs, results are copied back and
mutated arguments are written back. It is slow, so it is never silent: each use is
counted in ``torchtpu.metrics()["fallback"]`` and warned about once per op. With
``torchtpu.config.cpu_fallback = False`` (env ``TORCHTPU_CPU_FALLBACK=0``) the op
raises NotImplementedError instead.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map

from torchtpu import config, dtypes, tracing
from torchtpu.observe import metrics
from torchtpu.observe.locations import user_frame, user_stacklevel


class TPUFallbackWarning(UserWarning):
    """An op ran on the CPU because torchtpu has no lowering for it."""


_warned: set = set()


def run_on_cpu(func, args, kwargs):
    if tracing._active is not None:
        tracing.refuse("it has no tpu lowering, so it would run on the CPU", func)
    if not config.cpu_fallback:
        raise NotImplementedError(
            f"torchtpu: {func} has no tpu lowering and the CPU fallback is off "
            "(torchtpu.config.cpu_fallback / TORCHTPU_CPU_FALLBACK)"
        )
    for value in tree_flatten((args, kwargs))[0]:
        if isinstance(value, torch.dtype) and value not in dtypes.SUPPORTED:
            # A quantized or complex32 result: refused before anything is copied.
            dtypes.check_supported(value, f"tensor (asked of {func})")
    metrics.count("fallback", str(func))
    if metrics._recorders:
        metrics.event("fallback", op=str(func), where=user_frame())
    from torchtpu.dispatch import defer

    defer.flush("cpu fallback")
    if func not in _warned:
        _warned.add(func)
        warnings.warn(
            f"torchtpu: {func} (called from {user_frame()}) has no tpu lowering; it runs "
            "on the CPU, copying its inputs to the host and back (slow). See "
            "torchtpu.metrics()['fallback'].",
            TPUFallbackWarning,
            stacklevel=user_stacklevel(),
        )

    return compute_on_cpu(func, args, kwargs)


def compute_on_cpu(func, args, kwargs):
    """``func``'s CPU kernel on copies of the tpu tensors in ``args`` and ``kwargs``:
    the mutated arguments written back, the results copied to the tpu device."""
    from torchtpu.dispatch.values import from_cpu, host_value
    from torchtpu.tensor import TPUTensor

    device = None
    originals: dict[int, TPUTensor] = {}

    def to_cpu(x):
        nonlocal device
        if isinstance(x, TPUTensor):
            device = x._storage.device_index if device is None else device
            host = host_value(x)
            originals[id(host)] = x
            return host
        if isinstance(x, torch.device) and x.type == "tpu":
            device = x.index if device is None and x.index is not None else device
            return torch.device("cpu")
        return x

    cpu_args = tree_map(to_cpu, args)
    cpu_kwargs = tree_map(to_cpu, kwargs)
    result = func(*cpu_args, **cpu_kwargs)
    if device is None:  # a factory given device="tpu": the current device, as on CUDA
        from torchtpu.runtime import current_index

        device = current_index()

    # Write back every argument the op mutated.
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = cpu_args[i] if i < len(cpu_args) else cpu_kwargs.get(arg.name)
        for host in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(host, torch.Tensor) and id(host) in originals:
                originals[id(host)].copy_(host)

    def back(x):
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided:
                from torchtpu.ops import unsupported  # (imports JAX: not at import time)

                unsupported.refuse("sparse layouts", op=func, layout=x.layout)
            if x.dtype not in dtypes.SUPPORTED:  # a quantized result, complex32
                dtypes.check_supported(x.dtype, f"tensor (the result of {func})")
            original = originals.get(id(x))
            return original if original is not None else from_cpu(x, device)
        return x

    return tree_map(back, result)
