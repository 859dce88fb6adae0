"""One command that says whether torchtpu works on this machine's device, and how fast.

    python benchmarks/device_check.py              # on a TPU: at most ~8 minutes
    python benchmarks/device_check.py --smoke      # the same parts, tiny (CI, on the CPU)

In one process (a TPU admits one): the README's demo in Strict and DeferAndFuse (first
step, then per step), the platform policy's routes (float64 and complex128 on the host,
an int64 matmul; docs/tpu.md), a core subset of the test suite (tests/on_device.py,
stopped after ``--suite-minutes``), the cost of one op in each eager mode against a
pre-jitted JAX op, and the MLP and transformer training steps against the same step in
JAX. It ends with one summary line; the exit status is 1 if anything failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import torchtpu  # noqa: E402

#: The suite's core subset: training in every mode, the queue, precision and autocast,
#: random numbers, the platform policy, and views written through (where a TPU aborted).
CORE = [
    "tests/test_tpu_policy.py",
    "tests/test_precision_autocast.py",
    "tests/test_views.py::test_write_base_read_view",
    "tests/test_defer.py",
    "tests/test_rng.py",
    "tests/test_training.py",
]
SMOKE = ["tests/test_tpu_policy.py"]


def demo(mode: str, steps: int) -> dict:
    """The README's MLP in ``mode``: first step and later steps, losses finite."""
    import torch.nn as nn
    import torch.nn.functional as F

    with torchtpu.set_eager_mode(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10)).to("tpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(64, 512, device="tpu")
        y = torch.randint(0, 10, (64,), device="tpu")
        losses, times = [], []
        for _ in range(steps):
            start = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            times.append(time.perf_counter() - start)
    later = sorted(times[1:])
    return {
        "first_step_s": round(times[0], 3),
        "step_ms": round(1e3 * later[len(later) // 2], 2) if later else None,
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "ok": all(v == v for v in losses) and losses[-1] < losses[0],
    }


def policy_routes() -> dict:
    """float64 and complex128 keep their values (on the host, on a TPU); an int64
    matmul is exact; what ran where."""
    from torchtpu.runtime import policy

    torchtpu.reset_metrics()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        big = torch.tensor([1e300, 1 / 3, -2.5], dtype=torch.float64)
        f64 = (big.to("tpu") * 3).cpu()
        c = torch.tensor([1 + 2j, 3 - 1e200j], dtype=torch.complex128)
        c128 = (c.to("tpu") * c.to("tpu")).abs().cpu()
        i = torch.arange(12, dtype=torch.int64).reshape(3, 4) + 2**40
        s = torch.arange(8, dtype=torch.int64).reshape(4, 2)
        mm = (i.to("tpu") @ s.to("tpu")).cpu()
    return {
        "float64": torch.equal(f64, big * 3),
        "complex128": torch.allclose(c128, (c * c).abs()),
        "int64 matmul": torch.equal(mm, i @ s),
        "host_ops": dict(torchtpu.metrics().get("host_ops", {})),
        "policy": "on" if policy.active() else "off",
    }


def suite(paths: list[str], minutes: float) -> dict:
    """The subset in this process (tests/on_device.py), stopped after ``minutes``."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import on_device

    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.jsonl")
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            on_device.main(["--results", results, "--minutes", str(minutes), *paths])
        finally:
            os.chdir(cwd)
        records = on_device.load(results)
    counts: dict[str, int] = {}
    for row in records.values():
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    bad = {
        i: r.get("detail", "")
        for i, r in records.items()
        if r["outcome"] in ("failed", "error", "aborted")
    }
    return {"counts": counts, "not_passing": bad, "ok": not bad}


def speed(quick: bool) -> dict:
    """Per-op cost and training steps, each mode against jax.jit (medians)."""
    from benchmarks import eager_modes as em

    em.REPEAT, em.MIN_TIME = (2, 0.05) if quick else (5, 0.2)
    out: dict = {}
    import jax

    jadd = jax.jit(lambda a, b: a + b)
    ja = jax.numpy.ones((64, 64), jax.numpy.float32)
    t = torch.ones(64, 64, device="tpu")

    def tpu_chain():
        z = t
        for _ in range(em.CHAIN):
            z = z + t
        jax.block_until_ready(torchtpu.dispatch.values.materialize(z))

    def jax_chain():
        z = ja
        for _ in range(em.CHAIN):
            z = jadd(z, ja)
        z.block_until_ready()

    times = em.compare({"jax.jit": (jax_chain, None), "Strict": (tpu_chain, "strict")})
    out["per_op_us"] = {k: round(v / em.CHAIN * 1e6, 1) for k, v in times.items()}
    workloads = {
        "MLP step, batch 64": (em.mlp_step_fn("tpu", 64), em.jax_mlp_step_fn(64)),
        "transformer step": (em.transformer_step_fn("tpu"), em.jax_transformer_step_fn()),
    }
    for name, (step, jax_step) in workloads.items():
        times = em.compare(
            {"Strict": (step, "strict"), "Defer": (step, "defer"), "jax.jit": (jax_step, None)}
        )
        out[name] = {k: round(v * 1e3, 2) for k, v in times.items()}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny: checks that it runs")
    parser.add_argument("--suite-minutes", type=float, default=3.0)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    from torchtpu.runtime import device_name, platform

    start = time.perf_counter()
    x = torch.ones(1, device="tpu")  # starts the device
    print(f"device: {device_name()} ({platform()}); torch {torch.__version__}", flush=True)
    del x
    steps = 3 if args.smoke else 20
    parts = {
        "demo strict": lambda: demo("strict", steps),
        "demo defer": lambda: demo("defer", steps),
        "policy": policy_routes,
        "suite": lambda: suite(SMOKE if args.smoke else CORE, args.suite_minutes),
        "speed": lambda: speed(args.smoke),
    }
    results, failed = {}, []
    for name, part in parts.items():
        t0 = time.perf_counter()
        try:
            results[name] = part()
        except Exception as exc:
            traceback.print_exc()
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        results[name]["seconds"] = round(time.perf_counter() - t0, 1)
        ok = results[name].get("ok", all(v for v in results[name].values() if isinstance(v, bool)))
        if not ok:
            failed.append(name)
        print(f"\n== {name}: {json.dumps(results[name])}", flush=True)
    total = time.perf_counter() - start
    counts = results["suite"].get("counts", {})
    strict, defer = results["demo strict"], results["demo defer"]
    print(
        f"\nSUMMARY {'PASS' if not failed else 'FAIL: ' + ', '.join(failed)} on {device_name()} "
        f"in {total:.0f} s | demo first step {strict.get('first_step_s')} s, then "
        f"{strict.get('step_ms')} ms (Strict), {defer.get('step_ms')} ms (Defer) | suite "
        + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        + f" | one op {results['speed'].get('per_op_us', {})} us"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
