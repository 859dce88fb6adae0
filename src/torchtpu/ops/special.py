"""Special functions (Bessel, orthogonal polynomials, incomplete gamma, zeta, ...).

torch's CPU kernels (ATen/native/Math.h) are Cephes approximations evaluated in the
input's dtype; the lowerings here evaluate the same approximations the same way, branch
for branch (each branch of a piecewise definition is computed everywhere and the right
one picked with ``jnp.where``), so values agree to rounding, special points included.
Loops that run until a term is small run per element in a ``lax.while_loop``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.scipy import special as jsp

from torchtpu.ops.registry import aten, lowers, prims

_SQRT_2_OVER_PI = 0.797884560802865355879892119868763737
_TWO_OVER_PI = 0.636619772367581343075535053490057448
_PI_OVER_4 = 0.785398163397448309615660845819875721
_3_PI_OVER_4 = 2.356194490192344928846982537459627163
_1_OVER_SQRT_PI = 5.64189583547756286948e-01

# Cephes coefficients, highest power first, as in ATen/native/Math.h.
_AIRY_POS_N = (
    3.46538101525629032477e-01,
    1.20075952739645805542e01,
    7.62796053615234516538e01,
    1.68089224934630576269e02,
    1.59756391350164413639e02,
    7.05360906840444183113e01,
    1.40264691163389668864e01,
    9.99999999999999995305e-01,
)
_AIRY_POS_D = (
    5.67594532638770212846e-01,
    1.47562562584847203173e01,
    8.45138970141474626562e01,
    1.77318088145400459522e02,
    1.64234692871529701831e02,
    7.14778400825575695274e01,
    1.40959135607834029598e01,
    1.00000000000000000470e00,
)
_AIRY_NEG_FN = (
    -1.31696323418331795333e-01,
    -6.26456544431912369773e-01,
    -6.93158036036933542233e-01,
    -2.79779981545119124951e-01,
    -4.91900132609500318020e-02,
    -4.06265923594885404393e-03,
    -1.59276496239262096340e-04,
    -2.77649108155232920844e-06,
    -1.67787698489114633780e-08,
)
_AIRY_NEG_FD = (
    1.33560420706553243746e01,
    3.26825032795224613948e01,
    2.67367040941499554804e01,
    9.18707402907259625840e00,
    1.47529146771666414581e00,
    1.15687173795188044134e-01,
    4.40291641615211203805e-03,
    7.54720348287414296618e-05,
    4.51850092970580378464e-07,
)
_AIRY_NEG_GN = (
    1.97339932091685679179e-02,
    3.91103029615688277255e-01,
    1.06579897599595591108e00,
    9.39169229816650230044e-01,
    3.51465656105547619242e-01,
    6.33888919628925490927e-02,
    5.85804113048388458567e-03,
    2.82851600836737019778e-04,
    6.98793669997260967291e-06,
    8.11789239554389293311e-08,
    3.41551784765923618484e-10,
)
_AIRY_NEG_GD = (
    9.30892908077441974853e00,
    1.98352928718312140417e01,
    1.55646628932864612953e01,
    5.47686069422975497931e00,
    9.54293611618961883998e-01,
    8.64580826352392193095e-02,
    4.12656523824222607191e-03,
    1.01259085116509135510e-04,
    1.17166733214413521882e-06,
    4.91834570062930015649e-09,
)
_J0_RP = (
    -4.79443220978201773821e09,
    1.95617491946556577543e12,
    -2.49248344360967716204e14,
    9.70862251047306323952e15,
)
_J0_RQ = (
    4.99563147152651017219e02,
    1.73785401676374683123e05,
    4.84409658339962045305e07,
    1.11855537045356834862e10,
    2.11277520115489217587e12,
    3.10518229857422583814e14,
    3.18121955943204943306e16,
    1.71086294081043136091e18,
)
_J0_PP = (
    7.96936729297347051624e-04,
    8.28352392107440799803e-02,
    1.23953371646414299388e00,
    5.44725003058768775090e00,
    8.74716500199817011941e00,
    5.30324038235394892183e00,
    9.99999999999999997821e-01,
)
_J0_PQ = (
    9.24408810558863637013e-04,
    8.56288474354474431428e-02,
    1.25352743901058953537e00,
    5.47097740330417105182e00,
    8.76190883237069594232e00,
    5.30605288235394617618e00,
    1.00000000000000000218e00,
)
_J0_QP = (
    -1.13663838898469149931e-02,
    -1.28252718670509318512e00,
    -1.95539544257735972385e01,
    -9.32060152123768231369e01,
    -1.77681167980488050595e02,
    -1.47077505154951170175e02,
    -5.14105326766599330220e01,
    -6.05014350600728481186e00,
)
_J0_QQ = (
    6.43178256118178023184e01,
    8.56430025976980587198e02,
    3.88240183605401609683e03,
    7.24046774195652478189e03,
    5.93072701187316984827e03,
    2.06209331660327847417e03,
    2.42005740240291393179e02,
)
_J1_RP = (
    -8.99971225705559398224e08,
    4.52228297998194034323e11,
    -7.27494245221818276015e13,
    3.68295732863852883286e15,
)
_J1_RQ = (
    6.20836478118054335476e02,
    2.56987256757748830383e05,
    8.35146791431949253037e07,
    2.21511595479792499675e10,
    4.74914122079991414898e12,
    7.84369607876235854894e14,
    8.95222336184627338078e16,
    5.32278620332680085395e18,
)
_J1_PP = (
    7.62125616208173112003e-04,
    7.31397056940917570436e-02,
    1.12719608129684925192e00,
    5.11207951146807644818e00,
    8.42404590141772420927e00,
    5.21451598682361504063e00,
    1.00000000000000000254e00,
)
_J1_PQ = (
    5.71323128072548699714e-04,
    6.88455908754495404082e-02,
    1.10514232634061696926e00,
    5.07386386128601488557e00,
    8.39985554327604159757e00,
    5.20982848682361821619e00,
    9.99999999999999997461e-01,
)
_J1_QP = (
    5.10862594750176621635e-02,
    4.98213872951233449420e00,
    7.58238284132545283818e01,
    3.66779609360150777800e02,
    7.10856304998926107277e02,
    5.97489612400613639965e02,
    2.11688757100572135698e02,
    2.52070205858023719784e01,
)
_J1_QQ = (
    7.42373277035675149943e01,
    1.05644886038262816351e03,
    4.98641058337653607651e03,
    9.56231892404756170795e03,
    7.99704160447350683650e03,
    2.82619278517639096600e03,
    3.36093607810698293419e02,
)
_Y0_YP = (
    1.55924367855235737965e04,
    -1.46639295903971606143e07,
    5.43526477051876500413e09,
    -9.82136065717911466409e11,
    8.75906394395366999549e13,
    -3.46628303384729719441e15,
    4.42733268572569800351e16,
    -1.84950800436986690637e16,
)
_Y0_YQ = (
    1.04128353664259848412e03,
    6.26107330137134956842e05,
    2.68919633393814121987e08,
    8.64002487103935000337e10,
    2.02979612750105546709e13,
    3.17157752842975028269e15,
    2.50596256172653059228e17,
)
_Y1_YP = (
    1.26320474790178026440e09,
    -6.47355876379160291031e11,
    1.14509511541823727583e14,
    -8.12770255501325109621e15,
    2.02439475713594898196e17,
    -7.78877196265950026825e17,
)
_Y1_YQ = (
    5.94301592346128195359e02,
    2.35564092943068577943e05,
    7.34811944459721705660e07,
    1.87601316108706159478e10,
    3.88231277496238566008e12,
    6.20557727146953693363e14,
    6.87141087355300489866e16,
    3.97270608116560655612e18,
)
_K0_A = (
    1.37446543561352307156e-16,
    4.25981614279661018399e-14,
    1.03496952576338420167e-11,
    1.90451637722020886025e-09,
    2.53479107902614945675e-07,
    2.28621210311945178607e-05,
    1.26461541144692592338e-03,
    3.59799365153615016266e-02,
    3.44289899924628486886e-01,
    -5.35327393233902768720e-01,
)
_K0_B = (
    5.30043377268626276149e-18,
    -1.64758043015242134646e-17,
    5.21039150503902756861e-17,
    -1.67823109680541210385e-16,
    5.51205597852431940784e-16,
    -1.84859337734377901440e-15,
    6.34007647740507060557e-15,
    -2.22751332699166985548e-14,
    8.03289077536357521100e-14,
    -2.98009692317273043925e-13,
    1.14034058820847496303e-12,
    -4.51459788337394416547e-12,
    1.85594911495471785253e-11,
    -7.95748924447710747776e-11,
    3.57739728140030116597e-10,
    -1.69753450938905987466e-09,
    8.57403401741422608519e-09,
    -4.66048989768794782956e-08,
    2.76681363944501510342e-07,
    -1.83175552271911948767e-06,
    1.39498137188764993662e-05,
    -1.28495495816278026384e-04,
    1.56988388573005337491e-03,
    -3.14481013119645005427e-02,
    2.44030308206595545468e00,
)
_K1_A = (
    -7.02386347938628759343e-18,
    -2.42744985051936593393e-15,
    -6.66690169419932900609e-13,
    -1.41148839263352776110e-10,
    -2.21338763073472585583e-08,
    -2.43340614156596823496e-06,
    -1.73028895751305206302e-04,
    -6.97572385963986435018e-03,
    -1.22611180822657148235e-01,
    -3.53155960776544875667e-01,
    1.52530022733894777053e00,
)
_K1_B = (
    -5.75674448366501715755e-18,
    1.79405087314755922667e-17,
    -5.68946255844285935196e-17,
    1.83809354436663880070e-16,
    -6.05704724837331885336e-16,
    2.03870316562433424052e-15,
    -7.01983709041831346144e-15,
    2.47715442448130437068e-14,
    -8.97670518232499435011e-14,
    3.34841966607842919884e-13,
    -1.28917396095102890680e-12,
    5.13963967348173025100e-12,
    -2.12996783842756842877e-11,
    9.21831518760500529508e-11,
    -4.19035475934189648750e-10,
    2.01504975519703286596e-09,
    -1.03457624656780970260e-08,
    5.74108412545004946722e-08,
    -3.50196060308781257119e-07,
    2.40648494783721712015e-06,
    -1.93619797416608296024e-05,
    1.95215518471351631108e-04,
    -2.85781685962277938680e-03,
    1.03923736576817238437e-01,
    2.72062619048444266945e00,
)


def _polevl(z, coeffs):
    """Horner's rule, highest power first."""
    acc = jnp.full_like(z, coeffs[0])
    for c in coeffs[1:]:
        acc = acc * z + c
    return acc


