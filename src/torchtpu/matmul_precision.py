"""Matmul precision: follows ``torch.get_float32_matmul_precision()``.

torch's "highest" (its default) maps to XLA's HIGHEST, "high" to HIGH (three bfloat16
passes on a TPU) and "medium" to DEFAULT (one bfloat16 pass). The switches GPU users set
map where torch maps them: ``torch.backends.cuda.matmul.allow_tf32 = True`` is "high";
the newer ``torch.backends.cuda.matmul.fp32_precision`` / ``torch.backends.fp32_precision``
("ieee", "tf32", "bf16") are "highest", "high" and "medium". Convolutions follow the
same setting (cuDNN's switches are not mapped: ``cudnn.allow_tf32`` is on by default,
and the CPU, which a tpu result is checked against, computes convolutions exactly).
``torch.tpu.precision(...)`` overrides it::

    with torch.tpu.precision("medium"):
        y = model(x)          # bfloat16 matmul passes on a TPU
"""

from __future__ import annotations

import enum

import torch


class Precision(enum.Enum):
    HIGHEST = "highest"
    HIGH = "high"
    MEDIUM = "medium"
    DEFAULT = "medium"


_override: Precision | None = None


def _parse(mode: Precision | str) -> Precision:
    if isinstance(mode, Precision):
        return mode
    try:
        return Precision(str(mode).lower())
    except ValueError:
        raise ValueError(
            f"unknown precision {mode!r}; expected 'highest', 'high', 'medium' or a torch.tpu.Precision"
        ) from None


def current() -> Precision:
    """The precision matmuls and convolutions use now."""
    if _override is not None:
        return _override
    try:
        return Precision(torch.get_float32_matmul_precision())
    except RuntimeError:
        # torch refuses to read the legacy setting once the fp32_precision API was used
        setting = _fp32_precision("cuda", "matmul")
        if setting == "none":
            setting = _fp32_precision("generic", "all")
        return _FP32_PRECISION.get(setting, Precision.HIGHEST)


_fp32_precision = torch._C._get_fp32_precision_getter
_FP32_PRECISION = {"ieee": Precision.HIGHEST, "tf32": Precision.HIGH, "bf16": Precision.MEDIUM}


def lax_precision(mode: Precision):
    from torchtpu.runtime import jax

    lax = jax().lax
    return {
        Precision.HIGHEST: lax.Precision.HIGHEST,
        Precision.HIGH: lax.Precision.HIGH,
        Precision.MEDIUM: lax.Precision.DEFAULT,
    }[mode]


class precision:
    """Override the matmul precision; as a context manager, only inside the block."""

    def __init__(self, mode: Precision | str):
        global _override
        self._previous = _override
        _override = _parse(mode)

    def __enter__(self) -> precision:
        return self

    def __exit__(self, *exc) -> None:
        global _override
        _override = self._previous
