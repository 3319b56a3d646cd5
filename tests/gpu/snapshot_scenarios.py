"""GPU scenarios of named weight snapshots (tus.snapshot / restore / drop_snapshot), one per
fresh process: `python snapshot_scenarios.py NAME` prints "SCENARIO NAME OK" at the end.

Each asserts what a user can observe: the weights' bits and data_ptr after restore, a forward
pass and a replayed CUDA graph giving the very same output, device and host memory held (by
cudaMemGetInfo and the stats), the exception raised. Models are small (under 300 MiB).
"""

from __future__ import annotations

import sys

from scenarios import MiB, expect_error, free_bytes, same_bits, scenario_registry

SCENARIOS, scenario = scenario_registry()


def transformer(layers: int = 4):
    """A bf16 transformer encoder (about 100 MiB of weights), in eval mode (no dropout)."""
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        d_model=1024, nhead=16, dim_feedforward=4096, batch_first=True
    )
    model = torch.nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
    return model.to(device="cuda", dtype=torch.bfloat16).eval()


def weights(model) -> dict:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def all_same_bits(model, expected: dict) -> bool:
    return all(same_bits(t, expected[name]) for name, t in model.state_dict().items())


def pointers(model) -> dict:
    return {name: t.data_ptr() for name, t in model.state_dict().items()}


def perturb(model) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))


