"""Matmul precision: follows ``torch.get_float32_matmul_precision()``.

torch's "highest" (its default) maps to XLA's HIGHEST, "high" to HIGH and "medium" to
DEFAULT (one bfloat16 pass on a TPU). ``torch.tpu.precision(...)`` overrides it::

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
    return Precision(torch.get_float32_matmul_precision())


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
