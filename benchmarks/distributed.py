"""torch.distributed on tpu against torch's own gloo backend, 2 processes, same run.

    python benchmarks/distributed.py [--quick] [--require-quiet]

Starts itself under ``python -m torch.distributed.run --nproc_per_node=2``. Each rank
makes a ``"tpu"`` group (tpu tensors, JAX's collectives over gloo on the CPU backend)
and a ``"gloo"`` group (CPU tensors), and times, per call (median of several rounds):
all_reduce of 4 and of 1M float32, and one DDP step of an MLP (forward, backward with
the gradient all_reduce, SGD) in Strict and DeferAndFuse against DDP on the CPU.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import quiet  # noqa: E402


def _median_per_call(fn, calls: int, rounds: int, sync) -> float:
    times = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def worker(quick: bool) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("tpu")
    import torchtpu

    gloo = dist.new_group(backend="gloo")
    rank = dist.get_rank()
    rounds, calls = (3, 5) if quick else (7, 20)

    def tpu_sync():
        torchtpu.sync()
        dist.barrier()

    def cpu_sync():
        dist.barrier(group=gloo)

    rows = []
    for label, n in [("all_reduce 4 float32", 4), ("all_reduce 1M float32", 1 << 20)]:
        x_tpu = torch.ones(n, device="tpu")
        x_cpu = torch.ones(n)
        dist.all_reduce(x_tpu)  # compile
        dist.all_reduce(x_cpu, group=gloo)
        t_tpu = _median_per_call(lambda x=x_tpu: dist.all_reduce(x), calls, rounds, tpu_sync)
        t_cpu = _median_per_call(
            lambda x=x_cpu: dist.all_reduce(x, group=gloo), calls, rounds, cpu_sync
        )
        rows.append((label, t_tpu, t_cpu))

    def ddp_step_fn(device, group, mode=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
        ).to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        x = torch.randn(64, 256, device=device)
        y = torch.randint(0, 10, (64,), device=device)

        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()

        return step

    for mode in ["strict", "defer"]:
        with torch.tpu.set_eager_mode(mode):
            step = ddp_step_fn("tpu", None)
            step()
            step()
            t_tpu = _median_per_call(step, max(calls // 4, 2), rounds, tpu_sync)
        step = ddp_step_fn("cpu", gloo)
        step()
        t_cpu = _median_per_call(step, max(calls // 4, 2), rounds, cpu_sync)
        rows.append((f"DDP step, MLP 256-512-10, batch 64/rank ({mode})", t_tpu, t_cpu))

    if rank == 0:
        print("\n| measurement (2 processes) | tpu backend | torch gloo (CPU) | ratio |")
        print("|---|---|---|---|")
        for label, t_tpu, t_cpu in rows:
            print(
                f"| {label} | {t_tpu * 1e3:.2f} ms | {t_cpu * 1e3:.2f} ms | {t_tpu / t_cpu:.2f}x |"
            )
        m = torchtpu.metrics()
        print(f"\ncollectives on rank 0: {m.get('collectives')}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    quick = "--quick" in sys.argv
    if "RANK" in os.environ:
        worker(quick)
        return
    import jax
    import torch

    print(f"torch {torch.__version__}, jax {jax.__version__}, 2 processes on the CPU backend")
    quiet.check_before_start()
    window = quiet.Window()
    print(f"\n`{quiet.command()}`: median per call over several rounds")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", "--master_port=29677", os.path.abspath(__file__),
           *sys.argv[1:]]  # fmt: skip
    subprocess.run(cmd, env=env, check=True)
    print(f"\n{window.verdict()}", flush=True)


if __name__ == "__main__":
    main()
