"""One rank of the two-GPU tensor-parallel sharing scenario (sharing_scenarios.py), run by torchrun
with one process per GPU. Rank r attaches to the shard the weight manager serves on GPU r (argv[1]
is the socket of GPU 0's, argv[2] GPU 1's), computes its half of a Linear layer's output from the
shared weights with no copy, and the ranks combine the halves with NCCL all_gather. The result
must equal the manager's (argv[3]: its input and output, computed shard by shard on the same
GPUs). Then it prints
"RANK r READY" and waits for the file argv[4] (the manager paused and resumed both shards with
the ranks attached) to do it again, and prints "RANK r OK".
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import torch_uvm_saver as tus


def combined(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    half = x @ weight.T
    halves = [torch.empty_like(half) for _ in range(dist.get_world_size())]
    dist.all_gather(halves, half)
    return torch.cat(halves, dim=-1)


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    attached = tus.attach(sys.argv[1 + rank])
    weight = attached.state_dict()["weight"]
    assert weight.device == torch.device("cuda", rank), weight.device
    saved = torch.load(sys.argv[3])  # the manager's input and output
    x, expected = saved["x"].to(f"cuda:{rank}"), saved["y"].to(f"cuda:{rank}")
    assert torch.equal(combined(weight, x), expected), "the combined output differs"
    print(f"RANK {rank} READY", flush=True)
    deadline = time.monotonic() + 300
    while not os.path.exists(sys.argv[4]):
        assert time.monotonic() < deadline, "the manager never resumed"
        time.sleep(0.05)
    assert attached.mapped
    assert torch.equal(combined(weight, x), expected), "the output differs after pause/resume"
    dist.barrier()
    attached.close()
    dist.destroy_process_group()
    print(f"RANK {rank} OK", flush=True)


if __name__ == "__main__":
    main()
