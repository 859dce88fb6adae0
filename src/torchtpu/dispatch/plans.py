"""Op plans: one compiled function per (op, argument signature), and how to call it.

The dispatcher turns an op call into a *signature* (the op, each argument's shape,
strides, dtype and view chain, the aliasing between arguments, the Python type of each
traced scalar, the static arguments) and looks up its `Plan`. On a miss it builds one:

1. the **meta oracle**: the op runs on meta tensors of the same shapes, strides and
   dtypes. That gives torch's own output shapes, strides and dtypes, and torch's own
   exception for bad input (shape mismatch, impossible view, bad cast), before any
   JAX code runs;
2. the **type-promotion policy** of the lowering (registry.py);
3. a pure function of (base arrays, traced scalars, RNG state) that reads each
   argument through its view chain, calls the lowering, casts the results and writes
   the new values of mutated arguments back through their chains (storage.py).
   It is jitted once; calling the plan is one jitted call.

Note [Plan outputs]
    The lowering's outputs are the op's non-aliased returns, followed by the new
    values of the op's mutable arguments in schema order. That holds both for an
    op lowered directly and for a mutating op computed by its functional variant
    (``add_`` by ``add``, ``add.out`` by ``add``): torch names them that way.
    The compiled function returns the new tensors, then the new base arrays of the
    written storages, then the flags of value checks (checks.py).
"""

from __future__ import annotations

import itertools
import time
from typing import NamedTuple

import torch
from torch._prims_common import elementwise_dtypes

from torchtpu import config, dtypes, rng, storage, tracing
from torchtpu import matmul_precision as _precision
from torchtpu.dispatch import checks, defer
from torchtpu.dispatch.defer import Pending
from torchtpu.dispatch.modes import EagerMode
from torchtpu.dispatch.schema import Kind, SchemaInfo
from torchtpu.observe import metrics, perf_warnings
from torchtpu.observe.locations import add_context, name_op, user_frame
from torchtpu.ops import value_checks, view_chains
from torchtpu.ops.util import cast
from torchtpu.runtime import jax
from torchtpu.storage import Storage
from torchtpu.tensor import TPUTensor

jnp = jax().numpy

_META = torch.device("meta")


class OutMeta(NamedTuple):
    shape: tuple
    strides: tuple
    dtype: torch.dtype


# An output whose meta kernel is missing: sized by jax.eval_shape instead.
_UNKNOWN = OutMeta((), (), torch.float32)


class Signature:
    """An op call taken apart: its hashable spec, and the arrays and scalars it feeds."""

    __slots__ = ("spec", "arrays", "storages", "slot_of", "scalars", "device", "values")

    def __init__(self, info: SchemaInfo, values: list, static_scalars: frozenset):
        self.arrays: list = []
        self.storages: list[Storage] = []
        self.slot_of: dict[int, int] = {}
        self.scalars: list = []
        self.device: int | None = None
        self.values = values
        spec = []
        for arg, value in zip(info.args, values):
            kind = arg.kind
            if kind is Kind.TENSOR:
                spec.append(self._tensor(value, info.op))
            elif kind is Kind.TENSOR_LIST:
                spec.append(
                    None if value is None else ("l", tuple(self._tensor(v, info.op) for v in value))
                )
            elif (
                kind is Kind.SCALAR
                and value is not None
                and arg.name not in static_scalars
                and not (
                    value is arg.default
                    or (type(value) is type(arg.default) and value == arg.default)
                )
            ):
                # A traced input, so a new value (a learning rate) never recompiles. The
                # schema's default (alpha=1) stays static: it is rarely anything else.
                self.scalars.append(value)
                spec.append(("s", type(value)))
            elif kind is Kind.SCALAR_LIST and value is not None and arg.name not in static_scalars:
                self.scalars.extend(value)
                spec.append(("sl", tuple(type(v) for v in value)))
            else:
                spec.append(("v", _hashable(value)))
        slots = tuple(None if s.array is not None else (s.shape, s.dtype) for s in self.storages)
        self.spec = (tuple(spec), slots)

    def _tensor(self, t, op):
        if t is None:
            return None
        if type(t) in (int, float, bool, complex):
            # A Python number where the schema says Tensor (``x + 1``): a traced scalar.
            self.scalars.append(t)
            return ("s", type(t))
        if type(t) is TPUTensor or isinstance(t, TPUTensor):
            s = t._storage
            slot = self.slot_of.get(id(s))
            if slot is None:
                if self.device is None:
                    self.device = s.device_index
                elif self.device != s.device_index:
                    raise RuntimeError(
                        f"{op}: Expected all tensors to be on the same device, but found at "
                        f"least two devices, tpu:{self.device} and tpu:{s.device_index}!"
                    )
                slot = self.slot_of[id(s)] = len(self.storages)
                self.storages.append(s)
                array = s.array
                if array is not None:
                    if type(array) is Pending and array.node_done():
                        array = s.array = array.resolved()
                    self.arrays.append(array)
            return ("t", slot, t._meta)
        if isinstance(t, torch.Tensor):
            if t.dim() == 0 and t.device.type == "cpu":
                # torch lets a 0-d CPU tensor join ops on any device, as a scalar.
                self.scalars.append(t.item())
                if tracing._active is not None:  # a constant of the program: guarded
                    tracing._active.cpu_scalars.append(t)
                return ("c", t.dtype)
            where = "tpu" if self.device is None else f"tpu:{self.device}"
            raise RuntimeError(
                f"{op}: Expected all tensors to be on the same device, but found at least "
                f"two devices, {where} and {t.device}!"
            )
        raise TypeError(f"{op}: expected a Tensor, got {type(t).__name__}")


