"""First steps: what a new process pays before its first training step is done.

    python benchmarks/first_steps.py                          # every workload installed
    python benchmarks/first_steps.py --workloads mlp,llama --paths strict,jit
    python benchmarks/first_steps.py --tiny                   # the smoke size CI runs

Each cell is a fresh process (a notebook's first cell): it builds the model on the CPU,
moves it and a batch to the device, and times the first training step to its loss's
read (forward, backward, AdamW; model and batch creation not counted). Then, in the same
process: a step with a smaller batch (the ragged last batch of an epoch) and, for the
language model, a step with a longer sequence: each a new shape. Every tpu path runs
twice: with JAX's persistent compilation cache empty (cold), then in a new process with
the cache the first one filled (warm). Columns: wall seconds, XLA programs compiled and
the seconds spent compiling them (torchtpu.metrics; compiles on worker threads overlap,
so this can exceed the wall time), for Strict, Strict compiling each op's program in the
call ("strict-inline": ``config.background_compiles = False``), DeferAndFuse and
``torchtpu.jit`` (its first step is its first two calls: one eager, finding the state,
then the trace and compile of the whole step as one program), beside torch's CPU first
step. The last column is a second step of the first shape (DeferAndFuse compiles a
second chunk there: the optimizer's state exists from then on). Workloads: the demo MLP (512-1024-10), the zoo's tiny Llama (transformers), a
Diffusers ``UNet2DModel`` and timm's MobileNetV3 (each skipped, saying so, where its
library is not installed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.cells import run_cell  # noqa: E402

WORKLOADS = ("mlp", "llama", "unet2d", "mobilenetv3")
PATHS = ("cpu", "strict", "strict-inline", "defer", "jit")
_LIBRARY = {"llama": "transformers", "unet2d": "diffusers", "mobilenetv3": "timm"}


def _model_and_batches(workload: str, tiny: bool):
    """(model on the CPU, a function batch(size, length) -> (inputs, loss function),
    batch size, sequence length or None)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    if workload == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
        )

        def batch(n, _):
            x, y = torch.randn(n, 512), torch.randint(0, 10, (n,))
            return (x, y), lambda m, x, y: F.cross_entropy(m(x), y)

        return model, batch, 64, None
    if workload == "llama":
        from torchtpu.zoo import ARCHS

        arch = next(a for a in ARCHS if a.name == "llama")
        config = arch.build_config()
        model = arch.build().train()

        def batch(n, length):
            ids = torch.randint(3, config.vocab_size, (n, length))
            return (ids,), lambda m, ids: m(input_ids=ids, labels=ids).loss

        return model, batch, 4, 16 if tiny else 32
    if workload == "unet2d":
        from diffusers import UNet2DModel

        size = 16 if tiny else 32
        model = UNet2DModel(
            sample_size=size, in_channels=3, out_channels=3, layers_per_block=1,
            block_out_channels=(16, 32), norm_num_groups=8,
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        )  # fmt: skip

        def batch(n, _):
            x, t = torch.randn(n, 3, size, size), torch.randint(0, 1000, (n,))
            noise = torch.randn(n, 3, size, size)
            return (x, t, noise), lambda m, x, t, noise: F.mse_loss(m(x, t).sample, noise)

        return model, batch, 4, None
    if workload == "mobilenetv3":
        import timm

        model = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=10)
        size = 32 if tiny else 64

        def batch(n, _):
            x, y = torch.randn(n, 3, size, size), torch.randint(0, 10, (n,))
            return (x, y), lambda m, x, y: F.cross_entropy(m(x), y)

        return model, batch, 8, None
    raise ValueError(workload)


