"""
torch_uvm_saver native core (allocator, drivers, stats).
"""

# Generated: TUS_DRIVER=sim pybind11-stubgen torch_uvm_saver._C -o OUT, then `ruff format` and
# `ruff check --fix`. tests/sim/test_python_api.py checks that it names everything _C has.

from __future__ import annotations

import collections.abc
import typing

import typing_extensions

__all__: list[str] = [
    "FREE_SYMBOL",
    "HOOK_OUT_OF_MEMORY",
    "MALLOC_SYMBOL",
    "USED_CAPSULE_NAME",
    "Allocator",
    "CopyDoneEvent",
    "CudaDriver",
    "Driver",
    "RegionState",
    "RelocationPlanner",
    "SharedMapping",
    "SimDriver",
    "alias_capsule",
    "allocators",
    "check_device",
    "check_flag",
    "check_region",
    "check_tag",
    "check_whole_number",
    "clear_thread_region",
    "default_backup_policy",
    "disk_backup_chunk_bytes",
    "disk_backup_dir",
    "enable_global_hook",
    "get_allocator",
    "get_driver",
    "get_pin_ahead",
    "get_thread_region",
    "global_hook",
    "install_driver",
    "last_malloc_error",
    "logged_count",
    "managed_process_total",
    "preload_hook",
    "queue_relocation_copies",
    "restore_thread_region",
    "save_thread_region",
    "set_default_backup_policy",
    "set_disk_backup_chunk_bytes",
    "set_disk_backup_dir",
    "set_memory_margin",
    "set_pin_ahead",
    "set_thread_host_backup",
    "set_thread_region",
    "stat_docs",
]

class Driver:
    """
    A CUDA driver implementation (real or simulated).
    """
    def create_physical(
        self,
        device: typing.SupportsInt | typing.SupportsIndex,
        size: typing.SupportsInt | typing.SupportsIndex,
    ) -> int: ...
    def device_count(self) -> int: ...
    def event_create(self, device: typing.SupportsInt | typing.SupportsIndex) -> int: ...
    def event_destroy(
        self,
        device: typing.SupportsInt | typing.SupportsIndex,
        event: typing.SupportsInt | typing.SupportsIndex,
    ) -> None: ...
    def free_address(
        self,
        device: typing.SupportsInt | typing.SupportsIndex,
        ptr: typing.SupportsInt | typing.SupportsIndex,
        size: typing.SupportsInt | typing.SupportsIndex,
    ) -> None: ...
    def granularity(self, device: typing.SupportsInt | typing.SupportsIndex = 0) -> int: ...
    def is_managed(
        self,
        device: typing.SupportsInt | typing.SupportsIndex,
        ptr: typing.SupportsInt | typing.SupportsIndex,
    ) -> bool: ...
    def map(
        self,
        device: typing.SupportsInt | typing.SupportsIndex,
        ptr: typing.SupportsInt | typing.SupportsIndex,
        size: typing.SupportsInt | typing.SupportsIndex,
        handle: typing.SupportsInt | typing.SupportsIndex,
    ) -> None: ...
    def mem_alloc(
        self,
        device: typing.SupportsInt | typing.SupportsIndex,
        size: typing.SupportsInt | typing.SupportsIndex,
    ) -> int: ...
    def mem_alloc_managed(
        self,
        device: typing.SupportsInt | typing.SupportsIndex,
        size: typing.SupportsInt | typing.SupportsIndex,
    ) -> int: ...
    def mem_free(
        self,
        device: typing.SupportsInt | typing.SupportsIndex,
        ptr: typing.SupportsInt | typing.SupportsIndex,
    ) -> None: ...
    def mem_get_info(
        self, device: typing.SupportsInt | typing.SupportsIndex = 0
    ) -> tuple[int, int]:
        """
        (free, total) device memory in bytes.
        """
    def mem_prefetch(
        self,
        device: typing.SupportsInt | typing.SupportsIndex,
        ptr: typing.SupportsInt | typing.SupportsIndex,
        size: typing.SupportsInt | typing.SupportsIndex,
        location: str,
    ) -> None: ...
    def release_physical(
        self,
        device: typing.SupportsInt | typing.SupportsIndex,
        handle: typing.SupportsInt | typing.SupportsIndex,
    ) -> None: ...
    def reserve_address(
        self,
        device: typing.SupportsInt | typing.SupportsIndex,
        size: typing.SupportsInt | typing.SupportsIndex,
    ) -> int: ...
    def set_access(
        self,
        device: typing.SupportsInt | typing.SupportsIndex,
        ptr: typing.SupportsInt | typing.SupportsIndex,
        size: typing.SupportsInt | typing.SupportsIndex,
    ) -> None: ...
    def stream_create(self, device: typing.SupportsInt | typing.SupportsIndex) -> int: ...
    def stream_destroy(
        self,
        device: typing.SupportsInt | typing.SupportsIndex,
        stream: typing.SupportsInt | typing.SupportsIndex,
    ) -> None: ...
    def unmap(
        self,
        device: typing.SupportsInt | typing.SupportsIndex,
        ptr: typing.SupportsInt | typing.SupportsIndex,
        size: typing.SupportsInt | typing.SupportsIndex,
    ) -> None: ...
    @property
    def name(self) -> str: ...

