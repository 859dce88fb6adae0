"""Matrix products and linear algebra. Products take ``precision=`` (precision.py)."""

from __future__ import annotations

import jax.numpy as jnp

from torchtpu.ops.registry import aten, lowers

_LOW_FLOATS = (jnp.float16, jnp.bfloat16)


def _matmul(a, b, precision):
    # 16-bit floats accumulate in float32, as torch's CPU kernels do.
    if a.dtype in _LOW_FLOATS:
        return jnp.matmul(a, b, precision=precision, preferred_element_type=jnp.float32).astype(
            a.dtype
        )
    return jnp.matmul(a, b, precision=precision)


def _scale(x, factor):
    return (
        x if isinstance(factor, (int, float)) and factor == 1 else x * jnp.asarray(factor, x.dtype)
    )


def _plus_scaled(product, self, beta, alpha):
    out = _scale(product, alpha)
    if isinstance(beta, (int, float)) and beta == 0:
        return jnp.broadcast_to(out, jnp.broadcast_shapes(out.shape, self.shape))
    return out + _scale(self, beta)


@lowers(aten.mm.default, aten.bmm.default, aten.mv.default, precision=True)
def mm(self, mat2, *, precision):
    return _matmul(self, mat2, precision)


@lowers(aten.dot.default, precision=True)
def dot(self, tensor, *, precision):
    return _matmul(self, tensor, precision)


@lowers(aten.vdot.default, precision=True)
def vdot(self, other, *, precision):
    return _matmul(jnp.conj(self), other, precision)


@lowers(aten.addmm.default, aten.baddbmm.default, aten.addmv.default, precision=True)
def addmm(self, mat1, mat2, beta=1, alpha=1, *, precision):
    return _plus_scaled(_matmul(mat1, mat2, precision), self, beta, alpha)


@lowers(aten.addbmm.default, precision=True)
def addbmm(self, batch1, batch2, beta=1, alpha=1, *, precision):
    return _plus_scaled(jnp.sum(_matmul(batch1, batch2, precision), axis=0), self, beta, alpha)


@lowers(aten.addr.default, promote="default", promote_args=("self", "vec1", "vec2"))
def addr(self, vec1, vec2, beta=1, alpha=1):
    return _plus_scaled(jnp.outer(vec1, vec2), self, beta, alpha)


@lowers(aten.tril.default)
def tril(self, diagonal=0):
    return jnp.tril(self, diagonal)


@lowers(aten.triu.default)
def triu(self, diagonal=0):
    return jnp.triu(self, diagonal)