def _chbevl(z, coeffs):
    """Cephes' Clenshaw sum of a Chebyshev series (``z`` is twice the usual argument)."""
    a = jnp.full_like(z, coeffs[0])
    p = q = jnp.zeros_like(z)
    for c in coeffs[1:]:
        p, q = q, a
        a = z * q - p + c
    return 0.5 * (a - p)


# -- Bessel functions of the first and second kind ------------------------------------------


def _hankel_asymptotic(x, z, pp, pq, qp, qq, shift):
    """(J, Y) for x > 5 from Hankel's expansion: modulus and phase as rational functions
    of ``z`` (25 / x^2)."""
    p = _polevl(z, pp) / _polevl(z, pq)
    q = 5.0 / x * (_polevl(z, qp) / _polevl(z, qq))
    sin, cos = jnp.sin(x - shift), jnp.cos(x - shift)
    scale = _SQRT_2_OVER_PI / jnp.sqrt(x)
    return (p * cos - q * sin) * scale, (p * sin + q * cos) * scale


def _bessel_j0(x):
    x = jnp.abs(x)
    z = x * x
    near_zero = 1.0 - z / 4.0
    small = (
        (z - 5.78318596294678452118e00)
        * (z - 3.04712623436620863991e01)
        * _polevl(z, _J0_RP)
        / _polevl(z, _J0_RQ)
    )
    large, _ = _hankel_asymptotic(x, 25.0 / z, _J0_PP, _J0_PQ, _J0_QP, _J0_QQ, _PI_OVER_4)
    return jnp.where(x <= 5.0, jnp.where(x < 1e-5, near_zero, small), large)