class CudaDriver(Driver):
    def __init__(self) -> None: ...

class SimDriver(Driver):
    """
    Simulated driver on host memory: VMM semantics, a capacity, and fault injection.
    """
    def __init__(
        self,
        capacity: typing.SupportsInt | typing.SupportsIndex,
        device_count: typing.SupportsInt | typing.SupportsIndex = 1,
        granularity: typing.SupportsInt | typing.SupportsIndex = 2097152,
    ) -> None: ...
    def call_counts(self) -> dict[str, int]: ...
    def clear_faults(self) -> None: ...
    def fail_on(
        self,
        call: str,
        nth: typing.SupportsInt | typing.SupportsIndex = 1,
        error_code: typing.SupportsInt | typing.SupportsIndex = 999,
    ) -> None:
        """
        Make the nth call of `call` from now fail (error_code 2 = out of memory).
        """
    def held(self) -> dict[str, int]:
        """
        Objects still alive, by kind (Note [What the driver holds] in sim_driver.h).
        """
    def hold_copies(self, held: bool) -> None:
        """
        While held, copies on the allocator's own streams stay in flight (Note [Held copies] in sim_driver.h): unmapping their memory fails, as it faults on a GPU.
        """
    def hold_events(self, held: bool) -> None:
        """
        While held, event_query says recorded events are still running.
        """
    def mapped_ranges(self) -> int: ...
    def pinned_host_bytes(self) -> int: ...
    def reset_call_counts(self) -> None: ...
    def set_call_delay(
        self, call: str, seconds: typing.SupportsFloat | typing.SupportsIndex
    ) -> None:
        """
        Make every call of `call` ('*': any) take `seconds` longer, counted first and slow outside the driver's lock (Note [Slow calls] in sim_driver.h); 0 removes it.
        """
    def used_bytes(self, device: typing.SupportsInt | typing.SupportsIndex = 0) -> int: ...
    @property
    def capacity(self) -> int: ...

