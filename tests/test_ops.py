"""Ops on the tpu device against PyTorch on the CPU: values, dtypes, shapes, gradients.

Every case runs the same function on CPU tensors and on tpu copies of them. With
``grad``, the floating inputs require grad and both sides run backward from the
differentiable outputs, seeded with the same random gradients (the gradient of a
weighted sum of the outputs, so that e.g. softmax gets a gradient that is not zero),
then compare ``.grad``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

import torchtpu
from conftest import assert_same, tpu

nan, inf = math.nan, math.inf


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _randint(low, high, shape, seed=0):
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed))


def _wants_grad(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _backward(outputs):
    """Backward from every differentiable output, seeded with fixed random weights (the
    gradient of a weighted sum of the outputs) so that no gradient cancels out."""
    roots, seeds = [], []
    for i, out in enumerate(tree_flatten(outputs)[0]):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            seed = _randn(*out.shape, dtype=out.dtype, seed=100 + i)
            roots.append(out)
            seeds.append(tpu(seed) if out.device.type == "tpu" else seed)
    assert roots, "no output requires grad"
    torch.autograd.backward(roots, seeds)


def check(fn, *args, grad=False, rtol=None, atol=None):
    """``fn(*args)`` on tpu copies of the CPU tensors in ``args`` equals
    ``fn`` on the CPU tensors. ``grad``: True for every floating input, or a tuple of
    positions in ``args`` whose gradients to compare."""

    def wants(position, t):
        if grad is True:
            return _wants_grad(t)
        return bool(grad) and position in grad

    def prepare(device):
        def one(position, a):
            if not isinstance(a, torch.Tensor):
                return a
            b = a.detach().clone() if device == "cpu" else tpu(a.detach())
            return b.requires_grad_() if wants(position, a) else b

        return [tree_map(lambda a, p=p: one(p, a), v) for p, v in enumerate(args)]

    cpu_args, tpu_args = prepare("cpu"), prepare("tpu")
    expected = fn(*cpu_args)
    actual = fn(*tpu_args)
    assert_same(actual, expected, rtol=rtol, atol=atol)
    if grad:
        _backward(expected)
        _backward(actual)
        cpu_leaves = [
            a for a in tree_flatten(cpu_args)[0] if isinstance(a, torch.Tensor) and a.requires_grad
        ]
        tpu_leaves = [
            a for a in tree_flatten(tpu_args)[0] if isinstance(a, torch.Tensor) and a.requires_grad
        ]
        for c, t in zip(cpu_leaves, tpu_leaves, strict=True):
            if c.grad is None:
                assert t.grad is None
            else:
                assert_same(t.grad, c.grad, rtol=rtol, atol=atol)
    return actual, expected


def check_raises_like_cpu(fn, *args):
    """``fn`` raises on the CPU; on tpu it raises the same exception type at the
    latest when the result is read."""
    with pytest.raises(Exception) as on_cpu:
        fn(*args)
    expected = type(on_cpu.value)
    with pytest.raises(Exception) as on_tpu:
        result = fn(*[tpu(a) if isinstance(a, torch.Tensor) else a for a in args])
        tree_map(lambda r: r.cpu() if isinstance(r, torch.Tensor) else r, result)
    assert type(on_tpu.value) is expected, (
        f"{type(on_tpu.value).__name__} != {expected.__name__}: {on_tpu.value}"
    )


def _case(id, fn, *args, marks=()):
    return pytest.param(fn, args, id=id, marks=marks)


# ======================================================================================
# Type promotion
# ======================================================================================

_I = torch.tensor([7, -7, 3, -3, 0, 5], dtype=torch.int64)
_J = torch.tensor([2, 2, -2, -2, 3, -5], dtype=torch.int64)
_F = torch.tensor([7.5, -7.5, 3.0, -3.25, 0.0, 5.0])
_G = torch.tensor([2.0, 2.0, -2.0, -2.0, 3.0, -0.5])
_B = torch.tensor([True, False, True, False, True, True])
_C = torch.tensor([False, False, True, True, False, True])

PROMOTION = [
    _case("int+float_scalar", lambda a: a + 1.5, _I),
    _case("int*int_scalar", lambda a: a * 3, _I),
    _case("int32+float_scalar", lambda a: a + 1.5, _I.int()),
    _case("half*float_scalar", lambda a: a * 2.0, _F.half()),
    _case("bf16+int_scalar", lambda a: a + 3, _F.bfloat16()),
    _case("int+True", lambda a: a + True, _I),
    _case("int8+int_scalar_wraps", lambda a: a + 100, _I.to(torch.int8)),
    _case("bool+bool", lambda a, b: a + b, _B, _C),
    _case("bool*bool", lambda a, b: a * b, _B, _C),
    _case("bool+int_scalar", lambda a: a + 2, _B),
    _case("bool+float_scalar", lambda a: a + 0.5, _B),
    _case("float_scalar-int", lambda a: 2.5 - a, _I),
    _case("int/int", lambda a, b: a / b, _I, _J),
    _case("int/int_scalar", lambda a: a / 2, _I),
    _case("int_scalar/int", lambda a: 10 / a, _J),
    _case("int//int", lambda a, b: a // b, _I, _J),
    _case("int//int_scalar", lambda a: a // -2, _I),
    _case("float//float", lambda a, b: a // b, _F, _G),
    _case("div_trunc_int", lambda a, b: torch.div(a, b, rounding_mode="trunc"), _I, _J),
    _case("div_floor_int", lambda a, b: torch.div(a, b, rounding_mode="floor"), _I, _J),
    _case("div_trunc_float", lambda a, b: torch.div(a, b, rounding_mode="trunc"), _F, _G),
    _case("div_floor_float", lambda a, b: torch.div(a, b, rounding_mode="floor"), _F, _G),
    _case("div_floor_int_scalar", lambda a: torch.div(a, -2, rounding_mode="floor"), _I),
    _case("div_trunc_int_by_float_scalar", lambda a: torch.div(a, 2.5, rounding_mode="trunc"), _I),
    _case("remainder_int", lambda a, b: torch.remainder(a, b), _I, _J),
    _case("remainder_int_scalar", lambda a: a % -3, _I),
    _case("remainder_float", lambda a, b: torch.remainder(a, b), _F, _G),
    _case("remainder_scalar_tensor", lambda b: torch.remainder(7, b), _J),
    _case("fmod_int", lambda a, b: torch.fmod(a, b), _I, _J),
    _case("fmod_float", lambda a, b: torch.fmod(a, b), _F, _G),
    _case("fmod_int_scalar", lambda a: torch.fmod(a, -3), _I),
    _case("sum_int8", lambda a: a.sum(), _I.to(torch.int8)),
    _case("sum_int32_dim", lambda a: a.reshape(2, 3).sum(1), _I.int()),
    _case("sum_bool", lambda a: a.sum(), _B),
    _case("sum_int8_overflowing", lambda a: (a * 0 + 100).sum(), _I.to(torch.int8)),
    _case("sum_dtype_arg", lambda a: a.sum(dtype=torch.float64), _I.int()),
    _case("prod_int8", lambda a: (a.clamp(1, 3)).prod(), _I.to(torch.int8)),
    _case("prod_bool", lambda a: a.prod(), _B),
    _case("prod_int32_dim", lambda a: a.reshape(2, 3).prod(0), _I.int()),
    _case("cumsum_int8", lambda a: a.cumsum(0), _I.to(torch.int8)),
    _case("cumsum_bool", lambda a: a.cumsum(0), _B),
    _case("cumsum_int32", lambda a: a.cumsum(0), _I.int()),
    _case("mean_half", lambda a: a.mean(), _F.half()),
    _case("lt_int_float", lambda a, b: a < b, _I, _F),
    _case("eq_scalar", lambda a: a == 3, _I),
    _case("ge_float_scalar", lambda a: a >= 2.5, _I),
    _case("ne_bool", lambda a, b: a != b, _B, _C),
    _case("int32+int64", lambda a, b: a + b, _I.int(), _J),
    _case("int8+uint8", lambda a, b: a + b, _I.to(torch.int8), _J.abs().to(torch.uint8)),
    _case("half+float", lambda a, b: a + b, _F.half(), _G),
    _case("bf16+half", lambda a, b: a * b, _F.bfloat16(), _G.half()),
    _case("float+complex", lambda a, b: a + b, _F, torch.complex(_G, _F)),
    _case("double+complex64", lambda a, b: a * b, _F.double(), torch.complex(_G, _F)),
    _case("int+float_tensor", lambda a, b: a + b, _I, _G.double()),
    _case("0d_double+float", lambda a, b: a + b, torch.tensor(2.5, dtype=torch.float64), _F),
    _case("0d_float+int", lambda a, b: a + b, torch.tensor(2.5), _I),
    _case("0d_int64+int8", lambda a, b: a + b, torch.tensor(300), _I.to(torch.int8)),
    _case("0d_complex+float", lambda a, b: a + b, torch.tensor(1 + 2j), _F),
    _case("0d+0d", lambda a, b: a + b, torch.tensor(2.5, dtype=torch.float64), torch.tensor(3)),
    _case("where_mixed", lambda c, a, b: torch.where(c, a, b), _B, _I, _F),
    _case("maximum_mixed", lambda a, b: torch.maximum(a, b), _I.int(), _G),
    _case("pow_int_float_scalar", lambda a: a.abs() ** 0.5, _I),
    _case("pow_int_tensor", lambda a, b: a**b, _I, torch.tensor([2, 0, 1, 3, 2, 1])),
    _case("float_scalar_pow_int", lambda a: 2.0**a, _J),
    _case("bitwise_int_bool", lambda a, b: a & b, _I, _B),
    _case("clamp_int_float_bound", lambda a: a.clamp(min=-2.5), _I),
]


@pytest.mark.parametrize("fn,args", PROMOTION)
def test_type_promotion(fn, args):
    check(fn, *args)


_PROMOTION_IN_MODES = {
    "int+float_scalar",
    "half*float_scalar",
    "bool+bool",
    "int//int",
    "div_floor_int",
    "sum_int8",
    "float+complex",
    "0d_double+float",
}


@pytest.mark.parametrize("fn,args", [c for c in PROMOTION if c.id in _PROMOTION_IN_MODES])
def test_type_promotion_modes(mode, fn, args):
    check(fn, *args)


def test_cpu_scalar_tensor_operand(mode):
    x = _randn(2, 3)
    for scalar in (torch.tensor(2.5), torch.tensor(3), torch.tensor(0.5, dtype=torch.float64)):
        assert_same(tpu(x) + scalar, x + scalar)
        assert_same(scalar * tpu(x), scalar * x)
        assert_same(torch.where(tpu(x) > 0, tpu(x), scalar), torch.where(x > 0, x, scalar))
    i = _I.int()
    assert_same(tpu(i) + torch.tensor(2.5), i + torch.tensor(2.5))
    assert_same(tpu(i) * torch.tensor(2), i * torch.tensor(2))


def test_cpu_tensor_with_dims_is_rejected():
    with pytest.raises(RuntimeError, match="same device"):
        tpu(_randn(3)) + torch.ones(3)


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: a // b,
        lambda a, b: a % b,
        lambda a, b: torch.fmod(a, b),
        lambda a, b: torch.div(a, b, rounding_mode="trunc"),
        lambda a, b: torch.div(a, b, rounding_mode="floor"),
        lambda a, b: torch.remainder(a, 0),
    ],
    ids=["floordiv", "mod", "fmod", "trunc", "floor", "remainder_scalar"],
)
def test_integer_division_by_zero(mode, fn):
    check_raises_like_cpu(fn, torch.tensor([5, -3]), torch.tensor([0, 1]))


def test_float_division_by_zero_is_inf():
    check(lambda a, b: a / b, _I, torch.zeros(6, dtype=torch.int64))
    check(lambda a, b: a // b, _F, torch.zeros(6))


# ======================================================================================
# Elementwise
# ======================================================================================

_X = _randn(3, 4)
_Y = _randn(3, 4, seed=1)
_P = _X.abs() + 0.1  # positive
_U = torch.rand(3, 4, generator=torch.Generator().manual_seed(2)) * 0.8 + 0.1  # in (0, 1)

ELEMENTWISE_GRAD = [
    _case("add", lambda a, b: a + b, _X, _Y),
    _case("add_alpha", lambda a, b: torch.add(a, b, alpha=2.5), _X, _Y),
    _case("div", lambda a, b: a / b, _X, _P),
    _case("pow_scalar_2", lambda a: a**2, _X),
    _case("pow_scalar_neg_int", lambda a: a**-2, _P),
    _case("pow_scalar_half", lambda a: a**0.5, _P),
    _case("pow_scalar_float", lambda a: a**1.7, _P),
    _case("pow_negative_base_int_exp", lambda a: (-a) ** 3, _P),
    _case("pow_tensor_tensor", lambda a, b: a**b, _P, _Y),
    _case(
        "pow_negative_base_tensor_int_exp",
        lambda a, b: (-a) ** b,
        _P,
        torch.tensor([[2.0, 3.0, -1.0, 0.0]] * 3),
    ),
    _case("scalar_pow_tensor", lambda b: 2.0**b, _Y),
    _case("exp", torch.exp, _X),
    _case("log", torch.log, _P),
    _case("sqrt", torch.sqrt, _P),
    _case("rsqrt", torch.rsqrt, _P),
    _case("sin", torch.sin, _X),
    _case("cos", torch.cos, _X),
    _case("tan", torch.tan, _X),
    _case("tanh", torch.tanh, _X),
    _case("sigmoid", torch.sigmoid, _X),
    _case("erf", torch.erf, _X),
    _case("abs", torch.abs, _X),
    _case("neg", torch.neg, _X),
    _case("sign", torch.sign, _X),
    _case("clamp_scalar", lambda a: a.clamp(-0.5, 0.7), _X),
    _case("clamp_tensor", lambda a, lo, hi: a.clamp(lo, hi), _X, _Y - 1, _Y + 0.5),
    _case("clamp_min", lambda a: torch.clamp_min(a, 0.2), _X),
    _case("clamp_max", lambda a: torch.clamp_max(a, 0.2), _X),
    _case("where", lambda a, b: torch.where(a > b, a, b), _X, _Y),
    _case("masked_fill", lambda a: a.masked_fill(a > 0.5, -1.0), _X),
    _case("lerp_scalar", lambda a, b: torch.lerp(a, b, 0.3), _X, _Y),
    _case("lerp_tensor", lambda a, b, w: torch.lerp(a, b, w), _X, _Y, _U),
    _case("addcmul", lambda a, b, c: torch.addcmul(a, b, c, value=0.5), _X, _Y, _P),
    _case("addcdiv", lambda a, b, c: torch.addcdiv(a, b, c, value=-2.0), _X, _Y, _P),
    _case("maximum", torch.maximum, _X, _Y),
    _case("minimum", torch.minimum, _X, _Y),
    _case("relu", F.relu, _X),
    _case("gelu", F.gelu, _X),
    _case("gelu_tanh", lambda a: F.gelu(a, approximate="tanh"), _X),
    _case("silu", F.silu, _X),
    _case("leaky_relu", lambda a: F.leaky_relu(a, 0.2), _X),
    _case("elu", lambda a: F.elu(a, alpha=1.5), _X),
    _case("softplus", lambda a: F.softplus(a, beta=2.0, threshold=1.0), _X),
    _case("hardtanh", lambda a: F.hardtanh(a, -0.5, 0.5), _X),
    _case("hardswish", F.hardswish, _X * 3),
    _case("mish", F.mish, _X),
    _case("softshrink", lambda a: F.softshrink(a, 0.3), _X),
    _case("hardshrink", lambda a: F.hardshrink(a, 0.3), _X),
    _case("logsigmoid", F.logsigmoid, _X),
    _case("softmax", lambda a: F.softmax(a, dim=-1), _X),
    _case("log_softmax", lambda a: F.log_softmax(a, dim=1), _X),
    _case("glu", lambda a: F.glu(a, dim=-1), _X),
]


@pytest.mark.parametrize("fn,args", ELEMENTWISE_GRAD)
def test_elementwise_with_grad(fn, args):
    check(fn, *args, grad=True)


@pytest.mark.parametrize("fn,args", ELEMENTWISE_GRAD[:8])
def test_elementwise_modes(mode, fn, args):
    check(fn, *args, grad=True)


_WITH_NAN = torch.tensor([1.0, nan, -2.0, nan, inf, -inf, 0.0])
_OTHER = torch.tensor([nan, 3.0, -1.0, nan, 1.0, 2.0, -0.0])
_INTS = torch.tensor([0, 1, -1, 5, -8, 127, 3], dtype=torch.int64)
_INTS2 = torch.tensor([3, 1, 2, 0, 7, 2, 60], dtype=torch.int64)
_HALVES = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.4999, -0.2, 3.7, -3.7])

ELEMENTWISE = [
    _case("maximum_nan", torch.maximum, _WITH_NAN, _OTHER),
    _case("minimum_nan", torch.minimum, _WITH_NAN, _OTHER),
    _case("fmax_nan", torch.fmax, _WITH_NAN, _OTHER),
    _case("max_other_nan", torch.max, _WITH_NAN, _OTHER),
    _case("clamp_nan", lambda a: a.clamp(-1, 1), _WITH_NAN),
    _case("isnan", torch.isnan, _WITH_NAN),
    _case("isfinite", torch.isfinite, _WITH_NAN),
    _case("isinf", torch.isinf, _WITH_NAN),
    _case("isnan_int", torch.isnan, _INTS),
    _case("isfinite_int", torch.isfinite, _INTS),
    _case("nan_to_num", torch.nan_to_num, _WITH_NAN),
    _case("sign_nan", torch.sign, _WITH_NAN),
    _case("exp_inf", torch.exp, _WITH_NAN),
    _case("log_neg_zero", torch.log, torch.tensor([-1.0, 0.0, -0.0, 1.0])),
    _case("sqrt_neg", torch.sqrt, torch.tensor([-1.0, 0.0, 4.0])),
    _case("pow_neg_base_frac_exp", lambda a: a**0.5, torch.tensor([-4.0, 4.0, 0.0])),
    _case("pow_int_int_scalar", lambda a: a**3, _INTS),
    _case("pow_int_zero_base", lambda a: a**0, _INTS),
    _case("pow_int_tensor_tensor", lambda a, b: a**b, _INTS, _INTS2.clamp(max=5)),
    _case("pow_float_neg_int_scalar", lambda a: a**-1, _WITH_NAN),
    _case("bitwise_and", torch.bitwise_and, _INTS, _INTS2),
    _case("bitwise_or", torch.bitwise_or, _INTS, _INTS2),
    _case("bitwise_xor", torch.bitwise_xor, _INTS, _INTS2),
    _case("bitwise_not", torch.bitwise_not, _INTS),
    _case("bitwise_not_bool", torch.bitwise_not, _B),
    _case("bitwise_and_bool", lambda a, b: a & b, _B, _C),
    _case("bitwise_xor_scalar", lambda a: a ^ 5, _INTS),
    _case("bitwise_and_int8", lambda a, b: a & b, _INTS.to(torch.int8), _INTS2.to(torch.int8)),
    _case("left_shift", lambda a, b: a << b, _INTS, _INTS2),
    _case("right_shift", lambda a, b: a >> b, _INTS, _INTS2),
    _case("left_shift_scalar", lambda a: a << 2, _INTS.int()),
    _case("right_shift_scalar", lambda a: a >> 1, _INTS.to(torch.int8)),
    _case("right_shift_uint8", lambda a: a >> 3, _INTS.abs().to(torch.uint8)),
    _case("logical_and", torch.logical_and, _INTS, _INTS2),
    _case("logical_or", torch.logical_or, _F, _B),
    _case("logical_xor", torch.logical_xor, _B, _C),
    _case("logical_not", torch.logical_not, _INTS),
    _case("logical_not_float", torch.logical_not, _WITH_NAN),
    _case("floor", torch.floor, _HALVES),
    _case("ceil", torch.ceil, _HALVES),
    _case("round", torch.round, _HALVES),
    _case("trunc", torch.trunc, _HALVES),
    _case("frac", torch.frac, _HALVES),
    _case("round_decimals", lambda a: torch.round(a * 3.14159, decimals=2), _HALVES),
    _case("round_neg_decimals", lambda a: torch.round(a * 1234.5, decimals=-2), _HALVES),
    _case("floor_int", torch.floor, _INTS),
    _case("ceil_int", torch.ceil, _INTS),
    _case("round_int", torch.round, _INTS),
    _case("trunc_int", torch.trunc, _INTS),
    _case("abs_int", torch.abs, _INTS),
    _case("neg_int8", torch.neg, _INTS.to(torch.int8)),
    _case("sign_int", torch.sign, _INTS),
    _case("sign_bool", torch.sign, _B),
    _case("abs_complex", torch.abs, torch.complex(_F, _G)),
    _case("clamp_int", lambda a: a.clamp(-2, 4), _INTS),
    _case("clamp_int_tensor", lambda a, b: a.clamp(max=b), _INTS, _INTS2),
    _case("where_int", lambda c, a, b: torch.where(c, a, b), _INTS > 0, _INTS, _INTS2),
    _case("masked_fill_int", lambda a: a.masked_fill(a < 0, 99), _INTS),
    _case("masked_fill_bool", lambda a, m: a.masked_fill(m, True), _B, _C),
    _case("exp_half", torch.exp, _F.half() / 4),
    _case("sigmoid_int", torch.sigmoid, _INTS),
    _case("sqrt_int", torch.sqrt, _INTS.abs()),
    _case("relu_int", torch.relu, _INTS),
]


@pytest.mark.parametrize("fn,args", ELEMENTWISE)
def test_elementwise(fn, args):
    check(fn, *args)


def test_neg_bool_raises():
    check_raises_like_cpu(torch.neg, _B)


def test_int_pow_negative_exponent_raises():
    check_raises_like_cpu(lambda a: a**-1, _INTS)


def test_inplace_arithmetic(mode):
    def fn(a, b):
        a = a.clone()
        a.add_(b, alpha=2).mul_(0.5).clamp_(-1, 1)
        a[0].sub_(1)
        return a

    check(fn, _X, _Y, grad=True)
    i = _INTS.clone()

    def int_fn(a):
        a = a.clone()
        a += 3
        a //= 2
        a <<= 1
        return a

    check(int_fn, i)


# ======================================================================================
# Reductions
# ======================================================================================

_R = _randn(3, 4, 5)
_RI = _randint(-5, 5, (3, 4, 5))
_TIES = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, -1.0, 2.0], [nan, 1.0, nan, 5.0]])

REDUCTIONS_GRAD = [
    _case("sum", torch.sum, _R),
    _case("sum_neg_dim_keepdim", lambda a: a.sum(-1, keepdim=True), _R),
    _case("sum_dims", lambda a: a.sum((0, 2)), _R),
    _case("mean", torch.mean, _R),
    _case("mean_dims_keepdim", lambda a: a.mean((-1, 0), keepdim=True), _R),
    _case("prod_dim", lambda a: a.prod(1), _R),
    _case("amax_dims", lambda a: a.amax((0, -1)), _R),
    _case("max", torch.max, _R),
    _case("max_dim", lambda a: torch.max(a, 1), _R),
    _case("amin_keepdim", lambda a: a.amin(1, keepdim=True), _R),
    _case("min_dim_keepdim", lambda a: torch.min(a, -1, keepdim=True), _R),
    _case("var_dim_correction0", lambda a: torch.var(a, 1, correction=0), _R),
    _case("var_correction2", lambda a: torch.var(a, (0, 2), correction=2, keepdim=True), _R),
    _case("var_unbiased_false", lambda a: torch.var(a, unbiased=False), _R),
    _case("std_unbiased", lambda a: torch.std(a, -1, unbiased=True), _R),
    _case("var_mean", lambda a: torch.var_mean(a, 1, correction=0, keepdim=True), _R),
    _case("logsumexp_dims_keepdim", lambda a: torch.logsumexp(a, (0, 2), keepdim=True), _R),
    _case("vector_norm_2", lambda a: torch.linalg.vector_norm(a), _R),
    _case("vector_norm_1", lambda a: torch.linalg.vector_norm(a, 1, dim=1), _R),
    _case("vector_norm_inf", lambda a: torch.linalg.vector_norm(a, inf, dim=-1), _R),
    _case("vector_norm_0", lambda a: torch.linalg.vector_norm(a, 0, dim=(0, 1)), _R),
    _case(
        "vector_norm_3_keepdim", lambda a: torch.linalg.vector_norm(a, 3, dim=2, keepdim=True), _R
    ),
    _case("torch_norm", torch.norm, _R),
    _case("torch_norm_p1_dim", lambda a: torch.norm(a, p=1, dim=1), _R),
    _case("cumsum", lambda a: a.cumsum(1), _R),
    _case("cumprod", lambda a: a.cumprod(2), _R),
    _case("cummax", lambda a: torch.cummax(a, 1), _R),
    _case("median", torch.median, _R),
    _case("median_dim", lambda a: torch.median(a, 1), _R),
    _case("sort_descending", lambda a: torch.sort(a, -1, descending=True), _R),
    _case("topk_smallest_dim", lambda a: torch.topk(a, 3, dim=1, largest=False), _R),
    _case("kthvalue", lambda a: torch.kthvalue(a, 2, 1), _R),
]


@pytest.mark.parametrize("fn,args", REDUCTIONS_GRAD)
def test_reduction_with_grad(fn, args):
    check(fn, *args, grad=True)


@pytest.mark.parametrize("fn,args", REDUCTIONS_GRAD[:6])
def test_reduction_modes(mode, fn, args):
    check(fn, *args, grad=True)


_DUPS = torch.tensor(
    [[3.0, 1.0, 2.0, 1.0, nan, 3.0, -inf, 0.0], [nan, 1.0, 1.0, nan, 2.0, 2.0, inf, -0.0]]
)

REDUCTIONS = [
    _case("argmax", torch.argmax, _TIES),
    _case("argmax_dim_ties", lambda a: a.argmax(1), _TIES),
    _case("argmin_dim_ties", lambda a: a.argmin(1, keepdim=True), _TIES),
    _case("argmax_dim0", lambda a: a.argmax(0), _TIES),
    _case("argmax_keepdim_nodim", lambda a: torch.argmax(a, keepdim=True), _TIES),
    _case("argmin_int", lambda a: a.argmin(-1), _RI),
    _case("max_dim_ties_nan", lambda a: a.max(1), _TIES),
    _case("min_dim_ties_nan", lambda a: a.min(0), _TIES),
    _case("amax_nan", lambda a: a.amax(1), _TIES),
    _case("max_nan", torch.max, _TIES),
    _case("min_nan", torch.min, _TIES),
    _case("sum_int", lambda a: a.sum((0, -1)), _RI),
    _case("mean_dtype", lambda a: a.mean(1, dtype=torch.float64), _RI),
    _case("max_int_dim", lambda a: a.max(-1), _RI),
    _case("amin_int", lambda a: a.amin((1, 2)), _RI),
    _case("prod_int_dim", lambda a: a.prod(1), _RI),
    _case("any", torch.any, _RI > 3),
    _case("any_dim", lambda a: a.any(1), _RI > 3),
    _case("all_dim_keepdim", lambda a: a.all(-1, keepdim=True), _RI > -4),
    _case("all_float", torch.all, _R),
    _case("any_dims", lambda a: torch.any(a, dim=(0, 2)), _RI),
    _case("count_nonzero", lambda a: torch.count_nonzero(a, 1), _RI),
    _case("cumprod_int", lambda a: a.cumprod(0), _RI),
    _case("cummax_ties_nan", lambda a: torch.cummax(a, 1), _DUPS),
    _case("cummin_ties_nan", lambda a: torch.cummin(a, 1), _DUPS),
    _case("cummax_int", lambda a: torch.cummax(a, 2), _RI),
    _case("median_nan", lambda a: torch.median(a, 1), _DUPS),
    _case("median_int", lambda a: torch.median(a, -1), _RI),
    _case("nanmedian", lambda a: torch.nanmedian(a, 1), _DUPS),
    _case("sort_dups_nan", lambda a: torch.sort(a, stable=True), _DUPS),
    _case("sort_dups_nan_descending", lambda a: torch.sort(a, descending=True, stable=True), _DUPS),
    _case("sort_int_descending", lambda a: torch.sort(a, dim=1, descending=True, stable=True), _RI),
    _case("sort_bool", lambda a: torch.sort(a, stable=True), _B),
    _case("argsort_stable", lambda a: torch.argsort(a, dim=-1, stable=True), _RI),
    _case("argsort_descending", lambda a: torch.argsort(a, descending=True, stable=True), _DUPS),
    _case("topk_nan", lambda a: torch.topk(a[:, :4], 2), torch.tensor([[1.0, nan, 3.0, 2.0]])),
    _case("topk_int", lambda a: torch.topk(a.flatten(), 4, largest=False, sorted=True).values, _RI),
    _case("msort", torch.msort, _R[0]),
    _case("var_int_dtype", lambda a: torch.var(a.double(), 1), _RI),
    _case("var_single_element", lambda a: torch.var(a[:1]), _R),
    _case("std_half", lambda a: torch.std(a.half(), 1), _R),
    _case("sum_empty", lambda a: a[:, :0].sum(1), _R),
    _case("prod_empty", lambda a: a[:, :0].prod(1), _R),
    _case("amax_empty_other_dim", lambda a: a[:0].amax(1), _R),
    _case("mean_empty", lambda a: a[:, :0].mean(1), _R),
    _case("median_empty", torch.median, torch.zeros(0)),
]


@pytest.mark.parametrize("fn,args", REDUCTIONS)
def test_reduction(fn, args):
    check(fn, *args)


@pytest.mark.parametrize(
    "fn",
    [
        torch.max,
        torch.min,
        lambda a: a.max(1),
        lambda a: a.min(-1),
        lambda a: a.median(1),
        lambda a: a.nanmedian(1),
    ],
    ids=["max", "min", "max_dim", "min_dim", "median_dim", "nanmedian_dim"],
)
def test_empty_reduction_raises_like_cpu(fn):
    check_raises_like_cpu(fn, torch.zeros(2, 0))


# ======================================================================================
# Indexing
# ======================================================================================

_A = _randn(4, 5)
_IDX = torch.tensor([2, 0, 2, -1])
_IDX2 = torch.tensor([1, 4, 0, 4])
_MASK = _A > 0.2
_SRC = _randn(4, 5, seed=3)
_SCATTER_IDX = torch.tensor([[0, 1, 2, 0, 3], [1, 1, 0, 2, 0]])
_GATHER_IDX = torch.tensor([[0, 0], [1, 4], [2, 2], [3, 0]])
_UNIQUE_ROWS = torch.tensor([[0, 1, 2], [1, 2, 3]])  # scatter's set mode needs distinct targets


def _index_put(a, idx, v):
    a = a.clone()
    a[idx] = v
    return a


def _masked_assign(a, v):
    a = a.clone()
    a[a.detach() > 0.2] = v
    return a


def _t(*values):
    return torch.tensor(values)


INDEXING_GRAD = [
    _case("index", lambda a, i: a[i], _A, _IDX),
    _case("index_dim1", lambda a, i: a[:, i], _A, _IDX),
    _case("index_two", lambda a, i, j: a[i, j], _A, _IDX, _IDX2),
    _case("index_mask", lambda a, m: a[m], _A, _MASK),
    _case("index_row_mask", lambda a, m: a[m], _A, _t(True, False, True, True)),
    _case("index_put_scalar", lambda a, i: _index_put(a, i, 0.5), _A, _IDX),
    _case(
        "index_put_tensor",
        lambda a, v, i, j: _index_put(a, (i, j), v),
        _A,
        _t(1.0, 2.0, 3.0, 4.0),
        _t(2, 0, 1, -1),
        _IDX2,
    ),
    _case(
        "index_put_accumulate",
        lambda a, v, i, j: a.clone().index_put_((i, j), v, accumulate=True),
        _A,
        _t(1.0, 2.0, 3.0),
        _t(0, 2, 0),
        _t(1, 1, 1),
    ),
    _case("mask_assign_scalar", lambda a: _masked_assign(a, -3.0), _A),
    _case("gather", lambda a, i: torch.gather(a, 1, i), _A, _GATHER_IDX),
    _case("index_select", lambda a, i: torch.index_select(a, 1, i), _A, _t(4, 0, 0)),
    _case("scatter_src", lambda a, s, i: a.scatter(0, i, s), _A, _SRC[:2, :3], _UNIQUE_ROWS),
    _case(
        "scatter_add", lambda a, s, i: a.clone().scatter_add_(0, i, s), _A, _SRC[:2], _SCATTER_IDX
    ),
    _case(
        "scatter_reduce_sum",
        lambda a, s, i: a.scatter_reduce(0, i, s, "sum"),
        _A,
        _SRC[:2],
        _SCATTER_IDX,
    ),
    _case(
        "scatter_reduce_sum_exclude",
        lambda a, s, i: a.scatter_reduce(0, i, s, "sum", include_self=False),
        _A,
        _SRC[:2],
        _SCATTER_IDX,
    ),
    _case(
        "scatter_reduce_mean",
        lambda a, s, i: a.scatter_reduce(0, i, s, "mean"),
        _A,
        _SRC[:2],
        _SCATTER_IDX,
    ),
    _case(
        "scatter_reduce_mean_exclude",
        lambda a, s, i: a.scatter_reduce(0, i, s, "mean", include_self=False),
        _A,
        _SRC[:2],
        _SCATTER_IDX,
    ),
    _case(
        "scatter_reduce_amax",
        lambda a, s, i: a.scatter_reduce(0, i, s, "amax"),
        _A,
        _SRC[:2],
        _SCATTER_IDX,
    ),
    _case(
        "scatter_reduce_amax_exclude",
        lambda a, s, i: a.scatter_reduce(0, i, s, "amax", include_self=False),
        _A,
        _SRC[:2],
        _SCATTER_IDX,
    ),
    _case(
        "scatter_reduce_amin",
        lambda a, s, i: a.scatter_reduce(0, i, s, "amin"),
        _A,
        _SRC[:2],
        _SCATTER_IDX,
    ),
    _case(
        "scatter_reduce_amin_exclude",
        lambda a, s, i: a.scatter_reduce(0, i, s, "amin", include_self=False),
        _A,
        _SRC[:2],
        _SCATTER_IDX,
    ),
    _case(
        "scatter_reduce_prod",
        lambda a, s, i: a.scatter_reduce(0, i, s, "prod"),
        _A,
        _SRC[:2],
        _SCATTER_IDX,
    ),
    _case(
        "scatter_reduce_prod_exclude",
        lambda a, s, i: a.scatter_reduce(0, i, s, "prod", include_self=False),
        _A,
        _SRC[:2],
        _SCATTER_IDX,
    ),
    _case(
        "index_add_alpha",
        lambda a, s, i: a.clone().index_add_(1, i, s[:, :2], alpha=-2.0),
        _A,
        _SRC,
        _t(4, 4),
    ),
    _case("index_copy", lambda a, s, i: a.clone().index_copy_(1, i, s[:, :2]), _A, _SRC, _t(3, 0)),
    _case("index_fill", lambda a, i: a.clone().index_fill_(1, i, -1.0), _A, _t(1, 3)),
    _case("masked_fill", lambda a, m: a.masked_fill(m, 0.0), _A, _MASK),
    _case("masked_scatter", lambda a, s, m: a.masked_scatter(m, s), _A, _SRC, _MASK),
    _case("masked_select", lambda a, m: torch.masked_select(a, m), _A, _MASK),
    _case("take", lambda a, i: torch.take(a, i), _A, torch.tensor([[0, 19], [-1, 7]])),
    _case("repeat_interleave_int", lambda a: a.repeat_interleave(2, dim=0), _A),
    _case(
        "repeat_interleave_tensor", lambda a, r: a.repeat_interleave(r, dim=0), _A, _t(1, 0, 2, 3)
    ),
]


@pytest.mark.parametrize("fn,args", INDEXING_GRAD)
def test_indexing_with_grad(fn, args):
    check(fn, *args, grad=True)


@pytest.mark.parametrize("fn,args", INDEXING_GRAD[:8])
def test_indexing_modes(mode, fn, args):
    check(fn, *args, grad=True)


_V = torch.tensor([3, 1, 2, 3, 3, 0, 1, 7])
# torch deprecates scatter's reduce= with a Tensor src (its CPU kernel warns); still supported.
_LEGACY_REDUCE = pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter")

INDEXING = [
    _case(
        "scatter_value", lambda a, i: a.scatter(1, i, 9.0), _A, torch.tensor([[0], [2], [4], [1]])
    ),
    _case(
        "scatter_reduce_add_legacy",
        lambda a, s, i: a.scatter(0, i, s, reduce="add"),
        _A,
        _SRC,
        _SCATTER_IDX,
        marks=_LEGACY_REDUCE,
    ),
    _case(
        "scatter_reduce_multiply_legacy",
        lambda a, s, i: a.scatter(0, i, s, reduce="multiply"),
        _A,
        _SRC,
        _SCATTER_IDX,
        marks=_LEGACY_REDUCE,
    ),
    _case(
        "scatter_value_reduce", lambda a, i: a.scatter(0, i, 2.0, reduce="add"), _A, _SCATTER_IDX
    ),
    _case(
        "scatter_reduce_int_mean",
        lambda a, s, i: a.scatter_reduce(0, i, s, "mean"),
        _RI[0, :4],
        _RI[1, :2],
        _SCATTER_IDX,
    ),
    _case(
        "scatter_reduce_int_amax_exclude",
        lambda a, s, i: a.scatter_reduce(0, i, s, "amax", include_self=False),
        _RI[0, :4],
        _RI[1, :2],
        _SCATTER_IDX,
    ),
    _case(
        "scatter_reduce_int_mean_exclude",
        lambda a, s, i: a.scatter_reduce(0, i, s, "mean", include_self=False),
        _RI[0, :4],
        _RI[1, :2],
        _SCATTER_IDX,
    ),
    _case(
        "scatter_add_int",
        lambda z, i: z.scatter_add(0, i, torch.ones_like(i)),
        torch.zeros(8, dtype=torch.int64),
        _V,
    ),
    _case(
        "index_put_accumulate_int",
        lambda z, i, v: z.index_put_((i,), v, accumulate=True),
        torch.zeros(8, dtype=torch.int64),
        _V,
        torch.tensor(1),
    ),
    _case("index_put_bool_mask_2d", lambda a: _index_put(a, a > 0, 0), _RI),
    _case("index_int", lambda a, i, j: a[i, :, j], _RI, _t(2, 1, -1), _t(0, 4, 2)),
    _case("nonzero", torch.nonzero, _RI[0] > 0),
    _case("nonzero_float", torch.nonzero, _DUPS),
    _case("nonzero_as_tuple", lambda a: torch.nonzero(a, as_tuple=True), _RI > 2),
    _case("where_one_arg", torch.where, _RI[1]),
    _case("argwhere", torch.argwhere, _RI[0]),
    _case("unique", torch.unique, _V),
    _case(
        "unique_inverse_counts",
        lambda a: torch.unique(a, sorted=True, return_inverse=True, return_counts=True),
        _V,
    ),
    _case("unique_2d_inverse", lambda a: torch.unique(a, return_inverse=True), _RI[0]),
    _case(
        "unique_float_nan",
        lambda a: torch.unique(a, return_inverse=True, return_counts=True),
        torch.tensor([1.5, nan, -2.0, 1.5, nan, 0.0]),
    ),
    _case(
        "unique_dim",
        lambda a: torch.unique(a, dim=0, return_inverse=True, return_counts=True),
        torch.tensor([[1, 2], [0, 5], [1, 2]]),
    ),
    _case(
        "unique_consecutive",
        lambda a: torch.unique_consecutive(a, return_inverse=True, return_counts=True),
        _V,
    ),
    _case("repeat_interleave_repeats_only", torch.repeat_interleave, torch.tensor([2, 0, 3])),
    _case("bincount", torch.bincount, _V),
    _case("bincount_minlength", lambda a: torch.bincount(a, minlength=10), _V),
    _case("bincount_weights", lambda a, w: torch.bincount(a, w), _V, _randn(8)),
    _case("bincount_empty", lambda a: torch.bincount(a[:0]), _V),
    _case("masked_select_int", lambda a: a.masked_select(a > 0), _RI),
    _case("take_int", lambda a, i: a.take(i), _RI, torch.tensor([0, 59, -60])),
]


@pytest.mark.parametrize("fn,args", INDEXING)
def test_indexing(fn, args):
    check(fn, *args)


def _setitem(a, idx):
    a[idx] = 1.0
    return a


OUT_OF_RANGE = [
    _case("index", lambda a, i: a[i], _A, torch.tensor([1, 4])),
    _case("index_negative", lambda a, i: a[:, i], _A, torch.tensor([-6])),
    _case("index_put", _setitem, _A, torch.tensor([5])),
    _case(
        "index_put_accumulate",
        lambda a, i, v: a.index_put_((i,), v, accumulate=True),
        _A,
        torch.tensor([9]),
        torch.tensor(1.0),
    ),
    _case("gather", lambda a, i: a.gather(1, i), _A, torch.tensor([[5]])),
    _case("gather_negative", lambda a, i: a.gather(1, i), _A, torch.tensor([[-1]])),
    _case("index_select", lambda a, i: a.index_select(0, i), _A, torch.tensor([0, 4])),
    _case("index_select_negative", lambda a, i: a.index_select(0, i), _A, torch.tensor([-1])),
    _case("take", lambda a, i: a.take(i), _A, torch.tensor([20])),
    _case("scatter", lambda a, i: a.scatter(0, i, 1.0), _A, torch.tensor([[4]])),
    _case("scatter_add", lambda a, i: a.scatter_add(0, i, a), _A, torch.tensor([[4]])),
    _case(
        "scatter_reduce_negative",
        lambda a, i: a.scatter_reduce(0, i, a, "amax"),
        _A,
        torch.tensor([[-1]]),
    ),
    _case("index_add", lambda a, i: a.index_add(0, i, a[:1]), _A, torch.tensor([7])),
    _case("index_add_1d", lambda a, i: a[0].index_add(0, i, a[0, :1]), _A, torch.tensor([7])),
    _case("index_add_negative", lambda a, i: a.index_add(0, i, a[:1]), _A, torch.tensor([-1])),
    _case("index_copy", lambda a, i: a.index_copy(0, i, a[:1]), _A, torch.tensor([7])),
    _case("index_copy_negative", lambda a, i: a.index_copy(0, i, a[:1]), _A, torch.tensor([-1])),
    _case("index_fill", lambda a, i: a.index_fill(1, i, 0.0), _A, torch.tensor([5])),
    _case("embedding", lambda a, i: F.embedding(i, a), _A, torch.tensor([4])),
    _case("cross_entropy", lambda a, i: F.cross_entropy(a, i), _A, torch.tensor([0, 1, 2, 5])),
    _case("nll_loss", lambda a, i: F.nll_loss(a, i), _A, torch.tensor([0, 1, -2, 4])),
]


@pytest.mark.parametrize("fn,args", OUT_OF_RANGE)
def test_out_of_range_index_raises(mode, fn, args):
    check_raises_like_cpu(fn, *args)


def test_out_of_range_raises_at_next_read_in_strict_mode():
    """Strict mode defers the check of an index computed on the device: the op returns,
    the next read of any value raises. (An index uploaded from the host is checked at
    once: Note [Host copies of uploads].)"""
    x = tpu(_A)
    with torchtpu.set_eager_mode("strict"):
        x[torch.full((1,), 9, device="tpu")]
        with pytest.raises(IndexError, match="out of bounds"):
            (x + 1).cpu()


def test_out_of_range_raises_at_once_in_debug_mode():
    x = tpu(_A)
    with torchtpu.set_eager_mode("debug"), pytest.raises(IndexError, match="out of bounds"):
        x[tpu(torch.tensor([9]))]


# ======================================================================================
# Linear algebra and shape ops
# ======================================================================================

_M = _randn(3, 4)
_N = _randn(4, 5, seed=1)
_BA = _randn(2, 3, 4, seed=2)
_BB = _randn(2, 4, 5, seed=3)
_VEC = _randn(4, seed=4)

LINALG = [
    _case("mm", torch.mm, _M, _N),
    _case("bmm", torch.bmm, _BA, _BB),
    _case("matmul_1d_1d", torch.matmul, _VEC, _VEC * 2),
    _case("matmul_1d_2d", torch.matmul, _VEC, _N),
    _case("matmul_2d_1d", torch.matmul, _M, _VEC),
    _case("matmul_batched", torch.matmul, _BA, _BB),
    _case("matmul_broadcast", torch.matmul, _BA, _N),
    _case("addmm", lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0), _randn(5), _M, _N),
    _case(
        "baddbmm",
        lambda c, a, b: torch.baddbmm(c, a, b, beta=-1.0, alpha=0.5),
        _randn(2, 3, 5),
        _BA,
        _BB,
    ),
    _case("einsum_matmul", lambda a, b: torch.einsum("ij,jk->ik", a, b), _M, _N),
    _case("einsum_trace", lambda a: torch.einsum("ii->", a), _randn(4, 4)),
    _case(
        "einsum_attention",
        lambda q, k: torch.einsum("bhqd,bhkd->bhqk", q, k),
        _randn(1, 2, 3, 4),
        _randn(1, 2, 5, 4, seed=1),
    ),
    _case("outer", torch.outer, _VEC, _randn(3)),
    _case("dot", torch.dot, _VEC, _VEC + 1),
    _case(
        "tensordot",
        lambda a, b: torch.tensordot(a, b, dims=([1, 2], [0, 1])),
        _BA.permute(1, 0, 2),
        _randn(2, 4, 3),
    ),
    _case("cat", lambda a, b: torch.cat([a, b], 0), _M, _randn(2, 4)),
    _case("cat_dim1", lambda a, b: torch.cat([a, b, a], dim=-1), _M, _randn(3, 1)),
    _case("cat_empty_1d", lambda a, b: torch.cat([a, b]), _M, torch.empty(0)),
    _case("stack", lambda a, b: torch.stack([a, b]), _M, _M * 2),
    _case("pad_constant", lambda a: F.pad(a, (1, 2, 0, 1), value=0.5), _BA),
    _case("pad_reflect", lambda a: F.pad(a, (2, 1), mode="reflect"), _BA),
    _case("pad_replicate", lambda a: F.pad(a, (3, 1), mode="replicate"), _BA),
    _case("repeat", lambda a: a.repeat(2, 1, 3), _M),
    _case("tile", lambda a: torch.tile(a, (2,)), _M),
    _case("flip", lambda a: torch.flip(a, (0, -1)), _BA),
    _case("roll_multi", lambda a: torch.roll(a, (1, -1), (0, 2)), _BA),
    _case("tril", lambda a: torch.tril(a, -1), _BA),
    _case("triu", lambda a: torch.triu(a, 1), _M),
    _case("diag_embed", lambda a: torch.diag_embed(a, offset=-1, dim1=0, dim2=2), _M),
]


@pytest.mark.parametrize("fn,args", LINALG)
def test_linalg_and_shape(fn, args):
    check(fn, *args, grad=True)


@pytest.mark.parametrize("fn,args", LINALG[:3])
def test_linalg_modes(mode, fn, args):
    check(fn, *args, grad=True)


def test_linalg_integer_and_half():
    a, b = _randint(-3, 3, (3, 4)), _randint(-3, 3, (4, 2), seed=1)
    check(torch.mm, a, b)
    check(torch.matmul, a.int(), b.int())
    # float16 products accumulate in float32 on both sides, then round once.
    check(torch.mm, _M.half(), _N.half())
    check(lambda x: torch.cat([x, x.int()]), a)
    check(lambda x: torch.stack([x, x]).sum(0), _B)


def test_batched_products_plus_a_bias_round_bfloat16_once():
    """baddbmm and addbmm of 16-bit floats add the bias to the float32 accumulator
    before their one rounding: where product and bias nearly cancel, rounding the
    product first loses the bias's digits. baddbmm then equals the CPU's exactly.
    The CPU's addbmm rounds after each batch's addmm: its partial sums (up to ~20 here,
    where a bfloat16 step is 0.125) each lose up to half a step, four times."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 16, 32, generator=g).bfloat16()
    b = torch.randn(4, 32, 8, generator=g).bfloat16()
    products = torch.bmm(a.float(), b.float())
    noise = torch.randn(4, 16, 8, generator=g) * 0.01
    bias = (noise - products).bfloat16()  # bias + product: about the noise
    assert torch.equal(torch.baddbmm(bias.to("tpu"), a.to("tpu"), b.to("tpu")).cpu(),
                       torch.baddbmm(bias, a, b))  # fmt: skip
    bias = (noise[0] - products.sum(0)).bfloat16()
    ours = torch.addbmm(bias.to("tpu"), a.to("tpu"), b.to("tpu")).cpu()
    exact = (products.sum(0) + bias.float()).bfloat16()
    assert torch.equal(ours, exact)
    torch.testing.assert_close(ours, torch.addbmm(bias, a, b), rtol=0, atol=0.25)


