"""How long does a small device-to-host read (a loss's `float()`) wait behind large
device-to-host copies queued on another stream just before it, and does splitting those copies
into pieces let it through sooner?

The compute stream holds for --hold-ms (a sleep kernel, standing for the optimizer's last step);
a side stream waits for it, then copies --mib MiB to page-locked host memory, whole or in pieces
of each --pieces size; the host then reads a 4-byte scalar computed on the compute stream, into
pageable memory (`float()`) or into page-locked memory (`copy_(non_blocking=True)` and a
synchronize). Prints each case's median wait for the read past the hold, and the side copy's
bandwidth, against the same read with nothing queued beside it (the baseline, same run).

    python scripts/small_read_behind_copies.py [--mib 256] [--pieces 64,16,4] [--rounds 9]

Needs a GPU.
"""

from __future__ import annotations

import argparse
import statistics

import torch

MiB = 1 << 20


def sleep_cycles_for(ms: float) -> int:
    """Cycles of `torch.cuda._sleep` that take about `ms` on this device (measured)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 1_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * ms / start.elapsed_time(end))


def one_case(
    source: torch.Tensor,
    target: torch.Tensor,
    piece: int | None,
    side: torch.cuda.Stream,
    hold_cycles: int,
    scalar: torch.Tensor,
    pinned_scalar: torch.Tensor | None,
) -> tuple[float, float]:
    """One round: (the read's wait past the hold in ms, the side copies' GB/s or 0)."""
    compute = torch.cuda.current_stream()
    copies_start = torch.cuda.Event(enable_timing=True)
    copies_end = torch.cuda.Event(enable_timing=True)
    hold_end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(hold_cycles)
    scalar.add_(1.0)
    hold_end.record(compute)
    if piece is not None:
        side.wait_event(hold_end)
        copies_start.record(side)
        with torch.cuda.stream(side):
            n = source.numel()
            for offset in range(0, n, piece):
                end = min(offset + piece, n)
                target[offset:end].copy_(source[offset:end], non_blocking=True)
        copies_end.record(side)
    if pinned_scalar is None:
        float(scalar)  # the pageable read a training loop makes
    else:
        pinned_scalar.copy_(scalar, non_blocking=True)
        compute.synchronize()
    # Timed on the device: from the hold's end to a marker queued on the idle compute stream
    # the moment the read returned (the marker's own launch adds microseconds).
    after = torch.cuda.Event(enable_timing=True)
    after.record(compute)
    torch.cuda.synchronize()
    wait_ms = hold_end.elapsed_time(after)
    gbps = 0.0
    if piece is not None:
        gbps = source.numel() / (copies_start.elapsed_time(copies_end) / 1e3) / 1e9
    return wait_ms, gbps


def cases(total: int, pieces_mib: str) -> list[tuple[str, int | None]]:
    """(name, piece size in bytes or None for no side copies) of each case, in the table's
    order: the baseline first, then the copies whole, then in each size of pieces."""
    out: list[tuple[str, int | None]] = [("nothing beside", None), ("whole", total)]
    return out + [(f"pieces of {p} MiB", p * MiB) for p in map(int, pieces_mib.split(","))]


def row(read: str, case: str, waits: list[float], rates: list[float] | None) -> str:
    """One line of the table: the median wait and its range in ms, the copies' median GB/s."""
    rate = f"{statistics.median(rates):6.1f}" if rates else "     -"
    spread = f"{min(waits):5.2f}-{max(waits):5.2f}"
    return f"{read:>10} {case:>18} {statistics.median(waits):8.2f} {spread:>13} {rate}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes copied beside the read")
    parser.add_argument("--pieces", default="64,16,4", help="piece sizes in MiB to try")
    parser.add_argument("--hold-ms", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    n = args.mib * MiB
    source = torch.empty(n, dtype=torch.uint8, device="cuda")
    target = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    scalar = torch.zeros((), device="cuda")
    pinned_scalar = torch.empty((), pin_memory=True)
    side = torch.cuda.Stream()
    hold = sleep_cycles_for(args.hold_ms)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.mib} MiB copied "
        f"to the host beside the read; hold {args.hold_ms} ms; median of {args.rounds}"
    )
    print(f"{'read':>10} {'side copies':>18} {'wait ms':>8} {'range':>13} {'GB/s':>6}")
    for read_name, pinned in (("pageable", None), ("pinned", pinned_scalar)):
        for case, piece in cases(n, args.pieces):
            one_case(source, target, piece, side, hold, scalar, pinned)  # warm-up
            waits, rates = [], []
            for _ in range(args.rounds):
                wait, rate = one_case(source, target, piece, side, hold, scalar, pinned)
                waits.append(wait)
                rates.append(rate)
            print(row(read_name, case, waits, rates if piece is not None else None))


if __name__ == "__main__":
    main()
