"""How a lowering states a check that needs values: `error_if`.

Inside a jitted lowering the condition is a tracer, so it cannot be tested there: it
is collected (`collect`) and becomes an output flag of the compiled op, which the
dispatcher checks later (dispatch/checks.py). A concrete condition raises at once.
"""

from __future__ import annotations

# Checks stated while the dispatcher traces a lowering: a stack of lists.
_collecting: list[list] = []


def error_if(condition, exc_type: type[Exception], message: str) -> None:
    """Inside a lowering: raise ``exc_type(message)`` if ``condition`` holds."""
    from torchtpu.runtime import jax

    if isinstance(condition, jax().core.Tracer):
        if not _collecting:
            raise RuntimeError(
                f"torchtpu internal error: a value check ({message}) was traced where "
                "nothing collects it"
            )
        _collecting[-1].append((condition, exc_type, message))
    elif bool(condition):
        raise exc_type(message)


class collect:
    """Context manager: collect the checks stated while tracing a lowering."""

    def __enter__(self) -> list:
        self.checks = []
        _collecting.append(self.checks)
        return self.checks

    def __exit__(self, *exc) -> None:
        _collecting.pop()
