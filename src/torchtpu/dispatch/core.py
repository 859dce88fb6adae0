"""The body of ``TPUTensor.__torch_dispatch__``: choose how an aten op runs, and run it.

For each op overload, once, a *handler* is chosen (`_choose`), in this order:

1. a special handler: moving data between devices, reading a value, allocation,
   metadata-only ops (``detach``, ``alias``) -- the few ops that are not computations;
2. the op's lowering: a view op makes a tensor that shares storage (`_view`),
   any other op runs as a compiled plan (plans.py); the special handlers are in
   special.py, the view handlers in views.py;
3. for a mutating op, its functional variant: for an in-place op (``add_``,
   ``_foreach_mul_``) its lowering, with the write-back compiled into the same
   function; for an ``out=`` op (``add.out``), torch's meta checks and resizing of the
   out tensors, the functional variant, then ``copy_`` into them;
4. a decomposition: torch's own CompositeImplicitAutograd definition, else one from
   ``torch._decomp``, into ops that have lowerings;
5. for a mutating op, its functional variant's decomposition followed by ``copy_``;
   for an ``out=`` factory (``rand.out``), the factory followed by ``copy_``; for
   another library's op, its own PrivateUse1 kernel (FSDP2's ``fsdp.*`` copies);
6. the CPU fallback (fallback.py): counted, warned once per op, or an error.
"""

from __future__ import annotations

import functools
import warnings

import torch

from torchtpu import rng
from torchtpu import storage as storage_module
from torchtpu import tensor as tensor_module
from torchtpu.dispatch import backward_errors, factory_out, out_tensors, plans, schema
from torchtpu.dispatch import meta as oracle
from torchtpu.dispatch.fallback import run_on_cpu
from torchtpu.dispatch.special import SPECIAL, run_on_host
from torchtpu.dispatch.views import inplace_view_handler, view_handler
from torchtpu.observe import metrics
from torchtpu.observe.locations import add_context, user_stacklevel
from torchtpu.ops import TABLE

aten = torch.ops.aten

_HANDLERS: dict = {}


# Callables shown every op's (args, kwargs) before it runs: torchtpu.jit's watchers
# of which storages a step touches (compile/jit.py). Almost always empty.
watchers: list = []


def dispatch(func, args, kwargs):
    if backward_errors._raised and not backward_errors.in_backward():
        backward_errors.raise_deferred()
    if watchers:
        for watch in watchers:
            watch(args, kwargs)
    handler = _HANDLERS.get(func)
    if handler is None:
        handler = _HANDLERS[func] = _handler(func)
    try:
        return handler(func, args, kwargs)
    except Exception as exc:
        if not backward_errors.in_backward():
            raise
        # Note [Why backward errors are deferred]
        return backward_errors.poisoned(func, args, kwargs, exc)


def _handler(func):
    """`_choose`'s handler, wrapped for what the op's lowering asks at registration."""
    handler = _choose(func)
    if oracle.dtypes_checked_by_cpu(func) and not getattr(handler, "builds_plans", False):
        handler = _dtypes_as_cpu(handler, func)
    lowering = TABLE.get(func) or TABLE.get(schema.functional_variant(func))
    if lowering is not None and lowering.index_list:
        handler = _integer_indices(handler)
    if func in _BATCH_NORM_TRAINING_ARG:
        handler = _empty_stats_in_eval(handler, func)
    if func._schema.name in ("aten::index_fill", "aten::index_fill_"):
        handler = _index_fill_bounds(handler)
    if lowering is not None and lowering.factors_as_laid_out:
        handler = _factor_as_laid_out(handler)
    if func not in SPECIAL and any(a.name == "device" for a in func._schema.arguments):
        handler = _on_host_when_asked(handler)
    names = [a.name for a in func._schema.arguments]
    if "generator" in names:
        handler = _from_generator(handler, names.index("generator"))
    return handler


def _dtypes_as_cpu(handler, func):
    """Ops computed without a plan (decomposed, data-dependent shapes) whose CPU kernel
    refuses mixed dtypes: checked as builder.py checks the others, once per combination
    of dtypes (Note [Dtype checks only the CPU kernels make] in meta.py)."""
    info = schema.info(func)
    passed: set = set()

    def with_cpu_dtype_checks(func, args, kwargs):
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        key = tuple(t.dtype for t in leaves if isinstance(t, torch.Tensor))
        if key not in passed:
            margs, mkwargs = oracle.on_meta(args, kwargs)
            oracle.check_dtypes_as_cpu(func, info, info.bind(margs, mkwargs))
            passed.add(key)
        return handler(func, args, kwargs)

    return with_cpu_dtype_checks