def _bessel_j1(x):
    # j1 is odd: torch evaluates it at |x| and flips the sign.
    ax = jnp.abs(x)
    z = ax * ax
    small = (
        _polevl(z, _J1_RP)
        / _polevl(z, _J1_RQ)
        * ax
        * (z - 1.46819706421238932572e01)
        * (z - 4.92184563216946036703e01)
    )
    w = 5.0 / ax
    large, _ = _hankel_asymptotic(ax, w * w, _J1_PP, _J1_PQ, _J1_QP, _J1_QQ, _3_PI_OVER_4)
    value = jnp.where(ax <= 5.0, small, large)
    return jnp.where(x < 0, -value, value)


def _bessel_y0(x):
    z = x * x
    small = _polevl(z, _Y0_YP) / _polevl(z, _Y0_YQ) + _TWO_OVER_PI * jnp.log(x) * _bessel_j0(x)
    _, large = _hankel_asymptotic(x, 25.0 / z, _J0_PP, _J0_PQ, _J0_QP, _J0_QQ, _PI_OVER_4)
    small = jnp.where(x == 0, -jnp.inf, jnp.where(x < 0, jnp.nan, small))
    return jnp.where(x <= 5.0, small, large)


def _bessel_y1(x):
    z = x * x
    small = x * (_polevl(z, _Y1_YP) / _polevl(z, _Y1_YQ)) + _TWO_OVER_PI * (
        _bessel_j1(x) * jnp.log(x) - 1.0 / x
    )
    w = 5.0 / x
    _, large = _hankel_asymptotic(x, w * w, _J1_PP, _J1_PQ, _J1_QP, _J1_QQ, _3_PI_OVER_4)
    small = jnp.where(x == 0, -jnp.inf, jnp.where(x < 0, jnp.nan, small))
    return jnp.where(x <= 5.0, small, large)


