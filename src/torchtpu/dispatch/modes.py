"""The eager modes and how to select them.

The mode is process-wide state, not thread-local: autograd runs backward ops on its
own worker thread, and they must run in the mode the user chose.
"""

from __future__ import annotations

import enum
import sys

from torchtpu import config


class EagerMode(enum.Enum):
    """How ops on tpu tensors run eagerly.

    ``DEFER_NEVER`` (Strict, the default) runs each op at once as a cached jitted
    function, asynchronously. ``DEFER_NEVER_AND_LAUNCH_BLOCKING`` (Debug) also waits
    for each op to finish, so an error names the aten op and the user's line.
    ``DEFER_AND_FUSE`` records ops and runs each run of them as one jitted function.
    """

    DEFER_NEVER = "strict"
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "debug"
    DEFER_AND_FUSE = "defer"

    # Friendlier aliases.
    STRICT = "strict"
    DEBUG = "debug"
    DEFER = "defer"


_ALIASES = {
    "strict": EagerMode.DEFER_NEVER,
    "defer_never": EagerMode.DEFER_NEVER,
    "debug": EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
    "defer_never_and_launch_blocking": EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
    "launch_blocking": EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
    "defer": EagerMode.DEFER_AND_FUSE,
    "defer_and_fuse": EagerMode.DEFER_AND_FUSE,
    "deferandfuse": EagerMode.DEFER_AND_FUSE,
}

_IMPLEMENTED = {
    EagerMode.DEFER_NEVER,
    EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
    EagerMode.DEFER_AND_FUSE,
}


def to_mode(mode: EagerMode | str) -> EagerMode:
    """Parse an EagerMode or one of its names ("strict", "debug", "defer", ...)."""
    if isinstance(mode, EagerMode):
        parsed = mode
    elif isinstance(mode, str) and mode.strip().lower() in _ALIASES:
        parsed = _ALIASES[mode.strip().lower()]
    else:
        names = ", ".join(sorted({"strict", "debug", "defer"}))
        raise ValueError(f"unknown eager mode {mode!r}; expected an EagerMode or one of {names}")
    if parsed not in _IMPLEMENTED:
        raise NotImplementedError(
            f"eager mode {parsed.name} is not available in this version of torchtpu; "
            "use EagerMode.DEFER_NEVER (Strict) or EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING (Debug)"
        )
    return parsed


_current: EagerMode | None = None


def current() -> EagerMode:
    """The eager mode in effect."""
    global _current
    if _current is None:
        _current = to_mode(config.eager_mode)
    return _current


def set_current(mode: EagerMode | str) -> None:
    global _current
    mode = to_mode(mode)
    if _current is EagerMode.DEFER_AND_FUSE and mode is not _current and "jax" in sys.modules:
        from torchtpu.dispatch import defer

        defer.flush("mode change")
    _current = mode


def is_debug() -> bool:
    return current() is EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING


def is_deferring() -> bool:
    return current() is EagerMode.DEFER_AND_FUSE


class set_eager_mode:
    """Select the eager mode; as a context manager, restore the previous one on exit.

    Example::

        torch.tpu.set_eager_mode("debug")          # from now on
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER):
            ...                                     # only inside the block
    """

    def __init__(self, mode: EagerMode | str):
        self._previous = current()
        set_current(mode)

    def __enter__(self) -> set_eager_mode:
        return self

    def __repr__(self) -> str:  # a notebook cell that ends with the call shows this
        return f"set_eager_mode({current().value!r})"

    def __exit__(self, *exc) -> None:
        set_current(self._previous)
