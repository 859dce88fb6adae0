"""Float32 matrix products traced below float32 precision: a wrong answer on a TPU that
the CPU cannot show.

A float32 ``dot_general`` or convolution traced with no ``precision`` runs at XLA's
default, which on a TPU is one bfloat16 pass (about 3 significant digits); XLA:CPU
computes it in float32 whatever the setting, so such a lowering passes every check on
the CPU and is wrong on the chip (``linalg.pinv`` was, by 3e-3). Under torch's default
setting ("highest") every float32 product must be traced at HIGHEST; ``watch()``
records those that were not, as the harness runs each case.
"""

from __future__ import annotations

import contextlib

import numpy as np

_SINGLE = (np.float32, np.complex64)  # a complex64 product is float32 products


def _primitives():
    from jax._src.lax import convolution, lax  # the primitives are not public

    return lax.dot_general_p, convolution.conv_general_dilated_p


def _highest(precision) -> bool:
    from jax import lax

    if isinstance(precision, tuple):
        return all(p == lax.Precision.HIGHEST for p in precision)
    if isinstance(precision, lax.DotAlgorithmPreset):
        return precision == lax.DotAlgorithmPreset.F32_F32_F32
    return precision == lax.Precision.HIGHEST


@contextlib.contextmanager
def watch():
    """Yields a list that gains ``"primitive(float32[shape], ...) precision=..."`` for
    each float32 or complex64 product lowered meanwhile below HIGHEST.

    It watches the products' lowering rules, not their tracing: jnp.matmul and friends
    are jitted, and JAX traces each of them once per shape and precision, whereas every
    new program is lowered whole."""
    from jax._src.interpreters import mlir  # the rule tables are not public

    found: list[str] = []
    replaced = []

    def watching(primitive, rule):
        def lower(ctx, *args, **params):
            operands = ctx.avals_in[:2]
            if any(a.dtype in _SINGLE for a in operands) and not _highest(params.get("precision")):
                shapes = ", ".join(a.str_short() for a in operands)
                found.append(f"{primitive.name}({shapes}) precision={params.get('precision')}")
            return rule(ctx, *args, **params)

        return lower

    tables = [mlir._lowerings, *mlir._platform_specific_lowerings.values()]
    for primitive in _primitives():
        for table in tables:
            entry = table.get(primitive)
            if entry is not None:
                replaced.append((table, primitive, entry))
                table[primitive] = mlir.LoweringRuleEntry(
                    watching(primitive, entry.rule), entry.inline
                )
    try:
        yield found
    finally:
        for table, primitive, entry in replaced:
            table[primitive] = entry
