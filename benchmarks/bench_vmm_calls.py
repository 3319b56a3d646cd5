"""Host time of each CUDA VMM call while the GPU is idle, computing, or copying over the link.

LMS maps and unmaps a block at every page-in, page-out and new segment, with page-out copies
(device to host) almost always in flight. This measures what one cycle of a segment costs under
each kind of load, through the library's own driver (no caching allocator in between): reserve
an address range, create physical memory, map it, set its access, unmap, release, free the range.
The idle GPU is the baseline of the same run; each load reports its ratio to it.

    python benchmarks/bench_vmm_calls.py [--segment-mib 32] [--reps 15] [--d2h-pieces-mib 64,16,4]
                                         [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from _bench_common import GiB, MiB, default_output, log, utc_now, write_json

from torch_uvm_saver import _C

CALLS = ("reserve", "create", "map", "set_access", "unmap", "release", "free_address")
# Long enough (about 40 ms at 55 GB/s, or 20 large matmuls) to cover one cycle of calls.
COPY_BYTES = 2 * GiB
SETTLE_S = 0.002  # lets the load start on the device before the calls are timed


def one_cycle(driver: _C.Driver, size: int) -> dict[str, float]:
    """Seconds of each call of one reserve-to-free cycle of a `size`-byte segment."""
    seconds: dict[str, float] = {}

    def timed(name: str, call: Callable[[], object]) -> object:
        start = time.perf_counter()
        result = call()
        seconds[name] = time.perf_counter() - start
        return result

    address = timed("reserve", lambda: driver.reserve_address(0, size))
    handle = timed("create", lambda: driver.create_physical(0, size))
    timed("map", lambda: driver.map(0, address, size, handle))
    timed("set_access", lambda: driver.set_access(0, address, size))
    timed("unmap", lambda: driver.unmap(0, address, size))
    timed("release", lambda: driver.release_physical(0, handle))
    timed("free_address", lambda: driver.free_address(0, address, size))
    return seconds


def make_loads(piece_mib: list[int]) -> dict[str, Callable[[], None]]:
    """Work queued on a side stream, still running when the calls are made. `piece_mib`: sizes
    of the pieces a device-to-host copy is also queued in, one load each."""
    side = torch.cuda.Stream()
    other = torch.cuda.Stream()
    host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    matrix = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    half = COPY_BYTES // 2

    def matmuls() -> None:
        with torch.cuda.stream(side):
            for _ in range(20):
                matrix @ matrix

    def host_to_device() -> None:
        with torch.cuda.stream(side):
            device.copy_(host, non_blocking=True)

    def both_directions() -> None:
        with torch.cuda.stream(side):
            host[:half].copy_(device[:half], non_blocking=True)
        with torch.cuda.stream(other):
            device[half:].copy_(host[half:], non_blocking=True)

    def device_to_host_in(piece: int) -> Callable[[], None]:
        """The whole buffer device to host, queued as copies of `piece` bytes."""

        def load() -> None:
            with torch.cuda.stream(side):
                for start in range(0, COPY_BYTES, piece):
                    host[start : start + piece].copy_(device[start : start + piece], True)

        return load

    loads = {
        "idle": lambda: None,
        "matmuls": matmuls,
        "host_to_device_copy": host_to_device,
        "device_to_host_copy": device_to_host_in(COPY_BYTES),
        "both_directions": both_directions,
    }
    for mib in piece_mib:
        loads[f"device_to_host_{mib}MiB_pieces"] = device_to_host_in(mib * MiB)
    return loads


def measure(driver: _C.Driver, size: int, load: Callable[[], None], reps: int) -> dict:
    cycles = []
    for _ in range(reps + 1):  # the first cycle warms the driver up and is dropped
        load()
        time.sleep(SETTLE_S)
        cycles.append(one_cycle(driver, size))
        torch.cuda.synchronize()
    cycles = cycles[1:]
    return {
        name: {
            "median_ms": statistics.median(cycle[name] for cycle in cycles) * 1e3,
            "max_ms": max(cycle[name] for cycle in cycles) * 1e3,
        }
        for name in CALLS
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segment-mib", type=int, default=32)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument(
        "--d2h-pieces-mib",
        default="64,16,4",
        help="also copy device to host in pieces of these sizes (comma-separated; '' for none)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    driver = _C.CudaDriver()
    size = args.segment_mib * MiB
    granularity = driver.granularity(0)
    if size % granularity:
        print(f"--segment-mib must be a multiple of {granularity // MiB}", file=sys.stderr)
        return 2
    loads = make_loads([int(mib) for mib in args.d2h_pieces_mib.split(",") if mib])
    rows = {}
    for name, load in loads.items():
        log(f"{name}: {args.reps} cycles of a {args.segment_mib} MiB segment")
        rows[name] = measure(driver, size, load, args.reps)
    idle = rows["idle"]
    header = f"{'load':<32}" + "".join(f"{call:>16}" for call in CALLS)
    print(f"median host ms per call, {args.segment_mib} MiB segment (x idle):")
    print(header)
    for name, row in rows.items():
        cells = []
        for call in CALLS:
            ms = row[call]["median_ms"]
            ratio = ms / idle[call]["median_ms"] if idle[call]["median_ms"] > 0 else float("nan")
            row[call]["vs_idle"] = ratio
            cells.append(f"{ms:7.3f} ({ratio:4.1f}x)")
        print(f"{name:<32}" + "".join(f"{cell:>16}" for cell in cells))
    device_name = torch.cuda.get_device_name()
    out = args.out or default_output("vmm_calls", device_name, ".json")
    write_json(
        out,
        {
            "benchmark": "vmm_calls",
            "date": utc_now(),
            "device": device_name,
            "torch": torch.__version__,
            "segment_bytes": size,
            "copy_bytes": COPY_BYTES,
            "reps": args.reps,
            "d2h_pieces_mib": args.d2h_pieces_mib,
            "by_load": rows,
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
