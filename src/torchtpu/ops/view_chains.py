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

from torchtpu.storage import DynamicStep, ViewChain, ViewStep

aten = torch.ops.aten


def _lowering(op):
    from torchtpu.ops.registry import TABLE

    return TABLE[op]


def apply_step(x, step: ViewStep):
    out = _lowering(step.op).fn(x, *step.args)
    return out if step.index is None else out[step.index]


# Note [Positions are inputs] (dispatch/signature.py): the steps whose position can be a
# program input, and where their arguments (canonical: dispatch/views.py) hold it.
_POSITIONED = {aten.select.int, aten.slice.Tensor, aten.narrow.default}


def positions_as_inputs(chain: ViewChain):
    """``chain`` with each select, and each slice or narrow of step 1 that does not
    start at 0, as a `DynamicStep`, and the positions taken out of it in chain order;
    None where no step has a position to take."""
    positions = []
    steps = []
    for step in chain:
        if step.op in _POSITIONED and step.index is None:
            if step.op is aten.select.int:
                dim, index = step.args
                steps.append(DynamicStep(step.op, dim, None))
                positions.append(index)
                continue
            if step.op is aten.slice.Tensor:
                dim, start, end, stride = step.args
                length = end - start
            else:
                (dim, start, length), stride = step.args, 1
            if stride == 1 and start > 0 and length > 0:
                steps.append(DynamicStep(step.op, dim, length))
                positions.append(start)
                continue
        steps.append(step)
    return (tuple(steps), positions) if positions else None


def meta_without_positions(meta: tuple):
    """A tensor's ``_meta`` (shape, strides, offset, dtype, chain) with its chain's
    positions taken out and the offset, which they decide, as 0, and the positions; None
    where there are none."""
    shape, strides, _, dtype, chain = meta
    taken = positions_as_inputs(chain)
    if taken is None:
        return None
    return (shape, strides, 0, dtype, taken[0]), taken[1]


def _next_position(positions):
    """A position as an int32 index: it arrives as an int64 (a Python int), which a TPU
    emulates in pairs of 32-bit values; an index of a dim fits in 32 bits."""
    import jax.numpy as jnp

    return jnp.asarray(next(positions)).astype(jnp.int32)


def _dynamic_read(x, step: DynamicStep, position):
    from jax import lax

    if step.length is None:
        return lax.dynamic_index_in_dim(x, position, step.dim, keepdims=False)
    return lax.dynamic_slice_in_dim(x, position, step.length, step.dim)


def _read_step(x, step, positions):
    if type(step) is not DynamicStep:
        return apply_step(x, step)
    return _dynamic_read(x, step, _next_position(positions))


def read(base, chain: ViewChain, positions=()):
    """The value of the tensor reached from ``base`` through ``chain``; ``positions``
    are the values of its `DynamicStep` s, in order."""
    positions = iter(positions)
    for step in chain:
        base = _read_step(base, step, positions)
    return base


def write(base, chain: ViewChain, value, check_overlap: bool = True, positions=()):
    """The new base after the tensor reached through ``chain`` takes ``value``.

    ``check_overlap=False`` for the ops torch lets write an expanded tensor (fill_,
    zero_: every copy of an element gets the same value anyway).
    """
    if check_overlap and _shares_locations(base, chain):
        raise RuntimeError(
            "unsupported operation: more than one element of the written-to tensor refers "
            "to a single memory location. Please clone() the tensor before performing the operation."
        )
    return _write(base, chain, value, iter(positions))


def _write(base, chain: ViewChain, value, positions):
    if not chain:
        return value
    step, rest = chain[0], chain[1:]
    if type(step) is DynamicStep:
        from jax import lax

        position = _next_position(positions)
        inner = _dynamic_read(base, step, position)
        new_inner = _write(inner, rest, value, positions) if rest else value
        new_inner = new_inner.astype(base.dtype)
        if step.length is None:
            return lax.dynamic_update_index_in_dim(base, new_inner, position, step.dim)
        return lax.dynamic_update_slice_in_dim(base, new_inner, position, step.dim)
    inner = apply_step(base, step)
    new_inner = _write(inner, rest, value, positions) if rest else value
    inverse = _lowering(step.op).view_inverse
    if inverse is not None:
        return inverse(base, new_inner, *step.args, index=step.index)
    return scatter_into(base, step, new_inner)


def _static(step):
    """A `DynamicStep` as a step at position 0: the same shape and strides."""
    if type(step) is not DynamicStep:
        return step
    if step.length is None:
        return ViewStep(step.op, (step.dim, 0))
    if step.op is aten.slice.Tensor:
        return ViewStep(step.op, (step.dim, 0, step.length, 1))
    return ViewStep(step.op, (step.dim, 0, step.length))


def _shares_locations(base, chain: ViewChain) -> bool:
    """Whether the tensor reached through ``chain`` has a zero stride over a dim of
    more than one element (``expand``): torch refuses to write into it, as here.

    The strides are torch's own, from running the chain on a meta tensor.
    """
    if not chain:
        return False
    from torchtpu import dtypes

    t = torch.empty(base.shape, dtype=dtypes.to_torch(base.dtype), device="meta")
    for step in map(_static, chain):
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
