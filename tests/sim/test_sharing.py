"""Sharing a tag with other processes (torch_uvm_saver/sharing.py, Note [Sharing]) on the
simulated driver, whose physical memory is a memfd another process can map: an attached process
sees and writes the owner's bytes, unmaps before the owner's pause and maps the new memory at its
old addresses after the resume; a killed one does not block the pause, a stopped one fails it
with its process id and nothing changes."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import torch_uvm_saver as tus
from torch_uvm_saver import _C
from torch_uvm_saver.errors import InvalidArgumentError, InvalidStateError

MiB = 1 << 20

# The attached process: attaches, then obeys one command a line on stdin and answers on stdout.
CHILD = textwrap.dedent(
    """
    import sys
    import torch_uvm_saver as tus

    attached = tus.attach(sys.argv[1])
    tensor = attached.state_dict()["segment.0"]
    print("attached", tensor.data_ptr(), attached.bytes, flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[0] == "read":
            print("read", int(tensor[int(command[1])]), attached.mapped, flush=True)
        elif command[0] == "write":
            tensor[int(command[1])] = int(command[2])
            print("wrote", flush=True)
        elif command[0] == "mapped":
            print("mapped", attached.mapped, flush=True)
        elif command[0] == "close":
            attached.close()
            print("closed", flush=True)
            break
    """
)


class Child:
    def __init__(self, path: str) -> None:
        env = dict(os.environ, TUS_DRIVER="sim", TUS_SIM_CAPACITY=str(256 * MiB))
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD, path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.pid = self.process.pid
        words = self.readline().split()
        assert words[0] == "attached", words
        self.address, self.bytes = int(words[1]), int(words[2])

    def readline(self) -> str:
        line = self.process.stdout.readline()
        assert line, f"the attached process ended (exit status {self.process.poll()})"
        return line

    def ask(self, command: str) -> list[str]:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.readline().split()

    def close(self) -> None:
        if self.process.poll() is None:
            self.ask("close")
            self.process.wait(timeout=30)


def stop(pid: int) -> None:
    """SIGSTOP, returning once the process is stopped (the signal is delivered asynchronously:
    a process still running could answer one more message)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.001)


def fill(ptr: int, value: int, size: int) -> None:
    ctypes.memset(ptr, value, size)


def byte_at(ptr: int) -> int:
    return ctypes.c_uint8.from_address(ptr).value


@pytest.fixture
def shared(process, tmp_path, slowdown):
    """An 8 MiB tag "w" with backup, filled with 7, served at a socket under tmp_path."""
    driver, allocator = process
    ptr = allocator.malloc(8 * MiB, tag="w", cpu_backup=True)
    fill(ptr, 7, 8 * MiB)
    served = tus.share("w", path=str(tmp_path / "w.sock"), timeout_s=2.0 * slowdown)
    yield driver, allocator, ptr, served
    served.close()
    if allocator.is_paused("w"):
        allocator.resume("w")


def test_an_attached_process_reads_and_writes_the_owners_bytes(shared) -> None:
    _, _, ptr, served = shared
    child = Child(served.path)
    try:
        assert child.bytes == 8 * MiB and child.address != 0
        assert child.ask("read 12345") == ["read", "7", "True"]
        assert child.ask("write 12345 9") == ["wrote"]
        assert byte_at(ptr + 12345) == 9  # the same memory, not a copy
        assert served.attached == [child.pid]
    finally:
        child.close()


def test_pause_waits_for_the_attached_process_and_resume_maps_it_again(shared) -> None:
    _, allocator, ptr, served = shared
    child = Child(served.path)
    try:
        assert tus.pause("w") == 8 * MiB
        assert allocator.is_paused("w")
        assert child.ask("mapped") == ["mapped", "False"]  # it unmapped before the release
        assert tus.resume("w") == 8 * MiB
        assert child.ask("read 100") == ["read", "7", "True"]  # restored from the backup
        assert child.ask("write 100 5") == ["wrote"]
        assert byte_at(ptr + 100) == 5  # mapped at its old address, sharing the new memory
    finally:
        child.close()


