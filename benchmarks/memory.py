"""Peak memory of training steps: torch on the CPU against every tpu path (issue #33).

    python benchmarks/memory.py                  # the issue's sizes
    python benchmarks/memory.py --scale 0.25     # widths a quarter (a quick run)
    python benchmarks/memory.py --only mlp       # the workloads whose name has it

Each cell runs in a fresh process: build the model and data, then measure the peak
over ``--steps`` steps from the first (as issue #33 measured: the first step creates
the optimizer's state and, on tpu, compiles; torchtpu.jit traces on its second call).
Two figures per cell:

- peak RSS growth: the process's peak resident memory (VmHWM, reset before the first
  step through /proc/self/clear_refs) minus its resident memory then, in units of P,
  the parameters' bytes ("-" where VmHWM cannot be reset and the steps stayed below
  the peak before them). On JAX's CPU backend device arrays live in the process, so
  this is the figure to compare with torch's; it includes what XLA's compiler holds
  while it compiles, which matters for small P (use the issue's sizes).
- device peak: JAX's ``peak_bytes_in_use`` of the device where the backend reports it
  (TPU, GPU), plus a TPU's ``peak_bytes_reserved`` (compiled programs' temporaries,
  which a TPU counts apart), minus the bytes in use and reserved before the first
  step; "-" on the CPU backend.
  The last column divides it by torch CPU's peak growth: the chip's figure for #33.

Workloads: an MLP of 6 linear layers (width 4096: 101M parameters, P = 384 MiB) with
AdamW at batch 64; a GPT (benchmarks/gpt.py's, 4 layers, d 512, 8x256 tokens,
float32) with AdamW; the MLP fine-tuned with gradient accumulation over 4 micro-batches;
a Transformers Llama (4 layers, d 512, vocab 8192, random weights) generating 256 tokens
greedily with its static KV cache (``cache_implementation="static"``; each "step" a
``generate()``; ``torch.compile`` compiles ``model.forward`` as Transformers' docs do, and
torchtpu.jit does not apply), with a decode step's median time at tokens 8-16 against
248-256 printed under the table. Paths: torch CPU, Strict,
DeferAndFuse, ``torch.compile(step, backend="tpu")`` and ``torchtpu.jit(step)``; and
torch CPU with ``AdamW(foreach=True)`` (PATHS). The ratio columns divide by the first
path's peak growth (torch CPU's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# "cpu foreach": torch on the CPU with AdamW(foreach=True), the algorithm torch picks on
# CUDA and on tpu (a list of moment-sized temporaries per update), where on the CPU it
# updates one parameter at a time: the like-for-like bar for the eager paths.
PATHS = ("cpu", "cpu foreach", "strict", "defer", "compile", "jit")
WORKLOADS = ("mlp adamw", "gpt adamw", "mlp accumulation", "generate static cache")

# Run in a child process: prints one JSON line.
_CELL = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
import torch, torch.nn as nn, torch.nn.functional as F
import torchtpu

workload, path, scale, steps = {workload!r}, {path!r}, {scale!r}, {steps!r}
device = "cpu" if path.startswith("cpu") else "tpu"
if path in ("strict", "defer"):
    torchtpu.set_eager_mode(path)
torch.manual_seed(0)


def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024


def device_bytes(*keys):
    # A TPU counts compiled programs' temporaries apart, as reserved bytes.
    if device == "cpu":
        return None
    from torchtpu.runtime import jax
    stats = jax().local_devices()[0].memory_stats() or {{}}
    return sum(stats.get(key, 0) for key in keys) if stats else None


width = max(64, int(4096 * scale))
if workload.startswith("mlp"):
    layers = [nn.Linear(width, width) for _ in range(6)]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())][:-1]).to(device)
    micro = 4 if workload == "mlp accumulation" else 1
    x = torch.randn(micro, 64, width).to(device)
    y = torch.randn(micro, 64, width).to(device)

    def loss_of(i):
        return F.mse_loss(model(x[i]), y[i]) / micro
elif workload.startswith("generate"):
    from transformers import LlamaConfig, LlamaForCausalLM
    d = max(64, int(512 * scale))
    config = LlamaConfig(vocab_size=8192, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval().to(device)
    prompt = torch.randint(0, 8192, (1, 8)).to(device)
    if path == "compile":  # as Transformers' docs compile a model for generate()
        model.forward = torch.compile(model.forward, backend="tpu")
    if path == "jit":
        raise SystemExit("n/a: generate() is a loop of forwards, not one step")
    times = []

    class Clock:  # a logits processor: called once per new token, after its forward
        def __call__(self, input_ids, scores):
            times.append(time.perf_counter())
            return scores

    def step():
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=256, min_new_tokens=256, do_sample=False,
                                 cache_implementation="static", logits_processor=[Clock()])
        return out[0, -1]
else:
    from benchmarks.gpt import GPT
    d = max(64, int(512 * scale))
    model = GPT(4, d, 8, 8192, 256).to(device)
    tokens = torch.randint(0, 8192, (1, 8, 257)).to(device)
    micro = 1

    def loss_of(i):
        logits = model(tokens[i, :, :-1])
        return F.cross_entropy(logits.reshape(-1, 8192), tokens[i, :, 1:].reshape(-1))

if not workload.startswith("generate"):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True if path == "cpu foreach" else None)

    def step():
        opt.zero_grad()
        for i in range(micro):
            loss = loss_of(i)
            loss.backward()
        opt.step()
        return loss

    if path == "compile":
        step = torch.compile(step, backend="tpu")
    elif path == "jit":
        step = torchtpu.jit(step)
params = sum(p.numel() * p.element_size() for p in model.parameters())
import gc; gc.collect()
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
except OSError:
    pass  # not allowed on some machines (the TPU VM's): the peak is known only if exceeded
before, peak_before, device_before = rss("VmRSS:"), rss("VmHWM:"), device_bytes("bytes_in_use", "bytes_reserved")
for _ in range(steps):
    step().item()
peak = rss("VmHWM:")
if None in (peak, peak_before):  # a sandbox without VmHWM (the TPU machine's, 2026-12-06)
    growth = None
else:
    growth = peak - before if peak > peak_before or peak_before == before else None
device_peak = device_bytes("peak_bytes_in_use", "peak_bytes_reserved")
result = {{
    "params": params, "growth": growth,
    "device": None if device_peak is None else device_peak - device_before,
}}
if workload.startswith("generate"):  # the last run's decode steps: early against late
    gaps = [b - a for a, b in zip(times[-256:], times[-255:])]
    result["early"] = sorted(gaps[7:15])[4]  # tokens 8-16's median gap
    result["late"] = sorted(gaps[-8:])[4]  # tokens 248-256's
print(json.dumps(result))
"""