# ======================================================================================
# Neural-network ops
# ======================================================================================

_IMG = _randn(2, 4, 6, 7)
_VOL = _randn(1, 2, 4, 5, 4)
_SEQ = _randn(2, 4, 9)

CONV = [
    _case(
        "conv1d_stride_pad_dil",
        lambda x, w: F.conv1d(x, w, stride=2, padding=2, dilation=2),
        _SEQ,
        _randn(3, 4, 3),
    ),
    _case(
        "conv1d_groups",
        lambda x, w: F.conv1d(x, w, groups=2, padding="same"),
        _SEQ,
        _randn(6, 2, 3),
    ),
    _case(
        "conv2d", lambda x, w, b: F.conv2d(x, w, b, padding=1), _IMG, _randn(3, 4, 3, 3), _randn(3)
    ),
    _case(
        "conv2d_stride_dil",
        lambda x, w: F.conv2d(x, w, stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
        _IMG,
        _randn(5, 4, 3, 2),
    ),
    _case(
        "conv2d_groups",
        lambda x, w, b: F.conv2d(x, w, b, groups=4),
        _IMG,
        _randn(8, 1, 3, 3),
        _randn(8),
    ),
    _case(
        "conv3d",
        lambda x, w, b: F.conv3d(x, w, b, padding=1, stride=(1, 2, 1)),
        _VOL,
        _randn(3, 2, 3, 3, 2),
        _randn(3),
    ),
    _case(
        "conv_transpose1d",
        lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2, padding=1, output_padding=1),
        _SEQ,
        _randn(4, 3, 3),
        _randn(3),
    ),
    _case(
        "conv_transpose2d_groups_dil",
        lambda x, w, b: F.conv_transpose2d(
            x, w, b, stride=(2, 3), groups=2, dilation=2, output_padding=(1, 0)
        ),
        _IMG,
        _randn(4, 3, 2, 3),
        _randn(6),
    ),
    _case(
        "conv_transpose3d",
        lambda x, w: F.conv_transpose3d(
            x, w, stride=2, padding=(0, 1, 1), output_padding=(1, 0, 1)
        ),
        _VOL,
        _randn(2, 3, 2, 3, 3),
    ),
]


