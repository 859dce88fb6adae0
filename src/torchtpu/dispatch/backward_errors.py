"""Errors raised by tpu ops while autograd runs a backward pass.

Note [Why backward errors are deferred]
    torch runs backward ops under a device stream guard whose methods, for a device
    registered from Python, call back into Python. When an op raises a Python
    exception, torch unwinds with the exception still *set* in the interpreter; the
    guard's destructor then calls Python, which fails, inside a destructor: the
    process aborts ("terminate called without an active exception"). No exception may
    leave a tpu op during backward.

    So an op that fails during backward records its exception and returns *poisoned*
    outputs (their storages hold a failed `Pending`, defer.py) of the shapes torch
    expects. The backward pass completes; the error is raised, unchanged, by the next
    tpu op or value read on the user's thread, or by reading any poisoned value (a
    gradient). An exception raised by the user's own backward hook is outside this
    and still aborts (torch's limitation for Python-registered devices).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

from torchtpu.dispatch import schema

_raised: list[BaseException] = []


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def record(exc: BaseException) -> None:
    """Keep ``exc``, raised during backward, for the user's thread (`raise_deferred`)."""
    _raised.append(exc)


def poisoned(func, args, kwargs, exc: BaseException):
    """Outputs of ``func`` that raise ``exc`` when read; ``exc`` is raised later."""
    from torchtpu.storage import Storage
    from torchtpu.tensor import TPUTensor

    exc.add_note(f"torchtpu: raised by {func} during backward()")
    record(exc)

    def to_meta(t: TPUTensor):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    meta_args, meta_kwargs = tree_map_only(TPUTensor, to_meta, (args, kwargs))
    try:
        out = func(*meta_args, **meta_kwargs)
    except Exception:
        out = None  # torch's engine reports the missing output, without a Python error
    info = schema.info(func)
    values = info.bind(args, kwargs)
    for t in tree_leaves([values[i] for i in info.mutable]):
        if isinstance(t, TPUTensor):
            t._storage.array = failed(t._storage.shape, t._storage.dtype, exc)
    written = info.returned_written(args, kwargs)
    if written is not None:
        return written

    def wrap(m):
        if not isinstance(m, torch.Tensor):
            return m
        shape, strides = tuple(m.shape), tuple(m.stride())
        storage = Storage(failed(shape, m.dtype, exc), shape, strides, m.dtype, 0)
        return TPUTensor(storage, (), shape, strides, 0, m.dtype)

    return tree_map(wrap, out)


def failed(shape, dtype, exc: BaseException):
    """A value that raises ``exc`` when read: a Pending whose chunk failed (defer.py)."""
    from torchtpu.dispatch.pending import Pending

    pending = Pending(-1, 0, tuple(shape), dtype)
    pending.error = exc
    return pending


def raise_deferred() -> None:
    """Raise the first error recorded during a backward pass, once."""
    if _raised:
        exc = _raised[0]
        _raised.clear()
        raise exc
