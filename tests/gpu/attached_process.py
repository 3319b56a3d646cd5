"""The owner's handle on one sharing_child.py process (for sharing_scenarios.py and
benchmarks/bench_sharing.py): starts it attached to the socket at `path`, sends it commands and
reads its JSON answers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = Path(__file__).resolve().parent / "sharing_child.py"


class AttachedProcess:
    def __init__(self, path: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(CHILD), path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.report = self.read()  # the attach: pid, attach_ms, added_bytes, bytes

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"attached process ended with status {self.process.wait()}")
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.ask("close")
            self.process.wait(timeout=120)


def stop(pid: int) -> None:
    """SIGSTOP, returning once the process is stopped: the signal arrives asynchronously, and a
    process still running could answer one more message."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} did not stop")
        time.sleep(0.001)