class _Number(NamedTuple):
    """A static number in a plan key: 4 and 4.0 (and 1 and True) are equal and hash
    alike in Python, but are different constants to torch (``arange(4)`` is int64,
    ``arange(4.0)`` float32)."""

    type: type
    value: object

    def __repr__(self) -> str:
        return repr(self.value)


def _hashable(value):
    if type(value) in (int, float, bool, complex):
        return _Number(type(value), value)
    if isinstance(value, torch.dtype) and value not in dtypes.SUPPORTED:
        dtypes.check_supported(value, "result")
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, torch.device) and value.type == "tpu":
        return value
    if isinstance(value, torch.Generator):
        raise RuntimeError(
            f"Expected a 'tpu' device type for generator but found '{value.device.type}'"
        )
    return value


def _plain(value):
    """A static value from a plan key as the lowering takes it (undoing `_Number`)."""
    if type(value) is _Number:
        return value.value
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


class Plan:
    """A compiled op call. See Note [Plan outputs]."""

    __slots__ = (
        "op",
        "call",
        "outputs",
        "returns",
        "written_slots",
        "check_infos",
        "random",
        "compiled",
        "reads_arrays",
        "fn",
        "uid",
        "traced",
        "key",
    )

    def run(self, sig: Signature, device: int, debug: bool):
        args = list(sig.arrays)
        args.extend(sig.scalars)
        if self.random:
            args.extend(rng.take(device))
        if tracing._active is not None:
            flat = self._call(args, device)  # traced into the program: compiles nothing
        elif not self.compiled:
            start = time.perf_counter()
            flat = self._call(args, device)
            self.compiled = True
            metrics.count("compiles", "op")
            metrics.count("compile_seconds", "op", time.perf_counter() - start)
        else:
            flat = self._call(args, device)
        if debug:
            jax().block_until_ready(flat)
        n_out = len(self.outputs)
        n_written = len(self.written_slots)
        if self.check_infos:
            flags = flat[n_out + n_written :]
            where = f"called from {user_frame()}"
            if debug:
                checks.raise_now(flags, self.check_infos, where)
            else:
                checks.defer(flags, self.check_infos, where)
        return flat[:n_out], flat[n_out : n_out + n_written]

    def record(self, sig: Signature, device: int):
        """DeferAndFuse: queue the call; its results are Pending values (defer.py)."""
        args = list(sig.arrays)
        args.extend(sig.scalars)
        if self.random:
            args.extend(rng.take(device))
        avals = [(o.shape, dtypes.to_jax(o.dtype)) for o in self.outputs]
        avals += [
            (sig.storages[s].shape, dtypes.to_jax(sig.storages[s].dtype))
            for s in self.written_slots
        ]
        if not self.traced:
            # Trace it now, abstractly (cached per plan): a lowering's error about this
            # call then surfaces at the op, as in Strict, not at a later flush.
            abstract = [
                jax().ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a for a in args
            ]
            jax().eval_shape(self.fn, *abstract)
        # The user's line costs a stack walk: only kept where an error may need it.
        where = user_frame() if self.check_infos else None
        pending = defer.record(self, args, avals, where)
        n_out = len(self.outputs)
        return pending[:n_out], pending[n_out:]

    def _call(self, args, device: int):
        if device != 0 and not self.reads_arrays:
            # Nothing to infer a device from (a factory, an uninitialised storage):
            # run on the op's device rather than JAX's default.
            from torchtpu.runtime import device as jax_device

            with jax().default_device(jax_device(device)):
                return self.call(*args)
        return self.call(*args)


