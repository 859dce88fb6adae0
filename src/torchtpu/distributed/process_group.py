"""The ``"tpu"`` torch.distributed backend: a ProcessGroup whose collectives run as
JAX programs over one device per process (collectives.py).

torch 2.13 calls a group's methods by two sets of names: the ones its Python API uses
(``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``, ...) and the
older ones DDP and other code use (``allreduce``, ``_allgather_base``, ``alltoall_base``,
...); both are here. Every call returns a Work holding the list of output tensors
(completed: the program has been dispatched; reading a result waits for it as for any
tpu tensor). Tensors may be tpu or CPU tensors (object collectives send CPU tensors),
of any dtype, views (results are written back through the view), or 0-d.
"""

from __future__ import annotations

import pickle

import torch
from torch._C._distributed_c10d import ProcessGroup, ReduceOp, _create_work_from_future

from torchtpu import _compat, config, runtime
from torchtpu.dispatch import defer
from torchtpu.dispatch.values import OutMeta, contiguous, materialize, wrap
from torchtpu.distributed import (
    CollectiveMismatchError,
    collectives,
    fsdp_storage,
    functional,
    liveness,
)
from torchtpu.distributed.collectives import Spec
from torchtpu.runtime.transfer import to_device, to_host
from torchtpu.tensor import TPUTensor

__all__ = ["CollectiveMismatchError", "ProcessGroupTPU"]


def _op_name(op) -> tuple[str, tuple]:
    """torch's ReduceOp (or RedOpType) as a collectives name and its static factor."""
    red = op.op if isinstance(op, ReduceOp) else op
    name = red.name.lower()
    if name == "premul_sum":
        return name, (_compat.premul_sum_factor(op),)
    return name, ()


class _Capabilities:
    """What torch reads of a backend before it splits or coalesces with it."""

    supports_splitting = False
    supports_coalescing = False


_NO_SPLITTING = _Capabilities()