@pytest.mark.parametrize("fn,args", CONV)
def test_conv(fn, args):
    check(fn, *args, grad=True)


def test_conv_modes(mode):
    check(
        lambda x, w, b: F.conv2d(x, w, b, padding=1), _IMG, _randn(3, 4, 3, 3), _randn(3), grad=True
    )


POOL = [
    _case("max_pool2d_ceil", lambda x: F.max_pool2d(x, 2, stride=2, ceil_mode=True), _IMG),
    _case(
        "max_pool2d_ceil_pad",
        lambda x: F.max_pool2d(x, 3, stride=2, padding=1, ceil_mode=True),
        _IMG,
    ),
    _case(
        "max_pool2d_dilation",
        lambda x: F.max_pool2d(x, (2, 3), stride=1, dilation=(2, 1), padding=(1, 1)),
        _IMG,
    ),
    _case("max_pool2d_indices", lambda x: F.max_pool2d(x, 2, return_indices=True), _IMG),
    _case("avg_pool2d", lambda x: F.avg_pool2d(x, 2), _IMG),
    _case(
        "avg_pool2d_pad_include",
        lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=True),
        _IMG,
    ),
    _case(
        "avg_pool2d_pad_exclude",
        lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False),
        _IMG,
    ),
    _case(
        "avg_pool2d_ceil_pad_include",
        lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True),
        _IMG,
    ),
    _case(
        "avg_pool2d_ceil_pad_exclude",
        lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
        _IMG,
    ),
    _case("avg_pool2d_divisor", lambda x: F.avg_pool2d(x, 2, padding=1, divisor_override=3), _IMG),
    _case(  # EfficientNet's head: a kernel far larger than the input, ceil_mode
        "avg_pool2d_kernel_past_input",
        lambda x: F.avg_pool2d(x, 40, ceil_mode=True),
        _IMG,
    ),
    _case("adaptive_avg_pool2d", lambda x: F.adaptive_avg_pool2d(x, (4, 3)), _IMG),
    _case("adaptive_avg_pool2d_up", lambda x: F.adaptive_avg_pool2d(x, (5, 9)), _IMG),
    _case("adaptive_max_pool2d", lambda x: F.adaptive_max_pool2d(x, (4, 3)), _IMG),
]


