"""Sharing a tag's device memory with other processes, pause-aware (Note [Sharing] in
allocator/sharing/shared_mapping.h).

    # the weight manager                          # each inference process
    with tus.region("weights"):                    attached = tus.attach("/tmp/weights.sock")
        model = build().cuda()                     model.load_state_dict(attached.state_dict(),
    share = tus.share("weights", model,                                  assign=True)
                      path="/tmp/weights.sock")

The attached process maps the same physical memory at addresses of its own: no copy, and no
device memory beyond the driver's bookkeeping. ``tus.pause(tag)`` in the owner first tells every
attached process to unmap and waits for each (the driver frees nothing while anyone maps it);
``tus.resume(tag)`` sends the new memory and each maps it at the addresses it had, so its tensors
stay valid. Between the two an attached process must not touch the tensors.

Note [Sharing protocol]
    One Unix SOCK_SEQPACKET connection per attached process; the owner speaks first and the
    attached process only answers. Messages start with a type byte: b"j" a JSON part with more to
    come, b"J" the last part, b"F" a batch of file descriptors (SCM_RIGHTS, at most 250 a
    message). The owner sends the layout (segments, chunks, tensors, how many descriptors
    follow) and the descriptors; the attached process answers "attached". Later the owner sends
    "unmap" (answer "unmapped") before a pause and "remap" with new descriptors (answer
    "remapped") after a resume, and "closed" when it stops sharing. A connection that reaches
    end of file belongs to a process that detached or died: it is dropped, since the driver
    unmapped a dead process's memory with it. One that stays silent past ``timeout_s`` while
    its process lives fails the pause with the process's id; the processes that had unmapped
    already map the memory again, so the pause changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from . import _C, _native
from .errors import InvalidArgumentError, InvalidStateError
from .managed import _alias

__all__ = ["Attachment", "Share", "attach", "share"]

_PART_BYTES = 60_000  # a SOCK_SEQPACKET message stays well under the default socket buffer
_FDS_PER_MESSAGE = 250  # the kernel takes at most 253 descriptors a message
_RECEIVE_BYTES = 65_536
_SHARES: dict[tuple[str, int], Share] = {}  # (tag, device) -> the share serving it
_SHARES_LOCK = threading.Lock()

# ------------------------------------------------------------------------------------------
# Messages


def _send(connection: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    parts = [data[i : i + _PART_BYTES] for i in range(0, len(data), _PART_BYTES)] or [b""]
    for index, part in enumerate(parts):
        connection.sendall((b"J" if index == len(parts) - 1 else b"j") + part)
    for start in range(0, len(fds), _FDS_PER_MESSAGE):
        socket.send_fds(connection, [b"F"], list(fds[start : start + _FDS_PER_MESSAGE]))


def _receive(connection: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The next message and its descriptors; None at end of file (the peer is gone)."""
    data = b""
    while True:
        part = connection.recv(_RECEIVE_BYTES)
        if not part:
            return None
        data += part[1:]
        if part[:1] == b"J":
            break
    message = json.loads(data)
    fds: list[int] = []
    try:
        while len(fds) < message.get("fd_count", 0):
            payload, received, _, _ = socket.recv_fds(connection, 16, _FDS_PER_MESSAGE)
            fds += received
            if not payload:
                return None
    except BaseException:
        _close_all(fds)
        raise
    return message, fds


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _peer_pid(connection: socket.socket) -> int:
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    return struct.unpack("3i", credentials)[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------------------------------
# The owner


class _Peer:
    __slots__ = ("connection", "pid", "sent", "unmapped")

    def __init__(self, connection: socket.socket, pid: int) -> None:
        self.connection = connection
        self.pid = pid
        self.unmapped = False
        self.sent = 0  # requests sent; an answer carries its request's number


class _NoAnswer(InvalidStateError):
    """An attached process that lives did not answer in time."""


class Share:
    """A tag served to other processes; made by :func:`share`. ``close()`` stops serving."""

    def __init__(
        self, tag: str, device: int, entries: list[dict[str, Any]], path: str, timeout_s: float
    ) -> None:
        self.tag = tag
        self.device = device
        self.path = path
        self.timeout_s = timeout_s
        self._entries = entries
        self._peers: list[_Peer] = []
        self._lock = threading.RLock()  # the peers and every exchange with them
        self._closed = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(path)
        self._listener.listen(16)
        self._thread = threading.Thread(target=self._accept, name=f"tus-share-{tag}", daemon=True)
        self._thread.start()

    @property
    def attached(self) -> list[int]:
        """The process ids attached now (as of the last exchange with each)."""
        with self._lock:
            return [peer.pid for peer in self._peers]

    def _exported(self) -> tuple[list[dict[str, Any]], list[int]]:
        segments, fds = [], []
        for _, size, chunks in _native.allocator(self.device).export_tag(self.tag):
            segments.append({"size": size, "chunks": [[o, s] for o, s, _ in chunks]})
            fds += [fd for _, _, fd in chunks]
        return segments, fds

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                self._welcome(connection)
            except Exception:  # one failed attach must not stop the server
                connection.close()

    def _welcome(self, connection: socket.socket) -> None:
        connection.settimeout(self.timeout_s)
        with self._lock:
            if self._closed:
                connection.close()
                return
            try:
                segments, fds = self._exported()
            except (InvalidStateError, InvalidArgumentError) as error:
                _send(connection, {"type": "error", "message": str(error)})
                connection.close()
                return
            try:
                layout = {"type": "layout", "tag": self.tag, "device": self.device}
                layout.update(segments=segments, tensors=self._entries, fd_count=len(fds))
                _send(connection, layout, fds)
            finally:
                _close_all(fds)
            answer = _receive(connection)
            if answer is None or answer[0].get("type") != "attached":
                connection.close()
                return
            self._peers.append(_Peer(connection, _peer_pid(connection)))

    def _ask(self, peer: _Peer, message: dict[str, Any], expected: str, fds: list[int] = ()):
        """Sends and waits for the answer: True when given, False when the peer is gone.

        Raises _NoAnswer when the peer's process lives but did not answer in time (its late
        answer is skipped by its number at the next exchange), InvalidStateError when it
        answered with an error."""
        peer.sent += 1
        message = dict(message, seq=peer.sent)
        try:
            _send(peer.connection, message, fds)
            answer = _receive(peer.connection)
            while answer is not None and answer[0].get("seq") != peer.sent:
                answer = _receive(peer.connection)  # a late answer to an earlier request
        except (BrokenPipeError, ConnectionResetError):
            answer = None
        except (socket.timeout, TimeoutError):
            if _alive(peer.pid):
                raise _NoAnswer(
                    f"share({self.tag!r}): attached process {peer.pid} did not answer "
                    f"{message['type']!r} within {self.timeout_s} s; it still maps the tag"
                ) from None
            answer = None
        if answer is None:
            return False
        if answer[0].get("type") != expected:
            raise InvalidStateError(
                f"share({self.tag!r}): attached process {peer.pid} could not "
                f"{message['type']}: {answer[0].get('message', answer[0])}"
            )
        return True

    def _drop(self, gone: list[_Peer]) -> None:
        for peer in gone:
            peer.connection.close()
            self._peers.remove(peer)

    def before_pause(self) -> None:
        """Every attached process unmaps, or none stays unmapped and this raises."""
        with self._lock:
            gone, done, asked = [], [], None
            try:
                for peer in self._peers:
                    if peer.unmapped:
                        continue
                    asked = peer
                    if self._ask(peer, {"type": "unmap"}, "unmapped"):
                        peer.unmapped = True
                        done.append(peer)
                    else:
                        gone.append(peer)
            except BaseException:
                self._drop(gone)
                # The pause does not happen: the ones that unmapped map the memory again (one
                # that cannot stays marked unmapped, and the next resume maps it), and the one
                # that failed to answer is sent the same, to map again right after its late
                # unmap. The pause's own error is the one raised.
                with contextlib.suppress(InvalidStateError):
                    self._remap(done)
                if asked is not None:
                    self._remap_unanswered(asked)
                raise
            self._drop(gone)

    def after_resume(self) -> None:
        """Every attached process that unmapped maps the new memory at its old addresses."""
        with self._lock:
            self._remap([peer for peer in self._peers if peer.unmapped])

    def _remap_message(self) -> tuple[dict[str, Any], list[int]]:
        """The "remap" request for the tag's memory as it is now, and its descriptors."""
        segments, fds = self._exported()
        return {"type": "remap", "segments": segments, "fd_count": len(fds)}, fds

    def _remap(self, peers: list[_Peer]) -> None:
        """Each of `peers` maps the tag's memory as it is now."""
        if not peers:
            return
        message, fds = self._remap_message()
        gone, failures = [], []
        try:
            for peer in peers:
                try:
                    if self._ask(peer, message, "remapped", fds):
                        peer.unmapped = False
                    else:
                        gone.append(peer)
                except InvalidStateError as error:
                    failures.append(str(error))
        finally:
            _close_all(fds)
        self._drop(gone)
        if failures:
            raise InvalidStateError("; ".join(failures))

    def _remap_unanswered(self, peer: _Peer) -> None:
        """Queues a remap for a peer that did not answer its unmap, without waiting for it: it
        reads both once it runs again (Attachment._serve cancels the pair)."""
        message, fds = self._remap_message()
        peer.sent += 1
        try:
            with contextlib.suppress(OSError):
                _send(peer.connection, dict(message, seq=peer.sent), fds)
        finally:
            _close_all(fds)

    def close(self) -> None:
        """Stop serving: no new attachments; attached processes keep what they map."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for peer in self._peers:
                with contextlib.suppress(OSError):
                    _send(peer.connection, {"type": "closed"})
                peer.connection.close()
            self._peers.clear()
        self._listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with _SHARES_LOCK:
            if _SHARES.get((self.tag, self.device)) is self:
                del _SHARES[(self.tag, self.device)]

    def __enter__(self) -> Share:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _tensor_entries(
    tensors: Mapping[str, torch.Tensor], segments: list[tuple[int, int, Any]], tag: str
) -> list[dict[str, Any]]:
    entries = []
    for name, tensor in tensors.items():
        _native.tensor(tensor, "share", f"tensors[{name!r}]")
        storage = tensor.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        index = next(
            (
                i
                for i, (base, size, _) in enumerate(segments)
                if base <= ptr <= base + size - nbytes
            ),
            None,
        )
        if index is None:
            raise InvalidArgumentError(
                f"share({tag!r}): tensor {name!r} is not memory of the tag (allocate it inside "
                f"tus.region({tag!r}))"
            )
        entries.append(
            {
                "name": name,
                "segment": index,
                "offset": ptr - segments[index][0],
                "nbytes": nbytes,
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "stride": list(tensor.stride()),
                "storage_offset": tensor.storage_offset(),
            }
        )
    return entries


def share(
    tag: str,
    tensors: Mapping[str, torch.Tensor] | torch.nn.Module | None = None,
    *,
    path: str | None = None,
    device: _native.DeviceLike = None,
    timeout_s: float = 10.0,
) -> Share:
    """Serve ``tag``'s memory on ``device`` to other processes over a Unix socket at ``path``.

    Args:
        tensors: what attached processes get by name: a state dict, a module (its
            ``state_dict()``), or None (each segment of the tag as a uint8 tensor
            ``"segment.<i>"``). Every tensor must be memory of ``tag``.
        path: the socket's path (default: a fresh one in the temporary directory; read it from
            ``.path``). Must not exist.
        timeout_s: how long a pause waits for each attached process to unmap.

    Raises:
        InvalidArgumentError: unknown tag, memory of a mode other than ``vmm``, a tensor outside
            the tag, a path that exists.
        InvalidStateError: the tag is paused, or already shared on this device.
    """
    _C.check_tag("share", tag)
    index = _native.device_index(device)
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise InvalidArgumentError(f"share: timeout_s must be a positive number, got {timeout_s!r}")
    if isinstance(tensors, torch.nn.Module):
        tensors = tensors.state_dict(keep_vars=False)
    segments = _native.allocator(index).export_tag(tag)  # checks tag, mode and pause
    _close_all([fd for _, _, chunks in segments for _, _, fd in chunks])
    if tensors is None:
        entries = [
            {
                "name": f"segment.{i}",
                "segment": i,
                "offset": 0,
                "nbytes": size,
                "dtype": "uint8",
                "shape": [size],
                "stride": [1],
                "storage_offset": 0,
            }
            for i, (_, size, _) in enumerate(segments)
        ]
    else:
        entries = _tensor_entries(tensors, segments, tag)
    if path is None:
        path = os.path.join(tempfile.gettempdir(), f"tus-share-{os.getpid()}-{time.time_ns()}.sock")
    if os.path.exists(path):
        raise InvalidArgumentError(f"share({tag!r}): {path} exists; choose another path")
    with _SHARES_LOCK:
        if (tag, index) in _SHARES:
            raise InvalidStateError(
                f"share({tag!r}): already shared at {_SHARES[(tag, index)].path}"
            )
        served = _SHARES[(tag, index)] = Share(tag, index, entries, path, float(timeout_s))
    return served


def _shares_of(tag: str | None) -> list[Share]:
    """The shares of `tag` on every device (of every tag if None)."""
    with _SHARES_LOCK:
        return [served for (name, _), served in _SHARES.items() if tag is None or name == tag]


@contextlib.contextmanager
def pausing(tag: str | None) -> Iterator[None]:
    """Around an owner's pause of ``tag`` (None: every tag): attached processes unmap first;
    if the pause then fails, they map the memory again."""
    shares = _shares_of(tag)
    done = []
    try:
        for served in shares:
            served.before_pause()
            done.append(served)
        yield
    except BaseException:
        for served in done:
            if not _native.allocator(served.device).is_paused(served.tag):
                with contextlib.suppress(InvalidStateError):
                    served.after_resume()
        raise


def resumed(tag: str | None) -> None:
    """After an owner's resume of ``tag`` (None: every tag): attached processes map again."""
    for served in _shares_of(tag):
        if not _native.allocator(served.device).is_paused(served.tag):
            served.after_resume()


