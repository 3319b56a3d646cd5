"""Named weight snapshots: copies of a model's tensors, written back into the same tensors.

``snapshot("actor", model)`` copies the parameters and buffers into pooled pinned host memory at
the link's speed; ``restore("actor")`` writes them back into the very same tensors, at the same
addresses, so views, optimizers and captured CUDA graphs keep working; ``drop_snapshot("actor")``
gives the memory back. An RL trainer switches weights this way::

    tus.snapshot("ref", model)     # once
    tus.snapshot("actor", model)   # every step, after training
    tus.restore("ref")             # reference log-probs ...
    tus.restore("actor")           # ... and back

The mechanism (storage, copies, checks) is native: allocator/residency/snapshot_store.h has the
Notes on layout, replacing a snapshot, paused memory and what a failed restore leaves. This module
turns the caller's tensors into named spans and finds them again at restore.

Note [What a snapshot remembers]
    Per tensor: its name, address, bytes and layout (dtype, shape, strides), a weak reference to
    the tensor and one to its storage. A snapshot keeps nothing alive. At restore each tensor must
    still be where it was, with the same layout: a tensor that was freed, moved (``resize_``,
    ``.data =`` another tensor) or changed dtype or shape is refused before anything is written.
    When the tensor object itself is gone but its storage lives on, as with the detached tensors
    of ``model.state_dict()``, the storage is the tensor's memory, and the bytes go back into it.
    A module is looked up again by name at restore (its parameters and buffers as they are then),
    so a parameter replaced by a new tensor is found out instead of the stale one being written.
    A tag's snapshot holds the tag's segments, whole, and restore writes all of them back: memory
    of tensors allocated in those segments after the snapshot is overwritten too.

Note [Snapshots on the simulated driver]
    With the simulated driver (``TUS_DRIVER=sim``, and the tests) device memory is host memory, so
    a CPU tensor over it stands for a tensor of device 0: snapshots accept CPU tensors only then.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Union

import torch

from . import _C, _native
from .capture import refuse_during_capture
from .errors import InvalidArgumentError, InvalidStateError

__all__ = ["drop_snapshot", "list_snapshots", "restore", "snapshot"]

Source = Union[
    torch.nn.Module, Mapping[str, torch.Tensor], Sequence[torch.Tensor], torch.Tensor, str
]
# (name, address, bytes, layout), as the native side takes an entry
EntryTuple = tuple[str, int, int, str]


@dataclass
class _Entry:
    name: str
    tensor: weakref.ref  # dead for a state_dict()'s detached tensors: the storage then speaks
    storage: weakref.ref
    offset: int  # bytes from the storage's first byte to the entry's
    nbytes: int
    layout: str


@dataclass
class _Record:
    device: int
    entries: list[_Entry] = field(default_factory=list)
    module: weakref.ref | None = None
    tag: str | None = None


_records: dict[str, _Record] = {}
# One snapshot call at a time: a record and the native snapshot it describes change together.
_lock = threading.Lock()


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"a snapshot name is a non-empty string, got {name!r}")
    return name


def _layout(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} strides {tuple(t.stride())}"


def _span_bytes(name: str, t: torch.Tensor) -> int:
    """Bytes from the tensor's first element to the end of its last one."""
    if t.numel() == 0:
        return 0
    if t.is_contiguous():  # the common case, without the sum over dimensions
        return t.numel() * t.element_size()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    span = (last + 1) * t.element_size()
    if span > t.numel() * t.element_size():
        # Restore writes the whole span: the gaps are other tensors' elements.
        raise InvalidArgumentError(
            f"snapshot: {name!r} is a strided view with gaps between its elements "
            f"({_layout(t)}); snapshot the tensor it is a view of"
        )
    return span


def _device_of(name: str, t: torch.Tensor) -> int:
    if t.device.type == "cuda":
        return t.device.index if t.device.index is not None else _native.device_index(None)
    if t.device.type == "cpu" and _C.get_driver().name == "sim":
        return 0  # Note [Snapshots on the simulated driver]
    raise InvalidArgumentError(f"snapshot: {name!r} is on {t.device}; snapshots hold CUDA tensors")


