"""GPU scenarios of Large Model Support, one per fresh process: `python lms_scenarios.py NAME`
(test_scenarios.py runs them all). LMS needs the global hook, which must come before CUDA is
initialized, so runs that compare settings are child processes of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable

MiB = 1 << 20
SCENARIOS: dict[str, Callable[[], None]] = {}


def scenario(function: Callable[[], None]) -> Callable[[], None]:
    SCENARIOS[function.__name__] = function
    return function


TRAIN_SCRIPT = r"""
import json, sys
import torch
import torch_uvm_saver as tus
limit = int(sys.argv[1])
helper = sys.argv[2] == "helper"
tus.set_enabled_lms(True)
tus.set_backing_lms(sys.argv[3])
ahead = sys.argv[4] == "ahead"
tus.set_speculation_lms(ahead)
tus.set_prefetch_lms(2 if ahead else 0)
if sys.argv[5] != "off":
    tus.set_headroom_lms(None if sys.argv[5] == "auto" else int(sys.argv[5]))
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
width, depth, batch = 2048, 12, 4096
layers = []
for _ in range(depth):
    layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
model = torch.nn.Sequential(*layers).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
if helper:
    tus.pin_parameters(model)
data = torch.randn(batch, width, device="cuda")
target = torch.randn(batch, width, device="cuda")
if limit:
    tus.set_limit_lms(limit)
tus.reset_peak_memory_stats()
import time
losses, seconds = [], []
for step in range(6):
    torch.cuda.synchronize()
    start = time.perf_counter()
    with tus.lms_mode():
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(data), target)
        loss.backward()
        optimizer.step()
        # A host read touches the loss's block like a kernel does, so it runs under the mode too
        # (Note [Touching reclaimed memory]).
        losses.append(loss.item())
    tus.lms_step()
    torch.cuda.synchronize()
    seconds.append(time.perf_counter() - start)
torch.cuda.synchronize()
stats = tus.memory_stats()
keys = ("reserved_bytes.all.peak", "num_pageouts.lms", "num_pageins.lms", "pageout_bytes.lms",
        "pagein_bytes.lms", "reclaimed_bytes.lms.current", "speculative_pageouts.lms",
        "speculative_hits.lms", "speculative_misses.lms", "prefetches.lms", "prefetch_hits.lms",
        "prefetch_misses.lms", "pageouts_ahead.lms", "lms_ladder_pageouts")
