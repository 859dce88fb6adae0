"""The lowering table: aten op overload -> JAX function. One table for everything.

A lowering is a pure function of JAX arrays and Python values, named after its aten
op. It receives the op's arguments in schema order, kwarg-only ones included, with
the schema's defaults filled in: ``aten.sum.dim_IntList(self, dim, keepdim=False, *,
dtype=None)`` is lowered by ``def sum_dim(self, dim, keepdim, dtype)``. Tensors come
as arrays; Python numbers given as ``Scalar`` arguments come as traced scalars, so a
new learning rate never recompiles (list a name in ``static=`` when it must be a
Python value, e.g. the bounds of ``arange``).

Policies are decorator arguments, written once (see Note [Type promotion policy]):

- ``promote``: torch's elementwise type-promotion kind. The dispatcher casts the
  ``promote_args`` to torch's computation dtype before the lowering runs and casts
  the result to torch's result dtype, so a lowering never decides dtypes itself.
- ``compute_in_result``: arguments cast to the op's result dtype (in float32 for the
  16-bit floats) before the lowering runs: ``sum`` of int8 accumulates in int64.
- ``precision``: the lowering takes ``precision=`` (a ``jax.lax.Precision``).
- ``random``: the lowering takes ``key=`` (a JAX PRNG key, an input of the compiled
  function, never a constant).
- ``view``: the op returns a view; ``view_inverse(base, value, *args, index)`` puts a
  new view value back (index-like views need none, see storage.py).
- ``dynamic_shape``: the output shape depends on values (``nonzero``); the lowering
  runs op by op on concrete arrays instead of under ``jax.jit``.

Note [Type promotion policy]
    Every output of an op is cast to the dtype torch's meta kernel gives for it, and
    the inputs are cast as torch's CPU kernels would compute. So ``int_tensor / 2``
    is float32, ``sum`` of int32 is int64, ``x < y`` is bool and a Python float never
    widens a float32 tensor -- without any lowering knowing these rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND

aten = torch.ops.aten
prims = torch.ops.prims

PROMOTION_KINDS = {
    "default": ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT,
    "no_opmath": ELEMENTWISE_TYPE_PROMOTION_KIND.NO_OPMATH,
    "int_to_float": ELEMENTWISE_TYPE_PROMOTION_KIND.INT_TO_FLOAT,
    "always_bool": ELEMENTWISE_TYPE_PROMOTION_KIND.ALWAYS_BOOL,
    "complex_to_float": ELEMENTWISE_TYPE_PROMOTION_KIND.COMPLEX_TO_FLOAT,
    "bool_to_long": ELEMENTWISE_TYPE_PROMOTION_KIND.BOOL_TO_LONG,
}


@dataclasses.dataclass(frozen=True)
class Lowering:
    op: torch._ops.OpOverload
    fn: Callable
    promote: ELEMENTWISE_TYPE_PROMOTION_KIND | None = None
    promote_args: tuple[str, ...] | None = None
    compute_in_result: tuple[str, ...] = ()
    static: frozenset[str] = frozenset()
    precision: bool = False
    random: bool = False
    view: bool = False
    view_inverse: Callable | None = None
    dynamic_shape: bool = False
    # How the dispatcher treats this op, where it is not the usual. See `lowers`.
    meta: str = "run"
    cpu_statistics: bool = False
    writes_expanded: bool = False
    index_list: bool = False
    factors_as_laid_out: bool = False


_META_USES = ("run", "skip", "checks_only")

TABLE: dict[torch._ops.OpOverload, Lowering] = {}


def lowers(
    *ops: torch._ops.OpOverload,
    promote: str | None = None,
    promote_args: tuple[str, ...] | None = None,
    compute_in_result: tuple[str, ...] = (),
    static: tuple[str, ...] = (),
    precision: bool = False,
    random: bool = False,
    view: bool = False,
    view_inverse: Callable | None = None,
    dynamic_shape: bool = False,
    meta: str = "run",
    cpu_statistics: bool = False,
    writes_expanded: bool = False,
    index_list: bool = False,
    factors_as_laid_out: bool = False,
):
    """Register the decorated function as the lowering of each op in ``ops``.

    Registering an op twice raises: there is one table and one lowering per op.

    Where an op departs from what the dispatcher assumes, its registration says so:

    - ``meta``: how the meta oracle (dispatch/meta.py) is used: ``"run"`` for output
      sizes and argument checks; ``"checks_only"`` where the meta kernel checks the
      arguments but sizes outputs unlike the CPU (JAX sizes them); ``"skip"`` where it
      rejects what the CPU kernel takes.
    - ``cpu_statistics``: outputs 1 and 2 are a normalization's mean and inverse std,
      whose dtype for 16-bit inputs the CPU kernels choose unlike the meta kernels.
    - ``writes_expanded``: the in-place form may write into an expanded tensor (torch
      skips its internal-overlap check: ``fill_``, ``zero_``).
    - ``index_list``: takes a list of indices as advanced indexing does: a boolean
      mask stands for the integer indices of its True elements (made op by op, before
      the op runs), and index tensors on the CPU are taken as CUDA takes them.
    - ``factors_as_laid_out``: the result depends on the memory layout of a real input
      (LAPACK's column-major LU); the dispatcher passes it as laid out.
    """
    if meta not in _META_USES:
        raise ValueError(f"unknown meta use {meta!r}; expected one of {_META_USES}")
    if promote is not None and promote not in PROMOTION_KINDS:
        raise ValueError(f"unknown promotion kind {promote!r}")

    def register(fn: Callable) -> Callable:
        for op in ops:
            if op is None:  # an op this torch release lacks (_compat.aten)
                continue
            if not isinstance(op, torch._ops.OpOverload):
                raise TypeError(f"lowers() takes op overloads such as aten.add.Tensor, got {op!r}")
            if op in TABLE:
                raise RuntimeError(
                    f"{op} is lowered twice: by {TABLE[op].fn.__module__}.{TABLE[op].fn.__name__} "
                    f"and by {fn.__module__}.{fn.__name__}"
                )
            TABLE[op] = Lowering(
                op=op,
                fn=fn,
                promote=PROMOTION_KINDS[promote] if promote else None,
                promote_args=promote_args,
                compute_in_result=tuple(compute_in_result),
                static=frozenset(static),
                precision=precision,
                random=random,
                view=view,
                view_inverse=view_inverse,
                dynamic_shape=dynamic_shape,
                meta=meta,
                cpu_statistics=cpu_statistics,
                writes_expanded=writes_expanded,
                index_list=index_list,
                factors_as_laid_out=factors_as_laid_out,
            )
        return fn

    return register
