"""XLA:TPU's compiler, without a TPU (conformance/xla_tpu.py): the programs of the kinds
that abort a TPU process or that XLA:TPU refuses never reach it under the platform
policy, and do reach it -- and abort the compiler -- without the policy. The first
half is what keeps a notebook's kernel alive on a TPU; the second shows the check can
fail.

Needs libtpu, kept off this process's path (.ci/run installs it into .venv/libtpu).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torchtpu.conformance import xla_tpu
from torchtpu.runtime import platform

pytestmark = [
    pytest.mark.skipif(
        not xla_tpu.available(),
        reason="needs libtpu: pip install --target .venv/libtpu 'libtpu==0.0.42.*' "
        "(as .ci/run does)",
    ),
    pytest.mark.skipif(
        platform() == "tpu", reason="on a TPU the chip itself is the check (tests/on_device.py)"
    ),
]

# One program of each kind the platform sweep found XLA:TPU aborting on or refusing
# (docs/tpu.md), with everyday float32 and int64 ops beside them.
PROGRAMS = r"""
import json, sys, warnings
import torch, torchtpu
from torchtpu.conformance import xla_tpu
from torchtpu.runtime import platform

def programs():
    c = torch.tensor([1 + 2j, -3j], dtype=torch.complex128, device="tpu")
    yield "complex128 abs", lambda: c.abs()
    yield "complex128 += int", lambda: c.clone().add_(1)
    yield "complex128 flip", lambda: c.flip(0)
    yield "complex128 from float64", lambda: torch.ones(2, dtype=torch.float64, device="tpu").to(torch.complex128)
    z = torch.ones(2, 2, dtype=torch.complex64, device="tpu")
    yield "complex64 addmm", lambda: torch.addmm(z, z, z, beta=1j, alpha=2)
    d = torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64, device="tpu")
    yield "float64 sort", lambda: torch.sort(d)
    yield "float64 floor_divide", lambda: torch.floor_divide(d, 2)
    yield "float64 fft", lambda: torch.fft.fft(d)
    i = torch.ones(2, 2, dtype=torch.int64, device="tpu")
    yield "int64 matmul", lambda: i @ i
    x = torch.randn(4, 4, device="tpu")
    yield "float32 matmul", lambda: x @ x
    yield "float32 eig", lambda: torch.linalg.eig(x)
    yield "float32 svd", lambda: torch.linalg.svd(x)
    yield "float32 lstsq", lambda: torch.linalg.lstsq(x, x)
    yield "int64 arithmetic", lambda: (i * 3 + 2**40) // 7
    # float32 ops whose lowerings once built float64 arrays (a probability, a fill
    # value, a range's steps), and so ran on the host on a TPU
    yield "float32 dropout", lambda: torch.nn.functional.dropout(x, 0.1, True)
    yield "float32 bernoulli_", lambda: x.clone().bernoulli_(0.3)
    yield "float32 full", lambda: torch.full((3,), 0.3, device="tpu")
    yield "float32 full_like", lambda: torch.full_like(x, 0.3)
    yield "float32 new_full", lambda: x.new_full((3,), 0.3)
    yield "float32 arange", lambda: torch.arange(0, 1, 0.1, device="tpu")
    yield "float32 linspace", lambda: torch.linspace(0, 1, 5, device="tpu")
    yield "float32 angle", lambda: x.angle()

def main():
    warnings.simplefilter("ignore")
    compiler = xla_tpu.Compiler()
    out = {}
    for name, fn in programs():
        with xla_tpu.watch(compiler) as verdicts:
            result = fn()
            torchtpu.dispatch.values.materialize(result[0] if isinstance(result, tuple) else result)
        out[name] = [(v.name, v.outcome) for v in verdicts]
    compiler.close()
    print(json.dumps(out))

if __name__ == "__main__":
    main()
"""


def _verdicts(policy: str, tmp_path) -> dict:
    script = tmp_path / "programs.py"
    script.write_text(PROGRAMS)
    env = dict(os.environ, TORCHTPU_PLATFORM_POLICY=policy, JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_under_the_tpu_policy_nothing_reaches_xla_tpu_that_it_aborts_on_or_refuses(tmp_path):
    verdicts = _verdicts("tpu", tmp_path)
    bad = {name: v for name, v in verdicts.items() if any(o != "ok" for _, o in v)}
    assert not bad, bad
    # what stays on the device was compiled for it
    for name in (
        "float32 matmul",
        "int64 arithmetic",
        "float32 dropout",
        "float32 bernoulli_",
        "float32 full",
        "float32 full_like",
        "float32 new_full",
        "float32 arange",
        "float32 linspace",
        "float32 angle",
    ):
        assert verdicts[name] and all(o == "ok" for _, o in verdicts[name]), name


def test_without_the_policy_xla_tpu_aborts(tmp_path):
    verdicts = _verdicts("none", tmp_path)
    outcomes = {name: {o for _, o in v} for name, v in verdicts.items()}
    assert "abort" in outcomes["complex128 abs"]
    assert "abort" in outcomes["complex64 addmm"]
    assert "abort" in outcomes["float32 svd"]
    assert "abort" in outcomes["float32 lstsq"]
    assert "error" in outcomes["int64 matmul"]
    assert outcomes["float32 matmul"] == {"ok"}


def test_the_pallas_softmax_compiles_for_a_tpu(monkeypatch):
    """Note [Pallas kernels trace in 32 bits]: with 64-bit types on, the kernels'
    index maps returned int64 and Mosaic failed to compile them on the chip."""
    import jax
    import jax.numpy as jnp

    from torchtpu.interop import pallas

    monkeypatch.setattr(pallas, "_interpret", lambda: False)  # Mosaic, as on a TPU
    x = jnp.ones((16, 128), jnp.float32)
    compiler = xla_tpu.Compiler()
    try:
        for kernel in (lambda x: pallas._forward(-1, x), lambda x: pallas._backward(0, x, x)):
            text = jax.jit(kernel).trace(x).lower(lowering_platforms=("tpu",)).as_text()
            assert compiler.compile(text) == ("ok", "")
    finally:
        compiler.close()
