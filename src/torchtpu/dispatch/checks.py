"""Checks that need values: an index out of range, a class label out of bounds.

A lowering states such a check with `error_if` (ops/value_checks.py). The compiled op returns the check's
flag with its results, and the dispatcher keeps the flag *pending* instead of waiting
for it: like a device-side assert on a GPU, the error is raised at the next read of
values (``.item()``, ``.cpu()``, ``print``, ``torch.tpu.synchronize()``), naming the op
and the user's line that ran it. In Debug mode it is raised at once, by the op.
A check is never dropped: the error is raised before any value computed after it can
be read.
"""

from __future__ import annotations

from torchtpu import config, tracing

# (flag array, exception type, message, op, where) of ops that ran but were not checked yet.
_pending: list[tuple] = []


def _error(exc_type, message: str, op, where: str) -> BaseException:
    """The exception of a failed check: torch's message as torch words it, the op and
    the user's line in a note (PEP 678), so a test matching the message sees torch's."""
    exc = exc_type(message)
    # A check traced inside a compiled graph names its line already: once is enough.
    exc.add_note(f"torchtpu: raised by {op}" + ("" if where in str(op) else f" ({where})"))
    return exc


def defer(flags, infos, where: str) -> None:
    """Keep checks of an op that ran; ``infos`` are (exc_type, message, op) per flag.

    Inside a trace the flags are tracers: they become outputs of the program.
    """
    if tracing._active is not None:
        tracing._active.checks.extend(
            (flag, exc_type, message, f"{op}, {where}")
            for flag, (exc_type, message, op) in zip(flags, infos)
        )
        return
    for flag, (exc_type, message, op) in zip(flags, infos):
        _pending.append((flag, exc_type, message, op, where))
    if len(_pending) >= config.max_pending_checks:
        raise_pending()


def raise_now(flags, infos, where: str) -> None:
    """Check an op's flags at once (Debug mode)."""
    from torchtpu.runtime import transfer

    values = transfer.read_all(list(flags))
    for value, (exc_type, message, op) in zip(values, infos):
        if bool(value):
            raise _error(exc_type, message, op, where)


def raise_pending() -> None:
    """Raise the first failed pending check, if any; clear them all."""
    if _pending:
        _read_checked([])


def _read_checked(arrays: list) -> list:
    """The values of ``arrays``, read in the same round trip as the pending checks' flags
    and returned only if every check passed (else the first failure is raised): a value
    computed after a failed check is never seen. One round trip, not two: on a TPU each
    read waits ~0.4 ms for the device, and a training step that logs its loss has a
    check pending (its cross-entropy's class bounds)."""
    from torchtpu.runtime import transfer

    pending = list(_pending)
    _pending.clear()
    values = transfer.read_all([entry[0] for entry in pending] + list(arrays))
    for value, (_, exc_type, message, op, where) in zip(values, pending):
        if bool(value):
            raise _error(exc_type, message, op, where)
    return values[len(pending) :]


def to_host(array):
    """A CPU tensor of ``array``'s values, read only after every pending check has
    passed (runtime/transfer.py moves the bytes)."""
    from torchtpu.runtime import transfer

    if _pending and transfer.reads_with_checks(array):
        transfer.note_read(array)
        return transfer.from_numpy(_read_checked([array])[0])
    raise_pending()
    return transfer.to_host(array)


def item(array):
    """The Python number of a one-element ``array``, after the pending checks."""
    from torchtpu.runtime import transfer

    transfer.note_read(array)
    return _read_checked([array])[0].item()
