"""What torch checks and does with the tensors a mutating op writes, before it computes.

An ``out=`` op (``torch.add(a, b, out=o)``) and an in-place op whose functional variant
takes its arguments in another order (``polygamma_``) run as their functional variant
followed by ``copy_`` (core.py). Before that, `check` does what torch's kernels do
first: it runs the op's meta kernel on meta copies of the arguments, which raises
torch's own error where a result cannot be cast to the tensor written, and gives the
size an ``out=`` tensor of another shape is resized to (with torch's warning); and it
refuses ``out=`` tensors that overlap an input in memory, as the CPU kernels do.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false, make_contiguous_strides_for
from torch.utils._pytree import tree_flatten, tree_map

from torchtpu.dispatch.meta import as_on_cpu
from torchtpu.observe.locations import name_op, user_stacklevel

aten = torch.ops.aten

# The CPU kernels that refuse an out tensor sharing any memory with an input
# (at::assert_no_overlap), before and after resizing it; the others refuse only a
# partial overlap, before resizing.
_NO_OVERLAP_AT_ALL = frozenset(
    {"index_select", "take", "gather", "kthvalue", "cat", "masked_select"}
)

# The CPU kernels that take only out tensors of the result's own dtype, where the others
# take any dtype the result can be cast to; their meta kernels leave the check out.
# Found as the dtype checks of meta.py (Note [Dtype checks only the CPU kernels make]),
# with a float64 out tensor for a float32 result.
_OUT_DTYPE_EXACT = frozenset(
    {
        "complex", "polar", "multinomial", "aminmax", "amax", "amin",
        # elementwise
        "neg", "round", "conj_physical", "nan_to_num", "heaviside", "gelu", "softplus",
        "softshrink", "hardshrink", "log_sigmoid_forward", "renorm",
        # indexing and shapes
        "index_select", "index_copy", "index_add", "take", "masked_select", "slice_scatter",
        "scatter_reduce", "diag", "diag_embed", "tril", "triu", "unfold_copy",
        # reductions, scans, sorting
        "softmax", "_softmax", "logcumsumexp", "_logcumsumexp", "histc", "sort", "msort", "avg_pool3d",
        # linear algebra
        "cross", "linalg_cross", "ormqr", "lu_solve", "linalg_lu_solve", "linalg_solve",
        "_linalg_solve_ex", "linalg_solve_triangular", "linalg_ldl_solve", "_linalg_eigh",
        "linalg_eigvalsh",
    }
)  # fmt: skip

_OVERLAP_MESSAGE = (
    "unsupported operation: some elements of the input tensor and the written-to tensor "
    "refer to a single memory location. Please clone() the tensor before performing the "
    "operation."
)


def check(info, values: list) -> None:
    """torch's checks of the tensors ``info.op`` writes, given its bound arguments."""
    if info.out_args:
        _check_overlap(info, values, _outs(info, values))

    def to_meta(v):
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        return v

    metas = [tree_map(to_meta, v) for v in values]
    args, kwargs = info.split(metas)
    try:
        info.op(*args, **kwargs)
    except NotImplementedError:
        return  # no meta kernel: copy_ into the out tensors checks their shapes
    except Exception as exc:
        # The CPU kernel words some errors otherwise ("result type Float can't be cast
        # to the desired output type Long"): replayed on CPU zeros, on this error path only.
        raise name_op(as_on_cpu(info.op, args, kwargs, exc), info.op) from None
    if _name(info) in _OUT_DTYPE_EXACT:
        _check_exact_dtypes(info, values, metas)
    outs, sizes = _outs(info, values), [m.shape for m in _outs(info, metas)]
    if _name(info) in _NO_OVERLAP_AT_ALL:
        # An out tensor resized within its storage may come to overlap an input
        # (gather(x, 0, i[1:], out=i[:1])): the CPU checks it as resized.
        resized = [_as_resized(out, size) for out, size in zip(outs, sizes)]
        _check_overlap(info, values, [r for r in resized if r is not None])
    for out, size in zip(outs, sizes):
        if out.shape != size:
            aten.resize_.default(out, size)


