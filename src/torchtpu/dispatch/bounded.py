"""Results whose size depends on values, at a size the user states: `torchtpu.bounded`.

Note [Sizes the user states]
    ``nonzero`` (and so boolean indexing, ``argwhere``, ``torch.where(cond)``),
    ``masked_select``, ``unique`` and ``unique_consecutive`` return as many elements as
    their input's values say, so a tensor's size waits for values: DeferAndFuse ends its
    chunk there and the host waits for the count (plans.py `_run_dynamic`), and
    `torchtpu.jit` refuses the op. Often the user knows the size: top-k routing selects
    exactly k tokens an expert, a mask is built with a known count. ``with
    torchtpu.bounded(size):`` states it for the block: these ops then run as ops of that
    static size (``torchtpu_bounded::*``, ops/indexing.py), recorded into the chunk,
    compiled in the background or traced into a program like any op, and nothing waits.

    The size is checked on the device, as index bounds are (checks.py): a wrong one
    raises RuntimeError naming the op and the line at the next read, never a result cut
    or padded to fit. An exact size, not a bound, for that reason: torch's results have
    no padding, and ``torch.nonzero_static(x, size=n, fill_value=...)`` is the op for
    results padded to a bound. The statement is per thread (as ``torch.no_grad()``) and
    covers only the ops above; autograd's backward of them needs no sizes.
"""

from __future__ import annotations

import operator
import threading

import torch
from torch._prims_common import canonicalize_dim

from torchtpu.ops.indexing import masked_select_bounded, nonzero_bounded, unique_bounded

aten = torch.ops.aten

_stated = threading.local()


def stated() -> int | None:
    """The size stated by the innermost ``torchtpu.bounded`` block of this thread."""
    return getattr(_stated, "size", None)


class bounded:
    """``with torchtpu.bounded(size):`` -- the variable-size ops in the block (nonzero,
    boolean indexing, masked_select, unique, unique_consecutive) give ``size`` elements
    (rows for ``nonzero``, values or slices for ``unique``), which lets them run without
    waiting for values. A wrong size raises RuntimeError at the next read."""

    def __init__(self, size: int):
        try:  # an int, a numpy integer, an integer tensor of one element
            count = None if isinstance(size, bool) else operator.index(size)
        except TypeError:
            count = None
        if count is None or count < 0:
            raise ValueError(f"torchtpu.bounded: size must be an int >= 0, not {size!r}")
        self.size = count

    def __enter__(self) -> bounded:
        self._outer = stated()
        _stated.size = self.size
        return self

    def __exit__(self, *exc) -> None:
        _stated.size = self._outer


def _empty_long(self):
    return self.new_empty((0,), dtype=torch.int64)


def _unique_flat(self, size, sorted=True, return_inverse=False):
    values, inverse, _ = unique_bounded(self, size, None, False)
    return values, inverse if return_inverse else _empty_long(self)


def _unique2(self, size, sorted=True, return_inverse=False, return_counts=False):
    values, inverse, counts = unique_bounded(self, size, None, False)
    return (
        values,
        inverse if return_inverse else _empty_long(self),
        counts if return_counts else _empty_long(self),
    )


def _unique_dim(self, size, dim, sorted=True, return_inverse=False, return_counts=False):
    return unique_bounded(self, size, canonicalize_dim(self.dim(), dim), False)


def _unique_consecutive(self, size, return_inverse=False, return_counts=False, dim=None):
    if dim is not None:
        dim = canonicalize_dim(self.dim(), dim)
    values, inverse, counts = unique_bounded(self, size, dim, True)
    return (
        values,
        inverse if return_inverse else _empty_long(self),
        counts if return_counts else _empty_long(self),
    )


#: The ops a stated size covers: aten op -> its call at that size, taking
#: ``(self, size, *rest)`` with the op's arguments in schema order.
AT_SIZE = {
    aten.nonzero.default: lambda self, size: nonzero_bounded(self, size),
    aten.masked_select.default: lambda self, size, mask: masked_select_bounded(self, mask, size),
    aten._unique.default: _unique_flat,
    aten._unique2.default: _unique2,
    aten.unique_dim.default: _unique_dim,
    aten.unique_consecutive.default: _unique_consecutive,
}
