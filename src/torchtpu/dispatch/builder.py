"""Building a `Plan` for an op call seen for the first time (a cache miss).

1. The **meta oracle** (meta.py) gives torch's output shapes, strides and dtypes and
   torch's errors for bad input.
2. The lowering's **type-promotion policy** (Note [Type promotion policy] in
   ops/registry.py) gives the dtype its inputs are computed in.
3. A pure function of (base arrays, traced scalars, RNG seed and offset) reads each
   argument through its view chain, calls the lowering, casts the results to torch's
   dtypes and writes the new values of mutated arguments back through their chains
   (ops/view_chains.py). It is jitted once; running the plan is one jitted call.

Note [Plan outputs]
    The lowering's outputs are the op's non-aliased returns, followed by the new
    values of the op's mutable arguments in schema order. That holds both for an op
    lowered directly and for a mutating op computed by its functional variant
    (``add_`` by ``add``, ``add.out`` by ``add``): torch names them that way. The
    compiled function returns the new tensors, then the new base arrays of the written
    storages, then the flags of value checks (dispatch/checks.py).

Note [Profiles name aten ops]
    A plan's function is named after its op and traced inside ``jax.named_scope(op)``.
    Both are fixed when the function is first traced and cost nothing per call; a
    profile (``torchtpu.profile``, profiling.py) then names the device work of every op,
    in per-op programs and fused chunks alike, with no program compiled for it. The
    user's line cannot be part of a cached program (one program serves every line that
    makes the call): profiling.py puts it in host annotations instead. A DeferAndFuse
    chunk adds each op's position (``jit(chunk)/op3/aten.mm.default/dot_general``).
    Scopes are debug locations, which JAX's persistent-cache key leaves out; the
    program's name is in it, and is the same in every process.

Note [Lowering results in Debug mode]
    A lowering's result is cast to the dtype and broadcast to the shape the meta
    oracle gives (the promotion policy relies on the cast). A result of another shape,
    or of another kind of dtype (bool, integer, floating, complex) for an op without a
    ``dtype`` argument (whose conversion the lowering may leave to that cast: ``_to_copy``,
    ``scalar_tensor``), means a wrong lowering: the first trace notes it on the plan, and Debug mode raises it, naming
    the op and the user's line, before any result is used.
"""

from __future__ import annotations

import math

import torch
from torch._prims_common import elementwise_dtypes

from torchtpu import dtypes, rng
from torchtpu import matmul_precision as _precision
from torchtpu.dispatch import effort
from torchtpu.dispatch import meta as oracle
from torchtpu.dispatch.defer import new_uid
from torchtpu.dispatch.pending import Pending
from torchtpu.dispatch.scalars import as_arrays
from torchtpu.dispatch.schema import Kind, SchemaInfo, info
from torchtpu.dispatch.signature import SCALAR, SCALAR_LIST, TENSOR, TENSOR_LIST, Call, plain
from torchtpu.dispatch.values import UNKNOWN, OutMeta, contiguous
from torchtpu.ops import value_checks, view_chains
from torchtpu.ops.util import cast
from torchtpu.runtime import jax, policy, sharding
from torchtpu.storage import DynamicStep


