"""tus.snapshot / restore / drop_snapshot / list_snapshots on the simulated driver, with CPU
tensors over simulated device memory (Note [Snapshots on the simulated driver] in
torch_uvm_saver/snapshots.py): modules, dicts, lists and tags resolved to named spans, the RL
switch between two snapshots, what a snapshot remembers and refuses at restore (freed, moved,
reshaped, replaced tensors), paused tags, and the stats. The native store has its own suite
(test_snapshot_store.py); tests/gpu/snapshot_scenarios.py runs the same on a GPU.
"""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch

import torch_uvm_saver as tus
from torch_uvm_saver.errors import InvalidArgumentError, InvalidStateError, OutOfMemoryError

MiB = 1 << 20


@pytest.fixture
def process(process):
    """The sim process of conftest.py, with every snapshot dropped after the test."""
    yield process
    for name in tus.list_snapshots():
        tus.drop_snapshot(name)


def device_tensor(ptr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over simulated device memory at `ptr` (a CPU tensor, as the sim has it)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)


def place_module(module: torch.nn.Module, allocator, tag: str, cpu_backup: bool = False) -> int:
    """Moves the module's parameters and buffers into one segment of `tag`, back to back, as
    PyTorch places a model's weights; returns the segment's address."""
    tensors = [*module.parameters(), *module.buffers()]
    total = sum(t.nbytes for t in tensors)
    base = allocator.malloc(total, tag=tag, cpu_backup=cpu_backup)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            placed = device_tensor(base + offset, tuple(t.shape), t.dtype)
            placed.copy_(t)
            t.data = placed
            offset += t.nbytes
    return base


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 32)
    ).to(torch.bfloat16)
    model.register_buffer("steps", torch.zeros(4, dtype=torch.int64))
    return model


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def same(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(t, expected[name]) for name, t in model.state_dict().items())


