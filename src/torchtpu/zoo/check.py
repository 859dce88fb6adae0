"""Run a zoo architecture on tpu and on the CPU and compare.

Five checks, each giving an :class:`Outcome`:

- ``forward``: eval-mode forward; logits and loss.
- ``train``: train-mode forward, ``loss.backward()`` and one ``torch.optim.AdamW``
  step; loss, logits, every parameter's gradient, and the updated parameters
  against the CPU's step from the same gradients (see ``_cpu_step_with``).
- ``generate``: greedy ``generate()`` with the default (dynamic) KV cache, for causal
  LMs and encoder-decoders; the tokens.
- ``generate_static``: the same with ``cache_implementation="static"``.
- ``compile``: the eval-mode forward of ``torch.compile(model, backend="tpu")``
  against the CPU's eager forward, with the number of graphs and graph breaks.

The eager checks run in each eager mode (``MODES``); ``compile`` runs once (its
graphs do not depend on the eager mode). The CPU side runs once per architecture
(cached); the tpu side runs on a deep copy of the same CPU model moved with
``.to("tpu")``.
"""

from __future__ import annotations

import copy
import functools
import time
import traceback
from dataclasses import dataclass, field

import torch

import torchtpu
from torchtpu.zoo.arch import Arch

EAGER_CHECKS = ("forward", "train", "generate", "generate_static")
MODES = ("strict", "defer")
CHECKS = EAGER_CHECKS + ("compile",)
COMPILE_MODE = "strict"  # the eager mode of whatever runs between compiled graphs

# float32 on both sides, but XLA fuses and reorders reductions differently from ATen.
TOLERANCE = {"forward": (1e-4, 1e-4), "compile": (1e-4, 1e-4), "train": (1e-3, 1e-4)}
NEW_TOKENS = 6

# Why a check does not apply to a family that has no generate().
_NOT_GENERATIVE = {
    "encoder": "n/a: an encoder (no generate())",
    "vision": "n/a: an image classifier (no generate())",
    "audio": "n/a: a CTC model (no generate())",
    "multimodal": "n/a: a contrastive model (no generate())",
}


@dataclass
class Outcome:
    arch: str
    check: str
    mode: str
    passed: bool = False
    crashed: bool = False
    max_abs_diff: float | None = None
    reason: str = ""
    seconds: float = 0.0
    fallbacks: dict = field(default_factory=dict)
    graphs: int | None = None  # compile: graphs Dynamo handed the backend
    graph_breaks: int | None = None  # compile: Dynamo's graph-break count
    break_reasons: list = field(default_factory=list)


def columns(modes=MODES) -> list[tuple[str, str]]:
    """The (check, mode) pairs run for every architecture, in report order."""
    return [(c, m) for c in EAGER_CHECKS for m in modes] + [("compile", COMPILE_MODE)]


def not_applicable(arch: Arch, check: str) -> str | None:
    """Why ``check`` does not apply to ``arch`` (a cell of the report), or None."""
    if check.startswith("generate") and not arch.generate:
        return _NOT_GENERATIVE.get(arch.family, "n/a: no generate()")
    if check == "generate_static" and arch.no_static_cache:
        return f"n/a: {arch.no_static_cache}"
    return None


def applicable(arch: Arch, check: str) -> bool:
    return not_applicable(arch, check) is None


def run(arch: Arch, check: str, mode: str) -> Outcome:
    """Run one check; a crash on tpu is an outcome, not an exception."""
    outcome = Outcome(arch.name, check, mode)
    try:
        expected = _cpu_reference(arch, "forward" if check == "compile" else check)
    except Exception as error:  # noqa: BLE001 - a broken entry of the table, not tpu's
        outcome.reason = f"the CPU run fails too: {_crash_reason(error)}"
        return outcome
    torchtpu.reset_metrics()
    start = time.perf_counter()
    try:
        with torchtpu.set_eager_mode(mode):
            if check == "compile":
                actual = _run_compile(arch, outcome)
            else:
                actual = _RUNNERS[check](arch, "tpu")
            actual = _to_cpu(actual)
    except Exception as error:  # noqa: BLE001 - the report records any failure
        outcome.crashed = True
        outcome.reason = _crash_reason(error)
    else:
        if check == "train":
            expected = {**expected, **_cpu_step_with(arch, actual)}
        _compare(outcome, actual, expected)
        if check == "train" and not outcome.passed and actual.keys() == expected.keys():
            _compare(outcome, actual, expected, _cpu_float64_train(arch))
    outcome.seconds = time.perf_counter() - start
    outcome.fallbacks = dict(torchtpu.metrics().get("fallback", {}))
    return outcome


