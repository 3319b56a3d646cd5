"""Memory statistics, with PyTorch's key names where the meaning is the same.

Keys are ``<name>.<scope>.<field>`` for gauges (fields ``current``, ``peak``, ``allocated``,
``freed``) and ``<name>.<scope>`` for counters and timers; the scope is ``all``, a mode (``vmm``,
``device``, ``managed``) or ``tag:<tag>``. ``allocated_bytes == active_bytes + paused_bytes`` in
every scope: allocated memory is either resident on the device or paused. ``reserved_bytes`` is the
device memory held from the driver. Byte counts are rounded to the driver's granularity (2 MiB on
NVIDIA GPUs). The host pool keys (``host_pool_bytes.current``, ``host_pool_cached_bytes.current``,
``host_pool_hits``, ``host_pool_misses``, ``host_pool_waits``) describe the pinned buffers kept
for backups; ``host_pinned_ahead_bytes``, ``host_pin_ahead_failures`` and
``host_pin_ahead_pending_bytes.current`` the ones pinned ahead of a first pause (``set_pin_ahead``),
and the counters ``pause_buffer_hits`` / ``pause_buffer_misses`` how many buffers each scope's
pauses found ready or had to pin themselves.

Managed memory adds ``managed_bytes``, ``managed_device_bytes``, ``managed_peer_bytes`` and
``managed_host_bytes`` (where our prefetches last placed it: this device, another GPU, the host; its
``reserved_bytes`` are the ones on this device),
``prefetch_to_{device,host}_{bytes,seconds}`` (seconds of device time, from CUDA events),
``num_prefetch_skipped``, ``num_budget_evictions``, ``budget_eviction_bytes`` and
``num_managed_refusals``. The global hook mode adds ``block_bytes`` (tensors handed to PyTorch;
``allocated_bytes`` are the segments they are cut from), ``num_block_cache_misses``,
``num_alloc_retries``, ``block_cache_free_bytes.current`` and
``block_cache_pending_bytes.current``.

Named weight snapshots (snapshots.py) add, per device: ``snapshot_count``, ``snapshot_bytes``
(pinned host memory the snapshots hold, also counted in ``host_pool_bytes.current``),
``snapshot_device_bytes`` (plain device memory of ``on_device`` snapshots, outside the
``allocated_bytes`` and ``reserved_bytes`` families), the counters ``num_snapshots``,
``num_snapshot_restores``, ``num_snapshot_restore_faults`` (driver errors during restores),
``num_snapshot_free_failures``, ``snapshot_taken_bytes``, ``snapshot_restored_bytes``,
``snapshot_from_backup_bytes`` / ``snapshot_into_backup_bytes`` (read from and written to the CPU
backups of paused tags), and the timers ``snapshot_seconds`` and ``snapshot_restore_seconds``.

``stat_docs()`` lists every one of them with a line of documentation, from the same list the
native core builds the dict from (allocator/stats/stat_list.h).
"""

from __future__ import annotations

from typing import Union

from . import _native
from ._load import _C

__all__ = [
    "format_bytes",
    "memory_stats",
    "memory_summary",
    "reset_peak_memory_stats",
    "stat_docs",
]

StatValue = Union[int, float]


def memory_stats(device: _native.DeviceLike = None) -> dict[str, StatValue]:
    """All statistics of ``device`` (default: the current device), sorted by key."""
    return dict(sorted(_native.allocator(device).stats().items()))


def stat_docs() -> dict[str, tuple[str, str]]:
    """Every statistic: ``{key: (kind, doc)}``. For ``kind`` ``"gauge"`` the key is a family
    (``<key>.<scope>.current|peak|allocated|freed`` in ``memory_stats()``), for ``"counter"``
    and ``"timer"`` too (``<key>.<scope>``); ``"device"`` keys appear as they are, once per
    device."""
    return {key: (kind, doc) for key, kind, doc in _C.stat_docs()}


def reset_peak_memory_stats(device: _native.DeviceLike = None) -> None:
    """Set every ``peak`` to its ``current`` value."""
    _native.allocator(device).reset_peak()


def format_bytes(count: float) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"