class Allocator:
    """
    The allocator of one device.
    """
    def __init__(
        self,
        driver: Driver,
        device: typing.SupportsInt | typing.SupportsIndex = 0,
        chunk_bytes: typing.SupportsInt | typing.SupportsIndex = 268435456,
        snapshot_slab_bytes: typing.SupportsInt | typing.SupportsIndex = 67108864,
    ) -> None: ...
    def advise(
        self,
        ptr: typing.SupportsInt | typing.SupportsIndex,
        size: typing.SupportsInt | typing.SupportsIndex,
        advice: str,
        location: str | None = None,
    ) -> None: ...
    def backup_of(self, ptr: typing.SupportsInt | typing.SupportsIndex) -> tuple | None:
        """
        (host address, bytes available) of the backup of `ptr`, or None.
        """
    def backup_policy(self, arg0: str) -> dict: ...
    def block_free(self, ptr: typing.SupportsInt | typing.SupportsIndex) -> bool:
        """
        Return a block to the global-mode cache; False if `ptr` is not a live block.
        """
    def block_malloc(
        self,
        size: int,
        tag: str = "default",
        mode: str = "device",
        cpu_backup: bool = False,
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
        preferred_location: str | None = None,
        accessed_by: str | None = None,
        read_mostly: bool = False,
    ) -> int:
        """
        A block from the global-mode cache (what the global hook calls).
        """
    def clear_disk_faults(self) -> None: ...
    def describe_unguarded(
        self, ptrs: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]
    ) -> str:
        """
        '' when every address of `ptrs` is safe to touch unpinned; else why the first one is not (lms_check).
        """
    def device_budget(self) -> int: ...
    def disk_backup_chunk_bytes(self) -> int: ...
    def disk_backup_dir(self) -> str | None: ...
    def drop_snapshot(self, name: str) -> int:
        """
        Give the snapshot's storage back; returns the bytes it held.
        """
    def empty_cache(self) -> int:
        """
        Give the global-mode cache's wholly free segments back; returns their bytes.
        """
    def enter_region(self, tag: str, mode: str = "vmm", cpu_backup: bool = False) -> None: ...
    def exit_region(self, tag: str) -> None: ...
    def export_tag(self, tag: str) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
        """
        (address, size, [(offset, size, fd), ...]) for each segment of `tag`, the fds exported for another process (the caller closes them).
        """
    def fail_disk_io_on(
        self,
        op: str,
        nth: typing.SupportsInt | typing.SupportsIndex,
        error: typing.SupportsInt | typing.SupportsIndex,
    ) -> None:
        """
        Make the nth 'open', 'write', 'sync' or 'read' of disk backup fail with errno `error`.
        """
    def free(self, ptr: typing.SupportsInt | typing.SupportsIndex) -> None: ...
    def is_managed(self, ptr: typing.SupportsInt | typing.SupportsIndex) -> bool: ...
    def is_paused(self, arg0: str) -> bool: ...
    def knows_tag(self, arg0: str) -> bool: ...
    def lms_headroom(self) -> int: ...
    def lms_limit(self) -> int: ...
    def lms_on_managed(self) -> bool: ...
    def lms_size(self) -> int: ...
    def lms_step(self) -> None: ...
    def malloc(
        self,
        size: int,
        tag: str = "default",
        mode: str = "vmm",
        cpu_backup: bool = False,
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
        preferred_location: str | None = None,
        accessed_by: str | None = None,
        read_mostly: bool = False,
    ) -> int:
        """
        A segment of its own (what torch hook mode calls).
        """
    def managed_limit(self) -> int | None: ...
    def mem_get_info(self) -> tuple[int, int]:
        """
        (free, total) device memory in bytes, as the driver reports it.
        """
    def pause(self, tag: str | None = None) -> int:
        """
        Release the device memory of `tag` (every tag if None); returns bytes released.
        """
    def pin(
        self,
        ptr: typing.SupportsInt | typing.SupportsIndex,
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> bool:
        """
        Pin the lms block holding `ptr` (paging it in if it was reclaimed); False if the address is not lms memory.
        """
    def pin_all(
        self,
        ptrs: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> int:
        """
        Pin the lms blocks holding `ptrs`, all or none; returns how many were lms blocks.
        """
    def prefetch(
        self,
        ptr: typing.SupportsInt | typing.SupportsIndex,
        size: typing.SupportsInt | typing.SupportsIndex,
        location: str,
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> int:
        """
        Prefetch managed memory to 'cpu' or 'cuda:N'; returns the bytes scheduled.
        """
    def range_attributes(
        self,
        ptr: typing.SupportsInt | typing.SupportsIndex,
        size: typing.SupportsInt | typing.SupportsIndex,
    ) -> dict:
        """
        What the driver says about a managed range.
        """
    def reclaim_inactive(self) -> int: ...
    def record_stream(
        self,
        ptr: typing.SupportsInt | typing.SupportsIndex,
        stream: typing.SupportsInt | typing.SupportsIndex,
    ) -> None: ...
    def release_host_cache(self) -> int: ...
    def reset_peak(self) -> None: ...
    def restore_snapshot(
        self,
        name: str,
        current: collections.abc.Sequence[
            tuple[
                str,
                typing.SupportsInt | typing.SupportsIndex,
                typing.SupportsInt | typing.SupportsIndex,
                str,
            ]
        ] = [],
    ) -> int:
        """
        Write the snapshot back; `current` is what its entries are now, in its order (none for a tag's snapshot). Returns the bytes written.
        """
    def resume(self, tag: str | None = None) -> int:
        """
        Map memory again under `tag` (every tag if None); returns bytes mapped.
        """
    def segments(self) -> list: ...
    def set_backup_policy(
        self, tag: str, retain: bool = False, pinned: bool = True, disk: bool = False
    ) -> None: ...
    def set_device_budget(self, budget: int | None) -> None:
        """
        Keep the managed bytes on the device under `budget` (None or 0: no budget).
        """
    def set_disk_backup_chunk_bytes(self, nbytes: int) -> None: ...
    def set_disk_backup_dir(self, path: str | None) -> None:
        """
        Directory of this allocator's disk backups (None unsets it).
        """
    def set_lms_headroom(self, headroom: int | None) -> None:
        """
        Bytes kept free under the LMS limit by paging out ahead (0: off); None: limit / 32.
        """
    def set_lms_limit(self, limit: int) -> None:
        """
        Device memory held before inactive lms blocks are paged out (0: 95% of free plus held at the first lms allocation).
        """
    def set_lms_on_managed(self, managed: bool) -> None: ...
    def set_lms_prefetch_depth(self, depth: int) -> None: ...
    def set_lms_size(self, size: int) -> None:
        """
        lms blocks smaller than `size` bytes share segments, never paged out.
        """
    def set_lms_speculation(self, enabled: bool) -> None: ...
    def set_managed_limit(self, limit: int | None) -> None:
        """
        Refuse managed allocations past `limit` bytes (None: the default guard).
        """
    def snapshot(
        self,
        name: str,
        entries: collections.abc.Sequence[
            tuple[
                str,
                typing.SupportsInt | typing.SupportsIndex,
                typing.SupportsInt | typing.SupportsIndex,
                str,
            ]
        ],
        on_device: bool = False,
    ) -> int:
        """
        Copy the (name, address, bytes, layout) entries into a snapshot called `name`, replacing one of that name once the copies are done; returns the bytes copied.
        """
    def snapshot_tag(self, name: str, tag: str, on_device: bool = False) -> int:
        """
        Snapshot every live allocation of `tag`; returns the bytes copied.
        """
    def snapshots(self) -> list:
        """
        The snapshots of this device: name, bytes, held_bytes, entries, on_device, tag.
        """
    def stats(self) -> dict[str, int | float]: ...
    def tags(self) -> list[str]: ...
    def unpin(self, ptr: typing.SupportsInt | typing.SupportsIndex) -> bool: ...
    def unpin_all(
        self, ptrs: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]
    ) -> int:
        """
        Undo pin_all (blocks freed in between are skipped); returns how many were unpinned.
        """
    def wait_pin_ahead(
        self, timeout: typing.SupportsFloat | typing.SupportsIndex | None = None
    ) -> bool:
        """
        Wait until the host pool has pinned every backup buffer it expects (or gave up after a failure); False if `timeout` seconds passed first.
        """
    @property
    def device(self) -> int: ...
    @property
    def driver(self) -> Driver: ...

class SharedMapping:
    """
    Another process's shared tag, mapped here at addresses of this process's own.
    """
    def __init__(
        self, device: typing.SupportsInt | typing.SupportsIndex, driver: Driver = None
    ) -> None:
        """
        `driver`: the process driver when None (another for tests of one driver).
        """
    def add(
        self,
        size: typing.SupportsInt | typing.SupportsIndex,
        chunks: collections.abc.Sequence[
            tuple[
                typing.SupportsInt | typing.SupportsIndex,
                typing.SupportsInt | typing.SupportsIndex,
                typing.SupportsInt | typing.SupportsIndex,
            ]
        ],
    ) -> int:
        """
        Map one segment's chunks at a new address range; returns its base address.
        """
    def close(self) -> None: ...
    def remap(
        self,
        segments: collections.abc.Sequence[
            collections.abc.Sequence[
                tuple[
                    typing.SupportsInt | typing.SupportsIndex,
                    typing.SupportsInt | typing.SupportsIndex,
                    typing.SupportsInt | typing.SupportsIndex,
                ]
            ]
        ],
    ) -> None:
        """
        Map the owner's new memory at the same addresses.
        """
    def unmap(self) -> None:
        """
        Unmap every segment and release the imported memory; the addresses stay.
        """
    @property
    def bytes(self) -> int: ...
    @property
    def device(self) -> int: ...
    @property
    def mapped(self) -> bool: ...

class RegionState:
    """
    A thread's whole region state, saved to be put back later.
    """

class RelocationPlanner:
    """
    Which storages go out and come back in (Note [Relocating LMS]).
    """
    def __contains__(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> bool: ...
    def __init__(self, budget: typing.SupportsInt | typing.SupportsIndex) -> None: ...
    def add(
        self,
        id: typing.SupportsInt | typing.SupportsIndex,
        nbytes: typing.SupportsInt | typing.SupportsIndex,
        persistent: bool,
    ) -> None: ...
    def before_use(
        self, ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]
    ) -> typing.Any:
        """
        (page_out, page_in, prefetch) lists of ids, or None.
        """
    def bring_all_in(self) -> list[int]: ...
    def bring_in(
        self, ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]
    ) -> typing.Any:
        """
        Like before_use for a view: pages in, reads nothing.
        """
    def budget_at(self, position: typing.SupportsInt | typing.SupportsIndex) -> int: ...
    def cap_here(self, nbytes: typing.SupportsInt | typing.SupportsIndex) -> None: ...
    def coarsen(
        self, to: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]
    ) -> None:
        """
        After end_iteration: position p of the last iteration becomes to[p].
        """
    def counters(self) -> dict: ...
    def end_iteration(self) -> None: ...
    def evict_all(
        self, keep: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]
    ) -> list[int]: ...
    def is_out(self, id: typing.SupportsInt | typing.SupportsIndex) -> bool: ...
    def make_persistent(self, id: typing.SupportsInt | typing.SupportsIndex) -> None: ...
    def make_room(
        self,
        nbytes: typing.SupportsInt | typing.SupportsIndex,
        keep: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
    ) -> list[int]: ...
    def pageout_failed(self, id: typing.SupportsInt | typing.SupportsIndex) -> None: ...
    def prefetch_failed(self, id: typing.SupportsInt | typing.SupportsIndex) -> None: ...
    def remove(self, id: typing.SupportsInt | typing.SupportsIndex) -> bool: ...
    @property
    def budget(self) -> int: ...
    @budget.setter
    def budget(self, arg1: typing.SupportsInt | typing.SupportsIndex) -> None: ...
    @property
    def page_out_ahead(self) -> bool:
        """
        Note [Paging out ahead]: on by default; off, it forgets what it learned.
        """
    @page_out_ahead.setter
    def page_out_ahead(self, arg1: bool) -> None: ...
    @property
    def position(self) -> int: ...
    @property
    def prefetch_depth(self) -> int: ...
    @prefetch_depth.setter
    def prefetch_depth(self, arg1: typing.SupportsInt | typing.SupportsIndex) -> None: ...
    @property
    def registered_bytes(self) -> int: ...
    @property
    def resident_bytes(self) -> int: ...

