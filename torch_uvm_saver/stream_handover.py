"""Handing work from one CUDA stream to another with fewer host calls than torch.cuda's helpers.

Note [Stream hand-overs]
    The session pages in batches on streams of their own hundreds of times a step (GPT-2
    medium at 4x), and step_in_backward and the host's optimizer state hand each parameter
    group's step to a side stream; on a host-bound step each call's microseconds add up.
    ``waiter.wait_stream(stream)`` makes a new event every call (11 us on an H200); recording
    one reused event and waiting on it costs 5 us, and is as safe: a wait already queued keeps
    the record it was queued behind, so the event may be recorded again at once.
    ``torch.cuda.stream(s)`` looks the current device and stream up on entering and on leaving
    (17 us a use); while the stream's device is the current one, setting the raw current stream
    and setting it back is all it takes (3 us). Each Handover is used by one owner from one
    thread at a time (the training thread, or autograd's device thread in a backward, never
    both at once).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Handover", "switched"]

_SET_STREAM = getattr(torch._C, "_cuda_setStream", None)  # absent from CPU builds
_CURRENT_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


class Handover:
    """``waiter.wait_stream(stream)`` with one event, recorded again for each hand-over."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = torch.cuda.Event()

    @property
    def event(self) -> torch.cuda.Event:
        """The reused event (Note [Copies queued in one call] records it natively too)."""
        return self._event

    def wait_for(self, waiter: torch.cuda.Stream, stream: torch.cuda.Stream) -> None:
        """`waiter` runs what is queued on it from now on after what `stream` has queued."""
        self._event.record(stream)
        waiter.wait_event(self._event)


def switched(stream: torch.cuda.Stream, back: torch.cuda.Stream) -> Any:
    """``torch.cuda.stream(stream)``, entered while `back` is the current stream."""
    if _SET_STREAM is None or _CURRENT_DEVICE() != stream.device_index:
        return torch.cuda.stream(stream)
    return _Switch(stream, back)


def _make_current(stream: torch.cuda.Stream) -> None:
    _SET_STREAM(
        stream_id=stream.stream_id,
        device_index=stream.device_index,
        device_type=stream.device_type,
    )


class _Switch:
    """Makes `stream` the current one of its device (the current device), and `back` after."""

    __slots__ = ("back", "stream")

    def __init__(self, stream: torch.cuda.Stream, back: torch.cuda.Stream) -> None:
        self.stream = stream
        self.back = back

    def __enter__(self) -> None:
        _make_current(self.stream)

    def __exit__(self, *_: object) -> None:
        _make_current(self.back)
