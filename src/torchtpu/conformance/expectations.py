"""The one table of expected failures, skips and tolerance overrides.

Keyed by (OpInfo name, variant, dtype, check, mode); ``"*"`` matches anything. Each
entry has a reason a user can read. ``xfail`` entries are run anyway: if the case
passes, the suite reports the entry as stale. Only a loud failure (an exception)
can be expected: a silent mismatch is always a bug.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Expectation:
    kind: str  # "xfail": known loud failure; "skip": not run; "tolerance": looser comparison
    reason: str
    rtol: float | None = None
    atol: float | None = None


def xfail(reason: str) -> Expectation:
    return Expectation("xfail", reason)


def skip(reason: str) -> Expectation:
    return Expectation("skip", reason)


def tolerance(rtol: float, atol: float, reason: str) -> Expectation:
    return Expectation("tolerance", reason, rtol, atol)


# (op, variant, dtype, check, mode) -> Expectation
EXPECTATIONS: dict[tuple[str, str, str, str, str], Expectation] = {}


def lookup(op: str, variant: str, dtype: torch.dtype, check: str, mode: str) -> Expectation | None:
    """The most specific entry matching a case, or None."""
    dtype_name = str(dtype).replace("torch.", "")
    for key in (
        (op, variant, dtype_name, check, mode),
        (op, variant, dtype_name, check, "*"),
        (op, variant, "*", check, "*"),
        (op, "*", dtype_name, check, "*"),
        (op, "*", "*", check, "*"),
        (op, "*", "*", "*", "*"),
    ):
        if key in EXPECTATIONS:
            return EXPECTATIONS[key]
    return None
