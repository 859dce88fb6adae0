"""``torch.tpu.Stream``, ``Event``, ``current_stream``, ``stream``: in-order stubs.

JAX orders a device's work itself: every op and collective of this process runs in
the order the host dispatched it, so there is one stream in effect and waiting on
another is always satisfied. The classes exist for code written against CUDA's
streams (FSDP2 makes several and makes them wait on each other). ``Event`` with
``enable_timing`` measures real time: recording waits for the queued work first, so
``elapsed_time`` covers the device's time between two records.
"""

from __future__ import annotations

import contextlib
import time

import torch

from torchtpu import runtime

__all__ = ["Event", "Stream", "current_stream", "default_stream", "set_stream", "stream"]


def _index(device) -> int:
    if device is None:
        return runtime.current_index()
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return runtime.current_index() if index is None else index


def _sync() -> None:
    from torchtpu.dispatch.synchronize import sync

    sync()


class Stream:
    """A tpu stream. All streams of a device run in order with each other."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        index = _index(device)
        self.device = torch.device("tpu", index)
        self.device_index = index
        # An int, as torch.Stream's is (c10's DeviceType): FSDP2 passes it to an op
        # declared ``int device_type`` (torch 2.15's fsdp::record_grad_output_stream).
        self.device_type = int(torch._C._autograd.DeviceType.PrivateUse1)
        self.priority = priority
        self.stream_id = 0

    def wait_stream(self, stream: Stream) -> None:
        """Nothing to wait for: the streams are in order."""

    def wait_event(self, event: Event) -> None:
        """Nothing to wait for: the streams are in order."""

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _sync()

    def __enter__(self):
        self._context = stream(self)
        return self._context.__enter__()

    def __exit__(self, *exc) -> None:
        self._context.__exit__(*exc)

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and other.device == self.device

    def __hash__(self) -> int:
        return hash(self.device)

    def __repr__(self) -> str:
        return f"<torch.tpu.Stream device={self.device} (in order)>"


class Event:
    """A point in a stream's work; with ``enable_timing``, a time."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess=False):
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        if self.enable_timing:
            _sync()
            self._time = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        """Nothing to wait for: the streams are in order."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _sync()

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between this event's record and ``end_event``'s."""
        if self._time is None or end_event._time is None:
            raise RuntimeError(
                "elapsed_time needs two recorded events made with Event(enable_timing=True)"
            )
        return (end_event._time - self._time) * 1e3


_current: dict[int, Stream] = {}


def default_stream(device=None) -> Stream:
    index = _index(device)
    if index not in _current:
        _current[index] = Stream(index)
    return _current[index]


def current_stream(device=None) -> Stream:
    return default_stream(device)


def set_stream(stream: Stream) -> None:
    """Accepted for CUDA-like code; the work stays in order either way."""


@contextlib.contextmanager
def stream(stream: Stream | None):
    """``with torch.tpu.stream(s):`` -- work stays in order, so this changes nothing."""
    yield stream
