"""How a tpu result is compared with the CPU's.

Values within torch's default tolerances for the dtype (or an expectations entry's),
dtypes and shapes exactly; and the rules some ops need: random ops by shape and dtype,
factorizations through their gauge-invariant form, tied indices by the values they
point at, and 16-bit floats against a float64 run where they differ from the CPU's
(Note [16-bit floats are judged against float64]).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

# OpInfo entries whose values are random: compared by shape and dtype only.
RANDOM_OPS = frozenset(
    {
        "bernoulli", "normal", "log_normal", "randn", "randn_like", "rand_like", "randint",
        "randint_like", "multinomial", "nn.functional.dropout", "nn.functional.dropout2d",
        "nn.functional.dropout3d", "nn.functional.alpha_dropout",
        "nn.functional.feature_alpha_dropout", "nn.functional.fractional_max_pool2d",
        "nn.functional.fractional_max_pool3d", "nn.functional.rrelu", "svd_lowrank",
        "pca_lowrank", "uniform", "exponential", "geometric",
        "cauchy", "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
        "empty_permuted", "torch.ops.aten._flash_attention_forward",
        "torch.ops.aten._efficient_attention_forward",
    }
)  # fmt: skip


# Factorizations unique only up to signs or phases (torch documents it; LAPACK builds
# differ in the choice): forward values are compared through the sample's
# gauge-invariant output_process_fn_grad, as OpInfo's gradient tests do.
GAUGE_DEPENDENT = frozenset({"svd", "linalg.svd", "linalg.eigh", "linalg.eig", "linalg.qr", "qr"})

# Ops returning the index of a value that may occur several times, where torch leaves
# which occurrence unspecified: the CPU's ``mode``, ``kthvalue``, ``topk`` and unstable
# ``sort`` and ``argsort`` take whichever their sort or selection puts there, and
# torch's own test_compare_cpu skips mode on CUDA for it. Their indices are compared by
# the input values they point at (see pointed_values). Each maps to the positions of
# its ``dim`` and ``keepdim`` among the sample's args (None: its indices have the
# input's rank). A stable sort is not ambiguous.
TIE_AMBIGUOUS_INDICES = {
    "mode": (0, 1),
    "kthvalue": (1, 2),
    "sort": (0, None),
    "argsort": (0, None),
    "topk": (1, None),
}


# Note [Tolerances per platform]
#     Results are compared with torch's default tolerances for their dtype, except where
#     a platform computes differently on purpose, listed here and nowhere else (the
#     conformance harness, the divergence finder and the test suite all ask
#     `tolerance`). XLA:TPU evaluates float32 transcendental functions (exp, log, tanh,
#     pow, the inverse trigonometric and hyperbolic functions, and the gradients built
#     from them) with its own approximations: on a TPU v5e they differed from the CPU by
#     up to 2.6e-4 relative (asin of complex64) and 2e-4 absolute near 1 (the gradient of
#     softplus), where XLA:CPU agrees with torch to float32 rounding. Matrix products
#     are not the reason (at torch's default "highest" precision a 4096x4096 float32
#     product was within 5e-7 relative of float64 on the chip). A platform's tolerance
#     is a floor: a comparison that asks for less (a test's 1e-5) gets the platform's,
#     since no float32 transcendental on that chip is closer; the test suite applies it
#     to its direct ``torch.testing.assert_close`` calls too (tests/conftest.py).
PLATFORM_TOLERANCES = {
    "tpu": {torch.float32: (5e-4, 5e-4), torch.complex64: (5e-4, 5e-4)},
}


def tolerance(dtype: torch.dtype, rtol=None, atol=None) -> tuple:
    """(rtol, atol) for comparing a result of ``dtype`` with the CPU's: those given, or
    (None, None) for torch's defaults, widened to this platform's own where it has them
    (Note [Tolerances per platform]): a test that asks for 1e-5 on the CPU gets the
    TPU's 5e-4 there, since no float32 transcendental on the chip is closer."""
    floor = platform_tolerances().get(dtype)
    if floor is None:
        return rtol, atol
    if rtol is None and atol is None:
        return floor
    return max(rtol or 0.0, floor[0]), max(atol or 0.0, floor[1])


def platform_tolerances() -> dict:
    """This platform's tolerances by dtype (empty where torch's defaults hold)."""
    return PLATFORM_TOLERANCES.get(_platform(), {})


def _platform() -> str:
    import jax  # started already: there are tpu results to compare

    return jax.default_backend()


def is_random(op, sample) -> bool:
    """Whether a sample's values are random: compared by shape and dtype only."""
    if op.name in RANDOM_OPS or f"{op.name}.{op.variant_test_name}" in RANDOM_OPS:
        return True
    if op.name == "nn.functional.multi_head_attention_forward":
        # dropout_p is its 11th positional parameter, the sample's args[9]
        return sample.kwargs.get("training", True) and bool(sample.args[9])
    return bool(sample.kwargs.get("dropout_p", 0))  # scaled_dot_product_attention


def read(value):
    """Bring every tensor in ``value`` to the host (this also raises pending checks)."""

    def host(t):
        return t.detach().cpu() if isinstance(t, torch.Tensor) else t

    return tree_map(host, value)


class Mismatch(AssertionError):
    """tpu returned a value different from the CPU's: a silent wrong answer."""


