"""`Pending`: a value DeferAndFuse will produce (defer.py), held by a Storage in place
of its array until the queue that records it is flushed."""

from __future__ import annotations


class Pending:
    """A value the queue will produce: output ``index`` of node ``node``."""

    __slots__ = ("node", "index", "shape", "dtype", "queue", "value", "error", "__weakref__")

    def __init__(self, node: int, index: int, shape, dtype, queue=None):
        self.node, self.index, self.shape, self.dtype = node, index, shape, dtype
        self.queue = queue  # the queue that will produce it
        self.value = None
        self.error = None

    def node_done(self) -> bool:
        """Whether its chunk ran (successfully or not)."""
        return self.value is not None or self.error is not None

    def resolved(self):
        """The concrete array (after its flush), raising its chunk's error if it failed."""
        if self.error is not None:
            error = self.error
            notes = "; ".join(getattr(error, "__notes__", ()))  # the failed op, its line
            raise RuntimeError(
                f"this tensor's value was never computed: {type(error).__name__}: {error}"
                + (f" ({notes})" if notes else "")
            ) from error
        if self.value is None:  # never reached: a flush sets value or error
            raise RuntimeError("torchtpu: internal error: a deferred value its queue never ran")
        return self.value
