"""FlexAttention with a sliding-window block mask: the listed blocks against every score.

    python benchmarks/attention.py                      # lengths 2048, 4096, 8192
    python benchmarks/attention.py --lengths 1024 2048  # quicker
    python benchmarks/attention.py --transformers       # through a Transformers model
    python benchmarks/attention.py --path compile       # compiled: the program's loop
    python benchmarks/attention.py --dtype bfloat16     # and JAX's splash kernel (a TPU)

One causal sliding window of 256 keys (``create_block_mask``, blocks of 128), q, k, v
float32 [1, 4, L, 64] on tpu, forward and backward in Strict mode (or, with ``--path``,
under ``torch.compile(backend="tpu")`` or in a ``torchtpu.jit`` step), with
``torchtpu.config.flex_blocks`` "on" (compile/flex_blocks.py: only the blocks the mask
lists are scored; in a compiled program, a loop over them, compile/flex_loop.py) and
"off" (torch's dense implementation: every score of [L, L] is built and masked); with
``--dtype bfloat16`` in Strict, also as JAX's Pallas splash kernel over the same blocks
(compile/flex_splash.py; on a TPU). Each cell runs in a fresh process: the median of ``--repeats`` steps
after one that compiles, and the peak memory -- growth of the process's peak RSS over
its resident size before the timed steps (JAX's CPU backend holds device arrays in the
process) and, where JAX reports it (TPU, GPU), the device's peak bytes from before the
first step (a compiled program's temporaries are held from its first call on).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import quiet  # noqa: E402

_CELL = r"""
import json, statistics, sys, time
sys.path.insert(0, {root!r})
import torch
import torchtpu
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

length, blocks, repeats, transformers = {length!r}, {blocks!r}, {repeats!r}, {transformers!r}
path, dtype, flash = {path!r}, getattr(torch, {dtype!r}), {flash!r}
torchtpu.config.flex_blocks = blocks
torchtpu.config.flash_attention = flash
WINDOW = 256


def window(b, h, q, kv):
    return (q >= kv) & (q - kv < WINDOW)


def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024


def device_bytes(*keys):
    # A TPU counts compiled programs' temporaries apart, as reserved bytes.
    from torchtpu.runtime import jax
    stats = jax().local_devices()[0].memory_stats() or {{}}
    return sum(stats.get(key, 0) for key in keys) if stats else None


torch.manual_seed(0)
if transformers:  # Transformers makes the block mask and compiles flex_attention itself
    import transformers as tr

    config = tr.MistralConfig(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=length, sliding_window=WINDOW,
    )
    model = tr.MistralForCausalLM(config).to("tpu").train()
    model.set_attn_implementation("flex_attention")
    ids = torch.randint(0, 128, (1, length)).to("tpu")

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss)
else:
    q, k, v = (torch.randn(1, 4, length, 64, dtype=dtype).to("tpu").requires_grad_() for _ in range(3))
    # Made on the CPU: made on tpu, its dense [L, L] mask would be the device's peak.
    mask = create_block_mask(window, None, None, length, length, device="cpu", BLOCK_SIZE=128)
    mask = mask.to("tpu")

    def attend():
        out = flex_attention(q, k, v, block_mask=mask)
        out.sum().backward()
        return q.grad.sum()

    if path == "compile":  # the sum makes it more than a lone flex_attention call
        attend = torch.compile(attend, backend="tpu")
    elif path == "jit":
        attend = torchtpu.jit(attend)

    def step():
        for t in (q, k, v):
            t.grad = None
        return float(attend())


# Before the first call: a compiled program's temporaries are reserved while it is
# loaded, from its first call on (a TPU counts them apart, as bytes_reserved).
device_before = device_bytes("bytes_in_use", "bytes_reserved")
step()  # compiles
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
except OSError:
    pass