class ProcessGroupTPU(ProcessGroup):
    """A group of processes, each computing on one tpu device.

    Made by ``init_process_group("tpu")`` / ``new_group(...)``, never directly."""

    def __init__(self, store, rank: int, size: int, global_ranks):
        super().__init__(rank, size)
        self._store = store
        self._global_ranks = tuple(global_ranks)
        self._seq = 0
        self._group_name = self._group_desc = ""

    # -- names torch asks for ---------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "tpu"

    def name(self) -> str:
        return "tpu"

    # torch's ProcessGroup reads its name from its C++ backends, and this group has
    # none: functional collectives and DeviceMesh look groups up by these names.
    def _set_group_name(self, name: str) -> None:
        super()._set_group_name(name)
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        super()._set_group_desc(desc)
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    # torch asks the group for its C++ backend of a device where one may be split or
    # coalesced (``init_process_group(..., device_id=...)``, as Lightning's DDP passes
    # it; ``new_group``): this group is its own backend, and does neither.
    def _get_backend(self, device):
        if torch.device(device).type == "tpu":
            return _NO_SPLITTING
        return super()._get_backend(device)

    # -- the machinery ----------------------------------------------------------------------

    def _devices(self, tensors) -> tuple:
        return collectives.group_devices(self._global_ranks, _local_index(tensors))

    def _read(self, tensors) -> list:
        """The current values of ``tensors`` as arrays on this process's device."""
        fsdp_storage.install_if_imported()
        defer.flush("collective")
        index = _local_index(tensors)
        return [
            materialize(t) if isinstance(t, TPUTensor) else to_device(t, index) for t in tensors
        ]

    def _agree(self, spec: Spec, info=None) -> list:
        """Compare ``spec`` with every other rank's through the store (a mismatch raises
        on each rank) and return every rank's ``info``: a set, a multi_get, a delete."""
        if not config.distributed_check and info is None:
            return []
        self._seq += 1
        seq, me = self._seq, self.rank()
        mine = (spec.kind, spec.op, spec.static, spec.avals)
        self._store.set(f"c/{seq}/{me}", pickle.dumps((mine, info)))
        keys = [f"c/{seq}/{r}" for r in range(self.size())]
        owed = tuple(zip(self._global_ranks, keys, strict=True))
        with liveness.waiting(spec.kind, self._global_ranks, self._store, owed):
            got = [pickle.loads(v) for v in self._store.multi_get(keys)]
        gone = {g.rank: g.how for g in got if isinstance(g, liveness.Gone)}
        if gone:  # Note [Liveness]
            raise liveness.error(self._global_ranks[me], gone, spec.kind)
        if seq > 1:
            # every rank has read the previous call's keys: it has entered this one
            self._store.delete_key(f"c/{seq - 1}/{me}")
        others = {r: g for r, (g, _) in enumerate(got) if g != mine}
        if others:
            lines = "\n".join(f"  rank {r}: {_describe(g)}" for r, (g, _) in enumerate(got))
            raise CollectiveMismatchError(
                f"rank {me}: the ranks of the process group called different collectives "
                f"(collective #{seq} of this group):\n{lines}\nEvery rank must run the same "
                "collectives, on tensors of the same shapes and dtypes, in the same order."
            )
        return [i for _, i in got]

    def _run(self, kind: str, tensors, op=None, static=(), info=None):
        arrays = self._read(tensors)
        avals = tuple((tuple(a.shape), a.dtype.name) for a in arrays)
        spec = Spec(kind, op, tuple(static), avals, self._devices(tensors))
        infos = self._agree(spec, info)
        return collectives.run(spec, arrays), infos

    @staticmethod
    def _done(result) -> torch._C._distributed_c10d.Work:
        fut = torch.futures.Future()
        fut.set_result(result)
        return _create_work_from_future(fut)

    # -- all_reduce -------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        op, static = _op_name(_reduce_op(opts))
        results, _ = self._run("all_reduce", tensors, op, static)
        for t, r in zip(tensors, results, strict=True):
            _write(t, r)
        return self._done(list(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    # -- broadcast, reduce ------------------------------------------------------------------

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        results, _ = self._run("broadcast", tensors, static=(root,))
        if self.rank() != root:
            for t, r in zip(tensors, results, strict=True):
                _write(t, r)
        return self._done(list(tensors))

    def reduce(self, tensors, opts=None):
        op, static = _op_name(_reduce_op(opts))
        results, _ = self._run("all_reduce", tensors, op, static)
        if self.rank() == opts.rootRank:
            for t, r in zip(tensors, results, strict=True):
                _write(t, r)
        return self._done(list(tensors))

    # -- all_gather -------------------------------------------------------------------------

    def allgather(self, output_lists, inputs, opts=None):
        results, _ = self._run("all_gather", inputs)
        for outs, r in zip(output_lists, results, strict=True):
            _check_count(outs, self.size(), "all_gather's output list")
            _write_rows(outs, r)
        return self._done(output_lists)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def all_gather_single(self, output, input, opts=None):
        (r,), _ = self._run("all_gather", [input])
        _write(output, r)
        return self._done([output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        results, _ = self._run("all_gather", inputs)
        for t, r in zip(outputs, results, strict=True):
            _write(t, r)
        return self._done(list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists, inputs, opts=None):
        results, _ = self._run("all_gather", inputs, static=(opts.rootRank,))
        if self.rank() == opts.rootRank:
            for outs, r in zip(output_lists, results, strict=True):
                _check_count(outs, self.size(), "gather's output list")
                _write_rows(outs, r)
        return self._done(output_lists)

    # -- reduce_scatter ---------------------------------------------------------------------

    def reduce_scatter(self, outputs, input_lists, opts=None):
        for ins in input_lists:
            _check_count(ins, self.size(), "reduce_scatter's input list")
        stacked = [torch.stack(list(ins)) for ins in input_lists]
        return self._reduce_scatter(outputs, stacked, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter([output], [_rows(input, self.size())], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._reduce_scatter(outputs, [_rows(t, self.size()) for t in inputs], opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter(self, outputs, stacked, opts):
        op, static = _op_name(_reduce_op(opts))
        results, _ = self._run("reduce_scatter", stacked, op, static)
        for t, r in zip(outputs, results, strict=True):
            _write(t, r)
        return self._done(list(outputs))

    # -- all_to_all, scatter ----------------------------------------------------------------

    def alltoall(self, output_list, input_list, opts=None):
        n = self.size()
        _check_count(input_list, n, "all_to_all's input list")
        _check_count(output_list, n, "all_to_all's output list")
        shapes = {tuple(t.shape) for t in input_list}
        if len(shapes) == 1 and all(tuple(o.shape) in shapes for o in output_list):
            (r,), _ = self._run("all_to_all", [torch.stack(list(input_list))])
            _write_rows(output_list, r)
            return self._done(output_list)
        # Chunks of different shapes: each one flattened, then split sizes.
        flat_in = torch.cat([t.reshape(-1) for t in input_list])
        flat_out = torch.empty(
            sum(o.numel() for o in output_list), dtype=flat_in.dtype, device=flat_in.device
        )
        self.all_to_all_single(
            flat_out, flat_in, [o.numel() for o in output_list], [t.numel() for t in input_list]
        )
        for o, piece in zip(
            output_list, flat_out.split([o.numel() for o in output_list]), strict=True
        ):
            _write(o, piece.reshape(o.shape))
        return self._done(output_list)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self.size()
        if not output_split_sizes and not input_split_sizes:
            (r,), _ = self._run("all_to_all", [_rows(input, n)])
            _write(output, r)
            return self._done([output])
        return self._uneven_all_to_all(output, input, output_split_sizes, input_split_sizes)

    alltoall_base = all_to_all_single

    def _uneven_all_to_all(self, output, input, output_split_sizes, input_split_sizes):
        n, me = self.size(), self.rank()
        ins = list(input_split_sizes) or _even(input.shape[0], n, "input")
        outs = list(output_split_sizes) or _even(output.shape[0], n, "output")
        if (
            sum(ins) != input.shape[0]
            or sum(outs) != output.shape[0]
            or len(ins) != n
            or len(outs) != n
        ):
            raise ValueError(
                f"all_to_all_single: split sizes {ins} / {outs} do not match the input's and "
                f"output's first dimensions {input.shape[0]} / {output.shape[0]} over {n} ranks"
            )
        # Every rank's split sizes travel with the shape check; each rank pads its input
        # to the longest one, all ranks gather all inputs and each takes its pieces.
        (array,) = self._read([input])
        spec_avals = ((("?", *input.shape[1:]), array.dtype.name),)
        probe = Spec("all_to_all_uneven", None, (), spec_avals, self._devices([input]))
        splits = self._agree(probe, info=(tuple(ins), tuple(outs)))
        all_ins = [i for i, _ in splits]
        for dst, (_, expected) in enumerate(splits):  # on every rank, before any data moves
            for src in range(n):
                if all_ins[src][dst] != expected[src]:
                    raise CollectiveMismatchError(
                        f"rank {me}: in all_to_all_single rank {dst} expects {expected[src]} "
                        f"rows from rank {src}, which sends it {all_ins[src][dst]}"
                    )
        longest = max(sum(i) for i in all_ins)
        jnp = runtime.jax().numpy
        padded = jnp.pad(array, [(0, longest - array.shape[0])] + [(0, 0)] * (array.ndim - 1))
        avals = ((tuple(padded.shape), padded.dtype.name),)
        spec = Spec("all_gather", None, (), avals, probe.devices)
        (gathered,) = collectives.run(spec, [padded])
        pieces = []
        for src in range(n):
            start = sum(all_ins[src][:me])
            pieces.append(gathered[src, start : start + all_ins[src][me]])
        _write(output, jnp.concatenate(pieces, axis=0))
        return self._done([output])

    def scatter(self, outputs, input_lists, opts=None):
        root, n = opts.rootRank, self.size()
        (out,) = outputs
        if self.rank() == root:
            (ins,) = input_lists
            _check_count(ins, n, "scatter's input list")
            stacked = torch.stack(list(ins))
        else:
            stacked = out.new_zeros((n, *out.shape))
        (r,), _ = self._run("scatter", [stacked], static=(root,))
        _write(out, r)
        return self._done(list(outputs))

    # -- barrier, point to point ------------------------------------------------------------

    def barrier(self, opts=None):
        token = torch.zeros((), dtype=torch.int32)
        (r,), _ = self._run("all_reduce", [token], collectives.SUM)
        if not isinstance(r, runtime.jax().core.Tracer):  # in a program, the psum orders
            r.block_until_ready()
        return self._done([token])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return self.barrier()

    # Note [send and recv]: a send and its recv are one program, a ppermute over a mesh
    # of the two ranks, which both processes enter; so a send returns when the peer has
    # called the matching recv (as a blocking send), and a rank that sends to and
    # receives from the same peer must order the calls to match the peer's (rank 0
    # sends then receives, rank 1 receives then sends). A batch of isend/irecv to each
    # other entered in the same order on both ranks waits forever.

    def send(self, tensors, dst, tag=0):
        self._point_to_point(tensors, self.rank(), dst, sending=True)
        return self._done(list(tensors))

    def recv(self, tensors, src, tag=0):
        self._point_to_point(tensors, src, self.rank(), sending=False)
        return self._done(list(tensors))

    def recv_anysource(self, tensors, tag=0):
        raise NotImplementedError(
            "recv from any source is not supported by the tpu backend: a message is a "
            "program both ranks enter, so the receiver must name the sender"
        )

    def _point_to_point(self, tensors, src: int, dst: int, sending: bool) -> None:
        if src == dst:
            raise ValueError(f"rank {src} cannot send to itself")
        pair = sorted((src, dst))
        arrays = self._read(tensors)
        avals = tuple((tuple(a.shape), a.dtype.name) for a in arrays)
        ranks = [self._global_ranks[r] for r in pair]
        devices = collectives.group_devices(ranks, _local_index(tensors))
        static = (pair.index(src), pair.index(dst))
        results = collectives.run(Spec("permute", None, static, avals, devices), arrays)
        if not sending:
            for t, r in zip(tensors, results, strict=True):
                _write(t, r)


functional.register()


def _local_index(tensors) -> int:
    """The tpu device the call runs on: its tensors' (CPU tensors: the current one)."""
    return next(
        (t.device.index for t in tensors if isinstance(t, TPUTensor)), runtime.current_index()
    )


def _reduce_op(opts):
    if opts is None:
        return ReduceOp.SUM
    if isinstance(opts, (ReduceOp, ReduceOp.RedOpType)):
        return opts
    return opts.reduceOp


def _check_count(tensors, n: int, what: str) -> None:
    if len(tensors) != n:
        raise ValueError(f"{what} has {len(tensors)} tensors; the group has {n} ranks")


def _even(length: int, n: int, what: str) -> list[int]:
    if length % n:
        raise ValueError(
            f"all_to_all_single: the {what}'s first dimension {length} is not divisible by {n}"
        )
    return [length // n] * n


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` (first dimension ``n * k``) as ``(n, k, ...)``: row ``i`` for rank ``i``."""
    if t.dim() == 0 or t.shape[0] % n:
        raise ValueError(
            f"a tensor of shape {tuple(t.shape)} cannot be split into {n} equal chunks along dim 0"
        )
    return t.reshape(n, t.shape[0] // n, *t.shape[1:])


def _write(t: torch.Tensor, array) -> None:
    """Write ``array``'s values into ``t`` (a tpu or CPU tensor, maybe a view)."""
    if tuple(array.shape) != tuple(t.shape):
        array = array.reshape(tuple(t.shape))
    with torch.no_grad():
        if isinstance(t, TPUTensor):
            shape = tuple(array.shape)
            t.copy_(wrap(array, OutMeta(shape, contiguous(shape), t.dtype), t.device.index))
        else:
            t.copy_(to_host(array))


def _write_rows(tensors, array) -> None:
    for i, t in enumerate(tensors):
        _write(t, array[i])


def _describe(sig) -> str:
    kind, op, static, avals = sig
    parts = [kind]
    if op:
        parts.append(f"op={op}")
    if static:
        parts.append(f"static={static}")
    parts.append(", ".join(f"{dtype}{list(shape)}" for shape, dtype in avals))
    return " ".join(parts)