class CopyDoneEvent:
    """
    The end of a batch of relocation copies (Note [Copies queued in one call]); stream arguments are raw handles (torch.cuda.Stream.cuda_stream).
    """
    def __init__(
        self, driver: Driver, device: typing.SupportsInt | typing.SupportsIndex
    ) -> None: ...
    def query(self) -> bool:
        """
        Whether the last record has completed; never blocks.
        """
    def record(self, stream: typing.SupportsInt | typing.SupportsIndex) -> None:
        """
        Completes after what `stream` has queued so far.
        """
    def synchronize(self) -> None: ...
    def wait(self, stream: typing.SupportsInt | typing.SupportsIndex) -> None:
        """
        Work queued on `stream` from now on runs after the last record.
        """
    @property
    def device(self) -> int: ...

def _set_exception_types(
    error: typing.Any,
    out_of_memory: typing.Any,
    cuda_error: typing.Any,
    invalid_argument: typing.Any,
    invalid_state: typing.Any,
) -> None: ...
def alias_capsule(
    ptr: typing.SupportsInt | typing.SupportsIndex,
    nbytes: typing.SupportsInt | typing.SupportsIndex,
    device_type: str,
    device_index: typing.SupportsInt | typing.SupportsIndex,
    owner: typing.Any,
) -> typing_extensions.CapsuleType:
    """
    A DLPack capsule of `nbytes` uint8 at `ptr` on ('cpu' | 'cuda', index) that keeps `owner` alive until the tensor made from it is freed.
    """

