"""GPU scenarios of disk backup (set_backup_policy(tag, disk=True)), one per fresh process:
`python disk_scenarios.py NAME` prints "SCENARIO NAME OK" at the end.

Each asserts what a user can observe: device memory by cudaMemGetInfo, the backup file's bytes,
the tensor's bytes and data_ptr after resume, host memory held, the exception raised.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from scenarios import GiB, MiB, expect_error, free_bytes, scenario_registry

SCENARIOS, scenario = scenario_registry()


def backup_directory() -> Path:
    """A fresh directory on the disk the user points at (TUS_DISK_BACKUP_DIR), else under /tmp."""
    base = os.environ.get("TUS_DISK_BACKUP_DIR") or tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix="tus-disk-scenario-", dir=base)).resolve()


def visible_files(directory: Path) -> list[Path]:
    """What `ls` shows: removed backups are renamed to hidden names and unlinked in the
    background (the next pause waits for that)."""
    return sorted(p for p in directory.iterdir() if not p.name.startswith("."))


@scenario
def disk_backup_frees_1gib_and_restores_bytes() -> None:
    import torch

    import torch_uvm_saver as tus

    directory = backup_directory()
    try:
        tus.set_disk_backup_dir(directory)
        tus.set_backup_policy("weights", disk=True)
        with tus.region("weights", enable_cpu_backup=True):
            tensor = torch.randint(0, 256, (GiB,), dtype=torch.uint8, device="cuda")
        pointer = tensor.data_ptr()
        usage = []
        for cycle in range(3):
            tensor.add_(cycle)
            expected = tensor.cpu()
            before = free_bytes()
            released = tus.pause("weights")
            paused = free_bytes()
            print(
                f"cycle {cycle}: released {released / GiB:.3f} GiB; free grew by "
                f"{(paused - before) / GiB:.4f} GiB"
            )
            assert paused - before >= 0.99 * GiB
            files = visible_files(directory)
            assert len(files) == 1, files  # one segment, one file
            assert files[0].name.startswith(f"tus-{os.getpid()}-dev{torch.cuda.current_device()}-")
            on_disk = torch.frombuffer(bytearray(files[0].read_bytes()), dtype=torch.uint8)
            assert on_disk.numel() >= GiB and torch.equal(on_disk[:GiB], expected)
            del on_disk
            usage.append(sum(f.stat().st_blocks * 512 for f in files))
            stats = tus.memory_stats()
            assert stats["disk_backup_bytes.tag:weights.current"] >= GiB
            assert stats["cpu_backup_bytes.all.current"] == 0
            # Host memory held: the pooled staging buffers, not the gigabyte.
            assert stats["host_pool_bytes.current"] <= 2 * tus.get_disk_backup_chunk_bytes()
            assert tus.get_cpu_backup(tensor) is None
            tus.resume("weights")
            assert tensor.data_ptr() == pointer
            assert torch.equal(tensor.cpu(), expected), f"cycle {cycle}"
            assert visible_files(directory) == []
        assert usage == [usage[0]] * 3
        stats = tus.memory_stats()
        print(
            f"written {stats['disk_write_bytes.all'] / GiB:.2f} GiB, "
            f"read {stats['disk_read_bytes.all'] / GiB:.2f} GiB"
        )
        assert stats["disk_write_bytes.all"] >= 3 * GiB
        assert stats["disk_read_bytes.all"] >= 3 * GiB
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@scenario
def disk_backup_without_a_directory_raises_before_pausing() -> None:
    import torch

    import torch_uvm_saver as tus
    from torch_uvm_saver.errors import InvalidArgumentError, InvalidStateError

    tus.set_disk_backup_dir(None)
    tus.set_backup_policy("weights", disk=True)
    with tus.region("weights", enable_cpu_backup=True):
        tensor = torch.full((256 * MiB,), 5, dtype=torch.uint8, device="cuda")
    before = free_bytes()
    expect_error(InvalidStateError, lambda: tus.pause("weights"), "no disk-backup directory")
    assert not tus.is_paused("weights")
    assert free_bytes() == before
    assert int(tensor.sum(dtype=torch.int64)) == 5 * 256 * MiB  # still readable

    directory = backup_directory()
    missing = directory / "missing"
    expect_error(InvalidArgumentError, lambda: tus.set_disk_backup_dir(missing), str(missing))
    tus.set_disk_backup_dir(directory)
    directory.rmdir()  # gone after it was set
    expect_error(InvalidStateError, lambda: tus.pause("weights"), str(directory))
    assert not tus.is_paused("weights")
    assert int(tensor.sum(dtype=torch.int64)) == 5 * 256 * MiB

    directory.mkdir()
    try:
        assert tus.pause("weights") >= 256 * MiB  # works once the directory is back
        tus.resume("weights")
        assert int(tensor.sum(dtype=torch.int64)) == 5 * 256 * MiB
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    name = sys.argv[1]
    SCENARIOS[name]()
    print(f"SCENARIO {name} OK", flush=True)