result = {key: stats[key] for key in keys}
result.update({k: v for k, v in stats.items() if k.startswith("alloc_distribution.")})
result["step_s_last4"] = sorted(seconds[2:])
print("RESULT " + json.dumps({"losses": losses, "limit": tus.get_limit_lms(), **result}))
"""


def train(
    limit: int,
    helper: bool = False,
    backing: str = "vmm",
    ahead: bool = False,
    headroom: str = "off",
) -> dict:
    """`headroom`: "off", "auto" (limit / 32) or bytes (set_headroom_lms)."""
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    command = [sys.executable, "-c", TRAIN_SCRIPT, str(limit), "helper" if helper else "plain"]
    command += [backing, "ahead" if ahead else "plain", headroom]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@scenario
def training_under_half_the_footprint_matches_unlimited() -> None:
    free = train(0)
    peak = free["reserved_bytes.all.peak"]
    print(f"unlimited: peak {peak / MiB:.0f} MiB, losses {free['losses']}")
    assert free["num_pageouts.lms"] == 0
    limited = train(peak // 2)
    summary = {key: value for key, value in limited.items() if key != "losses"}
    print(f"limit {peak // 2 / MiB:.0f} MiB: losses {limited['losses']}")
    print(json.dumps(summary))
    assert limited["losses"] == free["losses"]  # every byte came back as it went out
    assert limited["reserved_bytes.all.peak"] <= peak // 2
    assert limited["num_pageouts.lms"] > 0 and limited["num_pageins.lms"] > 0
    assert limited["pagein_bytes.lms"] > 0
    helped = train(peak // 2, helper=True)  # pin_parameters keeps each layer's weights in
    print(f"with pin_parameters: pageouts {helped['num_pageouts.lms']}")
    assert helped["losses"] == free["losses"]
    assert helped["reserved_bytes.all.peak"] <= peak // 2
    ahead = train(peak // 2, ahead=True)  # speculative page-out and prefetch
    details = {key: value for key, value in ahead.items() if key != "losses"}
    print(f"with speculation and prefetch: {json.dumps(details)}")
    assert ahead["losses"] == free["losses"]
    assert ahead["speculative_pageouts.lms"] > 0
    assert ahead["reserved_bytes.all.peak"] <= peak // 2
    early = train(peak // 2, headroom="auto")  # paging out ahead, limit / 32 kept free
    print(f"paging out ahead: {json.dumps({k: v for k, v in early.items() if k != 'losses'})}")
    assert early["losses"] == free["losses"]
    assert early["pageouts_ahead.lms"] > 0
    assert early["reserved_bytes.all.peak"] <= peak // 2
    managed = train(peak // 2, backing="managed")  # page-out is a prefetch to the host
    print(f"on managed memory: {json.dumps({k: v for k, v in managed.items() if k != 'losses'})}")
    assert managed["losses"] == free["losses"]
    assert managed["num_pageouts.lms"] > 0 and managed["num_pageins.lms"] > 0
    assert managed["reserved_bytes.all.peak"] <= peak // 2  # the managed bytes placed on the GPU


@scenario
def pinned_tensor_survives_reclaim_inactive() -> None:
    import torch

    import torch_uvm_saver as tus

    tus.set_enabled_lms(True)
    keep = torch.arange(8 * MiB, dtype=torch.int32, device="cuda")
    out = torch.full((8 * MiB,), 6, dtype=torch.int32, device="cuda")
    with tus.lms_mode():  # an operator reads them: pinned, then unpinned, so reclaimable
        keep.add_(0)
        out.add_(1)
    torch.cuda.synchronize()
    with tus.pinned(keep):
        moved = tus.reclaim_inactive()
        print(f"reclaimed {moved / MiB:.0f} MiB")
        assert moved >= 32 * MiB  # `out` (and anything else inactive), never `keep`
        assert int(keep[-1]) == 8 * MiB - 1
    with tus.pinned(out):  # pages it back in at the same address
        assert int(out.sum()) == 7 * 8 * MiB
    stats = tus.memory_stats()
    assert stats["num_pageins.lms"] >= 1 and stats["reclaimed_bytes.lms.current"] >= 0


@scenario
def unguarded_reads_are_refused_under_lms_check() -> None:
    import torch

    import torch_uvm_saver as tus
    from torch_uvm_saver.errors import InvalidStateError

    tus.set_enabled_lms(True)
    t = torch.full((8 * MiB,), 3, dtype=torch.int32, device="cuda")
    with tus.lms_mode():
        t.add_(1)  # pinned for the operator, inactive from now on
    torch.cuda.synchronize()

    def refused(read, state: str) -> None:
        with tus.lms_check():
            try:
                read()
            except InvalidStateError as error:
                assert state in str(error), str(error)
                print(f"refused: {str(error)[:160]}")
                return
        raise AssertionError(f"an unpinned read of a block that is {state} was let through")

    refused(lambda: t.sum(), "inactive")
    assert tus.reclaim_inactive() >= 32 * MiB
    refused(lambda: int(t[-1]), "paged out")  # a host read, like loss.item(): no CUDA error
    with tus.lms_check(), tus.lms_mode():  # the guarded read pages it back in and goes through
        assert int(t[-1]) == 4
        assert int(t.sum(dtype=torch.int64)) == 4 * 8 * MiB


@scenario
def out_of_memory_under_the_limit_raises_and_the_process_goes_on() -> None:
    # The global hook hands PyTorch's tensors straight to us, and PyTorch does not check what
    # the hook returns: a failed allocation has to raise, or a kernel writes through a null
    # pointer and the CUDA context is lost (seen on an H200 before the fix).
    import torch

    import torch_uvm_saver as tus

    tus.set_enabled_lms(True)
    tus.set_limit_lms(256 * MiB)
    kept = torch.full((32 * MiB,), 3, dtype=torch.int32, device="cuda")  # 128 MiB, never pinned
    try:
        torch.ones(64 * MiB, dtype=torch.int32, device="cuda")  # 256 MiB more: past the limit
    except RuntimeError as error:
        message = str(error)
        print(f"raised as expected: {message[:200]}")
        assert "CUDA out of memory" in message and "under the limit" in message, message
    else:
        raise AssertionError("an allocation past the LMS limit should have raised")
    with tus.lms_mode():  # where LMS runs, the error is an out-of-memory error proper
        try:
            torch.ones(64 * MiB, dtype=torch.int32, device="cuda")
        except tus.OutOfMemoryError as error:
            assert isinstance(error, torch.OutOfMemoryError)
        else:
            raise AssertionError("an allocation past the LMS limit should have raised")
    # The context is intact: kernels run, data kept on the device is unchanged.
    small = torch.arange(1000, dtype=torch.float32, device="cuda")
    assert float(small.sum()) == 499500.0
    assert int(kept.min()) == 3 and int(kept.max()) == 3  # no wider copy: we sit at the limit
    torch.cuda.synchronize()
    assert tus.memory_stats()["num_ooms.lms"] >= 1


if __name__ == "__main__":
    name = sys.argv[1]
    SCENARIOS[name]()
    print(f"SCENARIO {name} OK", flush=True)