_PLANS = metrics.LRUCache("op_cache", lambda: config.op_cache_size)
_UIDS = itertools.count()


def run(op, lowering, info: SchemaInfo, values: list, mode: EagerMode):
    """Run ``op`` (bound ``values``) with ``lowering`` in ``mode``; return what torch's
    op returns."""
    if lowering.dynamic_shape:
        defer.flush("data-dependent shape")
        return _run_dynamic(op, lowering, info, values)
    if mode is EagerMode.DEFER_AND_FUSE and not info.all_tensor_returns:
        defer.flush("value read")  # the op returns a Python number: run it now
        mode = EagerMode.DEFER_NEVER
    static = lowering.static
    sig = Signature(info, values, static)
    # The default dtype decides the dtype of factories and of float scalars' promotion.
    key = (
        op,
        lowering.op,
        sig.spec,
        torch.get_default_dtype(),
        _precision.current() if lowering.precision else None,
    )
    plan = _PLANS.lookup(key)
    if plan is None:
        plan = _build(op, lowering, info, sig)
        plan.key = key
        _PLANS.insert(key, plan)
        # In DeferAndFuse chunks compile, and in a trace the program does.
        if mode is not EagerMode.DEFER_AND_FUSE and tracing._active is None:
            where = user_frame()
            metrics.event("compile", op=str(op), where=where)
            perf_warnings.note_compile(
                str(op), where, key, lambda old, new: describe_change(info, old, new)
            )
    device = sig.device if sig.device is not None else _factory_device(info, values)
    try:
        if mode is EagerMode.DEFER_AND_FUSE:
            outputs, bases = plan.record(sig, device)
        else:
            outputs, bases = plan.run(
                sig, device, debug=mode is EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
            )
    except Exception as exc:
        raise add_context(exc, op, values) from None
    for slot, base in zip(plan.written_slots, bases):
        sig.storages[slot].set(base)
    return _assemble(plan, values, outputs, device)


def describe_change(info: SchemaInfo, old: tuple, new: tuple) -> str:
    """What differs between two plan keys of one op, in the user's terms."""
    (_, _, (old_args, _), old_dtype, old_precision) = old
    (_, _, (new_args, _), new_dtype, new_precision) = new
    for arg, a, b in zip(info.args, old_args, new_args):
        if a != b:
            before, after = _describe_spec(a), _describe_spec(b)
            if before == after:
                return f"argument `{arg.name}`: its strides or view changed ({after})"
            return f"argument `{arg.name}`: {before} -> {after}"
    if old_dtype != new_dtype:
        return f"the default dtype: {old_dtype} -> {new_dtype}"
    if old_precision != new_precision:
        return f"the matmul precision: {old_precision} -> {new_precision}"
    return "a signature seen before (it was dropped from the full op cache)"


def _describe_spec(spec) -> str:
    if spec is None:
        return "None"
    tag = spec[0]
    if tag == "t":
        shape, _, _, dtype, _ = spec[2]
        return f"{str(dtype).replace('torch.', '')}{list(shape)}"
    if tag == "l":
        return "[" + ", ".join(_describe_spec(s) for s in spec[1]) + "]"
    if tag in ("s", "sl"):
        return f"a traced {spec[1]}"
    if tag == "c":
        return f"a 0-d CPU tensor of {spec[1]}"
    return f"the constant {spec[1]!r}"


