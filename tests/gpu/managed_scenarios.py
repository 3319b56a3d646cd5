"""GPU scenarios of managed memory, unified memory for the whole process and the device budget,
one per fresh process: `python managed_scenarios.py NAME` (test_scenarios.py runs them all).

Managed totals stay far under half the GPU's free memory (the shared GPU's rule); the guard and
the budget are exercised by lowering their limits, never by asking for more than the card has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable

from scenarios import expect_error, free_bytes, same_bits

MiB = 1 << 20
SCENARIOS: dict[str, Callable[[], None]] = {}


def scenario(function: Callable[[], None]) -> Callable[[], None]:
    SCENARIOS[function.__name__] = function
    return function


@scenario
def managed_region_tensors_are_managed_and_prefer_their_gpu() -> None:
    import torch

    import torch_uvm_saver as tus

    with tus.region("m", mode="managed"):
        x = torch.arange(8 * MiB, dtype=torch.float32, device="cuda")
    plain = torch.ones(10, device="cuda")
    pinned = torch.ones(10, pin_memory=True)
    assert tus.is_managed(x) and tus.is_managed(x[100:])
    assert not tus.is_managed(plain)
    assert not tus.is_managed(pinned)
    assert not tus.is_managed(torch.ones(10))
    attributes = tus.memory_attributes(x)
    print(attributes)
    assert attributes["preferred_location"] == "cuda:0"
    assert attributes["last_prefetch_location"] == "cuda:0"  # populated at allocation
    assert torch.equal(x.cpu(), torch.arange(8 * MiB, dtype=torch.float32))
    stats = tus.memory_stats()
    assert stats["managed_bytes.tag:m.current"] >= 32 * MiB
    with tus.region("m2", mode="managed", preferred_location="cpu", accessed_by="cuda"):
        y = torch.zeros(MiB, device="cuda")
    attributes = tus.memory_attributes(y)
    print(attributes)
    assert attributes["preferred_location"] == "cpu"
    assert attributes["accessed_by"] == ["cuda:0"]
    y += 1  # read and written in place over the link
    assert float(y.sum()) == MiB
    # Managed memory another library allocated (here straight from the driver) is managed too.
    from torch_uvm_saver import _C

    driver = _C.get_driver()
    foreign = driver.mem_alloc_managed(0, MiB)
    alias = torch.from_dlpack(_C.alias_capsule(foreign, MiB, "cuda", 0, None))
    assert tus.is_managed(alias)
    del alias
    driver.mem_free(0, foreign)


@scenario
def to_returns_an_alias_both_ways() -> None:
    import torch

    import torch_uvm_saver as tus

    with tus.region("a", mode="managed"):
        x = torch.zeros(4 * MiB, dtype=torch.int32, device="cuda")
    c = tus.to(x, "cpu")
    assert c.device.type == "cpu" and c.data_ptr() == x.data_ptr()
    assert tus.memory_attributes(x)["last_prefetch_location"] == "cpu"
    c[7] = 5  # a CPU write, seen by the GPU
    assert int(x[7]) == 5
    x.fill_(3)  # a GPU write, seen by the CPU after the stream synchronized
    torch.cuda.synchronize()
    assert int(c.sum()) == 3 * 4 * MiB
    g = tus.to(c, "cuda")
    assert g.device == torch.device("cuda", 0) and g.data_ptr() == x.data_ptr()
    assert tus.memory_attributes(g)["last_prefetch_location"] == "cuda:0"
    view = tus.to(x[10:20], "cpu")
    assert view.data_ptr() == x[10:].data_ptr() and view.tolist() == [3] * 10
    # A view keeps its memory alive after every other tensor on it is gone.
    owned = tus.manage_memory(torch.arange(MiB, device="cuda"))
    held = tus.memory_stats()["managed_bytes.all.current"]
    tail = tus.to(owned[MiB - 4 :], "cpu")
    del owned
    import gc

    gc.collect()
    assert tus.memory_stats()["managed_bytes.all.current"] == held
    assert tail.tolist() == [MiB - 4, MiB - 3, MiB - 2, MiB - 1]
    del tail
    gc.collect()
    assert tus.memory_stats()["managed_bytes.all.current"] < held
    # Copies where a copy was asked for.
    assert tus.to(x, "cpu", copy=True).data_ptr() != x.data_ptr()
    assert tus.to(x, "cpu", dtype=torch.int64).dtype == torch.int64


@scenario
def manage_unmanage_round_trip_on_gpu() -> None:
    import torch

    import torch_uvm_saver as tus

    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        original = (torch.randn(1000, 333, device="cuda") * 50).to(dtype)
        managed = tus.manage_memory(original)
        assert tus.is_managed(managed) and managed.device == original.device
        assert same_bits(managed, original)
        back = tus.unmanage_memory(managed)
        assert not tus.is_managed(back) and same_bits(back, original)
    host = torch.randn(4096)
    managed_host = tus.manage_memory(host)
    assert managed_host.device.type == "cpu" and tus.is_managed(managed_host)
    on_gpu = tus.to(managed_host, "cuda")
    assert on_gpu.data_ptr() == managed_host.data_ptr()
    assert torch.equal((on_gpu * 2).cpu(), host * 2)


def read_ms(x) -> float:
    """Milliseconds a GPU kernel takes to read every byte of `x` (CUDA events)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    x.view(torch.float32).sum()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