def _from_generator(handler, position: int):
    """Random ops given ``generator=torch.Generator(device="tpu")`` draw from it
    (Note [tpu generators from Python] in rng.py); the op itself sees no generator."""

    def with_generator(func, args, kwargs):
        if len(args) > position:
            generator = args[position]
            if generator is None:
                return handler(func, args, kwargs)
            args = args[:position] + (None,) + args[position + 1 :]
        else:
            generator = kwargs.get("generator")
            if generator is None:
                return handler(func, args, kwargs)
            kwargs = {**kwargs, "generator": None}
        with rng.drawing_from(rng.state_of(generator, func)):
            return handler(func, args, kwargs)

    return with_generator


def _factor_as_laid_out(handler):
    """Ops whose LU output is that of A^T for a contiguous real A and that of A
    otherwise (LAPACK is column-major), with backward formulas that ask
    A.is_contiguous() which it was (``@lowers(..., factors_as_laid_out=True)``).
    Lowerings see values, not strides: they always factor A^T, so a non-contiguous
    real A is passed as the contiguous B = A^T-laid-out copy, whose B^T is A."""

    def as_laid_out(func, args, kwargs):
        a = args[0]
        if not a.is_complex() and not a.is_contiguous():
            args = (a.mT.contiguous(),) + tuple(args[1:])
        return handler(func, args, kwargs)

    return as_laid_out