def compare(actual, expected, random: bool, rtol=None, atol=None) -> None:
    a_leaves, a_spec = tree_flatten(actual)
    e_leaves, e_spec = tree_flatten(expected)
    if len(a_leaves) != len(e_leaves):
        raise Mismatch(f"{len(a_leaves)} outputs, CPU gives {len(e_leaves)}")
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        where = f"output {i}: " if len(e_leaves) > 1 else ""
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise Mismatch(f"{where}got {type(a).__name__}, CPU gives a tensor")
            if a.dtype != e.dtype:
                raise Mismatch(f"{where}dtype {a.dtype}, CPU gives {e.dtype}")
            if a.shape != e.shape:
                raise Mismatch(f"{where}shape {tuple(a.shape)}, CPU gives {tuple(e.shape)}")
            if random:
                continue
            tol_r, tol_a = tolerance(e.dtype, rtol, atol)
            try:
                torch.testing.assert_close(
                    a, e, rtol=tol_r, atol=tol_a, equal_nan=True, check_device=False
                )
            except AssertionError as exc:
                # "Tensor-likes are not close! Mismatched elements: ...; Greatest ..."
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                raise Mismatch(where + "; ".join(lines)) from None
        elif isinstance(e, float) and isinstance(a, float):
            if not random and not (
                a == e or (a != a and e != e) or abs(a - e) <= 1e-5 + 1.3e-6 * abs(e)
            ):
                raise Mismatch(f"{where}{a} != {e}")
        elif not random and a != e:
            raise Mismatch(f"{where}{a!r} != {e!r}")


def comparable(op, fn, sample, result, sample_cpu):
    """A sample's result as the comparison sees it: on the host, gauge-fixed, ties
    resolved, and with the written input for an in-place variant."""
    if op.name in GAUGE_DEPENDENT:
        result = sample.output_process_fn_grad(result)
    result = read(result)
    if op.name in TIE_AMBIGUOUS_INDICES and not sample_cpu.kwargs.get("stable"):
        result = pointed_values(sample_cpu, result, *TIE_AMBIGUOUS_INDICES[op.name])
    if fn is op.inplace_variant:
        result = (result, read(sample.input))
    return result


# Note [16-bit floats are judged against float64]
#     A 16-bit float result that XLA computes in float32 and rounds once is within half
#     a unit of the true value, while torch's CPU kernels often accumulate or round
#     intermediates in the 16-bit type (batch norm's statistics, addbmm's sums,
#     adaptive pooling's means): the two can be units apart, which torch's default
#     tolerances (atol 1e-5) cannot allow for. So where a tpu result differs from the
#     CPU's, the sample runs again on the CPU in float64, and the tpu result passes if
#     none of its floating outputs is further from that one than the CPU's output is (or
#     than one unit of the dtype at the output's scale); other outputs must match the
#     CPU's. The report counts the cases decided this way.
JUDGED_BY_FLOAT64 = (torch.bfloat16, torch.float16)


def float64_sample(sample):
    from torch.testing._internal.opinfo.core import SampleInput

    def widen(t):
        if isinstance(t, torch.Tensor) and t.dtype in JUDGED_BY_FLOAT64:
            return t.detach().to(torch.float64)
        return t

    input, args, kwargs = tree_map(widen, (sample.input, sample.args, sample.kwargs))
    return SampleInput(
        input, args=args, kwargs=kwargs, output_process_fn_grad=sample.output_process_fn_grad
    )


def judge_by_float64(actual, expected, exact, dtype) -> None:
    a_leaves, e_leaves = tree_flatten(actual)[0], tree_flatten(expected)[0]
    x_leaves = tree_flatten(exact)[0]
    if len(x_leaves) != len(e_leaves):
        raise Mismatch(f"float64 reference has {len(x_leaves)} outputs, CPU {len(e_leaves)}")
    for i, (a, e, x) in enumerate(zip(a_leaves, e_leaves, x_leaves)):
        if not (isinstance(e, torch.Tensor) and e.is_floating_point()):
            compare([a], [e], random=False)  # indices, counts: as the CPU's
            continue
        compare([a], [e], random=True)  # dtype and shape only
        ours, cpus, x = a.double(), e.double(), x.double()
        if not torch.equal(torch.isnan(ours), torch.isnan(x)):
            raise Mismatch(f"output {i}: NaN where the float64 result has none, or not NaN")
        finite = torch.isfinite(x)
        if not torch.equal(ours[~finite & ~torch.isnan(x)], x[~finite & ~torch.isnan(x)]):
            raise Mismatch(f"output {i}: an infinity differs from the float64 result")
        if not finite.any():
            continue
        ours_error = (ours - x)[finite].abs().max().item()
        cpu_error = (cpus - x)[finite].abs().max().item()
        unit = torch.finfo(dtype).eps * x[finite].abs().max().item()
        if ours_error > max(cpu_error, unit):
            raise Mismatch(
                f"output {i}: {ours_error:.3g} off the float64 result, the CPU's "
                f"{cpu_error:.3g} (one {dtype} unit there: {unit:.3g})"
            )


def pointed_values(sample_cpu, out, dim_at: int, keepdim_at: int | None):
    """(values, input values at indices, indices dtype and shape) of a ``(values,
    indices)`` result (or of ``indices`` alone) along ``dim`` (args[dim_at]): equal
    for any choice among tied occurrences."""
    values, indices = out if isinstance(out, (tuple, list)) else (None, out)
    x = sample_cpu.input
    if x.ndim == 0:
        return values, indices  # the one occurrence
    args, kwargs = sample_cpu.args, sample_cpu.kwargs
    dim = args[dim_at] if len(args) > dim_at else kwargs.get("dim", -1)
    if keepdim_at is None:
        keepdim = True
    else:
        keepdim = args[keepdim_at] if len(args) > keepdim_at else kwargs.get("keepdim", False)
    picked = x.gather(dim, indices if keepdim else indices.unsqueeze(dim))
    return values, picked if keepdim else picked.squeeze(dim), indices.dtype, indices.shape
