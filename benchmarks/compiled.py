"""The compiled paths side by side with the eager modes and pure JAX.

    python benchmarks/compiled.py            # medians of several runs
    python benchmarks/compiled.py --quick    # fewer, shorter runs
    python benchmarks/compiled.py --only transformer   # the workloads whose name has it

Workloads: the MLP training step (512->1024->10, SGD) at batch 64 and 1024 and the
small transformer training step (benchmarks/eager_modes.py). Columns: Strict and
DeferAndFuse eager; ``torch.compile(model, backend="tpu")`` (forward and backward are
XLA programs, the optimizer runs eagerly), with the optimizer step fused by
DeferAndFuse (compile+Defer) or compiled too (compile+opt: ``torch.compile(opt.step)``);
``torchtpu.jit`` (the whole step is one program); the same step written in JAX under
one ``jax.jit`` (the floor). Every step ends by reading the loss (``.item()``), as a
training loop that logs does. Then the first call of each compiled path (two for
torchtpu.jit, whose first call runs eagerly): tracing and compiling its programs, with
JAX's persistent compile cache off.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchtpu  # noqa: E402
from benchmarks import quiet  # noqa: E402
from benchmarks.eager_modes import (  # noqa: E402
    _us,
    compare,
    jax_mlp_step_fn,
    jax_transformer_step_fn,
    mlp_step_fn,
    runtime_line,
    transformer_step_fn,
)

# First calls compile from scratch: no programs from JAX's persistent cache.
torchtpu.config.compile_cache_dir = None

WORKLOADS = {
    "MLP SGD step, batch 64": (
        lambda how: mlp_step_fn("tpu", 64, how),
        lambda: jax_mlp_step_fn(64),
    ),
    "MLP SGD step, batch 1024": (
        lambda how: mlp_step_fn("tpu", 1024, how),
        lambda: jax_mlp_step_fn(1024),
    ),
    "transformer step": (lambda how: transformer_step_fn("tpu", how=how), jax_transformer_step_fn),
}


def main():
    print(runtime_line())
    quiet.check_before_start()
    window = quiet.Window()
    print(f"\n`{quiet.command()}`: per step, every step reading its loss\n")
    print(
        "| workload | Strict | Defer | torch.compile | compile+Defer | compile+opt | torchtpu.jit "
        "| jax.jit | compile/jax | compile+Defer/jax | compile+opt/jax | jit/jax "
        "| first call: compile | first call: jit |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
    for name, (make_step, make_jax_step) in WORKLOADS.items():
        if only not in name:
            continue
        first = {}
        contenders = {
            "Strict": (make_step("eager"), "strict"),
            "Defer": (make_step("eager"), "defer"),
        }
        for how in ("compile", "compile+opt", "jit"):
            torch._dynamo.reset()
            step = make_step(how)
            start = time.perf_counter()
            step()
            if how == "jit":
                step()  # torchtpu.jit runs its first call eagerly and traces on the second
            first[how] = time.perf_counter() - start
            print(f"  {name}: first call of {how}: {first[how]:.1f} s", file=sys.stderr, flush=True)
            contenders[how] = (step, "strict")
            if how == "compile":
                # The compiled model with the optimizer step (plain torch code) fused by
                # DeferAndFuse instead of run op by op.
                contenders["compile+defer"] = (step, "defer")
        contenders["jax.jit"] = (make_jax_step(), None)
        times = compare(contenders)
        floor = times["jax.jit"]
        print(
            f"| {name} | {_us(times['Strict'])} | {_us(times['Defer'])} | {_us(times['compile'])} "
            f"| {_us(times['compile+defer'])} | {_us(times['compile+opt'])} | {_us(times['jit'])} "
            f"| {_us(floor)} | {times['compile'] / floor:.2f}x "
            f"| {times['compile+defer'] / floor:.2f}x | {times['compile+opt'] / floor:.2f}x "
            f"| {times['jit'] / floor:.2f}x | {first['compile']:.1f} s | {first['jit']:.1f} s |",
            flush=True,
        )
    print(f"\n{window.verdict()}", flush=True)


if __name__ == "__main__":
    main()
