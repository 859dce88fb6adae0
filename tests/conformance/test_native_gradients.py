"""Gradients of ops whose backward ops have lowerings of their own (grid sampling,
anti-aliased and nearest-exact upsampling, adaptive max pooling): they must match CPU
autograd without reaching the CPU fallback. The default conformance run checks
forward values only."""

from __future__ import annotations

import pytest
import torch

from torchtpu.conformance import expectations, harness

OPS = [
    "nn.functional.grid_sample",
    "grid_sampler_3d",
    "_upsample_bilinear2d_aa",
    "nn.functional.interpolate.nearest-exact",
    "nn.functional.adaptive_max_pool3d",
]


@pytest.mark.parametrize("name", OPS)
def test_gradient_matches_cpu_natively(name):
    case = harness.Case(name, "op", torch.float32, "grad", "strict")
    expected = expectations.lookup(name, "op", torch.float32, "grad", "strict")
    tolerance = (expected.rtol, expected.atol) if expected is not None else (None, None)
    result = harness.run(case, tolerance, max_samples=3)
    assert result.outcome == "pass", result.detail
    assert result.samples > 0
    assert not result.fallbacks, f"ran on the CPU fallback: {result.fallbacks}"
