"""GPU scenarios, one per fresh process: `python scenarios.py NAME`.

Each asserts what a user can observe (device memory by cudaMemGetInfo, bytes, data_ptr, the
exception raised) and prints "SCENARIO NAME OK" at the end. test_scenarios.py runs them all.
"""

from __future__ import annotations

import sys
from typing import Callable

GiB = 1 << 30
MiB = 1 << 20


def scenario_registry() -> tuple[dict[str, Callable[[], None]], Callable]:
    """A scenario file's SCENARIOS dict and the decorator that registers a function in it."""
    registered: dict[str, Callable[[], None]] = {}

    def register(function: Callable[[], None]) -> Callable[[], None]:
        registered[function.__name__] = function
        return function

    return registered, register


SCENARIOS, scenario = scenario_registry()


def free_bytes() -> int:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def random_tensor(shape, dtype):
    import torch

    if dtype.is_floating_point:
        return torch.randn(shape, device="cuda").to(dtype)
    return torch.randint(-(2**31), 2**31 - 1, shape, device="cuda", dtype=torch.int64).to(dtype)


def expect_error(error_type: type, call: Callable[[], object], fragment: str = "") -> None:
    """Asserts `call()` raises `error_type` whose message contains `fragment`."""
    try:
        call()
    except error_type as error:
        print(f"raised as expected: {error}")
        assert fragment in str(error), error
    else:
        raise AssertionError(f"{call} should have raised {error_type.__name__}")


def same_bits(a, b) -> bool:
    import torch

    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@scenario
def pause_frees_and_resume_restores_1gib() -> None:
    import torch

    import torch_uvm_saver as tus

    with tus.region("weights"):
        tensor = torch.ones(GiB, dtype=torch.uint8, device="cuda")
    pointer = tensor.data_ptr()
    before = free_bytes()
    released = tus.pause("weights")
    paused = free_bytes()
    print(f"released {released / GiB:.3f} GiB; free grew by {(paused - before) / GiB:.4f} GiB")
    assert paused - before >= 0.99 * GiB
    assert released >= GiB
    stats = tus.memory_stats()
    assert stats["paused_bytes.tag:weights.current"] >= GiB
    tus.resume("weights")
    resumed = free_bytes()
    print(f"after resume free is {(before - resumed) / MiB:.1f} MiB below the start")
    assert abs(resumed - before) <= 4 * MiB
    assert tensor.data_ptr() == pointer
    tensor.fill_(7)  # the memory is usable again
    assert int(tensor[-1]) == 7


@scenario
def backup_is_bit_identical_over_5_cycles() -> None:
    import torch

    import torch_uvm_saver as tus

    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.uint8]
    with tus.region("kv", enable_cpu_backup=True):
        tensors = [
            torch.empty(3 * MiB + 123 * i, dtype=d, device="cuda") for i, d in enumerate(dtypes)
        ]
    pointers = [t.data_ptr() for t in tensors]
    for cycle in range(5):
        for t in tensors:
            t.copy_(random_tensor(t.shape, t.dtype))
        expected = [t.cpu() for t in tensors]
        tus.pause("kv")
        backups = [tus.get_cpu_backup(t) for t in tensors]
        assert all(b is not None and same_bits(b, e) for b, e in zip(backups, expected))
        tus.resume("kv")
        assert [t.data_ptr() for t in tensors] == pointers
        assert all(same_bits(t.cpu(), e) for t, e in zip(tensors, expected)), f"cycle {cycle}"
        assert tus.get_cpu_backup(tensors[0]) is None  # not retained by default


@scenario
def retained_backup_survives_resume() -> None:
    import torch

    import torch_uvm_saver as tus

    tus.set_backup_policy("w", retain=True)
    with tus.region("w", enable_cpu_backup=True):
        tensor = torch.randn(MiB, device="cuda")
    expected = tensor.cpu()
    tus.pause("w")
    tus.resume("w")
    backup = tus.get_cpu_backup(tensor)
    assert backup is not None and torch.equal(backup, expected)
    tus.set_backup_policy("w", retain=False, pinned=False)
    tensor.add_(1)
    tus.pause("w")
    tus.resume("w")
    assert torch.equal(tensor.cpu(), expected + 1)


