"""A short training run on the tpu device: ``python -m torchtpu.demo``.

Trains the MLP from the seed articles (512 -> 1024 -> 10, SGD) for a few steps on
random data, prints the losses, and says where it ran.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchtpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--mode", default=None, help="eager mode: strict or debug (default: strict)"
    )
    args = parser.parse_args(argv)
    if args.mode:
        torch.tpu.set_eager_mode(args.mode)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10)).to("tpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(args.batch, 512, device="tpu")
    y = torch.randint(0, 10, (args.batch,), device="tpu")

    start = time.perf_counter()
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        print(f"step {step:3d}  loss {loss.item():.4f}")
        if step == 0:
            first = time.perf_counter() - start
    total = time.perf_counter() - start

    props = torch.tpu.get_device_properties()
    print()
    print(
        f"device        {x.device} = {torch.tpu.get_device_name()} (JAX backend: {props.platform}, "
        f"{torch.tpu.device_count()} device(s))"
    )
    print(f"eager mode    {torch.tpu.eager_mode.name}")
    print(
        f"parameters    on {next(model.parameters()).device}, {sum(p.numel() for p in model.parameters()):,}"
    )
    steps_after = max(args.steps - 1, 1)
    print(
        f"time          first step {first:.2f} s (compiles), then {(total - first) / steps_after * 1e3:.1f} ms/step"
    )
    fallbacks = torchtpu.metrics().get("fallback", {})
    print(f"CPU fallbacks {sum(fallbacks.values()) if fallbacks else 0}")


if __name__ == "__main__":
    main()
