"""The LMS session's page-out and prefetch copies of a batch, queued on a stream in one call.

Note [Copies queued in one call]
    A GPT-2 medium step at 4x pages in about 390 batches of one or two storages each, on the
    session's own streams, and the step's pace is the host's (it queued a step in 0.20-0.22 s
    where the device needed about 0.16). Through PyTorch each batch cost the host a hand-over
    (an event recorded, a wait queued), a switch of the current stream and back, and per
    storage a wait for the copy it must follow and a ``copy_`` (12 us each on an H200), about
    80 us a batch. Queued natively (``_C.queue_relocation_copies``: the driver's
    ``cuEventRecord``, ``cuStreamWaitEvent`` and ``cuMemcpy*Async``, the GIL held) the batch
    is one call with the addresses PyTorch gives: no current stream changes, no tensor is
    made. What stays in Python is what PyTorch's allocator must see: ``resize_`` of each
    storage and ``record_stream`` of each block its copy reads or writes.
    What that buys, measured on alternate steps of one process (so that the lent machines'
    CPUs, which ran the same Python loop 2x apart, cancel: lms_state_split.py --probe
    alternate, benchmarks/results/lms_alternating_steps_NVIDIA_H200.txt), one H200: at GPT-2
    medium 4x the batches took 7.0 + 6.9 ms of host time a step (page-out, prefetch) against
    8.3 + 8.0 ms through PyTorch's calls, 2.4 ms of a 0.2 s step, and at GPT-2 XL 3x nothing.
    The steps took as long either way. The batches are a small part of the host's step; the
    native path is kept for its fewer calls and its checked failure paths.
    The same call makes and records the event that ends the batch (``_C.CopyDoneEvent``), which
    the blocks' next readers wait for: a ``torch.cuda.Event`` a batch, made by
    ``Stream.record_event``, cost 9.2 us of host time (200 a step at GPT-2 medium 4x, the
    probe's process at a 30 ms host loop), and a wait through torch 2.2 us (266 a step).
    The native path needs the process driver to be CUDA's (it is, unless a test installed the
    simulated one while a GPU is present); otherwise PyTorch's calls queue the same work.
    A driver error stops a batch at the copy it names, and the session loses nothing: a
    page-out batch resizes no storage before it is queued, and on an error tells the planner
    that its blocks are still resident (RelocationPlanner::pageout_failed); a prefetch batch
    gives the device memory it took back, its blocks out again with their bytes on the host.
"""

from __future__ import annotations

import torch

from . import _C
from .stream_handover import Handover, switched

__all__ = ["CopyQueue"]


class CopyQueue:
    """Queues copies between device storages' bytes and pinned host buffers on one stream, and
    hands out the event that ends each batch: a ``_C.CopyDoneEvent`` on the native path (made
    and recorded in the same call: Note [Copies queued in one call]), a ``torch.cuda.Event``
    otherwise. Only this queue's own methods wait for them."""

    __slots__ = ("_device", "_driver", "_handover", "_handover_event", "native")

    def __init__(self, device: torch.device) -> None:
        self._device = device.index
        self._driver = _C.get_driver()
        self.native = self._driver.name == "cuda"
        self._handover = Handover()
        # torch makes an event's CUDA object at its first record: one record here gives the
        # native calls a handle to record again.
        self._handover.event.record(torch.cuda.current_stream(device))
        self._handover_event = self._handover.event.cuda_event  # the raw handle, the same after

    def queue(
        self,
        stream: torch.cuda.Stream,
        current: torch.cuda.Stream,
        others: tuple,
        after: list,
        copies: list[tuple[torch.Tensor, torch.Tensor]],
        to_host: bool,
    ) -> object:
        """Queues each (device bytes, host buffer) copy of `copies` on `stream`, `to_host` or
        back, after what `current` and `others` have queued and after each event of `after`
        (events this queue handed out); returns the event that ends the batch."""
        if self.native:
            return _C.queue_relocation_copies(
                self._driver,
                self._device,
                stream.cuda_stream,
                self._handover_event,
                [current.cuda_stream] + [other.cuda_stream for other in others],
                after,
                [(device.data_ptr(), host.data_ptr(), device.numel()) for device, host in copies],
                to_host,
            )
        for waited in (current, *others):
            self._handover.wait_for(stream, waited)
        for event in after:
            stream.wait_event(event)
        with switched(stream, current):
            for device, host in copies:
                if to_host:
                    host.copy_(device, non_blocking=True)
                else:
                    device.copy_(host, non_blocking=True)
        return stream.record_event()

    def wait(self, stream: torch.cuda.Stream, event: object) -> None:
        """Work queued on `stream` from now on runs after the batch `event` ended."""
        if self.native:
            event.wait(stream.cuda_stream)
        else:
            stream.wait_event(event)