@pytest.mark.parametrize("fn,args", POOL)
def test_pool(fn, args):
    check(fn, *args, grad=True)


def test_avg_pool_program_does_not_grow_with_the_kernel():
    """Average pooling is one reduce_window: stacking a slice per window offset made
    EfficientNet's 320 x 320 pooling of a 1 x 1 map a program of ~10^5 slices that took
    minutes to compile."""
    import jax

    from torchtpu.ops import TABLE

    def size(kernel):
        fn = TABLE[torch.ops.aten.avg_pool2d.default].fn
        x = jax.numpy.ones((1, 4, 3, 3))
        return len(jax.make_jaxpr(lambda a: fn(a, [kernel, kernel], [], [0, 0], True))(x).eqns)

    assert size(320) == size(3)


def test_max_pool_ties_and_nan():
    x = torch.tensor(
        [
            [
                [
                    [1.0, 1.0, 2.0, nan],
                    [1.0, 0.0, 2.0, 3.0],
                    [-inf, -inf, 5.0, 5.0],
                    [-inf, -inf, 5.0, 4.0],
                ]
            ]
        ]
    )
    check(lambda a: F.max_pool2d(a, 2, return_indices=True), x)


def _batch_norm(training):
    def fn(x, w, b, running_mean, running_var):
        out = F.batch_norm(
            x, running_mean, running_var, w, b, training=training, momentum=0.3, eps=1e-3
        )
        return out, running_mean, running_var

    return fn


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_batch_norm(training):
    stats = (_randn(4, seed=7), _randn(4, seed=8).abs() + 0.5)
    check(_batch_norm(training), _IMG, _randn(4, seed=5), _randn(4, seed=6), *stats, grad=(0, 1, 2))