@lowers(prims.bessel_j0.default)
def bessel_j0(self):
    return _bessel_j0(self)


@lowers(prims.bessel_j1.default)
def bessel_j1(self):
    return _bessel_j1(self)


@lowers(aten.special_bessel_y0.default, promote="int_to_float")
def special_bessel_y0(self):
    return _bessel_y0(self)


@lowers(aten.special_bessel_y1.default, promote="int_to_float")
def special_bessel_y1(self):
    return _bessel_y1(self)


_SPHERICAL_J0_TAYLOR = (
    1.0 / 6227020800.0,
    -1.0 / 39916800.0,
    1.0 / 362880.0,
    -1.0 / 5040.0,
    1.0 / 120.0,
    -1.0 / 6.0,
    1.0,
)


@lowers(prims.spherical_bessel_j0.default)
def spherical_bessel_j0(self):
    x = self
    value = jnp.where(jnp.abs(x) < 0.5, _polevl(x * x, _SPHERICAL_J0_TAYLOR), jnp.sin(x) / x)
    return jnp.where(jnp.isinf(x), 0.0, value)


# -- modified Bessel functions -------------------------------------------------------------


def _modified_bessel_i0(x):
    # exp(|x|) * i0e(x) is Cephes' i0; torch's gives NaN (inf * 0) at +-inf.
    return jnp.where(jnp.isinf(x), jnp.nan, jsp.i0(x))


def _modified_bessel_i1(x):
    return jnp.where(jnp.isinf(x), jnp.nan, jsp.i1(x))


@lowers(aten.special_modified_bessel_i0.default, promote="int_to_float")
def special_modified_bessel_i0(self):
    return _modified_bessel_i0(self)


@lowers(aten.special_modified_bessel_i1.default, promote="int_to_float")
def special_modified_bessel_i1(self):
    return _modified_bessel_i1(self)


def _modified_bessel_k(x, order: int, scaled: bool):
    """K0 / K1 (times exp(x) when ``scaled``): a Chebyshev series in x^2 - 2 plus the
    log(x/2) I_n(x) term up to 2, a Chebyshev series in 8/x - 2 times exp(-x)/sqrt(x) above."""
    if order == 0:
        small = _chbevl(x * x - 2.0, _K0_A) - jnp.log(0.5 * x) * _modified_bessel_i0(x)
        large = _chbevl(8.0 / x - 2.0, _K0_B) / jnp.sqrt(x)
    else:
        small = jnp.log(0.5 * x) * _modified_bessel_i1(x) + _chbevl(x * x - 2.0, _K1_A) / x
        large = _chbevl(8.0 / x - 2.0, _K1_B) / jnp.sqrt(x)
    value = (
        jnp.where(x <= 2.0, small * jnp.exp(x), large)
        if scaled
        else jnp.where(x <= 2.0, small, jnp.exp(-x) * large)
    )
    return jnp.where(x == 0, jnp.inf, jnp.where(x < 0, jnp.nan, value))


@lowers(aten.special_modified_bessel_k0.default, promote="int_to_float")
def special_modified_bessel_k0(self):
    return _modified_bessel_k(self, 0, scaled=False)


@lowers(aten.special_modified_bessel_k1.default, promote="int_to_float")
def special_modified_bessel_k1(self):
    return _modified_bessel_k(self, 1, scaled=False)


@lowers(aten.special_scaled_modified_bessel_k0.default, promote="int_to_float")
def special_scaled_modified_bessel_k0(x):
    return _modified_bessel_k(x, 0, scaled=True)


@lowers(aten.special_scaled_modified_bessel_k1.default, promote="int_to_float")
def special_scaled_modified_bessel_k1(x):
    return _modified_bessel_k(x, 1, scaled=True)


# -- Airy function ----------------------------------------------------------------------------


