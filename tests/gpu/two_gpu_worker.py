"""One rank of the two-GPU check (run by torchrun from test_hook_scenarios.py): weights (with
backup) and a KV cache (without) in pausable regions and a graph captured into pausable memory,
paused and resumed around NCCL all-reduces; the sums must match the ones before any pause."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import torch_uvm_saver as tus

MiB = 1 << 20


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    with tus.region("weights", enable_cpu_backup=True):
        weights = torch.full((64 * MiB,), float(rank + 1), device="cuda")
    with tus.region("kv"):
        kv = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    expected = weights.clone()
    dist.all_reduce(expected)  # 1 + 2 everywhere
    doubled = {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        doubled["y"] = weights * 2
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with tus.cuda_graph(graph, tag="graph"):
        doubled["y"] = weights * 2
    for _ in range(3):
        torch.cuda.synchronize()
        for tag in ("kv", "weights", "graph"):
            tus.pause(tag)
        dist.barrier()
        for tag in ("graph", "weights", "kv"):
            tus.resume(tag)
        kv.fill_(rank)
        total = weights.clone()
        dist.all_reduce(total)
        assert torch.equal(total, expected), (rank, float(total[0]))
        graph.replay()
        assert torch.equal(doubled["y"], weights * 2)
    dist.destroy_process_group()
    print(f"RANK {rank} OK", flush=True)


if __name__ == "__main__":
    main()