def test_batch_norm_module(mode):
    def fn(x):
        torch.manual_seed(0)
        bn = torch.nn.BatchNorm1d(4).to(x.device)
        y = bn(x) * 2
        bn.eval()
        z = bn(x)
        return y, z, bn.running_mean, bn.running_var, bn.num_batches_tracked

    check(fn, _SEQ, grad=True)


NORM = [
    _case(
        "batch_norm_no_stats",
        lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
        _SEQ,
        _randn(4),
        _randn(4, seed=1),
    ),
    _case(
        "layer_norm",
        lambda x, w, b: F.layer_norm(x, (9,), w, b),
        _SEQ,
        _randn(9),
        _randn(9, seed=1),
    ),
    _case(
        "layer_norm_2d",
        lambda x, w, b: F.layer_norm(x, (4, 9), w, b, eps=1e-3),
        _SEQ,
        _randn(4, 9),
        _randn(4, 9, seed=1),
    ),
    _case(
        "group_norm", lambda x, w, b: F.group_norm(x, 2, w, b), _IMG, _randn(4), _randn(4, seed=1)
    ),
    _case(
        "group_norm_3d",
        lambda x, w, b: F.group_norm(x, 1, w, b),
        _VOL,
        _randn(2),
        _randn(2, seed=1),
    ),
]


@pytest.mark.parametrize("fn,args", NORM)
def test_norm(fn, args):
    check(fn, *args, grad=True)


