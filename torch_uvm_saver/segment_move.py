"""Moving storages out of PyTorch's fixed segments into expandable ones, at the same StorageImpl
(Note [Storages made before the session] in lms_session.py).

A storage made before expandable segments were turned on lies in a fixed segment: a cudaMalloc'd
range that PyTorch gives back only once nothing in it lives. Paging such a storage out leaves a
hole that only requests of its size or smaller can reuse, and that stays reserved, counted under
the limit. Measured on an H100 (GPT-2 medium, AdamW's state made before the session opened, limit
6.71 GiB): the loss's 1.54 GiB request failed with 2.82 GiB reserved and unallocated; with every
segment expandable the same run trained.
"""

from __future__ import annotations

import bisect

import torch


def in_fixed_segments(storages: list[torch.UntypedStorage], device: torch.device) -> list[int]:
    """Indices of the storages whose memory lies in a segment that is not expandable; none
    when PyTorch's allocator cannot say (another backend, such as cudaMallocAsync or a pluggable
    allocator, has no segments to snapshot)."""
    try:
        segments = torch.cuda.memory_snapshot()
    except RuntimeError:
        return []
    ranges = sorted(
        (segment["address"], segment["address"] + segment["total_size"])
        for segment in segments
        if segment.get("device") == device.index and not segment.get("is_expandable", False)
    )
    starts = [start for start, _ in ranges]
    found = []
    for index, storage in enumerate(storages):
        address = storage.data_ptr()
        at = bisect.bisect_right(starts, address) - 1
        if storage.nbytes() > 0 and at >= 0 and address < ranges[at][1]:
            found.append(index)
    return found


def move_into_expandable_segments(
    storages: list[torch.UntypedStorage], device: torch.device
) -> list[tuple[int, torch.Tensor]]:
    """Copies the storages aside, gives their memory back (PyTorch releases the fixed segments
    that are empty then) and takes new memory for each, with expandable segments on, so it comes
    from an expandable segment. Every tensor and view of a storage follows it. The copy aside is
    one device buffer, or host memory when the device has no room for it.

    Returns (index, pinned host copy) for the storages that could not be given device memory again
    (the device filled up meanwhile): they are left with 0 bytes and their bytes are in the copy,
    for the caller to page in later. Nothing is lost either way."""
    sizes = [storage.nbytes() for storage in storages]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    try:
        aside = torch.empty(offsets[-1], dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        aside = torch.empty(offsets[-1], dtype=torch.uint8)
    for storage, start, size in zip(storages, offsets, sizes):
        aside[start : start + size].copy_(byte_view(storage))
    for storage in storages:
        storage.resize_(0)
    torch.cuda.empty_cache()  # the fixed segments that are empty now go back to the driver
    stranded: list[tuple[int, torch.Tensor]] = []
    for index, (storage, start, size) in enumerate(zip(storages, offsets, sizes)):
        if not stranded:
            try:
                storage.resize_(size)
                byte_view(storage).copy_(aside[start : start + size])
                continue
            except torch.OutOfMemoryError:
                pass
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host.copy_(aside[start : start + size])
        stranded.append((index, host))
    torch.cuda.current_stream(device).synchronize()  # the copies read `aside` before it goes
    del aside
    torch.cuda.empty_cache()  # nor does the session keep the memory it was in
    return stranded


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
