"""GPU soak, in a fresh process: `python soak_scenarios.py NAME` (test_scenarios.py runs it).

1,000 cycles, each pausing and resuming a tag with a CPU backup and one without, moving a small
managed tensor to the host and back, and allocating and freeing region memory. After them the
device's free memory (cudaMemGetInfo) must be within 2 MiB of where it was after the warm-up,
with the bytes intact, no pinned buffer added to the pool, and the process's open files as
before. tests/sim/test_soak.py runs 10,000 cycles of the same on the simulated driver. The
managed tensor is 32 MiB: far under half of any GPU's free memory (the shared GPU's rule).
"""

from __future__ import annotations

import os
import sys

from scenarios import MiB, free_bytes, same_bits, scenario_registry

SCENARIOS, scenario = scenario_registry()

CYCLES = 1_000
WARM_UP = 10  # the pool's pinned buffers and PyTorch's cached blocks are made here
TOLERANCE = 2 * MiB


@scenario
def thousand_cycles_return_device_memory_to_the_baseline() -> None:
    import torch

    import torch_uvm_saver as tus

    with tus.region("soak-weights", enable_cpu_backup=True):
        weights = [torch.randn(8 * MiB, device="cuda") for _ in range(2)]  # 32 MiB each
    with tus.region("soak-cache"):
        cache = torch.zeros(8 * MiB, device="cuda")  # no backup: its bytes go at each pause
    with tus.region("soak-managed", mode="managed"):
        managed = torch.randn(8 * MiB, device="cuda")
    expected = [w.cpu() for w in weights]
    expected_managed = managed.cpu()

    def cycle() -> None:
        assert tus.pause("soak-weights") >= 64 * MiB
        assert tus.pause("soak-cache") >= 32 * MiB
        tus.resume("soak-weights")
        tus.resume("soak-cache")
        cache.fill_(1.0)  # the fresh memory is usable
        tus.prefetch(managed, "cpu")
        tus.prefetch(managed, "cuda")
        with tus.region("soak-weights", enable_cpu_backup=True):
            scratch = torch.empty(4 * MiB, device="cuda")
        scratch.fill_(2.0)
        del scratch

    for _ in range(WARM_UP):
        cycle()
    baseline = free_bytes()
    stats = tus.memory_stats()
    misses, pauses = stats["host_pool_misses"], stats["num_pauses.tag:soak-weights"]
    open_files = len(os.listdir("/proc/self/fd"))

    for _ in range(CYCLES):
        cycle()
    after = free_bytes()
    stats = tus.memory_stats()
    print(f"free after {CYCLES} cycles differs from baseline by {(after - baseline) / MiB:.2f} MiB")
    assert abs(after - baseline) <= TOLERANCE
    assert stats["host_pool_misses"] == misses  # every pause found its buffer in the pool
    assert stats["num_pauses.tag:soak-weights"] == pauses + CYCLES
    assert len(os.listdir("/proc/self/fd")) == open_files
    assert all(same_bits(w.cpu(), e) for w, e in zip(weights, expected))
    assert same_bits(managed.cpu(), expected_managed)
    assert float(cache.sum()) == float(cache.numel())


if __name__ == "__main__":
    name = sys.argv[1]
    SCENARIOS[name]()
    print(f"SCENARIO {name} OK", flush=True)