def _on_host_when_asked(handler):
    """Ops with a ``device`` argument make their result where it says: ``x.new_zeros(2,
    device="cpu")`` and ``torch.linspace(tpu_start, 5, 4, device="cpu")`` are CPU
    tensors, computed from tpu inputs copied to the host. (Not the CPU fallback: the
    CPU is where the result was asked for.)"""

    def on_host_when_asked(func, args, kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cpu":
            return run_on_host(func, args, kwargs)
        return handler(func, args, kwargs)

    return on_host_when_asked


# Batch norm ops and the position of their `training` argument (None: always eval).
# In eval mode torch's CPU and CUDA kernels return the saved mean and invstd empty,
# while the meta kernels (our shape oracle) size them (C,).
_BATCH_NORM_TRAINING_ARG = {
    aten._native_batch_norm_legit.default: 5,
    aten._native_batch_norm_legit_no_training.default: None,
    aten._batch_norm_no_update.default: None,
}


def _empty_stats_in_eval(handler, func):
    position = _BATCH_NORM_TRAINING_ARG[func]
    info = schema.info(func)

    def with_empty_stats(func, args, kwargs):
        result = handler(func, args, kwargs)
        if position is not None and info.bind(args, kwargs)[position]:
            return result
        out, mean, invstd, *rest = result
        return (out, mean.new_empty((0,)), invstd.new_empty((0,)), *rest)

    return with_empty_stats


def _integer_indices(handler):
    """Ops taking a list of indices (``@lowers(..., index_list=True)``), as advanced
    indexing does. torch turns a boolean mask into the integer indices of its True
    elements before indexing; that count depends on values, so it happens here, op by
    op (nonzero), and the op itself stays compiled. Index tensors on the CPU are
    accepted and moved to the device, as CUDA's ``index`` and ``index_put_`` do
    (``x[torch.tensor([1])]``, ``x[cpu_mask] = 0``); a CPU mask is resolved on the CPU."""

    def with_integer_indices(func, args, kwargs):
        self, indices = args[0], args[1]
        if any(i is not None and (i.dtype in _MASKS or i.device != self.device) for i in indices):
            if func in _MASKED_PUTS and (put := _masked_put(func, args, kwargs)) is not None:
                return put
            expanded = []
            for i in indices:
                if i is not None and i.dtype in _MASKS:
                    _warn_if_uint8(i)
                    _check_mask_shape(self, i, len(expanded))
                    expanded.extend(aten.nonzero.default(i).unbind(1))
                else:
                    expanded.append(i)
            if any(i is not None and i.device != self.device for i in expanded):
                expanded = [i if i is None or i.dim() == 0 else i.to(self.device) for i in expanded]
            args = (self, expanded) + tuple(args[2:])
        _check_known_indices(func, self, args)
        return handler(func, args, kwargs)

    return with_integer_indices


def _warn_if_uint8(mask) -> None:
    if mask.dtype == torch.uint8:  # as torch's index kernels warn, per mask
        warnings.warn(
            "indexing with dtype torch.uint8 is now deprecated, please use a "
            "dtype torch.bool instead.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def _check_known_indices(func, self, args) -> None:
    """torch's IndexError, at once, for an index whose values the host holds: a CPU
    tensor, or a small one just uploaded (Note [Host copies of uploads]). Others are
    checked on the device, when a value is next read. Worded as the CPU kernel words
    it, which numbers the index tensors, not the dims they index."""
    indexed = -1
    for dim, i in enumerate(args[1]):
        if i is None or dim >= self.dim():
            continue
        indexed += 1
        host = _host_values(i)
        if host is None or host.dtype in _MASKS:
            continue
        size = self.shape[dim]
        value = _out_of_bounds(host, size)
        if value is not None:
            if size == 0:
                exc = IndexError("index is out of bounds for dimension with size 0")
            else:
                exc = IndexError(
                    f"index {value} is out of bounds for dimension {indexed} with size {size}"
                )
            raise add_context(exc, func, args)


def _host_values(index):
    """The values of an index tensor the host holds (a CPU tensor, or a small one just
    uploaded: Note [Host copies of uploads]), or None."""
    if index.device.type == "cpu":
        return index
    return None if index._chain else storage_module.host_copy(index._storage)


def _out_of_bounds(host, size: int):
    """The first index in ``host`` out of range for a dimension of ``size``, or None."""
    if host.numel() == 0:
        return None
    bad = (host >= size) | (host < -size)
    return host[bad].reshape(-1)[0].item() if bad.any() else None


def _index_fill_bounds(handler):
    """``index_fill``'s IndexError at once, as the CPU's, for an index whose values the
    host holds (from torch 2.15 ``x[[i]] = v`` is an ``index_fill_``); others are
    checked on the device, when a value is next read."""

    def with_known_bounds(func, args, kwargs):
        self, dim, index = args[0], args[1], args[2]
        if -self.dim() <= dim < self.dim() and (host := _host_values(index)) is not None:
            dim %= self.dim()
            value = _out_of_bounds(host, self.shape[dim])
            if value is not None:
                exc = IndexError(
                    f"index {value} is out of bounds for dimension {dim} with size "
                    f"{self.shape[dim]}"
                )
                raise add_context(exc, func, args)
        return handler(func, args, kwargs)

    return with_known_bounds


_MASKS = (torch.bool, torch.uint8)
_MASKED_PUTS = (aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)


def _masked_put(func, args, kwargs):
    """``x[mask] = v`` with one mask over the leading dims and a ``v`` of x's dtype, with
    no nonzero, whose size depends on values, so that nothing waits for the mask's count
    and a compiled program can run it too (a torch.compile graph keeps ``x[mask] = v``
    as one index_put, its shape being static):
    - a ``v`` that broadcasts to each selected element (a scalar, mostly): a ``where``;
    - a ``v`` of one row per True element (``x[mask] = x[mask] * 2``, and the backward
      of ``x[mask]``, which puts its gradient back so): the rows are scattered into the
      masked positions in order (``masked_scatter``), and their count is checked
      against the mask's on the device, raising at the next read as torch raises at once.
    Anything else returns None, for the integer indices of the mask."""
    self, indices, values = args[0], args[1], args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if len(indices) != 1 or indices[0] is None or indices[0].dtype not in _MASKS:
        return None
    mask = indices[0]
    if mask.device != self.device or values.dtype != self.dtype:
        return None
    rest = tuple(self.shape[mask.dim() :])
    by_row = values.dim() == len(rest) + 1 and tuple(values.shape[1:]) == rest
    if by_row and values.shape[0] == 1:  # one row broadcast to every selected one
        values, by_row = values[0], False
    if values.dim() > len(rest) and not by_row:
        return None
    _warn_if_uint8(mask)
    _check_mask_shape(self, mask, 0)
    mask = mask.bool()
    if by_row:
        torch._assert_async(
            mask.sum() == values.shape[0],
            f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast "
            f"to indexing result of shape [<the mask's count of True>, {', '.join(map(str, rest))}]",
        )
    mask = mask.reshape(tuple(mask.shape) + (1,) * len(rest))
    if by_row:
        values = torch.zeros_like(self).masked_scatter(mask, values)
    result = torch.where(mask, self + values if accumulate else values, self)
    return result if func is aten.index_put.default else self.copy_(result)


def _check_mask_shape(self, mask, start: int) -> None:
    """torch's IndexError for a mask whose shape is not that of the dims it covers
    (``ones(5, 4)[tensor([True])]``): without it the mask would select rows silently."""
    for j, size in enumerate(mask.shape):
        at = start + j
        if at >= self.dim() or self.shape[at] != size:
            shown = list(self.shape)
            raise IndexError(
                f"The shape of the mask {list(mask.shape)} at index {j} does not match the "
                f"shape of the indexed tensor {shown} at index {at}"
            )


def _choose(func):
    special = SPECIAL.get(func)
    if special is not None:
        return special
    info = schema.info(func)
    lowering = TABLE.get(func)
    if lowering is not None:
        if lowering.view:
            return view_handler(info, lowering)
        return plans.lowered_handler(plans.Entry(func, lowering, info))
    if func._schema.name in factory_out.SEQUENCES and info.out_args:
        # before torch's decompositions, which resize where the CPU kernels do not
        return factory_out.handler(info, schema.factory_variant(func))
    functional = schema.functional_variant(func)
    if functional is not None and (
        info.out_args or not schema.same_argument_order(func, functional)
    ):
        # ``add.out`` (torch's meta kernel checks and resizes the out tensors first), or
        # arguments to pass by name (``polygamma_``).
        return _functional_then_copy_handler(info, functional)
    if functional is not None and functional in TABLE:
        if TABLE[functional].view:
            return inplace_view_handler(functional)
        return plans.lowered_handler(plans.Entry(func, TABLE[functional], info))
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        # Ops torch defines in terms of other ops (reshape, linear, ...) reach us only
        # when called from inside a dispatch; their own definition is the decomposition.
        return _decomposed_handler(func.decompose)
    decomposition = _decompositions().get(func)
    if decomposition is not None:
        return _decomposed_handler(decomposition)
    if functional is not None:
        decomposition = _decompositions().get(functional)
        if decomposition is not None or functional in SPECIAL:
            return _functional_then_copy_handler(info, functional)
    factory = schema.factory_variant(func)
    if factory is not None:
        # ``torch.rand(3, out=o)``: the factory, then copied into o (resized first).
        return factory_out.handler(info, factory)
    if func.namespace != "aten" and any(
        torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)
        for key in ("PrivateUse1", "CompositeExplicitAutograd")
    ):
        # A library's own kernel for PrivateUse1 devices or for every backend, written in
        # torch ops (FSDP2's fsdp.all_gather_copy_in, split_with_sizes_copy, chunk_cat;
        # torch 2.15's no-op fsdp.record_grad_output_stream): run it.
        return _decomposed_handler(functools.partial(func.redispatch, _PRIVATEUSE1))
    return run_on_cpu


_PRIVATEUSE1 = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)


