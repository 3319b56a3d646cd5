"""Does a process's pinned host memory cross the link at the same speed in every process? The
host's NUMA nodes and the GPU's, then for each of --processes fresh processes (each bound to
the CPUs of --node, or left where the OS puts it) a pinned copy_ each way and both at once, the
CPU the process ran on and the NUMA nodes its pinned pages landed on (/proc/self/numa_maps).

    python scripts/pinned_numa_bandwidth.py [--processes 6] [--node N] [--mib 1024]

A process whose pinned pages sit on a node away from the GPU's copies slower; the session's
page-outs, prefetches and staged optimizer state all cross the link from such pages.
Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MARK = "NUMA "


def node_cpus() -> dict[int, set[int]]:
    """Each NUMA node of the host and its CPUs (one node 0 with every CPU where sysfs has none)."""
    root = "/sys/devices/system/node"
    nodes = {}
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if name.startswith("node") and name[4:].isdigit():
            with open(os.path.join(root, name, "cpulist")) as f:
                nodes[int(name[4:])] = parse_cpulist(f.read())
    return nodes or {0: set(range(os.cpu_count() or 1))}


def parse_cpulist(text: str) -> set[int]:
    """CPUs from a sysfs list such as "0-7,16-23"."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def gpu_node(device: int = 0) -> int | None:
    """The NUMA node sysfs gives the GPU's PCI device (None where it says -1 or nothing)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    address = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    try:
        with open(f"/sys/bus/pci/devices/{address}/numa_node") as f:
            node = int(f.read())
    except OSError:
        return None
    return node if node >= 0 else None


def pages_by_node(min_pages: int) -> dict[str, int]:
    """Pages per node over this process's mappings of at least `min_pages` pages: where the big
    pinned buffers landed."""
    totals: dict[str, int] = {}
    with open("/proc/self/numa_maps") as f:
        for line in f:
            counts = {
                key: int(value)
                for key, _, value in (field.partition("=") for field in line.split()[2:])
                if key.startswith("N") and key[1:].isdigit()
            }
            if sum(counts.values()) >= min_pages:
                for key, value in counts.items():
                    totals[key] = totals.get(key, 0) + value
    return totals


def measure(mib: int, repeats: int = 5) -> dict:
    """Pinned copy_ of `mib` MiB host to device, device to host, and both at once on two
    streams (each direction's bytes over the time of both): median GB/s of `repeats`."""
    import torch

    nbytes = mib << 20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device_out = torch.empty_like(device)
    streams = (torch.cuda.Stream(), torch.cuda.Stream())

    def both() -> None:
        with torch.cuda.stream(streams[0]):
            host.copy_(device, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            device_out.copy_(host_in, non_blocking=True)

    def rate(fn) -> float:
        fn()
        torch.cuda.synchronize()
        seconds = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for stream in streams:  # both() starts after `start`, and `end` waits for it
                stream.wait_event(start)
            fn()
            for stream in streams:
                torch.cuda.current_stream().wait_stream(stream)
            end.record()
            torch.cuda.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        return nbytes / statistics.median(seconds) / 1e9

    return {
        "h2d_gbps": rate(lambda: device.copy_(host, non_blocking=True)),
        "d2h_gbps": rate(lambda: host.copy_(device, non_blocking=True)),
        "duplex_gbps": rate(both),
        "pinned_pages": pages_by_node(min_pages=(mib << 20) // 4096 // 2),
    }


def one(args) -> None:
    """One process's measurement, printed after MARK as JSON."""
    if args.node is not None:
        os.sched_setaffinity(0, node_cpus()[args.node])
    import torch

    torch.cuda.init()
    result = measure(args.mib)
    result["cpu"] = current_cpu()
    result["bound_to"] = args.node
    print(MARK + json.dumps(result), flush=True)


def current_cpu() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])  # field 39: the CPU it last ran on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--node", type=int, help="bind each process to this node's CPUs")
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args)
        return
    import torch

    nodes = node_cpus()
    for node, cpus in nodes.items():
        print(f"node {node}: {len(cpus)} CPUs {min(cpus)}-{max(cpus)}")
    print(f"GPU {torch.cuda.get_device_name()} on node {gpu_node()}")
    command = [sys.executable, __file__, "--one", "--mib", str(args.mib)]
    command += ["--node", str(args.node)] if args.node is not None else []
    print("process | bound to | ran on CPU | pinned pages by node | h2d GB/s | d2h GB/s | both")
    for index in range(args.processes):
        done = subprocess.run(command, capture_output=True, text=True)
        marked = [x for x in done.stdout.splitlines() if x.startswith(MARK)]
        if not marked:
            print(f"{index} | failed (rc {done.returncode}): {done.stderr.strip()[-400:]}")
            continue
        r = json.loads(marked[-1][len(MARK) :])
        print(
            f"{index} | {r['bound_to']} | {r['cpu']} | {r['pinned_pages']} | "
            f"{r['h2d_gbps']:.1f} | {r['d2h_gbps']:.1f} | {r['duplex_gbps']:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
