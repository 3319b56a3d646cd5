"""GPU scenarios of pinning backup buffers ahead of the first pause, one per fresh process:
`python pin_ahead_scenarios.py NAME` (Note [Pinning ahead] in host_buffer_pool.h).

Each asserts what a user can observe (device memory by cudaMemGetInfo, bytes after resume, the
allocator's stats of pinned host buffers) and prints "SCENARIO NAME OK" at the end. A fresh
process matters here: the host pool keeps its buffers, so only a process's first pause is cold.
"""

from __future__ import annotations

import sys

from scenarios import GiB, MiB, free_bytes, same_bits, scenario_registry

SCENARIOS, scenario = scenario_registry()


def fill_region(tag: str, total: int, count: int):
    """`count` tensors of random bytes, `total` bytes in all, in a region with CPU backup;
    returns them and CPU copies of their contents."""
    import torch

    import torch_uvm_saver as tus

    with tus.region(tag, enable_cpu_backup=True):
        tensors = [torch.empty(total // count, dtype=torch.uint8, device="cuda")]
        tensors += [torch.empty_like(tensors[0]) for _ in range(count - 1)]
    for tensor in tensors:
        tensor.random_()
    return tensors, [tensor.cpu() for tensor in tensors]


def wait_for_pin_ahead() -> None:
    from torch_uvm_saver import _native

    for allocator in _native.allocators():
        assert allocator.wait_pin_ahead(120.0), "the pool's worker did not finish in 120 s"


@scenario
def first_pause_after_pin_ahead_makes_no_new_pinned_allocation() -> None:
    import time

    import torch_uvm_saver as tus

    assert tus.get_pin_ahead()  # on by default
    tag = "weights"
    tensors, expected = fill_region(tag, 2 * GiB, 8)
    start = time.perf_counter()
    wait_for_pin_ahead()
    print(f"waited {time.perf_counter() - start:.3f} s for the pool to be idle")
    stats = tus.memory_stats()
    assert stats["host_pinned_ahead_bytes"] >= 2 * GiB, stats["host_pinned_ahead_bytes"]
    assert stats["host_pin_ahead_failures"] == 0
    assert stats["host_pin_ahead_pending_bytes.current"] == 0
    misses = stats["host_pool_misses"]
    before = free_bytes()
    start = time.perf_counter()
    tus.pause(tag)
    seconds = time.perf_counter() - start
    freed = free_bytes() - before
    stats = tus.memory_stats()
    print(
        f"first pause of 2 GiB took {seconds * 1e3:.1f} ms, freed {freed / GiB:.3f} GiB; "
        f"{stats[f'pause_buffer_hits.tag:{tag}']} buffers ready, "
        f"{stats[f'pause_buffer_misses.tag:{tag}']} pinned by the pause"
    )
    assert freed >= 1.99 * GiB
    assert stats["host_pool_misses"] == misses  # no new pinned allocation
    assert stats[f"pause_buffer_misses.tag:{tag}"] == 0
    assert stats[f"pause_buffer_hits.tag:{tag}"] >= 1
    tus.resume(tag)
    for tensor, copy in zip(tensors, expected):
        assert same_bits(tensor.cpu(), copy)


@scenario
def pin_ahead_off_first_pause_pins_for_itself() -> None:
    import torch_uvm_saver as tus

    tus.set_pin_ahead(False)
    tag = "weights"
    tensors, expected = fill_region(tag, 1 * GiB, 4)
    wait_for_pin_ahead()
    stats = tus.memory_stats()
    assert stats["host_pinned_ahead_bytes"] == 0
    assert stats["host_pool_bytes.current"] == 0
    tus.pause(tag)
    stats = tus.memory_stats()
    assert stats[f"pause_buffer_misses.tag:{tag}"] >= 1
    tus.resume(tag)
    for tensor, copy in zip(tensors, expected):
        assert same_bits(tensor.cpu(), copy)


@scenario
def pause_while_the_worker_still_pins_keeps_every_byte() -> None:
    import torch_uvm_saver as tus

    tag = "weights"
    tensors, expected = fill_region(tag, 2 * GiB, 8)  # paused at once: the worker is mid-way
    tus.pause(tag)
    stats = tus.memory_stats()
    hits = stats[f"pause_buffer_hits.tag:{tag}"]
    misses = stats[f"pause_buffer_misses.tag:{tag}"]
    print(f"{hits} buffers ready or waited for, {misses} pinned by the pause itself")
    tus.resume(tag)
    for tensor, copy in zip(tensors, expected):
        assert same_bits(tensor.cpu(), copy)
    wait_for_pin_ahead()
    # Every buffer was pinned once, by the worker or by the pause: none twice.
    assert tus.memory_stats()["host_pool_bytes.current"] <= 2 * GiB + 64 * MiB


if __name__ == "__main__":
    name = sys.argv[1]
    SCENARIOS[name]()
    print(f"SCENARIO {name} OK", flush=True)
