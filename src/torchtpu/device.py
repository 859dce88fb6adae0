"""The "tpu" device: PrivateUse1 registration, factory kernels, and ``torch.tpu``.

`register()` runs when torchtpu is imported (also by ``import torch`` alone, through
the ``torch.backends`` autoload entry point). It must stay cheap: nothing here
imports JAX until a tpu tensor is made or a question about the hardware is asked.

This module *is* ``torch.tpu``: the cuda-like device module.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import threading
import types

import torch

from torchtpu import (
    _compat,
    autocast,
    distributed,
    dtypes,
    memory,
    pinned,
    rng,
    runtime,
    serialization,
)
from torchtpu.dispatch import modes
from torchtpu.dispatch.modes import EagerMode, set_eager_mode
from torchtpu.matmul_precision import Precision, precision
from torchtpu.memory import (
    empty_cache,
    get_per_process_memory_fraction,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_stats,
    memory_summary,
    reset_peak_memory_stats,
    set_per_process_memory_fraction,
)
from torchtpu.runtime import index_of as _index
from torchtpu.streams import Event, Stream, current_stream, default_stream, set_stream, stream

__all__ = [
    "EagerMode",
    "Event",
    "Precision",
    "Stream",
    "current_device",
    "current_stream",
    "default_stream",
    "device",
    "device_count",
    "empty_cache",
    "get_amp_supported_dtype",
    "get_device_capability",
    "get_device_name",
    "get_device_properties",
    "get_per_process_memory_fraction",
    "get_rng_state",
    "get_rng_state_all",
    "initial_seed",
    "is_available",
    "is_bf16_supported",
    "is_initialized",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "memory_summary",
    "precision",
    "reset_peak_memory_stats",
    "seed",
    "seed_all",
    "set_device",
    "set_eager_mode",
    "set_per_process_memory_fraction",
    "set_rng_state",
    "set_rng_state_all",
    "set_stream",
    "stream",
    "synchronize",
]

# This thread's torch-function mode state (see `_resolve_tpu_on_current_device`). The
# current device itself is per thread too, held by the runtime (runtime/backend.py).
_thread = threading.local()

# torch reads this flag (as ``torch.cuda._initialized``) to decide whether a device's RNG
# state is worth saving: ``torch.utils.checkpoint`` stashes the state only when it is
# true, and then replays the forward's random ops (dropout masks) in the recomputation.
# The tpu generator needs no initialisation (its state is two Python integers), so it
# is always ready.
_initialized = True


# -- the device module (torch.tpu) ------------------------------------------------------------


def is_available() -> bool:
    """True: JAX always has a backend (a TPU, a GPU, or the CPU)."""
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    """How many devices JAX sees: ``tpu:0`` .. ``tpu:{n-1}``."""
    from torchtpu.runtime import devices

    if runtime.launched_rank() is not None and not runtime.started():
        return 1  # Note [One device per launched process]
    return len(devices())


def current_device() -> int:
    return runtime.current_index()


def set_device(device) -> None:
    """Note [One device per launched process]
    A process that a launcher started as one of several (torchrun, Lightning's DDP:
    ``WORLD_SIZE`` > 1 in its environment) computes on one device, ``tpu:0``, as after
    ``init_process_group("tpu")`` (docs/distributed.md). CUDA scripts ask for the
    device count and select their GPU with ``set_device(local_rank)`` before
    ``init_process_group``; here both answer without starting JAX, which could not
    join the other processes once started: ``device_count()`` is 1, and
    ``set_device(LOCAL_RANK)`` selects the process's device, tpu:0."""
    index = _index(device)
    launched = runtime.launched_rank()
    count = device_count()
    if launched is not None and count == 1 and index == launched:
        index = 0
    if not 0 <= index < count:
        raise RuntimeError(f"tpu:{index} does not exist: {count} device(s) available")
    runtime.set_current_index(index)
    _resolve_tpu_on_current_device(index != 0)