def _run_dynamic(op, lowering, info: SchemaInfo, values: list):
    """An op whose output shape depends on values (``nonzero``): it runs op by op on
    concrete arrays, outside ``jax.jit``."""
    if tracing._active is not None:
        tracing.refuse("its output shape depends on the input values", op)
    sig = Signature(info, values, frozenset(a.name for a in info.args))

    def concrete(value):
        if isinstance(value, TPUTensor):
            return materialize(value)
        if isinstance(value, (list, tuple)):
            return [concrete(v) for v in value]
        if isinstance(value, torch.Tensor):
            return jnp.asarray(value.item(), dtypes.to_jax(value.dtype))
        return value

    metrics.count("dynamic_shape", str(op))
    try:
        result = lowering.fn(*[concrete(v) for v in values])
    except Exception as exc:
        raise add_context(exc, op, values) from None
    device = sig.device if sig.device is not None else _factory_device(info, values)
    results = []
    for array in _flatten_result(result)[: len(info.returns)]:
        meta = OutMeta(tuple(array.shape), _contiguous(array.shape), dtypes.to_torch(array.dtype))
        results.append(wrap(array, meta, device))
    return results[0] if len(results) == 1 else tuple(results)


_READERS: dict = {}


def materialize(t: TPUTensor):
    """The JAX array holding ``t``'s current value (its view chain applied)."""
    s = t._storage
    if type(s.array) is Pending:
        if not s.array.node_done():
            defer.flush("value read")
        s.array = s.array.resolved()
    if not t._chain and s.array is not None:
        return s.array
    key = (t._meta, None if s.array is not None else (s.shape, s.dtype))
    reader = _READERS.get(key)
    if reader is None:
        chain = t._chain
        if s.array is None:
            shape, dtype = s.shape, dtypes.to_jax(s.dtype)

            def read():
                return view_chains.read(jnp.zeros(shape, dtype), chain)

        else:

            def read(base):
                return view_chains.read(base, chain)

        reader = _READERS[key] = jax().jit(read)
    if s.array is None:
        if s.device_index != 0:
            from torchtpu.runtime import device as jax_device

            with jax().default_device(jax_device(s.device_index)):
                return reader()
        return reader()
    return reader(s.array)


def _factory_device(info: SchemaInfo, values: list) -> int:
    for arg, value in zip(info.args, values):
        if arg.name == "device" and value is not None:
            value = torch.device(value)
            if value.type != "tpu":
                raise RuntimeError(f"{info.op}: expected a tpu device, got {value}")
            return value.index if value.index is not None else _current_device()
    return _current_device()


def _current_device() -> int:
    from torchtpu.runtime import current_index

    return current_index()


def wrap(array, meta: OutMeta, device: int) -> TPUTensor:
    """A new TPUTensor owning ``array`` (a fresh Storage)."""
    if device != 0 and type(array) is not Pending:
        array = _on_device(array, device)
    s = Storage(array, meta.shape, meta.strides, meta.dtype, device)
    offset = 0
    return TPUTensor(s, (), meta.shape, meta.strides, offset, meta.dtype)


def _on_device(array, device: int):
    if array is None:
        return None
    from torchtpu.runtime import device as jax_device

    target = jax_device(device)
    if array.devices() != {target}:
        array = jax().device_put(array, target)
    return array


def _assemble(plan: Plan, values: list, outputs, device: int):
    results = []
    for kind, payload in plan.returns:
        if kind == "alias":
            results.append(values[payload])
        elif kind == "tensor":
            results.append(wrap(outputs[payload], plan.outputs[payload], device))
        elif kind == "list":
            results.append([wrap(outputs[i], plan.outputs[i], device) for i in payload])
        elif kind == "none":
            results.append(None)
        else:  # "scalar": a Python number, read back now
            from torchtpu.dispatch.checks import to_host

            results.append(to_host(outputs[payload]).item())
    if len(results) == 1:
        return results[0]
    if not results:
        return None
    return tuple(results)


# -- building a plan ----------------------------------------------------------------------


def _meta_tensor(meta: tuple) -> torch.Tensor:
    shape, strides, offset, dtype, _ = meta
    extent = offset + sum((n - 1) * s for n, s in zip(shape, strides) if n > 0) + 1
    if 0 in shape:
        extent = offset + 1
    base = torch.empty(extent, dtype=dtype, device=_META)
    return base.as_strided(shape, strides, offset)


def meta_values(info: SchemaInfo, sig: Signature) -> list:
    """The op's arguments with every tensor replaced by a meta tensor like it."""
    memo: dict = {}

    def one(spec, value):
        if spec is None:
            return None
        tag = spec[0]
        if tag == "t":
            key = (spec[1], spec[2])
            if key not in memo:
                memo[key] = _meta_tensor(spec[2])
            return memo[key]
        if tag == "l":
            return [one(s, v) for s, v in zip(spec[1], value)]
        if tag == "c":
            return torch.empty((), dtype=spec[1], device=_META)
        if isinstance(value, torch.device) and value.type == "tpu":
            return _META
        if isinstance(value, torch.Generator):
            return None
        return value

    return [one(s, v) for s, v in zip(sig.spec[0], sig.values)]