# -- computing -----------------------------------------------------------------------------


_decomposition_table = None


def _decompositions() -> dict:
    global _decomposition_table
    if _decomposition_table is None:
        from torch._decomp import core_aten_decompositions, decomposition_table

        from torchtpu.dispatch.decompositions import DECOMPOSITIONS

        table = dict(decomposition_table)
        table.update(core_aten_decompositions())
        table.update(DECOMPOSITIONS)
        _decomposition_table = table
    return _decomposition_table


def _decomposed_handler(decomposition):
    def handler(func, args, kwargs):
        metrics.count("decomposed", str(func))
        return decomposition(*args, **kwargs)

    return handler


def _functional_then_copy_handler(info, functional):
    """Mutating op without a fused lowering: run its functional variant, then copy_."""

    def handler(func, args, kwargs):
        values = info.bind(args, kwargs)
        out_tensors.check(info, values)
        functional_info = schema.info(functional)
        names = [a.name for a in functional_info.args]
        by_name = {a.name: v for a, v in zip(info.args, values)}
        fargs, fkwargs = functional_info.split([by_name[n] for n in names])
        result = dispatch(functional, tuple(fargs), fkwargs)
        produced = list(result) if isinstance(result, (tuple, list)) else [result]
        n_fresh = sum(1 for r in info.returns if r.aliases is None)
        fresh, new_values = produced[:n_fresh], produced[n_fresh:]
        targets = []
        for i in info.mutable:
            v = values[i]
            if isinstance(v, (list, tuple)):
                targets.extend(v)
            elif v is not None:
                targets.append(v)
        flat_new = []
        for v in new_values:
            flat_new.extend(v if isinstance(v, (list, tuple)) else [v])
        for target, value in zip(targets, flat_new):
            if info.out_args:
                # For an op without a meta kernel (a data-dependent size: nonzero),
                # out_tensors.check could not check and resize it beforehand.
                out_tensors.fit(info, target, value)
            aten.copy_.default(target, value)
        out = []
        fresh_iter = iter(fresh)
        for r in info.returns:
            out.append(values[r.aliases] if r.aliases is not None else next(fresh_iter))
        return out[0] if len(out) == 1 else (tuple(out) if out else None)

    return handler


tensor_module.hooks.dispatch = dispatch
