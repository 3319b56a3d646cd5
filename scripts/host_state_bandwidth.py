"""Where should optimizer state that does not fit live? One fused AdamW step over the same
parameters, its moments held five ways, timed on the GPU:

  device                 the moments in device memory (no link at all)
  managed                managed memory that prefers the host, mapped on the device: the kernel
                         reads and writes them over the link (optimizer_state="host" before
                         Note [Staging the state on the host])
  pinned                 page-locked host memory seen by the kernel at its unified address
  streamed               the moments copied in chunk by chunk, stepped, copied back out on
                         their own streams: the copy engines carry them (what the session does)
  streamed from managed  the same copies, out of and back into the managed memory

Prints each one's step time, the bytes that crossed the link each way, that rate and its
ratio to a plain pinned copy; then each one again on a side stream beside matmuls on the
compute stream, as a step in the backward runs: how much longer the matmuls took. A step whose
kernels wait on the link while holding the SMs makes the two run one after the other.

    python scripts/host_state_bandwidth.py [--mib 1024] [--chunks 8] [--repeats 5]

Needs a GPU. Keeps managed memory far under half of what the card has free.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import torch_uvm_saver as tus
from torch_uvm_saver.managed import _alias


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn` on the current stream, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def adamw(params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
    torch._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=1e-4,
        beta1=0.9,
        beta2=0.999,
        weight_decay=0.01,
        eps=1e-8,
        amsgrad=False,
        maximize=False,
    )


def pinned_on_device(n: int, device: torch.device) -> torch.Tensor:
    host = torch.zeros(n, dtype=torch.float32, pin_memory=True)
    return _alias(host, host.data_ptr(), host.nbytes, device).view(torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="parameter bytes (MiB)")
    parser.add_argument("--chunks", type=int, default=8, help="streamed: chunks in flight order")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    n = args.mib * 2**20 // 4
    state_bytes = 2 * n * 4  # the two moments

    param = torch.randn(n, device=device)
    grad = torch.randn(n, device=device) * 1e-3
    steps = [torch.ones((), device=device)]

    copy_src = torch.empty(n, device=device)
    copy_dst = torch.empty(n, pin_memory=True)
    d2h = timed(lambda: copy_dst.copy_(copy_src, non_blocking=True), args.repeats)

    def step_over(m: torch.Tensor, v: torch.Tensor) -> float:
        return timed(lambda: adamw([param], [grad], [m], [v], steps), args.repeats)

    rows = [("device", step_over(torch.zeros(n, device=device), torch.zeros(n, device=device)), 0)]

    managed = [tus.manage_memory(torch.zeros(n, device=device)) for _ in range(2)]
    for x in managed:
        tus.advise(x, preferred_location="cpu", accessed_by=device)
        tus.prefetch(x, "cpu")
    torch.cuda.synchronize()
    rows.append(("managed", step_over(*managed), state_bytes))
    kinds = {"managed": lambda: adamw([param], [grad], [managed[0]], [managed[1]], steps)}

    pinned = [pinned_on_device(n, device) for _ in range(2)]
    rows.append(("pinned", step_over(*pinned), state_bytes))
    kinds["pinned"] = lambda: adamw([param], [grad], [pinned[0]], [pinned[1]], steps)

    host_m = torch.zeros(n, pin_memory=True)
    host_v = torch.zeros(n, pin_memory=True)
    chunk = (n + args.chunks - 1) // args.chunks
    buffers = [(torch.empty(chunk, device=device), torch.empty(chunk, device=device))]
    buffers.append((torch.empty(chunk, device=device), torch.empty(chunk, device=device)))
    inbound, outbound = torch.cuda.Stream(), torch.cuda.Stream()

    def streamed(host_m: torch.Tensor = host_m, host_v: torch.Tensor = host_v) -> None:
        compute = torch.cuda.current_stream()
        freed = [torch.cuda.Event() for _ in buffers]
        for e in freed:
            e.record(compute)
        for i in range(args.chunks):
            lo, hi = i * chunk, min(n, (i + 1) * chunk)
            bm, bv = buffers[i % 2]
            bm, bv = bm[: hi - lo], bv[: hi - lo]
            inbound.wait_event(freed[i % 2])
            with torch.cuda.stream(inbound):
                bm.copy_(host_m[lo:hi], non_blocking=True)
                bv.copy_(host_v[lo:hi], non_blocking=True)
            compute.wait_stream(inbound)
            adamw([param[lo:hi]], [grad[lo:hi]], [bm], [bv], steps)
            outbound.wait_stream(compute)
            with torch.cuda.stream(outbound):
                host_m[lo:hi].copy_(bm, non_blocking=True)
                host_v[lo:hi].copy_(bv, non_blocking=True)
            freed[i % 2].record(outbound)
        compute.wait_stream(outbound)

    t = timed(streamed, args.repeats)
    rows.append(("streamed", t, state_bytes))
    kinds["streamed"] = streamed
    kinds["streamed from managed"] = lambda: streamed(*managed)
    t_managed = timed(kinds["streamed from managed"], args.repeats)
    rows.append(("streamed from managed", t_managed, state_bytes))
    contention = {name: beside_compute(fn, t, args.repeats) for name, fn in kinds.items()}

    name = torch.cuda.get_device_name()
    print(
        f"{name}: fused AdamW over {args.mib} MiB of parameters, moments {state_bytes / 1e9:.2f} GB"
    )
    print(f"pinned copy device->host: {n * 4 / d2h / 1e9:.1f} GB/s")
    print("where                   step s   GB each way   GB/s each way   vs pinned copy")
    for where, seconds, moved in rows:
        each_way = moved / 1e9
        gbps = moved / seconds / 1e9 if moved else 0.0
        ratio = f"{gbps / (n * 4 / d2h / 1e9):.2f}" if moved else "-"
        print(f"{where:<21} {seconds:8.4f}   {each_way:11.2f}   {gbps:13.1f}   {ratio:>14}")
    print("\nthe step on a side stream beside matmuls on the compute stream (medians):")
    print("where                   matmuls alone s   beside the step s   slowdown   both done s")
    for where, (alone, beside, both) in contention.items():
        print(f"{where:<21} {alone:17.4f}   {beside:17.4f}   {beside / alone:7.2f}x   {both:10.4f}")


def beside_compute(step, step_s: float, repeats: int) -> tuple[float, float, float]:
    """Matmuls on the compute stream about as long as the step, alone and while `step` runs
    on a side stream: (matmuls alone, matmuls beside the step, until both are done), seconds.
    A step whose kernels wait on the link while holding the SMs slows the matmuls down; one
    whose bytes the copy engines carry should not."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    one = timed(lambda: a @ a, repeats)
    count = max(4, round(step_s / one))

    def matmuls() -> None:
        for _ in range(count):
            a @ a

    alone = timed(matmuls, repeats)
    side = torch.cuda.Stream()
    beside, both = [], []
    for _ in range(repeats + 1):
        compute = torch.cuda.current_stream()
        start, end, done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            step()
        matmuls()
        end.record()
        compute.wait_stream(side)
        done.record()
        done.synchronize()
        beside.append(start.elapsed_time(end) / 1e3)
        both.append(start.elapsed_time(done) / 1e3)
    return alone, statistics.median(beside[1:]), statistics.median(both[1:])


if __name__ == "__main__":
    main()
