"""Where a small training step's time goes, path by path: per-step time, the host's
waits for the device, and a cProfile of the step.

    python benchmarks/step_profile.py                       # MLP and transformer, every path
    python benchmarks/step_profile.py --workloads mlp --paths defer,jit
    python benchmarks/step_profile.py --profile /tmp/prof   # one cProfile report per row

The workloads and paths are `compiled.py`'s (the MLP SGD step at batch 64, the small
transformer step; Strict, DeferAndFuse, ``torch.compile(model)``, ``torchtpu.jit``,
``jax.jit``), each step reading its loss. A row is the median of 5 runs of 30 steps
after 4 warm-up steps, with ``reads`` (torchtpu.metrics: the host's waits for device
values) per step. Meant for the device: on a TPU each wait and each program launch is a
fixed cost the profile shows. cProfile sees only the calling thread: backward ops run on
the autograd engine's device thread and appear as time inside ``run_backward``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchtpu  # noqa: E402
from benchmarks.eager_modes import (  # noqa: E402
    jax_mlp_step_fn,
    jax_transformer_step_fn,
    mlp_step_fn,
    runtime_line,
    transformer_step_fn,
)

PATHS = ("jax", "strict", "defer", "compile", "jit")  # jax first: the ratios divide by it


def make_step(workload: str, path: str):
    if path == "jax":
        return jax_mlp_step_fn(64) if workload == "mlp" else jax_transformer_step_fn()
    how = "eager" if path in ("strict", "defer") else path
    if workload == "mlp":
        return mlp_step_fn("tpu", 64, how)
    return transformer_step_fn("tpu", how=how)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,transformer")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--profile", help="a folder for one cProfile report per row")
    args = parser.parse_args(argv)
    print(runtime_line())
    print("\n| workload | path | per step | runs (us) | reads a step | vs jax.jit |")
    print("|---|---|---|---|---|---|")
    for workload in args.workloads.split(","):
        floor = None
        for path in args.paths.split(","):
            torch._dynamo.reset()
            with torch.tpu.set_eager_mode("defer" if path == "defer" else "strict"):
                step = make_step(workload, path)
                for _ in range(4):
                    step()
                torchtpu.reset_metrics()
                runs = []
                for _ in range(5):
                    start = time.perf_counter()
                    for _ in range(30):
                        step()
                    runs.append((time.perf_counter() - start) / 30)
                reads = torchtpu.metrics().get("reads", {}).get("waits", 0) / 150
                per_step = statistics.median(runs)
                floor = per_step if path == "jax" else floor
                ratio = f"{per_step / floor:.2f}x" if floor else ""
                print(
                    f"| {workload} | {path} | {per_step * 1e6:.0f} us "
                    f"| {', '.join(f'{r * 1e6:.0f}' for r in runs)} "
                    f"| {'' if path == 'jax' else f'{reads:g}'} | {ratio} |",
                    flush=True,
                )
                if args.profile:
                    _profile(step, os.path.join(args.profile, f"{workload}_{path}.txt"))


def _profile(step, path: str) -> None:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(100):
        step()
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text.getvalue())


if __name__ == "__main__":
    main()