class Plan:
    """A compiled op call (Note [Plan outputs]); run and recorded by plans.py."""

    __slots__ = (
        "op",
        "call",
        "fn",
        "outputs",
        "fresh",
        "avals",
        "returns",
        "single",
        "written_slots",
        "written_arrays",
        "writes_views",
        "check_infos",
        "random",
        "compiled",
        "uid",
        "traced",
        "key",
        "names",
        "mismatch",
        "fast",
        "host_rule",
        "traced_rule",
        "donating",
        "placed_calls",
        "traceable",
        "options",
        "output_bytes",
        "on_cpu",
    )

    def placed(self, index: int):
        """The op's program run eagerly on ``tpu:index``, its outputs committed there.

        Note [Every array is committed to its device]
            A JAX array that a program made from no committed input (a factory such as
            ``zeros``; or ``zeros_like(p)``, whose program reads nothing of ``p``) is
            *uncommitted*: free to move to wherever it is first used, and made on JAX's
            default device whatever tpu index the op was for. JAX's compiled-call cache
            tells committed inputs from uncommitted ones, so a program first called with
            an optimizer's fresh ``zeros_like`` moments, then with the moments its own
            update made, compiled twice, silently (a Strict AdamW step compiled its
            ``_foreach_`` updates again at step 2; a ``torch.compile``d step its whole
            optimizer graph, 2.3 s on a TPU v5e). A torch tensor always has its device,
            so every array a tpu tensor holds is committed to it: an eager op's program
            places its outputs on the op's device (``out_shardings``: here and in
            plans.py's donating variants), as do DeferAndFuse's chunks (defer.py
            `_Chunk`) and the zeros of an uninitialised storage (values.py
            `_reader`). Inside a compiled program (``plan.traceable``) and on the host
            (dispatch/host.py) the op is not placed: the program, or the host, decides.
            Numbers made arrays stay uncommitted (Note [Numbers as arrays]): they belong
            to no tensor and are always uncommitted, so they never flip a signature. An
            array the user hands over (``torchtpu.from_jax``) is kept as it is: a
            committed copy of its handle would share its buffer unseen by the check that
            lets an in-place op donate it (Note [Strict writes reuse their buffers])."""
        call = self.placed_calls.get(index)
        if call is None:
            call = self.placed_calls[index] = eager_program(self.fn, index, (), self.options)
        return call

    def note_fast(self) -> None:
        """Once its function was traced (its value checks are known): whether the plan
        can take the inline path of `plans.lowered_handler`."""
        self.fast = (
            self.single is not None
            and self.traced
            and not self.random
            and not self.check_infos
            and not self.written_slots
            and self.host_rule is None
        )


def eager_program(fn, device: int, donated: tuple = (), options: dict | None = None):
    """An op's function jitted to run eagerly on ``tpu:device``: its outputs committed
    there (Note [Every array is committed to its device]), the arguments at ``donated``
    given to XLA for its outputs, compiled with ``options`` (effort.py ``single_op_options``)."""
    return jax().jit(
        fn, donate_argnums=donated, out_shardings=sharding(device), compiler_options=options
    )


