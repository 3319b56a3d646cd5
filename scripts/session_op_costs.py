"""Host cost of each PyTorch call the LMS session makes per storage it pages out or prefetches
(lms_session.py, _page_out_all and _prefetch_all), timed alone on the current GPU: the byte view
over a storage, the queued copy each way, record_stream, giving the block back (resize_(0)) and
taking a new one (resize_(n)), events and stream waits, entering a stream context. GPT-2
medium's step at 4x pages about 190 storages out and in again, and there the host sets the pace
(lms_state_split.py's queued_s), so microseconds here are step time.

    python scripts/session_op_costs.py [--mib 8] [--repeat 2000]

Prints one line per call: median microseconds over --repeat calls (each call timed with the
others it needs around it, then those subtracted where the table says so). Needs a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from torch_uvm_saver.segment_move import byte_view


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def timed(call, repeat: int, setup=None) -> float:
    """Median host seconds of call(state) after setup() (untimed) made its state."""
    samples = []
    for _ in range(repeat):
        state = setup() if setup is not None else None
        start = time.perf_counter()
        call(state)
        samples.append(time.perf_counter() - start)
    return median_us(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=8.0, help="bytes per storage, MiB")
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    nbytes = int(args.mib * 2**20)
    repeat = args.repeat
    compute = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    device_tensor = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    storage = device_tensor.untyped_storage()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    view = byte_view(storage)
    event = side.record_event()
    rows: list[tuple[str, float]] = []

    def row(name: str, us: float) -> None:
        rows.append((name, us))
        torch.cuda.synchronize()  # the next measurement starts with empty queues

    row("byte_view(storage)", timed(lambda _: byte_view(storage), repeat))
    row("storage.device", timed(lambda _: storage.device, repeat))
    row("torch.cuda.current_stream()", timed(lambda _: torch.cuda.current_stream(), repeat))

    def enter_exit(_):
        with torch.cuda.stream(side):
            pass

    row("with torch.cuda.stream(side): (enter and exit)", timed(enter_exit, repeat))
    row("side.wait_stream(compute)", timed(lambda _: side.wait_stream(compute), repeat))
    row("side.record_event()", timed(lambda _: side.record_event(), repeat))
    row("side.wait_event(event)", timed(lambda _: side.wait_event(event), repeat))
    row("view.record_stream(side)", timed(lambda _: view.record_stream(side), repeat))
    torch.cuda.synchronize()
    small = max(repeat // 4, 50)  # copies queue real transfers: fewer of them
    row(
        f"host.copy_(view, non_blocking) ({args.mib:g} MiB, device to host)",
        timed(lambda _: host.copy_(view, non_blocking=True), small),
    )
    row(
        f"view.copy_(host, non_blocking) ({args.mib:g} MiB, host to device)",
        timed(lambda _: view.copy_(host, non_blocking=True), small),
    )
    row(
        "storage.copy_(host storage, non_blocking) (the same, no view)",
        timed(lambda _: storage.copy_(host.untyped_storage(), non_blocking=True), small),
    )

    def fresh() -> torch.UntypedStorage:
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda").untyped_storage()

    row("resize_(0), nothing recorded", timed(lambda s: s.resize_(0), small, fresh))

    def recorded() -> torch.UntypedStorage:
        s = fresh()
        byte_view(s).record_stream(side)
        return s

    row("resize_(0) after record_stream(side)", timed(lambda s: s.resize_(0), small, recorded))

    def emptied() -> torch.UntypedStorage:
        s = fresh()
        s.resize_(0)
        return s

    row("resize_(n) (a block from the cache)", timed(lambda s: s.resize_(nbytes), small, emptied))
    torch.cuda.synchronize()
    width = max(len(name) for name, _ in rows)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {repeat} calls each")
    for name, us in rows:
        print(f"  {name:<{width}}  {us:7.2f} us")


if __name__ == "__main__":
    main()