@scenario
def prefetch_changes_residency_on_gpu() -> None:
    # Where pages are shows in how fast a kernel reads them: from HBM, from the host by faults, or
    # over the link in place. (cudaMemGetInfo does not show it: the driver's unified-memory pool
    # keeps device memory it migrated away from, as measured on an H200.)
    import torch

    import torch_uvm_saver as tus

    size = 512 * MiB
    with tus.region("p", mode="managed"):
        x = torch.ones(size, dtype=torch.uint8, device="cuda")
    read_ms(x)
    resident = read_ms(x)
    assert tus.prefetch(x, "cpu") == size
    torch.cuda.synchronize()
    assert tus.memory_attributes(x)["last_prefetch_location"] == "cpu"
    assert tus.prefetch(x, "cpu") == 0  # tracked: already there
    faulted = read_ms(x)  # the GPU faults the pages back
    print(f"read 512 MiB: resident {resident:.2f} ms, after prefetch to host {faulted:.2f} ms")
    assert faulted > 10 * resident
    assert tus.prefetch(x, "cpu") == 0  # tracking misses faults (Note [Tracked residency])
    tus.advise(x, preferred_location="cuda")
    assert tus.prefetch(x, "cuda") == size
    torch.cuda.synchronize()
    again = read_ms(x)
    print(f"after prefetch back to the GPU {again:.2f} ms")
    assert again < 3 * resident + 0.1
    assert int(x[-1]) == 1 and tus.memory_attributes(x)["last_prefetch_location"] == "cuda:0"
    stats = tus.memory_stats()
    print({k: v for k, v in stats.items() if k.startswith("prefetch_") and k.endswith(".all")})
    assert stats["prefetch_to_host_bytes.all"] == size
    assert stats["prefetch_to_host_seconds.all"] > 0
    assert stats["prefetch_to_device_seconds.all"] > 0


@scenario
def prefetch_to_a_second_gpu_moves_the_pages() -> None:
    # Issue 15, item 9: tracking recorded "on a GPU", not which, so after a prefetch to the first
    # GPU one to the second was skipped (returned 0) and the pages stayed where they were.
    import torch

    import torch_uvm_saver as tus

    if torch.cuda.device_count() < 2:
        print("SKIP: needs two GPUs")
        return
    size = 256 * MiB
    with tus.region("two", mode="managed"):
        x = torch.ones(size, dtype=torch.uint8, device="cuda:0")
    assert tus.prefetch(x, "cuda:0") == 0  # populated there at allocation
    assert tus.prefetch(x, "cuda:1") == size
    torch.cuda.synchronize(0)
    attributes = tus.memory_attributes(x)
    print(attributes)
    assert attributes["last_prefetch_location"] == "cuda:1"
    stats = tus.memory_stats(0)
    assert stats["managed_peer_bytes.tag:two.current"] == size
    assert stats["managed_device_bytes.tag:two.current"] == 0
    assert stats["reserved_bytes.tag:two.current"] == 0
    assert tus.prefetch(x, "cuda:1") == 0  # there now
    with torch.cuda.device(1):
        on_second = tus.to(x, "cuda:1")  # the same bytes, read by the second GPU
        assert int(on_second.sum()) == size
        on_second.add_(1)
        torch.cuda.synchronize(1)
    del on_second
    assert tus.prefetch(x, "cuda:0") == size  # and back
    torch.cuda.synchronize(0)
    assert tus.memory_attributes(x)["last_prefetch_location"] == "cuda:0"
    assert int(x.sum()) == 2 * size
    assert tus.memory_stats(0)["managed_device_bytes.tag:two.current"] == size


