"""The eager modes side by side: torch CPU eager, Strict, Debug, DeferAndFuse, and the
same computation written in JAX under one ``jax.jit`` (the floor).

    python benchmarks/eager_modes.py                  # medians of several runs
    python benchmarks/eager_modes.py --quick          # fewer, shorter runs
    python benchmarks/eager_modes.py --require-quiet  # refuse to run on a busy machine

First the cost of one op: a 64x64 add whose result feeds the next add, in torch CPU
eager, a pre-jitted ``jax.jit`` add, the *floor* (a minimal wrapper subclass whose
``__torch_dispatch__`` calls that jitted add: the least any ``__torch_dispatch__``
runtime can cost), Strict, Debug, and DeferAndFuse *recording* (the op queued, its
flush not counted). Then whole workloads: one small elementwise op (64x64 add: dispatch dominates), an 11-op
elementwise chain at 64x64 and 1024x1024, the MLP training step (512->1024->10, SGD)
at batch 8, 64 and 1024, and a small transformer training step (one pre-norm block,
d=64, 4 heads, sequence 32, batch 8, SGD). And the first step of the MLP in a fresh
process, cold and warm (JAX's persistent compilation cache): that table comes first,
while this process has not opened the device (a TPU admits one process at a time).
torch's CPU baseline is
pinned to one thread (its 2-thread mode is erratic on a shared 2-core machine).
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchtpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import quiet  # noqa: E402
from torchtpu.runtime.backend import jax as _configured_jax  # noqa: E402

# JAX must start the way torchtpu starts it (its CPU async dispatch setting applies only
# before the backend starts): a `jax.default_backend()` here first would measure JAX's
# defaults, not the product's.
_configured_jax()
torch.set_num_threads(1)
# The workloads read values every step on purpose; the hints that say so are expected.
warnings.simplefilter("ignore", torchtpu.TPUPerformanceWarning)


REPEAT, MIN_TIME = (3, 0.1) if "--quick" in sys.argv else (7, 0.3)


def timeit(fn, *, repeat=None, min_time=None):
    """Median seconds per call over ``repeat`` runs of at least ``min_time`` each."""
    return compare({"fn": (fn, None)}, repeat=repeat, min_time=min_time)["fn"]


class SelfTimed:
    """A contender that returns the seconds of its call that count."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self):
        return self.fn()


def compare(contenders: dict, *, repeat=None, min_time=None) -> dict:
    """Median seconds per call of each contender, ``{label: (fn, eager mode or None)}``.

    The contenders' runs are interleaved (one run of each, ``repeat`` rounds), so a
    slow spell of the machine costs all of them alike and ratios stay fair."""
    repeat, min_time = repeat or REPEAT, min_time or MIN_TIME
    samples: dict = {label: [] for label in contenders}

    def run(label):
        fn, mode = contenders[label]
        with torch.tpu.set_eager_mode(mode) if mode else contextlib.nullcontext():
            n, counted, start = 0, 0.0, time.perf_counter()
            while True:
                measured = fn()
                n += 1
                elapsed = time.perf_counter() - start
                if isinstance(fn, SelfTimed):
                    counted += measured
                if elapsed >= min_time:
                    return (counted if isinstance(fn, SelfTimed) else elapsed) / n

    for label in contenders:  # warm up: compile, fill caches
        fn, mode = contenders[label]
        with torch.tpu.set_eager_mode(mode) if mode else contextlib.nullcontext():
            fn()
            fn()
    for _ in range(repeat):
        for label in contenders:
            samples[label].append(run(label))
    return {label: statistics.median(times) for label, times in samples.items()}


def chain(x):
    # 11 elementwise ops, no sin/cos (XLA:CPU's are slow and would hide dispatch).
    y = x * 2 + 1
    y = torch.relu(y) - x
    y = y * y / (x.abs() + 1)
    y = torch.tanh(y) + torch.sigmoid(x)
    return y.exp().clamp(max=10) * 0.5