def test_a_killed_attached_process_does_not_hold_up_the_pause(shared) -> None:
    _, allocator, _, served = shared
    assert not allocator.is_paused("w")
    child = Child(served.path)
    child.process.kill()
    child.process.wait(timeout=30)
    start = time.monotonic()
    assert tus.pause("w") == 8 * MiB
    assert time.monotonic() - start < served.timeout_s  # end of file, no timeout
    assert served.attached == []
    tus.resume("w")


def test_a_silent_attached_process_fails_the_pause_with_its_pid_and_nothing_changes(
    shared,
) -> None:
    _, allocator, ptr, served = shared
    answering = Child(served.path)
    silent = Child(served.path)
    stop(silent.pid)
    try:
        with pytest.raises(
            InvalidStateError, match=f"attached process {silent.pid} did not answer"
        ):
            tus.pause("w")
        assert not allocator.is_paused("w")
        # The one that had unmapped maps the memory again: it still sees the owner's bytes.
        assert answering.ask("read 7") == ["read", "7", "True"]
        assert byte_at(ptr + 7) == 7
    finally:
        os.kill(silent.pid, signal.SIGCONT)
    time.sleep(0.2)
    # Continued, the silent one unmaps late, then maps again: it reads the bytes too.
    assert silent.ask("read 7") == ["read", "7", "True"]
    assert tus.pause("w") == 8 * MiB  # both answer this time
    assert [answering.ask("mapped"), silent.ask("mapped")] == [["mapped", "False"]] * 2
    tus.resume("w")
    assert silent.ask("read 8") == ["read", "7", "True"]
    for child in (answering, silent):
        child.close()


def test_attaching_to_a_paused_tag_is_refused_with_the_reason(shared) -> None:
    _, _, _, served = shared
    tus.pause("w")
    with pytest.raises(InvalidStateError, match="paused"):
        tus.attach(served.path)


def test_bad_shares_are_refused(process, tmp_path) -> None:
    _, allocator = process
    with pytest.raises(InvalidArgumentError, match="unknown tag"):
        tus.share("nothing", path=str(tmp_path / "a.sock"))
    allocator.malloc(2 * MiB, tag="m", mode="managed")
    with pytest.raises(InvalidArgumentError, match="only vmm memory can be shared"):
        tus.share("m", path=str(tmp_path / "b.sock"))
    allocator.malloc(2 * MiB, tag="w")
    (tmp_path / "taken.sock").touch()
    with pytest.raises(InvalidArgumentError, match="exists"):
        tus.share("w", path=str(tmp_path / "taken.sock"))
    with pytest.raises(InvalidArgumentError, match="timeout_s"):
        tus.share("w", timeout_s=0)
    with (
        tus.share("w", path=str(tmp_path / "c.sock")),
        pytest.raises(InvalidStateError, match="already shared"),
    ):
        tus.share("w", path=str(tmp_path / "d.sock"))
    allocator.pause("w")
    with pytest.raises(InvalidStateError, match="paused"):
        tus.share("w", path=str(tmp_path / "e.sock"))
    allocator.resume("w")
    with pytest.raises(InvalidArgumentError, match="nothing serves"):
        tus.attach(str(tmp_path / "nobody.sock"))


def test_a_driver_fault_while_mapping_leaves_nothing_mapped(process) -> None:
    driver, allocator = process
    ptr = allocator.malloc(8 * MiB, tag="w")  # two 4 MiB chunks
    fill(ptr, 3, 8 * MiB)
    (segment,) = allocator.export_tag("w")
    _, size, chunks = segment
    try:
        mapping = _C.SharedMapping(0)
        held = driver.held()
        driver.fail_on("map", 2)  # the second chunk
        with pytest.raises(tus.CudaError):
            mapping.add(size, chunks)
        driver.clear_faults()
        assert driver.held() == held  # the first chunk's import, mapping and range are gone
        base = mapping.add(size, chunks)
        assert byte_at(base + 5 * MiB) == 3
        mapping.unmap()
        assert not mapping.mapped
        with pytest.raises(InvalidArgumentError, match="segments"):
            mapping.remap([])
        mapping.remap([chunks])
        assert byte_at(base + 5 * MiB) == 3
        mapping.close()
    finally:
        for _, _, fd in chunks:
            os.close(fd)
    assert _C.get_driver().name == "sim"