def fit(info, out: torch.Tensor, result: torch.Tensor) -> None:
    """Before ``result`` is copied into ``out``: the exact-dtype check, and the resize
    to the result's size, of an op whose meta kernel could not give them beforehand."""
    if _name(info) == "nonzero" and out.dtype != torch.int64:
        # (torch's own wording, missing space included)
        raise RuntimeError(
            "nonzero: Expected out tensor to have scalar type Long but got scalar type"
            f"{_scalar_type_name(out.dtype)}"
        )
    if _name(info) in _OUT_DTYPE_EXACT and out.dtype != result.dtype:
        raise RuntimeError(
            f"{info.op}: Expected out tensor to have dtype {result.dtype}, but got "
            f"{out.dtype} instead"
        )
    if out.shape != result.shape:
        _resize_out(out, result.shape)


def _scalar_type_name(dtype: torch.dtype) -> str:
    """c10's name of a dtype, as torch's messages print it (torch.float32: "Float")."""
    return torch.empty(0, dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")


def _resize_out(out: torch.Tensor, size) -> None:
    """Resize an out= tensor to the result's size, with torch's warning where it held
    elements (as at::native::resize_output)."""
    if out.numel() != 0:
        warnings.warn(
            f"An output with one or more elements was resized since it had shape "
            f"{list(out.shape)}, which does not match the required output shape "
            f"{list(size)}. This behavior is deprecated, and in a future PyTorch release "
            "outputs will not be resized unless they have zero elements. You can explicitly "
            "reuse an out tensor t by resizing it, inplace, to zero elements with t.resize_(0).",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    aten.resize_.default(out, tuple(size))


def _check_exact_dtypes(info, values: list, metas: list) -> None:
    from torchtpu.dispatch import schema

    functional = schema.functional_variant(info.op)
    by_name = {a.name: m for a, m in zip(info.args, metas)}
    f_info = schema.info(functional)
    args, kwargs = f_info.split([by_name[a.name] for a in f_info.args])
    results = functional(*args, **kwargs)
    results = results if isinstance(results, (tuple, list)) else [results]
    outs = _outs(info, values)
    for out, result in zip(outs, results):
        if out.dtype != result.dtype:
            raise RuntimeError(
                f"{info.op}: Expected out tensor to have dtype {result.dtype}, but got "
                f"{out.dtype} instead"
            )


def _name(info) -> str:
    return info.op._schema.name.split("::")[-1]


def _outs(info, values: list) -> list:
    return [t for i in info.out_args for t in _tensors(values[i])]


def _as_resized(out: torch.Tensor, size) -> torch.Tensor | None:
    """``out`` as resize_ lays it out in memory: in place (contiguous, at its offset)
    where its storage holds the new size, else in new memory (None: overlaps nothing)."""
    if out.shape == size:
        return out
    storage = getattr(out, "_storage", None)
    if storage is None or not storage.holds(out.storage_offset(), math.prod(size)):
        return None
    return out.as_strided(size, make_contiguous_strides_for(size), out.storage_offset())


def _check_overlap(info, values: list, outs: list) -> None:
    inputs = [t for i, v in enumerate(values) if i not in info.mutable for t in _tensors(v)]
    any_overlap = _name(info) in _NO_OVERLAP_AT_ALL
    for out in outs:
        if any(n > 1 and s == 0 for n, s in zip(out.shape, out.stride())):
            raise RuntimeError(
                f"{info.op}: unsupported operation: more than one element of the written-to "
                "tensor refers to a single memory location. Please clone() the tensor before "
                "performing the operation."
            )
        for x in inputs:
            status = _overlap(out, x)
            if status == "partial" or (status == "full" and any_overlap):
                raise RuntimeError(f"{info.op}: {_OVERLAP_MESSAGE}")


def _tensors(value) -> list:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _overlap(a: torch.Tensor, b: torch.Tensor) -> str:
    """torch's get_overlap_status of two tensors: "full", "partial", "no" or "too hard"."""
    if a is b:
        return "full"
    if a.numel() == 0 or b.numel() == 0:
        return "no"
    if getattr(a, "_storage", None) is None or a._storage is not getattr(b, "_storage", None):
        return "no"
    if not (is_non_overlapping_and_dense_or_false(a) and is_non_overlapping_and_dense_or_false(b)):
        return "too hard"
    a_begin, b_begin = a.storage_offset(), b.storage_offset()
    a_end, b_end = a_begin + a.numel(), b_begin + b.numel()
    if (a_begin, a_end) == (b_begin, b_end):
        return "full" if a.stride() == b.stride() else "partial"
    return "partial" if a_begin < b_end and b_begin < a_end else "no"