def allocators() -> list[Allocator]:
    """
    Process allocators created so far.
    """

def check_device(device: typing.SupportsInt | typing.SupportsIndex) -> None:
    """
    InvalidArgumentError unless the driver has `device`; makes no allocator.
    """

def check_flag(call: str, name: str, value: bool) -> bool:
    """
    `value` if it is True or False; else a TypeError naming `call` and `name`.
    """

def check_region(
    call: str,
    mode: str,
    tag: str,
    enable_cpu_backup: bool,
    preferred_location: str | None,
    accessed_by: str | None,
    read_mostly: bool,
) -> tuple[str, str, bool, str | None, str | None, bool]:
    """
    The region's arguments checked and in the form set_thread_region takes: (mode, tag, cpu_backup, preferred_location, accessed_by, read_mostly). Locations are None, 'cpu' or 'cuda:<index>'.
    """

def check_tag(call: str, tag: str) -> str:
    """
    `tag` if it is a tag (a non-empty string); else TypeError or InvalidArgumentError naming `call` (Note [Argument errors] in bindings/arguments.h).
    """

def check_whole_number(call: str, name: str, value: int, unit: str = "bytes") -> int:
    """
    `value` if it is a whole number from 0 to 2**64 - 1 counting `unit`; else TypeError or InvalidArgumentError naming `call` and `name`.
    """

