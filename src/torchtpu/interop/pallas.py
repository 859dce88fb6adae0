"""A Pallas kernel used from torch: a fused softmax, forward and backward.

``torchtpu.interop.pallas.softmax(x, dim)`` is ``torch.softmax`` computed by two
Pallas kernels, each reading a block of rows once: the forward (max, exp, sum and
divide in one pass over the block) and the backward (``y * (g - sum(g * y))``). It is
a `jax_op` with a user-given ``backward``, so it runs in every eager mode, under
``torch.compile`` and ``torchtpu.jit``, and autograd calls the backward kernel.

Where the kernels run: compiled by Mosaic on a TPU backend; elsewhere in Pallas's
interpret mode (``interpret=True``: the kernel body runs as ordinary JAX ops, block by
block), which is how the tests check it on the CPU. The same code is the template for
any kernel: write it on ``jax.Array`` blocks, wrap the ``pallas_call`` in a function of
arrays, and decorate that with ``@torchtpu.jax_op``. Example::

    from torchtpu.interop.pallas import softmax

    x = torch.randn(64, 128, device="tpu", requires_grad=True)
    softmax(x, dim=-1).sum().backward()

Note [Pallas kernels trace in 32 bits]
    torchtpu runs JAX with 64-bit types on (int64 tensors keep their meaning), and
    then a Python int in a kernel -- the ``0`` of an index map ``lambda i: (i, 0)``, a
    ``fori_loop`` bound -- is an int64. Mosaic, Pallas's TPU compiler, has no 64-bit
    integers and fails ("failed to legalize operation 'func.return' ... (i32, i64)").
    So a ``pallas_call`` is made and called under ``jax.enable_x64(False)``: the
    kernel sees JAX's defaults, as it would in a plain JAX program. The arrays passed
    in keep their dtypes. A kernel of your own needs the same ``with``.
"""

from __future__ import annotations

import functools

from torchtpu.interop.functions import jax_op
from torchtpu.runtime import jax, platform

__all__ = ["softmax"]

# Rows per block: a multiple of 8, as TPU tiles are (8, 128); the block's last dim is
# the whole row, which Mosaic accepts whatever its length (as it accepts a block of all
# the rows when there are fewer than 8).
BLOCK_ROWS = 8


def _interpret() -> bool:
    return platform() != "tpu"


def _forward_kernel(x_ref, y_ref):
    jnp = jax().numpy
    x = x_ref[...].astype(jnp.float32)
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    y_ref[...] = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(y_ref.dtype)


def _backward_kernel(y_ref, g_ref, dx_ref):
    jnp = jax().numpy
    y = y_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    dx_ref[...] = (y * (g - jnp.sum(g * y, axis=-1, keepdims=True))).astype(dx_ref.dtype)


def _rowwise(kernel, *arrays):
    """``kernel`` over blocks of ``BLOCK_ROWS`` rows of 2-d arrays of one shape."""
    from jax.experimental import pallas as pl

    rows, cols = arrays[0].shape
    block_rows = min(BLOCK_ROWS, rows)  # fewer rows: one block of all of them
    block = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
    with jax().enable_x64(False):  # Note [Pallas kernels trace in 32 bits]
        return pl.pallas_call(
            kernel,
            out_shape=jax().ShapeDtypeStruct(arrays[0].shape, arrays[0].dtype),
            grid=(pl.cdiv(rows, block_rows),),
            in_specs=[block] * len(arrays),
            out_specs=block,
            interpret=_interpret(),
        )(*arrays)


def _as_rows(fn):
    """Apply a function of 2-d (rows, cols) arrays along axis ``dim`` of n-d arrays."""

    @functools.wraps(fn)
    def along(dim: int, *arrays):
        jnp = jax().numpy
        x = arrays[0]
        moved = [jnp.moveaxis(a, dim, -1) if x.ndim else a.reshape(1) for a in arrays]
        shape = moved[0].shape
        out = fn(*[m.reshape(-1, shape[-1]) for m in moved]).reshape(shape)
        return jnp.moveaxis(out, -1, dim) if x.ndim else out.reshape(())

    return along


_forward = _as_rows(functools.partial(_rowwise, _forward_kernel))
_backward = _as_rows(functools.partial(_rowwise, _backward_kernel))


def _softmax_backward(grad_out, x, dim=-1):
    y = _forward(dim, x)
    return (_backward(dim, y, grad_out), None)


@functools.partial(jax_op, name="pallas_softmax", backward=_softmax_backward)
def softmax(x, dim=-1):
    """``torch.softmax(x, dim)`` by a fused Pallas kernel (floating ``x``)."""
    return _forward(dim, x)