def build(op, lowering, info_: SchemaInfo, rules, values: list, call: Call) -> Plan:
    """A plan for ``op`` called with ``values`` (bound, defaults filled in), whose
    scan is ``call``."""
    key = call.key
    margs = oracle.meta_values(rules, key, values)
    needs_meta = all(r.is_tensor for r in info_.returns) and lowering.meta != "skip"
    meta_out = oracle.run_meta(op, info_, margs) if needs_meta else None
    oracle.check_dtypes_as_cpu(op, info_, margs)
    oracle.check_overlap_as_cpu(op, info_, values)
    oracle.check_complex_as_cpu(op, info_, margs)
    if lowering.meta == "checks_only":
        meta_out = None

    # Targets of the lowering's outputs (Note [Plan outputs]): ("new", position) for a
    # value the compiled function returns, ("write", slot, chain, dtype, shape) for the
    # new value of a mutable argument. `outputs[position]` is the OutMeta of a new
    # tensor, or None for a Python number (an op returning Scalar or bool).
    targets: list = []
    returns: list = []
    outputs: list = []
    meta_returns = (
        (list(meta_out) if isinstance(meta_out, tuple) else [meta_out])
        if meta_out is not None
        else [None] * len(info_.returns)
    )

    def new_output(meta):
        outputs.append(meta)
        targets.append(("new", len(outputs) - 1))
        return len(outputs) - 1

    for r, m in zip(info_.returns, meta_returns):
        if r.aliases is not None:
            returns.append(("alias", r.aliases))
        elif not r.is_tensor:
            returns.append(("scalar", new_output(None)))
        elif r.is_list:
            if m is None:
                raise NotImplementedError(f"{op}: no meta kernel to size its list of outputs")
            returns.append(("list", [new_output(oracle.out_meta(mm)) for mm in m]))
        elif m is None and meta_out is not None:
            # torch returns no tensor here (e.g. a gradient output_mask left out).
            returns.append(("none", None))
            targets.append(("drop",))
        else:
            returns.append(("tensor", new_output(oracle.out_meta(m) if m is not None else UNKNOWN)))
    # A write target keeps what the compiled function needs of the tensor -- never the
    # tensor itself, which the plan would keep alive.
    slot_of = {id(s): i for i, s in enumerate(call.storages)}
    for i in info_.mutable:
        value = values[i]
        for tensor in value if isinstance(value, (list, tuple)) else [value]:
            if tensor is not None:
                slot = slot_of[id(tensor._storage)]
                targets.append(
                    ("write", slot, tensor._chain, dtypes.to_jax(tensor.dtype), tuple(tensor.shape))
                )

    names = rules.names
    if lowering.cpu_statistics:
        oracle.cpu_statistics_dtype(outputs, dict(zip(names, margs)), UNKNOWN)

    promote_to, promoting_set = _promotion(lowering, names, margs)
    result_dtype = None
    if lowering.compute_in_result:
        first = targets[0] if targets else None
        if first and first[0] == "new" and outputs[first[1]] not in (None, UNKNOWN):
            result_dtype = dtypes.opmath(outputs[first[1]].dtype)
        elif first and first[0] == "write":
            result_dtype = dtypes.opmath(dtypes.to_torch(first[3]))

    slots = tuple(None if s.array is not None else (s.shape, s.dtype) for s in call.storages)
    n_arrays = sum(1 for s in slots if s is None)
    n_scalars = len(call.scalars)
    n_positions = sum(
        sum(type(step) is DynamicStep for step in part[4])
        for kind, part in zip(rules.kinds, key)
        if kind is TENSOR and type(part) is tuple and len(part) == 5
    )
    plan = Plan()
    plan.op = op
    plan.returns = returns
    plan.outputs = outputs
    plan.random = lowering.random
    plan.compiled = False
    plan.check_infos = []
    plan.mismatch = None
    plan.fast = False  # set once traced (note_fast)
    plan.on_cpu = None  # Note [Small ops of changing shapes run on the CPU]
    plan.names = names
    written: list[int] = []
    for t in targets:
        if t[0] == "write" and t[1] not in written:
            written.append(t[1])
    plan.written_slots = written
    # Whether a written tensor is a view: its base's shape is then the call's, not
    # necessarily this first call's (plans.py _record)
    plan.writes_views = any(t[0] == "write" and t[2] for t in targets)
    # Per written storage: its position among the plan's array arguments, or None for
    # an uninitialised storage (the plan makes its base; no argument holds it).
    plan.written_arrays = tuple(
        None if slots[i] is not None else sum(1 for s in slots[:i] if s is None) for i in written
    )
    precision = _precision.lax_precision(_precision.current()) if lowering.precision else None
    check_overlap = not lowering.writes_expanded
    kinds = rules.kinds
    jnp = jax().numpy

    def fn(*flat):
        arrays = iter(flat[:n_arrays])
        bases = [next(arrays) if s is None else jnp.zeros(s[0], dtypes.to_jax(s[1])) for s in slots]
        scalars = iter(flat[n_arrays : n_arrays + n_scalars - n_positions])
        # Note [Positions are inputs] (signature.py): the views' positions come last
        positions = iter(flat[n_arrays + n_scalars - n_positions : n_arrays + n_scalars])
        positioned = {}  # slot -> (chain, positions) of a view read with positions
        rest = flat[n_arrays + n_scalars :]
        seen = [0]  # storages met so far, in scan order

        def tensor_value(part):
            if part is None:
                return None
            if type(part) is type:  # a Python number where the schema says Tensor
                return next(scalars)
            if part[0] == "c":  # a 0-d CPU tensor
                return jnp.asarray(next(scalars), dtypes.to_jax(part[1]))
            if len(part) == 5 or part[0] is None:  # a storage not seen before
                slot, meta = seen[0], part if len(part) == 5 else part[1]
                seen[0] += 1
            else:
                slot, meta = part
            chain = meta[4]
            if n_positions and any(type(step) is DynamicStep for step in chain):
                taken = [next(positions) for step in chain if type(step) is DynamicStep]
                positioned[slot] = (chain, taken)
                return view_chains.read(bases[slot], chain, taken)
            return view_chains.read(bases[slot], chain)

        def value_of(kind, part, name):
            if kind is TENSOR:
                v = tensor_value(part)
            elif kind is TENSOR_LIST:
                return None if part is None else [tensor_value(p) for p in part[1:]]
            elif kind is SCALAR:
                if part is None:
                    return None
                v = next(scalars) if type(part) is type else part[1]
            elif kind is SCALAR_LIST:
                return None if part is None else [next(scalars) for _ in part[1:]]
            else:
                return plain(part)
            if v is None:
                return None
            if promote_to is not None and name in promoting_set:
                v = cast(v, dtypes.to_jax(promote_to))
            elif result_dtype is not None and name in lowering.compute_in_result:
                v = cast(v, dtypes.to_jax(result_dtype))
            return v

        # Never the call's values themselves: the plan must not keep tensors alive.
        args = [value_of(k, p, n) for k, p, n in zip(kinds, key, names)]
        extra = {}
        if lowering.random:
            extra["key"] = rng.key(rest[0], rest[1])
        if lowering.precision:
            extra["precision"] = precision
        with value_checks.collect() as collected:
            result = lowering.fn(*args, **extra)
        # The message is torch's; the op and where it ran go in a note when it is raised.
        plan.check_infos = [
            (exc_type, message.removeprefix(f"{op}: "), op) for _, exc_type, message in collected
        ]
        produced = flatten_result(result)
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
                elif meta is not UNKNOWN:
                    _note_mismatch(plan, lowering, t[1], v, meta)
                    v = cast(v, dtypes.to_jax(meta.dtype))
                    if tuple(v.shape) != meta.shape:
                        v = jnp.broadcast_to(v, meta.shape)
                new.append(v)
            else:
                _, slot, chain, dtype, shape = t
                v = jnp.broadcast_to(cast(v, dtype), shape)
                chain, taken = positioned.get(slot, (chain, ()))
                bases[slot] = view_chains.write(bases[slot], chain, v, check_overlap, taken)
        plan.traced = True
        return (*new, *(bases[s] for s in written), *(flag for flag, _, _ in collected))

    if any(o is UNKNOWN for o in outputs):
        _fill_from_eval_shape(fn, plan, call, outputs)
    plan.fn = _named(fn, str(op))
    plan.uid = new_uid()
    plan.traced = False
    plan.traceable = jax().jit(plan.fn)  # in a compiled program, and on the host
    shapes = [st.shape for st in call.storages] + [o.shape for o in outputs if o is not None]
    plan.options = effort.single_op_options(lowering, shapes)
    plan.placed_calls = {}  # Plan.placed: its eager programs by device
    plan.call = plan.placed(0)  # eager, on tpu:0 (Note [Every array is committed to its device])
    plan.donating = {}  # plans.py _donating: its programs by (donated positions, device)
    # What running or recording it needs, computed once.
    plan.fresh = [None if o is None else (o, o.meta) for o in outputs]
    plan.avals = [
        (o.shape, dtypes.to_jax(o.dtype)) if o is not None else ((), None) for o in outputs
    ]
    plan.avals += [(call.storages[s].shape, dtypes.to_jax(call.storages[s].dtype)) for s in written]
    plan.output_bytes = sum(math.prod(shape) * d.itemsize for shape, d in plan.avals if d is not None)
    plan.single = returns[0][1] if len(returns) == 1 and returns[0][0] == "tensor" else None
    plan.host_rule = _host_rule(plan, call, outputs) if policy.active() else None
    plan.traced_rule = _traced_rule(plan, call, outputs)
    return plan