def _run_meta(op, info: SchemaInfo, margs: list):
    """Torch's own shapes, strides, dtypes and errors for this call, or None."""
    args, kwargs = info.split(margs)
    try:
        return op(*args, **kwargs)
    except NotImplementedError as exc:
        # Only a missing Meta kernel means "no oracle"; anything else (a quantized
        # dtype, an unsupported combination) is torch's answer for this input.
        if "'Meta' backend" in str(exc) or "no fake impl or Meta kernel" in str(exc):
            return None
        raise name_op(_as_on_cpu(op, args, kwargs, exc), op) from None
    except Exception as exc:
        raise name_op(_as_on_cpu(op, args, kwargs, exc), op) from None


# Meta kernels sometimes reject bad input with another exception type than the CPU
# kernels (RuntimeError for IndexError). Below this many elements, the rejected call
# is replayed on CPU zeros to raise what the CPU raises.
_CPU_REPLAY_ELEMENTS = 1 << 20


def _as_on_cpu(op, args, kwargs, meta_error: Exception) -> Exception:
    """The exception the CPU kernel raises for this call, or ``meta_error``."""
    leaves = [
        t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
    ]
    if sum(t.numel() for t in leaves) > _CPU_REPLAY_ELEMENTS:
        return meta_error

    def on_cpu(value):
        if isinstance(value, torch.Tensor):
            return torch.zeros_like(value, device="cpu")
        if isinstance(value, torch.device) and value.type == "meta":
            return torch.device("cpu")
        return value

    cpu_args, cpu_kwargs = torch.utils._pytree.tree_map(on_cpu, (args, kwargs))
    try:
        op(*cpu_args, **cpu_kwargs)
    except Exception as cpu_error:
        return cpu_error
    return meta_error


def _out_meta(t: torch.Tensor) -> OutMeta:
    if t.dtype not in dtypes.SUPPORTED:
        dtypes.check_supported(t.dtype, "result")
    return OutMeta(tuple(t.shape), tuple(t.stride()), t.dtype)


def _contiguous(shape) -> tuple:
    return storage._contiguous_strides(tuple(shape))


# In-place ops torch lets write into an expanded tensor (no internal-overlap check).
_WRITES_EXPANDED = frozenset(
    {torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor, torch.ops.aten.zero_.default}
)


# Ops whose meta kernel disagrees with the CPU kernel, our reference. _grouped_mm's
# rejects what only the CUDA kernel requires (non-bfloat16 inputs): it is not run. The
# margin losses' give one 1-d sample a loss of shape (1,) where the CPU's is 0-d: they
# run, for torch's checks of the arguments, but JAX sizes the outputs.
_META_REJECTS_WHAT_CPU_TAKES = frozenset({torch.ops.aten._grouped_mm.default})
_META_SIZES_UNLIKE_CPU = frozenset(
    {
        torch.ops.aten.multi_margin_loss.default,
        torch.ops.aten.multilabel_margin_loss_forward.default,
    }
)


# Normalization ops whose outputs 1 and 2 are the mean and inverse std. For a 16-bit
# input torch's CPU kernels return them in the input's dtype, or in float32 where a
# parameter (weight, bias, running stats) is float32; the meta kernels follow CUDA's
# (float32 for layer and batch norm, the input's dtype for group norm).
_NORM_STATISTICS = frozenset(
    {
        torch.ops.aten.native_layer_norm.default,
        torch.ops.aten.native_group_norm.default,
        torch.ops.aten.native_batch_norm.default,
        torch.ops.aten._native_batch_norm_legit.default,
        torch.ops.aten._native_batch_norm_legit.no_stats,
        torch.ops.aten._native_batch_norm_legit_functional.default,
        torch.ops.aten._native_batch_norm_legit_no_training.default,
        torch.ops.aten._batch_norm_with_update.default,
        torch.ops.aten._batch_norm_with_update_functional.default,
        torch.ops.aten._batch_norm_no_update.default,
    }
)