EMBEDDING = [
    _case(
        "embedding",
        lambda w, i: F.embedding(i, w),
        _randn(6, 3),
        torch.tensor([[0, 2, 5], [2, 2, 1]]),
    ),
    _case(
        "embedding_padding_idx",
        lambda w, i: F.embedding(i, w, padding_idx=2),
        _randn(6, 3),
        torch.tensor([[0, 2, 5], [2, 2, 1]]),
    ),
    _case(
        "embedding_max_norm",
        lambda w, i: F.embedding(i, w, max_norm=1.5),
        _randn(6, 3) * 2,
        torch.tensor([[0, 2, 5], [2, 2, 1]]),
    ),
    _case(
        "embedding_scale_grad",
        lambda w, i: F.embedding(i, w, scale_grad_by_freq=True),
        _randn(6, 3),
        torch.tensor([0, 0, 0, 1]),
    ),
]


@pytest.mark.parametrize("fn,args", EMBEDDING)
def test_embedding(fn, args):
    check(fn, *args, grad=(0,))


def test_dropout(mode):
    check(lambda x: F.dropout(x, p=0.0, training=True), _X, grad=True)
    check(lambda x: F.dropout(x, p=0.5, training=False), _X, grad=True)

    def module(x):
        layer = torch.nn.Dropout(0.7).eval()
        return layer(x)

    check(module, _X, grad=True)
    check(lambda x: F.dropout2d(x, p=0.3, training=False), _IMG, grad=True)


# -- losses ----------------------------------------------------------------------------------

_LOGITS = _randn(5, 4)
_TARGET = torch.tensor([0, 3, 1, 3, 2])
_TARGET_IGNORE = torch.tensor([0, -100, 1, 3, 2])
_CLASS_W = torch.tensor([0.5, 1.0, 2.0, 0.25])
_PROBS = F.softmax(_randn(5, 4, seed=9), dim=1)
_LOGITS_2D = _randn(2, 4, 3, 3)
_TARGET_2D = _randint(0, 4, (2, 3, 3))

LOSSES = [
    _case("ce", lambda x, t: F.cross_entropy(x, t), _LOGITS, _TARGET),
    _case(
        "ce_none_ignore",
        lambda x, t: F.cross_entropy(x, t, reduction="none"),
        _LOGITS,
        _TARGET_IGNORE,
    ),
    _case(
        "ce_weight_ignore_sum",
        lambda x, t, w: F.cross_entropy(x, t, weight=w, ignore_index=3, reduction="sum"),
        _LOGITS,
        _TARGET,
        _CLASS_W,
    ),
    _case(
        "ce_label_smoothing_weight_ignore",
        lambda x, t, w: F.cross_entropy(x, t, weight=w, label_smoothing=0.2),
        _LOGITS,
        _TARGET_IGNORE,
        _CLASS_W,
    ),
    _case("ce_probs", lambda x, t: F.cross_entropy(x, t), _LOGITS, _PROBS),
    _case(
        "ce_probs_smoothing",
        lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1, reduction="sum"),
        _LOGITS,
        _PROBS,
    ),
    _case("nll", lambda x, t: F.nll_loss(x, t), F.log_softmax(_LOGITS, 1), _TARGET),
    _case(
        "nll_weight_sum",
        lambda x, t, w: F.nll_loss(x, t, weight=w, reduction="sum"),
        _LOGITS,
        _TARGET_IGNORE,
        _CLASS_W,
    ),
    _case("nll_2d", lambda x, t, w: F.nll_loss(x, t, weight=w), _LOGITS_2D, _TARGET_2D, _CLASS_W),
    _case("mse", F.mse_loss, _X, _Y),
    _case("l1", F.l1_loss, _X, _Y),
    _case("smooth_l1", F.smooth_l1_loss, _X * 2, _Y),
    _case(
        "smooth_l1_beta", lambda x, t: F.smooth_l1_loss(x, t, beta=0.5, reduction="sum"), _X * 2, _Y
    ),
    _case("huber", F.huber_loss, _X * 2, _Y),
    _case("huber_delta", lambda x, t: F.huber_loss(x, t, delta=0.3, reduction="none"), _X * 2, _Y),
    _case("bce", F.binary_cross_entropy, _U, _U.flip(0)),
    _case("bce_weight", lambda x, t, w: F.binary_cross_entropy(x, t, weight=w), _U, _U.flip(0), _P),
    _case(
        "bce_sum_hard_targets",
        lambda x, t: F.binary_cross_entropy(x, t, reduction="sum"),
        _U,
        (_X > 0).float(),
    ),
    _case("bce_logits", F.binary_cross_entropy_with_logits, _X * 3, _U),
    _case(
        "bce_logits_pos_weight",
        lambda x, t, p: F.binary_cross_entropy_with_logits(x, t, pos_weight=p),
        _X * 3,
        _U,
        _P[0],
    ),
    _case(
        "bce_logits_weight_sum",
        lambda x, t, w, p: F.binary_cross_entropy_with_logits(
            x, t, weight=w, pos_weight=p, reduction="sum"
        ),
        _X * 3,
        _U,
        _P,
        _P[0] + 1,
    ),
    _case(
        "kl_div",
        lambda x, t: F.kl_div(x, t, reduction="batchmean"),
        F.log_softmax(_X, 1),
        F.softmax(_Y, 1),
    ),
    _case(
        "kl_div_log_target",
        lambda x, t: F.kl_div(x, t, reduction="sum", log_target=True),
        F.log_softmax(_X, 1),
        F.log_softmax(_Y, 1),
    ),
    _case(
        "kl_div_none_zero_target",
        lambda x, t: F.kl_div(x, t, reduction="none"),
        F.log_softmax(_X, 1),
        torch.tensor([[0.0, 0.5, 0.5, 0.0]] * 3),
    ),
    # Each row's targets end at its first -1 (torch's own decomposition gets it wrong).
    _case(
        "multilabel_margin",
        lambda x, t: F.multilabel_margin_loss(x, t, reduction="none"),
        _X,
        torch.tensor([[2, 1, -1, 0], [3, -1, 1, 1], [0, 1, 2, 3]]),
    ),
    _case(
        "multilabel_margin_one_sample",
        lambda x, t: F.multilabel_margin_loss(x, t, reduction="sum"),
        _X[0],
        torch.tensor([1, -1, 3, 3]),
    ),
    _case(
        "multi_margin_p2_weight",
        lambda x, t, w: F.multi_margin_loss(x, t, p=2, margin=0.7, weight=w, reduction="none"),
        _X,
        torch.tensor([1, 0, 3]),
        _P[0] + 1,
    ),
    _case(
        "multi_margin_one_sample",
        lambda x, t: F.multi_margin_loss(x, t, reduction="none"),
        _X[0],
        torch.tensor(2),
    ),
]

# Gradients of the input (and of float targets where torch defines them).
_TARGET_GRADS = {"mse", "l1", "smooth_l1", "huber", "ce_probs", "kl_div", "kl_div_log_target"}


@pytest.mark.parametrize("fn,args", LOSSES)
def test_loss(request, fn, args):
    name = request.node.callspec.id
    check(fn, *args, grad=(0, 1) if name in _TARGET_GRADS else (0,))


def test_loss_modes(mode):
    check(
        lambda x, t, w: F.cross_entropy(x, t, weight=w, label_smoothing=0.1),
        _LOGITS,
        _TARGET_IGNORE,
        _CLASS_W,
        grad=(0,),
    )


# -- attention and interpolation --------------------------------------------------------------

_Q = _randn(2, 2, 3, 4)
_K = _randn(2, 2, 5, 4, seed=1)
_VV = _randn(2, 2, 5, 4, seed=2)
_BOOL_MASK = _randn(3, 5, seed=3) > -0.5
_FLOAT_MASK = _randn(2, 1, 3, 5, seed=4)

ATTENTION = [
    _case("sdpa", F.scaled_dot_product_attention, _Q, _K, _VV),
    _case(
        "sdpa_bool_mask",
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
        _Q,
        _K,
        _VV,
        _BOOL_MASK,
    ),
    _case(
        "sdpa_float_mask",
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
        _Q,
        _K,
        _VV,
        _FLOAT_MASK,
    ),
    _case(
        "sdpa_causal",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        _Q,
        _K,
        _VV,
    ),
    _case(
        "sdpa_causal_square",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
        _K,
        _K * 2,
        _VV,
    ),
    _case(
        "sdpa_dropout0",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.0),
        _Q,
        _K,
        _VV,
    ),
]


def test_attention_modes(mode):
    check(
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
        _Q,
        _K,
        _VV,
        _BOOL_MASK,
        grad=True,
    )


_GQA_Q = _randn(2, 4, 3, 4)
_MASKED_ROW = _BOOL_MASK.clone()
_MASKED_ROW[1] = False  # a query that sees nothing: zeros, as torch's math path gives

ATTENTION += [
    # a query broadcast over the key's batch: torch's math path (the op reduces nothing)
    _case("sdpa_broadcast_query", F.scaled_dot_product_attention, _Q[0], _K, _VV),
    # float64 accumulates in float64 (on a TPU it runs on the host)
    _case(
        "sdpa_float64_causal",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        _Q.double(),
        _K.double(),
        _VV.double(),
    ),
    _case(
        "sdpa_gqa_causal",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        _GQA_Q,
        _K,
        _VV,
    ),
    _case(
        "sdpa_masked_row",
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
        _Q,
        _K,
        _VV,
        _MASKED_ROW,
    ),
]


@pytest.mark.parametrize("fn,args", ATTENTION)
def test_attention(fn, args):
    check(fn, *args, grad=True)


def test_attention_is_one_op_in_the_inputs_dtype():
    """ops/attention.py: bfloat16 attention stays bfloat16 (float32 only inside), and
    autograd saves q, k and v -- not torch's math path's float32 copies of them and its
    float32 [B, H, L, S] probabilities."""
    q, k, v = (tpu(t.bfloat16()).requires_grad_() for t in (_Q, _K, _VV))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torchtpu.reset_metrics()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torchtpu.metrics()["ops"] == {"strict": 1}
    assert out.dtype == torch.bfloat16
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [
        (torch.bfloat16, tuple(x.shape)) for x in (q, k, v)
    ]
    out.sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16


def test_bfloat16_attention_is_as_accurate_as_the_cpus():
    """Against float64, bfloat16 attention on tpu (bfloat16 products, float32 softmax
    and accumulation) errs about as much as torch's CPU kernels do: values and
    gradients both within a bfloat16 rounding or two, so they differ from each other
    by that too (beyond assert_same's bfloat16 atol for values near 0)."""

    def run(device, dtype):
        q, k, v = (t.to(dtype).to(device).requires_grad_() for t in (_Q, _K, _VV))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(_randn(*out.shape, seed=5).to(dtype).to(device))
        return [t.detach().cpu().double() for t in (out, q.grad, k.grad, v.grad)]

    truth, cpu, on_tpu = (
        run("cpu", torch.float64),
        run("cpu", torch.bfloat16),
        run("tpu", torch.bfloat16),
    )
    for exact, c, t in zip(truth, cpu, on_tpu):
        assert (t - exact).abs().max() <= 2 * (c - exact).abs().max() + 1e-3


def test_attention_with_dropout_or_a_learned_mask_takes_torchs_path():
    # A mask that requires a gradient (a learned bias) gets it, through torch's math path.
    check(
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
        _Q,
        _K,
        _VV,
        _FLOAT_MASK,
        grad=True,
    )
    q, k, v = (tpu(t) for t in (_Q, _K, _VV))
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert out.shape == _Q.shape and out.isfinite().all()


