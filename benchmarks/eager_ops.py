"""Per-op cost in the eager modes, side by side: torch CPU eager, Strict, Debug, and a
pre-jitted JAX function (the floor for one op).

    python benchmarks/eager_ops.py            # medians of several runs, in microseconds

Workloads: one small elementwise op (64x64 add: dispatch dominates), an 11-op
elementwise chain at 64x64 and 1024x1024, and one MLP training step (512->1024->10,
SGD) at batch 8 and 64. torch's CPU baseline is pinned to one thread (its 2-thread
mode is erratic on a shared 2-core machine).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchtpu

torch.set_num_threads(1)


def timeit(fn, *, repeat=7, min_time=0.2):
    """Median seconds per call over ``repeat`` runs of at least ``min_time`` each."""
    fn()
    fn()
    samples = []
    for _ in range(repeat):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        samples.append(elapsed / n)
    return statistics.median(samples)


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


def mlp_step_fn(device, batch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(batch, 512, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

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

    @jax.jit
    def update(p):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        return loss, jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)

    state = {"p": params}

    def step():
        loss, state["p"] = update(state["p"])
        return float(loss)

    return step


def main():
    rows = []
    small_cpu, small_tpu = torch.randn(64, 64), torch.randn(64, 64, device="tpu")
    jadd = jax.jit(lambda a, b: a + b)
    ja = jnp.ones((64, 64), jnp.float32)

    def tpu_sync(fn):
        def run():
            out = fn()
            jax.block_until_ready(torchtpu.plans.materialize(out))

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
    for batch in (8, 64):
        cases[f"MLP SGD step, batch {batch}"] = (
            mlp_step_fn("cpu", batch),
            mlp_step_fn("tpu", batch),
            jax_mlp_step_fn(batch),
        )

    print(
        f"{'workload':<28}{'torch CPU':>12}{'Strict':>12}{'Debug':>12}{'jax.jit':>12}{'Strict/jit':>12}"
    )
    for name, (cpu_fn, tpu_fn, jax_fn) in cases.items():
        cpu = timeit(cpu_fn)
        strict = timeit(tpu_fn)
        with torch.tpu.set_eager_mode("debug"):
            debug = timeit(tpu_fn)
        floor = timeit(jax_fn)
        rows.append((name, cpu, strict, debug, floor))
        print(
            f"{name:<28}{cpu * 1e6:>10.0f}us{strict * 1e6:>10.0f}us{debug * 1e6:>10.0f}us{floor * 1e6:>10.0f}us{strict / floor:>11.1f}x"
        )


if __name__ == "__main__":
    main()