_COLUMNS = (
    ("allocated", "allocated_bytes", "current"),
    ("peak", "allocated_bytes", "peak"),
    ("active", "active_bytes", "current"),
    ("paused", "paused_bytes", "current"),
    ("cpu backup", "cpu_backup_bytes", "current"),
    ("managed gpu", "managed_device_bytes", "current"),
    ("managed cpu", "managed_host_bytes", "current"),
)


def memory_summary(device: _native.DeviceLike = None) -> str:
    """A readable table of ``memory_stats(device)``: one row per scope (all, modes, tags)."""
    allocator = _native.allocator(device)
    stats = allocator.stats()
    scopes = ["all", *_native.MODES]
    # Tags are any string, dots included: the scope is everything between the family and field.
    scopes += sorted(
        key[len("segment.") : -len(".current")]
        for key in stats
        if key.startswith("segment.tag:") and key.endswith(".current")
    )
    # Two narrow tables rather than one wide one: a terminal of 100 columns shows both (unless a
    # tag is longer than 15 characters: tags are shown whole).
    width = max(16, *(len(scope) + 1 for scope in scopes))
    bytes_header = f"{'scope':<{width}}" + "".join(f"{title:>12}" for title, _, _ in _COLUMNS)
    activity_header = f"{'scope':<{width}}{'segments':>10}{'pauses':>8}{'resumes':>8}"
    activity_header += f"{'pause s':>10}{'resume s':>10}"
    lines = [
        f"torch_uvm_saver memory summary, device {allocator.device} "
        f"(driver: {allocator.driver.name})",
        bytes_header,
        "-" * len(bytes_header),
    ]
    for scope in scopes:
        row = f"{scope:<{width}}"
        row += "".join(
            f"{format_bytes(stats[f'{name}.{scope}.{field}']):>12}" for _, name, field in _COLUMNS
        )
        lines.append(row)
    lines += ["", activity_header, "-" * len(activity_header)]
    for scope in scopes:
        lines.append(
            f"{scope:<{width}}{stats[f'segment.{scope}.current']:>10}"
            f"{stats[f'num_pauses.{scope}']:>8}{stats[f'num_resumes.{scope}']:>8}"
            f"{stats[f'pause_seconds.{scope}']:>10.3f}{stats[f'resume_seconds.{scope}']:>10.3f}"
        )
    lines.append(
        f"host pool: {format_bytes(stats['host_pool_bytes.current'])} pinned "
        f"({format_bytes(stats['host_pool_cached_bytes.current'])} idle), "
        f"{stats['host_pool_hits']} reuses, {stats['host_pool_misses']} new buffers, "
        f"{format_bytes(stats['host_pinned_ahead_bytes'])} pinned ahead"
    )
    if stats["managed_bytes.all.current"] or stats["prefetch_to_host_bytes.all"]:
        budget = stats["device_budget_bytes"]
        lines.append(
            f"managed: {format_bytes(stats['prefetch_to_device_bytes.all'])} prefetched to the "
            f"GPU in {stats['prefetch_to_device_seconds.all']:.3f} s, "
            f"{format_bytes(stats['prefetch_to_host_bytes.all'])} to the host in "
            f"{stats['prefetch_to_host_seconds.all']:.3f} s; budget "
            f"{format_bytes(budget) if budget else 'none'}, "
            f"{stats['num_budget_evictions.all']} evictions"
        )
    if stats["snapshot_count"]:
        lines.append(
            f"snapshots: {stats['snapshot_count']}, holding "
            f"{format_bytes(stats['snapshot_bytes'])} of host and "
            f"{format_bytes(stats['snapshot_device_bytes'])} of device memory"
        )
    if stats["block_bytes.all.current"] or stats["num_block_cache_misses.all"]:
        lines.append(
            f"global cache: {format_bytes(stats['block_bytes.all.current'])} in tensors, "
            f"{format_bytes(stats['block_cache_free_bytes.current'])} free in the cache, "
            f"{stats['num_block_cache_misses.all']} new segments"
        )
    try:
        free, total = allocator.mem_get_info()
        lines.append(f"device: {format_bytes(free)} free of {format_bytes(total)}")
    except Exception as error:  # the summary must not fail because the driver is absent
        lines.append(f"device: free memory unknown ({error})")
    return "\n".join(lines)
