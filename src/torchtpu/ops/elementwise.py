"""Pointwise ops: arithmetic, comparisons, math functions, activations.

Dtypes are the dispatcher's business (Note [Type promotion policy]): by the time a
lowering here runs, its ``promote`` arguments already have torch's computation dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy import special as jsp

from torchtpu.ops.registry import aten, lowers, prims
from torchtpu.ops.util import canonical_dim, cast, complex_logaddexp, opmath
from torchtpu.ops.value_checks import error_if


def _is_int(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.integer) or jnp.result_type(x) == jnp.bool_


def _is_bool(x) -> bool:
    return jnp.result_type(x) == jnp.bool_


def _check_int_divisor(divisor):
    if _is_int(divisor) and not _is_bool(divisor):
        error_if(jnp.any(divisor == 0), RuntimeError, "ZeroDivisionError")


# -- arithmetic ---------------------------------------------------------------------------------


def _check_alpha(self, alpha) -> None:
    """torch's alpha_check of add, sub and rsub (made by the CPU kernels; the meta kernels
    leave it out): ``alpha`` must be of a kind the computation dtype can hold."""
    if _is_one(alpha):
        return
    dtype, kind = jnp.result_type(self), jnp.result_type(alpha)
    if kind == jnp.bool_ and dtype != jnp.bool_:
        raise RuntimeError("Boolean alpha only supported for Boolean results.")
    if jnp.issubdtype(kind, jnp.inexact) and not jnp.issubdtype(dtype, jnp.inexact):
        raise RuntimeError(
            "For integral input tensors, argument alpha must not be a floating point number."
        )
    if jnp.issubdtype(kind, jnp.complexfloating) and not jnp.issubdtype(dtype, jnp.complexfloating):
        raise RuntimeError(
            "For non-complex input tensors, argument alpha must not be a complex number."
        )


@lowers(aten.add.Tensor, aten.add.Scalar, promote="default", promote_args=("self", "other"))
def add(self, other, alpha=1):
    _check_alpha(self, alpha)
    if _is_bool(self) and _is_bool(other):
        return jnp.logical_or(self, jnp.logical_and(other, alpha != 0))
    if _is_one(alpha):
        return self + other
    return self + other * cast(alpha, jnp.result_type(other))


def _is_one(alpha) -> bool:
    """True for a static alpha of 1 (the schema default), the common case."""
    return isinstance(alpha, (int, float)) and alpha == 1


@lowers(aten.sub.Tensor, aten.sub.Scalar, promote="default", promote_args=("self", "other"))
def sub(self, other, alpha=1):
    _check_alpha(self, alpha)
    if _is_one(alpha):
        return self - other
    return self - other * cast(alpha, jnp.result_type(other))


@lowers(aten.rsub.Tensor, aten.rsub.Scalar, promote="default", promote_args=("self", "other"))
def rsub(self, other, alpha=1):
    _check_alpha(self, alpha)
    return other - self * cast(alpha, jnp.result_type(self))


@lowers(aten.mul.Tensor, aten.mul.Scalar, promote="default", promote_args=("self", "other"))
def mul(self, other):
    if _is_bool(self) and _is_bool(other):
        return jnp.logical_and(self, other)
    return self * other


@lowers(aten.div.Tensor, aten.div.Scalar, aten.true_divide.Tensor, promote="int_to_float")
def div(self, other):
    return self / other


@lowers(
    aten.div.Tensor_mode, aten.div.Scalar_mode, promote="default", promote_args=("self", "other")
)
def div_mode(self, other, rounding_mode=None):
    if rounding_mode is None:
        return self / other
    if _is_int(self):
        _check_int_divisor(other)
        if rounding_mode == "trunc":
            a, b = jnp.broadcast_arrays(self, jnp.where(other == 0, 1, other))
            return lax.div(a, b)  # rounds toward zero, unlike jnp's floor division
        return jnp.floor_divide(self, jnp.where(other == 0, 1, other))
    if rounding_mode == "trunc":
        return jnp.trunc(self / other)
    return _floor_divide_float(self, other)


def _floor_divide_float(a, b):
    # torch's div_floor_floating: exact for representable quotients, where a plain
    # floor(a / b) can be off by one; a zero divisor gives a / b (inf or nan).
    mod = jnp.fmod(a, b)
    div = (a - mod) / b
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floored = jnp.floor(div)
    floored = jnp.where(div - floored > 0.5, floored + 1, floored)
    quotient = jnp.where(div == 0, jnp.copysign(jnp.zeros_like(div), a / b), floored)
    return jnp.where(b == 0, a / b, quotient).astype(a.dtype)


@lowers(aten.floor_divide.default, aten.floor_divide.Scalar, promote="default")
def floor_divide(self, other):
    return div_mode(self, other, "floor")


@lowers(aten.remainder.Tensor, aten.remainder.Scalar, promote="default")
def remainder(self, other):
    if _is_int(self):
        _check_int_divisor(other)
        return jnp.remainder(self, jnp.where(other == 0, 1, other))
    return jnp.remainder(self, other)


@lowers(aten.remainder.Scalar_Tensor, promote="default")
def remainder_scalar_tensor(self, other):
    return remainder(self, other)


@lowers(aten.fmod.Tensor, aten.fmod.Scalar, promote="default")
def fmod(self, other):
    if _is_int(self):
        _check_int_divisor(other)
        return jnp.fmod(self, jnp.where(other == 0, 1, other))
    return jnp.fmod(self, other)


@lowers(aten.pow.Tensor_Scalar, promote="bool_to_long", static=("exponent",))
def pow_tensor_scalar(self, exponent):
    if isinstance(exponent, bool):
        exponent = int(exponent)
    if isinstance(exponent, int) and not jnp.issubdtype(self.dtype, jnp.complexfloating):
        if exponent < 0 and _is_int(self):
            raise RuntimeError("Integers to negative integer powers are not allowed.")
        if exponent >= 0 or not _is_int(self):
            return (
                lax.integer_pow(self, exponent)
                if abs(exponent) <= 64
                else jnp.power(self, exponent)
            )
    if exponent == 0.5:
        return jnp.sqrt(self)
    return jnp.power(self, jnp.asarray(exponent, self.dtype))


@lowers(aten.pow.Tensor_Tensor, promote="bool_to_long")
def pow_tensor_tensor(self, exponent):
    return _power(self, exponent)


@lowers(aten.pow.Scalar, promote="bool_to_long")
def pow_scalar(self, exponent):
    return _power(self, exponent)


def _power(base, exponent):
    if not (_is_int(base) and _is_int(exponent)):
        return jnp.power(base, exponent)
    # torch's integer pow: a negative exponent gives 1 for a base of 1, +-1 for -1 and
    # 0 otherwise (only a negative Python-number exponent is an error).
    base, exponent = jnp.broadcast_arrays(base, exponent)
    negative = exponent < 0
    result = jnp.power(base, jnp.where(negative, 0, exponent))
    odd = (exponent % 2) != 0
    reciprocal = jnp.where(base == 1, 1, jnp.where(base == -1, jnp.where(odd, -1, 1), 0))
    return jnp.where(negative, reciprocal.astype(result.dtype), result)


@lowers(aten.float_power.Tensor_Tensor, aten.float_power.Tensor_Scalar, aten.float_power.Scalar)
def float_power(self, exponent):
    dtype = jnp.complex128 if jnp.iscomplexobj(self) or jnp.iscomplexobj(exponent) else jnp.float64
    return jnp.power(cast(self, dtype), cast(exponent, dtype))


@lowers(aten.neg.default, promote="default")
def neg(self):
    if _is_bool(self):
        raise RuntimeError(
            "Negation, the `-` operator, on a bool tensor is not supported. "
            "If you are trying to invert a mask, use the `~` or `logical_not()` operator instead."
        )
    return -self


@lowers(aten.reciprocal.default, promote="int_to_float")
def reciprocal(self):
    return 1 / self


@lowers(aten.abs.default, promote="complex_to_float")
def abs_(self):
    return jnp.abs(self)


@lowers(aten.sgn.default, aten.sign.default, promote="default")
def sign(self):
    if _is_bool(self):
        return self
    if jnp.iscomplexobj(self):
        magnitude = jnp.abs(self)
        return jnp.where(magnitude == 0, 0, self / jnp.where(magnitude == 0, 1, magnitude))
    # torch's (0 < x) - (x < 0): NaN and -0.0 give 0, where jnp.sign keeps them.
    return (self > 0).astype(self.dtype) - (self < 0).astype(self.dtype)


@lowers(aten.signbit.default, promote="always_bool")
def signbit(self):
    return jnp.signbit(self) if not _is_int(self) else self < 0


@lowers(aten.square.default, promote="bool_to_long")
def square(self):
    return self * self


@lowers(aten.positive.default)
def positive(self):
    return self


# -- rounding ---------------------------------------------------------------------------------


def _float_only(fn):
    def lowering(self):
        return self if _is_int(self) else fn(self)

    lowering.__name__ = fn.__name__
    return lowering


lowers(aten.ceil.default, promote="default")(_float_only(jnp.ceil))
lowers(aten.floor.default, promote="default")(_float_only(jnp.floor))
lowers(aten.trunc.default, aten.fix.default, promote="default")(_float_only(jnp.trunc))
lowers(aten.round.default, promote="default")(_float_only(jnp.round))


@lowers(aten.round.decimals, promote="default")
def round_decimals(self, decimals):
    scale = 10.0**decimals
    if decimals >= 0:
        return jnp.round(self * scale) / scale
    return jnp.round(self / 10.0**-decimals) * 10.0**-decimals


@lowers(aten.frac.default, promote="default")
def frac(self):
    return self - jnp.trunc(self)


# -- float math ---------------------------------------------------------------------------------


def _digamma(x):
    # torch: -inf at +0 and +inf at -0 (the pole's sides), where JAX gives NaN
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x).astype(x.dtype), jsp.digamma(x))


_FLOAT_UNARY = {
    aten.exp.default: jnp.exp,
    aten.exp2.default: jnp.exp2,
    aten.expm1.default: jnp.expm1,
    aten.log.default: jnp.log,
    aten.log2.default: jnp.log2,
    aten.log10.default: jnp.log10,
    aten.log1p.default: jnp.log1p,
    aten.sqrt.default: jnp.sqrt,
    aten.rsqrt.default: lax.rsqrt,
    aten.sin.default: jnp.sin,
    aten.cos.default: jnp.cos,
    aten.tan.default: jnp.tan,
    aten.asin.default: jnp.arcsin,
    aten.acos.default: jnp.arccos,
    aten.atan.default: jnp.arctan,
    aten.sinh.default: jnp.sinh,
    aten.cosh.default: jnp.cosh,
    aten.tanh.default: jnp.tanh,
    aten.asinh.default: jnp.arcsinh,
    aten.acosh.default: jnp.arccosh,
    aten.atanh.default: jnp.arctanh,
    aten.sigmoid.default: jax.nn.sigmoid,
    aten.erf.default: jsp.erf,
    aten.erfc.default: jsp.erfc,
    aten.lgamma.default: jsp.gammaln,
    aten.digamma.default: _digamma,
    aten.i0.default: jsp.i0,
    aten.special_i0e.default: jsp.i0e,
    aten.special_i1.default: jsp.i1,
    aten.special_i1e.default: jsp.i1e,
    aten.special_ndtri.default: jsp.ndtri,
    aten.special_ndtr.default: jsp.ndtr,
    aten.special_erfcx.default: jsp.erfcx
    if hasattr(jsp, "erfcx")
    else (lambda x: jnp.exp(x * x) * jsp.erfc(x)),
    aten.special_entr.default: lambda x: jnp.where(
        x > 0, -x * jnp.log(x), jnp.where(x == 0, 0.0, -jnp.inf)
    ),
    aten.deg2rad.default: jnp.deg2rad,
    aten.rad2deg.default: jnp.rad2deg,
}
for _op, _fn in _FLOAT_UNARY.items():
    lowers(_op, promote="int_to_float")(_fn)


@lowers(aten.erfinv.default, promote="int_to_float")
def erfinv(self):
    # XLA's erf_inv is a polynomial up to ~50 ulp off near |x| = 1 in float32 and float64,
    # where its gradient exp(y^2) magnifies the error. One Newton step on
    # erfc(|y|) = 1 - |x| (exact there: Sterbenz) brings it to ~2 ulp, as torch's CPU
    # kernel is; below |x| = 0.5 it is already that accurate.
    x = opmath(self)
    y = jsp.erfinv(x)
    a, b = jnp.abs(x), jnp.abs(y)
    slope = cast(2 / math.sqrt(math.pi), x.dtype) * jnp.exp(-b * b)
    refined = jnp.sign(y) * (b + (lax.erfc(b) - (1 - a)) / slope)
    return jnp.where((a > 0.5) & jnp.isfinite(y), refined, y).astype(self.dtype)


@lowers(aten.sinc.default, promote="int_to_float")
def sinc(self):
    return jnp.sinc(self)


@lowers(aten.angle.default, promote="int_to_float")
def angle(self):
    if jnp.iscomplexobj(self):
        return jnp.angle(self)
    pi, zero = jnp.asarray(jnp.pi, self.dtype), jnp.zeros((), self.dtype)  # not float64 arrays
    return jnp.where(jnp.isnan(self), self, jnp.where(self < 0, pi, zero))


@lowers(aten.logit.default, promote="int_to_float")
def logit(self, eps=None):
    x = self if eps is None else jnp.clip(self, eps, 1 - eps)
    return jnp.log(x / (1 - x))


@lowers(aten.polygamma.default, promote="int_to_float", promote_args=("self",))
def polygamma(n, self):
    if n == 0:
        return _digamma(self)
    if n == 1:
        return _trigamma(self)
    # psi^(n)(x) = (-1)^(n+1) n! zeta(n+1, x), as torch computes it for every x.
    sign = 1.0 if n % 2 else -1.0
    return sign * math.factorial(n) * _hurwitz_zeta(float(n + 1), self)


def _hurwitz_zeta(s, q):
    """zeta(s, q) for an integer s > 1 and any q: JAX's zeta is only right for q > 0, so
    negative q is first shifted up by the recurrence zeta(s, q) = zeta(s, q + 1) + q^-s."""
    shift = jnp.where(q < 0, jnp.ceil(-q), 0)

    def more(state):
        return state[0] < jnp.max(shift)

    def add_term(state):
        j, total = state
        return j + 1, total + jnp.where(j < shift, (q + j) ** -s, 0)

    _, head = lax.while_loop(more, add_term, (jnp.zeros((), q.dtype), jnp.zeros_like(q)))
    tail = jsp.zeta(s, q + shift)
    return jnp.where(q == jnp.floor(q), jnp.where(q <= 0, jnp.inf, tail), head + tail)


def _trigamma(x):
    """psi'(x), accurate for negative x too (JAX's polygamma(1, x) is not): the
    reflection psi'(x) + psi'(1 - x) = pi^2 / sin^2(pi x) below 1/2, then the
    recurrence psi'(x) = psi'(x + 1) + 1/x^2 up to x >= 6, then the asymptotic series."""
    reflect = x < 0.5
    sin_pi_x = jnp.sin(jnp.pi * x)
    y = jnp.where(reflect, 1 - x, x)
    total = jnp.zeros_like(y)
    for _ in range(6):
        total = total + 1 / (y * y)
        y = y + 1
    inv2 = 1 / (y * y)
    total = total + (1 + 1 / (2 * y) + inv2 * (1 / 6 - inv2 * (1 / 30 - inv2 / 42))) / y
    return jnp.where(reflect, jnp.pi**2 / (sin_pi_x * sin_pi_x) - total, total)


@lowers(aten.mvlgamma.default, promote="int_to_float")
def mvlgamma(self, p):
    return jsp.multigammaln(self, p)


@lowers(aten.atan2.default, aten.arctan2.default, promote="int_to_float")
def atan2(self, other):
    return jnp.arctan2(self, other)


@lowers(aten.hypot.default, promote="int_to_float")
def hypot(self, other):
    return jnp.hypot(self, other)


@lowers(aten.copysign.Tensor, aten.copysign.Scalar, promote="int_to_float")
def copysign(self, other):
    return jnp.copysign(self, other)


@lowers(aten.nextafter.default, promote="default")
def nextafter(self, other):
    return jnp.nextafter(self, other)


@lowers(aten.logaddexp.default, promote="int_to_float")
def logaddexp(self, other):
    if jnp.iscomplexobj(self):
        return complex_logaddexp(self, other)
    return jnp.logaddexp(self, other)


@lowers(aten.logaddexp2.default, promote="int_to_float")
def logaddexp2(self, other):
    return jnp.logaddexp2(self, other)


@lowers(aten.xlogy.Tensor, aten.xlogy.Scalar_Self, aten.xlogy.Scalar_Other, promote="int_to_float")
def xlogy(self, other):
    return jnp.where(jnp.isnan(other), jnp.nan, jsp.xlogy(self, other))


@lowers(aten.special_xlog1py.default, promote="int_to_float")
def xlog1py(self, other):
    return jnp.where(jnp.isnan(other), jnp.nan, jsp.xlog1py(self, other))


@lowers(aten.ldexp.Tensor, promote="int_to_float")
def ldexp(self, other):
    return self * jnp.exp2(other)


@lowers(aten.heaviside.default, promote="default")
def heaviside(self, values):
    return jnp.where(self == 0, values, (self > 0).astype(self.dtype))


@lowers(aten.nan_to_num.default)
def nan_to_num(self, nan=None, posinf=None, neginf=None):
    if _is_int(self):
        return self
    info = jnp.finfo(self.real.dtype if jnp.iscomplexobj(self) else self.dtype)
    return jnp.nan_to_num(
        self,
        nan=0.0 if nan is None else nan,
        posinf=info.max if posinf is None else posinf,
        neginf=info.min if neginf is None else neginf,
    )


@lowers(aten.real.default)
def real(self):
    return jnp.real(self)


@lowers(aten.imag.default)
def imag(self):
    return jnp.imag(self)


@lowers(aten.conj_physical.default)
def conj_physical(self):
    return jnp.conj(self)


@lowers(aten.complex.default)
def complex_(real, imag):
    if real.dtype != imag.dtype:
        names = {jnp.float16: "Half", jnp.float32: "Float", jnp.float64: "Double"}
        raise RuntimeError(
            f"Expected object of scalar type {names.get(real.dtype.type, real.dtype)} but got "
            f"scalar type {names.get(imag.dtype.type, imag.dtype)} for second argument"
        )
    return lax.complex(*jnp.broadcast_arrays(real, imag))


@lowers(aten.polar.default)
def polar(abs, angle):
    return lax.complex(abs * jnp.cos(angle), abs * jnp.sin(angle))


# -- comparisons and logic ---------------------------------------------------------------------

_COMPARISONS = {
    aten.eq.Tensor: jnp.equal,
    aten.eq.Scalar: jnp.equal,
    aten.ne.Tensor: jnp.not_equal,
    aten.ne.Scalar: jnp.not_equal,
    aten.lt.Tensor: jnp.less,
    aten.lt.Scalar: jnp.less,
    aten.le.Tensor: jnp.less_equal,
    aten.le.Scalar: jnp.less_equal,
    aten.gt.Tensor: jnp.greater,
    aten.gt.Scalar: jnp.greater,
    aten.ge.Tensor: jnp.greater_equal,
    aten.ge.Scalar: jnp.greater_equal,
}
for _op, _fn in _COMPARISONS.items():
    lowers(_op, promote="always_bool")(_fn)


@lowers(aten.logical_and.default, promote="always_bool")
def logical_and(self, other):
    return jnp.logical_and(self != 0, other != 0)


@lowers(aten.logical_or.default, promote="always_bool")
def logical_or(self, other):
    return jnp.logical_or(self != 0, other != 0)


@lowers(aten.logical_xor.default, promote="always_bool")
def logical_xor(self, other):
    return jnp.logical_xor(self != 0, other != 0)


@lowers(aten.logical_not.default)
def logical_not(self):
    return self == 0


@lowers(aten.isnan.default)
def isnan(self):
    return jnp.isnan(self) if not _is_int(self) else jnp.zeros(self.shape, bool)


@lowers(aten.isinf.default)
def isinf(self):
    return jnp.isinf(self) if not _is_int(self) else jnp.zeros(self.shape, bool)


@lowers(aten.isfinite.default)
def isfinite(self):
    return jnp.isfinite(self) if not _is_int(self) else jnp.ones(self.shape, bool)


@lowers(aten.isposinf.default)
def isposinf(self):
    return jnp.isposinf(self) if not _is_int(self) else jnp.zeros(self.shape, bool)


@lowers(aten.isneginf.default)
def isneginf(self):
    return jnp.isneginf(self) if not _is_int(self) else jnp.zeros(self.shape, bool)


@lowers(aten.maximum.default, promote="default")
def maximum(self, other):
    return jnp.maximum(self, other)


@lowers(aten.minimum.default, promote="default")
def minimum(self, other):
    return jnp.minimum(self, other)


@lowers(aten.fmax.default, promote="default")
def fmax(self, other):
    return jnp.fmax(self, other)


@lowers(aten.fmin.default, promote="default")
def fmin(self, other):
    return jnp.fmin(self, other)


# -- bitwise ----------------------------------------------------------------------------------

_BITWISE = {
    aten.bitwise_and.Tensor: jnp.bitwise_and,
    aten.bitwise_and.Scalar: jnp.bitwise_and,
    aten.bitwise_or.Tensor: jnp.bitwise_or,
    aten.bitwise_or.Scalar: jnp.bitwise_or,
    aten.bitwise_xor.Tensor: jnp.bitwise_xor,
    aten.bitwise_xor.Scalar: jnp.bitwise_xor,
}
for _op, _fn in _BITWISE.items():
    lowers(_op, promote="default")(_fn)


@lowers(aten.gcd.default, promote="default")
def gcd(self, other):
    return jnp.gcd(self, other)


@lowers(aten.lcm.default, promote="default")
def lcm(self, other):
    # torch's |a / gcd(a, b) * b|, wrapping on overflow; 0 where either is 0.
    g = jnp.gcd(self, other)
    return jnp.where(
        g == 0, jnp.zeros((), self.dtype), jnp.abs(self // jnp.where(g == 0, 1, g) * other)
    )


@lowers(aten.bitwise_not.default)
def bitwise_not(self):
    return jnp.logical_not(self) if _is_bool(self) else jnp.bitwise_not(self)


@lowers(
    aten.bitwise_left_shift.Tensor,
    aten.bitwise_left_shift.Tensor_Scalar,
    aten.__lshift__.Tensor,
    aten.__lshift__.Scalar,
    promote="default",
)
def left_shift(self, other):
    bits = jnp.iinfo(self.dtype).bits
    return jnp.where(
        (other < 0) | (other >= bits), 0, jnp.left_shift(self, jnp.clip(other, 0, bits - 1))
    )


@lowers(
    aten.bitwise_right_shift.Tensor,
    aten.bitwise_right_shift.Tensor_Scalar,
    aten.__rshift__.Tensor,
    aten.__rshift__.Scalar,
    promote="default",
)
def right_shift(self, other):
    bits = jnp.iinfo(self.dtype).bits
    shifted = jnp.right_shift(self, jnp.clip(other, 0, bits - 1))
    return jnp.where(
        (other < 0) | (other >= bits), jnp.where(self < 0, -1, 0).astype(self.dtype), shifted
    )


# -- selection ---------------------------------------------------------------------------------


@lowers(
    aten.where.self,
    aten.where.ScalarOther,
    aten.where.ScalarSelf,
    aten.where.Scalar,
    promote="no_opmath",
    promote_args=("self", "other"),
)
def where(condition, self, other):
    return jnp.where(condition, self, other)


@lowers(aten.clamp.default, aten.clamp.Tensor, promote="default")
def clamp(self, min=None, max=None):
    if min is None and max is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
    out = self
    if min is not None:
        out = (
            jnp.where(jnp.isnan(min), min, jnp.maximum(out, min))
            if not _is_int(out)
            else jnp.maximum(out, min)
        )
    if max is not None:
        out = (
            jnp.where(jnp.isnan(max), max, jnp.minimum(out, max))
            if not _is_int(out)
            else jnp.minimum(out, max)
        )
    return out


@lowers(aten.clamp_min.default, aten.clamp_min.Tensor, promote="default")
def clamp_min(self, min):
    return clamp(self, min, None)


@lowers(aten.clamp_max.default, aten.clamp_max.Tensor, promote="default")
def clamp_max(self, max):
    return clamp(self, None, max)


@lowers(aten.fill.Scalar, aten.fill.Tensor, writes_expanded=True)
def fill(self, value):
    return jnp.broadcast_to(cast(value, self.dtype), self.shape)


@lowers(aten.zero.default, writes_expanded=True)
def zero(self):
    return jnp.zeros_like(self)


@lowers(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(self, mask, value):
    return jnp.where(mask, cast(value, self.dtype), self)


@lowers(aten.lerp.Scalar, aten.lerp.Tensor, promote="default")
def lerp(self, end, weight):
    # torch's formula: exact at weight 0 and 1 from either side.
    diff = end - self
    return jnp.where(jnp.abs(weight) < 0.5, self + weight * diff, end - diff * (1 - weight))


@lowers(aten.addcmul.default, promote="default", promote_args=("self", "tensor1", "tensor2"))
def addcmul(self, tensor1, tensor2, value=1):
    return self + cast(value, self.dtype) * tensor1 * tensor2


@lowers(aten.addcdiv.default, promote="default", promote_args=("self", "tensor1", "tensor2"))
def addcdiv(self, tensor1, tensor2, value=1):
    return self + cast(value, self.dtype) * (tensor1 / tensor2)


@lowers(aten._to_copy.default, prims.convert_element_type.default)
def _to_copy(
    self,
    dtype=None,
    layout=None,
    device=None,
    pin_memory=None,
    non_blocking=False,
    memory_format=None,
):
    return self  # the dispatcher casts to torch's result dtype


@lowers(aten.copy.default)
def copy(self, src, non_blocking=False):
    return jnp.broadcast_to(cast(src, self.dtype), self.shape)


# -- activations ------------------------------------------------------------------------------


@lowers(aten.relu.default, promote="default")
def relu(self):
    return jnp.maximum(self, jnp.zeros((), self.dtype)) if not _is_bool(self) else self


@lowers(aten.relu6.default, promote="default")
def relu6(self):
    return jnp.clip(self, 0, 6)


@lowers(aten.threshold.default, promote="default")
def threshold(self, threshold, value):
    return jnp.where(self <= threshold, cast(value, self.dtype), self)


@lowers(aten.threshold_backward.default, promote="default")
def threshold_backward(grad_output, self, threshold):
    return jnp.where(self <= threshold, jnp.zeros((), grad_output.dtype), grad_output)


_SQRT_2 = 1.4142135623730951
_SQRT_2_OVER_PI = 0.7978845608028654


@lowers(aten.gelu.default, promote="default")
def gelu(self, approximate="none"):
    if approximate == "tanh":
        return 0.5 * self * (1 + jnp.tanh(_SQRT_2_OVER_PI * (self + 0.044715 * self**3)))
    return 0.5 * self * (1 + jsp.erf(self / _SQRT_2))


@lowers(aten.gelu_backward.default, promote="default")
def gelu_backward(grad_output, self, approximate="none"):
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (self + 0.044715 * self**3)
        t = jnp.tanh(inner)
        d_inner = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * self**2)
        return grad_output * (0.5 * (1 + t) + 0.5 * self * (1 - t * t) * d_inner)
    cdf = 0.5 * (1 + jsp.erf(self / _SQRT_2))
    pdf = jnp.exp(-0.5 * self * self) / jnp.sqrt(2 * jnp.pi)
    return grad_output * (cdf + self * pdf)


@lowers(aten.silu.default, promote="default")
def silu(self):
    return self * jax.nn.sigmoid(self)


@lowers(aten.silu_backward.default, promote="default")
def silu_backward(grad_output, self):
    s = jax.nn.sigmoid(self)
    return grad_output * s * (1 + self * (1 - s))


@lowers(aten.mish.default, promote="default")
def mish(self):
    return self * jnp.tanh(jax.nn.softplus(self))


@lowers(aten.sigmoid_backward.default, promote="default")
def sigmoid_backward(grad_output, output):
    return (
        grad_output * output * (1 - output)
        if not jnp.iscomplexobj(output)
        else grad_output * jnp.conj(output * (1 - output))
    )


@lowers(aten.tanh_backward.default, promote="default")
def tanh_backward(grad_output, output):
    return (
        grad_output * (1 - output * output)
        if not jnp.iscomplexobj(output)
        else grad_output * jnp.conj(1 - output * output)
    )


@lowers(aten.leaky_relu.default, promote="default", promote_args=("self",))
def leaky_relu(self, negative_slope=0.01):
    return jnp.where(self > 0, self, self * cast(negative_slope, self.dtype))


@lowers(aten.leaky_relu_backward.default, promote="default", promote_args=("grad_output", "self"))
def leaky_relu_backward(grad_output, self, negative_slope, self_is_result):
    if self_is_result:  # the backward of leaky_relu_: the input is gone, its sign unknown
        error_if(
            negative_slope < 0,
            RuntimeError,
            "In-place leakyReLu backward calculation is triggered with a negative slope which "
            "is not supported. This is caused by calling in-place forward function with a "
            "negative slope, please call out-of-place version instead. File an issue at "
            "https://github.com/pytorch/pytorch if you do require supporting in-place leakRelu "
            "backward calculation with negative slope",
        )
    return jnp.where(self > 0, grad_output, grad_output * cast(negative_slope, grad_output.dtype))


@lowers(aten.elu.default, promote="default", promote_args=("self",))
def elu(self, alpha=1, scale=1, input_scale=1):
    negative = cast(alpha, self.dtype) * (jnp.expm1(self * cast(input_scale, self.dtype)))
    return cast(scale, self.dtype) * jnp.where(self > 0, self, negative)


@lowers(
    aten.elu_backward.default, promote="default", promote_args=("grad_output", "self_or_result")
)
def elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    dtype = grad_output.dtype
    alpha, scale, input_scale = cast(alpha, dtype), cast(scale, dtype), cast(input_scale, dtype)
    if is_result:
        # From the output y = scale * alpha * (exp(x * input_scale) - 1), as torch does.
        negative = input_scale * (self_or_result + alpha * scale)
    else:
        negative = input_scale * alpha * scale * jnp.exp(self_or_result * input_scale)
    return grad_output * jnp.where(self_or_result <= 0, negative, scale)


@lowers(aten.softplus.default, promote="default", promote_args=("self",))
def softplus(self, beta=1, threshold=20):
    scaled = self * beta
    return jnp.where(
        scaled > threshold, self, jnp.log1p(jnp.exp(jnp.minimum(scaled, threshold))) / beta
    )


@lowers(aten.softplus_backward.default, promote="default", promote_args=("grad_output", "self"))
def softplus_backward(grad_output, self, beta, threshold):
    scaled = self * cast(beta, self.dtype)
    return jnp.where(scaled > threshold, grad_output, grad_output * jax.nn.sigmoid(scaled))


@lowers(aten.hardtanh.default, promote="default", promote_args=("self",))
def hardtanh(self, min_val=-1, max_val=1):
    return jnp.clip(self, cast(min_val, self.dtype), cast(max_val, self.dtype))


@lowers(aten.hardtanh_backward.default, promote="default", promote_args=("grad_output", "self"))
def hardtanh_backward(grad_output, self, min_val, max_val):
    return jnp.where(
        (self <= min_val) | (self >= max_val), jnp.zeros((), grad_output.dtype), grad_output
    )


@lowers(aten.hardsigmoid.default, promote="default")
def hardsigmoid(self):
    return jnp.clip(self / 6 + 0.5, 0, 1)


@lowers(aten.hardsigmoid_backward.default, promote="default")
def hardsigmoid_backward(grad_output, self):
    return jnp.where((self > -3) & (self < 3), grad_output / 6, jnp.zeros((), grad_output.dtype))


@lowers(aten.hardswish.default, promote="default")
def hardswish(self):
    return self * jnp.clip(self + 3, 0, 6) / 6


@lowers(aten.hardswish_backward.default, promote="default")
def hardswish_backward(grad_output, self):
    inside = grad_output * (self / 3 + 0.5)
    return jnp.where(
        self < -3, jnp.zeros((), grad_output.dtype), jnp.where(self <= 3, inside, grad_output)
    )


@lowers(aten.softshrink_backward.default, promote="default", promote_args=("grad_output", "self"))
def softshrink_backward(grad_output, self, lambd):
    return jnp.where(jnp.abs(self) > lambd, grad_output, jnp.zeros((), grad_output.dtype))


@lowers(aten.hardshrink_backward.default, promote="default", promote_args=("grad_out", "self"))
def hardshrink_backward(grad_out, self, lambd):
    return jnp.where(jnp.abs(self) > lambd, grad_out, jnp.zeros((), grad_out.dtype))


@lowers(aten.log_sigmoid_forward.default, promote="default")
def log_sigmoid_forward(self):
    # The second output is the buffer torch's CPU kernel returns: exp(-|x|).
    return -jax.nn.softplus(-self), jnp.exp(-jnp.abs(self))


@lowers(aten.log_sigmoid_backward.default, promote="default", promote_args=("grad_output", "self"))
def log_sigmoid_backward(grad_output, self, buffer):
    # d/dx log(sigmoid(x)) = sigmoid(-x), from sigmoid(-|x|) so that exp cannot overflow.
    z = jnp.exp(-jnp.abs(self))
    small = z / (1 + z)
    return grad_output * jnp.where(self < 0, 1 - small, small)


@lowers(aten.glu.default, promote="default")
def glu(self, dim=-1):
    a, b = jnp.split(self, 2, axis=canonical_dim(dim, self.ndim))
    return a * jax.nn.sigmoid(b)


@lowers(aten.glu_backward.default, promote="default", promote_args=("grad_output", "self"))
def glu_backward(grad_output, self, dim):
    axis = canonical_dim(dim, self.ndim)
    a, b = jnp.split(self, 2, axis=axis)
    gate = jax.nn.sigmoid(b)
    return jnp.concatenate([grad_output * gate, grad_output * a * gate * (1 - gate)], axis=axis)


@lowers(aten._prelu_kernel.default, promote="default")
def _prelu_kernel(self, weight):
    return jnp.where(self > 0, self, weight * self)