def child(workload: str, path: str, tiny: bool) -> dict:
    """One cell, in this (fresh) process."""
    import torch

    import torchtpu

    device = "cpu" if path == "cpu" else "tpu"
    if path == "defer":
        torch.tpu.set_eager_mode("defer")
    if path == "strict-inline":  # each op compiles before it returns, as before 2026-12-07
        torchtpu.config.background_compiles = False
    model, batch, size, length = _model_and_batches(workload, tiny)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(*inputs, loss_of):
        opt.zero_grad()
        loss = loss_of(model, *inputs)
        loss.backward()
        opt.step()
        return loss

    whole_step = torchtpu.jit(step) if path == "jit" else step
    calls = [2 if path == "jit" else 1]  # torchtpu.jit's first call runs eagerly

    def run(n, seq) -> float:
        """Seconds for one step on a new batch of (n, seq), its loss read."""
        inputs, loss_of = batch(n, seq)
        inputs = [t.to(device) for t in inputs]
        if device == "tpu":
            torch.tpu.synchronize()
        start = time.perf_counter()
        for _ in range(calls[0]):
            whole_step(*inputs, loss_of=loss_of).item()
        calls[0] = 1
        return time.perf_counter() - start

    torchtpu.reset_metrics()
    result = {"first": run(size, length)}
    metrics = torchtpu.metrics()
    result["programs"] = sum(metrics.get("compiles", {}).values())
    result["compile_s"] = sum(metrics.get("compile_seconds", {}).values())
    result["steady"] = run(size, length)
    result["ragged"] = run(size - 3, length)
    if length is not None:
        result["longer"] = run(size, length * 2)
    return result


def _cell(workload: str, path: str, cache: str | None, tiny: bool) -> dict:
    env = dict(os.environ)
    env["TORCHTPU_COMPILE_CACHE_DIR"] = cache or "0"
    env.setdefault("PYTHONPATH", os.path.join(ROOT, "src"))
    arguments = ["--child", workload, path] + (["--tiny"] if tiny else [])
    return run_cell(__file__, arguments, env, ROOT)


def _seconds(value) -> str:
    return "" if value is None else f"{value:.2f} s"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--tiny", action="store_true", help="smaller inputs (CI's smoke run)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.tiny)))
        return

    import importlib.util

    import jax
    import torch

    print(f"torch {torch.__version__}, jax {jax.__version__}; {os.cpu_count()} cores")
    print(f"\n`python benchmarks/first_steps.py {' '.join(sys.argv[1:])}`".rstrip() + "\n")
    print(
        "| workload | path | first step: cold | warm cache | warm/cold | programs | compiling "
        "| vs jit, cold | ragged batch | longer sequence | second step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for workload in args.workloads.split(","):
        library = _LIBRARY.get(workload)
        if library and importlib.util.find_spec(library) is None:
            print(f"| {workload} | (skipped: {library} is not installed) |||||||||")
            continue
        cells = {}
        for path in args.paths.split(","):
            if path == "cpu":
                cells[path] = (_cell(workload, path, None, args.tiny), None)
                continue
            with tempfile.TemporaryDirectory() as cache:
                cold = _cell(workload, path, cache, args.tiny)
                cells[path] = (cold, _cell(workload, path, cache, args.tiny))
        jit_cold = cells.get("jit", ({}, None))[0].get("first")
        for path, (cold, warm) in cells.items():
            if "error" in cold:
                print(f"| {workload} | {path} | failed: {cold['error']} |||||||||")
                continue
            warm_first = (warm or {}).get("first")
            tpu = path != "cpu"
            warm_ratio = f"{warm_first / cold['first']:.2f}" if warm_first else ""
            jit_ratio = f"{cold['first'] / jit_cold:.2f}" if jit_cold and tpu else ""
            print(
                f"| {workload} | {path} | {_seconds(cold['first'])} | {_seconds(warm_first)} "
                f"| {warm_ratio} | {cold['programs'] if tpu else ''} "
                f"| {_seconds(cold['compile_s']) if tpu else ''} | {jit_ratio} "
                f"| {_seconds(cold['ragged'])} | {_seconds(cold.get('longer'))} "
                f"| {_seconds(cold['steady'])} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