before = rss("VmRSS:")
times = []
for _ in range(repeats):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
device_peak = device_bytes("peak_bytes_in_use", "peak_bytes_reserved")
print(json.dumps({{
    # A sandbox may keep no VmHWM (the TPU machine's): the growth is then unknown.
    "seconds": statistics.median(times),
    "growth": None if None in (peak := rss("VmHWM:"), before) else peak - before,
    "device": None if device_peak is None else device_peak - device_before,
    "choices": torchtpu.metrics().get("attention", {{}}),
}}))
"""


def cell(
    length: int, blocks: str, repeats: int, transformers: bool = False, path="strict",
    dtype="float32", flash="off",
) -> dict:  # fmt: skip
    code = _CELL.format(
        root=ROOT, length=length, blocks=blocks, repeats=repeats, transformers=transformers,
        path=path, dtype=dtype, flash=flash,
    )  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if run.returncode:
        return {"error": (run.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def _mib(n):
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--require-quiet", action="store_true", help="refuse a busy machine")
    parser.add_argument(
        "--transformers", action="store_true",
        help="a Transformers Mistral (2 layers, d 256, window 256) with flex_attention instead",
    )  # fmt: skip
    parser.add_argument(
        "--path", choices=("strict", "compile", "jit"), default="strict",
        help="eager Strict, torch.compile(backend='tpu') or a torchtpu.jit step",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32",
        help="q, k and v's dtype; bfloat16 in Strict adds the splash kernel's columns",
    )  # fmt: skip
    args = parser.parse_args()
    if args.transformers and args.path != "strict":
        parser.error("--transformers runs in Strict (Transformers compiles flex_attention itself)")
    quiet.check_before_start()  # (the cells' own processes would count as others' load)
    what = (
        "a Transformers MistralForCausalLM (2 layers, d 256, 4 heads of 64, sliding window "
        "256), attn_implementation=\"flex_attention\", one sequence of L tokens"
        if args.transformers
        else f"FlexAttention, causal sliding window of 256, [1, 4, L, 64] {args.dtype}"
    )
    splash = args.dtype == "bfloat16" and args.path == "strict" and not args.transformers
    how = {"strict": "Strict", "compile": "torch.compile", "jit": "torchtpu.jit"}[args.path]
    print(f"`python benchmarks/attention.py --lengths {' '.join(map(str, args.lengths))}"
          f"{' --transformers' if args.transformers else ''}"
          f"{'' if args.path == 'strict' else ' --path ' + args.path}"
          f"{'' if args.dtype == 'float32' else ' --dtype ' + args.dtype}`: {what}, forward and "
          f"backward, {how}\n")  # fmt: skip
    extra = " splash: time | splash: device peak | dense/splash |" if splash else ""
    print("| L | blocks: time | dense: time | dense/blocks | blocks: peak RSS growth | "
          f"dense: peak RSS growth | blocks: device peak | dense: device peak |{extra}")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|" + ("---|---|---|" if splash else ""))
    for length in args.lengths:
        on, off = (
            cell(length, b, args.repeats, args.transformers, args.path, args.dtype)
            for b in ("on", "off")
        )
        kernel = ""
        if splash:
            fused = cell(length, "on", args.repeats, False, "strict", args.dtype, "auto")
            kernel = (
                f" {fused['error']} | | |" if "error" in fused else
                f" {fused['seconds'] * 1e3:,.1f} ms | {_mib(fused['device'])} | "
                f"{off.get('seconds', 0) / fused['seconds']:.1f}x |"
            )  # fmt: skip
        if "error" in on or "error" in off:
            print(f"| {length} | {on.get('error', '')} | {off.get('error', '')} | | | | | |")
            continue
        print(
            f"| {length} | {on['seconds'] * 1e3:,.1f} ms | {off['seconds'] * 1e3:,.1f} ms | "
            f"{off['seconds'] / on['seconds']:.1f}x | {_mib(on['growth'])} | {_mib(off['growth'])} | "
            f"{_mib(on['device'])} | {_mib(off['device'])} |{kernel}",
            flush=True,
        )


if __name__ == "__main__":
    main()
