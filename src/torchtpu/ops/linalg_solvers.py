"""Matrix decompositions and solvers (cholesky, lu, qr, svd, eigh, inverse, det, ...).

Conventions shared with torch's CPU kernels (LAPACK):

- LU pivots are int32 and 1-based, in LAPACK's ``getrf`` form (row ``i`` was swapped
  with row ``pivots[i] - 1``); ``info`` is int32, 0 where the matrix factored, else the
  1-based index of the first zero pivot (LU) or failing leading minor (Cholesky).
- ``_linalg_det`` and ``_linalg_slogdet`` of a real matrix factor ``A^T``, as torch
  does for a contiguous ``A``: their backward formulas solve with that LU
  (``adjoint=not (A.is_contiguous() and not A.is_complex())``). A lowering does not
  see strides; for a non-contiguous real ``A`` the dispatcher passes a copy laid out
  so that factoring its transpose factors ``A`` (dispatch._FACTORS_BY_LAYOUT).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsp_linalg
from jax import lax
from torch.linalg import LinAlgError

from torchtpu import _compat
from torchtpu.ops.registry import aten, lowers
from torchtpu.ops.value_checks import error_if


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x))


def _eye_like(a, n=None):
    n = a.shape[-1] if n is None else n
    return jnp.broadcast_to(jnp.eye(n, dtype=a.dtype), (*a.shape[:-2], n, n))


def _broadcast_batch(a, b):
    """Broadcast the batch dimensions (all but the last two) of two matrices."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return (
        jnp.broadcast_to(a, (*batch, *a.shape[-2:])),
        jnp.broadcast_to(b, (*batch, *b.shape[-2:])),
    )


def _is_vector_rhs(a, b):
    # torch's linalg_solve_is_vector_rhs: B is a (batch of) vector(s) of A's rows.
    return b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])


# -- checks -------------------------------------------------------------------------------------


# torch's _linalg_check_errors picks its message by a word in the API's name, in this
# order. lu_factor raises a plain RuntimeError (TORCH_CHECK, not TORCH_CHECK_LINALG).
_INFO_ERRORS = (
    ("inv", LinAlgError, "a diagonal element is zero, the inversion could not be completed "
     "because the input matrix is singular."),
    ("solve", LinAlgError, "The solver failed because the input matrix is singular."),
    ("cholesky", LinAlgError, "The factorization could not be completed because the input is "
     "not positive-definite (a leading minor is not positive-definite)."),
    ("svd", LinAlgError, "The algorithm failed to converge because the input matrix is "
     "ill-conditioned or has too many repeated singular values."),
    ("eig", LinAlgError, "The algorithm failed to converge because the input matrix is "
     "ill-conditioned or has too many repeated eigenvalues."),
    ("syevd", LinAlgError, "The algorithm failed to converge because the input matrix is "
     "ill-conditioned or has too many repeated eigenvalues."),
    ("lstsq", LinAlgError, "The least squares solution could not be computed because the "
     "input matrix does not have full rank."),
    ("lu_factor", RuntimeError, "a diagonal element of U is zero and using it on lu_solve "
     "would result in a division by zero. If you still want to perform the factorization, "
     "consider calling linalg.lu(A, pivot) or linalg.lu_factor_ex(A, pivot)"),
)  # fmt: skip


def check_info(info, api_name: str) -> None:
    """Raise as torch's ``_linalg_check_errors`` does where ``info`` is nonzero.

    The message cannot name the failing index or batch element: checks carry static
    messages (checks.py)."""
    exc, what = next(
        ((exc, what) for word, exc, what in _INFO_ERRORS if word in api_name),
        (RuntimeError, "Unknown error code."),
    )
    error_if(jnp.any(info > 0), exc, f"{api_name}: {what}")
    error_if(
        jnp.any(info < 0),
        RuntimeError,
        f"{api_name}: an argument has an illegal value. Most certainly there is a bug in the "
        "implementation calling the backend library.",
    )


@lowers(aten._linalg_check_errors.default)
def _linalg_check_errors(info, api_name, is_matrix):
    check_info(info, api_name)
    return ()


