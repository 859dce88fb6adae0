"""Run PyTorch's OpInfo samples on the CPU and on tpu, and compare.

A *case* is one OpInfo entry x variant (the function, the Tensor method, the in-place
method) x dtype x check (forward values, gradients, error inputs) x eager mode. Its
outcome is one of:

- ``pass``: every sample matches CPU (values with torch's default tolerances for the
  dtype, dtype, shape; for error inputs, the exception type);
- ``fail``: some sample raised on tpu where the CPU did not -- loud, acceptable as a
  gap in coverage;
- ``mismatch``: some sample returned a *different value* (or none where the CPU
  raised) -- a silent wrong answer, never acceptable;
- ``skip``: the expectations table says not to run it, with a reason.

Where the CPU itself rejects a sample, tpu must reject it with the same exception type.
Random ops are compared by shape and dtype only.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map

import torchtpu
from torchtpu import checks

#: Eager modes the suite runs in. Adding a mode is adding its name here.
MODES = ("strict", "debug", "defer")

#: Dtypes checked for every op that supports them, then the extra ones.
REQUIRED_DTYPES = (torch.float32, torch.int64, torch.bool)
EXTRA_DTYPES = (torch.bfloat16, torch.float16, torch.float64, torch.complex64)

VARIANTS = ("op", "method", "inplace")
CHECKS = ("forward", "grad", "errors")

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
# the input values they point at (see _pointed_values). Each maps to the positions of
# its ``dim`` and ``keepdim`` among the sample's args (None: its indices have the
# input's rank). A stable sort is not ambiguous.
TIE_AMBIGUOUS_INDICES = {
    "mode": (0, 1),
    "kthvalue": (1, 2),
    "sort": (0, None),
    "argsort": (0, None),
    "topk": (1, None),
}

# Positional arguments torch requires on the CPU whatever the device (as the samples
# make them): they are not moved to tpu.
HOST_ARGS = {"tensor_split": 0}


def _is_random(op, sample) -> bool:
    if op.name in RANDOM_OPS or op_name(op) in RANDOM_OPS:
        return True
    if op.name == "nn.functional.multi_head_attention_forward":
        # dropout_p is its 11th positional parameter, the sample's args[9]
        return sample.kwargs.get("training", True) and bool(sample.args[9])
    return bool(sample.kwargs.get("dropout_p", 0))  # scaled_dot_product_attention


@functools.cache
def op_db() -> tuple:
    from torch.testing._internal.common_methods_invocations import op_db as db

    return tuple(db)


def op_name(op) -> str:
    """The OpInfo entry's name, with its variant test name if any (``max.reduction_with_dim``)."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def find(name: str):
    for op in op_db():
        if op_name(op) == name:
            return op
    raise KeyError(name)


@dataclasses.dataclass(frozen=True)
class Case:
    op_name: str
    variant: str
    dtype: torch.dtype
    check: str
    mode: str

    @property
    def id(self) -> str:
        return f"{self.op_name}-{self.variant}-{str(self.dtype).replace('torch.', '')}-{self.check}-{self.mode}"


@dataclasses.dataclass
class Result:
    case: Case
    outcome: str  # "pass", "fail", "mismatch", "skip"
    detail: str = ""
    samples: int = 0
    fallbacks: tuple[str, ...] = ()
    stale: str = ""  # why the case's expectations entry is no longer needed, if it is not
    by_float64: bool = False  # passed as judged against float64 (see JUDGED_BY_FLOAT64)