def _airy_maclaurin(x):
    """Ai(x) from its Maclaurin series Ai = c1 f(x) - c2 g(x), summed per element until
    the relative size of f's last term is below the dtype's epsilon, as torch does."""
    eps = jnp.finfo(x.dtype).eps
    z = x * x * x

    def running(state):
        return state[-1] > eps

    def add_terms(state):
        k, m, n, f, g, t = state
        go = running(state)
        m2 = m * z / (k + 1.0)
        n2 = n * z / (k + 2.0)
        m2 = m2 / (k + 2.0)
        f2 = f + m2
        n2 = n2 / (k + 3.0)
        g2 = g + n2
        t2 = jnp.abs(m2 / f2)
        new = (m2, n2, f2, g2, t2)
        old = (m, n, f, g, t)
        return (k + 3.0, *(jnp.where(go, a, b) for a, b in zip(new, old)))

    one = jnp.ones_like(x)
    # k is an array so that XLA keeps the divisions (see _recurrence).
    init = (one, one, x, one, x, one)
    _, _, _, f, g, _ = lax.while_loop(lambda s: jnp.any(running(s)), add_terms, init)
    return 0.355028053887817239260 * f - 0.258819403792806798405 * g


@lowers(aten.special_airy_ai.default, promote="int_to_float")
def special_airy_ai(x):
    # Oscillatory asymptotic expansion below -2.09.
    t = -2.0 * x * jnp.sqrt(-x) / 3.0
    z = 1.0 / t
    zz = z * z
    phase = t + 0.25 * math.pi
    negative = (
        _1_OVER_SQRT_PI
        / jnp.sqrt(jnp.sqrt(-x))
        * (
            jnp.sin(phase) * (1.0 + zz * _polevl(zz, _AIRY_NEG_FN) / _polevl(zz, _AIRY_NEG_FD))
            - jnp.cos(phase) * (z * _polevl(zz, _AIRY_NEG_GN) / _polevl(zz, _AIRY_NEG_GD))
        )
    )
    # Exponentially decaying asymptotic expansion from 2.09 on.
    zeta = 2.0 * x * jnp.sqrt(x) / 3.0
    w = 1.0 / zeta
    positive = (
        _1_OVER_SQRT_PI
        * (_polevl(w, _AIRY_POS_N) / _polevl(w, _AIRY_POS_D))
        / (2.0 * jnp.sqrt(jnp.sqrt(x)) * jnp.exp(zeta))
    )
    # (The series runs on NaN too, so that NaN comes out.)
    central = _airy_maclaurin(jnp.where((x < -2.09) | (x >= 2.09), 0.0, x))
    value = jnp.where(x < -2.09, negative, jnp.where(x >= 2.09, positive, central))
    value = jnp.where(x > 103.892, 0.0, value)
    return jnp.where(jnp.isinf(x), jnp.nan, value)


# -- orthogonal polynomials ------------------------------------------------------------------
#
# torch truncates the degree n to an int64 and evaluates by the three-term recurrence,
# with closed forms where the recurrence would be slow or inexact (a large degree inside
# (-1, 1) for the Chebyshev kinds) and exact values at the ends of the interval.


def _degree(n):
    """``static_cast<int64_t>(n)``: truncation toward zero; NaN, +-inf and values out of
    int64's range become INT64_MIN on x86, so they count as a negative degree."""
    n = jnp.asarray(n)
    if jnp.issubdtype(n.dtype, jnp.integer):
        return n.astype(jnp.int64)
    in_range = jnp.isfinite(n) & (jnp.abs(n) < 2.0**63)
    return jnp.where(in_range, jnp.trunc(n), -1.0).astype(jnp.int64)


def _recurrence(n, p0, p1, step):
    """P_n of P_0 = p0, P_1 = p1, P_{m+1} = step(m, P_{m-1}, P_m), for n >= 1 (elements
    with n <= 1 come out as p1). Each element stops at its own degree, or at NaN."""

    def running(state):
        m, _, _, q = state
        return (m < n) & ~jnp.isnan(q)

    def advance(state):
        m, m_array, p, q = state
        go = running(state)
        r = step(m_array, p, q)
        return m + 1, m_array + 1.0, jnp.where(go, q, p), jnp.where(go, r, q)

    # m also runs as an array: XLA would turn a division by a broadcast scalar into a
    # multiplication by its reciprocal, which rounds differently from torch.
    init = (jnp.ones((), jnp.int64), jnp.ones_like(p1), p0, p1)
    _, _, _, q = lax.while_loop(lambda s: jnp.any(running(s)), advance, init)
    return q


def _libm(fn, x):
    """``fn(x)`` evaluated in float64 and rounded: torch's kernels call the C library, whose
    float32 functions are (nearly) correctly rounded; XLA's float32 ones are a few ulps
    off, which the closed forms' large arguments n * acos(x) magnify."""
    return fn(x.astype(jnp.float64)).astype(x.dtype)


def _parity_sign(n, dtype):
    return jnp.where(n % 2 == 0, 1.0, -1.0).astype(dtype)


