"""Which programs XLA compiles with its least execution-time effort.

Note [The least effort for programs without products]
    ``config.op_compiler_options`` (XLA's least effort, by default) is what Strict's
    single-op programs compile with: one op leaves XLA little to optimise. A program
    with no matrix product or convolution is the same case at any size: an optimizer's
    update, a factory of its new state, a chunk of pointwise ops a notebook cell
    queued. On a TPU v5e, AdamW over GPT-2 small's 148 parameters as one program
    compiled in 5.3 s instead of 8.4 and ran in 7.26 ms instead of 7.14, where a whole
    training step at the least effort ran 2.1x slower (docs/performance.md). So a
    DeferAndFuse chunk or a torch.compile graph whose every op is pointwise, a
    ``_foreach_`` op (a list's norms too), a factory, a cast, a view or ``getitem``
    compiles with those options; any other op (a product, a reduction, an op of
    torchtpu's own) keeps XLA's defaults.
"""

from __future__ import annotations

import operator

import torch

from torchtpu import config
from torchtpu.dispatch.schema import FACTORIES

aten = torch.ops.aten

_ALSO_LIGHT = frozenset(
    (operator.getitem, aten._to_copy.default, aten.copy_.default, aten.clone.default)
) | FACTORIES


def _light(op) -> bool:
    if op in _ALSO_LIGHT:
        return True
    if not isinstance(op, torch._ops.OpOverload):
        return False  # a compiled graph's call, a function of torchtpu's own
    return (
        torch.Tag.pointwise in op.tags
        or op.is_view
        or op.__name__.startswith("_foreach_")
    )


def compiler_options(ops) -> dict | None:
    """The compiler options of a program made of ``ops`` (aten OpOverloads or other
    callables): ``config.op_compiler_options`` where none is a product (Note [The least
    effort for programs without products]), else None (XLA's defaults)."""
    options = config.op_compiler_options
    if not options or not all(_light(op) for op in ops):
        return None
    return options