#: The named selections of cases: scope -> its parts, each (cases() arguments, samples
#: per case or None for all). "ci" is what the default test run checks within CI's time
#: budget: the first samples of every op's float32 forward and the first of its
#: gradient, in Strict. "forward" is every float32 forward sample of every variant in
#: Strict; "grad" the gradients of the first float32 samples of every op; "errors"
#: every error input; "dtypes" the first samples of every op in every other dtype;
#: "modes" the first float32 samples of every op in the other eager modes; "coverage"
#: every float32 forward, gradient and error-input sample; "full" is everything.
_STRICT_F32 = dict(dtypes=(torch.float32,), modes=("strict",))
SCOPES = {
    "ci": (
        (dict(_STRICT_F32, variants=("op",), checks=("forward",)), 3),
        (dict(_STRICT_F32, variants=("op",), checks=("grad",)), 1),
    ),
    "forward": ((dict(_STRICT_F32, checks=("forward",)), None),),
    "grad": ((dict(_STRICT_F32, variants=("op",), checks=("grad",)), 3),),
    "errors": ((dict(_STRICT_F32, checks=("errors",)), None),),
    "dtypes": (
        (
            dict(
                dtypes=REQUIRED_DTYPES[1:] + EXTRA_DTYPES,
                variants=("op",),
                checks=("forward",),
                modes=("strict",),
            ),
            3,
        ),
    ),
    "modes": (
        (
            dict(
                dtypes=(torch.float32,),
                variants=("op",),
                checks=("forward",),
                modes=tuple(m for m in MODES if m != "strict"),
            ),
            3,
        ),
    ),
    "coverage": ((_STRICT_F32, None),),
    "full": (({}, None),),
}

#: The scopes of the committed report (docs/conformance.md).
REPORT_SCOPES = ("forward", "grad", "errors", "dtypes", "modes")


def scope(name: str) -> list[tuple[Case, int | None]]:
    """The cases of a named scope, each with its cap on samples (None: all)."""
    if name not in SCOPES:
        raise ValueError(f"unknown conformance scope {name!r}; expected one of {sorted(SCOPES)}")
    return [(case, cap) for selection, cap in SCOPES[name] for case in cases(**selection)]


def cases(dtypes=REQUIRED_DTYPES + EXTRA_DTYPES, variants=VARIANTS, checks=CHECKS, modes=MODES):
    """Every applicable case, in op_db order."""
    for op in op_db():
        supported = op.supported_dtypes("cpu")
        for variant in variants:
            if _variant_fn(op, variant) is None:
                continue
            for dtype in dtypes:
                if dtype not in supported:
                    continue
                for check in checks:
                    if check == "grad" and not (
                        op.supports_autograd and dtype == torch.float32 and variant != "inplace"
                    ):
                        continue
                    if check == "errors" and (
                        variant != "op" or dtype != torch.float32 or op.error_inputs_func is None
                    ):
                        continue
                    for mode in modes:
                        yield Case(op_name(op), variant, dtype, check, mode)


def _variant_fn(op, variant):
    if variant == "op":
        return op.op
    if variant == "method":
        return op.method_variant
    return op.inplace_variant


# -- moving samples -------------------------------------------------------------------------


def _to_tpu(sample, host_arg: int | None = None):
    """The sample with every tensor copied to tpu (leaves that require grad stay leaves
    that require grad), except positional argument ``host_arg``. Tensors sharing memory
    share it on tpu too (an ``out=`` tensor that is an input, views of one base)."""
    from torch.testing._internal.opinfo.core import SampleInput

    copies: dict[int, tuple] = {}  # id(tensor) -> (tensor, its tpu copy)

    def copy(t):
        if id(t) not in copies:
            copies[id(t)] = (t, t.detach().to("tpu"))
        return copies[id(t)][1]

    moved: dict[int, torch.Tensor] = {}  # id(tensor) -> its tpu tensor: one per object

    def move(t):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return t  # a meta tensor stays one (error inputs mixing devices)
        if id(t) not in moved:
            moved[id(t)] = move_one(t)
        return moved[id(t)]

    def move_one(t):
        if (
            t._base is not None
            and t._base.layout == torch.strided
            and t._base.dtype == t.dtype
            and not (t.is_conj() or t.is_neg())
        ):
            # A view moves as a view of its moved base: ops like as_strided may read
            # storage outside the view. (A view as another dtype, such as a real view
            # of a complex tensor, moves as a copy: its strides count other elements;
            # so does a lazily conjugated or negated view, whose base lacks its bit.)
            result = copy(t._base).as_strided(t.size(), t.stride(), t.storage_offset())
        elif t._base is None:
            result = copy(t).detach()  # a tensor of its own, on the shared storage
        else:
            result = t.detach().to("tpu")
        return result.requires_grad_(t.requires_grad)

    input, args, kwargs = tree_map(move, (sample.input, sample.args, sample.kwargs))
    if host_arg is not None and len(sample.args) > host_arg:
        args = tuple(sample.args[host_arg] if i == host_arg else a for i, a in enumerate(args))
    return SampleInput(
        input, args=args, kwargs=kwargs, output_process_fn_grad=sample.output_process_fn_grad
    )