def cell(workload: str, path: str, scale: float, steps: int) -> dict:
    code = _CELL.format(root=ROOT, workload=workload, path=path, scale=scale, steps=steps)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if run.returncode:
        last = (run.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": last[:120]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="width factor")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--only", default="")
    parser.add_argument("--paths", default=",".join(PATHS), help="a comma-separated subset")
    args = parser.parse_args()
    paths = [p for p in PATHS if p in args.paths.split(",")]
    print(f"`{' '.join(['python', *sys.argv])}`: peak growth over {args.steps} steps, in P\n")
    print("| workload | P | " + " | ".join(paths) + " | " + " | ".join(
        f"{p}/cpu" for p in paths[1:]) + " | device peak (" + ", ".join(paths[1:])
        + ") | device peak / cpu growth |")  # fmt: skip
    print("|---" * (3 + 2 * (len(paths) - 1)) + "|---|---|")
    notes = []
    for workload in WORKLOADS:
        if args.only not in workload:
            continue
        cells = {path: cell(workload, path, args.scale, args.steps) for path in paths}
        params = next((c["params"] for c in cells.values() if "params" in c), None)
        if params is None:
            print(f"| {workload} | failed: {cells[paths[0]].get('error')} |", flush=True)
            continue

        def units(c, key="growth", params=params):
            if "error" in c:
                return "n/a" if c["error"].startswith("n/a") else f"failed: {c['error']}"
            return "-" if c.get(key) is None else f"{c[key] / params:.2f} P"

        base = cells[paths[0]].get("growth")

        def ratios(key, cells=cells, base=base):
            return [
                f"{c[key] / base:.2f}" if c.get(key) is not None and base else "-"
                for c in (cells[p] for p in paths[1:])
            ]

        print(
            f"| {workload} | {params / 2**20:.0f} MiB | "
            + " | ".join(units(cells[p]) for p in paths)
            + " | " + " | ".join(ratios("growth")) + " | "
            + ", ".join(units(cells[p], "device") for p in paths[1:]) + " | "
            + ", ".join(ratios("device")) + " |",
            flush=True,
        )  # fmt: skip
        decoded = [(p, c) for p, c in cells.items() if "early" in c]
        if decoded:  # issue 33: a decode step's time is flat as the static cache fills
            notes.append(
                f"{workload}, a decode step at tokens 8-16 / 248-256 (median): "
                + "; ".join(
                    f"{p} {c['early'] * 1e3:.1f} / {c['late'] * 1e3:.1f} ms ({c['late'] / c['early']:.2f}x)"
                    for p, c in decoded
                )
            )
    for line in notes:
        print(f"\n{line}")


if __name__ == "__main__":
    main()
