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
# which occurrence unspecified: the CPU's ``mode`` takes whichever an unstable sort puts
# last, and torch's own test_compare_cpu skips mode on CUDA for it. Their indices are
# compared by the input values they point at (see _pointed_values).
TIE_AMBIGUOUS_INDICES = frozenset({"mode"})

# Positional arguments torch requires on the CPU whatever the device (as the samples
# make them): they are not moved to tpu.
HOST_ARGS = {"tensor_split": 0}


def _is_random(op, sample) -> bool:
    if op.name in RANDOM_OPS or op_name(op) in RANDOM_OPS:
        return True
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


#: The named selections of cases: scope -> (cases() arguments, samples per case).
#: "ci" is what the default test run checks within CI's time budget: the first samples
#: of every op's float32 forward in Strict. "forward" is every float32 forward sample of
#: every variant in Strict; "grad" the gradients of the first float32 samples of every
#: op; "coverage" every float32 forward, gradient and error-input sample; "full" is
#: everything.
SCOPES = {
    "ci": (
        dict(dtypes=(torch.float32,), variants=("op",), checks=("forward",), modes=("strict",)),
        3,
    ),
    "forward": (dict(dtypes=(torch.float32,), checks=("forward",), modes=("strict",)), None),
    "grad": (
        dict(dtypes=(torch.float32,), variants=("op",), checks=("grad",), modes=("strict",)),
        3,
    ),
    "coverage": (dict(dtypes=(torch.float32,), modes=("strict",)), None),
    "full": ({}, None),
}


def scope(name: str) -> tuple[list[Case], int | None]:
    """The cases of a named scope and its cap on samples per case (None: all)."""
    if name not in SCOPES:
        raise ValueError(f"unknown conformance scope {name!r}; expected one of {sorted(SCOPES)}")
    selection, max_samples = SCOPES[name]
    return list(cases(**selection)), max_samples


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
    that require grad), except positional argument ``host_arg``."""
    from torch.testing._internal.opinfo.core import SampleInput

    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t._base is not None and t._base.layout == torch.strided and t._base.dtype == t.dtype:
            # A view moves as a view of its moved base: ops like as_strided may read
            # storage outside the view. (A view as another dtype, such as a real view
            # of a complex tensor, moves as a copy: its strides count other elements.)
            base = t._base.detach().to("tpu")
            moved = base.as_strided(t.size(), t.stride(), t.storage_offset())
        else:
            moved = t.detach().to("tpu")
        return moved.requires_grad_(t.requires_grad)

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
    for a, e in zip(a_leaves, e_leaves):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise Mismatch(f"got {type(a).__name__}, CPU gives a tensor")
            if a.dtype != e.dtype:
                raise Mismatch(f"dtype {a.dtype}, CPU gives {e.dtype}")
            if a.shape != e.shape:
                raise Mismatch(f"shape {tuple(a.shape)}, CPU gives {tuple(e.shape)}")
            if random:
                continue
            try:
                torch.testing.assert_close(
                    a, e, rtol=rtol, atol=atol, equal_nan=True, check_device=False
                )
            except AssertionError as exc:
                raise Mismatch(str(exc).split("\n\n")[0].replace("\n", " ")) from None
        elif isinstance(e, float) and isinstance(a, float):
            if not random and not (
                a == e or (a != a and e != e) or abs(a - e) <= 1e-5 + 1.3e-6 * abs(e)
            ):
                raise Mismatch(f"{a} != {e}")
        elif not random and a != e:
            raise Mismatch(f"{a!r} != {e!r}")


# -- running --------------------------------------------------------------------------------


def _call(fn, sample):
    return fn(sample.input, *sample.args, **sample.kwargs)


def _run_forward(op, fn, sample_cpu, sample_tpu, random, tolerance):
    """Compare one sample; raise Mismatch or the tpu's exception."""
    try:
        expected = _call(fn, sample_cpu)
    except Exception as exc:  # the CPU rejects the sample: tpu must reject it alike
        try:
            _read(_call(fn, sample_tpu))
        except type(exc):
            return
        except Exception as other:
            raise Mismatch(
                f"raised {type(other).__name__}: {other}; CPU raises {type(exc).__name__}: {exc}"
            ) from None
        raise Mismatch(f"returned a value; CPU raises {type(exc).__name__}: {exc}") from None
    actual = _call(fn, sample_tpu)
    if op.name in GAUGE_DEPENDENT:
        actual = sample_tpu.output_process_fn_grad(actual)
        expected = sample_cpu.output_process_fn_grad(expected)
    actual = _read(actual)
    if op.name in TIE_AMBIGUOUS_INDICES:
        actual = _pointed_values(sample_cpu, actual)
        expected = _pointed_values(sample_cpu, _read(expected))
    if fn is op.inplace_variant:
        actual = (actual, _read(sample_tpu.input))
        expected = (expected, sample_cpu.input)
    _compare(actual, _read(expected), random, *tolerance)


def _pointed_values(sample_cpu, out):
    """(values, input values at indices, indices dtype and shape) of a ``(values,
    indices)`` result along ``dim``: equal for any choice among tied occurrences."""
    values, indices = out
    x = sample_cpu.input
    if x.ndim == 0:
        return values, indices  # the one occurrence
    args, kwargs = sample_cpu.args, sample_cpu.kwargs
    dim = args[0] if args else kwargs.get("dim", -1)
    keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
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
    try:
        _call(fn, sample)
    except Exception as exc:
        expected = type(exc)
    else:
        return  # the CPU accepts it in this build: nothing to compare
    moved = _to_tpu(sample)
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
    samples = 0
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
                    else:
                        _run_forward(op, fn, sample, sample_tpu, _is_random(op, sample), tolerance)
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
    return result


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""