def _leaves_requiring_grad(sample):
    leaves, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _read(value):
    """Bring every tensor in ``value`` to the host (this also raises pending checks)."""

    def host(t):
        return t.detach().cpu() if isinstance(t, torch.Tensor) else t

    return tree_map(host, value)


# -- comparing ------------------------------------------------------------------------------


class Mismatch(AssertionError):
    """tpu returned a value different from the CPU's: a silent wrong answer."""


def _compare(actual, expected, random: bool, rtol=None, atol=None) -> None:
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
            try:
                torch.testing.assert_close(
                    a, e, rtol=rtol, atol=atol, equal_nan=True, check_device=False
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


# -- running --------------------------------------------------------------------------------


def _call(fn, sample):
    return fn(sample.input, *sample.args, **sample.kwargs)


def _run_forward(op, fn, sample_cpu, sample_tpu, random, tolerance, dtype) -> bool:
    """Compare one sample; raise Mismatch or the tpu's exception. True when the values
    were judged against float64 (Note [16-bit floats are judged against float64])."""
    try:
        expected = _call(fn, sample_cpu)
    except Exception as exc:  # the CPU rejects the sample: tpu must reject it alike
        try:
            _read(_call(fn, sample_tpu))
        except type(exc):
            return False
        except Exception as other:
            raise Mismatch(
                f"raised {type(other).__name__}: {other}; CPU raises {type(exc).__name__}: {exc}"
            ) from None
        raise Mismatch(f"returned a value; CPU raises {type(exc).__name__}: {exc}") from None
    actual = _comparable(op, fn, sample_tpu, _call(fn, sample_tpu), sample_cpu)
    expected = _comparable(op, fn, sample_cpu, expected, sample_cpu)
    try:
        _compare(actual, expected, random, *tolerance)
        return False
    except Mismatch:
        if random or dtype not in JUDGED_BY_FLOAT64:
            raise
    reference = _float64_sample(sample_cpu)
    exact = _comparable(op, fn, reference, _call(fn, reference), sample_cpu)
    _judge_by_float64(actual, expected, exact, dtype)
    return True


def _comparable(op, fn, sample, result, sample_cpu):
    """A sample's result as the comparison sees it: on the host, gauge-fixed, ties
    resolved, and with the written input for an in-place variant."""
    if op.name in GAUGE_DEPENDENT:
        result = sample.output_process_fn_grad(result)
    result = _read(result)
    if op.name in TIE_AMBIGUOUS_INDICES and not sample_cpu.kwargs.get("stable"):
        result = _pointed_values(sample_cpu, result, *TIE_AMBIGUOUS_INDICES[op.name])
    if fn is op.inplace_variant:
        result = (result, _read(sample.input))
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


def _float64_sample(sample):
    from torch.testing._internal.opinfo.core import SampleInput

    def widen(t):
        if isinstance(t, torch.Tensor) and t.dtype in JUDGED_BY_FLOAT64:
            return t.detach().to(torch.float64)
        return t

    input, args, kwargs = tree_map(widen, (sample.input, sample.args, sample.kwargs))
    return SampleInput(
        input, args=args, kwargs=kwargs, output_process_fn_grad=sample.output_process_fn_grad
    )


def _judge_by_float64(actual, expected, exact, dtype) -> None:
    a_leaves, e_leaves = tree_flatten(actual)[0], tree_flatten(expected)[0]
    x_leaves = tree_flatten(exact)[0]
    if len(x_leaves) != len(e_leaves):
        raise Mismatch(f"float64 reference has {len(x_leaves)} outputs, CPU {len(e_leaves)}")
    for i, (a, e, x) in enumerate(zip(a_leaves, e_leaves, x_leaves)):
        if not (isinstance(e, torch.Tensor) and e.is_floating_point()):
            _compare([a], [e], random=False)  # indices, counts: as the CPU's
            continue
        _compare([a], [e], random=True)  # dtype and shape only
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


def _pointed_values(sample_cpu, out, dim_at: int, keepdim_at: int | None):
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


def _run_grad(fn, sample_cpu, sample_tpu, tolerance, random):
    outputs = []
    for sample in (sample_cpu, sample_tpu):
        out = sample.output_process_fn_grad(_call(fn, sample))
        leaves = [
            t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        inputs = _leaves_requiring_grad(sample)
        if not leaves or not inputs:
            return
        total = sum(t.sum() if not t.is_complex() else t.abs().sum() for t in leaves)
        grads = torch.autograd.grad(total, inputs, allow_unused=True)
        outputs.append([None if g is None else g.detach().cpu() for g in grads])
    _compare(outputs[1], outputs[0], random, *tolerance)


def _run_error(fn, error_input):
    sample = error_input.sample_input
    moved = _to_tpu(sample)  # before the CPU runs: it may resize an out= tensor, then raise
    try:
        _call(fn, sample)
    except Exception as exc:
        expected = type(exc)
    else:
        return  # the CPU accepts it in this build: nothing to compare
    try:
        _read(_call(fn, moved))
    except expected:
        return
    except Exception as other:
        raise Mismatch(
            f"error input: raised {type(other).__name__}: {other}; CPU raises {expected.__name__}"
        ) from None
    raise Mismatch(f"error input: returned a value; CPU raises {expected.__name__}")


def run(case: Case, tolerance=(None, None), max_samples: int | None = None) -> Result:
    """Run one case (its first ``max_samples`` samples, or all) and classify it; the
    expectations table is not consulted here."""
    op = find(case.op_name)
    fn = _variant_fn(op, case.variant)
    torchtpu.reset_metrics()
    checks._pending.clear()
    # OpInfo draws its samples from torch's global generator: seeded, a case sees the
    # same samples whatever ran before it (another op, another worker, --ops).
    torch.manual_seed(0)
    samples, judged = 0, False
    result = Result(case, "pass")
    with torchtpu.set_eager_mode(case.mode), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if case.check == "errors":
                for error_input in op.error_inputs("cpu"):
                    if samples == max_samples:
                        break
                    samples += 1
                    _run_error(fn, error_input)
            else:
                grad = case.check == "grad"
                for sample in op.sample_inputs("cpu", case.dtype, requires_grad=grad):
                    if case.variant == "inplace" and sample.broadcasts_input:
                        continue  # the CPU rejects these too; OpInfo's own tests skip them
                    if samples == max_samples:
                        break
                    samples += 1
                    sample_tpu = _to_tpu(sample, HOST_ARGS.get(op.name))
                    if grad:
                        _run_grad(fn, sample, sample_tpu, tolerance, _is_random(op, sample))
                    elif _run_forward(
                        op, fn, sample, sample_tpu, _is_random(op, sample), tolerance, case.dtype
                    ):
                        judged = True
        except Mismatch as exc:
            result = Result(case, "mismatch", f"sample {samples}: {exc}")
        except Exception as exc:  # tpu raised where the CPU did not: loud, so a "fail"
            result = Result(
                case, "fail", f"sample {samples}: {type(exc).__name__}: {_first_line(exc)}"
            )
        finally:
            checks._pending.clear()
    result.samples = samples
    result.fallbacks = tuple(sorted(torchtpu.metrics().get("fallback", {})))
    result.by_float64 = judged and result.outcome == "pass"
    return result


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""