@scenario
def uvm_mode_moves_instead_of_copying() -> None:
    import torch

    import torch_uvm_saver as tus

    with tus.region("u", mode="managed"):
        x = torch.randn(MiB, device="cuda")
    plain = torch.randn(10, device="cuda")
    with tus.uvm_mode():
        c = x.cpu()
        assert c.data_ptr() == x.data_ptr()
        assert x.to("cpu").data_ptr() == x.data_ptr()
        assert x.to("cpu", copy=True).data_ptr() != x.data_ptr()
        assert x.to(torch.float64).data_ptr() != x.data_ptr()
        g = c.cuda()
        assert g.data_ptr() == x.data_ptr() and g.is_cuda
        assert c.to("cuda:0", non_blocking=True).data_ptr() == x.data_ptr()
        p = plain.cpu()
        assert p.data_ptr() != plain.data_ptr() and torch.equal(p, plain.cpu())
    assert x.cpu().data_ptr() != x.data_ptr()  # outside uvm_mode, .cpu() copies again


@scenario
def guard_refuses_a_managed_allocation_past_a_lowered_limit() -> None:
    import torch

    import torch_uvm_saver as tus
    from torch_uvm_saver import _C

    tus.set_managed_limit(_C.managed_process_total() + 64 * MiB)
    before = free_bytes()

    def allocate():
        with tus.region("g", mode="managed"):
            return torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")

    expect_error(torch.OutOfMemoryError, allocate)
    print("native reason:", _C.last_malloc_error())
    assert "refused" in _C.last_malloc_error()
    assert tus.memory_stats()["num_managed_refusals.tag:g"] >= 1
    assert abs(free_bytes() - before) <= 4 * MiB
    tus.set_managed_limit(None)
    assert allocate().numel() == 128 * MiB