# Chebyshev polynomials of the four kinds: P_1 as a function of y, the degree above which
# torch switches to the trigonometric closed form (unshifted, shifted).
_CHEBYSHEV_P1 = {
    "t": lambda y: y,
    "u": lambda y: y + y,
    "v": lambda y: y + y - 1.0,
    "w": lambda y: y + y + 1.0,
}
_CHEBYSHEV_CLOSED_FORM_ABOVE = {"t": (6, 6), "u": (8, 6), "v": (8, 6), "w": (8, 4)}


def _chebyshev(kind: str, x, n, shifted: bool):
    """The Chebyshev polynomial of ``kind`` at x, or at 2x - 1 when ``shifted``."""
    x = jnp.asarray(x)
    x, n = jnp.broadcast_arrays(x, _degree(n))
    dtype = x.dtype
    y = x + x - 1.0 if shifted else x
    # The ends y = 1 and y = -1 (tested on x as torch does: x == 1 and x == 0 when shifted).
    at_plus_one = x == 1.0
    at_minus_one = x == 0.0 if shifted else x == -1.0
    sign = _parity_sign(n, dtype)

    def count(k):
        """An int64 expression converted to the dtype, as torch's arithmetic does."""
        return k.astype(dtype)

    odd_count = count(n + n + 1)
    plus_end, minus_end = {
        "t": (1.0, sign),
        "u": (count(n + 1), sign * count(n + 1)),
        "v": (1.0, sign * odd_count),
        "w": (odd_count, sign),
    }[kind]

    theta = _libm(jnp.arccos, y)
    half = count(n) + 0.5
    if kind == "t":
        closed = _libm(jnp.cos, count(n) * theta)
    elif kind == "u":
        closed = jnp.where(
            _libm(jnp.sin, theta) != 0,
            _libm(jnp.sin, count(n + 1) * theta) / _libm(jnp.sin, theta),
            count(n + 1) * _libm(jnp.cos, count(n + 1) * theta) / y,
        )
    elif kind == "v":
        closed = jnp.where(
            _libm(jnp.sin, theta / 2.0) != 1.0,
            _libm(jnp.cos, half * theta) / _libm(jnp.cos, theta / 2.0),
            sign * odd_count,
        )
    else:
        # Where cos(theta / 2) rounds to 1 (y just below 1) torch gives 2n + 1, and the
        # shifted kernel gives (-1)^n instead; both are reproduced.
        closed = jnp.where(
            _libm(jnp.cos, theta / 2.0) != 1.0,
            _libm(jnp.sin, half * theta) / _libm(jnp.sin, theta / 2.0),
            sign if shifted else odd_count,
        )
    use_closed = (n > _CHEBYSHEV_CLOSED_FORM_ABOVE[kind][shifted]) & (jnp.abs(y) < 1.0)

    p1 = _CHEBYSHEV_P1[kind](y)
    special = (n < 0) | at_plus_one | at_minus_one | use_closed
    looped = _recurrence(
        jnp.where(special, 0, n), jnp.ones_like(y), p1, lambda m, p, q: (y + y) * q - p
    )
    value = jnp.where(n == 0, 1.0, looped)
    value = jnp.where(use_closed, closed, value)
    value = jnp.where(at_minus_one, minus_end, value)
    value = jnp.where(at_plus_one, plus_end, value)
    return jnp.where(n < 0, 0.0, value)


def _hermite(x, n, physicists: bool):
    """H_n (physicists') or He_n (probabilists'); NaN above degree 128 (float32) / 512."""
    x = jnp.asarray(x)
    x, n = jnp.broadcast_arrays(x, _degree(n))
    limit = 128 if x.dtype.itemsize <= 4 else 512
    if physicists:
        p1, step = x + x, lambda m, p, q: (x + x) * q - (m + m) * p
    else:
        p1, step = x, lambda m, p, q: x * q - m * p
    special = (n < 0) | (n > limit)
    value = _recurrence(jnp.where(special, 0, n), jnp.ones_like(x), p1, step)
    value = jnp.where(n == 0, 1.0, jnp.where(n > limit, jnp.nan, value))
    return jnp.where(n < 0, 0.0, value)


def _laguerre(x, n):
    x = jnp.asarray(x)
    x, n = jnp.broadcast_arrays(x, _degree(n))

    def step(m, p, q):
        return ((m + m + (1.0 - x)) * q - m * p) / (m + 1.0)

    special = (n < 0) | (x == 0)
    value = _recurrence(jnp.where(special, 0, n), jnp.ones_like(x), 1.0 - x, step)
    value = jnp.where((n == 0) | (x == 0), 1.0, value)
    return jnp.where(n < 0, 0.0, value)


