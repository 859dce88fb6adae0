"""Reading and writing a tensor through its view chain (storage.py), inside jitted code.

- `read`: the tensor's value, its chain of view lowerings applied to the base array.
- `write`: the new base array after the tensor takes a new value: each view op has an
  inverse that puts a new view value back into the array it was taken from.
  Index-like views (slices, select, diagonal, unfold, as_strided, ...) share one generic
  inverse, `scatter_into`; reshape-, permute- and dtype-like views register exact
  inverses with their lowering (``@lowers(..., view_inverse=...)``).
"""

from __future__ import annotations

import torch

from torchtpu.storage import ViewChain, ViewStep


def _lowering(op):
    from torchtpu.ops.registry import TABLE

    return TABLE[op]


def apply_step(x, step: ViewStep):
    out = _lowering(step.op).fn(x, *step.args)
    return out if step.index is None else out[step.index]


def read(base, chain: ViewChain):
    """The value of the tensor reached from ``base`` through ``chain``."""
    for step in chain:
        base = apply_step(base, step)
    return base


def write(base, chain: ViewChain, value, check_overlap: bool = True):
    """The new base after the tensor reached through ``chain`` takes ``value``.

    ``check_overlap=False`` for the ops torch lets write an expanded tensor (fill_,
    zero_: every copy of an element gets the same value anyway).
    """
    if check_overlap and _shares_locations(base, chain):
        raise RuntimeError(
            "unsupported operation: more than one element of the written-to tensor refers "
            "to a single memory location. Please clone() the tensor before performing the operation."
        )
    return _write(base, chain, value)


def _write(base, chain: ViewChain, value):
    if not chain:
        return value
    step, rest = chain[0], chain[1:]
    inner = apply_step(base, step)
    new_inner = _write(inner, rest, value) if rest else value
    inverse = _lowering(step.op).view_inverse
    if inverse is not None:
        return inverse(base, new_inner, *step.args, index=step.index)
    return scatter_into(base, step, new_inner)


def _shares_locations(base, chain: ViewChain) -> bool:
    """Whether the tensor reached through ``chain`` has a zero stride over a dim of
    more than one element (``expand``): torch refuses to write into it, as here.

    The strides are torch's own, from running the chain on a meta tensor.
    """
    if not chain:
        return False
    from torchtpu import dtypes

    t = torch.empty(base.shape, dtype=dtypes.to_torch(base.dtype), device="meta")
    for step in chain:
        # zip drops arguments torch's schema lacks (as_strided's storage strides)
        schema = zip(step.op._schema.arguments[1:], step.args)
        args, kwargs = [], {}
        for arg, value in schema:
            if arg.kwarg_only:
                kwargs[arg.name] = value
            else:
                args.append(value)
        out = step.op(t, *args, **kwargs)
        t = out if step.index is None else out[step.index]
        # The conj and neg bits change what later views mean to torch (view_as_real
        # refuses a conj tensor), not strides; the chain already applies them.
        torch._C._set_conj(t, False)
        torch._C._set_neg(t, False)
    return any(n > 1 and s == 0 for n, s in zip(t.shape, t.stride()))


def scatter_into(base, step: ViewStep, value):
    """Generic inverse of an index-like view: write ``value`` where the view reads."""
    from torchtpu.runtime import jax

    jnp = jax().numpy
    positions = jnp.arange(base.size, dtype=jnp.int64).reshape(base.shape)
    index = apply_step(positions, step).reshape(-1)
    flat = base.reshape(-1).at[index].set(value.reshape(-1).astype(base.dtype))
    return flat.reshape(base.shape)
