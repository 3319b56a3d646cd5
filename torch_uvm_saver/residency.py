"""Pause and resume: giving a tag's device memory back and taking it again.

``pause(tag)`` waits for all work queued on the device, copies the tag's memory that asked for a
CPU backup into pooled pinned host buffers, then unmaps and releases the physical memory. The
virtual addresses stay reserved, so every tensor keeps its ``data_ptr()``. ``resume(tag)`` maps
fresh memory at the same addresses and copies the backups back; it returns once the bytes are
visible to every stream. Both are idempotent per tag.

With ``set_backup_policy(tag, disk=True)`` the backups go to one file per segment under the
directory set with ``set_disk_backup_dir`` (or ``TUS_DISK_BACKUP_DIR`` / ``TMS_DISK_BACKUP_DIR``)
instead of host memory; only two small pinned staging buffers are used while pausing/resuming.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from . import _C, _native, sharing
from .capture import refuse_during_capture
from .errors import InvalidArgumentError

__all__ = [
    "get_cpu_backup",
    "get_disk_backup_chunk_bytes",
    "get_disk_backup_dir",
    "get_pin_ahead",
    "is_paused",
    "pause",
    "release_host_cache",
    "resume",
    "set_backup_policy",
    "set_disk_backup_chunk_bytes",
    "set_disk_backup_dir",
    "set_pin_ahead",
]

_policies: dict[str, tuple[bool, bool, bool]] = {}  # tag -> (retain, pinned, disk)
_policies_lock = threading.Lock()


def _owners(tag: str | None, call: str) -> list[_C.Allocator]:
    allocators = _native.allocators()
    if tag is None:
        return allocators
    _C.check_tag(call, tag)
    owners = [a for a in allocators if a.knows_tag(tag)]
    if not owners:
        known = sorted({t for a in allocators for t in a.tags()})
        raise InvalidArgumentError(
            f"{call}({tag!r}): unknown tag (known tags: {', '.join(map(repr, known)) or 'none'})"
        )
    return owners


def pause(tag: str | None = None) -> int:
    """Release the device memory of ``tag`` (every tag if None) on every device that has it.

    Returns the device bytes released. Pausing a paused tag does nothing and returns 0, and so
    does pausing a tag that holds no ``vmm`` memory (it does not turn paused). With no tag, the
    ``vmm`` memory of every tag pauses, the ``vmm`` part of a tag that mixes modes included;
    memory of other modes stays resident (Note [Pausing every tag] in allocator.h). A paused tag
    takes no new allocations until ``resume``, but for torch_memory_saver's callers (Note
    [Allocating in a paused tag] in allocator.h).

    Raises:
        InvalidArgumentError: unknown tag, or the named tag holds memory of a mode that cannot
            pause (``device``, ``managed``, ``lms``).
        InvalidStateError: a ``region`` of the tag is still open, or a CUDA graph capture is
            (Note [Pausing during capture] in capture.py).
        CudaError: a driver call failed; the message says whether the tag is partly paused.
            Nothing with a backup is lost; call ``pause`` or ``resume`` again.

    A tag shared with other processes (``share``) pauses once each attached process has
    unmapped it; one that lives but does not answer within the share's ``timeout_s`` fails the
    pause with ``InvalidStateError`` naming its process id, and nothing is paused.
    """
    refuse_during_capture("pause")
    owners = _owners(tag, "pause")
    with sharing.pausing(tag):  # processes attached to a shared tag unmap first
        return sum(allocator.pause(tag) for allocator in owners)


def resume(tag: str | None = None) -> int:
    """Map device memory again under ``tag`` (every tag if None), restoring backups.

    Returns the device bytes mapped. Resuming a tag that is not paused does nothing.

    Raises:
        OutOfMemoryError: (a ``torch.OutOfMemoryError``) not enough free device memory. Nothing
            was resumed and the backups are intact: free memory and call ``resume`` again.
        InvalidArgumentError: unknown tag.
    """
    refuse_during_capture("resume")
    resumed = sum(allocator.resume(tag) for allocator in _owners(tag, "resume"))
    sharing.resumed(tag)  # processes attached to a shared tag map the new memory
    return resumed


def is_paused(tag: str) -> bool:
    """True when ``tag`` is paused on any device."""
    _C.check_tag("is_paused", tag)
    return any(allocator.is_paused(tag) for allocator in _owners(tag, "is_paused"))


def set_backup_policy(
    tag: str, *, retain: bool = False, pinned: bool = True, disk: bool = False
) -> None:
    """How ``tag``'s CPU backups are kept (for memory allocated with ``enable_cpu_backup``).

    Args:
        retain: keep the host copy after ``resume`` (``get_cpu_backup`` can read it, and the next
            pause reuses the buffer). By default the buffer goes back to the pool at resume.
            With ``disk``: keep the file, rewritten in place by the next pause.
        pinned: back up into pooled pinned memory (full link speed; the pool keeps the memory
            for the next pause, ``release_host_cache()`` frees it). ``False`` uses pageable
            memory that goes back to the operating system at resume, at a lower copy speed.
        disk: back up into one file per segment under ``get_disk_backup_dir()`` instead of host
            memory (``pinned`` does not apply). ``pause`` raises before changing anything when
            no directory is set or it is not writable or full; a write error part way leaves the
            segment being written on the device. ``get_cpu_backup`` returns None for these.
    """
    tag = _C.check_tag("set_backup_policy", tag)
    policy = (
        _C.check_flag("set_backup_policy", "retain", retain),
        _C.check_flag("set_backup_policy", "pinned", pinned),
        _C.check_flag("set_backup_policy", "disk", disk),
    )
    with _policies_lock:
        _policies[tag] = policy
    for allocator in _native.allocators():
        apply_backup_policy(allocator, tag)


def apply_backup_policy(allocator: _C.Allocator, tag: str) -> None:
    with _policies_lock:
        policy = _policies.get(tag)
    if policy is not None:
        allocator.set_backup_policy(tag, retain=policy[0], pinned=policy[1], disk=policy[2])


def set_disk_backup_dir(path: str | os.PathLike[str] | None) -> None:
    """Directory for disk backups (``set_backup_policy(tag, disk=True)``), for every device of the
    process; ``None`` unsets it. It must exist and be writable (``InvalidArgumentError``
    otherwise). Files are named ``tus-<pid>-dev<device>-<address>.bin`` and removed at resume.
    The default comes from ``TUS_DISK_BACKUP_DIR``, else ``TMS_DISK_BACKUP_DIR``.
    """
    _C.set_disk_backup_dir(None if path is None else os.fspath(path))


def get_disk_backup_dir() -> str | None:
    """The disk-backup directory (absolute), or None when none is set."""
    return _C.disk_backup_dir()


def set_disk_backup_chunk_bytes(nbytes: int) -> None:
    """Size of each pinned staging buffer and IO request of disk backup (two are used); a multiple
    of 4 KiB up to 1 GiB. The default is 64 MiB, or ``TUS_DISK_BACKUP_CHUNK_MB`` /
    ``TMS_DISK_BACKUP_CHUNK_MB``."""
    _C.set_disk_backup_chunk_bytes(nbytes)


def get_disk_backup_chunk_bytes() -> int:
    """Size of each pinned staging buffer and IO request of disk backup."""
    return _C.disk_backup_chunk_bytes()


def release_host_cache() -> int:
    """Free the pooled pinned host buffers that no backup is using; returns the bytes freed.

    The host copies of LMS page-ins whose copies back to the device are done are freed too.

    Buffers pinned ahead of a first pause (``set_pin_ahead``) are freed too, and are not pinned
    again until the segment's next pause or resume.
    """
    return sum(allocator.release_host_cache() for allocator in _native.allocators())


def set_pin_ahead(enabled: bool) -> None:
    """Pin the host buffers of CPU backups in the background, ahead of the first pause.

    Pinning host memory is slow (about 3 s for 8 GiB on an H200), and without this the first
    ``pause`` of a tag with ``enable_cpu_backup=True`` pays for it; later pauses reuse the pooled
    buffers and run at the link's speed. With it (the default; ``TUS_PIN_AHEAD=0`` turns it off),
    allocating memory that backs up to pinned memory has a background thread pin a buffer of the
    same size, so a pause a few seconds after loading runs as fast as later ones. A pause that
    comes sooner waits at most for the buffer the thread is pinning and pins the rest itself,
    copying as it goes.

    This holds as much pinned host memory as the backed-up regions from allocation on, which
    their first pause would take anyway; ``release_host_cache()`` gives it back. Applies to every
    device, for memory allocated from then on. ``enabled`` must be a bool.
    """
    _C.set_pin_ahead(enabled)


def get_pin_ahead() -> bool:
    """Whether backup buffers are pinned ahead of the first pause (see ``set_pin_ahead``)."""
    return bool(_C.get_pin_ahead())


def _extent_bytes(tensor: torch.Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def get_cpu_backup(tensor: torch.Tensor) -> torch.Tensor | None:
    """A CPU copy of ``tensor``'s contents as held in its backup, or None if it has none.

    A backup exists while the tensor's tag is paused with ``enable_cpu_backup=True``, and after
    ``resume`` when the tag's policy retains it (``set_backup_policy(tag, retain=True)``).
    """
    _native.tensor(tensor, "get_cpu_backup", "tensor")
    if tensor.device.type != "cuda":
        raise InvalidArgumentError(f"get_cpu_backup expects a CUDA tensor, got {tensor.device}")
    owners = [a for a in _native.allocators() if a.device == tensor.device.index]
    if not owners:
        return None
    view = owners[0].backup_of(tensor.data_ptr())
    if view is None:
        return None
    host_address, available = view
    nbytes = _extent_bytes(tensor)
    if nbytes == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    if nbytes > available:
        return None
    raw = (ctypes.c_uint8 * nbytes).from_address(host_address)
    flat = torch.frombuffer(raw, dtype=torch.uint8, count=nbytes).view(tensor.dtype)
    return torch.as_strided(flat, tensor.shape, tensor.stride()).clone()
