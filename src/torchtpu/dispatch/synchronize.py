"""``torchtpu.sync()`` / ``torch.tpu.synchronize()``: finish all queued work."""

from __future__ import annotations

import sys


def sync() -> None:
    """Wait for every queued op to finish; raise any pending value check (e.g. an
    index out of range) with the op and user line that caused it."""
    if "jax" not in sys.modules:  # no tpu tensor was ever made
        return
    import jax

    from torchtpu.dispatch import background, checks, defer

    defer.flush("sync")
    background.run_queued("sync")  # Strict's ops waiting for their compiles
    checks.raise_pending()
    jax.block_until_ready(jax.live_arrays())
