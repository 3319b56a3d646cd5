"""An attached process of sharing_scenarios.py and bench_sharing.py: attaches to the tag served at
argv[1], then obeys one command a line on stdin and answers one JSON line on stdout.

    forward          the transformer of snapshot_scenarios.transformer() loaded with the shared
                     weights (assign=True: no copy) on a fixed input; answers its output's sum
    checksum         the sum of every shared tensor, as float64
    mapped           whether the owner's memory is mapped here
    close            detach and exit
The first line reports the attach: {"pid", "attach_ms", "added_bytes", "bytes"}; added_bytes is
the device memory the attach took (free memory before minus after, CUDA already initialized).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import torch_uvm_saver as tus


def answer(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the context exists before the measurement
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    attached = tus.attach(sys.argv[1])
    attach_ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    added = free_before - torch.cuda.mem_get_info()[0]
    answer(pid=os.getpid(), attach_ms=attach_ms, added_bytes=added, bytes=attached.bytes)
    model = None
    for line in sys.stdin:
        command = line.strip()
        if command == "forward":
            if model is None:
                model = _meta_transformer()
                model.load_state_dict(attached.state_dict(), assign=True)
            torch.manual_seed(1)
            x = torch.randn(2, 64, 1024, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                out = model(x)
            answer(sum=float(out.float().sum()))
        elif command == "checksum":
            tensors = attached.state_dict().values()
            answer(sum=sum(float(t.double().sum()) for t in tensors))
        elif command == "mapped":
            answer(mapped=attached.mapped)
        elif command == "close":
            attached.close()
            answer(closed=True)
            return


def _meta_transformer():
    """snapshot_scenarios.transformer()'s architecture with no memory of its own (meta device):
    load_state_dict(assign=True) then puts the shared tensors in its place."""
    with torch.device("meta"):
        layer = torch.nn.TransformerEncoderLayer(
            d_model=1024, nhead=16, dim_feedforward=4096, batch_first=True
        )
        model = torch.nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    return model.to(dtype=torch.bfloat16).eval()


if __name__ == "__main__":
    main()
