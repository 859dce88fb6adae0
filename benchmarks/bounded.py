"""Variable-size results with and without a stated size (`torchtpu.bounded`).

    python benchmarks/bounded.py            # medians of several runs
    python benchmarks/bounded.py --tiny     # a smoke run: small sizes, one short round

Workload: a training step of a top-2 mixture-of-experts layer written with a boolean
mask, as such layers often are: the router's top-2 choices become a mask, ``nonzero`` of
it gives the (token, expert) pairs, the gates are read with ``scores[mask]``, each pair
runs its expert's weights and the results are added back per token; AdamW. The mask
holds exactly 2 True a token, so the step can state the size
(``torchtpu.bounded(2 * tokens)``). Columns: per step (every step reading its loss) in
Strict and DeferAndFuse, without and with the stated size, and the flushes a
DeferAndFuse step makes.
"""

from __future__ import annotations

import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchtpu  # noqa: E402
from benchmarks import quiet  # noqa: E402
from benchmarks.eager_modes import _us, compare, runtime_line  # noqa: E402


def moe_step_fn(tokens: int, width: int, experts: int, stated: bool):
    """One training step of the layer on tpu: a function returning the loss as a number."""
    gen = torch.Generator().manual_seed(0)
    router = torch.nn.Linear(width, experts).to("tpu")
    weights = torch.nn.Parameter((torch.randn(experts, width, width, generator=gen) / width**0.5).to("tpu"))
    opt = torch.optim.AdamW([*router.parameters(), weights], lr=1e-3)
    x = torch.randn(tokens, width, generator=gen).to("tpu")

    def step():
        scores = router(x).softmax(-1)
        mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(2).indices, True)
        with torchtpu.bounded(2 * tokens) if stated else contextlib.nullcontext():
            pairs = mask.nonzero()
            gates = scores[mask]
        token, expert = pairs[:, 0], pairs[:, 1]
        out = torch.bmm(x[token].unsqueeze(1), weights[expert]).squeeze(1) * gates[:, None]
        y = torch.zeros_like(x).index_add(0, token, out)
        loss = (y - x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def main():
    tiny = "--tiny" in sys.argv
    tokens, width, experts = (32, 16, 4) if tiny else (1024, 256, 8)
    print(runtime_line())
    quiet.check_before_start()
    window = quiet.Window()
    print(f"\n`{quiet.command()}`: per step, every step reading its loss\n")
    print(
        "| MoE step (tokens, width, experts) | Strict | Strict, bounded | Defer | Defer, bounded "
        "| bounded/unbounded Strict | bounded/unbounded Defer | Defer flushes a step: unbounded, bounded |"
    )
    print("|---|---|---|---|---|---|---|---|")
    contenders = {}
    for mode in ("strict", "defer"):
        for stated in (False, True):
            contenders[(mode, stated)] = (moe_step_fn(tokens, width, experts, stated), mode)
    flushes = {}
    for stated in (False, True):
        step = contenders[("defer", stated)][0]
        with torch.tpu.set_eager_mode("defer"):
            step()  # compiles
            torchtpu.reset_metrics()
            step()
        flushes[stated] = sum(torchtpu.metrics().get("flushes", {}).values())
    kwargs = {"repeat": 1, "min_time": 0.05} if tiny else {}
    times = compare(contenders, **kwargs)
    print(
        f"| {tokens}, {width}, {experts} | {_us(times[('strict', False)])} "
        f"| {_us(times[('strict', True)])} | {_us(times[('defer', False)])} "
        f"| {_us(times[('defer', True)])} "
        f"| {times[('strict', True)] / times[('strict', False)]:.2f} "
        f"| {times[('defer', True)] / times[('defer', False)]:.2f} "
        f"| {flushes[False]}, {flushes[True]} |",
        flush=True,
    )
    print(f"\n{window.verdict()}", flush=True)


if __name__ == "__main__":
    main()