def _legendre(x, n):
    x = jnp.asarray(x)
    x, n = jnp.broadcast_arrays(x, _degree(n))

    def step(m, p, q):
        return ((m + m + 1.0) * x * q - m * p) / (m + 1.0)

    at_end = jnp.abs(x) == 1.0
    special = (n < 0) | at_end
    value = _recurrence(jnp.where(special, 0, n), jnp.ones_like(x), x, step)
    value = jnp.where(n == 0, 1.0, value)
    value = jnp.where(at_end, jnp.where(x > 0, 1.0, _parity_sign(n, x.dtype)), value)
    return jnp.where(n < 0, 0.0, value)


def _polynomial(name: str):
    """Registers a lowering of the Tensor-Tensor, Scalar-Tensor and Tensor-Scalar overloads."""
    packet = getattr(aten, name)
    return lowers(packet.default, packet.x_scalar, packet.n_scalar, promote="int_to_float")


@_polynomial("special_chebyshev_polynomial_t")
def special_chebyshev_polynomial_t(x, n):
    return _chebyshev("t", x, n, shifted=False)


@_polynomial("special_chebyshev_polynomial_u")
def special_chebyshev_polynomial_u(x, n):
    return _chebyshev("u", x, n, shifted=False)


@_polynomial("special_chebyshev_polynomial_v")
def special_chebyshev_polynomial_v(x, n):
    return _chebyshev("v", x, n, shifted=False)


@_polynomial("special_chebyshev_polynomial_w")
def special_chebyshev_polynomial_w(x, n):
    return _chebyshev("w", x, n, shifted=False)


@_polynomial("special_shifted_chebyshev_polynomial_t")
def special_shifted_chebyshev_polynomial_t(x, n):
    return _chebyshev("t", x, n, shifted=True)


@_polynomial("special_shifted_chebyshev_polynomial_u")
def special_shifted_chebyshev_polynomial_u(x, n):
    return _chebyshev("u", x, n, shifted=True)


@_polynomial("special_shifted_chebyshev_polynomial_v")
def special_shifted_chebyshev_polynomial_v(x, n):
    return _chebyshev("v", x, n, shifted=True)


@_polynomial("special_shifted_chebyshev_polynomial_w")
def special_shifted_chebyshev_polynomial_w(x, n):
    return _chebyshev("w", x, n, shifted=True)


@_polynomial("special_hermite_polynomial_h")
def special_hermite_polynomial_h(x, n):
    return _hermite(x, n, physicists=True)


@_polynomial("special_hermite_polynomial_he")
def special_hermite_polynomial_he(x, n):
    return _hermite(x, n, physicists=False)


@_polynomial("special_laguerre_polynomial_l")
def special_laguerre_polynomial_l(x, n):
    return _laguerre(x, n)


@_polynomial("special_legendre_polynomial_p")
def special_legendre_polynomial_p(x, n):
    return _legendre(x, n)


# -- incomplete gamma, Hurwitz zeta, frexp ------------------------------------------------------


@lowers(prims.igamma.default)
def igamma(self, other):
    return _incomplete_gamma(self, other, lower=True)


@lowers(prims.igammac.default)
def igammac(self, other):
    return _incomplete_gamma(self, other, lower=False)


def _incomplete_gamma(a, x, lower: bool):
    """Regularized lower (upper) incomplete gamma P(a, x) (Q(a, x)), computed in float64;
    the edges follow torch: NaN outside a, x >= 0 and at a = x = 0 or a = x = inf."""
    dtype = jnp.result_type(a, x)
    a, x = jnp.broadcast_arrays(a.astype(jnp.float64), x.astype(jnp.float64))
    value = jsp.gammainc(a, x) if lower else jsp.gammaincc(a, x)
    full, empty = (1.0, 0.0) if lower else (0.0, 1.0)
    # a = 0 (x > 0) and x = inf integrate everything; x = 0 and a = inf nothing.
    value = jnp.where(jnp.isinf(x), full, value)
    value = jnp.where(jnp.isinf(a), empty, value)
    value = jnp.where(x == 0, empty, value)
    value = jnp.where(a == 0, jnp.where(x > 0, full, jnp.nan), value)
    undefined = (x < 0) | (a < 0) | (jnp.isinf(a) & jnp.isinf(x))
    return jnp.where(undefined, jnp.nan, value).astype(dtype)