# -- LU -----------------------------------------------------------------------------------------


def _lu_factor(a):
    """LU with partial pivoting: (LU, 1-based int32 pivots, info)."""
    lu, pivots, _ = lax.linalg.lu(a)
    return lu, pivots + 1, _zero_pivot_info(lu)


def _zero_pivot_info(lu):
    # getrf's info: the 1-based index of the first exactly-zero diagonal element of U.
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    if diagonal.shape[-1] == 0:
        return jnp.zeros(lu.shape[:-2], jnp.int32)
    zero = diagonal == 0
    return jnp.where(jnp.any(zero, -1), jnp.argmax(zero, -1) + 1, 0).astype(jnp.int32)


def _permutation(pivots, m):
    """The row permutation ``perm`` of 1-based getrf pivots: ``A[perm] = L @ U``."""
    return lax.linalg.lu_pivots_to_permutation(pivots - 1, m)


def _pivots_sign(pivots, dtype):
    # det(P) = (-1)^(number of actual row swaps).
    swaps = jnp.sum(pivots != jnp.arange(1, pivots.shape[-1] + 1, dtype=pivots.dtype), -1)
    return jnp.where(swaps % 2 == 0, 1, -1).astype(dtype)


def _lu_solve(lu, pivots, b, left=True, adjoint=False):
    """Solve A X = B (or X A = B; A^H in place of A if ``adjoint``) given A's LU."""
    if not left:
        # X A = B  <=>  A^H X^H = B^H.
        return _mH(_lu_solve(lu, pivots, _mH(b), True, not adjoint))
    lu, b = _broadcast_batch(lu, b)
    n = lu.shape[-1]
    perm = jnp.broadcast_to(_permutation(pivots, n), lu.shape[:-1])
    solve = lax.linalg.triangular_solve
    if not adjoint:
        # A = P L U: L U X = B[perm].
        y = jnp.take_along_axis(b, perm[..., None], axis=-2)
        y = solve(lu, y, left_side=True, lower=True, unit_diagonal=True)
        return solve(lu, y, left_side=True, lower=False)
    # A^H = U^H L^H P^T: X[perm] = L^-H U^-H B.
    y = solve(lu, b, left_side=True, lower=False, transpose_a=True, conjugate_a=True)
    y = solve(
        lu, y, left_side=True, lower=True, transpose_a=True, conjugate_a=True, unit_diagonal=True
    )
    return jnp.take_along_axis(y, jnp.argsort(perm, axis=-1)[..., None], axis=-2)


def _factor_for_backward(a):
    """LU of ``A^T`` for real ``A``, of ``A`` for complex, as torch's det kernels."""
    return _lu_factor(a if jnp.iscomplexobj(a) else _mT(a))


def _no_unpivoted_lu(pivot):
    if not pivot:
        raise RuntimeError("linalg.lu_factor: LU without pivoting is not implemented on the CPU")