@scenario
def budget_keeps_resident_bytes_under_it() -> None:
    import torch

    import torch_uvm_saver as tus

    budget = 256 * MiB
    tus.set_device_budget(budget)
    tensors = []
    with tus.region("b", mode="managed"):
        for value in range(6):  # 768 MiB of managed memory under a 256 MiB budget
            tensors.append(torch.full((128 * MiB,), value, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    stats = tus.memory_stats()
    print(
        f"placed {stats['managed_device_bytes.all.current'] / MiB:.0f} MiB (tracked), "
        f"evictions {stats['num_budget_evictions.all']}"
    )
    assert stats["managed_device_bytes.all.current"] <= budget
    assert stats["num_budget_evictions.all"] >= 4
    evicted, resident = tensors[0], tensors[-1]
    attributes = tus.memory_attributes(evicted)
    assert attributes["preferred_location"] == "cpu" and attributes["accessed_by"] == ["cuda:0"]
    assert attributes["last_prefetch_location"] == "cpu"
    assert tus.memory_attributes(resident)["last_prefetch_location"] == "cuda:0"
    # An evicted tensor stays on the host when the GPU reads it: every read goes over the link,
    # the second as slow as the first, while the resident one reads from HBM.
    first, second, third = read_ms(evicted), read_ms(evicted), read_ms(evicted)
    read_ms(resident)
    local = read_ms(resident)
    print(
        f"read 128 MiB evicted {first:.2f}, {second:.2f}, {third:.2f} ms; resident {local:.3f} ms"
    )
    assert min(second, third) > 5 * local  # still read over the link, not migrated back
    sums = [int(t.sum()) for t in tensors]  # every value is intact wherever it lives
    assert sums == [value * 128 * MiB for value in range(6)]
    # Using an evicted tensor again brings it back and evicts the least recently used other.
    tus.prefetch(evicted, "cuda")
    torch.cuda.synchronize()
    assert tus.memory_attributes(evicted)["preferred_location"] == "cuda:0"
    assert tus.memory_stats()["managed_device_bytes.all.current"] <= budget
    read_ms(evicted)
    assert read_ms(evicted) < 3 * local + 0.1


LOSS_SCRIPT = r"""
import json, os, sys
import torch
import torch_uvm_saver as tus
if sys.argv[1] == "uvm":
    tus.set_enabled_uvm(True)
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
model = torch.nn.Sequential(
    torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512), torch.nn.GELU(),
    torch.nn.Linear(512, 10)).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.randn(64, 256, device="cuda")
target = torch.randint(0, 10, (64,), device="cuda")
losses = []
for step in range(30):
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
extra = {}
if sys.argv[1] == "uvm":
    stats = tus.memory_stats()
    extra = {"enabled": tus.get_enabled_uvm(), "params_managed": all(
        tus.is_managed(p) for p in model.parameters()), "grads_managed": all(
        tus.is_managed(p.grad) for p in model.parameters()),
        "block_bytes": stats["block_bytes.managed.current"],
        "misses": stats["num_block_cache_misses.all"]}
print("RESULT " + json.dumps({"losses": losses, **extra}))
"""


def _losses(variant: str) -> dict:
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    done = subprocess.run(
        [sys.executable, "-c", LOSS_SCRIPT, variant], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@scenario
def set_enabled_uvm_trains_to_the_same_losses() -> None:
    native = _losses("native")
    uvm = _losses("uvm")
    print("native", native["losses"][:3], "...", native["losses"][-1])
    details = {key: value for key, value in uvm.items() if key != "losses"}
    print("uvm   ", uvm["losses"][:3], "...", uvm["losses"][-1], details)
    assert uvm["enabled"] and uvm["params_managed"] and uvm["grads_managed"]
    assert uvm["block_bytes"] > 0
    assert native["losses"][-1] < native["losses"][0]  # it trains
    assert uvm["losses"] == native["losses"]  # same kernels, same data: the same bits


@scenario
def set_enabled_uvm_after_cuda_is_initialized_is_refused() -> None:
    import torch

    import torch_uvm_saver as tus
    from torch_uvm_saver.errors import InvalidStateError

    torch.zeros(1, device="cuda")
    expect_error(InvalidStateError, lambda: tus.set_enabled_uvm(True), "before CUDA is initialized")
    assert not tus.get_enabled_uvm() and tus.hook_mode() == "torch"
    assert not tus.is_managed(torch.zeros(4, device="cuda"))


@scenario
def environment_switch_turns_unified_memory_on() -> None:
    script = (
        "import torch_uvm_saver as tus, torch\n"
        "x = torch.empty(1000, device='cuda')\n"
        "print('RESULT', tus.get_enabled_uvm(), tus.is_managed(x), tus.hook_mode())\n"
    )
    env = dict(os.environ, PYTORCH_ENABLE_UNIFIED_MEMORY="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "RESULT True True global" in done.stdout, done.stdout


@scenario
def global_cache_waits_for_recorded_streams() -> None:
    import torch

    import torch_uvm_saver as tus

    tus.use_global_allocator("device")
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    pointer = x.data_ptr()
    a = torch.randn(8192, 8192, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(20):  # about a second of float32 matmuls keeps the side stream busy
            a = a @ a / 8192
        x.add_(1)
    x.record_stream(side)
    del x
    # The free went the record_stream way: the block waits for an event on the side stream.
    assert tus.memory_stats()["block_cache_pending_bytes.current"] == 64 * MiB
    busy = not side.query()
    y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    print(f"side stream busy: {busy}; new block {y.data_ptr():#x}, freed block {pointer:#x}")
    # On the lent H200 the host was held until queued work ran, with PyTorch's own allocator too,
    # so the side stream may already be done here; the simulated suite holds events instead.
    if busy:
        assert y.data_ptr() != pointer  # not handed out while the side stream may still use it
    torch.cuda.synchronize()
    z = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    assert pointer in (y.data_ptr(), z.data_ptr())  # once the side stream is done, it is reused
    assert tus.memory_stats()["block_cache_pending_bytes.current"] == 0
    stats = tus.memory_stats()
    assert stats["block_bytes.all.current"] >= 128 * MiB
    del y, z
    released = tus.empty_cache()
    print(f"empty_cache released {released / MiB:.0f} MiB")
    assert released >= 128 * MiB  # the freed blocks' segments went back


if __name__ == "__main__":
    name = sys.argv[1]
    SCENARIOS[name]()
    print(f"SCENARIO {name} OK", flush=True)
