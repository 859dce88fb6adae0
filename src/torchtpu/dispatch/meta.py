"""The meta oracle: torch's own output shapes, strides and dtypes for an op call, and
torch's own exception for bad input, before any JAX code runs.

The op runs on meta tensors of the arguments' shapes, strides and dtypes. Where a meta
kernel rejects input with another exception type than the CPU kernel (RuntimeError for
IndexError), the rejected call is replayed on small CPU zeros to raise what the CPU
raises. Lowerings that know their meta kernel disagrees with the CPU's say so at
registration (``meta="skip"``, ``meta="check_only"``, ``statistics_dtype="cpu"``).
"""

from __future__ import annotations

import torch

from torchtpu import dtypes
from torchtpu.dispatch.schema import SchemaInfo
from torchtpu.dispatch.signature import TENSOR, TENSOR_LIST, Rules
from torchtpu.dispatch.values import OutMeta
from torchtpu.observe.locations import name_op

META = torch.device("meta")


def meta_tensor(meta: tuple) -> torch.Tensor:
    shape, strides, offset, dtype, _ = meta
    extent = offset + sum((n - 1) * s for n, s in zip(shape, strides) if n > 0) + 1
    if 0 in shape:
        extent = offset + 1
    base = torch.empty(extent, dtype=dtype, device=META)
    return base.as_strided(shape, strides, offset)


def meta_values(rules: Rules, key: tuple, values: list) -> list:
    """The op's arguments (bound, with their key) with every tensor replaced by a
    meta tensor like it."""
    memo: dict = {}
    slots: list = []

    def tensor(part, value):
        if part is None:
            return None
        if type(part) is type:  # a Python number where the schema says Tensor
            return value
        if part[0] == "c":
            return torch.empty((), dtype=part[1], device=META)
        if len(part) == 5:  # a tensor on a storage not seen before
            slot, meta = len(slots), part
            slots.append(slot)
        elif part[0] is None:
            slot, meta = len(slots), part[1]
            slots.append(slot)
        else:
            slot, meta = part
        if (slot, meta) not in memo:
            memo[(slot, meta)] = meta_tensor(meta)
        return memo[(slot, meta)]

    out = []
    for kind, part, value in zip(rules.kinds, key, values):
        if kind is TENSOR:
            out.append(tensor(part, value))
        elif kind is TENSOR_LIST:
            out.append(None if part is None else [tensor(p, v) for p, v in zip(part[1:], value)])
        elif isinstance(value, torch.device) and value.type == "tpu":
            out.append(META)
        elif isinstance(value, torch.Generator):
            out.append(None)
        else:
            out.append(value)
    return out


def run_meta(op, info: SchemaInfo, margs: list):
    """Torch's own shapes, strides, dtypes and errors for this call, or None."""
    args, kwargs = info.split(margs)
    try:
        return op(*args, **kwargs)
    except NotImplementedError as exc:
        # Only a missing Meta kernel means "no oracle"; anything else (a quantized
        # dtype, an unsupported combination) is torch's answer for this input.
        if "'Meta' backend" in str(exc) or "no fake impl or Meta kernel" in str(exc):
            return None
        raise name_op(as_on_cpu(op, args, kwargs, exc), op) from None
    except Exception as exc:
        raise name_op(as_on_cpu(op, args, kwargs, exc), op) from None


