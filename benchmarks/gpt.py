"""A GPT training step in every torchtpu path, side by side with the same step in JAX.

    python benchmarks/gpt.py                       # GPT-2 small: 12 layers, d 768, 8x1024
    python benchmarks/gpt.py --tokens 8x512 --layers 4
    python benchmarks/gpt.py --tiny                # a 2-layer model: a smoke run on the CPU
    python benchmarks/gpt.py --only jit,jax        # some of the paths

The model (nanoGPT's shape, issue #40): token and position embeddings, pre-norm blocks
of causal ``scaled_dot_product_attention`` and a GELU MLP (benchmarks/eager_modes.py's
block), an untied head, AdamW (torch's default, its ``_foreach_`` ops; ``--fused-adamw``:
``fused=True``, one op a step), every step reading its loss. ``--dtype``: parameters
in ``bfloat16`` (the default), or ``float32``, or ``autocast``: float32 parameters and
the forward under ``torch.autocast("tpu", dtype=torch.bfloat16)``, the torch idiom
(the JAX row then casts as autocast does: products in bfloat16, norms, softmax and the
residual stream in float32).
Paths: Strict and DeferAndFuse eager, ``torch.compile(step, backend="tpu")`` of the
whole step (forward, backward, ``opt.step()``), ``torchtpu.jit(step)``, and the same
model and AdamW written in JAX under one ``jax.jit`` with donated state (the floor; its
attention is the one torchtpu picks: JAX's Pallas flash kernels on a TPU where they apply).

Each path runs in a fresh process (``--one-process``: all in this one, so that a later
path reuses the eager ops' programs an earlier one compiled, and the peak is the
run's). Per path: the first step, cold (tracing and compiling; two calls for
torchtpu.jit, whose first call runs eagerly) and in a second fresh process with JAX's
persistent cache filled by the first (a folder of the run's own), the XLA programs torchtpu compiled for it
(per-op programs, DeferAndFuse chunks, compiled graphs and steps:
``torchtpu.metrics()``), then the median seconds per step, tokens per second, the
share of the chip's peak (MFU, from nanoGPT's 6N + 12·layers·d·seq FLOPs per token;
``--peak-tflops``, 197 for a TPU v5e's bfloat16), the ratio to JAX's step, and the
process's peak memory with its ratio to JAX's: the device's peak bytes where JAX
reports them (TPU, GPU: ``torch.tpu.max_memory_allocated()``, which on a TPU adds the
peak of the bytes reserved for compiled programs' temporaries to the arrays' peak: two
peaks that need not meet, so an upper bound; the arrays' peak is its own column), else
the peak resident memory (JAX's CPU backend keeps its arrays in the process; torch and
JAX themselves are part of it). A path that fails
(out of memory) prints its error in its row and the others go on.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torchtpu  # noqa: E402

# First steps compile from scratch: JAX's persistent cache is off, or (a path's second
# process, `run_child`) a fresh folder only that path's first process filled. Set before
# the imports below, which start torchtpu's runtime (where the cache is configured).
# (With --one-process, programs an earlier path compiled stay in the process: later
# paths' first steps reuse the eager ops' programs.)
_CACHE_VARIABLE = "TORCHTPU_GPT_BENCHMARK_CACHE"
torchtpu.config.compile_cache_dir = os.environ.get(_CACHE_VARIABLE) or None
if torchtpu.config.compile_cache_dir:  # the JAX row starts no torchtpu runtime
    jax.config.update("jax_compilation_cache_dir", torchtpu.config.compile_cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

from benchmarks import quiet  # noqa: E402
from benchmarks.eager_modes import Block, runtime_line  # noqa: E402
from torchtpu.ops import flash_attention as flash_kernels  # noqa: E402

PATHS = ("jax", "strict", "defer", "compile", "jit")  # jax first: the ratios divide by it


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, vocab: int, seq: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(args.layers, args.d, args.heads, args.vocab, args.seq).to(args.param_dtype)


def _tokens(args) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)


def torch_step(args, how: str):
    """A step function returning the loss as a float, on tpu."""
    model = _model(args).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.fused_adamw or None)
    tokens = _tokens(args).to("tpu")
    vocab = args.vocab

    def step():
        opt.zero_grad()
        with torch.autocast("tpu", dtype=torch.bfloat16, enabled=args.autocast):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        return loss

    if how == "compile":
        step = torch.compile(step, backend="tpu")
    elif how == "jit":
        step = torchtpu.jit(step)
    return lambda: step().item()


def jax_step(args):
    """The same model and AdamW (torch's defaults: betas 0.9, 0.999, eps 1e-8, weight
    decay 0.01) in JAX, one ``jax.jit`` with the state donated."""
    dtype = jnp.bfloat16 if args.param_dtype == torch.bfloat16 else jnp.float32
    params = {
        k: jnp.asarray(v.float().numpy(), dtype) for k, v in _model(args).state_dict().items()
    }
    # torch.autocast: matmuls (and their results) in bfloat16, the rest as it comes.
    low = (lambda a: a.astype(jnp.bfloat16)) if args.autocast else (lambda a: a)
    tokens = jnp.asarray(_tokens(args).numpy())
    d, h = args.d, args.heads

    def layer_norm(x, p, name):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5)
        return (y * p[f"{name}.weight"] + p[f"{name}.bias"]).astype(x.dtype)

    def linear(x, p, name):
        y = low(x) @ low(p[f"{name}.weight"]).T
        return y + low(p[f"{name}.bias"]) if f"{name}.bias" in p else y

    # The attention torchtpu's SDPA picks (ops/flash_attention.py): JAX's Pallas flash
    # kernels on a TPU for bfloat16 and lengths multiples of 128, else XLA's dense one.
    flash = (
        torchtpu.config.flash_attention == "on"
        or (jax.default_backend() == "tpu" and torchtpu.config.flash_attention == "auto")
    ) and ((args.autocast or dtype == jnp.bfloat16) and args.seq % 128 == 0)

    @jax.custom_vjp
    def flash_attention(q, k, v):  # [batch, heads, length, head size]
        return flash_kernels.forward(q, k, v, True, (d // h) ** -0.5)

    def flash_forward(q, k, v):
        return flash_attention(q, k, v), (q, k, v)

    def flash_backward(saved, grad):
        return tuple(flash_kernels.backward(grad, *saved, True, (d // h) ** -0.5))

    flash_attention.defvjp(flash_forward, flash_backward)

    def attention(q, k, v):  # [batch, length, heads, head size]
        if not flash:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True)
        heads_first = [z.transpose(0, 2, 1, 3) for z in (q, k, v)]
        return flash_attention(*heads_first).transpose(0, 2, 1, 3)

    def loss_fn(p):
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        b, t = inputs.shape
        x = p["wte.weight"][inputs] + p["wpe.weight"][:t]
        for i in range(args.layers):
            n = f"blocks.{i}"
            q, k, v = jnp.split(linear(layer_norm(x, p, f"{n}.ln1"), p, f"{n}.qkv"), 3, axis=-1)
            q, k, v = (z.reshape(b, t, h, d // h) for z in (q, k, v))
            a = attention(q, k, v).reshape(b, t, d)
            x = x + linear(a, p, f"{n}.proj").astype(x.dtype)
            m = jax.nn.gelu(linear(layer_norm(x, p, f"{n}.ln2"), p, f"{n}.fc1"), approximate=False)
            x = x + linear(m, p, f"{n}.fc2").astype(x.dtype)
        logits = linear(layer_norm(x, p, "ln_f"), p, "head").astype(jnp.float32)
        logp = jax.nn.log_softmax(logits.reshape(-1, args.vocab))
        return -jnp.mean(jnp.take_along_axis(logp, labels.reshape(-1, 1), 1))

    lr, b1, b2, eps, wd = 1e-4, 0.9, 0.999, 1e-8, 0.01

    def update(state):
        p, m, v, count = state
        loss, g = jax.value_and_grad(loss_fn)(p)
        count = count + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        c1, c2 = 1 - b1**count, 1 - b2**count

        def new(p, m, v):
            p = p * (1 - lr * wd)
            return (p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps)).astype(p.dtype)

        return loss, (jax.tree.map(new, p, m, v), m, v, count)

    update = jax.jit(update, donate_argnums=0)
    zeros = jax.tree.map(jnp.zeros_like, params)
    state = [(params, zeros, jax.tree.map(jnp.zeros_like, params), jnp.float32(0))]

    def step():
        loss, state[0] = update(state[0])
        return float(loss)

    return step


def flops_per_step(args) -> float:
    n = sum(p.numel() for name, p in _model(args).named_parameters() if name != "wpe.weight")
    per_token = 6 * n + 12 * args.layers * args.d * args.seq
    return per_token * args.batch * args.seq


def programs_compiled() -> int:
    """XLA programs torchtpu has compiled in this process, of every kind."""
    return sum(torchtpu.metrics().get("compiles", {}).values())


def peak_memory() -> tuple[int, int | None]:
    """(bytes, bytes of arrays or None): the device's peak where JAX reports one (TPU,
    GPU: ``torch.tpu``'s, which on a TPU adds the peak of its compiled programs'
    temporaries to its arrays' peak -- two peaks that need not meet, so an upper bound)
    and its arrays' peak alone; else this process's peak resident memory (VmHWM)."""
    stats = jax.local_devices()[0].memory_stats()
    if stats:
        return torch.tpu.max_memory_allocated(), stats.get("peak_bytes_in_use")
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return rss, None


def measure(step, mode: str | None, steps: int, repeat: int, first_calls: int = 1):
    """(seconds of the first ``first_calls`` steps, median seconds per step, programs
    compiled meanwhile)."""
    compiled = programs_compiled()
    with torchtpu.set_eager_mode(mode) if mode else contextlib.nullcontext():
        start = time.perf_counter()
        for _ in range(first_calls):
            step()
        first = time.perf_counter() - start
        step()  # DeferAndFuse's chunks settle (docs/eager-modes.md)
        # What the first steps left (Dynamo's and AOTAutograd's graphs, traced programs)
        # is collected now rather than in a timed run. (On the TPU v5e the first timed
        # run of torch.compile's steps has been slower than the rest: 161 ms a step in
        # one run, 101 ms in the median of three; docs/performance.md.)
        gc.collect()
        runs = []
        for _ in range(repeat):
            start = time.perf_counter()
            for _ in range(steps):
                step()
            runs.append((time.perf_counter() - start) / steps)
    return first, statistics.median(runs), programs_compiled() - compiled


def run_path(path: str, args) -> tuple[float, float, int, int, int | None]:
    """(first step seconds, median seconds per step, programs compiled, peak bytes,
    arrays' peak bytes or None) of one path, in this process."""
    torch._dynamo.reset()
    if path == "jax":
        first, per_step, programs = measure(jax_step(args), None, args.steps, args.repeat)
    else:
        how = path if path in ("compile", "jit") else "eager"
        mode = path if path in ("strict", "defer") else "strict"
        first_calls = 2 if path == "jit" else 1  # the first runs eagerly, then it traces
        first, per_step, programs = measure(
            torch_step(args, how), mode, args.steps, args.repeat, first_calls
        )
    return first, per_step, programs, *peak_memory()


def run_child(path: str, cache: str, *options: str) -> tuple:
    """`run_path`'s row in a fresh process: this script again with ``--only path
    --child``, with JAX's persistent cache in folder ``cache``."""
    argv, skip = [], False
    for arg in sys.argv[1:]:  # every option but --only
        if skip or arg == "--only" or arg.startswith("--only="):
            skip = arg == "--only"
            continue
        argv.append(arg)
    run = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *argv, *options, "--only", path, "--child"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, _CACHE_VARIABLE: cache},
    )  # fmt: skip
    rows = [line[4:] for line in run.stdout.splitlines() if line.startswith("row ")]
    if run.returncode or not rows:  # the child printed its traceback to stderr
        raise RuntimeError(f"{path} exited with {run.returncode}: {run.stdout[-150:]}")
    return tuple(json.loads(rows[-1]))


