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
How results are compared is observe/compare.py's business (the divergence finder shares it).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map

import torchtpu
from torchtpu import matmul_precision
from torchtpu.conformance import products
from torchtpu.dispatch import checks
from torchtpu.observe import compare

#: Eager modes the suite runs in. Adding a mode is adding its name here.
MODES = ("strict", "debug", "defer")

#: Dtypes checked for every op that supports them, then the extra ones.
REQUIRED_DTYPES = (torch.float32, torch.int64, torch.bool)
EXTRA_DTYPES = (torch.bfloat16, torch.float16, torch.float64, torch.complex64)

VARIANTS = ("op", "method", "inplace")
CHECKS = ("forward", "grad", "errors")

# Positional arguments torch requires on the CPU whatever the device (as the samples
# make them): they are not moved to tpu.
HOST_ARGS = {"tensor_split": 0}

_HIGHEST = matmul_precision.Precision.HIGHEST


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
    by_float64: bool = False  # passed as judged against float64 (see compare.JUDGED_BY_FLOAT64)
    # what XLA:TPU made of the case's programs, where they were compiled for it too
    # (xla_tpu.py): "program: outcome: detail" for each one it refused or aborted on
    tpu_compile: tuple[str, ...] = ()
    compiled_for_tpu: bool = False  # whether they were
    routes: tuple[str, ...] = ()  # the platform policy's routes taken (platform.py)


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
            compare.read(_call(fn, sample_tpu))
        except type(exc):
            return False
        except Exception as other:
            raise compare.Mismatch(
                f"raised {type(other).__name__}: {other}; CPU raises {type(exc).__name__}: {exc}"
            ) from None
        raise compare.Mismatch(
            f"returned a value; CPU raises {type(exc).__name__}: {exc}"
        ) from None
    actual = compare.comparable(op, fn, sample_tpu, _call(fn, sample_tpu), sample_cpu)
    expected = compare.comparable(op, fn, sample_cpu, expected, sample_cpu)
    try:
        compare.compare(actual, expected, random, *tolerance)
        return False
    except compare.Mismatch:
        if random or dtype not in compare.JUDGED_BY_FLOAT64:
            raise
    reference = compare.float64_sample(sample_cpu)
    exact = compare.comparable(op, fn, reference, _call(fn, reference), sample_cpu)
    compare.judge_by_float64(actual, expected, exact, dtype)
    return True


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
    compare.compare(outputs[1], outputs[0], random, *tolerance)


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
        compare.read(_call(fn, moved))
    except expected:
        return
    except Exception as other:
        raise compare.Mismatch(
            f"error input: raised {type(other).__name__}: {other}; CPU raises {expected.__name__}"
        ) from None
    raise compare.Mismatch(f"error input: returned a value; CPU raises {expected.__name__}")


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
    with (
        torchtpu.set_eager_mode(case.mode),
        warnings.catch_warnings(),
        products.watch() as below_float32,
    ):
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
                        _run_grad(fn, sample, sample_tpu, tolerance, compare.is_random(op, sample))
                    elif _run_forward(
                        op,
                        fn,
                        sample,
                        sample_tpu,
                        compare.is_random(op, sample),
                        tolerance,
                        case.dtype,
                    ):
                        judged = True
        except compare.Mismatch as exc:
            result = Result(case, "mismatch", f"sample {samples}: {exc}")
        except Exception as exc:  # tpu raised where the CPU did not: loud, so a "fail"
            result = Result(
                case, "fail", f"sample {samples}: {type(exc).__name__}: {_first_line(exc)}"
            )
        finally:
            checks._pending.clear()
    if below_float32 and result.outcome == "pass" and matmul_precision.current() is _HIGHEST:
        # right on the CPU, one bfloat16 pass on a TPU (products.py)
        result = Result(case, "mismatch", f"traced below float32 precision: {below_float32[0]}")
    result.samples = samples
    result.fallbacks = tuple(sorted(torchtpu.metrics().get("fallback", {})))
    result.routes = tuple(sorted(torchtpu.metrics().get("host_ops", {})))
    result.by_float64 = judged and result.outcome == "pass"
    return result


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""
