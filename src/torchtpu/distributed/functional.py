"""``torch.distributed._functional_collectives`` on tpu tensors: the
``_c10d_functional.*`` ops run on the group's tpu collectives, not the CPU fallback.

Each op is a dispatcher handler (registered with ``dispatch.special.register``): it
makes the result tensor and calls the group's method (process_group.py), which runs
the collective and writes the result. The collective has been dispatched when the op
returns, so ``wait_tensor`` has nothing to wait for.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives  # noqa: F401 (defines _wrap_tensor_autograd)
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BroadcastOptions,
    ProcessGroup,
    ReduceOp,
    ReduceScatterOptions,
)

from torchtpu.dispatch import special

__all__ = ["register"]

c10d = torch.ops._c10d_functional


def _group(name) -> ProcessGroup:
    if isinstance(name, ProcessGroup):
        return name
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _reduce_opts(cls, reduce_op: str):
    opts = cls()
    opts.reduceOp = getattr(ReduceOp, reduce_op.upper())
    return opts


def all_reduce_(input, reduce_op, group_name):
    _group(group_name).allreduce([input], _reduce_opts(AllreduceOptions, reduce_op))
    return input


def all_reduce(input, reduce_op, group_name):
    return all_reduce_(input.clone(), reduce_op, group_name)


def all_reduce_coalesced_(inputs, reduce_op, group_name):
    _group(group_name).allreduce_coalesced(list(inputs), _reduce_opts(AllreduceOptions, reduce_op))
    return list(inputs)


def all_reduce_coalesced(inputs, reduce_op, group_name):
    return all_reduce_coalesced_([t.clone() for t in inputs], reduce_op, group_name)


def _gathered(input, group_size: int):
    shape = (input.shape[0] * group_size, *input.shape[1:]) if input.dim() else (group_size,)
    return input.new_empty(shape)


def all_gather_into_tensor_out(input, group_size, group_name, *, out):
    _group(group_name).all_gather_single(out, input, AllgatherOptions())
    return out


def all_gather_into_tensor(input, group_size, group_name):
    return all_gather_into_tensor_out(
        input, group_size, group_name, out=_gathered(input, group_size)
    )


def all_gather_into_tensor_coalesced(inputs, group_size, group_name):
    outs = [_gathered(t, group_size) for t in inputs]
    _group(group_name).all_gather_single_coalesced(outs, list(inputs), AllgatherOptions())
    return outs


def _scattered(input, group_size: int):
    return input.new_empty((input.shape[0] // group_size, *input.shape[1:]))


def reduce_scatter_tensor_out(input, reduce_op, group_size, group_name, *, out):
    opts = _reduce_opts(ReduceScatterOptions, reduce_op)
    _group(group_name).reduce_scatter_single(out, input, opts)
    return out


def reduce_scatter_tensor(input, reduce_op, group_size, group_name):
    out = _scattered(input, group_size)
    return reduce_scatter_tensor_out(input, reduce_op, group_size, group_name, out=out)


def reduce_scatter_tensor_coalesced(inputs, reduce_op, group_size, group_name):
    outs = [_scattered(t, group_size) for t in inputs]
    opts = _reduce_opts(ReduceScatterOptions, reduce_op)
    _group(group_name).reduce_scatter_single_coalesced(outs, list(inputs), opts)
    return outs


def all_to_all_single(input, output_split_sizes, input_split_sizes, group_name):
    rows = sum(output_split_sizes) if output_split_sizes else input.shape[0]
    out = input.new_empty((rows, *input.shape[1:]))
    _group(group_name).all_to_all_single(
        out, input, list(output_split_sizes), list(input_split_sizes)
    )
    return out


def broadcast_(input, src, group_name):
    opts = BroadcastOptions()
    opts.rootRank = src  # as torch's own kernel: the root's rank in the group
    _group(group_name).broadcast([input], opts)
    return input


def broadcast(input, src, group_name):
    return broadcast_(input.clone(), src, group_name)


def wait_tensor(tensor):
    return tensor


def _wrap_tensor_autograd(input):
    # torch wraps a collective's result in an AsyncCollectiveTensor that waits on first
    # use; a tpu result needs no waiting: the same values, on the same storage.
    return torch.ops.aten.alias.default(input)


_OPS = {
    "all_reduce": all_reduce,
    "all_reduce_": all_reduce_,
    "all_reduce_coalesced": all_reduce_coalesced,
    "all_reduce_coalesced_": all_reduce_coalesced_,
    "all_gather_into_tensor": all_gather_into_tensor,
    "all_gather_into_tensor_out": all_gather_into_tensor_out,
    "all_gather_into_tensor_coalesced": all_gather_into_tensor_coalesced,
    "reduce_scatter_tensor": reduce_scatter_tensor,
    "reduce_scatter_tensor_out": reduce_scatter_tensor_out,
    "reduce_scatter_tensor_coalesced": reduce_scatter_tensor_coalesced,
    "all_to_all_single": all_to_all_single,
    "broadcast": broadcast,
    "broadcast_": broadcast_,
    "wait_tensor": wait_tensor,
    "_wrap_tensor_autograd": _wrap_tensor_autograd,
}


def _handler(fn):
    def handle(func, args, kwargs):
        return fn(*args, **kwargs)

    return handle


def register() -> None:
    """Route the ``_c10d_functional`` ops on tpu tensors to the handlers above."""
    for name, fn in _OPS.items():
        special.register(getattr(c10d, name).default, _handler(fn))