# torch fills in the index of a bare "tpu" itself in ``Tensor.to`` (so also
# ``Module.to``) and in ``torch.tensor``-like constructors, from the device guard's
# ``getDevice()``. torch 2.13's Python device guard (``torch._C._acc.DeviceGuard``,
# torch/csrc/acc/Module.cpp) lets Python override only ``type_``: its ``getDevice()``
# always answers index 0 (and ``setDevice`` does nothing, ``deviceCount()`` is 1). So
# while the current device is not 0, a torch-function mode gives those calls the
# index before torch does, as ``torch.set_default_device`` does for factories.
# (Factories such as ``torch.zeros(device="tpu")`` reach the kernels in this module
# with no index and need no help.)
_INDEX_FILLED_BY_TORCH = frozenset(
    {
        torch.Tensor.to,
        torch.Tensor.new_tensor,
        torch.tensor,
        torch.as_tensor,
        torch.asarray,
    }
)


def _with_current_index(value):
    if type(value) is str and value == "tpu":
        return torch.device("tpu", current_device())
    if type(value) is torch.device and value.type == "tpu" and value.index is None:
        return torch.device("tpu", current_device())
    return value


class _CurrentTPUDevice(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INDEX_FILLED_BY_TORCH:
            args = tuple(_with_current_index(a) for a in args)
            kwargs = {k: _with_current_index(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _resolve_tpu_on_current_device(active: bool) -> None:
    """Put the mode at the bottom of this thread's torch-function mode stack, or take it
    out. (At the bottom, as torch's DeviceContext: modes the user enters later stay
    above it, and leaving them does not remove it.)"""
    from torch.overrides import _len_torch_function_stack, _pop_mode, _push_mode

    if active == getattr(_thread, "mode", False):
        return
    stack = [_pop_mode() for _ in range(_len_torch_function_stack())]
    if active:
        _push_mode(_CurrentTPUDevice())
    for mode in reversed(stack):
        if not isinstance(mode, _CurrentTPUDevice):
            _push_mode(mode)
    _thread.mode = active


class device:
    """Context manager that makes ``device`` the current tpu device, as
    ``torch.cuda.device``: ``with torch.tpu.device(1): ...``. ``None`` or -1 change
    nothing. (``torch.utils.checkpoint`` enters it to read each device's RNG state.)"""

    def __init__(self, device):
        self.idx = -1 if device is None else _index(device)
        self.prev_idx = -1

    def __enter__(self):
        self.prev_idx = current_device()
        if self.idx not in (-1, self.prev_idx):
            set_device(self.idx)
        return self

    def __exit__(self, *exc_info) -> bool:
        if self.idx not in (-1, self.prev_idx):
            set_device(self.prev_idx)
        return False


def synchronize(device=None) -> None:
    """Wait until every op on the device has finished (raises pending value checks)."""
    from torchtpu.dispatch.synchronize import sync

    sync()


def get_device_name(device=None) -> str:
    """The chip's name, e.g. "TPU v5 lite", "NVIDIA H100", or "cpu (XLA)"."""
    from torchtpu.runtime import device_name

    return device_name(_index(device))


def get_device_capability(device=None) -> tuple[int, int]:
    """As ``torch.cuda.get_device_capability``: a GPU's compute capability (major,
    minor); for a TPU its generation and 0 (``(5, 0)`` for "TPU v5 lite"); (0, 0) for
    the CPU backend."""
    from torchtpu.runtime import device as jax_device

    dev = jax_device(_index(device))
    capability = getattr(dev, "compute_capability", None)
    if capability:
        major, _, minor = str(capability).partition(".")
        return int(major), int(minor or 0)
    if dev.platform == "tpu":
        digits = "".join(c if c.isdigit() else " " for c in dev.device_kind).split()
        return (int(digits[0]), 0) if digits else (0, 0)
    return (0, 0)


class _DeviceProperties(types.SimpleNamespace):
    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"_TPUDeviceProperties({fields})"


def get_device_properties(device=None) -> _DeviceProperties:
    """Name, platform, kind, capability and memory of a device. ``total_memory`` is
    ``mem_get_info``'s total: the chip's memory, or on the CPU backend the host's, where
    its arrays live (libraries size batches by it and divide by it)."""
    from torchtpu.runtime import device as jax_device
    from torchtpu.runtime import device_name

    index = _index(device)
    dev = jax_device(index)
    major, minor = get_device_capability(index)
    return _DeviceProperties(
        name=device_name(index),
        index=index,
        platform=dev.platform,
        device_kind=dev.device_kind,
        major=major,
        minor=minor,
        total_memory=memory.mem_get_info(index)[1],
    )


def manual_seed(seed) -> None:
    rng.manual_seed(seed, current_device())


def manual_seed_all(seed) -> None:
    rng.manual_seed_all(seed)


def seed() -> None:
    """Seed the current device with a non-deterministic random number (as torch.cuda.seed)."""
    manual_seed(_random_seed())


def seed_all() -> None:
    """Seed every device with one non-deterministic random number."""
    manual_seed_all(_random_seed())


def _random_seed() -> int:
    return int.from_bytes(os.urandom(8), "little")


def initial_seed() -> int:
    return rng.initial_seed(current_device())


def get_rng_state(device="tpu") -> torch.Tensor:
    return rng.get_state(_index(device))


def set_rng_state(new_state: torch.Tensor, device="tpu") -> None:
    rng.set_state(new_state, _index(device))


def get_rng_state_all() -> list[torch.Tensor]:
    return [rng.get_state(i) for i in range(device_count())]


def set_rng_state_all(new_states) -> None:
    for i, state in enumerate(new_states):
        rng.set_state(state, i)


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


class _DeviceModule(types.ModuleType):
    """Lets ``torch.tpu.eager_mode`` be read and assigned like an attribute, and shows
    its API only to ``dir()`` (not the modules and helpers it uses)."""

    def __dir__(self):
        return sorted([*__all__, "eager_mode"])

    @property
    def eager_mode(self) -> EagerMode:
        return modes.current()

    @eager_mode.setter
    def eager_mode(self, mode) -> None:
        modes.set_current(mode)


sys.modules[__name__].__class__ = _DeviceModule


# -- registration ---------------------------------------------------------------------------

# Factory ops whose PrivateUse1 kernel runs our lowering directly (instead of torch's
# "allocate, then fill in place" composite).
_FACTORIES = (
    "zeros",
    "_efficientzerotensor",
    "ones",
    "full",
    "scalar_tensor",
    "arange",
    "arange.start",
    "arange.start_step",
    "range",
    "range.step",
    "eye",
    "eye.m",
    "linspace",
    "logspace",
    "randperm",
    "randperm.generator",
    "tril_indices",
    "triu_indices",
)

_library = None


def _empty_memory_format(
    size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None
):
    return _empty(size, None, dtype, device, memory_format)


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _empty(size, stride, dtype, device, None)


def _empty(size, stride, dtype, device, memory_format):
    load_runtime()
    from torchtpu.tensor import empty_tensor

    dtype = dtype or torch.get_default_dtype()
    if stride is None:
        meta = torch.empty(
            size, dtype=dtype, device="meta", memory_format=memory_format or torch.contiguous_format
        )
        stride = meta.stride()
    return empty_tensor(tuple(size), tuple(stride), dtype, _index(device))


# Allocations of a quantized dtype (``torch.empty(2, dtype=torch.quint8, device="tpu")``,
# ``qtensor.to("tpu")``) go to the QuantizedPrivateUse1 key, where torch alone would only
# say that the "Quantizedtpu" backend lacks the op. tpu tensors hold no quantized dtype;
# say so, naming it, as for every other unsupported dtype.
_QUANTIZED_ALLOCATIONS = (
    "empty.memory_format",
    "empty_strided",
    "empty_quantized",
    "_empty_affine_quantized",
    "_empty_per_channel_affine_quantized",
)


def _quantized_allocation(*args, **kwargs):
    # torch reaches this key only from a quantized ``dtype``, which it always passes.
    dtypes.check_supported(kwargs["dtype"])


def _copy_from(self, dst, non_blocking=False):
    # Reached instead of __torch_dispatch__ where torch excludes Python dispatch while
    # filling a new tensor (``torch.tensor(data, device="tpu")``).
    return load_runtime()(torch.ops.aten.copy_.default, (dst, self, non_blocking), {})


def _local_scalar_dense(self):
    # ``torch.tensor([v.sum(), v.mean()])`` reads each 0-d tpu element with .item() while
    # torch has Python dispatch excluded (as it fills a new tensor): the result is a CPU
    # tensor of the values, as on CUDA.
    return load_runtime()(torch.ops.aten._local_scalar_dense.default, (self,), {})


def _ctc_loss_lengths_on_device(
    log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1, zero_infinity=False
):
    # F.ctc_loss takes length tensors on the CPU (documented; CUDA takes them). torch's
    # definition reads them there on a fast path that tensor subclasses skip; on theirs
    # (the lengths as tensors, autograd through _ctc_loss) the mean reduction divides by
    # target_lengths, so they must be on the device of log_probs. Copied there (values,
    # not constants: other lengths compile no new program).
    if input_lengths.device.type == "cpu" and target_lengths.device.type == "cpu":
        _check_ctc_lengths(log_probs, targets, input_lengths.tolist(), target_lengths.tolist())
    device = log_probs.device
    return torch.ops.aten.ctc_loss.Tensor.decompose(
        log_probs,
        targets,
        input_lengths.to(device),
        target_lengths.to(device),
        blank,
        reduction,
        zero_infinity,
    )


def _one_hot(self, num_classes=-1):
    # Note [one_hot's checks on tpu] (ops/indexing.py); the rest as torch's one_hot.
    if self.dtype != torch.long:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if self.numel() == 0:
        if num_classes <= 0:
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
        return self.new_empty((*self.shape, num_classes))
    if num_classes == -1:  # the classes are counted on the host, as on every device
        low, high = torch.stack([self.min(), self.max()]).tolist()
        if low < 0:
            raise RuntimeError("Class values must be non-negative.")
        num_classes = high + 1
    elif num_classes < -1:
        raise RuntimeError("Class values must be smaller than num_classes.")
    from torchtpu.ops.indexing import one_hot_checked

    return one_hot_checked(self, num_classes)


@functools.lru_cache(maxsize=256)
def _check_attention_arguments(described, dropout_p, is_causal, scale, enable_gqa) -> None:
    """torch's checks of attention's arguments, on meta tensors of these (shape, dtype)s:
    the composite on meta costs ~1.7 ms, so each signature that passes is remembered."""
    meta = [None if d is None else torch.empty(d[0], dtype=d[1], device="meta") for d in described]
    torch.ops.aten.scaled_dot_product_attention(
        *meta[:3], meta[3], dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


def _fits_attention_op(query, key, value, attn_mask, dropout_p, enable_gqa) -> bool:
    """Whether ops/attention.py takes the call: no dropout, a mask that needs no
    gradient and broadcasts to the scores, and q, k, v of one batch shape (heads
    grouped under ``enable_gqa``), none broadcast: its backward reduces nothing."""
    if (
        dropout_p > 0
        or not query.ndim == key.ndim == value.ndim
        or key.shape[:-1] != value.shape[:-1]
    ):
        return False
    if query.shape[:-2] != key.shape[:-2]:
        grouped = (
            enable_gqa
            and query.ndim >= 3
            and query.shape[:-3] == key.shape[:-3]
            and query.shape[-3] % key.shape[-3] == 0
        )
        if not grouped:
            return False
    if attn_mask is not None:
        scores = (*query.shape[:-1], key.shape[-2])
        try:
            fits = torch.broadcast_shapes(attn_mask.shape, scores) == scores
        except RuntimeError:
            return False
        if attn_mask.requires_grad or not fits:
            return False
    return True


# The dtypes linear and cross_entropy run as ops of their own (ops/linear.py, cross_entropy.py).
_FUSED_OP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fused_linear(input, weight, bias, dtype):
    """``linear`` as ops/linear.py's one op forward and one backward, with the inputs
    cast to ``dtype`` inside it (autocast's dtype; None: no casts), or None where the
    call takes torch's composite: tensors other than eager tpu tensors (torch.compile's
    traced wrappers, whose graph XLA fuses anyway; DTensor, functorch's wrappers),
    forward-mode AD, dtypes other than 16- and 32-bit floats, mixed dtypes without
    autocast, and shapes the composite would refuse or broadcast (its error then)."""
    from torchtpu.ops.linear import Linear
    from torchtpu.tensor import TPUTensor

    tensors = (input, weight) if bias is None else (input, weight, bias)
    if not all(
        isinstance(t, TPUTensor) and t._inner is None and t.dtype in _FUSED_OP_DTYPES
        for t in tensors
    ):
        return None
    if dtype is None and any(t.dtype != input.dtype for t in tensors):
        return None
    if weight.dim() != 2 or input.dim() == 0 or input.shape[-1] != weight.shape[1]:
        return None
    if bias is not None and tuple(bias.shape) != tuple(weight.shape[:1]):
        return None
    if torch.autograd.forward_ad._current_level >= 0:  # forward AD: the op has no jvp
        return None
    # The backward needs the input as the product saw it: kept by the forward when it
    # casts the input and a weight gradient will be asked for.
    keep_input = (
        dtype is not None
        and input.dtype != dtype
        and weight.requires_grad
        and torch.is_grad_enabled()
    )
    out, _kept = Linear.apply(input, weight, bias, dtype, keep_input)
    return out


def _autocast_linear(dtype, input, weight, bias=None):
    """``F.linear`` under autocast on tpu: its casts inside the op (or None)."""
    return _fused_linear(input, weight, bias, dtype)


def _linear(input, weight, bias=None):
    """``F.linear`` on tpu: one op forward and one backward (ops/linear.py), else
    torch's composite."""
    out = _fused_linear(input, weight, bias, None)
    if out is None:
        return torch.ops.aten.linear.default.decompose(input, weight, bias)
    return out


def _cross_entropy_loss(
    input, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0
):
    """``F.cross_entropy`` on tpu: for [N, C] logits and [N] class indices, one op
    forward and one backward (ops/cross_entropy.py), else torch's composite, as for
    `_fused_linear`'s refusals (and its errors for bad calls)."""
    from torchtpu.ops.cross_entropy import CrossEntropy
    from torchtpu.tensor import TPUTensor

    tensors = (input, target) if weight is None else (input, target, weight)
    fused = (
        all(isinstance(t, TPUTensor) and t._inner is None for t in tensors)
        and input.dtype in _FUSED_OP_DTYPES
        and input.dim() == 2
        and target.dtype == torch.int64
        and tuple(target.shape) == tuple(input.shape[:1])
        and (weight is None or (weight.dtype == input.dtype and tuple(weight.shape) == tuple(input.shape[1:])))
        and reduction in (0, 1, 2)
        and 0.0 <= label_smoothing <= 1.0
        and torch.autograd.forward_ad._current_level < 0
    )
    if not fused:
        return torch.ops.aten.cross_entropy_loss.default.decompose(
            input, target, weight, reduction, ignore_index, label_smoothing
        )
    # Under autocast torch's composite computes in float32 (log_softmax and nll_loss
    # are on its float32 list): so does the op, for 16-bit logits.
    dtype = None
    if input.dtype != torch.float32 and torch.is_autocast_enabled("tpu"):
        dtype = torch.float32
    loss = CrossEntropy.apply(input, target, weight, reduction, ignore_index, label_smoothing, dtype)
    if loss.grad_fn is not None:
        # Saved: the logits' values (16-bit where they are a ``.float()``), not the tensor.
        from torchtpu.dispatch import saved_values

        saved_values.save_values(loss.grad_fn, 0, input)
    return loss


def _scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """One op in the inputs' dtype instead of torch's float32 math path
    (ops/attention.py). torch's own checks of the arguments run first, on meta tensors,
    so a bad call raises the CPU's error (under torch.compile the arguments are fake
    tensors, checked when Dynamo traced the call). What the op does not take
    (`_fits_attention_op`) takes torch's math path."""
    from torchtpu.ops.attention import attention_op
    from torchtpu.tensor import TPUTensor

    if isinstance(query, TPUTensor):
        described = tuple(
            None if t is None else (tuple(t.shape), t.dtype) for t in (query, key, value, attn_mask)
        )
        # Symbolic sizes (torch.compile's dynamic shapes) are not hashable: checked
        # each time, without the cache.
        static = all(type(n) is int for d in described if d is not None for n in d[0])
        check = _check_attention_arguments if static else _check_attention_arguments.__wrapped__
        check(described, dropout_p, is_causal, scale, enable_gqa)
    if not _fits_attention_op(query, key, value, attn_mask, dropout_p, enable_gqa):
        return torch.ops.aten._scaled_dot_product_attention_math(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            None,
            scale=scale,
            enable_gqa=enable_gqa,
        )[0]
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])  # as torch: 1 / sqrt(E)
    return attention_op(query, key, value, attn_mask, is_causal, scale, enable_gqa)


def _check_ctc_lengths(log_probs, targets, input_lengths, target_lengths) -> None:
    """The CPU kernel's checks of lengths the host holds, in its order and words (the
    lowering checks lengths on the device too, without their values)."""

    def refuse(message):
        raise RuntimeError(message + " (while checking arguments for ctc_loss_allocate_outputs)")

    for name, lengths in (("target_lengths", target_lengths), ("input_lengths", input_lengths)):
        if any(n < 0 for n in lengths):
            refuse(f"Expected {name} to have value at least 0, but got value {min(lengths)}")
    if targets.dim() == 1 and targets.shape[0] != sum(target_lengths):
        refuse(
            f"Expected tensor to have size {sum(target_lengths)} at dimension 0, but got size "
            f"{targets.shape[0]} for argument #2 'targets'"
        )
    if targets.dim() == 2 and targets.shape[1] < max(target_lengths, default=0):
        refuse(
            f"Expected tensor to have size at least {max(target_lengths)} at dimension 1, but "
            f"got size {targets.shape[1]} for argument #2 'targets'"
        )
    longest = log_probs.shape[0]
    if any(n > longest for n in input_lengths):
        refuse(
            f"Expected input_lengths to have value at most {longest}, but got value "
            f"{next(n for n in input_lengths if n > longest)}"
        )


def _factory_kernel(op):
    def kernel(*args, **kwargs):
        return load_runtime()(op, args, kwargs)

    return kernel


_dispatch = None


def load_runtime():
    """The dispatcher, imported on first use (it imports JAX): importing it and
    torch.compile's handles installs their entry points into TPUTensor (tensor.py
    ``hooks``). Every tpu tensor is first made by a kernel here, which calls this."""
    global _dispatch
    if _dispatch is None:
        _compat.check_torch()
        before = set(sys.modules)
        try:
            import torchtpu.compile.flex_attention  # noqa: F401
            import torchtpu.compile.handles  # noqa: F401
            import torchtpu.interop.arrays  # noqa: F401  (TPUTensor's DLPack protocol)
            from torchtpu.dispatch.core import dispatch
        except BaseException:
            # Never half a table: what this attempt imported goes, with the torch ops it
            # defined, so the next one (and its error) starts from scratch instead of
            # registering lowerings or defining ops twice.
            for name in set(sys.modules) - before:
                if name.startswith("torchtpu."):
                    for value in list(vars(sys.modules.pop(name)).values()):
                        if isinstance(value, torch.library.Library):
                            _compat.destroy_library(value)
                    # A package imported before keeps its submodule as an attribute,
                    # which ``from package import submodule`` would take: gone too.
                    parent, _, child = name.rpartition(".")
                    if parent in before and getattr(sys.modules.get(parent), child, None):
                        delattr(sys.modules[parent], child)
            raise
        _dispatch = dispatch
    return _dispatch


def register() -> None:
    """Make "tpu" a torch device backed by torchtpu (idempotent)."""
    global _library
    if _library is not None:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend("tpu", backend_module=sys.modules[__name__])
    _library = torch.library.Library("aten", "IMPL")
    _library.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
    _library.impl("empty_strided", _empty_strided, "PrivateUse1")
    _library.impl("_copy_from", _copy_from, "PrivateUse1")
    _library.impl("_local_scalar_dense", _local_scalar_dense, "PrivateUse1")
    _library.impl("ctc_loss.Tensor", _ctc_loss_lengths_on_device, "AutogradPrivateUse1")
    _library.impl("one_hot", _one_hot, "AutogradPrivateUse1")
    _library.impl(
        "scaled_dot_product_attention", _scaled_dot_product_attention, "AutogradPrivateUse1"
    )
    _library.impl("linear", _linear, "AutogradPrivateUse1")
    _library.impl("cross_entropy_loss", _cross_entropy_loss, "AutogradPrivateUse1")
    for name in _QUANTIZED_ALLOCATIONS:
        _library.impl(name, _quantized_allocation, "QuantizedPrivateUse1")
    for name in _FACTORIES:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        _library.impl(name, _factory_kernel(op), "PrivateUse1")
    pinned.register(_library)
    torch.Generator = rng.Generator
    # The legacy capsule of a tpu tensor is its jax array's (tensor.py to_dlpack).
    from torchtpu.tensor import swap_tensors, to_dlpack

    torch.utils.dlpack.to_dlpack = torch.to_dlpack = to_dlpack
    # Note [Converting a module's tpu parameters] (tensor.py)
    torch.utils.swap_tensors = swap_tensors
    serialization.register()
    _use_foreach_kernels()
    memory.route_accelerator_functions()
    autocast.register()
    autocast.casts_inside["linear"] = _autocast_linear
    distributed.register()
    # torch.compile(model) with its default backend compiles tpu graphs as backend="tpu".
    _compat.inductor_hands_graphs_on("tpu", _tpu_backend)


def _tpu_backend():
    from torchtpu.compile.backend import tpu_backend

    return tpu_backend


def _use_foreach_kernels() -> None:
    """Let optimizers and ``clip_grad_norm_`` take their ``_foreach_`` path on tpu by
    default, as on CUDA.

    torch chooses it only for tensors whose type is listed in
    ``torch.optim.optimizer._foreach_supported_types`` (and its twin in
    ``torch.utils._foreach_utils``); a wrapper subclass is not, so every optimizer ran its
    per-parameter loop: an Adam step of N parameters dispatched ~10·N ops instead of ~10.
    Every ``_foreach_`` op has a lowering (ops/foreach.py); DTensor lists itself the same
    way (torch/distributed/tensor/__init__.py)."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    from torchtpu.tensor import TPUTensor

    for supported in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if TPUTensor not in supported:
            supported.append(TPUTensor)
