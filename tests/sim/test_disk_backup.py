"""Disk backup (set_backup_policy(tag, disk=True)) on the SimDriver: bytes identical after resume
over cycles and uneven pieces, one file per backed segment while paused and none after, disk
usage constant over cycles, only the staging buffers held in host memory, configuration errors
before anything is paused, IO failures (injected, and a real file-size limit) that lose nothing
and let a later pause or resume finish, files removed when a paused segment is freed, retained
files, policy changes between pause and resume, driver faults during a disk-backed cycle, and the
package functions and environment variables.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import torch_uvm_saver as tus
from torch_uvm_saver import _C
from torch_uvm_saver.errors import InvalidArgumentError, InvalidStateError, TusError

MiB = 1 << 20
TAG = "t"
IO_CHUNK = 3 * MiB  # against 4 MiB VMM chunks: pieces of 3 and 1 MiB, an uneven tail each time
SIZES = (10 * MiB, 6 * MiB, 2 * MiB)  # chunks of 4+4+2, 4+2 and 2 MiB


def files_in(directory: Path) -> list[str]:
    """What `ls` shows: removed backups are renamed to hidden names and unlinked in the
    background (the next pause waits for that)."""
    return sorted(name for name in os.listdir(directory) if not name.startswith("."))


def disk_usage(directory: Path) -> int:
    """Blocks of every file, hidden ones being removed included (a pause waits for those)."""
    return sum(os.stat(directory / name).st_blocks * 512 for name in os.listdir(directory))


def file_name(ptr: int, device: int = 0) -> str:
    return f"tus-{os.getpid()}-dev{device}-{ptr:x}.bin"


@pytest.fixture
def disk(allocator, tmp_path):
    """The allocator with a disk policy on TAG, backing up to a fresh directory."""
    allocator.set_disk_backup_dir(str(tmp_path))
    allocator.set_disk_backup_chunk_bytes(IO_CHUNK)
    allocator.set_backup_policy(TAG, disk=True)
    return allocator, tmp_path


def backed_segments(allocator, fill):
    ptrs = [allocator.malloc(size, tag=TAG, cpu_backup=True) for size in SIZES]
    return ptrs, [fill(ptr, size) for ptr, size in zip(ptrs, SIZES)]


def test_bytes_identical_over_cycles(driver, disk, fill, peek, consistent) -> None:
    allocator, directory = disk
    ptrs = [allocator.malloc(size, tag=TAG, cpu_backup=True) for size in SIZES]
    scratch = allocator.malloc(4 * MiB, tag=TAG)  # no backup: released, no file
    for cycle in range(3):
        data = [fill(ptr, size) for ptr, size in zip(ptrs, SIZES)]
        assert allocator.pause(TAG) == sum(SIZES) + 4 * MiB
        assert driver.used_bytes() == 0
        assert files_in(directory) == sorted(file_name(ptr) for ptr in ptrs)
        for ptr, expected in zip(ptrs, data):
            assert (directory / file_name(ptr)).read_bytes() == expected
        stats = consistent(allocator)
        assert stats["disk_backup_bytes.all.current"] == sum(SIZES)
        assert stats["cpu_backup_bytes.all.current"] == 0
        # Host memory: the pooled staging buffers only, never the segments' size.
        assert driver.pinned_host_bytes() == 2 * 4 * MiB  # 3 MiB rounded to the pool's 2 MiB
        assert allocator.resume(TAG) == sum(SIZES) + 4 * MiB
        assert [peek(ptr, size) for ptr, size in zip(ptrs, SIZES)] == data
        assert files_in(directory) == []
        stats = consistent(allocator)
        assert stats["disk_backup_bytes.all.current"] == 0
        assert stats[f"disk_write_bytes.tag:{TAG}"] == (cycle + 1) * sum(SIZES)
        assert stats["disk_read_bytes.all"] == (cycle + 1) * sum(SIZES)
        assert stats["pause_copy_bytes.all"] == (cycle + 1) * sum(SIZES)
    assert sorted(s["ptr"] for s in allocator.segments()) == sorted([*ptrs, scratch])


@pytest.mark.parametrize("retain", [False, True])
def test_disk_usage_is_constant_over_cycles(disk, fill, peek, retain) -> None:
    allocator, directory = disk
    allocator.set_backup_policy(TAG, disk=True, retain=retain)
    ptrs, _ = backed_segments(allocator, fill)
    usage = []
    for _ in range(3):
        data = [fill(ptr, size) for ptr, size in zip(ptrs, SIZES)]
        allocator.pause(TAG)
        assert len(files_in(directory)) >= len(ptrs)  # at least one file per backed allocation
        usage.append(disk_usage(directory))
        allocator.resume(TAG)
        assert [peek(ptr, size) for ptr, size in zip(ptrs, SIZES)] == data
        assert len(files_in(directory)) == (len(ptrs) if retain else 0)
    assert usage[0] >= sum(SIZES)
    assert usage == [usage[0]] * 3


def test_retained_files_are_rewritten_and_removed_at_free(disk, fill, peek) -> None:
    allocator, directory = disk
    allocator.set_backup_policy(TAG, disk=True, retain=True)
    ptrs, _ = backed_segments(allocator, fill)
    allocator.pause(TAG)
    allocator.resume(TAG)
    assert allocator.backup_of(ptrs[0]) is None  # no host copy to read
    assert allocator.stats()["disk_backup_bytes.all.current"] == sum(SIZES)
    data = fill(ptrs[0], SIZES[0])
    allocator.pause(TAG)
    assert (directory / file_name(ptrs[0])).read_bytes() == data
    allocator.resume(TAG)
    assert peek(ptrs[0], SIZES[0]) == data
    for ptr in ptrs:
        allocator.free(ptr)
    assert files_in(directory) == []
    assert allocator.stats()["disk_backup_bytes.all.current"] == 0


def test_freeing_a_paused_segment_removes_its_file(driver, disk, fill, peek, consistent) -> None:
    allocator, directory = disk
    ptrs, data = backed_segments(allocator, fill)
    allocator.pause(TAG)
    allocator.free(ptrs[1])
    assert files_in(directory) == sorted(file_name(p) for p in (ptrs[0], ptrs[2]))
    stats = consistent(allocator)
    assert stats["disk_backup_bytes.all.current"] == SIZES[0] + SIZES[2]
    allocator.resume(TAG)
    assert peek(ptrs[0], SIZES[0]) == data[0]
    assert peek(ptrs[2], SIZES[2]) == data[2]
    assert files_in(directory) == []
    for ptr in (ptrs[0], ptrs[2]):
        allocator.free(ptr)
    assert driver.used_bytes() == 0


def assert_nothing_paused(driver, allocator, ptrs, data, peek) -> None:
    assert not allocator.is_paused(TAG)
    assert driver.used_bytes() == sum(SIZES)
    assert [peek(ptr, size) for ptr, size in zip(ptrs, SIZES)] == data


def test_no_directory_is_an_error_before_anything_pauses(driver, allocator, fill, peek) -> None:
    allocator.set_disk_backup_dir(None)
    allocator.set_backup_policy(TAG, disk=True)
    ptrs, data = backed_segments(allocator, fill)
    with pytest.raises(InvalidStateError, match="no disk-backup directory is set"):
        allocator.pause(TAG)
    assert_nothing_paused(driver, allocator, ptrs, data, peek)


def test_missing_directory_is_an_error_before_anything_pauses(
    driver, disk, fill, peek, tmp_path
) -> None:
    allocator, _ = disk
    gone = tmp_path / "gone"
    with pytest.raises(InvalidArgumentError, match=str(gone)):
        allocator.set_disk_backup_dir(str(gone))
    gone.mkdir()
    allocator.set_disk_backup_dir(str(gone))
    gone.rmdir()  # removed after it was set
    ptrs, data = backed_segments(allocator, fill)
    with pytest.raises(InvalidStateError, match=rf"'{gone}' is not usable: No such file") as raised:
        allocator.pause(TAG)
    assert "nothing was paused" in str(raised.value)
    assert_nothing_paused(driver, allocator, ptrs, data, peek)
    gone.mkdir()
    assert allocator.pause(TAG) == sum(SIZES)  # a later pause works
    allocator.resume(TAG)
    assert_nothing_paused(driver, allocator, ptrs, data, peek)


def test_a_file_is_not_a_directory(allocator, tmp_path) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match="is not a directory"):
        allocator.set_disk_backup_dir(str(plain))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_unwritable_directory_is_an_error_before_anything_pauses(driver, disk, fill, peek) -> None:
    allocator, directory = disk
    ptrs, data = backed_segments(allocator, fill)
    directory.chmod(0o500)
    try:
        with pytest.raises(InvalidStateError, match="is not writable"):
            allocator.pause(TAG)
    finally:
        directory.chmod(0o700)
    assert_nothing_paused(driver, allocator, ptrs, data, peek)


def test_not_enough_space_is_an_error_before_anything_pauses(tmp_path) -> None:
    # A simulated segment larger than the free disk space: never touched, so it costs no memory.
    stat = os.statvfs(tmp_path)
    size = (stat.f_bavail * stat.f_frsize + (4 << 30)) // (1 << 30) * (1 << 30)
    if size > 1 << 40:
        pytest.skip("more than 1 TiB free")
    driver = _C.SimDriver(size, 1, 2 * MiB)
    allocator = _C.Allocator(driver, device=0, chunk_bytes=1 << 30)
    allocator.set_disk_backup_dir(str(tmp_path))
    allocator.set_backup_policy(TAG, disk=True)
    ptr = allocator.malloc(size, tag=TAG, cpu_backup=True)
    with pytest.raises(InvalidStateError, match=r"GiB free; the pause needs") as raised:
        allocator.pause(TAG)
    assert str(tmp_path) in str(raised.value)
    assert not allocator.is_paused(TAG)
    assert driver.used_bytes() == size
    assert files_in(tmp_path) == []
    allocator.free(ptr)


@pytest.mark.parametrize(
    ("op", "nth", "code"),
    [("write", 6, errno.ENOSPC), ("sync", 2, errno.EIO), ("open", 2, errno.EACCES)],
)
def test_io_failure_part_way_loses_nothing(
    driver, allocator, tmp_path, fill, peek, consistent, op, nth, code
) -> None:
    # Three 4 MiB segments, 1 MiB pieces: writes 1-4 are segment 0, 5-8 segment 1.
    allocator.set_disk_backup_dir(str(tmp_path))
    allocator.set_disk_backup_chunk_bytes(1 * MiB)
    allocator.set_backup_policy(TAG, disk=True)
    # Paused in address order.
    ptrs = sorted(allocator.malloc(4 * MiB, tag=TAG, cpu_backup=True) for _ in range(3))
    data = [fill(ptr, 4 * MiB) for ptr in ptrs]
    allocator.fail_disk_io_on(op, nth, code)
    with pytest.raises(TusError) as raised:
        allocator.pause(TAG)
    message = str(raised.value)
    assert os.strerror(code) in message
    assert str(tmp_path / file_name(ptrs[1])) in message
    assert "keeps its device memory and contents" in message
    assert "partly paused" in message
    if op == "write":
        assert "after 1048576 of 4194304 bytes" in message
    # Segment 0 is on disk and released; segment 1 (the failed one) and 2 are untouched.
    resident = {s["ptr"]: s["resident"] for s in allocator.segments()}
    assert [resident[p] for p in ptrs] == [0, 4 * MiB, 4 * MiB]
    assert files_in(tmp_path) == [file_name(ptrs[0])]
    assert peek(ptrs[1], 4 * MiB) == data[1]
    assert peek(ptrs[2], 4 * MiB) == data[2]
    consistent(allocator)
    assert allocator.pause(TAG) == 8 * MiB  # the later pause finishes the job
    assert len(files_in(tmp_path)) == 3
    assert allocator.resume(TAG) == 12 * MiB
    assert [peek(ptr, 4 * MiB) for ptr in ptrs] == data
    assert files_in(tmp_path) == []
    consistent(allocator)


def test_real_file_size_limit_loses_nothing(driver, disk, fill, peek, consistent) -> None:
    allocator, directory = disk
    ptrs, data = backed_segments(allocator, fill)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 * MiB, hard))  # the 10 MiB segment cannot fit
    try:
        with pytest.raises(TusError, match=os.strerror(errno.EFBIG)) as raised:
            allocator.pause(TAG)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)
    assert str(directory / file_name(ptrs[0])) in str(raised.value)
    # The 10 MiB segment stays on the device with its bytes; the others fit and may be paused.
    resident = {s["ptr"]: s["resident"] for s in allocator.segments()}
    assert resident[ptrs[0]] == SIZES[0]
    assert peek(ptrs[0], SIZES[0]) == data[0]
    consistent(allocator)
    allocator.pause(TAG)
    allocator.resume(TAG)
    assert [peek(ptr, size) for ptr, size in zip(ptrs, SIZES)] == data
    assert files_in(directory) == []


def test_read_failure_at_resume_keeps_the_tag_paused(driver, disk, fill, peek, consistent) -> None:
    allocator, directory = disk
    ptrs, data = backed_segments(allocator, fill)
    allocator.pause(TAG)
    files = files_in(directory)
    allocator.fail_disk_io_on("read", 3, errno.EIO)
    with pytest.raises(TusError, match=os.strerror(errno.EIO)) as raised:
        allocator.resume(TAG)
    assert "the file is kept" in str(raised.value)
    assert "nothing was resumed" in str(raised.value)
    assert allocator.is_paused(TAG)
    assert driver.used_bytes() == 0
    assert files_in(directory) == files
    consistent(allocator)
    # A file that went away: the same, and it works again once the file is back.
    moved = directory / "moved"
    (directory / files[0]).rename(moved)
    with pytest.raises(TusError, match="No such file"):
        allocator.resume(TAG)
    assert allocator.is_paused(TAG)
    moved.rename(directory / files[0])
    allocator.resume(TAG)
    assert [peek(ptr, size) for ptr, size in zip(ptrs, SIZES)] == data
    assert files_in(directory) == []


def test_policy_change_between_pause_and_resume(driver, disk, fill, peek) -> None:
    allocator, directory = disk
    ptrs, data = backed_segments(allocator, fill)
    allocator.pause(TAG)
    allocator.set_backup_policy(TAG)  # host memory from now on
    allocator.resume(TAG)  # still reads the files
    assert [peek(ptr, size) for ptr, size in zip(ptrs, SIZES)] == data
    allocator.pause(TAG)
    assert files_in(directory) == []
    assert allocator.backup_of(ptrs[0]) is not None
    allocator.set_backup_policy(TAG, disk=True)
    allocator.resume(TAG)
    assert [peek(ptr, size) for ptr, size in zip(ptrs, SIZES)] == data


# Driver faults during a disk-backed cycle (Note [Failure atomicity]): every call of a clean
# cycle, failed once; then the cycle is finished and nothing may be lost or leaked.
def make_disk_scenario(directory: Path):
    driver = _C.SimDriver(128 * MiB, 1, 2 * MiB)
    allocator = _C.Allocator(driver, device=0, chunk_bytes=4 * MiB)
    allocator.set_disk_backup_dir(str(directory))
    allocator.set_disk_backup_chunk_bytes(3 * MiB)
    allocator.set_backup_policy(TAG, disk=True)
    ptrs = [allocator.malloc(size, tag=TAG, cpu_backup=True) for size in SIZES]
    plain = allocator.malloc(2 * MiB, tag=TAG)
    data = []
    for ptr, size in zip(ptrs, SIZES):
        data.append(os.urandom(size))
        ctypes.memmove(ptr, data[-1], size)
    return driver, allocator, ptrs, plain, data


def disk_cycle_counts(tmp_dir: str) -> dict[str, int]:
    driver, allocator, ptrs, plain, _ = make_disk_scenario(Path(tmp_dir))
    driver.reset_call_counts()
    allocator.pause(TAG)
    allocator.resume(TAG)
    counts = dict(driver.call_counts())
    for ptr in [*ptrs, plain]:
        allocator.free(ptr)
    return counts


def _sweep() -> list:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        counts = disk_cycle_counts(directory)
    return [
        pytest.param(call, n, id=f"{call}#{n}")
        for call, count in sorted(counts.items())
        for n in range(1, count + 1)
    ]


@pytest.mark.parametrize(("call", "nth"), _sweep())
def test_driver_failure_during_disk_cycle(tmp_path, call: str, nth: int) -> None:
    driver, allocator, ptrs, plain, data = make_disk_scenario(tmp_path)
    driver.fail_on(call, nth)
    for step in (allocator.pause, allocator.resume):
        try:
            step(TAG)
        except TusError:
            break
    driver.clear_faults()
    for step in (allocator.pause, allocator.resume):
        step(TAG)  # finishing the cycle from wherever the failure left it
    assert not allocator.is_paused(TAG)
    assert [ctypes.string_at(ptr, size) for ptr, size in zip(ptrs, SIZES)] == data
    stats = allocator.stats()
    assert stats["paused_bytes.all.current"] == 0
    assert stats["active_bytes.all.current"] == sum(SIZES) + 2 * MiB
    assert driver.used_bytes() == stats["active_bytes.all.current"]
    assert files_in(tmp_path) == []
    for ptr in [*ptrs, plain]:
        allocator.free(ptr)
    allocator.release_host_cache()
    assert driver.used_bytes() == 0
    assert driver.mapped_ranges() == 0
    assert driver.pinned_host_bytes() == 0
    assert allocator.stats()["num_free_failures.all"] == 0


def test_package_functions(process, tmp_path, fill, peek) -> None:
    _, allocator = process
    previous = tus.get_disk_backup_dir()
    previous_chunk = tus.get_disk_backup_chunk_bytes()
    try:
        with pytest.raises(InvalidArgumentError, match="missing"):
            tus.set_disk_backup_dir(tmp_path / "missing")
        with pytest.raises(InvalidArgumentError, match="multiple of 4 KiB"):
            tus.set_disk_backup_chunk_bytes(1000)
        tus.set_disk_backup_dir(tmp_path)
        tus.set_disk_backup_chunk_bytes(2 * MiB)
        assert tus.get_disk_backup_dir() == str(tmp_path.resolve())
        assert allocator.disk_backup_dir() == str(tmp_path.resolve())
        assert tus.get_disk_backup_chunk_bytes() == allocator.disk_backup_chunk_bytes() == 2 * MiB
        ptr = allocator.malloc(6 * MiB, tag="api-disk", cpu_backup=True)
        tus.set_backup_policy("api-disk", disk=True)
        assert allocator.backup_policy("api-disk") == {
            "retain": False,
            "pinned": True,
            "disk": True,
        }
        data = fill(ptr, 6 * MiB)
        assert tus.pause("api-disk") == 6 * MiB
        assert files_in(tmp_path) == [file_name(ptr)]
        assert tus.memory_stats()["disk_backup_bytes.tag:api-disk.current"] == 6 * MiB
        tus.resume("api-disk")
        assert peek(ptr, 6 * MiB) == data
        assert files_in(tmp_path) == []
        tus.set_backup_policy("api-disk")
    finally:
        _C.set_disk_backup_dir(previous)
        _C.set_disk_backup_chunk_bytes(previous_chunk)


def test_environment_defaults(tmp_path) -> None:
    code = (
        "import torch_uvm_saver as tus, torch_uvm_saver._C as C;"
        "print(tus.get_disk_backup_dir(), tus.get_disk_backup_chunk_bytes(),"
        " C.Allocator(C.SimDriver(1 << 26, 1, 1 << 21)).disk_backup_dir())"
    )
    env = {k: v for k, v in os.environ.items() if "DISK_BACKUP" not in k}
    tms = {**env, "TMS_DISK_BACKUP_DIR": str(tmp_path / "tms"), "TMS_DISK_BACKUP_CHUNK_MB": "8"}
    both = {**tms, "TUS_DISK_BACKUP_DIR": str(tmp_path / "tus"), "TUS_DISK_BACKUP_CHUNK_MB": "16"}
    outputs = []
    for environment in (env, tms, both):
        result = subprocess.run(
            [sys.executable, "-c", code],
            env=environment,
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.append(result.stdout.split())
    assert outputs[0] == ["None", str(64 * MiB), "None"]
    assert outputs[1] == [str(tmp_path / "tms"), str(8 * MiB), str(tmp_path / "tms")]
    assert outputs[2] == [str(tmp_path / "tus"), str(16 * MiB), str(tmp_path / "tus")]
