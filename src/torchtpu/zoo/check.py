"""Run a zoo architecture on tpu and on the CPU and compare.

Three checks, each giving an :class:`Outcome`:

- ``forward``: eval-mode forward; logits and loss.
- ``train``: train-mode forward, ``loss.backward()`` and one ``torch.optim.AdamW``
  step; loss, logits, every parameter's gradient, and the updated parameters
  against the CPU's step from the same gradients (see ``_cpu_step_with``).
- ``generate``: greedy ``generate()`` with the KV cache (causal LMs); the tokens.

The CPU side runs once per architecture (cached); the tpu side runs on a deep copy
of the same CPU model moved with ``.to("tpu")``, in the eager mode asked for.
"""

from __future__ import annotations

import copy
import functools
import time
import traceback
from dataclasses import dataclass, field

import torch

import torchtpu
from torchtpu.zoo import Arch

CHECKS = ("forward", "train", "generate")
MODES = ("strict", "defer")

# float32 on both sides, but XLA fuses and reorders reductions differently from ATen.
TOLERANCE = {"forward": (1e-4, 1e-4), "train": (1e-3, 1e-4)}  # (rtol, atol), scaled below
NEW_TOKENS = 6


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


def applicable(arch: Arch, check: str) -> bool:
    return check != "generate" or arch.generate


def run(arch: Arch, check: str, mode: str) -> Outcome:
    """Run one check; a crash on tpu is an outcome, not an exception."""
    outcome = Outcome(arch.name, check, mode)
    expected = _cpu_reference(arch, check)
    torchtpu.reset_metrics()
    start = time.perf_counter()
    try:
        with torchtpu.set_eager_mode(mode):
            actual = _RUNNERS[check](arch, "tpu")
            actual = _to_cpu(actual)
    except Exception as error:  # noqa: BLE001 - the report records any failure
        outcome.crashed = True
        outcome.reason = _crash_reason(error)
    else:
        if check == "train":
            expected = {**expected, **_cpu_step_with(arch, actual)}
        _compare(outcome, actual, expected)
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
    batch = _on(arch.batch(model.config), device)
    output = model(**batch)
    output.loss.backward()
    result = _outputs(output)
    named = dict(model.named_parameters())
    result.update({f"grad {n}": p.grad for n, p in named.items() if p.grad is not None})
    _adamw(model).step()
    result.update({f"step {n}": p.detach() for n, p in named.items()})
    return result


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


def _run_generate(arch: Arch, device: str) -> dict:
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
    )
    return {"tokens": tokens}


_RUNNERS = {"forward": _run_forward, "train": _run_train, "generate": _run_generate}


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


def _compare(outcome: Outcome, actual: dict, expected: dict) -> None:
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
        if not diff <= atol + rtol * scale:
            failed.append(f"{name} differs by {diff:.3g} (scale {scale:.3g})")
    outcome.max_abs_diff = worst
    if failed:
        outcome.reason = "; ".join(failed[:3]) + (
            f" (+{len(failed) - 3} more)" if len(failed) > 3 else ""
        )
    else:
        outcome.passed = True


def _crash_reason(error: Exception) -> str:
    """The exception and the innermost torchtpu/transformers frame that raised it."""
    message = str(error).strip().splitlines()
    first = message[0][:300] if message else ""
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
    return f"{type(error).__name__}: {first}{where}"