@pytest.mark.parametrize(
    "kwargs",
    [dict(is_causal=True), dict(attn_mask=_BOOL_MASK), dict(attn_mask=_MASKED_ROW)],
    ids=["causal", "bool_mask", "masked_row"],
)
def test_attention_gradients_under_torch_compile(kwargs):
    # a TPU torch.compile backend of another stack gave NaN gradients here (issue 34)
    def attend(q, k, v, mask=None):
        extra = {} if mask is None else {"attn_mask": mask}
        return F.scaled_dot_product_attention(q, k, v, is_causal="is_causal" in kwargs, **extra)

    mask = kwargs.get("attn_mask")
    compiled = torch.compile(attend, backend="tpu", fullgraph=True)
    cpu = [t.clone().requires_grad_() for t in (_Q, _K, _VV)]
    ours = [tpu(t).requires_grad_() for t in (_Q, _K, _VV)]
    expected = attend(*cpu, mask)
    actual = compiled(*ours, None if mask is None else tpu(mask))
    assert_same(actual, expected)
    expected.square().sum().backward()
    actual.square().sum().backward()
    for t, c in zip(ours, cpu):
        assert_same(t.grad, c.grad)


def test_attention_dropout_is_reproducible(mode):
    q, k, v = (tpu(t) for t in (_Q, _K, _VV))

    def draw():
        torch.manual_seed(7)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5).cpu()

    first, again = draw(), draw()
    assert torch.equal(first, again)
    # dropout zeroes weights and scales the rest by 2: the output is not the plain one
    assert not torch.allclose(first, F.scaled_dot_product_attention(_Q, _K, _VV))


def test_attention_refuses_what_torch_refuses():
    check_raises_like_cpu(F.scaled_dot_product_attention, _Q, _K[..., :3], _VV)
    check_raises_like_cpu(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_BOOL_MASK[:2]),
        _Q,
        _K,
        _VV,
    )


INTERPOLATE = [
    _case("nearest", lambda x: F.interpolate(x, size=(9, 5), mode="nearest"), _IMG),
    _case("nearest_scale", lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), _IMG),
    _case("bilinear", lambda x: F.interpolate(x, size=(9, 5), mode="bilinear"), _IMG),
    _case(
        "bilinear_align",
        lambda x: F.interpolate(x, size=(9, 5), mode="bilinear", align_corners=True),
        _IMG,
    ),
    _case(
        "bilinear_down_align",
        lambda x: F.interpolate(x, size=(3, 3), mode="bilinear", align_corners=True),
        _IMG,
    ),
]


@pytest.mark.parametrize("fn,args", INTERPOLATE)
def test_interpolate(fn, args):
    check(fn, *args, grad=True)


# ======================================================================================
# Ops Hugging Face models use (tests/models)
# ======================================================================================

_OFFS = torch.tensor([3, 4, 8], dtype=torch.int32)  # groups of 3, 1 and 4; one may be empty
GROUPED_MM = [
    # torch's CPU kernel needs 16-byte aligned strides: sizes are multiples of 4.
    _case(
        "rows", lambda a, b, o: torch._grouped_mm(a, b, o), _randn(8, 4), _randn(3, 4, 12), _OFFS
    ),
    _case("shared", lambda a, b, o: torch._grouped_mm(a, b, o), _randn(4, 8), _randn(8, 12), _OFFS),
    _case(
        "columns", lambda a, b, o: torch._grouped_mm(a, b, o), _randn(3, 4, 4), _randn(4, 8), _OFFS
    ),
    _case("batched", lambda a, b: torch._grouped_mm(a, b), _randn(3, 4, 8), _randn(3, 8, 4)),
    _case(
        "empty_group",
        lambda a, b, o: torch._grouped_mm(a, b, o),
        _randn(8, 4),
        _randn(3, 4, 4),
        torch.tensor([3, 3, 8], dtype=torch.int32),
    ),
]


@pytest.mark.parametrize("fn,args", GROUPED_MM)
def test_grouped_mm(fn, args):
    # Mixture-of-experts layers (mixtral, qwen3_moe); backward uses the other layouts.
    check(fn, *args, grad=True, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "values, options",
    [
        (torch.randn(1000, generator=torch.Generator().manual_seed(0)), {}),
        (torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e20, {"bins": 13}),
        (
            torch.randn(300, generator=torch.Generator().manual_seed(1)),
            {"bins": 10, "min": -1, "max": 1},
        ),
        (
            torch.randn(300, generator=torch.Generator().manual_seed(1)),
            {"bins": 5, "min": 0.3, "max": 0.3},
        ),
        (torch.tensor([1.0, 1.0, 1.0]), {"bins": 4}),
        (torch.tensor([0.0, 1.0, float("nan"), 2.0, 3.0]), {"bins": 3, "min": 0, "max": 3}),
        (torch.linspace(0, 1, 101), {"bins": 10, "min": 0, "max": 1}),
        (torch.empty(0), {"bins": 4, "min": 2, "max": 2}),
    ],
)
def test_histc_edges_and_bounds(values, options, mode):
    """histc computes in the input's dtype (float64 would send it to the host on a
    TPU): every value lands in the CPU's bin, the last edge and NaN included."""
    assert_same(torch.histc(tpu(values), **options), torch.histc(values, **options), rtol=0, atol=0)


@pytest.mark.parametrize("options", [{"min": 1, "max": 0}, {"min": 0, "max": float("inf")}])
def test_histc_refuses_bounds_as_the_cpu(options):
    x = torch.randn(10)
    with pytest.raises(RuntimeError) as cpu:
        torch.histc(x, **options)
    with pytest.raises(RuntimeError) as on_tpu:
        torch.histc(tpu(x), **options)
    assert str(on_tpu.value).startswith(str(cpu.value))


def test_histc_integer_input():
    # torch's CPU kernel refuses integer input; CUDA's bins it, and Hugging Face's MoE
    # routing relies on that off the CPU. Same counts as histc of the float values.
    experts = _randint(0, 4, (20,))
    for dtype in (torch.int32, torch.int64):
        expected = torch.histc(experts.float(), bins=4, min=0, max=3).to(dtype)
        assert_same(torch.histc(tpu(experts.to(dtype)), bins=4, min=0, max=3), expected)
        # min == max: the data's extremes
        expected = torch.histc(experts.float(), bins=3).to(dtype)
        assert_same(torch.histc(tpu(experts.to(dtype)), bins=3), expected)


@pytest.mark.parametrize("dim", [0, 2])
def test_weight_norm_backward(dim):
    # wav2vec2's positional convolution: torch.nn.utils.parametrizations.weight_norm.
    v = _randn(4, 3, 5)
    g = _randn(*[size if d == dim else 1 for d, size in enumerate(v.shape)], seed=1)
    check(lambda v, g: torch._weight_norm(v, g, dim), v, g, grad=True, rtol=1e-5, atol=1e-5)


def _ctc_inputs(seed=0):
    # (T, N, C) log-probabilities; padded targets with a repeated label (a blank must
    # separate the two), inputs and targets shorter than the padded sizes.
    log_probs = F.log_softmax(_randn(12, 3, 5, seed=seed), dim=-1)
    targets = torch.tensor([[1, 2, 2, 3], [4, 1, 0, 0], [3, 3, 3, 0]])
    return log_probs, targets, torch.tensor([12, 9, 6]), torch.tensor([4, 2, 3])


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_ctc_loss(reduction):
    # wav2vec2 / hubert CTC heads. The 3rd sample needs 6 steps for 3 repeated labels.
    def loss(lp, t, il, tl):
        return F.ctc_loss(lp, t, il, tl, reduction=reduction, zero_infinity=True)

    check(loss, *_ctc_inputs(), grad=(0,), rtol=1e-5, atol=1e-5)


def test_ctc_loss_concatenated_targets_and_infinite():
    # 1-d targets; the 2nd sample cannot be aligned (3 labels in 2 steps): inf, and
    # zero_infinity gives 0 loss and 0 gradient.
    log_probs = F.log_softmax(_randn(6, 2, 4, seed=2), dim=-1)
    targets, input_lengths, target_lengths = (
        torch.tensor([1, 2, 3, 1, 2]),
        torch.tensor([6, 2]),
        torch.tensor([2, 3]),
    )
    inputs = (log_probs, targets, input_lengths, target_lengths)
    for zero_infinity in (False, True):
        check(
            lambda *a, z=zero_infinity: F.ctc_loss(*a, reduction="none", zero_infinity=z), *inputs
        )
    summed = lambda *a: F.ctc_loss(*a, reduction="sum", zero_infinity=True)  # noqa: E731
    check(summed, *inputs, grad=(0,), rtol=1e-5, atol=1e-5)


def test_ctc_loss_with_lengths_as_lists():
    log_probs, targets, input_lengths, target_lengths = _ctc_inputs()
    lengths = (tuple(input_lengths.tolist()), tuple(target_lengths.tolist()))
    check(
        lambda lp, t: F.ctc_loss(lp, t, *lengths),
        log_probs,
        targets,
        grad=(0,),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize(
    "shape,kernel,output",
    [
        ((2, 3, 9, 11), (2, 3), (4, 5)),
        ((3, 9, 11), (3, 2), (5, 4)),
        ((1, 2, 5, 5), (2, 2), (1, 1)),
        ((0, 1, 4, 5, 4), (2, 2, 1), (2, 2, 2)),
        ((2, 3, 7, 8, 9), (2, 3, 2), (3, 4, 5)),
        ((3, 7, 8, 9), (2, 2, 3), (4, 4, 4)),
    ],
)
def test_fractional_max_pool_given_samples(shape, kernel, output):
    # F.fractional_max_pool* draw their samples from the device's generator; with the
    # same samples the aten op is deterministic, NaN and ties included.
    n = len(kernel)
    op = getattr(torch.ops.aten, f"fractional_max_pool{n}d").default
    x = _randn(*shape)
    x.view(-1)[:1] = nan
    planes = (shape[0] if len(shape) == n + 2 else 1, shape[-n - 1])
    samples = torch.rand(planes + (n,), generator=torch.Generator().manual_seed(0))
    check(lambda a, s: op(a, kernel, output, s), x, samples, grad=(0,))


@pytest.mark.parametrize(
    "make,size,stride,offset",
    [
        (lambda d: torch.arange(12.0, device=d).view(3, 4), (2, 2), (1, 2), 1),
        (lambda d: torch.arange(12.0, device=d).view(4, 3).t(), (2, 2), (1, 2), 0),
        (lambda d: torch.arange(24.0, device=d).view(2, 3, 4).permute(2, 0, 1), (3,), (5,), 2),
        (lambda d: torch.arange(24.0, device=d).view(4, 6)[:, ::2], (2, 2), (3, 1), 1),
        (lambda d: torch.tensor(3.0, device=d), (), (), 0),
    ],
    ids=["contiguous", "transposed", "permuted", "with_gaps", "0d"],
)
def test_as_strided_scatter_writes_memory_positions_of_the_inputs_layout(
    make, size, stride, offset
):
    src = -torch.arange(1.0, 1 + math.prod(size)).view(size)
    expected = torch.as_strided_scatter(make("cpu"), src, size, stride, offset)
    actual = torch.as_strided_scatter(make("tpu"), tpu(src), size, stride, offset)
    assert_same(actual, expected, check_stride=True)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32, None], ids=str)