def perturb(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.add_(1)


def test_module_snapshot_restores_the_same_tensors(process) -> None:
    _, allocator = process
    model = small_model()
    place_module(model, allocator, "weights")
    original = weights(model)
    pointers = {name: t.data_ptr() for name, t in model.state_dict().items()}
    nbytes = sum(t.nbytes for t in original.values())
    assert tus.snapshot("actor", model) == nbytes
    perturb(model)
    assert not same(model, original)
    assert tus.restore("actor") == nbytes
    assert same(model, original)
    assert {name: t.data_ptr() for name, t in model.state_dict().items()} == pointers
    listed = tus.list_snapshots()
    assert listed == {
        "actor": {
            "device": 0,
            "bytes": nbytes,
            "held_bytes": 2 * MiB,  # one slab, rounded by the host pool
            "tensors": len(original),
            "on_device": False,
            "tag": None,
        }
    }
    assert tus.list_snapshots(device=0) == listed
    stats = tus.memory_stats()
    assert (stats["snapshot_count"], stats["snapshot_bytes"]) == (1, 2 * MiB)
    assert "snapshots: 1, holding 2.00 MiB of host and 0 B of device memory" in tus.memory_summary()


def test_the_rl_switch_between_ref_and_actor(process) -> None:
    _, allocator = process
    model = small_model()
    place_module(model, allocator, "weights")
    tus.snapshot("ref", model)
    ref = weights(model)
    for _step in range(3):
        perturb(model)  # a training step
        actor = weights(model)
        tus.snapshot("actor", model)  # replaced every step
        tus.restore("ref")
        assert same(model, ref)
        tus.restore("actor")
        assert same(model, actor)
    assert sorted(tus.list_snapshots()) == ["actor", "ref"]
    assert tus.memory_stats()["num_snapshots"] == 4


@pytest.mark.parametrize("kind", ["dict", "list", "tuple", "tensor"])
def test_dicts_lists_and_single_tensors(process, kind) -> None:
    _, allocator = process
    base = allocator.malloc(4 * MiB, tag="t")
    a = device_tensor(base, (256, 256), torch.float32)
    b = device_tensor(base + MiB, (1024,), torch.int32)
    a.normal_(), b.random_()
    expected = [a.clone(), b.clone()]
    source = {"dict": {"a": a, "b": b}, "list": [a, b], "tuple": (a, b), "tensor": a}[kind]
    tus.snapshot("s", source)
    a.zero_(), b.zero_()
    tus.restore("s")
    assert torch.equal(a, expected[0])
    if kind == "tensor":
        assert torch.all(b == 0)  # not in the snapshot
    else:
        assert torch.equal(b, expected[1])
    assert tus.list_snapshots()["s"]["tensors"] == (1 if kind == "tensor" else 2)


def test_a_state_dict_restores_through_the_storage(process) -> None:
    # state_dict() hands out detached tensors that die with the dict: their storages live on in
    # the module (Note [What a snapshot remembers]).
    _, allocator = process
    model = small_model()
    place_module(model, allocator, "weights")
    original = weights(model)
    tus.snapshot("sd", model.state_dict())
    gc.collect()
    perturb(model)
    tus.restore("sd")
    assert same(model, original)


def test_a_freed_tensor_is_refused_and_nothing_is_written(process) -> None:
    _, allocator = process
    base = allocator.malloc(4 * MiB, tag="t")
    kept = device_tensor(base, (1024,), torch.float32)
    dropped = device_tensor(base + MiB, (1024,), torch.float32)
    tus.snapshot("s", [kept, dropped])
    kept.fill_(7)
    del dropped
    gc.collect()
    with pytest.raises(InvalidStateError, match="'1' was freed; nothing was written"):
        tus.restore("s")
    assert torch.all(kept == 7)


def test_a_reshaped_or_retyped_tensor_is_refused(process) -> None:
    _, allocator = process
    base = allocator.malloc(2 * MiB, tag="t")
    t = device_tensor(base, (64, 64), torch.float32)
    t.fill_(1)
    tus.snapshot("s", {"t": t})
    t.fill_(2)
    t.data = t.data.view(torch.int32)  # same bytes, another dtype
    with pytest.raises(InvalidArgumentError, match="same shape and dtype"):
        tus.restore("s")
    t.data = t.data.view(torch.float32).view(4096)
    with pytest.raises(InvalidArgumentError, match=r"torch.float32 \(64, 64\)"):
        tus.restore("s")
    t.data = t.data.view(64, 64)
    assert torch.all(t == 2)  # nothing was written by the refused restores
    tus.restore("s")
    assert torch.all(t == 1)


def test_a_moved_tensor_is_refused(process) -> None:
    _, allocator = process
    base = allocator.malloc(4 * MiB, tag="t")
    t = device_tensor(base, (1024,), torch.float32)
    tus.snapshot("s", [t])
    t.data = device_tensor(base + MiB, (1024,), torch.float32)  # same layout, other memory
    with pytest.raises(InvalidStateError, match="same memory only"):
        tus.restore("s")


def test_a_module_is_looked_up_again_at_restore(process) -> None:
    _, allocator = process
    model = small_model()
    place_module(model, allocator, "weights")
    tus.snapshot("m", model)
    stale = model[0].weight
    spare = allocator.malloc(2 * MiB, tag="spare")
    model[0].weight = torch.nn.Parameter(device_tensor(spare, tuple(stale.shape), stale.dtype))
    with pytest.raises(InvalidStateError, match=r"'0.weight' was at .* and is now at"):
        tus.restore("m")
    model[0].weight = stale
    del model[2]
    with pytest.raises(InvalidStateError, match=r"has no '2\.weight' any more"):
        tus.restore("m")
    del model, stale
    gc.collect()
    with pytest.raises(InvalidStateError, match="the module was freed"):
        tus.restore("m")


def test_a_strided_view_with_gaps_is_refused_but_a_transpose_is_not(process) -> None:
    _, allocator = process
    base = allocator.malloc(2 * MiB, tag="t")
    t = device_tensor(base, (64, 64), torch.float32)
    with pytest.raises(InvalidArgumentError, match="gaps between its elements"):
        tus.snapshot("s", [t[:, ::2]])
    t.normal_()
    expected = t.clone()
    tus.snapshot("s", [t.t()])  # dense, another stride order
    t.zero_()
    gc.collect()  # the transposed view dies; its storage is t's
    tus.restore("s")
    assert torch.equal(t, expected)


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        (3, "takes a module, a dict"),
        ([torch.zeros(2), "x"], "'1' is a str, not a tensor"),
        ({"w": None}, "'w' is a NoneType"),
        ([], "nothing to snapshot"),
        ([torch.zeros(2, device="meta")], "is on meta"),
        ([torch.zeros(4, 4).to_sparse()], "only dense ones"),
    ],
    ids=["int", "not-a-tensor", "none", "empty", "meta", "sparse"],
)
def test_bad_sources(process, source, fragment) -> None:
    with pytest.raises(InvalidArgumentError, match=fragment):
        tus.snapshot("bad", source)
    assert tus.list_snapshots() == {}


