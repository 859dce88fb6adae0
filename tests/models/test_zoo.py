"""Hugging Face Transformers architectures on tpu match the same models on the CPU.

The zoo (``torchtpu.zoo``) builds each model from a tiny config with random weights;
nothing is downloaded. The default run covers ``torchtpu.zoo.DEFAULT``
(one architecture of each family); ``TORCHTPU_ZOO=full`` runs all of them.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")

from torchtpu.zoo import ARCHS, DEFAULT  # noqa: E402
from torchtpu.zoo.check import CHECKS, MODES, applicable, run  # noqa: E402

FULL = os.environ.get("TORCHTPU_ZOO", "").lower() == "full"
SELECTED = [arch for arch in ARCHS if FULL or arch.name in DEFAULT]

CASES = [
    pytest.param(arch, check, mode, id=f"{arch.name}-{check}-{mode}")
    for arch in SELECTED
    for check in CHECKS
    if applicable(arch, check)
    for mode in MODES
]


# Fallbacks are allowed (and counted in docs/models.md); results must still match.
@pytest.mark.allow_fallback
@pytest.mark.parametrize("arch, check, mode", CASES)
def test_matches_cpu(arch, check, mode):
    outcome = run(arch, check, mode)
    assert outcome.passed, f"{arch.name} {check} ({mode}): {outcome.reason}"
