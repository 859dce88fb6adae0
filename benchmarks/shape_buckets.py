"""Prompts of many lengths through a compiled causal LM: programs and seconds, with
torch.compile's dynamic sizes padded to buckets and without.

    python benchmarks/shape_buckets.py                    # Llama, 20 prompt lengths 9-120
    python benchmarks/shape_buckets.py --tiny             # the smoke size CI runs

Each cell is a fresh process with JAX's persistent cache off. It builds a Transformers
Llama (random weights, from a config) and runs inference (``torch.no_grad()``) on a
padded batch of prompts (an attention mask with padding) for each of 20 lengths, in an
order that is not sorted, twice. The first pass is what a notebook or a server pays as
new lengths arrive (tracing and compiling); the second, every program cached, the
steady cost of a call (median). Paths: torch on the CPU; ``torch.compile(model,
backend="tpu", dynamic=True)`` with buckets (``config.shape_buckets="pow2"``, the
default, Note [Shape buckets] in compile/buckets.py) and without ("off": one program per
length); Strict eager, which compiles each op per length. Columns: XLA programs compiled
in the first pass (the model's graphs, and the single-op programs that pad inputs and
slice outputs, or the eager ops), the first pass's seconds, the median call of the
second pass, and the largest logits difference from the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.cells import run_cell  # noqa: E402

PATHS = ("cpu", "pow2", "off", "strict")
_NAMES = {
    "cpu": "torch CPU",
    "pow2": "torch.compile, buckets",
    "off": "torch.compile, one per length",
    "strict": "Strict",
}
LENGTHS = (33, 9, 64, 17, 120, 47, 12, 99, 25, 65, 16, 80, 31, 55, 110, 20, 40, 63, 15, 32)


def _model(tiny: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    if not tiny:
        size = dict(
            hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8
        )
    config = LlamaConfig(
        vocab_size=4096, num_key_value_heads=4, max_position_embeddings=256, **size
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def _batch(length: int):
    import torch

    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, 4096, (4, length), generator=g)
    mask = torch.ones(4, length, dtype=torch.long)
    mask[1, : length // 3] = 0  # a left-padded prompt
    return ids, mask


def child(path: str, lengths: tuple, tiny: bool) -> dict:
    import torch

    import torchtpu

    model = _model(tiny)
    with torch.no_grad():
        expected = {n: model(*_batch(n)).logits for n in lengths}
    device = "cpu" if path == "cpu" else "tpu"
    if device == "tpu":
        model = model.to("tpu")
        torchtpu.config.shape_buckets = "off" if path == "off" else "pow2"
    run = torch.compile(model, backend="tpu", dynamic=True) if path in ("pow2", "off") else model
    batches = {n: [t.to(device) for t in _batch(n)] for n in lengths}
    worst = 0.0

    def call(n):
        with torch.no_grad():
            logits = run(*batches[n]).logits.cpu()  # read: a server returns it
        return logits

    torchtpu.reset_metrics()
    start = time.perf_counter()
    for n in lengths:
        worst = max(worst, (call(n) - expected[n]).abs().max().item())
    first = time.perf_counter() - start
    compiles = torchtpu.metrics().get("compiles", {})
    times = []
    for n in lengths:
        start = time.perf_counter()
        call(n)
        times.append(time.perf_counter() - start)
    import jax

    return {
        "backend": jax.default_backend(),
        "first": first,
        "graphs": compiles.get("graph", 0),
        "small": sum(v for k, v in compiles.items() if k != "graph"),
        "steady": statistics.median(times),
        "worst": worst,
    }


def _cell(path: str, lengths: tuple, tiny: bool) -> dict:
    env = dict(os.environ, TORCHTPU_COMPILE_CACHE_DIR="0")
    env.setdefault("PYTHONPATH", os.path.join(ROOT, "src"))
    arguments = ["--child", path, "--lengths", ",".join(map(str, lengths))]
    return run_cell(__file__, arguments + (["--tiny"] if tiny else []), env, ROOT)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--tiny", action="store_true", help="smaller model (CI's smoke run)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    lengths = tuple(int(n) for n in args.lengths.split(","))
    if args.child:
        print(json.dumps(child(args.child, lengths, args.tiny)))
        return

    import jax
    import torch

    # the backend is named by the cells: a process holding a TPU keeps its children off it
    print(f"torch {torch.__version__}, jax {jax.__version__}")
    print(f"\n`python benchmarks/shape_buckets.py {' '.join(sys.argv[1:])}`".rstrip())
    print(f"{len(lengths)} prompt lengths, {min(lengths)} to {max(lengths)}, batch 4\n")
    print(
        "| path | backend | graphs compiled | single-op programs | first pass | per call, cached | vs CPU |"
    )
    print("|---|---|---|---|---|---|---|")
    for path in args.paths.split(","):
        cell = _cell(path, lengths, args.tiny)
        name = _NAMES.get(path, path)
        if "error" in cell:
            print(f"| {name} | failed: {cell['error']} ||||||")
            continue
        tpu = path != "cpu"
        print(
            f"| {name} | {cell['backend'] if tpu else 'cpu'} "
            f"| {cell['graphs'] if tpu else ''} | {cell['small'] if tpu else ''} "
            f"| {cell['first']:.2f} s | {cell['steady'] * 1e3:.1f} ms "
            f"| {cell['worst']:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