# Note [Dtype checks only the CPU kernels make]
#     These ops' CPU kernels refuse tensors of mixed dtypes ("expected m1 and m2 to
#     have the same dtype", "index_add_(): self (Float) and source (Double) must have
#     the same scalar type") where their meta kernels compute a result, so the meta
#     oracle alone would let a float64 source into a float32 ``index_add_``. A call of
#     one of them whose tensors are not all of one dtype is replayed on CPU zeros when
#     its plan is built (once per signature: never on the hot path), and the CPU's
#     error is raised. The replay also accepts what the CPU accepts (a bfloat16 input
#     with float32 norm parameters, int64 indices). The list comes from running every
#     OpInfo's samples with one float argument recast to float64 on the CPU and on tpu
#     (tests/test_errors.py checks it).
_DTYPES_CHECKED_BY_CPU = frozenset(
    {
        # matrix products and convolutions
        "mm", "addmm", "addbmm", "bmm", "baddbmm", "mv", "addmv", "_cdist_forward",
        "convolution",
        # attention
        "_scaled_dot_product_flash_attention_for_cpu",
        # vector functions
        "cross", "linalg_cross", "heaviside", "polar", "complex", "linalg_lstsq",
        # normalizations, softmax, losses, sampling
        "native_group_norm", "native_layer_norm", "native_batch_norm",
        "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
        "_batch_norm_with_update", "_batch_norm_no_update", "_softmax_backward_data",
        "binary_cross_entropy", "nll_loss_forward", "nll_loss2d_forward",
        "grid_sampler_2d", "grid_sampler_3d", "_embedding_bag", "_embedding_bag_forward_only",
        # writes of a source into self
        "index_copy", "index_add", "index_reduce", "index_put", "_index_put_impl",
        "_unsafe_masked_index_put_accumulate", "put",
        # histograms
        "histogram", "_histogramdd_bin_edges", "_histogramdd_from_bin_tensors",
        "_histogramdd_from_bin_cts",
    }
)  # fmt: skip


def dtypes_checked_by_cpu(op) -> bool:
    """Whether ``op``'s CPU kernel checks dtypes its meta kernel does not (Note [Dtype
    checks only the CPU kernels make]); in-place variants are named with a trailing _."""
    return op._schema.name.split("::")[-1].rstrip("_") in _DTYPES_CHECKED_BY_CPU


def check_dtypes_as_cpu(op, info: SchemaInfo, margs: list) -> None:
    """Raise the CPU kernel's error for a call mixing dtypes it refuses (Note [Dtype
    checks only the CPU kernels make])."""
    if not dtypes_checked_by_cpu(op):
        return
    leaves = torch.utils._pytree.tree_leaves(margs)
    if len({t.dtype for t in leaves if isinstance(t, torch.Tensor)}) < 2:
        return
    args, kwargs = info.split(margs)
    error = as_on_cpu(op, args, kwargs, None, _DTYPE_REPLAY_ELEMENTS)
    if error is not None:
        raise name_op(error, op) from None


def check_complex_as_cpu(op, info: SchemaInfo, margs: list) -> None:
    """Raise the CPU kernel's refusal of complex input (``torch.maximum``, ``max``,
    ``sort``, ``clamp`` ... are not implemented for complex tensors; their meta kernels
    accept them). A call with a complex tensor is replayed on CPU zeros, once per
    signature."""
    leaves = torch.utils._pytree.tree_leaves(margs)
    if not any(isinstance(t, torch.Tensor) and t.is_complex() for t in leaves):
        return
    args, kwargs = info.split(margs)
    with torch.random.fork_rng(devices=[]):  # a random op's replay draws from the CPU's
        error = as_on_cpu(op, args, kwargs, None, _DTYPE_REPLAY_ELEMENTS)
    if isinstance(error, NotImplementedError) or (
        error is not None and "complex" in str(error).lower()
    ):
        raise name_op(error, op) from None


# Note [In-place ops on overlapping memory]
#     torch's CPU kernels refuse an in-place op whose input partly overlaps the tensor
#     it writes (``x[1:].add_(x[:-1])``: TensorIterator's memory-overlap check); meta
#     tensors share no memory, so the oracle cannot see it. Where a written argument
#     shares a storage with another argument -- part of the plan's key, so this runs
#     once per signature -- the call is replayed on CPU zeros laid out in one buffer per
#     storage, and an overlap error the CPU raises is raised here. (``out=`` tensors
#     are checked in out_tensors.py.)