def _cpu_statistics_dtype(outputs: list, args: dict) -> None:
    x = args["input"]
    if x.dtype not in (torch.float16, torch.bfloat16):
        return
    params = [args.get(n) for n in ("weight", "bias", "running_mean", "running_var")]
    mixed = any(p is not None and p.dtype == torch.float32 for p in params)
    for i in (1, 2):
        if outputs[i] not in (None, _UNKNOWN):
            outputs[i] = outputs[i]._replace(dtype=torch.float32 if mixed else x.dtype)


def _build(op, lowering, info: SchemaInfo, sig: Signature) -> Plan:
    margs = meta_values(info, sig)
    needs_meta = all(r.is_tensor for r in info.returns) and op not in _META_REJECTS_WHAT_CPU_TAKES
    meta_out = _run_meta(op, info, margs) if needs_meta else None
    if op in _META_SIZES_UNLIKE_CPU:
        meta_out = None

    # Targets of the lowering's outputs (Note [Plan outputs]): ("new", position) for a
    # value the compiled function returns, ("write", arg index, list position or None)
    # for the new value of a mutable argument. `outputs[position]` is the OutMeta of a
    # new tensor, or None for a Python number (an op returning Scalar or bool).
    targets: list = []
    returns: list = []
    outputs: list = []
    meta_returns = (
        (list(meta_out) if isinstance(meta_out, tuple) else [meta_out])
        if meta_out is not None
        else [None] * len(info.returns)
    )

    def new_output(meta):
        outputs.append(meta)
        targets.append(("new", len(outputs) - 1))
        return len(outputs) - 1

    for r, m in zip(info.returns, meta_returns):
        if r.aliases is not None:
            returns.append(("alias", r.aliases))
        elif not r.is_tensor:
            returns.append(("scalar", new_output(None)))
        elif r.is_list:
            if m is None:
                raise NotImplementedError(f"{op}: no meta kernel to size its list of outputs")
            returns.append(("list", [new_output(_out_meta(mm)) for mm in m]))
        elif m is None and meta_out is not None:
            # torch returns no tensor here (e.g. a gradient output_mask left out).
            returns.append(("none", None))
            targets.append(("drop",))
        else:
            returns.append(("tensor", new_output(_out_meta(m) if m is not None else _UNKNOWN)))
    # A write target keeps what the compiled function needs of the tensor -- never the
    # tensor itself, which the plan would keep alive.
    for i in info.mutable:
        value = sig.values[i]
        for tensor in value if isinstance(value, (list, tuple)) else [value]:
            if tensor is not None:
                slot = sig.slot_of[id(tensor._storage)]
                targets.append(
                    ("write", slot, tensor._chain, dtypes.to_jax(tensor.dtype), tuple(tensor.shape))
                )

    names = [a.name for a in info.args]
    if op in _NORM_STATISTICS:
        _cpu_statistics_dtype(outputs, dict(zip(names, margs)))

    # Type promotion (Note [Type promotion policy] in ops/registry.py).
    low_info = _lowering_info(lowering)
    promote_to = None
    promoting_set: set = set()
    if lowering.promote is not None:
        promoting = lowering.promote_args
        if promoting is None:
            promoting = tuple(
                a.name
                for a in low_info.args
                if a.kind in (Kind.TENSOR, Kind.SCALAR) and a.name != "alpha"
            )
        operands = []
        for n in promoting:
            if n in names:
                value = margs[names.index(n)]
                operands.extend(value if isinstance(value, list) else [value])
        operands = [o for o in operands if isinstance(o, (torch.Tensor, int, float, bool, complex))]
        if operands:
            promote_to, _ = elementwise_dtypes(*operands, type_promotion_kind=lowering.promote)
            promoting_set = set(promoting)
    result_dtype = None
    if lowering.compute_in_result:
        first = targets[0] if targets else None
        if first and first[0] == "new" and outputs[first[1]] not in (None, _UNKNOWN):
            result_dtype = dtypes.opmath(outputs[first[1]].dtype)
        elif first and first[0] == "write":
            result_dtype = dtypes.opmath(dtypes.to_torch(first[3]))

    spec_args, slots = sig.spec
    n_arrays = sum(1 for s in slots if s is None)
    n_scalars = len(sig.scalars)
    op_names = [a.name for a in info.args]
    plan = Plan()
    plan.op = op
    plan.returns = returns
    plan.outputs = outputs
    plan.random = lowering.random
    plan.compiled = False
    plan.check_infos = []
    written: list[int] = []
    for t in targets:
        if t[0] == "write" and t[1] not in written:
            written.append(t[1])
    plan.written_slots = written
    precision = _precision.lax_precision(_precision.current()) if lowering.precision else None
    check_overlap = op not in _WRITES_EXPANDED

    def fn(*flat):
        arrays = iter(flat[:n_arrays])
        bases = [next(arrays) if s is None else jnp.zeros(s[0], dtypes.to_jax(s[1])) for s in slots]
        scalars = iter(flat[n_arrays : n_arrays + n_scalars])
        rest = flat[n_arrays + n_scalars :]

        def value_of(spec, name):
            if spec is None:
                return None
            tag = spec[0]
            if tag == "t":
                v = view_chains.read(bases[spec[1]], spec[2][4])
            elif tag == "l":
                return [value_of(s, name) for s in spec[1]]
            elif tag == "c":
                v = jnp.asarray(next(scalars), dtypes.to_jax(spec[1]))
            elif tag == "s":
                v = next(scalars)
            elif tag == "sl":
                return [next(scalars) for _ in spec[1]]
            else:
                return _plain(spec[1])
            if promote_to is not None and name in promoting_set:
                v = cast(v, dtypes.to_jax(promote_to))
            elif result_dtype is not None and name in lowering.compute_in_result:
                v = cast(v, dtypes.to_jax(result_dtype))
            return v

        values = [value_of(s, n) for s, n in zip(spec_args, op_names)]
        extra = {}
        if lowering.random:
            extra["key"] = rng.key(rest[0], rest[1])
        if lowering.precision:
            extra["precision"] = precision
        with value_checks.collect() as collected:
            result = lowering.fn(*values, **extra)
        # The message names the op once; where it ran is added when it is raised.
        plan.check_infos = [
            (exc_type, message if message.startswith(f"{op}:") else f"{op}: {message}")
            for _, exc_type, message in collected
        ]
        produced = _flatten_result(result)
        if len(produced) != len(targets):
            raise RuntimeError(
                f"torchtpu internal error: the lowering of {lowering.op} returned {len(produced)} "
                f"values where {op} needs {len(targets)}"
            )
        new = []
        for t, v in zip(targets, produced):
            if t[0] == "drop":
                continue
            if t[0] == "new":
                meta = outputs[t[1]]
                if meta is None:  # a Python number
                    v = jnp.asarray(v)
                elif meta is not _UNKNOWN:
                    v = cast(v, dtypes.to_jax(meta.dtype))
                    if tuple(v.shape) != meta.shape:
                        v = jnp.broadcast_to(v, meta.shape)
                new.append(v)
            else:
                _, slot, chain, dtype, shape = t
                v = jnp.broadcast_to(cast(v, dtype), shape)
                bases[slot] = view_chains.write(bases[slot], chain, v, check_overlap)
        plan.traced = True
        return (*new, *(bases[s] for s in written), *(flag for flag, _, _ in collected))

    if any(o is _UNKNOWN for o in outputs):
        _fill_from_eval_shape(fn, plan, sig, outputs)
    plan.fn = fn
    plan.uid = next(_UIDS)
    plan.traced = False
    plan.reads_arrays = n_arrays > 0
    plan.call = jax().jit(fn)
    return plan


def _fill_from_eval_shape(fn, plan, sig, outputs):
    """No meta kernel: take output shapes and dtypes from JAX (contiguous strides)."""
    arrays = [
        jax().ShapeDtypeStruct(a.shape, a.dtype) if type(a) is Pending else a for a in sig.arrays
    ]
    args = arrays + list(sig.scalars)
    if plan.random:
        args += [0, 0]
    shapes = jax().eval_shape(fn, *args)
    for i, o in enumerate(outputs):
        if o is _UNKNOWN:
            s = shapes[i]
            outputs[i] = OutMeta(tuple(s.shape), _contiguous(s.shape), dtypes.to_torch(s.dtype))


def _flatten_result(result) -> list:
    if isinstance(result, (tuple, list)):
        out = []
        for r in result:
            if isinstance(r, (tuple, list)):
                out.extend(r)
            else:
                out.append(r)
        return out
    return [result]


def _lowering_info(lowering):
    from torchtpu.dispatch.schema import info

    return info(lowering.op)