@pytest.mark.parametrize("norm", ["layer", "batch", "group"])
def test_norm_statistics_of_16_bit_input_have_the_cpus_dtype(norm, param_dtype):
    # The CPU keeps them in the input's dtype unless a parameter is float32; torch's
    # meta kernels (our shape oracle) follow CUDA instead.
    aten = torch.ops.aten
    x = _randn(4, 6).to(torch.bfloat16)
    w = None if param_dtype is None else (_randn(6).abs() + 0.5).to(param_dtype)

    def stats(x, w):
        if norm == "layer":
            return aten.native_layer_norm(x, [6], w, w, 1e-5)
        if norm == "group":
            return aten.native_group_norm(x.view(4, 6, 1), w, w, 4, 6, 1, 2, 1e-5)
        running = None if w is None else (torch.zeros_like(w), torch.ones_like(w))
        return aten.native_batch_norm(x, w, w, *(running or (None, None)), True, 0.1, 1e-5)

    expected = stats(x, w)
    actual = stats(tpu(x), None if w is None else tpu(w))
    assert [t.dtype for t in actual] == [t.dtype for t in expected]
    assert_same(actual[1:], expected[1:], rtol=1.6e-2, atol=1e-5)


_FLAGS = torch.tensor([True, False, True, False])
_SIGNED = torch.tensor([[1, -1, 2, 0], [3, -2, -1, 5]])

# Ops whose results for these dtypes once differed from the CPU's (found by the dtypes
# scope of the conformance report).
DTYPE_CASES = [
    _case("pow_int_negative_exponents", torch.pow, _SIGNED, torch.tensor([-1, -3, -2, 2])),
    _case("rpow_int_negative_exponents", lambda e: 2**e, _SIGNED),
    _case(
        "div_trunc_int_broadcast",
        lambda a, b: torch.div(a, b, rounding_mode="trunc"),
        _SIGNED,
        torch.tensor([[3], [-2]]),
    ),
    _case("digamma_at_zeros", torch.digamma, torch.tensor([0.0, -0.0, 1.0, -1.0])),
    _case("erfinv_near_one", torch.erfinv, torch.tensor([0.9998, -0.99983, 0.75, 0.3, 1 - 2**-20])),
    _case("var_complex", lambda x: (x.var(), x.std(1)), _randn(3, 4, dtype=torch.complex64)),
    _case(
        "logaddexp_complex_branch",
        torch.logaddexp,
        torch.tensor([1 + 3j, -2 - 3j]),
        torch.tensor([0.5 + 3j, -2 + 3.1j]),
    ),
    _case(
        "logcumsumexp_complex",
        lambda x: torch.logcumsumexp(x, 0),
        torch.tensor([1 + 3j, 0.5 + 3j, -1 - 3j]),
    ),
    _case(
        "index_add_bool",
        lambda x, s: x.index_add(0, torch.tensor([0, 0, 2], device=x.device), s),
        _FLAGS,
        torch.tensor([False, True, True]),
    ),
    _case(
        "scatter_add_bool",
        lambda x, s: x.scatter_add(0, torch.tensor([1, 1, 3], device=x.device), s),
        _FLAGS,
        torch.tensor([True, False, False]),
    ),
    _case(
        "index_put_accumulate_bool",
        lambda x, v: x.index_put((torch.tensor([1, 3], device=x.device),), v, accumulate=True),
        _FLAGS,
        torch.tensor([True, False]),
    ),
    _case(
        "scatter_reduce_bool",
        lambda x, s: x.scatter_reduce(0, torch.tensor([1, 1, 3], device=x.device), s, "amin"),
        _FLAGS,
        torch.tensor([True, False, False]),
    ),
    _case(
        "dropout_backward_bool_grad",
        lambda g, m: torch.ops.aten.native_dropout_backward(g, m, 2.0),
        _FLAGS,
        torch.tensor([True, True, False, False]),
    ),
]


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, m, v: torch.addmm(x, m, m, alpha=0),
        lambda x, m, v: torch.addmv(x[0], m, v, alpha=0),
        lambda x, m, v: torch.addbmm(x, m[None], m[None], alpha=0),
        lambda x, m, v: torch.baddbmm(x[None], m[None], m[None], alpha=0),
        lambda x, m, v: torch.addr(x, v, v, alpha=0),
    ],
    ids=["addmm", "addmv", "addbmm", "baddbmm", "addr"],
)
def test_alpha_zero_with_nan_products_as_on_the_cpu(fn):
    # The CPU's BLAS-backed addmm, addmv and addbmm skip the product when alpha is 0;
    # its baddbmm and addr compute 0 * NaN.
    m = torch.tensor([[nan, 1.0], [1.0, 1.0]])
    check(fn, torch.ones(2, 2), m, torch.tensor([nan, 1.0]))


@pytest.mark.parametrize("fn,args", DTYPE_CASES)
def test_dtype_specific_results_match_cpu(fn, args):
    check(fn, *args)


def test_static_numbers_of_equal_value_but_other_type_are_other_constants():
    # 4 == 4.0 and 1 == True in Python; as op constants they give other dtypes.
    for make in (
        lambda d: torch.arange(4, device=d),
        lambda d: torch.arange(4.0, device=d),
        lambda d: torch.full((2,), 1, device=d),
        lambda d: torch.full((2,), True, device=d),
        lambda d: torch.full((2,), 1.0, device=d),
    ):
        assert_same(make("tpu"), make("cpu"))


@pytest.mark.parametrize(
    "dtype,hermitian",
    [
        (torch.float32, False),
        (torch.float64, False),
        (torch.complex128, False),
        (torch.complex128, True),
    ],
)
def test_ldl_factor_pivots_and_solve_match_lapack(dtype, hermitian):
    # Bunch-Kaufman pivoting decides LD's layout: the pivots (2x2 blocks included) must be
    # LAPACK's own. Several seeds so that both block sizes occur; a singular case too.
    for seed in range(6):
        a = torch.randn(2, 5, 5, dtype=dtype, generator=torch.Generator().manual_seed(seed))
        a = a + (a.mH if hermitian else a.mT)
        if seed == 5:
            a[0] = 0  # info = 1
        b = _randn(2, 5, 3, dtype=dtype, seed=seed)
        factored = torch.linalg.ldl_factor_ex(a, hermitian=hermitian)
        actual = torch.linalg.ldl_factor_ex(tpu(a), hermitian=hermitian)
        assert_same(actual.pivots, factored.pivots)
        assert_same(actual.info, factored.info)
        assert_same(actual.LD, factored.LD, rtol=1e-4, atol=1e-4)
        if seed < 5:
            x = torch.linalg.ldl_solve(*factored[:2], b, hermitian=hermitian)
            assert_same(
                torch.linalg.ldl_solve(*actual[:2], tpu(b), hermitian=hermitian),
                x,
                rtol=1e-4,
                atol=1e-4,
            )


def test_gcd_and_lcm_with_zeros_signs_and_overflow():
    a = torch.tensor([0, 6, -4, 9, 2**62, -7, 0])
    b = torch.tensor([0, 4, 6, -6, 3, 0, 5])
    check(torch.gcd, a, b)
    check(torch.lcm, a, b)  # 2**62 * 3 wraps as on the CPU
    check(torch.gcd, a.to(torch.int16).clamp(-100, 100), b.to(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_renorm_of_16_bit_floats(dtype):
    # torch's decomposition converts with prims.convert_element_type: lowered too.
    check(lambda x: torch.renorm(x, 2, 0, 1.0), _randn(3, 4).to(dtype))


@pytest.mark.parametrize(
    "case",
    ["plain", "causal", "scale", "float_mask_with_an_empty_row", "grouped", "causal_more_queries"],
)
def test_cpu_flash_attention_returns_the_logsumexp(case):
    """aten._scaled_dot_product_flash_attention_for_cpu as the CPU kernel computes it:
    its second output is the log-sum-exp (torch's decomposition gives the weights)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    kwargs = {}
    if case == "causal":
        kwargs["is_causal"] = True
    elif case == "scale":
        kwargs["scale"] = 0.3
    elif case == "float_mask_with_an_empty_row":
        mask = torch.zeros(3, 5)
        mask[0], mask[1:, :2] = float("-inf"), float("-inf")
        kwargs["attn_mask"] = mask
    elif case == "grouped":
        k, v = k[:, :2], v[:, :2]
    elif case == "causal_more_queries":
        k, v, kwargs["is_causal"] = k[:, :, :2], v[:, :, :2], True
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    tpu_kwargs = {n: tpu(a) if torch.is_tensor(a) else a for n, a in kwargs.items()}
    assert_same(
        op(*tpu((q, k, v)), **tpu_kwargs),
        op(q, k, v, **kwargs),
        rtol=1e-4,
        atol=1e-4,
        check_stride=True,
    )
    cpu_inputs = [t.requires_grad_() for t in (q, k, v)]
    tpu_inputs = [t.detach().to("tpu").requires_grad_() for t in cpu_inputs]
    cpu_grads = torch.autograd.grad(op(*cpu_inputs, **kwargs)[0].sum(), cpu_inputs)
    tpu_grads = torch.autograd.grad(op(*tpu_inputs, **tpu_kwargs)[0].sum(), tpu_inputs)
    assert_same(tpu_grads, cpu_grads, rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize(
    "mode,antialias",
    [("bilinear", False), ("bilinear", True), ("bicubic", True), ("bicubic", False)],
)
def test_uint8_resizes_round_as_the_cpu_kernel(mode, antialias):
    # Note [uint8 resizing in fixed point]: exact, up and down, either align_corners,
    # several channel counts (the CPU takes another code path above 4), tiny images
    # (uint8 bicubic without antialiasing differed by up to 17: computed in float and
    # truncated, and its edge taps are the float kernel's, not a normalised window).
    torch.manual_seed(0)
    for (h, w), size, align_corners, channels in [
        ((5, 7), (10, 14), False, 3),
        ((16, 16), (4, 5), True, 1),
        ((32, 20), (33, 41), False, 6),
        ((9, 9), (9, 4), False, 3),
        ((2, 3), (5, 1), True, 3),
        ((8, 8), (13, 5), False, 3),
    ]:
        if antialias and align_corners and mode == "bicubic":
            continue
        x = torch.randint(0, 256, (2, channels, h, w), dtype=torch.uint8)
        options = dict(size=size, mode=mode, align_corners=align_corners, antialias=antialias)
        assert_same(F.interpolate(tpu(x), **options), F.interpolate(x, **options), rtol=0, atol=0)


def test_antialiased_bicubic_float_and_its_gradient():
    check(
        lambda x: F.interpolate(x, size=(4, 5), mode="bicubic", antialias=True),
        torch.randn(1, 2, 9, 7),
        grad=(0,),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hash_tensor_of_16_and_32_bit_floats_widens_their_bits_as_the_cpu_does(dtype):
    # built with integer ops on tpu (a TPU's emulated float64 changed them): zeros of both
    # signs, subnormals, the extremes, infinities and NaN
    values = [0.0, -0.0, 1.0, -2.5, 1e-45, -3e-39, 1.17e-38, 3.4e38, 6e-8, 65504.0]
    x = torch.tensor(values + [math.inf, -math.inf, math.nan], dtype=torch.float32).to(dtype)
    x = torch.cat([x, torch.randn(1001).to(dtype)])
    assert_same(torch.hash_tensor(tpu(x)), torch.hash_tensor(x))
    rows = x.reshape(-1, 13)
    assert_same(torch.hash_tensor(tpu(rows), dim=1), torch.hash_tensor(rows, dim=1))