def jax_chain(x):
    y = x * 2 + 1
    y = jnp.maximum(y, 0) - x
    y = y * y / (jnp.abs(x) + 1)
    y = jnp.tanh(y) + jax.nn.sigmoid(x)
    return jnp.minimum(jnp.exp(y), 10) * 0.5


def mlp_step_fn(device, batch, how="eager"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(batch, 512, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    return training_step(model, opt, lambda m: F.cross_entropy(m(x), y), how)


def training_step(model, opt, loss_of, how="eager"):
    """A step function (returning the loss as a float) run eagerly, with the model under
    ``torch.compile(backend="tpu")`` (how="compile"), with the optimizer step compiled
    too (how="compile+opt", as ``torch.compile(opt.step)`` users do) or as one
    ``torchtpu.jit`` program (how="jit")."""
    run = torch.compile(model, backend="tpu") if how.startswith("compile") else model
    opt_step = torch.compile(opt.step, backend="tpu") if how == "compile+opt" else opt.step

    def step():
        opt.zero_grad()
        loss = loss_of(run)
        loss.backward()
        opt_step()
        return loss

    if how == "jit":
        step = torchtpu.jit(step)
    return lambda: step().item()


def _sgd_step(loss_fn, params, lr=0.1):
    """A step function: one jitted SGD update of ``params`` on ``loss_fn``, returning the loss."""

    @jax.jit
    def update(p):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        return loss, jax.tree.map(lambda a, g: a - lr * g, p, grads)

    state = {"p": params}

    def step():
        loss, state["p"] = update(state["p"])
        return float(loss)

    return step


def jax_mlp_step_fn(batch):
    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    params = {
        "w1": jax.random.normal(k1, (512, 1024)) * 0.04,
        "b1": jnp.zeros(1024),
        "w2": jax.random.normal(k2, (1024, 10)) * 0.03,
        "b2": jnp.zeros(10),
    }
    params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    x = jax.random.normal(k3, (batch, 512), jnp.float32)
    y = jnp.arange(batch) % 10

    def loss_fn(p):
        h = jnp.maximum(x @ p["w1"] + p["b1"], 0)
        logits = h @ p["w2"] + p["b2"]
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(batch), y])

    return _sgd_step(loss_fn, params)