def cold_and_warm(path: str) -> tuple:
    """A path's `run_path` row from a fresh process with an empty persistent cache, then
    the first step's seconds of a second fresh process once the first filled it."""
    with tempfile.TemporaryDirectory(prefix="gpt-cache-") as cache:
        row = run_child(path, cache)
        warm = run_child(path, cache, "--steps", "1", "--repeat", "1")
    return (*row, warm[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--tokens", default="8x1024", help="batch x sequence length")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "autocast"))
    parser.add_argument("--tiny", action="store_true", help="2 layers, d 64, 4x64 tokens")
    parser.add_argument(
        "--fused-adamw", action="store_true", help="AdamW(fused=True): one op a step"
    )
    parser.add_argument("--only", default=",".join(PATHS))
    parser.add_argument("--steps", type=int, default=5, help="steps per timed run")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs (median)")
    parser.add_argument("--peak-tflops", type=float, default=197.0)
    parser.add_argument("--one-process", action="store_true", help="every path in this one")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.d, args.heads, args.vocab, args.tokens = 2, 64, 4, 512, "4x64"
    args.batch, args.seq = map(int, args.tokens.split("x"))
    args.autocast = args.dtype == "autocast"
    args.param_dtype = torch.float32 if args.autocast else getattr(torch, args.dtype)
    if args.child:  # one path; its row as JSON after "row "
        print("row " + json.dumps(run_path(args.only, args)), flush=True)
        return 0

    quiet.check_before_start()
    window = quiet.Window()
    flops = flops_per_step(args)
    print(
        f"\n`{quiet.command()}`: GPT {args.layers} layers, d {args.d}, {args.heads} heads, "
        f"vocab {args.vocab}, {args.batch}x{args.seq} tokens, {args.dtype}, "
        f"{'AdamW(fused=True)' if args.fused_adamw else 'AdamW'}; "
        f"{flops / 1e12:.2f} TFLOP a step\n"
    )
    print(
        "| path | first step | warm cache | programs | per step | tokens/s | MFU | vs jax.jit "
        "| peak memory | vs jax.jit | arrays' peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows, failed = {}, []
    for path in PATHS:
        if path not in args.only.split(","):
            continue
        try:
            rows[path] = (*run_path(path, args), None) if args.one_process else cold_and_warm(path)
        except Exception as exc:  # an out-of-memory path must not hide the others
            message = f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
            print(f"| {path} | failed: {message} | | | | | | | | | |", flush=True)
            traceback.print_exc(file=sys.stderr)
            failed.append(path)
            continue
        first, per_step, programs, peak, arrays, warm = rows[path]
        arrays = "" if arrays is None else f"{arrays / 2**30:.2f} GiB"
        warm = "" if warm is None else f"{warm:.1f} s"
        mfu = flops / per_step / (args.peak_tflops * 1e12)
        floor = rows.get("jax")
        ratio = "" if floor is None else f"{per_step / floor[1]:.2f}x"
        peak_ratio = "" if floor is None else f"{peak / floor[3]:.2f}x"
        programs = "(jax)" if path == "jax" else programs
        print(
            f"| {path} | {first:.1f} s | {warm} | {programs} | {per_step * 1e3:.1f} ms "
            f"| {args.batch * args.seq / per_step:,.0f} | {100 * mfu:.1f}% | {ratio} "
            f"| {peak / 2**30:.2f} GiB | {peak_ratio} | {arrays} |",
            flush=True,
        )
    # Only now does this process open the device: a TPU admits one process at a time.
    print(f"\n{runtime_line()}")
    memory = "device" if jax.local_devices()[0].memory_stats() else "resident (VmHWM)"
    print(f"peak memory: the {memory} peak of the path's process" + (
        "" if args.one_process else " (each path in its own)"
    ))  # fmt: skip
    if "jax" in rows:
        print("ratios to jax.jit: " + ", ".join(
            f"{path} {rows[path][1] / rows['jax'][1]:.2f}x" for path in rows if path != "jax"
        ))  # fmt: skip
    print(f"\n{window.verdict()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
