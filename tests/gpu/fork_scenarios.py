"""GPU scenarios of fork() (Note [Fork] in allocator/fork_guard.h), one per fresh process:
`python fork_scenarios.py NAME` (test_scenarios.py runs them all).

The simulated-driver tests (tests/sim/test_fork.py) fork with a thread inside the allocator for
certain; here the fork meets a real pause on the GPU, and the child checks what the Note promises
on a GPU machine: it can read the stats, and CUDA refuses it instead of hanging.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Callable

MiB = 1 << 20
GiB = 1 << 30
CHILD_TIMEOUT_S = 60
SCENARIOS: dict[str, Callable[[], None]] = {}


def scenario(function: Callable[[], None]) -> Callable[[], None]:
    SCENARIOS[function.__name__] = function
    return function


def fork_and_report(child: Callable[[], str]) -> str:
    """Runs `child` in a forked child; returns what it returned, or fails if it failed or hung."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.write(writer, child().encode())
            code = 0
        except BaseException:
            os.write(writer, traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(writer)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done != 0:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError(f"the forked child hung for {CHILD_TIMEOUT_S} s")
        time.sleep(0.01)
    with os.fdopen(reader, "rb") as pipe:
        report = pipe.read().decode()
    assert os.waitstatus_to_exitcode(status) == 0, report
    return report


@scenario
def fork_during_a_pause_gives_a_child_that_can_read_stats() -> None:
    import threading

    import torch

    import torch_uvm_saver as tus
    from torch_uvm_saver import _C
    from torch_uvm_saver.errors import CudaError

    with tus.region("w", enable_cpu_backup=True):
        w = torch.full((GiB,), 3, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    pausing = threading.Thread(target=tus.pause, args=("w",))
    pausing.start()
    time.sleep(0.005)  # the pause is under way: it copies 1 GiB to the host

    def child() -> str:
        # The device is named: memory_stats() alone asks torch.cuda for the current device, and
        # PyTorch refuses torch.cuda in a child forked after CUDA was initialized.
        stats = tus.memory_stats(0)
        assert stats["allocated_bytes.tag:w.current"] == GiB, stats["allocated_bytes.tag:w.current"]
        try:
            _C.get_driver().mem_get_info(0)
        except CudaError as error:
            return f"CUDA refused the child: {error}"
        return "CUDA answered the child"

    start = time.monotonic()
    report = fork_and_report(child)
    print(f"fork returned {time.monotonic() - start:.3f} s after it was called; child: {report}")
    assert report.startswith("CUDA refused the child"), report
    pausing.join(timeout=120)
    assert not pausing.is_alive()
    assert tus.memory_stats(0)["paused_bytes.tag:w.current"] == GiB
    tus.resume("w")
    assert int(w[0]) == 3 and int(w[-1]) == 3 and int(w.sum()) == 3 * GiB


if __name__ == "__main__":
    name = sys.argv[1]
    SCENARIOS[name]()
    print(f"SCENARIO {name} OK", flush=True)