def test_names_and_unknown_snapshots(process) -> None:
    _, allocator = process
    base = allocator.malloc(2 * MiB, tag="t")
    tus.snapshot("known", [device_tensor(base, (16,), torch.float32)])
    for bad in ("", 3, None):
        with pytest.raises(InvalidArgumentError, match="non-empty string"):
            tus.snapshot(bad, [])  # type: ignore[arg-type]
    for call in (tus.restore, tus.drop_snapshot):
        with pytest.raises(InvalidArgumentError, match=r"no snapshot of that name .*'known'"):
            call("missing")
    assert tus.drop_snapshot("known") == 2 * MiB
    with pytest.raises(InvalidArgumentError, match="snapshots: none"):
        tus.restore("known")


def test_a_tag_snapshot_and_a_paused_tag(process) -> None:
    driver, allocator = process
    model = small_model()
    place_module(model, allocator, "weights", cpu_backup=True)
    original = weights(model)
    tus.pause("weights")
    driver.reset_call_counts()
    assert tus.snapshot("tagged", "weights") == 2 * MiB  # the whole segment, from its backup
    assert driver.call_counts().get("copy_device_to_host", 0) == 0
    assert tus.memory_stats()["snapshot_from_backup_bytes"] == 2 * MiB
    assert tus.list_snapshots()["tagged"]["tag"] == "weights"
    tus.resume("weights")
    perturb(model)
    tus.pause("weights")
    tus.restore("tagged")  # into the backup; the resume brings it in
    tus.resume("weights")
    assert same(model, original)
    with pytest.raises(InvalidArgumentError, match="unknown tag"):
        tus.snapshot("x", "no-such-tag")


def test_a_module_snapshot_of_a_paused_tag_and_one_without_backup(process) -> None:
    _, allocator = process
    model = small_model()
    place_module(model, allocator, "weights", cpu_backup=True)
    original = weights(model)
    tus.pause("weights")
    tus.snapshot("paused", model)
    tus.resume("weights")
    scratch = small_model()
    place_module(scratch, allocator, "scratch")
    tus.pause("scratch")
    with pytest.raises(InvalidStateError, match="paused without a CPU backup"):
        tus.snapshot("paused", [*model.parameters(), *scratch.parameters()])
    tus.resume("scratch")
    perturb(model)
    tus.restore("paused")  # the older snapshot of that name is intact
    assert same(model, original)


def test_on_device_and_no_room(process) -> None:
    driver, allocator = process
    model = small_model()
    place_module(model, allocator, "weights")
    original = weights(model)
    used = driver.used_bytes()
    tus.snapshot("gpu", model, on_device=True)
    nbytes = tus.list_snapshots()["gpu"]["bytes"]
    assert driver.used_bytes() >= used + nbytes  # device memory (the sim rounds to pages)
    assert driver.pinned_host_bytes() == 0
    assert tus.memory_stats()["snapshot_device_bytes"] == nbytes
    perturb(model)
    tus.restore("gpu")
    assert same(model, original)
    big = device_tensor(allocator.malloc(4 * MiB, tag="big"), (MiB,), torch.float32)
    free = driver.capacity - driver.used_bytes()
    hog = allocator.malloc(free // (2 * MiB) * (2 * MiB), tag="hog")  # leaves under 2 MiB
    with pytest.raises(OutOfMemoryError, match="on_device=False"):
        tus.snapshot("more", [big], on_device=True)
    allocator.free(hog)
    assert "more" not in tus.list_snapshots()
    held = driver.used_bytes()
    tus.drop_snapshot("gpu")
    assert held - driver.used_bytes() >= nbytes


def test_nothing_is_held_after_drop_and_release_host_cache(process) -> None:
    driver, allocator = process
    model = small_model()
    place_module(model, allocator, "weights")
    tus.snapshot("a", model)
    tus.snapshot("b", model)
    assert driver.pinned_host_bytes() > 0
    assert tus.drop_snapshot("a") == tus.drop_snapshot("b") == 2 * MiB
    tus.release_host_cache()
    assert driver.pinned_host_bytes() == 0
    stats = tus.memory_stats()
    assert (stats["snapshot_count"], stats["snapshot_bytes"]) == (0, 0)


def test_cpu_tensors_are_refused_on_a_real_driver(monkeypatch) -> None:
    class RealDriver:
        name = "cuda"

    monkeypatch.setattr(tus.snapshots._C, "get_driver", lambda: RealDriver())
    with pytest.raises(InvalidArgumentError, match="is on cpu; snapshots hold CUDA tensors"):
        tus.snapshot("cpu", [torch.zeros(4)])
