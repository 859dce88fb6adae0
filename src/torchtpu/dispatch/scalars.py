"""Python numbers passed to compiled functions, as 0-d JAX arrays made once per value.

Note [Numbers as arrays]
    A traced Python number (``x * 0.5``'s 0.5, an optimizer's learning rate) is an
    input of the op's or chunk's compiled function, so a new value never recompiles.
    Handed to ``jax.jit`` as a Python number, JAX turns it into a device buffer on
    every call (about 3 us each, a fifth of a small op); handed as a 0-d array it is
    just passed (under 1 us). So each value's array is made once and kept. The array
    is what JAX would make of the number itself -- ``device_put`` of it: weakly typed
    (a float32 tensor times it stays float32), uncommitted (it joins the device of
    the op's other inputs) -- so a function traces the same as with the number.
    Floats are keyed by their bits (``-0.0`` is not ``0.0``; every NaN its own), and
    the table is emptied when it grows past ``_LIMIT`` values (a loop over many
    distinct numbers). Where the platform policy keeps complex128 off the device (a TPU:
    runtime/policy.py), a complex number is made complex64, the widest complex dtype an
    op computes in there; ops on complex128 run on the host, from the numbers themselves.
"""

from __future__ import annotations

import numpy as np
import torch

from torchtpu.runtime import jax, policy

_ARRAYS: dict = {}
_LIMIT = 4096


def as_arrays(numbers) -> list:
    """``numbers`` (Python numbers) as the 0-d arrays of Note [Numbers as arrays]."""
    return [as_array(n) for n in numbers]


def as_array(number):
    """One Python number as its 0-d array; anything else as it is."""
    kind = type(number)
    if kind is float:
        key = number.hex()
    elif kind is int or kind is bool:
        key = (kind, number)
    elif kind is complex:
        key = (number.real.hex(), number.imag.hex())
    else:
        return number
    array = _ARRAYS.get(key)
    if array is None:
        if kind is complex and torch.complex128 in policy.host_dtypes():
            number = np.complex64(number)
        try:
            array = jax().device_put(number)
        except OverflowError:  # an int beyond int64: JAX's own call raises its error
            return number
        if isinstance(array, jax().core.Tracer):  # inside a JAX trace: nothing to keep
            return number
        if len(_ARRAYS) >= _LIMIT:
            _ARRAYS.clear()
        _ARRAYS[key] = array
    return array