# Euler-Maclaurin coefficients (2k)! / B_2k of Cephes' zeta.
_ZETA_EULER_MACLAURIN = (
    12.0,
    -720.0,
    30240.0,
    -1209600.0,
    47900160.0,
    -1.8924375803183791606e9,
    7.47242496e10,
    -2.950130727918164224e12,
    1.1646782814350067249e14,
    -4.5979787224074726105e15,
    1.8152105401943546773e17,
    -7.1661652561756670113e18,
)
_MACHEP = 1.11022302462515654042e-16


def _hurwitz_zeta(x, q):
    """Cephes' zeta(x, q) = sum_k (q + k)^-x in float64, as torch computes it for every
    dtype: direct summation (at least 9 terms and up to q + k > 9, stopping early once a
    term is negligible), then the Euler-Maclaurin tail. A negative q needs an integer x."""
    # torch's edge cases, in its order of precedence.
    q_pole = (q <= 0) & (q == jnp.floor(q))
    q_undefined = (q <= 0) & (x != jnp.floor(x))
    edge = jnp.where(
        x == 1.0,
        jnp.inf,
        jnp.where(x < 1.0, jnp.nan, jnp.where(q_pole, jnp.inf, jnp.nan)),
    )
    is_edge = (x <= 1.0) | q_pole | q_undefined

    def summing(state):
        i, a, _, _, done = state
        return ~done & ((i < 9) | (a <= 9.0))

    def add_term(state):
        i, a, s, b, done = state
        go = summing(state)
        a2 = a + 1.0
        b2 = jnp.power(a2, -x)
        s2 = s + b2
        negligible = (-_MACHEP * s2 < b2) & (b2 < _MACHEP * s2)
        return (
            i + 1,
            jnp.where(go, a2, a),
            jnp.where(go, s2, s),
            jnp.where(go, b2, b),
            done | (go & negligible),
        )

    init = (jnp.zeros((), jnp.int64), q, jnp.power(q, -x), jnp.zeros_like(q), is_edge)
    _, a, s, b, done = lax.while_loop(lambda st: jnp.any(summing(st)), add_term, init)

    w = a
    s = jnp.where(done, s, s + b * w / (x - 1.0) - 0.5 * b)
    factor = jnp.ones_like(q)
    k = 0.0
    for coeff in _ZETA_EULER_MACLAURIN:
        factor = factor * (x + k)
        b = b / w
        t = factor * b / coeff
        s = jnp.where(done, s, s + t)
        done = done | (jnp.abs(t / s) < _MACHEP)
        factor = factor * (x + k + 1.0)
        b = b / w
        k += 2.0
    return jnp.where(is_edge, edge, s)


@lowers(prims.zeta.default)
def zeta(self, other):
    dtype = jnp.result_type(self, other)
    x, q = jnp.broadcast_arrays(self.astype(jnp.float64), other.astype(jnp.float64))
    return _hurwitz_zeta(x, q).astype(dtype)


_UINT_OF_WIDTH = {16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


@lowers(prims.frexp.default)
def frexp(self):
    """x = mantissa * 2^exponent with |mantissa| in [0.5, 1), read off the bits: XLA's CPU
    arithmetic flushes subnormals to zero, so jnp.frexp gets them wrong (exponent -149)."""
    info = jnp.finfo(self.dtype)
    uint = _UINT_OF_WIDTH[info.bits]
    bits = lax.bitcast_convert_type(self, uint)
    n_mant = info.nmant
    bias = -info.minexp + 1  # 127 for float32
    fraction_mask = uint((1 << n_mant) - 1)
    exponent_max = (1 << info.nexp) - 1
    biased = ((bits >> n_mant) & uint(exponent_max)).astype(jnp.int32)
    fraction = bits & fraction_mask
    # A subnormal's fraction f has bit length L: x = f * 2^(1 - bias - n_mant), so its
    # exponent is L + 1 - bias - n_mant and its fraction moves up to the implicit bit.
    length = info.bits - lax.clz(fraction).astype(jnp.int32)
    subnormal = biased == 0
    exponent = jnp.where(subnormal, length + 1 - bias - n_mant, biased - (bias - 1))
    shift = jnp.maximum(n_mant + 1 - length, 0).astype(uint)
    fraction = jnp.where(subnormal, (fraction << shift) & fraction_mask, fraction)
    sign = bits & ~(fraction_mask | (uint(exponent_max) << n_mant))
    mantissa_bits = sign | (uint(bias - 1) << n_mant) | fraction
    mantissa = lax.bitcast_convert_type(mantissa_bits, self.dtype)
    # Zero, inf and NaN come back unchanged with exponent 0 (tested on the bits, as a
    # flushing platform may also compare subnormals as zero).
    passthrough = (biased == exponent_max) | ((bits & ~sign) == 0)
    return jnp.where(passthrough, self, mantissa), jnp.where(passthrough, 0, exponent)
