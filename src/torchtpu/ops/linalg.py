"""Matrix products and linear algebra. Products take ``precision=`` (precision.py)."""

from __future__ import annotations

import jax.numpy as jnp

from torchtpu import dtypes
from torchtpu.ops import unsupported
from torchtpu.ops.registry import aten, lowers

_LOW_FLOATS = (jnp.float16, jnp.bfloat16)


def _matmul(a, b, precision):
    # 16-bit floats accumulate in float32, as torch's CPU kernels do.
    return _accumulated(a, b, precision).astype(a.dtype)


def _accumulated(a, b, precision):
    """``a @ b`` as accumulated: float32 for 16-bit floats, before their one rounding."""
    if a.dtype in _LOW_FLOATS:
        return jnp.matmul(a, b, precision=precision, preferred_element_type=jnp.float32)
    return jnp.matmul(a, b, precision=precision)


def _scale(x, factor):
    return (
        x if isinstance(factor, (int, float)) and factor == 1 else x * jnp.asarray(factor, x.dtype)
    )


def _plus_scaled(product, self, beta, alpha, blas_alpha=False):
    """beta * self + alpha * product, where beta = 0 ignores self (NaN and inf included)
    as torch documents. ``blas_alpha``: alpha = 0 ignores the product too, as the BLAS
    kernels behind the CPU's addmm, addmv and addbmm do (baddbmm and addr do not)."""
    out = _scale(product, alpha)
    if blas_alpha and not (isinstance(alpha, (int, float)) and alpha != 0):
        out = jnp.where(jnp.asarray(alpha) == 0, jnp.zeros((), out.dtype), out)
    if isinstance(beta, (int, float)) and beta == 0:
        return jnp.broadcast_to(out, jnp.broadcast_shapes(out.shape, self.shape))
    # A traced beta may be 0 too: then self is ignored, its NaN and inf included, as
    # torch documents for addmm and friends.
    ignored = jnp.asarray(beta) == 0
    return out + jnp.where(ignored, jnp.zeros((), out.dtype), _scale(self, beta))


@lowers(aten.mm.default, aten.bmm.default, aten.mv.default, precision=True)
def mm(self, mat2, *, precision):
    return _matmul(self, mat2, precision)


@lowers(aten.dot.default, precision=True)
def dot(self, tensor, *, precision):
    return _matmul(self, tensor, precision)


@lowers(aten.vdot.default, precision=True)
def vdot(self, other, *, precision):
    return _matmul(jnp.conj(self), other, precision)


def _plus_scaled_rounded_once(product, self, beta, alpha, dtype, blas_alpha=False):
    """`_plus_scaled` of an `_accumulated` product, rounded to ``dtype`` once: for
    16-bit floats the sum is made before the one rounding, as the CPU's and cuBLAS's
    kernels do (rounding the product first loses the bias's digits where the two
    nearly cancel)."""
    out = _plus_scaled(product, self.astype(product.dtype), beta, alpha, blas_alpha)
    return out.astype(dtype)


@lowers(aten.addmm.default, aten.addmv.default, precision=True)
def addmm(self, mat1, mat2, beta=1, alpha=1, *, precision):
    product = _accumulated(mat1, mat2, precision)
    return _plus_scaled_rounded_once(product, self, beta, alpha, mat1.dtype, blas_alpha=True)


@lowers(aten.baddbmm.default, precision=True)
def baddbmm(self, batch1, batch2, beta=1, alpha=1, *, precision):
    product = _accumulated(batch1, batch2, precision)
    return _plus_scaled_rounded_once(product, self, beta, alpha, batch1.dtype)


@lowers(aten.addbmm.default, precision=True)
def addbmm(self, batch1, batch2, beta=1, alpha=1, *, precision):
    # (The CPU's kernel is a loop of addmm over the batch, rounding after each: within
    # a rounding step per batch of this.)
    product = jnp.sum(_accumulated(batch1, batch2, precision), axis=0)
    return _plus_scaled_rounded_once(product, self, beta, alpha, batch1.dtype, blas_alpha=True)


@lowers(aten.addr.default, promote="default", promote_args=("self", "vec1", "vec2"))
def addr(self, vec1, vec2, beta=1, alpha=1):
    return _plus_scaled(jnp.outer(vec1, vec2), self, beta, alpha)


@lowers(aten.tril.default)
def tril(self, diagonal=0):
    return jnp.tril(self, diagonal)


@lowers(aten.triu.default)
def triu(self, diagonal=0):
    return jnp.triu(self, diagonal)


# meta="skip": its meta kernel has a CUDA-only check (bfloat16 inputs only).
@lowers(aten._grouped_mm.default, precision=True, meta="skip")
def _grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None, *, precision):
    """Matrix products of groups of rows/columns (mixture-of-experts layers).

    ``offs`` holds the end offset of each group along the ragged dimension: the rows
    of a 2-d ``self`` against a 3-d ``mat2`` (one matrix per group), the shared
    dimension of two 2-d operands (one product per group), or the columns of a 2-d
    ``mat2`` against a 3-d ``self``. Two 3-d operands are a plain batched product.
    Each case is a product of every group masked to its own rows/columns, so shapes
    stay static; positions past the last offset are 0 (torch leaves them unset).
    """
    if bias is not None:
        unsupported.refuse("_grouped_mm: bias")
    # No meta kernel sizes this op for float32 (registered meta="skip"): the
    # lowering gives the result dtype itself.
    result_dtype = dtypes.to_jax(out_dtype) if out_dtype is not None else self.dtype
    if self.dtype in _LOW_FLOATS:  # accumulate in float32, as _matmul does
        self, mat2 = self.astype(jnp.float32), mat2.astype(jnp.float32)
    return _grouped_product(self, mat2, offs, precision).astype(result_dtype)


def _grouped_product(self, mat2, offs, precision):
    if self.ndim == 3 and mat2.ndim == 3:
        return jnp.matmul(self, mat2, precision=precision)
    ragged = (
        self.shape[0] if mat2.ndim == 3 else self.shape[-1] if self.ndim == 2 else mat2.shape[1]
    )
    position = jnp.arange(ragged)
    starts = jnp.concatenate([jnp.zeros((1,), offs.dtype), offs[:-1]])
    member = ((position >= starts[:, None]) & (position < offs[:, None])).astype(self.dtype)
    if mat2.ndim == 3:  # (M, K) x (G, K, N) -> (M, N), rows grouped
        return jnp.einsum("mk,gkn,gm->mn", self, mat2, member, precision=precision)
    if self.ndim == 2:  # (M, K) x (K, N) -> (G, M, N), the shared dimension grouped
        return jnp.einsum("mk,gk,kn->gmn", self, member, mat2, precision=precision)
    # (G, M, K) x (K, N) -> (M, N), columns grouped
    return jnp.einsum("gmk,kn,gn->mn", self, mat2, member, precision=precision)
