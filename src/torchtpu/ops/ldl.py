"""LDL factorization of symmetric (or Hermitian) indefinite matrices, and its solve.

torch.linalg.ldl_factor returns LAPACK's compact form (?sytrf / ?hetrf, lower): L's
multipliers below the diagonal, D's 1x1 and 2x2 blocks on and next to it, and the
Bunch-Kaufman pivots (1-based; a 2x2 block's two rows both hold minus the row swapped
with its second). Its values depend on the pivot choices, so those are LAPACK's own
(?sytf2's rule, alpha = (1 + sqrt(17)) / 8, first index of a maximum), computed on the
full matrix: a symmetric swap of rows and columns then keeps it symmetric (or
Hermitian), where LAPACK juggles conjugates within one triangle. The matrices are
small and the pivots data-dependent, so each is a ``lax.while_loop`` over columns on
the whole matrix, with masks instead of dynamic slices.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from torchtpu.ops.linalg_solvers import check_info
from torchtpu.ops.registry import aten, lowers

_ALPHA = (1 + math.sqrt(17.0)) / 8


def _cabs1(x):
    """|re| + |im|: LAPACK's magnitude for choosing complex pivots."""
    return jnp.abs(jnp.real(x)) + jnp.abs(jnp.imag(x)) if jnp.iscomplexobj(x) else jnp.abs(x)


def _conjugate_if(hermitian, x):
    return jnp.conj(x) if hermitian and jnp.iscomplexobj(x) else x


def _swap(x, i, j):
    index = jnp.arange(x.shape[0])
    order = jnp.where(index == i, j, jnp.where(index == j, i, index))
    return x[order]


def _factor(a, hermitian):
    """(LD, pivots, info) of one (n, n) matrix, as ?sytf2 / ?hetf2 give them."""
    n = a.shape[-1]
    complex_hermitian = hermitian and jnp.iscomplexobj(a)
    real = jnp.finfo(a.dtype).dtype
    s = jnp.tril(a) + _conjugate_if(hermitian, jnp.tril(a, -1).T)
    if complex_hermitian:
        s = s.at[jnp.arange(n), jnp.arange(n)].set(jnp.real(jnp.diagonal(s)).astype(a.dtype))
    index = jnp.arange(n)
    alpha = jnp.asarray(_ALPHA, real)

    def diagonal_size(x):
        return jnp.abs(jnp.real(x)) if complex_hermitian else _cabs1(x)

    def step(state):
        s, pivots, info, k = state
        # Choose the pivot: column k's diagonal, or a 1x1 or 2x2 block with row imax.
        absakk = diagonal_size(s[k, k])
        below = jnp.where(index > k, _cabs1(s[:, k]), -1)
        imax = jnp.argmax(below)
        colmax = jnp.where(k < n - 1, below[imax], 0).astype(real)
        singular = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
        row = jnp.where((index >= k) & (index != imax), _cabs1(s[imax]), -1)
        rowmax = jnp.max(row).astype(real)
        keep_k = (absakk >= alpha * colmax) | (absakk >= alpha * colmax * (colmax / rowmax))
        one_by_one = singular | keep_k | (diagonal_size(s[imax, imax]) >= alpha * rowmax)
        kstep = jnp.where(one_by_one, 1, 2)
        kp = jnp.where(singular | keep_k, k, imax)
        # Swap rows and columns k + kstep - 1 and kp within the trailing block (the
        # columns of L already computed stay as they are, as in LAPACK).
        kk = k + kstep - 1
        order = jnp.where(index == kk, kp, jnp.where(index == kp, kk, index))
        order = jnp.where(index >= k, order, index)
        trailing = (index[:, None] >= k) & (index[None, :] >= k)
        s = jnp.where(trailing, s[order][:, order], s)
        # Eliminate: the trailing block -= L D L^T; L's multipliers replace the columns.
        k1 = jnp.minimum(k + 1, n - 1)
        rest = index > kk
        x1 = jnp.where(rest, s[:, k], 0)
        x2 = jnp.where(rest, s[:, k1], 0)
        r = 1 / s[k, k]  # ?syr's -1/d times x x^T
        update_1 = x1[:, None] * (r * _conjugate_if(hermitian, x1))[None, :]
        d11, d21, d22 = s[k, k], s[k1, k], s[k1, k1]
        det = d11 * d22 - d21 * _conjugate_if(hermitian, d21)
        l1 = (x1 * d22 - x2 * d21) / det  # [x1 x2] D^-1, D = [[d11, d21*], [d21, d22]]
        l2 = (x2 * d11 - x1 * _conjugate_if(hermitian, d21)) / det
        update_2 = l1[:, None] * _conjugate_if(hermitian, x1)[None, :]
        update_2 = update_2 + l2[:, None] * _conjugate_if(hermitian, x2)[None, :]
        update = jnp.where(kstep == 1, update_1, update_2)
        s = jnp.where(rest[:, None] & rest[None, :] & ~singular, s - update, s)
        s = s.at[:, k].set(jnp.where(rest & ~singular, jnp.where(kstep == 1, x1 * r, l1), s[:, k]))
        s = s.at[:, k1].set(jnp.where(rest & (kstep == 2), l2, s[:, k1]))
        if complex_hermitian:
            s = s.at[index, index].set(jnp.real(jnp.diagonal(s)).astype(s.dtype))
        pivot = (kp + 1).astype(jnp.int32)
        pivots = pivots.at[k].set(jnp.where(kstep == 1, pivot, -pivot))
        pivots = pivots.at[k1].set(jnp.where(kstep == 2, -pivot, pivots[k1]))
        info = jnp.where((info == 0) & singular, k + 1, info).astype(jnp.int32)
        return s, pivots, info, k + kstep

    start = (s, jnp.zeros(n, jnp.int32), jnp.asarray(0, jnp.int32), jnp.asarray(0))
    s, pivots, info, _ = lax.while_loop(lambda state: state[3] < n, step, start)
    return jnp.tril(s), pivots, info