@scenario
def model_forward_is_identical_after_resume() -> None:
    import torch

    import torch_uvm_saver as tus

    torch.manual_seed(0)
    with tus.region("model", enable_cpu_backup=True):
        model = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True).cuda().eval()
    inputs = torch.randn(4, 128, 512, device="cuda")
    with torch.no_grad():
        reference = model(inputs)
        tus.pause("model")
        tus.resume("model")
        again = model(inputs)
    assert torch.equal(reference, again)


@scenario
def tags_isolate() -> None:
    import torch

    import torch_uvm_saver as tus

    with tus.region("a"):
        a = torch.zeros(256 * MiB, dtype=torch.uint8, device="cuda")
    with tus.region("b", enable_cpu_backup=True):
        b = torch.full((64 * MiB,), 3, dtype=torch.uint8, device="cuda")
    before = free_bytes()
    tus.pause("a")
    assert free_bytes() - before >= 255 * MiB
    assert tus.is_paused("a") and not tus.is_paused("b")
    assert int(b.sum(dtype=torch.int64)) == 3 * 64 * MiB  # b stays resident and usable
    tus.resume("a")
    a.fill_(1)
    assert int(a.sum(dtype=torch.int64)) == 256 * MiB


@scenario
def disable_allocates_outside_the_region() -> None:
    import torch

    import torch_uvm_saver as tus

    with tus.region("x"):
        inside = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        with tus.disable():
            outside = torch.full((64 * MiB,), 5, dtype=torch.uint8, device="cuda")
        inside_again = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
    assert tus.memory_stats()["allocated_bytes.tag:x.current"] == 96 * MiB
    tus.pause("x")
    assert int(outside.sum(dtype=torch.int64)) == 5 * 64 * MiB  # untouched by the pause
    tus.resume("x")
    inside.fill_(1)
    inside_again.fill_(1)


@scenario
def nested_regions_route_to_the_innermost() -> None:
    import torch

    import torch_uvm_saver as tus

    with tus.region("outer"):
        a = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        with tus.region("inner", enable_cpu_backup=True):
            b = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
        c = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")
    stats = tus.memory_stats()
    # Sizes of 10 MiB and more get segments of their own size (PyTorch's large-block rule).
    assert stats["allocated_bytes.tag:outer.current"] == 28 * MiB, stats
    assert stats["allocated_bytes.tag:inner.current"] == 32 * MiB, stats
    del a, b, c


