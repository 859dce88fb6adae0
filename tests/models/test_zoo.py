"""Hugging Face Transformers architectures on tpu match the same models on the CPU.

The zoo (``torchtpu.zoo``) builds each model from a tiny config with random weights;
nothing is downloaded. The default run covers ``torchtpu.zoo.DEFAULT`` (one
architecture of each family) in every eager check and mode, plus
``torchtpu.zoo.DEFAULT_EXTRA`` (torch.compile, the static cache) for a few of them;
``TORCHTPU_ZOO=full`` runs every architecture in every column of docs/models.md.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")

from torchtpu.zoo import ARCHS, DEFAULT, DEFAULT_EXTRA  # noqa: E402
from torchtpu.zoo.check import applicable, columns, run  # noqa: E402

FULL = os.environ.get("TORCHTPU_ZOO", "").lower() == "full"


def _selected(arch, check) -> bool:
    if FULL:
        return True
    return arch.name in DEFAULT_EXTRA.get(check, DEFAULT)


CASES = [
    pytest.param(arch, check, mode, id=f"{arch.name}-{check}-{mode}")
    for arch in ARCHS
    for check, mode in columns()
    if applicable(arch, check) and _selected(arch, check)
]


# Fallbacks are allowed (and counted in docs/models.md); results must still match.
@pytest.mark.allow_fallback
@pytest.mark.parametrize("arch, check, mode", CASES)
def test_matches_cpu(arch, check, mode):
    outcome = run(arch, check, mode)
    assert outcome.passed, f"{arch.name} {check} ({mode}): {outcome.reason}"
    if check == "compile":
        assert outcome.graph_breaks == 0, outcome.break_reasons


def test_an_ill_conditioned_value_is_judged_against_float64():
    # Note [Judged against float64]: beyond the tolerance of the CPU's float32 value,
    # tpu passes if it is no farther from the float64 value than that float32 one is.
    import torch

    from torchtpu.zoo.check import Outcome, _compare

    exact = {"grad w": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    cpu = {"grad w": torch.tensor([1.5, 2.0])}  # the CPU's float32 is 0.5 off
    for tpu, passes in ((torch.tensor([0.8, 2.0]), True), (torch.tensor([3.0, 2.0]), False)):
        outcome = Outcome("tiny", "train", "strict")
        _compare(outcome, {"grad w": tpu}, cpu)
        assert not outcome.passed  # beyond float32 tolerance of the CPU's value
        _compare(outcome, {"grad w": tpu}, cpu, exact)
        assert outcome.passed is passes, outcome.reason
        assert ("float64" in outcome.reason) is not passes
