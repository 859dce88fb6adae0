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
    torchtpu's own) keeps XLA's defaults. Strict's single-op programs: below
    (`single_op_options`).
"""

from __future__ import annotations

import math
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


# Note [Single ops with products compile at XLA's default effort]: how many elements
# the largest array of a product's call has, at least, for its program to be compiled
# at XLA's default effort (2**20: a GPT-2-small step's products all have more; the
# README demo MLP's, at most 512 x 1024 weights, have fewer).
LARGE_PRODUCT = 1 << 20


def single_op_options(lowering, shapes) -> dict | None:
    """The compiler options of an op's eager program, ``shapes`` those of its arrays.

    Note [Single ops with products compile at XLA's default effort]
        Strict's single-op programs compile with ``config.op_compiler_options``, XLA's
        least execution-time effort: one op leaves XLA little to optimise, and
        compiling is most of an eager first step (docs/performance.md). Not so for a
        large product. On a TPU v5e, a GPT-2-small step (8x1024 tokens, autocast) in
        Strict kept the chip busy 229 ms a step with its products compiled at the
        least effort (``linear`` forward 41 ms, backward 60 ms, attention's backward
        41 ms) and 150 ms at XLA's default effort (13, 26 and 33 ms): the step went
        from 229 to 168 ms, the chip having decided it. Compiling those programs well
        cost the first step ~15 s more (41 s). So an op whose lowering takes a matmul
        precision -- a matrix product, a convolution, attention -- keeps XLA's defaults
        where one of its arrays has at least `LARGE_PRODUCT` elements; a small
        product, whose run is a launch whatever its code, and every other op compile
        with the options."""
    if lowering.precision and any(math.prod(shape) >= LARGE_PRODUCT for shape in shapes):
        return None
    return config.op_compiler_options or None
