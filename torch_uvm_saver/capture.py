"""Whether a CUDA graph capture is open, for the calls that must not run during one.

Note [Pausing during capture]
    ``pause`` waits for the whole device (Note [Pause ordering] in pause_controller.h), and a
    device-wide synchronize while a stream is capturing invalidates the capture. So ``pause`` and
    ``resume`` refuse to run while a capture started here is open, or while the calling thread's
    current stream is capturing, with an InvalidStateError that says so; the capture goes on.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from .errors import InvalidStateError

_open_captures = 0
_open_captures_lock = threading.Lock()


def capturing() -> bool:
    """True while a capture is open (one of ours on any thread, or any on the current stream)."""
    if _open_captures > 0:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def refuse_during_capture(call: str) -> None:
    if capturing():
        raise InvalidStateError(
            f"{call}: a CUDA graph capture is open; pausing or resuming would synchronize the "
            "device and invalidate it (Note [Pausing during capture]). Call it after the capture."
        )


@contextlib.contextmanager
def counted_capture() -> Iterator[None]:
    global _open_captures
    with _open_captures_lock:
        _open_captures += 1
    try:
        yield
    finally:
        with _open_captures_lock:
            _open_captures -= 1