def _module_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def _named_tensors(source: object) -> list[tuple[str, object]]:
    if isinstance(source, torch.nn.Module):
        return list(_module_tensors(source))
    if isinstance(source, torch.Tensor):
        return [("0", source)]
    if isinstance(source, Mapping):
        return [(str(key), value) for key, value in source.items()]
    if isinstance(source, (list, tuple)):
        return [(str(index), value) for index, value in enumerate(source)]
    raise InvalidArgumentError(
        "snapshot takes a module, a dict, list or tuple of tensors, a tensor or a tag, got "
        f"{type(source).__name__}"
    )


def _entry(name: str, t: object) -> _Entry:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"snapshot: {name!r} is a {type(t).__name__}, not a tensor")
    if t.layout != torch.strided:
        raise InvalidArgumentError(f"snapshot: {name!r} is a {t.layout} tensor; only dense ones")
    storage = t.untyped_storage()
    return _Entry(
        name=name,
        tensor=weakref.ref(t),
        storage=weakref.ref(storage),
        offset=t.data_ptr() - storage.data_ptr() if t.numel() else 0,
        nbytes=_span_bytes(name, t),
        layout=_layout(t),
    )


def _native_entry(entry: _Entry, t: torch.Tensor) -> EntryTuple:
    return (entry.name, t.data_ptr() if t.numel() else 0, _span_bytes(entry.name, t), _layout(t))


def snapshot(
    name: str, source: Source, *, on_device: bool = False, device: _native.DeviceLike = None
) -> int:
    """Copy tensors into a snapshot called ``name``; returns the bytes copied.

    Args:
        name: the snapshot's name. A snapshot of that name is replaced once the new one is
            complete (if taking the new one fails, the old one stays as it was).
        source: an ``nn.Module`` (its parameters and buffers, by name), a dict, list or tuple of
            CUDA tensors, one tensor, or a tag (every live allocation of ``tag``, segment by
            segment; Note [What a snapshot remembers]). The tensors must be on one device.
        on_device: keep the copy in device memory instead of pinned host memory, for a restore
            at device-to-device speed; ``OutOfMemoryError`` when the GPU has no room for it.
        device: for a tag held on several devices, which one.

    Memory of a paused tag is copied from its CPU backup, with no trip through the GPU. The
    device is synchronized first, as ``pause`` does, so work queued on any stream is done.

    Raises:
        InvalidArgumentError: a bad name or source, tensors on several devices or not on a GPU,
            a strided view with gaps, an unknown or empty tag.
        InvalidStateError: memory paused without a CPU backup (or to disk), or a CUDA graph
            capture is open.
        OutOfMemoryError: no host (or, with ``on_device``, device) memory for the copy.
    """
    refuse_during_capture("snapshot")
    _check_name(name)
    with _lock:
        if isinstance(source, str):
            index = _tag_device(name, source, device)
            taken = _native.allocator(index).snapshot_tag(name, source, bool(on_device))
            record = _Record(device=index, tag=source)
        else:
            named = _named_tensors(source)
            entries = [_entry(key, t) for key, t in named]
            devices = sorted({_device_of(key, t) for key, t in named})
            if len(devices) > 1:
                raise InvalidArgumentError(
                    f"snapshot({name!r}): the tensors are on devices {devices}; take one snapshot "
                    "per device"
                )
            index = devices[0] if devices else _native.device_index(device)
            if device is not None and _native.device_index(device) != index:
                raise InvalidArgumentError(
                    f"snapshot({name!r}): the tensors are on device {index}, not {device!r}"
                )
            native = [
                (entry.name, t.data_ptr() if t.numel() else 0, entry.nbytes, entry.layout)
                for entry, (_, t) in zip(entries, named)
            ]  # the span and layout _entry just worked out: one pass over the tensors
            taken = _native.allocator(index).snapshot(name, native, bool(on_device))
            module = weakref.ref(source) if isinstance(source, torch.nn.Module) else None
            record = _Record(device=index, entries=entries, module=module)
        previous = _records.get(name)
        if previous is not None and previous.device != record.device:
            _drop_quietly(previous.device, name)  # the name moved to another device
        _records[name] = record
        return taken


def _tag_device(name: str, tag: str, device: _native.DeviceLike) -> int:
    _C.check_tag("snapshot", tag)
    if device is not None:
        return _native.device_index(device)
    holders = [a.device for a in _native.allocators() if a.knows_tag(tag)]
    if len(holders) > 1:
        raise InvalidArgumentError(
            f"snapshot({name!r}, {tag!r}): the tag is on devices {holders}; pass device="
        )
    return holders[0] if holders else _native.device_index(None)


