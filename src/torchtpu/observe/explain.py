"""``torchtpu.explain(fn, *args)``: run ``fn`` once and say where its time goes.

The account lists the ops run per eager mode, every DeferAndFuse flush (its reason,
the user line that caused it, how many ops it ran, whether it compiled), the XLA
compilations, the ops that ran on the CPU fallback and the torch.distributed
collectives. It is built from the counters (metrics.py) and from events the runtime
notes while a recording is open.
"""

from __future__ import annotations

import collections
import dataclasses

from torchtpu.observe import metrics


@dataclasses.dataclass
class Explanation:
    """What one call of ``fn`` did on tpu. ``str()`` gives the readable account."""

    result: object
    metrics: dict[str, dict[str, float]]
    events: list[tuple[str, dict]]

    @property
    def flushes(self) -> list[dict]:
        return [details for kind, details in self.events if kind == "flush"]

    @property
    def compiles(self) -> list[dict]:
        """Compilations of per-op programs (DeferAndFuse chunks are in ``flushes``)."""
        return [details for kind, details in self.events if kind == "compile"]

    @property
    def programs(self) -> list[dict]:
        """Each run of a DeferAndFuse chunk or compiled program, with XLA's account of
        its memory (``bytes``: arguments, outputs, aliased, temporaries)."""
        return [details for kind, details in self.events if kind == "program"]

    @property
    def fallbacks(self) -> list[dict]:
        return [details for kind, details in self.events if kind == "fallback"]

    def __str__(self) -> str:
        m = self.metrics
        ops = m.get("ops", {})
        lines = ["torchtpu.explain"]
        by_mode = ", ".join(f"{mode}: {int(n)}" for mode, n in sorted(ops.items()))
        lines.append(f"  ops run: {int(sum(ops.values()))}" + (f" ({by_mode})" if by_mode else ""))
        seconds = m.get("compile_seconds", {})
        lines.append(
            f"  per-op programs compiled (Strict, Debug): {len(self.compiles)}"
            f" ({seconds.get('op', 0.0):.2f} s)"
        )
        if self.compiles:
            where = collections.Counter(c["where"] for c in self.compiles)
            for line, n in where.most_common(5):
                lines.append(f"    {n} from {line}")
        lines.append(
            f"  DeferAndFuse flushes: {len(self.flushes)}"
            f" (chunks compiled: {sum(f['compiled'] for f in self.flushes)},"
            f" {seconds.get('chunk', 0.0):.2f} s)"
        )
        for i, f in enumerate(self.flushes, 1):
            state = "compiled" if f["compiled"] else "cached"
            if f["failed"]:
                state += ", failed"
            lines.append(
                f"    {i}. {f['reason']} at {f['where']}: {f['ops']} ops, "
                f"{f['outputs']} outputs kept ({state})"
            )
        if self.programs:
            lines.append("  programs' memory (XLA: arguments, new outputs, temporaries):")
            runs = collections.Counter((p["what"], p["where"], p["bytes"]) for p in self.programs)
            for (what, where, b), n in runs.items():
                parts = (b.arguments, b.outputs - b.aliased, b.temporaries)
                lines.append(
                    f"    {what} at {where}: " + ", ".join(_mib(x) for x in parts)
                    + (f" ({n} runs)" if n > 1 else "")
                )
        fallback = m.get("fallback", {})
        if fallback:
            lines.append("  CPU fallbacks (slow: no lowering):")
            for op, n in sorted(fallback.items(), key=lambda kv: -kv[1]):
                first = next((f["where"] for f in self.fallbacks if f["op"] == op), "?")
                lines.append(f"    {op}: {int(n)} calls, first from {first}")
        else:
            lines.append("  CPU fallbacks: none")
        collectives = m.get("collectives", {})
        if collectives:
            nbytes = m.get("collective_bytes", {})
            lines.append(
                "  torch.distributed collectives: "
                + ", ".join(
                    f"{kind} {int(n)} ({int(nbytes.get(kind, 0)):,} bytes)"
                    for kind, n in sorted(collectives.items())
                )
            )
        attention = m.get("attention", {})
        if attention:  # which attention implementation each call took, and why
            lines.append("  attention:")
            for choice, n in sorted(attention.items(), key=lambda kv: -kv[1]):
                lines.append(f"    {choice}: {int(n)}")
        moved = m.get("transfer_bytes", {})
        if moved:
            lines.append(
                "  bytes moved: "
                + ", ".join(f"{name} {int(n):,}" for name, n in sorted(moved.items()))
            )
        return "\n".join(lines)

    __repr__ = __str__


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.2f} MiB"


def explain_call(fn, args, kwargs, finish) -> Explanation:
    """Run ``fn(*args, **kwargs)`` once, then ``finish()`` (wait for its work), and
    explain what ran (``torchtpu.explain``, in the package root, passes its ``sync``)."""
    before = metrics.metrics()
    log: list = []
    metrics._recorders.append(log)
    try:
        result = fn(*args, **kwargs)
        finish()
    finally:
        metrics._recorders.remove(log)
    return Explanation(result, _difference(metrics.metrics(), before), log)


def _difference(after: dict, before: dict) -> dict:
    out = {}
    for category, values in after.items():
        old = before.get(category, {})
        changed = {k: v - old.get(k, 0) for k, v in values.items() if v != old.get(k, 0)}
        if changed:
            out[category] = changed
    return out