class Block(nn.Module):
    """A pre-norm transformer block with a causal attention and a GELU MLP."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab=256, d=64):
        super().__init__()
        self.embed, self.block, self.head = nn.Embedding(vocab, d), Block(d), nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)))


def transformer_step_fn(device, batch=8, seq=32, vocab=256, how="eager"):
    torch.manual_seed(0)
    model = TinyLM(vocab).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)

    def loss_of(m):
        logits = m(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    return training_step(model, opt, loss_of, how)


def jax_transformer_step_fn(batch=8, seq=32, vocab=256, d=64, heads=4):
    torch.manual_seed(0)
    params = {k: jnp.asarray(v.detach().numpy()) for k, v in TinyLM(vocab, d).state_dict().items()}
    tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, vocab)

    def layer_norm(x, w, b):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * w + b

    def linear(x, p, name):
        return x @ p[f"{name}.weight"].T + p[f"{name}.bias"]

    def loss_fn(p):
        x = p["embed.weight"][tokens[:, :-1]]
        h = layer_norm(x, p["block.ln1.weight"], p["block.ln1.bias"])
        q, k, v = jnp.split(linear(h, p, "block.qkv"), 3, axis=-1)
        q, k, v = (
            z.reshape(batch, seq, heads, d // heads).transpose(0, 2, 1, 3) for z in (q, k, v)
        )
        s = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(d // heads)
        s = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), s, -jnp.inf)
        a = (jax.nn.softmax(s, -1) @ v).transpose(0, 2, 1, 3).reshape(batch, seq, d)
        x = x + linear(a, p, "block.proj")
        h = layer_norm(x, p["block.ln2.weight"], p["block.ln2.bias"])
        x = x + linear(jax.nn.gelu(linear(h, p, "block.fc1"), approximate=False), p, "block.fc2")
        logits = linear(x, p, "head").reshape(-1, vocab)
        labels = tokens[:, 1:].reshape(-1)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(labels.size), labels])

    return _sgd_step(loss_fn, params)


MODES = (("Strict", "strict"), ("Debug", "debug"), ("Defer", "defer"))

CHAIN = 100  # adds per timed call in the per-op table


class Floor(torch.Tensor):
    """The least a ``__torch_dispatch__`` runtime can do per op: no lookup, no checks,
    one pre-jitted JAX call and a new wrapper for its result."""

    add = None  # the pre-jitted jax add

    @staticmethod
    def __new__(cls, array):
        t = torch.Tensor._make_wrapper_subclass(
            cls, array.shape, dtype=torch.float32, device=torch.device("tpu", 0)
        )
        t.array = array
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return Floor(Floor.add(args[0].array, args[1].array))


def per_op():
    """Microseconds per op of a 64x64 add whose result feeds the next add."""
    jadd = jax.jit(lambda a, b: a + b)
    Floor.add = jadd
    ja = jnp.ones((64, 64), jnp.float32)
    cpu = torch.ones(64, 64)
    tpu = torch.ones(64, 64, device="tpu")
    floor = Floor(ja)

    def chained(x, y, block):
        def run():
            z = x
            for _ in range(CHAIN):
                z = z + y
            block(z)

        return run

    def tpu_block(z):
        jax.block_until_ready(torchtpu.dispatch.values.materialize(z))

    def jax_run():
        z = ja
        for _ in range(CHAIN):
            z = jadd(z, ja)
        z.block_until_ready()

    @SelfTimed
    def record_only():
        """Record CHAIN adds, then flush them: only the recording counts."""
        z, start = tpu, time.perf_counter()
        for _ in range(CHAIN):
            z = z + tpu
        recorded = time.perf_counter() - start
        tpu_block(z)
        return recorded

    window = quiet.Window()
    times = compare(
        {
            "torch CPU": (chained(cpu, cpu, lambda z: None), None),
            "jax.jit": (jax_run, None),
            "floor": (chained(floor, floor, lambda z: z.array.block_until_ready()), None),
            "Strict": (chained(tpu, tpu, tpu_block), "strict"),
            "Debug": (chained(tpu, tpu, tpu_block), "debug"),
            "Defer, recording": (record_only, "defer"),
        }
    )
    print(f"\n`{quiet.command()}`: one 64x64 add, each result feeding the next")
    print(f"({quiet.THRESHOLD} cores of others is the limit for a quiet run)\n")
    print("| per op | " + " | ".join(times) + " | Strict/floor | recording/floor |")
    print("|---|" + "---|" * (len(times) + 2))
    cells = " | ".join(f"{t / CHAIN * 1e6:.1f}us" for t in times.values())
    print(
        f"| 64x64 add | {cells} | {times['Strict'] / times['floor']:.2f}x "
        f"| {times['Defer, recording'] / times['floor']:.2f}x |"
    )
    print(f"\n{window.verdict()}", flush=True)


def side_by_side():
    small_cpu, small_tpu = torch.randn(64, 64), torch.randn(64, 64, device="tpu")
    jadd = jax.jit(lambda a, b: a + b)
    ja = jnp.ones((64, 64), jnp.float32)

    def tpu_sync(fn):
        def run():
            out = fn()
            jax.block_until_ready(torchtpu.dispatch.values.materialize(out))

        return run

    cases = {
        "add 64x64": (
            lambda: small_cpu + small_cpu,
            tpu_sync(lambda: small_tpu + small_tpu),
            lambda: jadd(ja, ja).block_until_ready(),
        ),
    }
    for n in (64, 1024):
        xc, xt = torch.randn(n, n), torch.randn(n, n, device="tpu")
        jx = jnp.asarray(xc.numpy())
        jchain = jax.jit(jax_chain)
        cases[f"11-op chain {n}x{n}"] = (
            lambda xc=xc: chain(xc),
            tpu_sync(lambda xt=xt: chain(xt)),
            lambda jx=jx, jchain=jchain: jchain(jx).block_until_ready(),
        )
    for batch in (8, 64, 1024):
        cases[f"MLP SGD step, batch {batch}"] = (
            mlp_step_fn("cpu", batch),
            mlp_step_fn("tpu", batch),
            jax_mlp_step_fn(batch),
        )
    cases["transformer step"] = (
        transformer_step_fn("cpu"),
        transformer_step_fn("tpu"),
        jax_transformer_step_fn(),
    )

    window = quiet.Window()
    print(f"\n`{quiet.command()}`: whole workloads, every step reading its loss\n")
    header = f"| {'workload':<24} | torch CPU | " + " | ".join(f"{m:>9}" for m, _ in MODES)
    print(header + " |   jax.jit | Strict/Defer | Defer/jit |")
    print("|" + "---|" * (len(MODES) + 5))
    for name, (cpu_fn, tpu_fn, jax_fn) in cases.items():
        contenders = {"torch CPU": (cpu_fn, None), "jax.jit": (jax_fn, None)}
        contenders.update({label: (tpu_fn, mode) for label, mode in MODES})
        times = compare(contenders)
        cpu, floor = times["torch CPU"], times["jax.jit"]
        cells = " | ".join(_us(times[m]) for m, _ in MODES)
        print(
            f"| {name:<24} | {_us(cpu)} | {cells} | {_us(floor)} | "
            f"{times['Strict'] / times['Defer']:>11.2f}x | {times['Defer'] / floor:>8.2f}x |",
            flush=True,
        )
    print(f"\n{window.verdict()}", flush=True)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:>7.0f}us" if seconds < 0.01 else f"{seconds * 1e3:>7.1f}ms"


# Timed from the model's creation: DeferAndFuse queues the data's random draws into the
# first step's chunk, where Strict would compile them before a timer started at step().
_FIRST_STEP = """
import time, torch, torchtpu
from benchmarks.eager_modes import mlp_step_fn
torch.tpu.set_eager_mode("{mode}")
start = time.perf_counter()
step = mlp_step_fn("tpu", 64)
step(); print(time.perf_counter() - start)
"""


def first_step():
    """The first MLP step in a fresh process: compiling everything (cold), then with the
    programs in JAX's persistent compilation cache (warm)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print("\n| first MLP step (batch 64), new process: model, data, one step | cold | warm |")
    print("|---|---|---|")
    for label, mode in MODES:
        with tempfile.TemporaryDirectory() as cache:
            # Keeps the caller's PYTHONPATH: where torch is not installed in the
            # interpreter (the TPU machine's staged torch), it is how the child finds it.
            path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
            env = dict(os.environ, TORCHTPU_COMPILE_CACHE_DIR=cache, PYTHONPATH=path)
            seconds = []
            for _ in range(2):
                out = subprocess.run(
                    [sys.executable, "-c", _FIRST_STEP.format(mode=mode)],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                if out.returncode:
                    raise RuntimeError(f"the first-step process failed:\n{out.stderr[-3000:]}")
                seconds.append(float(out.stdout.split()[-1]))
        print(f"| {label} | {seconds[0]:.2f} s | {seconds[1]:.2f} s |", flush=True)


def runtime_line() -> str:
    """Versions and JAX's backend as torchtpu configured it."""
    dispatch = "async" if torchtpu.config.cpu_async_dispatch else "sync"
    return (
        f"torch {torch.__version__}, jax {jax.__version__}, backend {jax.default_backend()}, "
        f"CPU dispatch {dispatch} (torchtpu.config.cpu_async_dispatch)"
    )


def main():
    print(f"machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    quiet.check_before_start()
    # First, while this process has not opened the device: the first-step table runs
    # fresh processes, and a TPU admits one process at a time.
    first_step()
    print(runtime_line())
    per_op()
    side_by_side()


if __name__ == "__main__":
    main()