def _drop_quietly(device: int, name: str) -> None:
    allocator = _native.allocator(device)
    if any(info["name"] == name for info in allocator.snapshots()):
        allocator.drop_snapshot(name)


def _current_entries(name: str, record: _Record) -> list[EntryTuple]:
    """What the snapshot's tensors are now (Note [What a snapshot remembers])."""
    if record.module is not None:
        module = record.module()
        if module is None:
            raise InvalidStateError(f"restore({name!r}): the module was freed; nothing was written")
        tensors = dict(_module_tensors(module))
        current = []
        for entry in record.entries:
            t = tensors.get(entry.name)
            if t is None:
                raise InvalidStateError(
                    f"restore({name!r}): the module has no {entry.name!r} any more; nothing was "
                    "written"
                )
            current.append(_native_entry(entry, t))
        return current
    current = []
    for entry in record.entries:
        t = entry.tensor()
        if t is not None:
            current.append(_native_entry(entry, t))
            continue
        storage = entry.storage()
        if storage is None:
            raise InvalidStateError(
                f"restore({name!r}): {entry.name!r} was freed; nothing was written"
            )
        available = max(0, storage.nbytes() - entry.offset)
        start = storage.data_ptr() + entry.offset if entry.nbytes else 0
        current.append((entry.name, start, min(entry.nbytes, available), entry.layout))
    return current


def restore(name: str) -> int:
    """Write the snapshot ``name`` back into the tensors it was taken from; returns the bytes.

    The tensors keep their addresses, so views, optimizers holding them and CUDA graphs captured
    over them stay valid. Tensors of a paused tag get the bytes in their CPU backup, which the next
    ``resume`` brings in. The device is synchronized before the first write, and the bytes are
    visible to every stream when this returns.

    Raises:
        InvalidArgumentError: no snapshot of that name, or a tensor's shape, dtype or size changed.
        InvalidStateError: a tensor was freed or moved, memory is paused without a CPU backup, or
            a CUDA graph capture is open. Nothing was written.
        CudaError: a driver call failed. The message says which state the tensors are in:
            "nothing was written" (all old), "the restore was completed after this error" (all
            restored) or, if the driver failed every retry, a mix; the snapshot is kept in every
            case (allocator/residency/snapshot_store.h, Note [Restore atomicity]).
    """
    refuse_during_capture("restore")
    _check_name(name)
    with _lock:
        record = _records.get(name)
        if record is None:
            raise InvalidArgumentError(
                f"restore({name!r}): no snapshot of that name (snapshots: {_known()})"
            )
        allocator = _native.allocator(record.device)
        if record.tag is not None:
            return allocator.restore_snapshot(name)
        return allocator.restore_snapshot(name, _current_entries(name, record))


def drop_snapshot(name: str) -> int:
    """Give the snapshot's memory back (its pinned slabs go to the pool that
    ``release_host_cache()`` empties); returns the bytes it held."""
    _check_name(name)
    with _lock:
        record = _records.pop(name, None)
        if record is not None:
            return _native.allocator(record.device).drop_snapshot(name)
        for allocator in _native.allocators():
            if any(info["name"] == name for info in allocator.snapshots()):
                return allocator.drop_snapshot(name)
        raise InvalidArgumentError(
            f"drop_snapshot({name!r}): no snapshot of that name (snapshots: {_known()})"
        )


def list_snapshots(device: _native.DeviceLike = None) -> dict[str, dict[str, object]]:
    """The snapshots (of ``device``, or of every device), by name: ``device``, ``bytes`` (what
    it holds), ``held_bytes`` (host or device memory it keeps), ``tensors`` (for a tag's
    snapshot, its segments), ``on_device`` and ``tag`` (None unless a tag's)."""
    allocators = _native.allocators() if device is None else [_native.allocator(device)]
    out: dict[str, dict[str, object]] = {}
    for allocator in allocators:
        for info in allocator.snapshots():
            out[info["name"]] = {
                "device": allocator.device,
                "bytes": info["bytes"],
                "held_bytes": info["held_bytes"],
                "tensors": info["entries"],
                "on_device": info["on_device"],
                "tag": info["tag"],
            }
    return out


def _known() -> str:
    names = sorted(list_snapshots())
    return ", ".join(map(repr, names)) or "none"