def _solve(ld, pivots, b, hermitian):
    """X with A X = B from one matrix's LD and pivots, as ?sytrs / ?hetrs compute it."""
    n = ld.shape[-1]
    index = jnp.arange(n)

    def conj(x):
        return _conjugate_if(hermitian, x)

    def forward(state):  # L D Y = P B
        x, k = state
        one = pivots[k] > 0
        kp = jnp.abs(pivots[k]) - 1
        k1 = jnp.minimum(k + 1, n - 1)
        x = _swap(x, jnp.where(one, k, k1), kp)
        l_k = jnp.where(index > jnp.where(one, k, k1), ld[:, k], 0)
        l_k1 = jnp.where(index > k1, ld[:, k1], 0)
        y1 = x - l_k[:, None] * x[k][None, :]
        y1 = y1.at[k].set(y1[k] / ld[k, k])
        y2 = x - l_k[:, None] * x[k][None, :] - l_k1[:, None] * x[k1][None, :]
        akm1k = ld[k1, k]
        akm1, ak = ld[k, k] / conj(akm1k), ld[k1, k1] / akm1k
        denom = akm1 * ak - 1
        bkm1, bk = y2[k] / conj(akm1k), y2[k1] / akm1k
        y2 = y2.at[k].set((ak * bkm1 - bk) / denom).at[k1].set((akm1 * bk - bkm1) / denom)
        return jnp.where(one, y1, y2), k + jnp.where(one, 1, 2)

    def backward(state):  # L^T X = Y (L^H if Hermitian)
        x, k = state
        one = pivots[k] > 0
        kp = jnp.abs(pivots[k]) - 1
        km1 = jnp.maximum(k - 1, 0)

        def dot_below(column):
            return jnp.sum(conj(jnp.where(index > k, ld[:, column], 0))[:, None] * x, axis=0)

        y = x.at[k].add(-dot_below(k))
        y = jnp.where(one, y, y.at[km1].add(-dot_below(km1)))
        return _swap(y, k, kp), k - jnp.where(one, 1, 2)

    x, _ = lax.while_loop(lambda state: state[1] < n, forward, (b, jnp.asarray(0)))
    x, _ = lax.while_loop(lambda state: state[1] >= 0, backward, (x, jnp.asarray(n - 1)))
    return x


def _batched(fn, ndim):
    for _ in range(ndim):
        fn = jax.vmap(fn)
    return fn


@lowers(aten.linalg_ldl_factor_ex.default)
def linalg_ldl_factor_ex(self, hermitian=False, check_errors=False):
    n = self.shape[-1]
    if n == 0:
        batch = self.shape[:-2]
        return self, jnp.zeros(batch + (0,), jnp.int32), jnp.zeros(batch, jnp.int32)
    ld, pivots, info = _batched(lambda a: _factor(a, hermitian), self.ndim - 2)(self)
    if check_errors:
        check_info(info, "torch.linalg.ldl_factor_ex")
    return ld, pivots, info


@lowers(aten.linalg_ldl_solve.default)
def linalg_ldl_solve(LD, pivots, B, hermitian=False):
    batch = jnp.broadcast_shapes(LD.shape[:-2], pivots.shape[:-1], B.shape[:-2])
    LD = jnp.broadcast_to(LD, batch + LD.shape[-2:])
    pivots = jnp.broadcast_to(pivots, batch + pivots.shape[-1:])
    B = jnp.broadcast_to(B, batch + B.shape[-2:]).astype(jnp.result_type(LD, B))
    if LD.shape[-1] == 0:
        return B
    return _batched(lambda ld, p, b: _solve(ld, p, b, hermitian), len(batch))(LD, pivots, B)