@functools.lru_cache(maxsize=8)
def _cpu_reference(arch: Arch, check: str):
    return _RUNNERS[check](arch, "cpu")


def _model_on(arch: Arch, device: str):
    return _cpu_model(arch) if device == "cpu" else copy.deepcopy(_cpu_model(arch)).to(device)


@functools.lru_cache(maxsize=2)
def _cpu_model(arch: Arch):
    return arch.build()


def _run_forward(arch: Arch, device: str) -> dict:
    model = _model_on(arch, device)
    batch = _on(arch.batch(model.config), device)
    with torch.no_grad():
        output = model(**batch)
    return _outputs(output)


def _run_train(arch: Arch, device: str) -> dict:
    model = copy.deepcopy(_cpu_model(arch)).to(device).train()
    result = _loss_and_grads(model, _on(arch.batch(model.config), device))
    _adamw(model).step()
    result.update({f"step {n}": p.detach() for n, p in model.named_parameters()})
    return result


def _loss_and_grads(model, batch: dict) -> dict:
    """A train-mode forward and ``loss.backward()``: the outputs and every gradient."""
    output = model(**batch)
    output.loss.backward()
    result = _outputs(output)
    result.update({f"grad {n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    return result


@functools.lru_cache(maxsize=2)
def _cpu_float64_train(arch: Arch) -> dict:
    """The CPU's train-mode outputs and gradients in float64 (Note [Judged against
    float64])."""
    model = copy.deepcopy(_cpu_model(arch)).double().train()
    batch = {
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in arch.batch(model.config).items()
    }
    return _loss_and_grads(model, batch)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _cpu_step_with(arch: Arch, grads: dict) -> dict:
    """The CPU's AdamW step from the initial parameters with the given gradients.

    The tpu's step is compared against this rather than the CPU's own step: Adam
    divides a gradient by its magnitude, so where a gradient is rounding noise (a
    key projection's bias, whose gradient is 0 in exact arithmetic) each side moves
    the parameter by a full learning rate in a random direction. Gradients are
    compared separately, against the CPU's.
    """
    model = copy.deepcopy(_cpu_model(arch))
    for name, p in model.named_parameters():
        p.grad = grads.get(f"grad {name}")
    _adamw(model).step()
    return {f"step {n}": p.detach() for n, p in model.named_parameters()}


def _run_generate(arch: Arch, device: str, **options) -> dict:
    model = _model_on(arch, device)
    batch = _on(arch.batch(model.config), device)
    batch.pop("labels")
    tokens = model.generate(
        **batch,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
        **options,
    )
    return {"tokens": tokens}


def _run_generate_static(arch: Arch, device: str) -> dict:
    return _run_generate(arch, device, cache_implementation="static")


def _run_compile(arch: Arch, outcome: Outcome) -> dict:
    """The forward of ``torch.compile(model, backend="tpu")``, counting Dynamo's graphs
    and graph breaks into ``outcome``. Dynamo is reset before and after, so each
    architecture compiles from scratch and leaves nothing cached."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from torchtpu.compile.backend import tpu_backend

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return tpu_backend(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    try:
        model = _model_on(arch, "tpu")
        batch = _on(arch.batch(model.config), "tpu")
        with torch.no_grad():
            output = torch.compile(model, backend=counting_backend)(**batch)
        return _outputs(output)
    finally:
        breaks = counters["graph_break"]
        outcome.graphs = len(graphs)
        outcome.graph_breaks = sum(breaks.values())
        outcome.break_reasons = [_break_reason(reason) for reason in breaks]
        torch._dynamo.reset()


_RUNNERS = {
    "forward": _run_forward,
    "train": _run_train,
    "generate": _run_generate,
    "generate_static": _run_generate_static,
}


def _outputs(output) -> dict:
    """The tensors of a model output worth comparing: loss and logits of any kind."""
    keys = ("loss", "logits", "logits_per_image", "logits_per_text")
    return {k: output[k].detach() for k in keys if output.get(k) is not None}


def _on(batch: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _to_cpu(result: dict) -> dict:
    for name, value in result.items():
        if value.device.type != "tpu":
            raise AssertionError(f"{name} is on {value.device}, not tpu")
    return {name: value.cpu() for name, value in result.items()}


# Note [Judged against float64]
#     Some tiny models are ill-conditioned in training: LeViT's batch norms over a
#     batch of two make float32 gradients on the CPU itself differ from float64 ones
#     by several times their scale. Where tpu and the CPU differ beyond the tolerance,
#     a value is judged as the conformance harness judges 16-bit floats: against the
#     CPU's float64 run, it passes if tpu is no farther from it than the CPU's float32
#     value is (twice that, plus the tolerance).
def _compare(outcome: Outcome, actual: dict, expected: dict, float64: dict | None = None) -> None:
    if actual.keys() != expected.keys():
        missing = sorted(expected.keys() ^ actual.keys())
        outcome.reason = f"different outputs or gradients: {missing[:4]}"
        return
    rtol, atol = TOLERANCE.get(outcome.check, (0.0, 0.0))
    worst, worst_name, failed = 0.0, None, []
    for name, want in expected.items():
        got = actual[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            failed.append(f"{name}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}")
            continue
        diff = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
        if diff > worst or worst_name is None:
            worst, worst_name = diff, name
        # Relative to the tensor's scale: gradients range over orders of magnitude.
        scale = want.double().abs().max().item() if want.numel() else 0.0
        if diff <= atol + rtol * scale:
            continue
        exact = float64.get(name) if float64 else None
        if exact is not None and exact.shape == want.shape:
            ours = (got.double() - exact).abs().max().item()
            cpus = (want.double() - exact).abs().max().item()
            if ours <= 2 * cpus + atol + rtol * scale:
                continue
            failed.append(
                f"{name} differs by {diff:.3g} (scale {scale:.3g}); from float64 by "
                f"{ours:.3g}, the CPU's float32 by {cpus:.3g}"
            )
            continue
        failed.append(f"{name} differs by {diff:.3g} (scale {scale:.3g})")
    outcome.max_abs_diff = worst
    if failed:
        outcome.reason = "; ".join(failed[:3]) + (
            f" (+{len(failed) - 3} more)" if len(failed) > 3 else ""
        )
    else:
        outcome.passed, outcome.reason = True, ""


def _break_reason(text: str) -> str:
    """Dynamo's graph-break message, short: what broke and where it was (its
    "Developer debug context" names the op or the function)."""
    context = [
        line.split(":", 1)[1].strip()
        for line in str(text).splitlines()
        if line.strip().startswith("Developer debug context:") and line.split(":", 1)[1].strip()
    ]
    return _first_lines(text) + (f" ({context[0][:160]})" if context else "")


def _first_lines(text, n: int = 1) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return " ".join(lines[:n])[:300]


def _crash_reason(error: Exception) -> str:
    """The exception and the innermost torchtpu/transformers frame that raised it."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if "torchtpu" in f.filename or "transformers" in f.filename
    ]
    where = (
        f" at {frames[-1].filename.split('site-packages/')[-1].split('src/')[-1]}:{frames[-1].lineno}"
        if frames
        else ""
    )
    message = _first_lines(error)
    explanation = [line for line in str(error).splitlines() if "Explanation:" in line]
    if explanation:  # Dynamo's first line is generic; its explanation names the op
        message += " " + explanation[0].strip()[:400]
    return f"{type(error).__name__}: {message}{where}"