def check_overlap_as_cpu(op, info: SchemaInfo, values: list) -> None:
    """Raise the CPU kernel's memory-overlap error for an in-place call whose input
    overlaps what it writes (Note [In-place ops on overlapping memory])."""
    written = [i for i in info.mutable if i not in info.out_args]
    if not written:
        return
    leaves = [(i, t) for i, v in enumerate(values) for t in _tensor_leaves(v)]
    written_storages = {id(t._storage) for i, t in leaves if i in written}
    if not any(i not in written and id(t._storage) in written_storages for i, t in leaves):
        return
    groups: dict[int, list] = {}
    for _, t in leaves:
        groups.setdefault(id(t._storage), []).append(t)
    buffers = {}
    for key, tensors in groups.items():
        if len({t.dtype for t in tensors}) > 1:
            return  # views of another dtype (x.view(torch.int32)): not replayed
        extent = max(
            t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
            for t in tensors
        )
        if extent > _DTYPE_REPLAY_ELEMENTS:
            return
        buffers[key] = torch.zeros(max(extent, 0), dtype=tensors[0].dtype)

    def on_cpu(value):
        if _is_tpu_tensor(value):
            return buffers[id(value._storage)].as_strided(
                value.shape, value.stride(), value.storage_offset()
            )
        return value

    args, kwargs = info.split([torch.utils._pytree.tree_map(on_cpu, v) for v in values])
    try:
        with torch.random.fork_rng(devices=[]):  # a random op's replay draws from the CPU's
            op(*args, **kwargs)
    except Exception as cpu_error:  # noqa: BLE001 - only the overlap error is ours to raise
        if isinstance(cpu_error, RuntimeError) and "memory location" in str(cpu_error):
            raise name_op(cpu_error, op) from None


def _is_tpu_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, "_storage", None) is not None


def _tensor_leaves(value) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(value) if _is_tpu_tensor(t)]


# Below this many elements, a call the meta kernel rejected is replayed on CPU zeros.
_CPU_REPLAY_ELEMENTS = 1 << 20
# The dtype checks replay calls of any size a host holds easily: most of them fail at
# once, and the others run once per signature.
_DTYPE_REPLAY_ELEMENTS = 1 << 26


def as_on_cpu(
    op, args, kwargs, meta_error: Exception | None, limit: int = _CPU_REPLAY_ELEMENTS
) -> Exception | None:
    """The exception the CPU kernel raises for this call (of at most ``limit``
    elements), or ``meta_error``."""
    leaves = [
        t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
    ]
    if sum(t.numel() for t in leaves) > limit:
        return meta_error

    # LAPACK's pivots are 1-based and unchecked: a pivot of 0 makes the CPU kernel read
    # out of bounds (torch 2.11's ldl_solve aborted the process), so they replay as 1s.
    pivots = any(a.name.endswith("pivots") for a in op._schema.arguments)

    def on_cpu(value):
        if isinstance(value, torch.Tensor):
            fill = 1 if pivots and not (value.is_floating_point() or value.is_complex()) else 0
            return torch.full_like(value, fill, device="cpu")
        if isinstance(value, torch.device) and value.type == "meta":
            return torch.device("cpu")
        return value

    cpu_args, cpu_kwargs = torch.utils._pytree.tree_map(on_cpu, (args, kwargs))
    try:
        op(*cpu_args, **cpu_kwargs)
    except Exception as cpu_error:
        return cpu_error
    return meta_error


def out_meta(t: torch.Tensor) -> OutMeta:
    if t.dtype not in dtypes.SUPPORTED:
        dtypes.check_supported(t.dtype, "result")
    return OutMeta(tuple(t.shape), tuple(t.stride()), t.dtype)


def cpu_statistics_dtype(outputs: list, args: dict, unknown: OutMeta) -> None:
    """Normalization ops whose outputs 1 and 2 are the mean and inverse std: for a
    16-bit input torch's CPU kernels return them in the input's dtype, or in float32
    where a parameter (weight, bias, running stats) is float32; the meta kernels
    follow CUDA's (float32 for layer and batch norm, the input's dtype for group
    norm)."""
    x = args["input"]
    if x.dtype not in (torch.float16, torch.bfloat16):
        return
    params = [args.get(n) for n in ("weight", "bias", "running_mean", "running_var")]
    mixed = any(p is not None and p.dtype == torch.float32 for p in params)
    for i in (1, 2):
        if outputs[i] not in (None, unknown):
            outputs[i] = outputs[i]._replace(dtype=torch.float32 if mixed else x.dtype)


def on_meta(args, kwargs):
    """``args`` and ``kwargs`` with each tpu tensor replaced by a meta tensor like it,
    and each tpu device by the meta device."""
    from torch.utils._pytree import tree_map

    from torchtpu.tensor import TPUTensor

    def one(value):
        if isinstance(value, TPUTensor):
            return meta_tensor(value._meta)
        if isinstance(value, torch.device) and value.type == "tpu":
            return META
        return value

    return tree_map(one, (args, kwargs))