@scenario
def snapshot_restore_is_bit_exact_for_a_transformer() -> None:
    import torch

    import torch_uvm_saver as tus

    model = transformer()
    x = torch.randn(4, 128, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        reference = model(x)
    original = weights(model)
    addresses = pointers(model)
    nbytes = sum(t.nbytes for t in original.values())
    host_before = tus.memory_stats()["host_pool_bytes.current"]
    assert tus.snapshot("actor", model) == nbytes
    listed = tus.list_snapshots()["actor"]
    print(f"snapshot of {nbytes / MiB:.1f} MiB in {listed['tensors']} tensors: {listed}")
    assert listed["tensors"] == len(original) and not listed["on_device"]
    stats = tus.memory_stats()
    assert stats["snapshot_bytes"] >= nbytes
    assert stats["host_pool_bytes.current"] - host_before >= nbytes  # pinned host memory
    perturb(model)
    with torch.no_grad():
        assert not torch.equal(model(x), reference)
    assert tus.restore("actor") == nbytes
    assert all_same_bits(model, original)
    assert pointers(model) == addresses
    with torch.no_grad():
        assert torch.equal(model(x), reference)
    assert tus.drop_snapshot("actor") >= nbytes
    tus.release_host_cache()
    stats = tus.memory_stats()
    assert (stats["snapshot_count"], stats["snapshot_bytes"]) == (0, 0)


@scenario
def ref_and_actor_alternate_with_an_optimizer() -> None:
    import torch

    import torch_uvm_saver as tus

    model = transformer(layers=2)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2, 64, 1024, device="cuda", dtype=torch.bfloat16)
    tus.snapshot("ref", model)
    ref = weights(model)
    misses = []
    for step in range(4):
        model(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        actor = weights(model)
        assert not all_same_bits(model, ref)
        tus.snapshot("actor", model)  # replaced every step
        tus.restore("ref")  # reference log-probs would be computed here
        assert all_same_bits(model, ref)
        tus.restore("actor")
        assert all_same_bits(model, actor)
        misses.append(tus.memory_stats()["host_pool_misses"])
        print(f"step {step}: host pool misses so far {misses[-1]}")
    # Note [Replacing a snapshot]: nothing new is pinned once the pool holds two sets.
    assert misses[-1] == misses[1], misses
    assert all(p is q for p, q in zip(model.parameters(), optimizer.param_groups[0]["params"]))
    model(x).float().square().mean().backward()
    optimizer.step()  # the optimizer goes on with the same tensors


@scenario
def a_captured_graph_replays_after_restore() -> None:
    import torch

    import torch_uvm_saver as tus

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(
        device="cuda", dtype=torch.bfloat16
    )
    static_input = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        model(static_input)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_output = model(static_input)
    graph.replay()
    torch.cuda.synchronize()
    reference = static_output.clone()
    tus.snapshot("weights", model)
    perturb(model)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(static_output, reference)
    tus.restore("weights")
    graph.replay()  # the graph read the same addresses, which hold the snapshot again
    torch.cuda.synchronize()
    assert torch.equal(static_output, reference)


@scenario
def snapshot_of_a_paused_tag_comes_from_its_backup() -> None:
    import torch

    import torch_uvm_saver as tus

    with tus.region("weights", enable_cpu_backup=True):
        model = transformer(layers=2)
    original = weights(model)
    nbytes = sum(t.nbytes for t in original.values())
    tus.pause("weights")
    before = tus.memory_stats()
    free_paused = free_bytes()
    tus.snapshot("from-backup", model)
    after = tus.memory_stats()
    copied_from_backup = after["snapshot_from_backup_bytes"] - before["snapshot_from_backup_bytes"]
    print(f"{copied_from_backup / MiB:.1f} MiB taken from the backup of a paused tag")
    assert copied_from_backup == nbytes
    assert free_bytes() >= free_paused - 2 * MiB  # no device memory mapped for it
    assert tus.is_paused("weights")
    tus.resume("weights")
    assert all_same_bits(model, original)
    perturb(model)
    tus.pause("weights")
    tus.restore("from-backup")  # into the backup: the resume brings the snapshot in
    assert tus.memory_stats()["snapshot_into_backup_bytes"] == nbytes
    tus.resume("weights")
    assert all_same_bits(model, original)
    # A tag without a backup holds nothing to copy while paused.
    with tus.region("scratch"):
        scratch = torch.ones(MiB, device="cuda")
    tus.pause("scratch")
    expect_error(tus.InvalidStateError, lambda: tus.snapshot("s", [scratch]), "without a CPU")
    tus.resume("scratch")


@scenario
def snapshot_of_a_tag_restores_its_segments() -> None:
    import gc

    import torch

    import torch_uvm_saver as tus

    with tus.region("weights"):
        model = transformer(layers=2)
    original = weights(model)
    taken = tus.snapshot("tagged", "weights")
    listed = tus.list_snapshots()["tagged"]
    print(f"tag snapshot: {taken / MiB:.1f} MiB in {listed['tensors']} segments")
    assert listed["tag"] == "weights" and taken >= sum(t.nbytes for t in original.values())
    perturb(model)
    tus.restore("tagged")
    assert all_same_bits(model, original)
    # Dropping the pools makes PyTorch free their segments.
    del model
    tus.regions._pools.clear()
    gc.collect()
    torch.cuda.empty_cache()
    expect_error(tus.InvalidStateError, lambda: tus.restore("tagged"), "was freed")


@scenario
def device_snapshot_restores_device_to_device() -> None:
    import torch

    import torch_uvm_saver as tus

    model = transformer()
    original = weights(model)
    nbytes = sum(t.nbytes for t in original.values())
    free_before = free_bytes()
    tus.snapshot("gpu", model, on_device=True)
    print(f"device snapshot took {(free_before - free_bytes()) / MiB:.1f} MiB of device memory")
    assert free_before - free_bytes() >= nbytes
    assert tus.memory_stats()["snapshot_device_bytes"] == nbytes
    perturb(model)
    tus.restore("gpu")
    assert all_same_bits(model, original)
    # No room: fill the device with plain memory (never managed) until the driver refuses even
    # a small piece, then ask for another device copy. (A free-memory reading is not enough: on
    # an H200 a 98 MiB cuMemAlloc succeeded with cudaMemGetInfo reporting less than that free.)
    torch.cuda.empty_cache()
    hog, piece = [], free_bytes()
    while piece >= 4 * MiB:
        try:
            hog.append(torch.empty(piece, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            piece //= 2
    print(f"device filled: {free_bytes() / MiB:.1f} MiB left free in {len(hog)} pieces")
    expect_error(
        tus.OutOfMemoryError, lambda: tus.snapshot("more", model, on_device=True), "on_device"
    )
    assert "more" not in tus.list_snapshots()
    del hog
    torch.cuda.empty_cache()
    free_with_snapshot = free_bytes()
    tus.drop_snapshot("gpu")
    returned = free_bytes() - free_with_snapshot
    print(f"drop_snapshot returned {returned / MiB:.1f} MiB for {nbytes / MiB:.1f} MiB of weights")
    assert returned >= nbytes, "the device copy's memory did not come back"
    assert tus.memory_stats()["snapshot_device_bytes"] == 0


@scenario
def restore_refuses_a_reshaped_tensor_and_writes_nothing() -> None:
    import torch

    import torch_uvm_saver as tus

    t = torch.randn(1024, 1024, device="cuda")
    tus.snapshot("t", {"t": t})
    t.fill_(3)
    t.data = t.data.view(torch.int32)
    expect_error(tus.InvalidArgumentError, lambda: tus.restore("t"), "same shape and dtype")
    t.data = t.data.view(torch.float32)
    assert bool((t == 3).all())


if __name__ == "__main__":
    name = sys.argv[1]
    SCENARIOS[name]()
    print(f"SCENARIO {name} OK", flush=True)
