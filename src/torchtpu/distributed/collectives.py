"""Collectives as jitted JAX programs over a mesh of one device per process.

Each process passes its local arrays; a program is ``jax.jit(shard_map(body))`` over
a 1-D mesh (axis ``"r"``) of the group's devices in group-rank order, built once per
(kind, reduce op, static arguments, shapes and dtypes, devices) and cached. Every
process of the group must call the same program in the same order (docs/distributed.md).

Local blocks carry a leading axis of 1 only for 0-d values (a block needs a dimension
to be split along); other arrays are their own block, so nothing is reshaped on the way.

Note [Reduce ops without a lax collective]: PRODUCT and the bitwise ops have no
``lax.p*``: the values are all-gathered and reduced locally, which costs ``n`` times
the bandwidth of a psum but is exact. broadcast is an all_gather then a pick for the
same reason (a psum with zeros would turn ``-0.0`` into ``0.0``).

Note [Reduce-scatter on the CPU]: XLA:CPU's gloo reduce-scatter fails when a peer
arrives more than 30 s late (jax-ml/jax#40831) where psum waits; on the CPU a
reduce-scatter is a psum followed by taking this rank's slice.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import NamedTuple

import numpy as np

from torchtpu import runtime, tracing
from torchtpu.distributed import liveness
from torchtpu.observe import metrics

AXIS = tracing.MESH_AXIS

SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM = (
    "sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum",
)  # fmt: skip


class Spec(NamedTuple):
    """What determines a program: every process of the group must build the same."""

    kind: str
    op: str | None
    static: tuple  # e.g. (root,), (factor,)
    avals: tuple  # ((shape, dtype name), ...) of the local inputs
    devices: tuple  # the group's JAX devices in group-rank order


_PROGRAMS = metrics.LRUCache("collective_cache", lambda: 256)


def run(spec: Spec, arrays) -> list:
    """Run the collective ``spec`` on this process's ``arrays``; its local results.

    Inside a compiled program's trace a collective of traced values becomes part of
    that program (Note [Collectives in compiled programs] in compile/program.py); one
    of concrete values (CPU tensors: DDP's bucket sizes, object collectives) runs now,
    as Python needs its result while tracing."""
    trace = tracing._active
    if trace is not None and any(isinstance(a, runtime.jax().core.Tracer) for a in arrays):
        return _in_trace(trace, spec, arrays)
    program = _PROGRAMS.lookup(spec)
    if program is None:
        with metrics.timer("compile_seconds", "collective"):
            program = _Program(spec)
        metrics.count("compiles", "collective")
        _PROGRAMS.insert(spec, program)
    metrics.count("collectives", spec.kind)
    metrics.count("collective_bytes", spec.kind, sum(a.size * a.dtype.itemsize for a in arrays))
    if trace is None:
        tracing.eager_collectives[0] += 1
        tracing.eager_collectives[1] = spec.devices
    else:
        # Concrete values in a trace: run now, on a thread of its own, where neither the
        # trace nor the program's mesh is JAX's context, so nothing is staged.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(program, arrays).result()
    with liveness.waiting(spec.kind, [d.process_index for d in spec.devices]):
        return program(arrays)


def _in_trace(trace, spec: Spec, arrays) -> list:
    """The collective traced into the program: its body, inside the program's
    ``shard_map`` over the mesh axis ``"r"``."""
    if trace.mesh is None:
        raise tracing.NeedsMesh(spec.devices)  # trace again, as an SPMD program
    mesh = trace.mesh
    if spec.kind == "permute" and set(spec.devices) <= set(mesh):
        # point to point between two ranks of the program's mesh
        source, dest = (mesh.index(spec.devices[i]) for i in spec.static)
        spec = spec._replace(static=(source, dest), devices=mesh)
    if spec.devices != mesh:
        raise NotImplementedError(
            "a torch.distributed collective over a subgroup inside a compiled program "
            "(torch.compile(backend='tpu') or torchtpu.jit): the program runs over the "
            f"devices of its first collective's group ({len(mesh)} processes), and this one's "
            f"group has {len(spec.devices)}. Run it outside the compiled function."
        )
    metrics.count("compiled_collectives", spec.kind)  # traced into a program
    return list(_BODIES[spec.kind](spec, len(mesh), mesh[0].platform)(list(arrays)))


def group_devices(global_ranks, local_index: int) -> tuple:
    """The JAX device of each process in ``global_ranks``: its ``tpu:local_index``."""
    jax = runtime.jax()
    by_process: dict[int, list] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    return tuple(sorted(by_process[r], key=lambda d: d.id)[local_index] for r in global_ranks)


class _Program:
    def __init__(self, spec: Spec):
        jax = runtime.jax()
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        self.n = n = len(spec.devices)
        mesh = Mesh(np.array(spec.devices, dtype=object), (AXIS,))
        self.sharding = NamedSharding(mesh, P(AXIS))
        self.in_shapes = [tuple(shape) for shape, _ in spec.avals]
        body = _BODIES[spec.kind](spec, n, spec.devices[0].platform)

        def blocks(*xs):
            values = [x if len(s) else x[0] for x, s in zip(xs, self.in_shapes, strict=True)]
            results = body(values)
            self.scalar_out = [r.ndim == 0 for r in results]  # set while tracing
            return tuple(r if r.ndim else r[None] for r in results)

        mapped = jax.shard_map(
            blocks,
            mesh=mesh,
            in_specs=(P(AXIS),) * len(spec.avals),
            out_specs=P(AXIS),
            check_vma=False,
        )
        self.call = jax.jit(mapped)

    def __call__(self, arrays) -> list:
        jax = runtime.jax()
        inputs = []
        for a, shape in zip(arrays, self.in_shapes, strict=True):
            block = a if len(shape) else a.reshape(1)
            global_shape = (self.n * block.shape[0], *block.shape[1:])
            inputs.append(
                jax.make_array_from_single_device_arrays(global_shape, self.sharding, [block])
            )
        outs = self.call(*inputs)
        return [
            o.addressable_data(0).reshape(()) if scalar else o.addressable_data(0)
            for o, scalar in zip(outs, self.scalar_out, strict=True)
        ]


# -- bodies: functions of this rank's values inside shard_map ------------------------------


def _lax():
    return runtime.jax().lax


def reduce_values(x, op: str, factor, n: int):
    """``x`` reduced over the group by torch's ReduceOp ``op``."""
    lax, jnp = _lax(), runtime.jax().numpy
    if x.dtype == jnp.bool_:
        if op in (SUM, MAX, BOR):
            return lax.pmax(x.astype(jnp.int32), AXIS).astype(jnp.bool_)
        if op in (MIN, PRODUCT, BAND):
            return lax.pmin(x.astype(jnp.int32), AXIS).astype(jnp.bool_)
    if op == SUM:
        return lax.psum(x, AXIS)
    if op == PREMUL_SUM:
        return lax.psum(x * jnp.asarray(factor, x.dtype), AXIS)
    if op == AVG:
        total = lax.psum(x, AXIS)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return (total / jnp.asarray(n, x.dtype)).astype(x.dtype)
        return lax.div(total, jnp.asarray(n, x.dtype))
    if op == MAX:
        return lax.pmax(x, AXIS)
    if op == MIN:
        return lax.pmin(x, AXIS)
    # Note [Reduce ops without a lax collective]
    gathered = lax.all_gather(x, AXIS)
    if op == PRODUCT:
        return jnp.prod(gathered, axis=0, dtype=x.dtype)
    combine = {BAND: jnp.bitwise_and, BOR: jnp.bitwise_or, BXOR: jnp.bitwise_xor}[op]
    return functools.reduce(combine, [gathered[i] for i in range(n)])


def _all_reduce(spec, n, platform):
    factor = spec.static[0] if spec.static else None
    return lambda xs: [reduce_values(x, spec.op, factor, n) for x in xs]


def _broadcast(spec, n, platform):
    (src,) = spec.static
    return lambda xs: [_lax().all_gather(x, AXIS)[src] for x in xs]


def _all_gather(spec, n, platform):
    # (n, *shape): rank i's value at [i]
    return lambda xs: [_lax().all_gather(x, AXIS) for x in xs]


def _reduce_scatter(spec, n, platform):
    # each input is (n, *chunk): this rank receives the reduction of every rank's [rank]
    factor = spec.static[0] if spec.static else None

    def body(xs):
        lax = _lax()
        if platform != "cpu" and spec.op == SUM:
            return [lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=False) for x in xs]
        # Note [Reduce-scatter on the CPU]
        me = lax.axis_index(AXIS)
        return [
            lax.dynamic_index_in_dim(reduce_values(x, spec.op, factor, n), me, 0, keepdims=False)
            for x in xs
        ]

    return body


def _all_to_all(spec, n, platform):
    # each input is (n, *chunk): [j] goes to rank j; the result's [j] came from rank j
    def body(xs):
        return [_lax().all_to_all(x, AXIS, 0, 0, tiled=True) for x in xs]

    return body


def _scatter(spec, n, platform):
    # the root's input is (n, *chunk) ([j] for rank j); the others pass anything of that shape
    (src,) = spec.static

    def body(xs):
        return [_lax().all_to_all(x, AXIS, 0, 0, tiled=True)[src] for x in xs]

    return body


def _permute(spec, n, platform):
    # point to point over a mesh of the two ranks: [0] of the mesh sends to [1] or back
    (source, dest) = spec.static
    return lambda xs: [_lax().ppermute(x, AXIS, perm=[(source, dest)]) for x in xs]


_BODIES = {
    "permute": _permute,
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "scatter": _scatter,
}