def _host_rule(plan, call, outputs):
    """The platform policy's rule that keeps this call off the device, or None: a
    dtype the host keeps among its storages or results, else a rule its program
    breaks (runtime/policy.py; traced once, abstractly, only where the policy applies)."""
    kinds = {s.dtype for s in call.storages} | {o.dtype for o in outputs if o is not None}
    rule = policy.rule_for_dtypes(kinds)
    if rule is not None:
        return rule
    return _program_rule(plan, call)


def _traced_rule(plan, call, outputs):
    """The rule that refuses this call inside a compiled program, which cannot step out
    to the host: the host rule, except that 0-d float64 tensors are numbers there.
    Dynamo passes a Python float that changes between calls (a temperature, a learning
    rate) as a 0-d float64 tensor; on the device it is a float64 number, as a Python
    float already is (Note [Numbers as arrays]), so a call whose only float64 tensors
    are 0-d is kept if its program breaks no rule."""
    if plan.host_rule is not policy.FLOAT64:
        return plan.host_rule
    shapes = [s.shape for s in call.storages if s.dtype == torch.float64]
    shapes += [o.shape for o in outputs if o is not None and o.dtype == torch.float64]
    if any(shapes):  # a float64 tensor with dimensions
        return plan.host_rule
    return _program_rule(plan, call)