def clear_thread_region() -> None:
    """
    The calling thread leaves every region (the global hook then uses its default).
    """

def default_backup_policy() -> tuple[bool, bool]:
    """
    (retain, pinned) of the policy new tags start with.
    """

def disk_backup_chunk_bytes() -> int: ...
def disk_backup_dir() -> str | None: ...
def enable_global_hook(default_mode: str) -> None:
    """
    Serve every allocation PyTorch makes from the block caches (after change_current_allocator); outside regions in `default_mode`.
    """

def get_allocator(device: typing.SupportsInt | typing.SupportsIndex) -> Allocator:
    """
    The process allocator of `device`, created on first use.
    """

def get_driver() -> Driver: ...
def get_pin_ahead() -> bool:
    """
    Whether backup buffers are pinned ahead (TUS_PIN_AHEAD until set_pin_ahead).
    """

def get_thread_region() -> tuple[str, str, bool, bool]:
    """
    (mode, tag, cpu_backup, inside a region) of the calling thread.
    """

def global_hook() -> str | None:
    """
    The default mode of the global hook, or None when it is not enabled.
    """

def install_driver(
    driver: Driver, chunk_bytes: typing.SupportsInt | typing.SupportsIndex = 268435456
) -> None:
    """
    Use `driver` for the process allocators (refused while they hold memory).
    """