# ------------------------------------------------------------------------------------------
# The attached process


class Attachment:
    """Another process's shared tag, mapped here; made by :func:`attach`."""

    def __init__(self, connection: socket.socket, layout: dict[str, Any], fds: list[int]) -> None:
        self.tag: str = layout["tag"]
        self.device: int = layout["device"]
        self._connection = connection
        self._mapping = _C.SharedMapping(self.device)
        self._bases: list[int] = []
        try:
            start = 0
            for segment in layout["segments"]:
                chunks = segment["chunks"]
                with_fds = [(o, s, fds[start + i]) for i, (o, s) in enumerate(chunks)]
                start += len(chunks)
                self._bases.append(self._mapping.add(segment["size"], with_fds))
        except BaseException:
            self._mapping.close()
            raise
        finally:
            _close_all(fds)
        self._tensors = self._build(layout["tensors"])
        self._closed = False
        self._thread = threading.Thread(
            target=self._serve, name=f"tus-attached-{self.tag}", daemon=True
        )
        self._thread.start()

    def _build(self, entries: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        on_cuda = _C.get_driver().name == "cuda"
        where = torch.device("cuda", self.device) if on_cuda else torch.device("cpu")
        storages: dict[tuple[int, int, int], torch.Tensor] = {}
        tensors = {}
        for entry in entries:
            key = (entry["segment"], entry["offset"], entry["nbytes"])
            if key not in storages:
                ptr = self._bases[entry["segment"]] + entry["offset"]
                storages[key] = _alias(self._mapping, ptr, entry["nbytes"], where)
            dtype = getattr(torch, entry["dtype"])
            flat = storages[key].view(dtype)
            tensors[entry["name"]] = flat.as_strided(
                entry["shape"], entry["stride"], entry["storage_offset"]
            )
        return tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The shared tensors by name (for ``load_state_dict(..., assign=True)``)."""
        return dict(self._tensors)

    @property
    def mapped(self) -> bool:
        """False while the owner's tag is paused: the tensors must not be touched then."""
        return self._mapping.mapped

    @property
    def bytes(self) -> int:
        return self._mapping.bytes

    def _serve(self) -> None:
        connection = self._connection
        connection.settimeout(None)
        pending = None  # a message read ahead while answering an "unmap"
        while True:
            if pending is not None:
                received, pending = pending, None
            else:
                try:
                    received = _receive(connection)
                except OSError:
                    return
            if received is None:
                return  # the owner is gone; the memory stays mapped while we hold it
            message, fds = received
            kind, seq = message.get("type"), message.get("seq")
            try:
                if kind == "unmap":
                    pending = self._read_ahead(connection)
                    if pending is not None and pending[0].get("type") == "remap":
                        # An unmap answered late, after the owner's pause failed, is followed by
                        # that failure's remap of the same memory: the two cancel, and the
                        # tensors never lose their memory.
                        _send(connection, {"type": "unmapped", "seq": seq})
                        remap, remap_fds = pending
                        pending = None
                        _close_all(remap_fds)
                        _send(connection, {"type": "remapped", "seq": remap.get("seq")})
                        continue
                    if _C.get_driver().name == "cuda":
                        torch.cuda.synchronize(self.device)  # our kernels are done with it
                    self._mapping.unmap()
                    _send(connection, {"type": "unmapped", "seq": seq})
                elif kind == "remap":
                    start, segments = 0, []
                    for segment in message["segments"]:
                        chunks = segment["chunks"]
                        segments.append([(o, s, fds[start + i]) for i, (o, s) in enumerate(chunks)])
                        start += len(chunks)
                    self._mapping.remap(segments)
                    _send(connection, {"type": "remapped", "seq": seq})
                elif kind == "closed":
                    return
            except Exception as error:  # the owner gets the reason
                with contextlib.suppress(OSError):
                    _send(connection, {"type": "error", "message": str(error), "seq": seq})
            finally:
                _close_all(fds)

    @staticmethod
    def _read_ahead(connection: socket.socket):
        """The next message if one has arrived already (else None), without waiting for one."""
        try:
            connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return None
        return _receive(connection)

    def close(self) -> None:
        """Detach: unmap the owner's memory and stop answering it. The tensors must not be
        used afterwards."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._connection.shutdown(socket.SHUT_RDWR)
        self._connection.close()
        self._thread.join(timeout=5)
        self._mapping.close()

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def attach(path: str, *, timeout_s: float = 30.0) -> Attachment:
    """Map the tag another process serves at ``path`` (see :func:`share`).

    Raises:
        InvalidArgumentError: nothing serves at ``path``.
        InvalidStateError: the owner refused (its tag is paused, say) or did not answer within
            ``timeout_s``.
    """
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.settimeout(timeout_s)
    try:
        connection.connect(path)
    except (FileNotFoundError, ConnectionRefusedError) as error:
        connection.close()
        raise InvalidArgumentError(f"attach: nothing serves at {path} ({error})") from None
    try:
        received = _receive(connection)
    except (socket.timeout, TimeoutError):
        connection.close()
        raise InvalidStateError(f"attach: {path} did not answer within {timeout_s} s") from None
    if received is None or received[0].get("type") != "layout":
        connection.close()
        why = received[0].get("message") if received else "it closed the connection"
        raise InvalidStateError(f"attach: the owner at {path} refused: {why}")
    layout, fds = received
    attachment = Attachment(connection, layout, fds)
    _send(connection, {"type": "attached"})
    return attachment