def _program_rule(plan, call):
    """The first rule of the policy the call's program breaks (traced abstractly)."""
    args = [
        jax().ShapeDtypeStruct(a.shape, a.dtype) if type(a) is Pending else a for a in call.arrays
    ]
    args += as_arrays(call.scalars)  # as the plan is called (Note [Numbers as arrays])
    if plan.random:
        args += [0, 0]
    try:
        program = jax().make_jaxpr(plan.fn)(*args)
    except Exception:  # bad input the lowering refuses: raised, as torch's, when it runs
        return None
    return policy.broken_rule(program)


def _named(fn, name: str):
    """``fn`` traced in the named scope ``name`` (the aten op) and under that name, so the
    XLA program is ``jit_<op>`` and its instructions carry ``<op>`` in their metadata,
    inside a DeferAndFuse chunk and a compiled step too (Note [Profiles name aten ops])."""
    scope = jax().named_scope

    def named(*flat):
        with scope(name):
            return fn(*flat)

    named.__name__ = named.__qualname__ = name
    return named


def _promotion(lowering, names, margs):
    """The dtype a lowering's promoting inputs are cast to, and their names."""
    if lowering.promote is None:
        return None, set()
    promoting = lowering.promote_args
    if promoting is None:
        promoting = tuple(
            a.name
            for a in info(lowering.op).args
            if a.kind in (Kind.TENSOR, Kind.SCALAR) and a.name != "alpha"
        )
    operands = []
    for n in promoting:
        if n in names:
            value = margs[names.index(n)]
            operands.extend(value if isinstance(value, list) else [value])
    operands = [o for o in operands if isinstance(o, (torch.Tensor, int, float, bool, complex))]
    if not operands:
        return None, set()
    promote_to, _ = elementwise_dtypes(*operands, type_promotion_kind=lowering.promote)
    return promote_to, set(promoting)


def _kind_of(dtype) -> str:
    jnp = jax().numpy
    if jnp.dtype(dtype) == jnp.bool_:
        return "bool"
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return "complex"
    if jnp.issubdtype(dtype, jnp.floating):
        return "floating"
    return "integer"


def _note_mismatch(plan, lowering, position, value, meta: OutMeta) -> None:
    """Note [Lowering results in Debug mode]."""
    if plan.mismatch is not None or not hasattr(value, "shape"):
        return
    expected = dtypes.to_jax(meta.dtype)
    if tuple(value.shape) != meta.shape:
        plan.mismatch = (
            f"output {position} of the lowering {lowering.fn.__module__}.{lowering.fn.__name__} "
            f"has shape {list(value.shape)} where torch's meta kernel gives {list(meta.shape)}"
        )
    elif "dtype" not in plan.names and _kind_of(value.dtype) != _kind_of(expected):
        plan.mismatch = (
            f"output {position} of the lowering {lowering.fn.__module__}.{lowering.fn.__name__} "
            f"is {value.dtype} where torch's meta kernel gives {meta.dtype}"
        )


def _fill_from_eval_shape(fn, plan, call, outputs):
    """No meta kernel: take output shapes and dtypes from JAX (contiguous strides)."""
    arrays = [
        jax().ShapeDtypeStruct(a.shape, a.dtype) if type(a) is Pending else a for a in call.arrays
    ]
    args = arrays + list(call.scalars)
    if plan.random:
        args += [0, 0]
    shapes = jax().eval_shape(fn, *args)
    for i, o in enumerate(outputs):
        if o is UNKNOWN:
            s = shapes[i]
            outputs[i] = OutMeta(tuple(s.shape), contiguous(s.shape), dtypes.to_torch(s.dtype))


def flatten_result(result) -> list:
    if isinstance(result, (tuple, list)):
        out = []
        for r in result:
            if isinstance(r, (tuple, list)):
                out.extend(r)
            else:
                out.append(r)
        return out
    return [result]
