"""Workloads for the fault-injection sweep of test_fault_injection.py: one per mode and mechanism
(malloc/free in each mode, through segments and through the block cache; managed allocation,
prefetch and the device budget's eviction; LMS page-out and page-in on VMM and on managed
memory; pause/resume with host and disk backups), each a list of named steps on a fresh
SimDriver and Allocator.

Note [Sweeping a workload]
    A clean run counts the driver calls the steps make, teardown and the allocator's destruction
    included; the sweep then makes one case of each (call, position) pair: the same run with
    that one call failing. A step that raises is run once more (the fault fired and is gone),
    so the workload goes on as a user would after an error, and each step checks the bytes it
    expects. What a case must show is in check_case() of test_fault_injection.py. Every case
    starts from a fresh driver and allocator, so the positions of one clean run are those of
    every failing one up to the fault.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Callable

from torch_uvm_saver import _C

KiB = 1 << 10
MiB = 1 << 20
# The driver's granularity, where the allocator allows it: small sizes keep a case cheap (the
# bytes written, copied and compared are most of its cost) with as many chunks as large ones.
# The block cache and LMS round to 2 MiB themselves, and managed memory is tracked in 2 MiB pages.
SMALL_UNIT = 64 * KiB
LARGE_UNIT = 2 * MiB
STREAM = 0x1000  # opaque stream handles: the simulated driver only compares them
OTHER_STREAM = 0x2000
MODES = ("device", "vmm", "managed", "lms")
# Drawn once: a sweep has hundreds of cases, and drawing fresh bytes for each costs more than
# the case itself. Slices of it are distinct enough to tell two allocations apart.
RANDOM = os.urandom(32 * MiB)


@dataclass
class Env:
    """One case's driver and allocator, the addresses its steps keep by name and the bytes
    written to each."""

    driver: _C.SimDriver
    allocator: _C.Allocator | None
    scratch_dir: str  # where disk backups go
    ptrs: dict[str, int] = field(default_factory=dict)
    data: dict[str, bytes] = field(default_factory=dict)
    offset: int = 0

    @property
    def alloc(self) -> _C.Allocator:
        assert self.allocator is not None
        return self.allocator

    def write(self, name: str, ptr: int, size: int) -> None:
        """Keeps `ptr` as `name` and fills its first `size` bytes with bytes of its own."""
        start = self.offset % (len(RANDOM) - size)
        self.offset += 4099  # a prime stride: neighbours never hold the same bytes
        data = RANDOM[start : start + size]
        ctypes.memmove(ptr, data, size)
        self.ptrs[name] = ptr
        self.data[name] = data

    def check(self, *names: str) -> None:
        for name in names or tuple(self.data):
            got = ctypes.string_at(self.ptrs[name], len(self.data[name]))
            assert got == self.data[name], f"{name}: the bytes written before were lost"

    def drop(self, name: str) -> int:
        """Forgets `name` (about to be freed) and returns its address."""
        self.data.pop(name, None)
        return self.ptrs.pop(name)


@dataclass(frozen=True)
class Step:
    label: str
    run: Callable[[Env], object]
    context: str = ""  # what an error it raises must start with (the call and its arguments)


@dataclass(frozen=True)
class Workload:
    name: str
    prepare: Callable[[Env], None]  # not counted: what the steps start from
    steps: tuple[Step, ...]
    unit: int = SMALL_UNIT  # the driver's granularity
    chunk_units: int = 2  # VMM chunks of this many units: segments of several chunks


def new_env(workload: Workload, scratch_dir: str) -> Env:
    driver = _C.SimDriver(128 * MiB, 1, workload.unit)
    chunk_bytes = workload.chunk_units * workload.unit
    return Env(driver, _C.Allocator(driver, device=0, chunk_bytes=chunk_bytes), scratch_dir)


def nothing(env: Env) -> None:
    pass


def free_all(env: Env) -> None:
    """Teardown: frees what the steps left, segments and blocks alike."""
    for name in list(env.ptrs):
        ptr = env.drop(name)
        if not env.alloc.block_free(ptr):
            env.alloc.free(ptr)


TEARDOWN = (
    Step("free everything", free_all),
    Step("empty_cache", lambda env: env.alloc.empty_cache()),
    Step("release_host_cache", lambda env: env.alloc.release_host_cache()),
    Step("stats", lambda env: env.alloc.stats()),  # collects prefetch timings
)


# --- malloc/free per mode: segments (torch hook mode) ------------------------------------------


def segments_workload(mode: str) -> Workload:
    unit = SMALL_UNIT

    def prepare(env: Env) -> None:
        if mode == "lms":
            env.alloc.set_lms_limit(64 * MiB)
            env.alloc.set_lms_headroom(0)

    def malloc(name: str, size: int, tag: str) -> Step:
        def run(env: Env) -> None:
            env.write(name, env.alloc.malloc(size, tag=tag, mode=mode, stream=STREAM), size)

        return Step(f"malloc {name}", run)

    def free(name: str) -> Step:
        return Step(f"free {name}", lambda env: env.alloc.free(env.drop(name)))

    return Workload(
        f"segments[{mode}]",
        prepare,
        (
            malloc("a", 5 * unit + 1, "t"),  # 3 chunks in vmm and lms
            malloc("b", 3 * unit, "u"),
            Step("check", lambda env: env.check()),
            free("a"),
            malloc("c", 2 * unit, "t"),
            Step("check c", lambda env: env.check("b", "c")),
            *TEARDOWN,
        ),
    )


# --- malloc/free per mode: the global hook mode's block cache ----------------------------------


def blocks_workload(mode: str) -> Workload:
    def prepare(env: Env) -> None:
        if mode == "lms":
            env.alloc.set_lms_limit(64 * MiB)
            env.alloc.set_lms_headroom(0)

    def malloc(name: str, size: int) -> Step:
        def run(env: Env) -> None:
            env.write(name, env.alloc.block_malloc(size, mode=mode, stream=STREAM), size)

        return Step(f"block_malloc {name}", run)

    def free(name: str) -> Step:
        return Step(f"block_free {name}", lambda env: env.alloc.block_free(env.drop(name)))

    def record_stream(env: Env) -> None:
        env.alloc.record_stream(env.ptrs["small"], OTHER_STREAM)

    return Workload(
        f"blocks[{mode}]",
        prepare,
        (
            malloc("large", 2 * MiB),
            malloc("small", 64 * KiB),
            Step("record_stream", record_stream),
            free("large"),
            free("small"),  # behind an event on the other stream
            malloc("again", 2 * MiB),  # the cached block
            malloc("small again", 64 * KiB),
            Step("check", lambda env: env.check()),
            free("again"),
            *TEARDOWN,
        ),
        unit=LARGE_UNIT,
    )


# --- managed allocation, prefetch and the device budget ----------------------------------------

PAGE = 2 * MiB  # what managed residency tracks


def managed_malloc(name: str, **advice: object) -> Step:
    def run(env: Env) -> None:
        env.write(
            name, env.alloc.malloc(PAGE, tag="m", mode="managed", stream=STREAM, **advice), PAGE
        )

    return Step(f"malloc {name}", run)


def prefetch(name: str, location: str, offset: int = 0, size: int = PAGE) -> Step:
    def run(env: Env) -> None:
        env.alloc.prefetch(env.ptrs[name] + offset, size, location, STREAM)

    return Step(f"prefetch {name} to {location}", run)


def budget(pages: int) -> Step:
    return Step(
        f"set_device_budget {pages} pages", lambda env: env.alloc.set_device_budget(pages * PAGE)
    )


def managed_block(env: Env) -> None:
    env.write("block", env.alloc.block_malloc(PAGE, tag="m", mode="managed", stream=STREAM), PAGE)


MANAGED_PLACEMENT = Workload(
    "managed placement",
    nothing,
    (
        budget(2),
        managed_malloc("m1"),
        managed_malloc("m2"),
        managed_malloc("m3"),  # three pages placed: m1 is evicted
        managed_malloc("host", preferred_location="cpu", accessed_by="cuda:0", read_mostly=True),
        prefetch("m1", "cuda:0"),  # re-admitted; m2 is evicted
        prefetch("m3", "cpu"),
        prefetch("m2", "cuda:0", offset=PAGE // 2, size=PAGE // 2),
        Step(
            "advise m3",
            lambda env: env.alloc.advise(env.ptrs["m3"], PAGE, "set_accessed_by", "cuda:0"),
        ),
        Step("block_malloc", managed_block),  # a segment of its own, placed: evicts
        Step("block_free", lambda env: env.alloc.block_free(env.drop("block"))),
        budget(1),
        Step("block_malloc again", managed_block),  # the cached block, evicted: re-admitted
        Step("stats", lambda env: env.alloc.stats()),
        Step("check", lambda env: env.check()),
        budget(0),
        *TEARDOWN,
    ),
)


# --- LMS page-out and page-in ------------------------------------------------------------------

LMS_BLOCK = 2 * MiB


def lms_workload(on_managed: bool) -> Workload:
    def prepare(env: Env) -> None:
        env.alloc.set_lms_on_managed(on_managed)
        env.alloc.set_lms_limit(4 * LMS_BLOCK)
        env.alloc.set_lms_headroom(0)

    def used_block(name: str) -> Step:
        def run(env: Env) -> None:
            ptr = env.alloc.block_malloc(LMS_BLOCK, mode="lms", stream=STREAM)
            env.write(name, ptr, LMS_BLOCK)

        return Step(f"block_malloc {name}", run)

    def pin(name: str) -> Step:
        def run(env: Env) -> None:
            assert env.alloc.pin(env.ptrs[name], STREAM)
            env.check(name)

        return Step(f"pin {name}", run)

    def unpin(name: str) -> Step:
        return Step(f"unpin {name}", lambda env: env.alloc.unpin(env.ptrs[name]))

    def pinned_round(*names: str) -> tuple[Step, ...]:
        return tuple(step for name in names for step in (pin(name), unpin(name)))

    def pin_all(env: Env) -> None:
        env.alloc.pin_all([env.ptrs["p1"], env.ptrs["p2"]], STREAM)
        env.check("p1", "p2")

    def unpin_all(env: Env) -> None:
        env.alloc.unpin_all([env.ptrs["p1"], env.ptrs["p2"]])

    return Workload(
        "lms paging" + (" on managed memory" if on_managed else ""),
        prepare,
        (
            *(used_block(name) for name in ("p0", "p1", "p2", "p3")),
            *pinned_round("p0", "p1", "p2", "p3"),  # used by an operator: reclaimable
            Step("reclaim_inactive", lambda env: env.alloc.reclaim_inactive()),
            *pinned_round("p0", "p1", "p2", "p3"),  # each paged in
            used_block("p4"),  # past the limit: the ladder pages p0 out
            *pinned_round("p4"),
            Step("lms_step", lambda env: env.alloc.lms_step()),
            *pinned_round("p0", "p4"),  # p0 paged in again, room made by paging out
            Step("pin_all", pin_all),
            Step("unpin_all", unpin_all),
            Step("lms_step again", lambda env: env.alloc.lms_step()),
            *pinned_round("p3", "p0"),  # prefetched ahead, speculated out at unpin
            *TEARDOWN,  # (the bytes are checked at each pin: unpinned blocks may be out)
        ),
        unit=LARGE_UNIT,
        chunk_units=1,
    )


# --- pause and resume --------------------------------------------------------------------------


def pause_workload(disk: bool) -> Workload:
    unit = SMALL_UNIT
    # Chunks of 2 units: 5 backed-up chunks and 7 in all on tag t (test_fault_injection.py).
    layout = [
        ("a", 5 * unit, "t", True),
        ("b", 4 * unit, "t", True),
        ("none", 3 * unit, "t", False),
    ]
    if disk:
        layout.append(("on disk", 3 * unit, "d", True))

    def prepare(env: Env) -> None:
        if disk:
            env.alloc.set_disk_backup_dir(env.scratch_dir)
            env.alloc.set_disk_backup_chunk_bytes(2 * unit)
            env.alloc.set_backup_policy("d", disk=True)
        for name, size, tag, backup in layout:
            env.write(name, env.alloc.malloc(size, tag=tag, cpu_backup=backup), size)
        env.data.pop("none")  # without a backup its bytes are gone after a pause

    def check(env: Env) -> None:
        env.check()

    steps: tuple[Step, ...] = (
        Step("pause t", lambda env: env.alloc.pause("t"), "pause('t') on device 0: "),
        Step("resume t", lambda env: env.alloc.resume("t"), "resume('t') on device 0: "),
        Step("check", check),
    )
    if disk:
        steps += (
            Step("pause everything", lambda env: env.alloc.pause(None)),
            Step("free a while paused", lambda env: env.alloc.free(env.drop("a"))),
            Step("resume everything", lambda env: env.alloc.resume(None)),
            Step("check again", check),
        )
    name = "pause/resume" + (" with a disk backup" if disk else "")
    return Workload(name, prepare, steps + TEARDOWN)


WORKLOADS: tuple[Workload, ...] = (
    *(segments_workload(mode) for mode in MODES),
    *(blocks_workload(mode) for mode in MODES),
    MANAGED_PLACEMENT,
    lms_workload(on_managed=False),
    lms_workload(on_managed=True),
    pause_workload(disk=False),
    pause_workload(disk=True),
)
