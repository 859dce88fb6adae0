"""``_foreach_*`` ops: one elementwise op over lists of tensors.

torch's optimizers and ``clip_grad_norm_`` use them on the tpu device (it is a
"foreach" device for torch). Each list becomes one compiled function; the in-place
forms (``_foreach_add_``) are derived from these functional ones by the dispatcher.
A list argument is taken element by element, anything else is shared by all
elements, except the ``scalars`` tensor of ``addcmul``/``addcdiv`` (one value per
element).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy import special as jsp

from torchtpu import _compat
from torchtpu.ops import elementwise as ew
from torchtpu.ops import reduction
from torchtpu.ops.registry import aten, lowers
from torchtpu.ops.util import cast, opmath


def _over_lists(element, per_element_scalars: bool = False):
    """A lowering applying ``element`` to the i-th item of every list argument
    (and of the 1-d ``scalars`` tensor, argument 3, if ``per_element_scalars``)."""

    def lowering(*args):
        n = next(len(a) for a in args if isinstance(a, list))
        out = []
        for i in range(n):
            items = []
            for position, a in enumerate(args):
                if isinstance(a, list):
                    items.append(opmath(a[i]))
                elif per_element_scalars and position == 3 and getattr(a, "ndim", 0) == 1:
                    items.append(a[i])
                else:
                    items.append(opmath(a))
            out.append(element(*items))
        return out

    lowering.__name__ = f"foreach_{element.__name__}"
    return lowering


def _register(ops, element, **kwargs):
    lowers(*ops)(_over_lists(element, **kwargs))


_register(
    [
        aten._foreach_add.Scalar,
        aten._foreach_add.List,
        aten._foreach_add.ScalarList,
        aten._foreach_add.Tensor,
    ],
    ew.add,
)
_register([aten._foreach_sub.Scalar, aten._foreach_sub.List, aten._foreach_sub.ScalarList], ew.sub)
_register(
    [
        aten._foreach_mul.Scalar,
        aten._foreach_mul.List,
        aten._foreach_mul.ScalarList,
        aten._foreach_mul.Tensor,
    ],
    ew.mul,
)
_register(
    [
        aten._foreach_div.Scalar,
        aten._foreach_div.List,
        aten._foreach_div.ScalarList,
        aten._foreach_div.Tensor,
    ],
    ew.div,
)
_register(
    [aten._foreach_maximum.Scalar, aten._foreach_maximum.List, aten._foreach_maximum.ScalarList],
    ew.maximum,
)
_register(
    [aten._foreach_minimum.Scalar, aten._foreach_minimum.List, aten._foreach_minimum.ScalarList],
    ew.minimum,
)
_register(
    [
        aten._foreach_clamp_min.Scalar,
        aten._foreach_clamp_min.List,
        aten._foreach_clamp_min.ScalarList,
    ],
    ew.clamp_min,
)
_register(
    [
        aten._foreach_clamp_max.Scalar,
        aten._foreach_clamp_max.List,
        aten._foreach_clamp_max.ScalarList,
    ],
    ew.clamp_max,
)
_register(
    [aten._foreach_addcmul.Scalar, aten._foreach_addcmul.ScalarList, aten._foreach_addcmul.Tensor],
    ew.addcmul,
    per_element_scalars=True,
)
_register(
    [aten._foreach_addcdiv.Scalar, aten._foreach_addcdiv.ScalarList, aten._foreach_addcdiv.Tensor],
    ew.addcdiv,
    per_element_scalars=True,
)
_register(
    [aten._foreach_lerp.List, aten._foreach_lerp.Scalar, aten._foreach_lerp.ScalarList], ew.lerp
)
_register(
    [aten._foreach_pow.List, aten._foreach_pow.ScalarList, aten._foreach_pow.ScalarAndTensor],
    jnp.power,
)


def _pow_scalar(x, exponent):
    return (
        ew.pow_tensor_scalar(x, exponent)
        if isinstance(exponent, (int, float))
        else jnp.power(x, exponent)
    )


lowers(aten._foreach_pow.Scalar, static=("exponent",))(_over_lists(_pow_scalar))

_UNARY = {
    aten._foreach_abs.default: jnp.abs,
    aten._foreach_acos.default: jnp.arccos,
    aten._foreach_asin.default: jnp.arcsin,
    aten._foreach_atan.default: jnp.arctan,
    aten._foreach_ceil.default: jnp.ceil,
    aten._foreach_cos.default: jnp.cos,
    aten._foreach_cosh.default: jnp.cosh,
    aten._foreach_erf.default: jsp.erf,
    aten._foreach_erfc.default: jsp.erfc,
    aten._foreach_exp.default: jnp.exp,
    aten._foreach_expm1.default: jnp.expm1,
    aten._foreach_floor.default: jnp.floor,
    aten._foreach_frac.default: ew.frac,
    aten._foreach_lgamma.default: jsp.gammaln,
    aten._foreach_log.default: jnp.log,
    aten._foreach_log10.default: jnp.log10,
    aten._foreach_log1p.default: jnp.log1p,
    aten._foreach_log2.default: jnp.log2,
    aten._foreach_neg.default: ew.neg,
    aten._foreach_reciprocal.default: ew.reciprocal,
    aten._foreach_round.default: jnp.round,
    aten._foreach_rsqrt.default: lax.rsqrt,
    aten._foreach_sigmoid.default: jax.nn.sigmoid,
    aten._foreach_sign.default: ew.sign,
    aten._foreach_sin.default: jnp.sin,
    aten._foreach_sinh.default: jnp.sinh,
    aten._foreach_sqrt.default: jnp.sqrt,
    aten._foreach_tan.default: jnp.tan,
    aten._foreach_tanh.default: jnp.tanh,
    aten._foreach_trunc.default: jnp.trunc,
    aten._foreach_zero.default: jnp.zeros_like,
    aten._foreach_max.default: jnp.max,
}
for _op, _fn in _UNARY.items():
    lowers(_op)(_over_lists(_fn))


@lowers(_compat.op("aten._foreach_clone.default"))
def _foreach_clone(self, memory_format=None):
    return list(self)


@lowers(aten._foreach_copy.default)
def _foreach_copy(self, src, non_blocking=False):
    return [jnp.broadcast_to(cast(s, x.dtype), x.shape) for x, s in zip(self, src)]


@lowers(aten._foreach_norm.Scalar, static=("ord",))
def _foreach_norm(self, ord=2, dtype=None):
    return [reduction.linalg_vector_norm(x, ord) for x in self]


@lowers(aten._foreach_powsum.Scalar, static=("ord",))
def _foreach_powsum(self, ord=2, dtype=None):
    return [jnp.sum(jnp.abs(opmath(x)) ** ord) for x in self]


@lowers(_compat.op("aten._foreach_mm.default"), precision=True)
def _foreach_mm(self, mat2, *, precision):
    return [jnp.matmul(a, b, precision=precision) for a, b in zip(self, mat2)]
