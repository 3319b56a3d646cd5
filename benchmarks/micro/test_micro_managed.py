"""Managed memory: prefetch of one managed block to the host and back to the device (what the
uvm offload and the device budget do), per size. ``extra_info`` splits the round trip with the
allocator's own ``prefetch_to_host_seconds`` and ``prefetch_to_device_seconds``. The blocks stay
tiny: managed memory past the GPU's free memory can hang it (``managed_room`` skips first)."""

from __future__ import annotations

import os

import pytest

MiB = 1 << 20
SENTINEL = 64 << 10
DEVICE = "cuda:0"


@pytest.mark.parametrize("size", [4 * MiB, 64 * MiB], ids=["4MiB", "64MiB"])
def test_prefetch_to_host_and_back(
    benchmark, allocator, device_io, device_sync, managed_room, record_split, rounds, size
) -> None:
    managed_room(allocator, size)
    write, read = device_io
    ptr = allocator.malloc(size, tag="bench", mode="managed")
    sentinel = os.urandom(SENTINEL)
    write(ptr, sentinel)

    # Once, what a user observes: the pages move (the driver says where they were sent last),
    # the allocator's residency counters follow, and the contents travel with them.
    assert allocator.prefetch(ptr, size, "cpu") == size
    device_sync()
    assert allocator.range_attributes(ptr, size)["last_prefetch_location"] == "cpu"
    stats = allocator.stats()
    assert stats["managed_host_bytes.tag:bench.current"] == size
    assert stats["managed_device_bytes.tag:bench.current"] == 0
    assert allocator.prefetch(ptr, size, DEVICE) == size
    device_sync()
    assert allocator.range_attributes(ptr, size)["last_prefetch_location"] == DEVICE
    assert allocator.stats()["managed_device_bytes.tag:bench.current"] == size
    assert read(ptr, SENTINEL) == sentinel

    def round_trip() -> None:
        allocator.prefetch(ptr, size, "cpu")
        allocator.prefetch(ptr, size, DEVICE)
        device_sync()

    before = allocator.stats()
    benchmark.extra_info.update(bytes=size, call="prefetch cpu + prefetch cuda:0")
    benchmark.pedantic(round_trip, rounds=rounds(10, 20), iterations=1, warmup_rounds=1)
    after = allocator.stats()
    moved = after["prefetch_to_host_bytes.tag:bench"] - before["prefetch_to_host_bytes.tag:bench"]
    assert moved >= size and moved % size == 0
    assert (
        after["prefetch_to_device_bytes.tag:bench"] - before["prefetch_to_device_bytes.tag:bench"]
        == moved
    )
    assert read(ptr, SENTINEL) == sentinel
    trips = moved // size
    for direction in ("host", "device"):
        seconds = f"prefetch_to_{direction}_seconds.tag:bench"
        if after[seconds] > before[seconds]:  # timed on a GPU; the simulated driver says 0
            mean = (after[seconds] - before[seconds]) / trips
            benchmark.extra_info[f"prefetch_to_{direction}_mean_s"] = mean
    allocator.free(ptr)