@scenario
def work_queued_on_a_side_stream_is_not_lost() -> None:
    import torch

    import torch_uvm_saver as tus

    with tus.region("s", enable_cpu_backup=True):
        x = torch.zeros(128 * MiB, dtype=torch.float32, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the write
        x.add_(1)
    tus.pause("s")  # no synchronize by the caller: pause must order after the queued work
    tus.resume("s")
    assert float(x.min()) == 1.0 and float(x.max()) == 1.0


@scenario
def resume_out_of_memory_raises_and_a_later_resume_works() -> None:
    import torch

    import torch_uvm_saver as tus

    size = 2 * GiB
    with tus.region("big", enable_cpu_backup=True):
        big = random_tensor((size // 8,), torch.int64)
    expected = big.cpu()
    tus.pause("big")
    filler = torch.empty(free_bytes() - size // 2, dtype=torch.uint8, device="cuda")
    free_with_filler = free_bytes()
    try:
        tus.resume("big")
    except tus.OutOfMemoryError as error:
        assert isinstance(error, torch.OutOfMemoryError)
        print(f"resume raised as expected: {error}")
        assert "nothing was resumed" in str(error)
    else:
        raise AssertionError("resume should have run out of memory")
    assert tus.is_paused("big")
    assert abs(free_bytes() - free_with_filler) <= 4 * MiB  # the failed resume kept nothing
    del filler
    torch.cuda.empty_cache()
    tus.resume("big")
    assert torch.equal(big.cpu(), expected)


@scenario
def pausing_while_the_region_is_open_is_refused() -> None:
    import torch

    import torch_uvm_saver as tus

    def enter_open_region() -> None:
        with tus.region("open"):
            pass

    with tus.region("open"):
        t = torch.empty(MiB, device="cuda")
        expect_error(tus.InvalidStateError, lambda: tus.pause("open"), "region of this tag is open")
    tus.pause("open")
    expect_error(tus.InvalidStateError, enter_open_region, "the tag is paused")
    tus.resume("open")
    expect_error(tus.InvalidArgumentError, lambda: tus.pause("no-such-tag"), "unknown tag")
    del t


@scenario
def bad_arguments_are_refused_and_change_nothing() -> None:
    # On a GPU these calls get past the checks that need CUDA, so the device and flag checks of
    # region(), empty_cache() and advise() run here (tests/sim/test_bad_inputs.py has the rest).
    import torch

    import torch_uvm_saver as tus

    def enter(**arguments) -> None:
        with tus.region("w", **arguments):
            pass

    count = torch.cuda.device_count()
    expect_error(tus.InvalidArgumentError, lambda: enter(device="bogus"), "'bogus' is not a device")
    expect_error(tus.InvalidArgumentError, lambda: enter(device=count), "does not exist")
    expect_error(TypeError, lambda: enter(enable_cpu_backup="yes"), "region(enable_cpu_backup)")
    with tus.region("w", enable_cpu_backup=True):  # nothing above left a region of it open
        kept = torch.ones(MiB, dtype=torch.uint8, device="cuda")
    assert tus.pause("w") >= MiB
    tus.resume("w")
    expect_error(tus.InvalidArgumentError, lambda: tus.empty_cache(device=count), "does not exist")
    expect_error(tus.InvalidArgumentError, lambda: tus.empty_cache(device=-1), "does not exist")
    assert tus.empty_cache() == 0
    managed = tus.manage_memory(torch.zeros(MiB, device="cuda"))
    before = tus.memory_attributes(managed)
    expect_error(
        TypeError,
        lambda: tus.advise(managed, preferred_location="cpu", read_mostly="no"),
        "advise(read_mostly)",
    )
    assert tus.memory_attributes(managed) == before  # the preferred location was not set either
    expect_error(TypeError, lambda: tus.set_device_budget(1.5), "set_device_budget(budget)")
    assert tus.get_device_budget() is None
    expect_error(TypeError, lambda: tus.pin(None), "pin(t)")
    expect_error(tus.InvalidArgumentError, lambda: tus.to(managed, "bogus"), "is not a device")
    assert int(kept.sum()) == MiB


@scenario
def device_mode_is_the_baseline_and_cannot_pause() -> None:
    import torch

    import torch_uvm_saver as tus

    with tus.region("plain", mode="device"):
        t = torch.ones(32 * MiB, device="cuda")
    assert tus.memory_stats()["allocated_bytes.device.current"] >= 128 * MiB
    expect_error(tus.InvalidArgumentError, lambda: tus.pause("plain"), "'device'")
    assert float(t.sum()) == 32 * MiB


@scenario
def tensor_freed_while_paused_is_released_once() -> None:
    import gc

    import torch

    import torch_uvm_saver as tus

    with tus.region("f", enable_cpu_backup=True):
        keep = torch.full((64 * MiB,), 2, dtype=torch.uint8, device="cuda")
        drop = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    tus.pause("f")
    del drop  # back to PyTorch's pool cache, still paused
    tus.resume("f")
    with tus.region("f", enable_cpu_backup=True):
        reused = torch.ones(256 * MiB, dtype=torch.uint8, device="cuda")  # from the pool cache
    assert int(reused.sum(dtype=torch.int64)) == 256 * MiB
    assert int(keep.sum(dtype=torch.int64)) == 2 * 64 * MiB
    tus.pause("f")
    del keep, reused
    # Dropping the pools makes PyTorch free their segments, which are paused right now.
    tus.regions._pools.clear()
    gc.collect()
    torch.cuda.empty_cache()
    stats = tus.memory_stats()
    print({k: v for k, v in stats.items() if k.endswith("tag:f.current")})
    assert stats["num_free_failures.all"] == 0
    assert stats["allocated_bytes.tag:f.current"] == 0
    assert stats["cpu_backup_bytes.tag:f.current"] == 0
    assert tus.resume("f") == 0  # nothing left to map


@scenario
def backward_lands_in_the_region_without_autograd_threads() -> None:
    import torch

    import torch_uvm_saver as tus

    def grads_inside(multithreading: bool) -> bool:
        tag = f"train-{multithreading}"
        torch.autograd.set_multithreading_enabled(multithreading)
        with tus.region(tag):
            layer = torch.nn.Linear(1024, 1024, device="cuda")
            layer(torch.randn(64, 1024, device="cuda")).sum().backward()
        segments = tus._C.get_allocator(0).segments()
        pointer = layer.weight.grad.data_ptr()
        return any(s["tag"] == tag and s["ptr"] <= pointer < s["ptr"] + s["size"] for s in segments)

    inside_single = grads_inside(False)
    inside_multi = grads_inside(True)
    print(f"gradients in region: multithreading off={inside_single}, on={inside_multi}")
    assert inside_single  # Note [Regions route one thread]: the documented way works


@scenario
def exit_with_paused_regions_and_live_tensors() -> None:
    import torch

    import torch_uvm_saver as tus

    global _keep
    with tus.region("exit", enable_cpu_backup=True):
        _keep = [torch.randn(16 * MiB, device="cuda") for _ in range(4)]
    with tus.region("exit-nobackup"):
        _keep.append(torch.empty(64 * MiB, device="cuda"))
    tus.pause()
    # The interpreter now exits with paused memory still owned by live tensors and pools.


@scenario
def exit_after_freeing_paused_tensors() -> None:
    import torch

    import torch_uvm_saver as tus

    with tus.region("exit", enable_cpu_backup=True):
        tensors = [torch.randn(16 * MiB, device="cuda") for _ in range(4)]
    tus.pause("exit")
    del tensors
    torch.cuda.empty_cache()


@scenario
def two_hundred_cycles_return_to_the_baseline() -> None:
    import torch

    import torch_uvm_saver as tus

    with tus.region("loop", enable_cpu_backup=True):
        tensors = [torch.randn(32 * MiB, device="cuda") for _ in range(4)]
    expected = [t.sum().item() for t in tensors]
    tus.pause("loop")
    tus.resume("loop")  # warm-up: the pinned backup buffers are allocated here
    baseline = free_bytes()
    misses = tus.memory_stats()["host_pool_misses"]
    for _ in range(200):
        tus.pause("loop")
        tus.resume("loop")
    after = free_bytes()
    stats = tus.memory_stats()
    print(f"free after 200 cycles differs from baseline by {(after - baseline) / MiB:.1f} MiB")
    assert abs(after - baseline) <= 2 * MiB
    assert stats["host_pool_misses"] == misses  # no new pinned buffer after the first cycle
    assert stats["num_pauses.tag:loop"] == 201
    assert [t.sum().item() for t in tensors] == expected


@scenario
def out_of_memory_under_the_global_hook_raises_and_the_process_goes_on() -> None:
    # Note [Failing under the global hook]: PyTorch does not check what the hook returns, so a
    # failed allocation must raise rather than hand a null pointer to the kernels.
    import torch

    import torch_uvm_saver as tus

    tus.use_global_allocator("device")
    kept = torch.full((1024,), 3.0, device="cuda")
    too_much = 2 * torch.cuda.mem_get_info()[1]  # twice the card: plain device memory fails
    try:
        torch.ones(too_much, dtype=torch.uint8, device="cuda")
    except RuntimeError as error:
        print(f"raised as expected: {str(error)[:200]}")
        assert "CUDA out of memory" in str(error), str(error)
    else:
        raise AssertionError("an allocation of twice the card should have raised")
    assert float(kept.sum()) == 3072.0
    assert float(torch.arange(10, device="cuda").sum()) == 45.0
    torch.cuda.synchronize()


if __name__ == "__main__":
    name = sys.argv[1]
    SCENARIOS[name]()
    print(f"SCENARIO {name} OK", flush=True)