def last_malloc_error() -> str:
    """
    Why the last allocation PyTorch asked of us on this thread failed ('' if none).
    """

def logged_count() -> int:
    """
    Failures reported on stderr so far (repeats of one kind, printed once, included).
    """

def managed_process_total() -> int:
    """
    Managed bytes allocated by every allocator of the process (the guard's total).
    """

def preload_hook() -> bool:
    """
    True when the preload library interposes cudaMalloc in this process.
    """

def queue_relocation_copies(
    driver: Driver,
    device: typing.SupportsInt | typing.SupportsIndex,
    stream: typing.SupportsInt | typing.SupportsIndex,
    handover: typing.SupportsInt | typing.SupportsIndex,
    after_streams: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
    after_events: collections.abc.Sequence[CopyDoneEvent],
    copies: collections.abc.Sequence[
        tuple[
            typing.SupportsInt | typing.SupportsIndex,
            typing.SupportsInt | typing.SupportsIndex,
            typing.SupportsInt | typing.SupportsIndex,
        ]
    ],
    to_host: bool,
) -> CopyDoneEvent:
    """
    Queues (device address, host address, bytes) copies on `stream` after `after_streams` (through the `handover` event) and the CopyDoneEvents `after_events`; returns a new CopyDoneEvent recorded after them (Note [Copies queued in one call]).
    """

def restore_thread_region(state: RegionState) -> None: ...
def save_thread_region() -> RegionState:
    """
    The calling thread's region state (restore_thread_region puts it back).
    """

def set_default_backup_policy(retain: bool, pinned: bool) -> None:
    """
    The backup policy new tags start with.
    """

def set_disk_backup_chunk_bytes(nbytes: int) -> None: ...
def set_disk_backup_dir(path: str | None) -> None:
    """
    Directory of every allocator's disk backups, now and later (None unsets it).
    """

def set_memory_margin(bytes: int) -> None:
    """
    Refuse hooked allocations that would leave less than `bytes` free on the device.
    """

def set_pin_ahead(enabled: bool) -> None:
    """
    Pin backup buffers ahead of the first pause, every allocator (Note [Pinning ahead] in host_buffer_pool.h).
    """

def set_thread_host_backup(backend: str | None) -> None:
    """
    Where the calling thread's backed allocations keep their backup: 'pinned', 'mmap' (pageable) or None (the tag's policy).
    """

def set_thread_region(
    mode: str,
    tag: str,
    cpu_backup: bool,
    preferred_location: str | None = None,
    accessed_by: str | None = None,
    read_mostly: bool = False,
) -> None:
    """
    Set the region the calling thread's allocations through PyTorch belong to.
    """

def stat_docs() -> list[tuple[str, str, str]]:
    """
    Every statistic as (key, kind, doc): kind 'gauge', 'counter' or 'timer' for the families kept per scope, 'device' for the keys kept once per device (allocator/stats/stat_list.h).
    """

FREE_SYMBOL: str = "tus_free"
HOOK_OUT_OF_MEMORY: str = "CUDA out of memory. torch_uvm_saver could not allocate"
MALLOC_SYMBOL: str = "tus_malloc"
USED_CAPSULE_NAME: str = "used_dltensor"