@lowers(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(A, pivot, check_errors):
    _no_unpivoted_lu(pivot)
    lu, pivots, info = _lu_factor(A)
    if check_errors:
        check_info(info, "torch.linalg.lu_factor_ex")
    return lu, pivots, info


def _unpack_lu(lu):
    m, n = lu.shape[-2:]
    k = min(m, n)
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    return lower, jnp.triu(lu[..., :k, :])


def _permutation_matrix(pivots, m, dtype):
    # A = P L U with A[perm] = L U, so P[perm[i], i] = 1.
    return _mT(jax.nn.one_hot(_permutation(pivots, m), m, dtype=dtype))


@lowers(aten.linalg_lu.default)
def linalg_lu(A, pivot):
    _no_unpivoted_lu(pivot)
    lu, pivots, _ = _lu_factor(A)
    lower, upper = _unpack_lu(lu)
    return _permutation_matrix(pivots, A.shape[-2], A.dtype), lower, upper


@lowers(aten.lu_unpack.default)
def lu_unpack(LU_data, LU_pivots, unpack_data, unpack_pivots):
    m = LU_data.shape[-2]
    empty = jnp.zeros((0,), LU_data.dtype)
    lower, upper = _unpack_lu(LU_data) if unpack_data else (empty, empty)
    if unpack_pivots:
        error_if(
            jnp.any((LU_pivots < 1) | (LU_pivots > m)),
            RuntimeError,
            "pivots passed to lu_unpack must be between 1 and LU.size(-2) inclusive."
            "Did you properly pass the result of lu_factor?",
        )
        permutation = _permutation_matrix(jnp.clip(LU_pivots, 1, m), m, LU_data.dtype)
    else:
        permutation = empty
    return permutation, lower, upper


@lowers(aten.linalg_lu_solve.default)
def linalg_lu_solve(LU, pivots, B, left, adjoint):
    return _lu_solve(LU, pivots, B, left, adjoint)


@lowers(aten._linalg_solve_ex.default)
def _linalg_solve_ex(A, B, left, check_errors):
    lu, pivots, info = _lu_factor(A)
    if check_errors:
        check_info(info, "torch.linalg.solve_ex")
    vector_case = _is_vector_rhs(A, B)
    x = _lu_solve(lu, pivots, B[..., None] if vector_case else B, left)
    return (x[..., 0] if vector_case else x), lu, pivots, info


@lowers(aten.linalg_inv_ex.default)
def linalg_inv_ex(A, check_errors):
    lu, pivots, info = _lu_factor(A)
    if check_errors:
        check_info(info, "linalg.inv_ex")
    return _lu_solve(lu, pivots, _eye_like(A)), info


@lowers(aten._linalg_det.default, factors_as_laid_out=True)
def _linalg_det(A):
    lu, pivots, _ = _factor_for_backward(A)
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    return _pivots_sign(pivots, A.dtype) * jnp.prod(diagonal, -1), lu, pivots


@lowers(aten._linalg_slogdet.default, factors_as_laid_out=True)
def _linalg_slogdet(A):
    lu, pivots, _ = _factor_for_backward(A)
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    sign = _pivots_sign(pivots, A.dtype) * jnp.prod(jnp.sign(diagonal), -1)
    return sign, jnp.sum(jnp.log(jnp.abs(diagonal)), -1), lu, pivots


# -- Cholesky -----------------------------------------------------------------------------------


def _failing_minor(a):
    """potrf's info: the order of the first leading minor of Hermitian ``a`` (lower
    triangle) that is not positive-definite, else 0. Unpivoted elimination: the k-th
    pivot is the ratio of the k-th and (k-1)-th leading minors."""
    n = a.shape[-1]
    a = jnp.tril(a) + _mH(jnp.tril(a, -1))

    def eliminate(k, carry):
        a, info = carry
        column = lax.dynamic_index_in_dim(a, k, axis=-1, keepdims=False)
        pivot = jnp.real(lax.dynamic_index_in_dim(column, k, axis=-1, keepdims=False))
        failed = ~(pivot > 0)  # NaN fails too, as in LAPACK
        info = jnp.where((info == 0) & failed, k + 1, info)
        pivot = jnp.where(failed, 1, pivot)[..., None, None]
        return a - column[..., :, None] * jnp.conj(column)[..., None, :] / pivot, info

    info = jnp.zeros(a.shape[:-2], jnp.int32)
    return lax.fori_loop(0, n, eliminate, (a, info))[1]


def _cholesky(a, upper):
    """(factor, info): L with A = L L^H from A's lower triangle, or U with A = U^H U
    from its upper triangle."""
    if upper:
        factor, info = _cholesky(_mH(a), False)
        return _mH(factor), info
    if a.shape[-1] == 0:
        return a, jnp.zeros(a.shape[:-2], jnp.int32)
    factor = jnp.tril(lax.linalg.cholesky(a, symmetrize_input=False))
    # JAX marks a failed factorization with NaN; only then is the failing minor sought.
    failed = ~jnp.all(jnp.isfinite(factor), axis=(-2, -1))
    info = lax.cond(
        jnp.any(failed),
        lambda: jnp.where(failed, _failing_minor(a), 0),
        lambda: jnp.zeros(a.shape[:-2], jnp.int32),
    )
    return factor, info


@lowers(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(self, upper, check_errors):
    factor, info = _cholesky(self, upper)
    if check_errors:
        check_info(info, "linalg.cholesky_ex")
    return factor, info


@lowers(_compat.op("aten.cholesky.default"))
def cholesky(self, upper):
    factor, info = _cholesky(self, upper)
    check_info(info, "cholesky")
    return factor


def _cholesky_solve(factor, b, upper):
    """Solve (L L^H) X = B, or (U^H U) X = B."""
    factor, b = _broadcast_batch(factor, b)
    solve = lax.linalg.triangular_solve
    lower = not upper
    # First the factor on the left of the product, then the other one.
    y = solve(factor, b, left_side=True, lower=lower, transpose_a=upper, conjugate_a=upper)
    return solve(factor, y, left_side=True, lower=lower, transpose_a=lower, conjugate_a=lower)


def _triangle(x, upper):
    return jnp.triu(x) if upper else jnp.tril(x)


@lowers(aten.cholesky_solve.default)
def cholesky_solve(self, input2, upper):
    return _cholesky_solve(_triangle(input2, upper), self, upper)


@lowers(aten.cholesky_inverse.default)
def cholesky_inverse(self, upper):
    factor = _triangle(self, upper)
    error_if(
        jnp.any(jnp.diagonal(factor, axis1=-2, axis2=-1) == 0),
        LinAlgError,
        "cholesky_inverse: a diagonal element is zero, the inversion could not be completed "
        "because the input matrix is singular.",
    )
    return _cholesky_solve(factor, _eye_like(self), upper)


# -- triangular solves --------------------------------------------------------------------------


@lowers(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(self, B, upper, left, unitriangular):
    a, b = _broadcast_batch(self, B)
    return lax.linalg.triangular_solve(
        a, b, left_side=left, lower=not upper, unit_diagonal=unitriangular
    )


@lowers(aten.triangular_solve.default)
def triangular_solve(self, A, upper, transpose, unitriangular):
    a, b = _broadcast_batch(A, self)
    solution = lax.linalg.triangular_solve(
        a, b, left_side=True, lower=not upper, transpose_a=transpose, unit_diagonal=unitriangular
    )
    return solution, a


# -- QR and Householder products ----------------------------------------------------------------


@lowers(aten.linalg_qr.default)
def linalg_qr(A, mode):
    if mode == "r":
        return jnp.zeros((0,), A.dtype), jnp.linalg.qr(A, mode="r")
    return tuple(jnp.linalg.qr(A, mode=mode))


@lowers(aten.geqrf.default)
def geqrf(self):
    # The "raw" QR is LAPACK's geqrf in column-major order: its reflectors come transposed.
    reflectors, tau = jnp.linalg.qr(self, mode="raw")
    return _mT(reflectors), tau


@lowers(aten.linalg_householder_product.default)
def linalg_householder_product(input, tau):
    return lax.linalg.householder_product(input, tau)


@lowers(aten.ormqr.default)
def ormqr(self, input2, input3, left, transpose):
    return lax.linalg.ormqr(self, input2, input3, left=left, transpose=transpose)


# -- spectral decompositions --------------------------------------------------------------------


@lowers(aten._linalg_svd.default)
def _linalg_svd(A, full_matrices, compute_uv, driver):
    if not compute_uv:
        empty = jnp.zeros((0,), A.dtype)
        return empty, jnp.linalg.svd(A, compute_uv=False), empty
    return tuple(jnp.linalg.svd(A, full_matrices=full_matrices))


@lowers(aten._linalg_eigh.default)
def _linalg_eigh(A, UPLO, compute_v):
    values, vectors = jnp.linalg.eigh(A, UPLO=UPLO, symmetrize_input=False)
    return values, (vectors if compute_v else jnp.zeros((0,), A.dtype))


# JAX has a general (non-Hermitian) eigendecomposition only on the CPU: elsewhere the
# platform policy runs it on the host (runtime/policy.py, rule "eig").
@lowers(aten.linalg_eig.default)
def linalg_eig(self):
    return tuple(jnp.linalg.eig(self))


@lowers(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(self):
    if self.dtype in (jnp.float16, jnp.bfloat16):  # JAX's expm takes neither
        return jsp_linalg.expm(self.astype(jnp.float32)).astype(self.dtype)
    return jsp_linalg.expm(self)


@lowers(aten.linalg_pinv.atol_rtol_tensor, precision=True)
def linalg_pinv_atol_rtol_tensor(self, atol, rtol, hermitian, *, precision):
    m, n = self.shape[-2:]
    real = jnp.finfo(self.dtype).dtype
    # torch's get_atol_rtol: a given positive atol alone turns the default rtol off.
    default_rtol = jnp.asarray(jnp.finfo(real).eps * max(m, n), real)
    if rtol is None:
        rtol = default_rtol if atol is None else jnp.where(atol > 0, 0, default_rtol)
    atol = jnp.zeros((), real) if atol is None else atol
    if self.size == 0:
        return jnp.zeros((*self.shape[:-2], n, m), self.dtype)
    if hermitian:
        # Like torch, only the lower triangle is read.
        values, vectors = jnp.linalg.eigh(self, UPLO="L", symmetrize_input=False)
        magnitudes = jnp.abs(values)
        left, right = vectors, _mH(vectors)
    else:
        left, magnitudes, right = jnp.linalg.svd(self, full_matrices=False)
        values = magnitudes
    largest = jnp.max(magnitudes, -1, keepdims=True)
    threshold = jnp.maximum(atol[..., None], rtol[..., None] * largest)
    kept = magnitudes > threshold
    inverted = jnp.where(kept, 1 / jnp.where(kept, values, 1), 0).astype(self.dtype)
    return jnp.matmul(_mH(right), inverted[..., :, None] * _mH(left), precision=precision)


_LSTSQ_DRIVERS = ("gels", "gelsy", "gelsd", "gelss")


@lowers(aten.linalg_lstsq.default, dynamic_shape=True, precision=True)
def linalg_lstsq(self, b, rcond, driver, *, precision):
    """Every driver's solution is the minimum-norm least-squares one (gels assumes full
    rank, where it is the same): computed from the SVD. The drivers differ in which of
    residuals, rank and singular values they report."""
    if self.ndim < 2:
        raise RuntimeError("torch.linalg.lstsq: input must have at least 2 dimensions.")
    driver = driver or "gelsy"
    if driver not in _LSTSQ_DRIVERS:
        raise RuntimeError(
            "torch.linalg.lstsq: parameter `driver` should be one of (gels, gelsy, gelsd, gelss)"
        )
    m, n = self.shape[-2:]
    real = jnp.finfo(self.dtype).dtype
    vector_case = _is_vector_rhs(self, b)
    rhs = b[..., None] if vector_case else b
    a, rhs = _broadcast_batch(self, rhs)
    u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    rcond = jnp.finfo(real).eps * max(m, n) if rcond is None or rcond < 0 else rcond
    kept = s > rcond * jnp.max(s, -1, keepdims=True, initial=0)
    s_inverse = jnp.where(kept, 1 / jnp.where(kept, s, 1), 0).astype(self.dtype)
    product = functools.partial(jnp.matmul, precision=precision)
    solution = product(_mH(vh), s_inverse[..., :, None] * product(_mH(u), rhs))
    rank = jnp.sum(kept, -1).astype(jnp.int64)

    empty = jnp.zeros((0,), real)
    residuals = empty
    if m > n and driver != "gelsy" and (driver == "gels" or bool(jnp.all(rank == n))):
        residuals = jnp.sum(jnp.abs(rhs - product(a, solution)) ** 2, -2).astype(real)
        if vector_case:
            residuals = residuals[..., 0]
    if vector_case:
        solution = solution[..., 0]
    return (
        solution,
        residuals,
        jnp.zeros((0,), jnp.int64) if driver == "gels" else rank,
        s if driver in ("gelsd", "gelss") else empty,
    )
