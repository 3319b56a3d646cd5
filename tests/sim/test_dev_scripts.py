"""The parts of the developer scripts under scripts/ that decide what a measurement says: the
replay that names why PyTorch's allocator retried (lms_allocator_retries.py), which files an
A/B swaps (ab_python_change.py), the replay of a session's planner calls (replay_planner.py),
what a traced step's idle gaps are put down to (lms_step_timeline.py), which thread a step's
CPU time is charged to (thread_cpu.py), how rounds of processes make one row a configuration,
which placement keywords its "helper" passes and how its switch flat lays blocks out
(lms_state_split.py), and how the host's speed under copies is put against the idle GPU's
(host_speed_under_copies.py), how a small read behind copies is tabled
(small_read_behind_copies.py), the timing of the session's per-step walks
(lms_block_end_cost.py), the session's host cost on the CPU (session_host_cost_cpu.py), the
switch that steps groups on a thread of their own (lms_state_split.py) and the scan of each
CPU's speed (cpu_speed_scan.py). All run here without a GPU."""

from __future__ import annotations

import collections
import os
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import ab_python_change  # noqa: E402
import cpu_speed_scan  # noqa: E402
import host_speed_under_copies  # noqa: E402
import lms_allocator_retries  # noqa: E402
import lms_block_end_cost  # noqa: E402
import lms_state_split  # noqa: E402
import lms_step_timeline  # noqa: E402
import pinned_numa_bandwidth  # noqa: E402
import planner_cold_cost  # noqa: E402
import pyspy_summary  # noqa: E402
import replay_planner  # noqa: E402
import run_gpu_tests  # noqa: E402
import session_host_cost_cpu  # noqa: E402
import small_read_behind_copies  # noqa: E402
import thread_cpu  # noqa: E402
import timed_calls  # noqa: E402

GiB = 1 << 30
KEPT = ROOT / "benchmarks/results/lms_allocator_retries_4x_NVIDIA_H100_80GB_HBM3.json.gz"
KEPT_H200 = ROOT / "benchmarks/results/lms_allocator_retries_4x_helper_NVIDIA_H200.json.gz"
KEPT_CLEARED = (
    ROOT / "benchmarks/results/lms_allocator_retries_4x_autocast_cleared_NVIDIA_H200.json.gz"
)
PLANNER_LOG = ROOT / "benchmarks/results/lms_planner_log_xl_2x_NVIDIA_H100_80GB_HBM3.json.gz"
PLANNER_LOG_AHEAD = (
    ROOT / "benchmarks/results/lms_planner_log_xl_2x_paging_ahead_NVIDIA_H200.json.gz"
)


def snapshot(trace: list[tuple[str, int, int]], reserved: int = 10 * GiB) -> dict:
    """Starts with `reserved` bytes in one segment, 6 GiB of it allocated at address 0."""
    blocks = [
        {"state": "active_allocated", "size": 6 * GiB, "address": 0},
        {"state": "inactive", "size": reserved - 6 * GiB, "address": 6 * GiB},
    ]
    return {
        "start": {"segments": [{"device": 0, "total_size": reserved, "blocks": blocks}]},
        "trace": [{"action": a, "size": size, "addr": addr} for a, size, addr in trace],
        "fraction_bytes": 12 * GiB,
    }


def test_a_retry_is_the_state_before_its_waits_and_unmaps():
    retries = lms_allocator_retries.replay(
        snapshot(
            [
                ("free_requested", 2 * GiB, 0),  # a page-out's block, pending on its copy
                ("free_completed", 2 * GiB, 0),  # the retry waits for it
                ("segment_unmap", 4 * GiB, 6 * GiB),  # and gives back what is cached
                ("segment_map", 5 * GiB, 6 * GiB),
                ("alloc", 5 * GiB, 6 * GiB),
            ]
        )
    )
    assert retries == [
        {
            "allocated": 6 * GiB,
            "pending": 2 * GiB,
            "reserved": 10 * GiB,
            "released": 4 * GiB,
            "waited": 2 * GiB,
            "unmapped": True,
            "request": 5 * GiB,
            "largest_free": 4 * GiB,  # the pending block still counts as live
            "made_in_step": {},  # the live block was there before the step
        }
    ]


def test_the_largest_free_piece_is_mapped_memory_no_live_block_covers():
    mapped = [(0, 10), (20, 30), (30, 34)]  # two mappings that meet at 30 make one stretch
    live = {2: 3, 25: 3}
    # Free: 0-2, 5-10, 20-25 and 28-34; 10-20 is not mapped.
    assert lms_allocator_retries._largest_free_piece(mapped, live) == 6
    assert lms_allocator_retries._largest_free_piece(mapped, {0: 34}) == 0


def test_reusing_a_completed_free_is_not_a_retry():
    retries = lms_allocator_retries.replay(
        snapshot(
            [
                ("free_requested", 2 * GiB, 0),
                ("free_completed", 2 * GiB, 0),  # its event passed: back in the pool
                ("alloc", 1 * GiB, 0),
            ]
        )
    )
    assert retries == []


def test_the_kept_h100_step_retries_three_times_all_with_memory_free_in_pieces(capsys):
    import gzip
    import json

    with gzip.open(KEPT, "rt") as f:
        kept = json.load(f)
    retries = lms_allocator_retries.replay(kept)
    assert [round(r["request"] / GiB, 3) for r in retries] == [0.767, 1.534, 0.125]
    assert all(r["reserved"] - r["allocated"] >= r["request"] for r in retries)
    # ...but in pieces: none of them as large as the request
    assert [round(r["largest_free"] / GiB, 3) for r in retries] == [0.648, 0.777, 0.078]
    lms_allocator_retries.report(kept)
    assert capsys.readouterr().out.count("fragmentation: free in pieces") == 3


def test_autocasts_weight_copies_are_what_split_the_forwards_loss_at_4x(capsys):
    # Note [Autocast's cast cache]: at the forward's retry the bf16 copies of GPT-2 medium's 24
    # layers (2, 6, 8 and 8 MiB each) are live; with the cache emptied after each module the
    # forward's retry is gone and the one left, in the backward, holds none of them.
    import gzip
    import json

    def kept(path):
        with gzip.open(path, "rt") as f:
            return json.load(f)

    kept_copies, cleared = kept(KEPT_H200), kept(KEPT_CLEARED)
    forward = lms_allocator_retries.replay(kept_copies)[0]["made_in_step"]
    assert (forward[2], forward[6], forward[8]) == (24, 24, 48)
    [backward] = lms_allocator_retries.replay(cleared)
    assert not {2, 6, 8} & set(backward["made_in_step"])
    assert backward["made_in_step"][1571] == 2  # two of the loss's buffers, a third asked for
    lms_allocator_retries.report(cleared)
    assert "retry 1: live blocks made in the step, MiB x count: 1571 x2" in capsys.readouterr().out


@pytest.fixture
def base_tree(tmp_path):
    """A copy of the package and the native sources as they are: the base of an A/B."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    for top in (ab_python_change.PACKAGE, *ab_python_change.NATIVE):
        shutil.copytree(ROOT / top, tmp_path / top, ignore=ignore)
    return tmp_path


def test_an_ab_against_a_folder_swaps_the_python_files_that_differ(base_tree):
    assert ab_python_change.changed_python_files(str(base_tree)) == []
    changed = base_tree / ab_python_change.PACKAGE / "lms_session.py"
    changed.write_text(changed.read_text() + "\n# the base differs\n")
    assert ab_python_change.changed_python_files(str(base_tree)) == [
        "torch_uvm_saver/lms_session.py"
    ]


def test_an_ab_against_a_folder_refuses_a_native_difference(base_tree):
    source = next((base_tree / "allocator").rglob("*.cpp"))
    source.write_text(source.read_text() + "\n// the base differs\n")
    with pytest.raises(SystemExit, match=r"native core differs.*--build-sides"):
        ab_python_change.changed_python_files(str(base_tree))


def test_an_ab_that_builds_its_sides_needs_the_base_whole(base_tree, tmp_path):
    # A folder made for swapping Python files holds no build files: refused with what to make.
    with pytest.raises(SystemExit, match=r"no pyproject\.toml"):
        ab_python_change.base_source(str(base_tree), tmp_path)
    # A revision is unpacked whole, ready to build.
    source = ab_python_change.base_source("HEAD", tmp_path / "scratch")
    for needed in ("pyproject.toml", "CMakeLists.txt", "allocator", "bindings", "torch_uvm_saver"):
        assert (source / needed).exists(), needed


def replayed(path) -> tuple[dict, int]:
    """The log's steady iteration (the sixth less the fifth) replayed on this build, and how
    many results differ from the log's."""
    import gzip
    import json

    with gzip.open(path, "rt") as f:
        log = json.load(f)
    iterations, differences = replay_planner.replay(log, verify=True)
    return {k: iterations[5][k] - iterations[4][k] for k in iterations[5]}, differences


def test_the_kept_xl_planner_log_replays_to_the_same_plans():
    # GPT-2 XL at 2x on an H100, all the state on the device, logged by lms_state_split.py
    # --probe plans. The planner decides from its calls alone, so this build's planner returns
    # what the GPU run's did; a change to its policy fails here first (log the run again). The
    # log is older than paging out ahead, which the replay turns off for it.
    steady, differences = replayed(PLANNER_LOG)
    assert differences == 0
    assert steady["pagein_bytes"] == 0  # every page-in a prefetch
    assert round(steady["prefetch_bytes"] / 1e9, 2) == 6.04
    assert steady["ahead_pageout_bytes"] == 0


def test_the_kept_xl_log_with_paging_out_ahead_replays_to_the_same_plans():
    # The same configuration on an H200 with Note [Paging out ahead] on (its default): part of
    # what the planner sends out goes right after a read, and every page-in is still a prefetch.
    steady, differences = replayed(PLANNER_LOG_AHEAD)
    assert differences == 0
    assert steady["pagein_bytes"] == 0
    assert round(steady["prefetch_bytes"] / 1e9, 2) == 5.31
    assert round(steady["ahead_pageout_bytes"] / 1e9, 2) == 5.02


OUT = "Memcpy DtoH (Device -> Pinned)"  # a page-out's copy, as torch.profiler names it


def traced(kind: str, name: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "cat": kind, "name": name, "ts": ts, "dur": dur, "args": args}


def compute_gap(first_ends: float, second_launched: float, second_starts: float) -> list[dict]:
    """The compute stream (7, the busiest): a gemm from 0, then a softmax 100 us long, each
    launched by the host at the times given."""
    return [
        traced("kernel", "gemm", 0, first_ends, stream=7, correlation=1),
        traced("kernel", "softmax", second_starts, 100, stream=7, correlation=2),
        traced("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
        traced("cuda_runtime", "cudaLaunchKernel", second_launched, 5, correlation=2),
    ]


def test_a_gap_the_compute_stream_waited_out_names_the_work_it_waited_for(capsys):
    # The softmax was launched at once but started only when a 64 MiB copy out on stream 23
    # ended: a wait on that stream.
    events = [
        *compute_gap(first_ends=2000, second_launched=2010, second_starts=3100),
        traced("gpu_memcpy", OUT, 100, 2980, stream=23, bytes=64 << 20),
        traced("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 100, 500, stream=24, bytes=1 << 20),
    ]
    gaps = lms_step_timeline.analyse(events, gap_us=50.0, show=4)
    assert len(gaps) == 1
    ms, _, cause, after = gaps[0]
    assert ms == 1.1 and after == "softmax"
    assert cause == f"waited on another stream (stream 23: {OUT}, 64 MiB)"
    assert "stream 23" in capsys.readouterr().out


def test_a_trace_kept_with_python_frames_names_where_the_work_after_a_gap_was_launched(capsys):
    # As at GPT-2 medium's step end: the loss's read back (launched at 2010 us from step(),
    # inside the probe's one()) started only when a 200 MiB page-out ended. The innermost four
    # Python functions around the launch are named, outermost first; those of another thread
    # or that ended before the launch are not.
    python = "python_function"
    events = [
        *compute_gap(first_ends=2000, second_launched=2010, second_starts=3100),
        traced("gpu_memcpy", OUT, 100, 2980, stream=23, bytes=200 << 20),
        traced(python, "/work/scripts/lms_state_split.py(1174): <module>", 0, 4000),
        traced(python, "/work/scripts/lms_state_split.py(1046): main", 1, 3990),
        traced(python, "/work/scripts/lms_state_split.py(958): run_one", 2, 3980),
        traced(python, "/work/scripts/lms_state_split.py(843): one", 3, 3970),
        traced(python, "/work/scripts/profile_lms_session.py(54): step", 1500, 1600),
        traced(python, "/work/torch/optim/optimizer.py(512): wrapper", 1600, 300),  # ended
        {**traced(python, "/work/autograd.py(1): elsewhere", 0, 4000), "tid": 2},
    ]
    lms_step_timeline.analyse(events, gap_us=50.0, show=4)
    printed = capsys.readouterr().out
    stack = "lms_state_split.py(1046): main > lms_state_split.py(958): run_one > "
    stack += "lms_state_split.py(843): one > profile_lms_session.py(54): step"
    assert f"             launched from {stack}\n" in printed
    # Recorded without Python frames: no such line.
    lms_step_timeline.analyse(events[:5], gap_us=50.0, show=4)
    assert "launched from" not in capsys.readouterr().out


def test_each_copy_direction_says_when_the_link_was_used(capsys):
    # A copy in from 0.3 to 0.8 ms and two copies out, 0.2-0.9 and 2.5-3.1 ms, against the
    # compute stream's first work at 0: both directions are named with their first start and
    # last end, and the copies out count once for their busy time (1.3 ms). A 4-byte copy out
    # at 0.05 ms (a loss read back) counts in the busy time, not in when the link was used.
    events = [
        *compute_gap(first_ends=2000, second_launched=2010, second_starts=3100),
        traced("gpu_memcpy", OUT, 50, 10, stream=7, bytes=4),
        traced("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 300, 500, stream=24, bytes=1 << 20),
        traced("gpu_memcpy", OUT, 200, 700, stream=23, bytes=1 << 20),
        traced("gpu_memcpy", OUT, 2500, 600, stream=25, bytes=1 << 20),
    ]
    lms_step_timeline.analyse(events, gap_us=50.0, show=4)
    printed = capsys.readouterr().out
    span = "those of a MiB or more from"
    assert f"HtoD copies (all streams): 1, 0.00 GB, busy 0.5 ms, {span} 0.3 to 0.8 ms" in printed
    assert f"DtoH copies (all streams): 3, 0.00 GB, busy 1.3 ms, {span} 0.2 to 3.1 ms" in printed


def test_each_host_thread_is_charged_with_its_outermost_operators_and_its_cuda_calls(capsys):
    # Thread 1 (training): an operator 0-1000 us enclosing one at 100-300 and another at
    # 2000-2500: 1.5 ms under its outermost operators. Thread 2 (autograd): one operator of
    # 3 ms and three event queries of 0.1 ms. Autograd's thread, which spent more, comes first.
    op = "cpu_op"
    events = [
        *compute_gap(first_ends=2000, second_launched=2010, second_starts=3100),
        {**traced(op, "aten::linear", 0, 1000), "tid": 1},
        {**traced(op, "aten::addmm", 100, 200), "tid": 1},
        {**traced(op, "aten::add_", 2000, 500), "tid": 1},
        {**traced(op, "autograd::engine::evaluate_function", 500, 3000), "tid": 2},
        *({**traced("cuda_runtime", "cudaEventQuery", 600 + i, 100), "tid": 2} for i in range(3)),
    ]
    for e in events[:4]:
        e.setdefault("tid", 1)
    lms_step_timeline.analyse(events, gap_us=50.0, show=4)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  thread ")]
    calls = "CUDA calls: cudaEventQuery 3 / 0.3 ms"
    assert lines[0] == f"  thread 2: 3.0 ms under 1 operators; {calls}"
    assert lines[1].startswith("  thread 1: 1.5 ms under 3 operators; CUDA calls: cudaLaunchKernel")


def test_a_gap_the_host_was_late_for_names_no_stream():
    events = [
        *compute_gap(first_ends=100, second_launched=1090, second_starts=1100),
        traced("gpu_memcpy", OUT, 100, 990, stream=23, bytes=1 << 20),
    ]
    [(_, _, cause, _)] = lms_step_timeline.analyse(events, gap_us=50.0, show=4)
    assert cause == "host late (Python)"


@pytest.mark.skipif(not Path(thread_cpu.TASKS).is_dir(), reason="needs Linux's /proc")
def test_a_thread_that_spins_through_a_step_is_charged_with_it_and_a_sleeping_one_is_not():
    import threading
    import time

    go, stop = threading.Event(), threading.Event()

    def spin():
        go.wait()
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    sleeper = threading.Thread(target=stop.wait)
    for t in (spinner, sleeper):
        t.start()

    def step():  # the training thread sleeps while the spinner burns 50 ms of CPU
        go.set()
        time.sleep(0.05)

    try:
        walls, per_thread = thread_cpu.cpu_per_step(step, 2, lambda: None, time.perf_counter)
    finally:
        stop.set()
        for t in (spinner, sleeper):
            t.join()
    assert len(walls) == 2 and all(wall >= 50 for wall in walls)

    def spent(thread: threading.Thread) -> list[float]:
        # Keyed "tid:name"; other threads of the process (a library's pool) are not ours.
        [key] = [k for k in per_thread if k.split(":")[0] == str(thread.native_id)]
        return per_thread[key]

    assert all(ms >= 10 for ms in spent(spinner))
    assert all(ms < 5 for ms in spent(sleeper))


def process(
    step_s: float, lag_s: float, losses: list[float], peak_gib=10.0, alloc_retries=0.0, **extra
) -> dict:
    """One --one process's result: three steps around `step_s`, each queued `lag_s` before it
    ended."""
    steps = [step_s - 0.01, step_s, step_s + 0.02]
    return {
        "step_s": step_s,
        "steps_s": steps,
        "queued_s": [s - lag_s for s in steps],
        "peak_gib": peak_gib,
        "losses": losses,
        "alloc_retries": alloc_retries,
        **extra,
    }


@pytest.mark.parametrize("watch", ["operators", "modules"])
def test_the_residency_line_says_how_an_iteration_is_watched_and_what_it_holds(watch):
    import torch_uvm_saver as tus

    session = tus.lms_session(8 * GiB, device="cpu", budget=4 * GiB, watch=watch)
    line = lms_state_split.residency_line(session, 3 * GiB, 5 * GiB)
    session.close()
    how = "operators" if watch == "operators" else "off"  # no iteration has begun
    assert line == (
        f"RESIDENCY watch={how} resident=0.00 budget_here=4.00 allocated=3.00 reserved=5.00"
    )


def test_the_residency_probe_follows_a_session_from_recording_to_acting_on_events():
    sys.path.insert(0, str(ROOT / "tests" / "sim"))
    from lms_training import make_model, session_for, train

    model, optimizer = make_model()
    session = session_for(model, optimizer, watch="modules")
    lines = []
    model[-1].register_forward_hook(
        lambda *_: lines.append(lms_state_split.residency_line(session, 0, 0))
    )
    train(model, optimizer, session, steps=4)
    session.close()
    # AdamW makes its state in the first iteration, so the second is recorded again.
    assert [line.split()[1] for line in lines] == ["watch=record"] * 2 + ["watch=act"] * 2


def test_a_trend_line_shows_each_steps_own_paging_and_how_it_was_watched():
    sys.path.insert(0, str(ROOT / "tests" / "sim"))
    from lms_training import make_model, session_for, train

    model, optimizer = make_model()
    session = session_for(model, optimizer, watch="modules")
    lines = []
    for index in range(4):
        before = session.stats()
        train(model, optimizer, session, steps=1)
        after = session.stats()
        moved = {k: after[k] - before[k] for k in after}
        lines.append(lms_state_split.trend_line(index, 2, 0.25, 0, moved))
    session.close()
    assert lines[0].startswith("step  1 warm-up 0.250 s, 0 retries, out ")
    assert lines[3].startswith("step  4 timed   0.250 s, 0 retries, out ")
    # AdamW makes its state in the first iteration, so the second is recorded again.
    assert [line.rsplit(", ", 1)[1] for line in lines] == ["watched by operators"] * 2 + [
        "watched by events"
    ] * 2


def test_a_trend_line_puts_bytes_in_gb_and_counts_as_they_are():
    moved = {key: 0 for key, _, _ in lms_state_split.TREND}
    moved.update(pageout_bytes=1_700_000_000, near_misses=26, quiet_iterations=1)
    line = lms_state_split.trend_line(11, 4, 0.4861, 1, moved)
    assert line == (
        "step 12 timed   0.486 s, 1 retries, out 1.70 GB, ahead 0.00 GB, in 0.00 GB, "
        "dead 0.00 GB, misses 26, oom 0, deviations 0, caps 0, quiet"
    )


def test_a_trend_line_without_a_session_has_only_the_time_and_retries():
    assert lms_state_split.trend_line(0, 1, 0.1234, 2, {}) == "step  1 warm-up 0.123 s, 2 retries"


def test_a_trend_line_says_what_the_host_did_in_the_step():
    host = {"queued": 0.2, "user": 0.19, "system": 0.015, "preempted": 3, "steal": 0.04}
    line = lms_state_split.trend_line(4, 4, 0.25, 0, {}, host)
    assert line == (
        "step  5 timed   0.250 s, 0 retries, queued 0.200 s, cpu 0.190+0.015 s, "
        "preempted 3, steal 0.04 s"
    )


class _Clock:
    """A perf_counter that moves only when told: the alternating probe's figures are exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_the_alternating_probe_puts_each_side_in_its_own_steps_and_turns_the_switch_off(
    monkeypatch, capsys
):
    clock = _Clock()
    monkeypatch.setattr(lms_state_split, "time", clock)
    monkeypatch.setattr(timed_calls, "time", clock)

    class FakeSession:
        def __init__(self) -> None:
            self.fast = True
            self.sides: list[bool] = []

        def _page_out_all(self, blocks) -> None:
            clock.now += 0.002 if self.fast else 0.006

        def _prefetch_all(self, blocks) -> None:
            clock.now += 0.001 if self.fast else 0.004

    session = FakeSession()
    real_methods = (FakeSession._page_out_all, FakeSession._prefetch_all)
    queued: list[float] = []

    def one() -> None:
        session.sides.append(session.fast)
        session._page_out_all([])
        session._prefetch_all([])
        clock.now += 0.1
        queued.append(clock.now)
        clock.now += 0.01  # the device's tail after the host queued the step

    toggles = [lambda on: setattr(session, "fast", not on)]
    lms_state_split.print_alternating(one, session, toggles, 3, queued, synchronize=lambda: None)
    lines = capsys.readouterr().out.splitlines()
    assert session.sides == [True, False] * 3
    assert session.fast is True  # left off
    assert (FakeSession._page_out_all, FakeSession._prefetch_all) == real_methods
    assert lines[1].split() == ["off", "0.113", "0.103", "0", "2.0", "1.0"]
    assert lines[2].split() == ["on", "0.120", "0.110", "0", "6.0", "4.0"]


def test_a_timed_function_answers_as_before_and_adds_each_call_to_its_label(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(timed_calls, "time", clock)

    def work(x: int) -> int:
        """Doubles x."""
        clock.now += 0.5
        if x < 0:
            raise ValueError("negative")
        return 2 * x

    spent: dict = collections.Counter()
    calls: dict = collections.Counter()
    timed = timed_calls.timed_into(work, "work", spent, calls)
    assert timed(3) == 6 and timed.__name__ == "work"
    with pytest.raises(ValueError, match="negative"):
        timed(-1)  # a call that raises is timed and counted too
    assert spent == {"work": 1.0} and calls == {"work": 2}


def test_each_switch_the_alternating_probe_turns_goes_on_and_back_off():
    sys.path.insert(0, str(ROOT / "tests" / "sim"))
    from lms_training import make_model, session_for

    model, optimizer = make_model()
    # As run_one makes it for the probe: the autocast switches' hooks are the probe's own.
    session = session_for(model, optimizer, watch="modules", clear_autocast_cache=False)
    session._copies = SimpleNamespace(native=True)  # a CPU session queues no copies
    check = session._check_margin
    owners = sum(next(m.parameters(recurse=False), None) is not None for m in model.modules())

    def hooks() -> int:
        return sum(len(m._forward_hooks) for m in model.modules())

    before = hooks()
    toggles = lms_state_split.switch_toggles(
        session, model, frozenset({"pycopies", "noahead", "nomiss", "clear", "noareas"})
    )
    for toggle in toggles:
        toggle(True)
    assert session._host_state.areas is False
    assert session._copies.native is False
    assert session._planner.page_out_ahead is False
    assert session._check_margin is not check
    assert hooks() == before + owners  # clearing in every iteration
    for toggle in toggles:
        toggle(False)
    assert session._host_state.areas is True
    assert session._copies.native is True
    assert session._planner.page_out_ahead is True
    assert session._check_margin == check
    assert hooks() == before  # the cache kept, as the session was opened
    (events,) = lms_state_split.switch_toggles(session, model, frozenset({"events"}))
    events(True)
    assert hooks() == before + owners
    events(False)
    assert hooks() == before
    refusals = (
        ({"inplace"}, "inplace"),
        ({"keep"}, "not keep"),
        ({"retrymiss"}, "compare processes"),
        ({"nodefer"}, "cannot compare nodefer"),
        ({"clear", "events"}, "contra"),
    )
    for refused, says in refusals:
        with pytest.raises(ValueError, match=says):
            lms_state_split.switch_toggles(session, model, frozenset(refused))
    session.close()

    model, optimizer = make_model()
    session = session_for(model, optimizer, watch="operators", clear_autocast_cache=False)
    with pytest.raises(ValueError, match="watched by modules"):
        lms_state_split.switch_toggles(session, model, frozenset({"events"}))
    session.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux's affinity calls")
def test_the_cpu_scan_times_each_allowed_cpu_and_gives_the_process_all_of_them_back(capsys):
    allowed = os.sched_getaffinity(0)
    speeds = cpu_speed_scan.cpu_speeds(runs=1)
    assert set(speeds) == allowed and all(ms > 0 for ms in speeds.values())
    assert os.sched_getaffinity(0) == allowed
    sys.argv = ["cpu_speed_scan.py", "--count", "1"]
    cpu_speed_scan.main()
    out, err = capsys.readouterr()
    assert int(out.strip()) in allowed
    assert len(err.splitlines()) == len(allowed) and err.startswith("cpu ")


@pytest.mark.parametrize("quiet", [True, False], ids=["quiet", "watched"])
def test_the_worker_switch_steps_groups_on_its_thread_only_in_quiet_iterations(quiet):
    # The experiment worker (not kept): step_in_backward's group steps on a thread of their own
    # where the session runs quiet, inline where it watches; training is the same bit for bit.
    sys.path.insert(0, str(ROOT / "tests" / "sim"))
    import threading

    from lms_training import assert_trained_alike, make_model, session_for, train

    import torch_uvm_saver as tus
    from torch_uvm_saver.step_in_backward import StepInBackward

    def run(worker: bool):
        model, optimizer = make_model(groups=True)
        # A budget that holds everything: iterations go quiet after the first, unless told not to.
        session = session_for(model, optimizer, budget=10**8, quiet=quiet)
        overlap = tus.step_in_backward(optimizer, free_gradients=True, modules=[model])
        threads = []
        if worker:
            real = StepInBackward._step_group
            overlap._step_group = lambda group: (
                threads.append(threading.current_thread().name),
                real(overlap, group),
            )
            switch, stop = lms_state_split.group_steps_on_a_thread(overlap, optimizer, session)
            switch(True)
        losses = train(model, optimizer, session, steps=4)
        if worker:
            stop()  # a thread left waiting at exit is a leak to the sanitizer's checks
            assert not any(t.name == "group-steps" for t in threading.enumerate())
        stats = session.stats()
        overlap.remove()
        session.close()
        return losses, list(model.parameters()), threads, stats

    inline = run(worker=False)
    threaded = run(worker=True)
    assert_trained_alike(threaded[0], threaded[1], inline[0], inline[1])
    groups = 6  # a group a block, each stepped once an iteration
    if quiet:
        # The first step makes the state (the session's held bytes grow): the second is
        # watched too, the last two quiet.
        assert threaded[3]["quiet_iterations"] == 2
        assert threaded[2] == ["MainThread"] * 2 * groups + ["group-steps"] * 2 * groups
    else:
        assert threaded[3]["quiet_iterations"] == 0
        assert threaded[2] == ["MainThread"] * 4 * groups


def test_the_autocast_switches_pick_the_sessions_clearing():
    clearing = lms_state_split.autocast_clearing
    assert clearing(frozenset()) == "auto"  # the session's default, as the benchmark runs it
    assert clearing(frozenset({"clear", "nomiss"})) is True
    assert clearing(frozenset({"events"})) == "events"
    assert clearing(frozenset({"keep"})) is False
    # Alternated, the probe's hooks clear: the session keeps the cache.
    assert clearing(frozenset(), frozenset({"events"})) is False
    assert clearing(frozenset(), frozenset({"pycopies"})) == "auto"
    for both in ({"clear", "events"}, {"events", "keep"}, {"clear", "keep"}):
        with pytest.raises(ValueError, match="contradict"):
            clearing(frozenset(both))
    with pytest.raises(ValueError, match="contradict"):
        clearing(frozenset({"keep"}), frozenset({"events"}))


def test_the_host_clock_moves_with_the_cpu_this_process_spends():
    before = lms_state_split.host_clock()
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    after = lms_state_split.host_clock()
    assert after["user"] + after["system"] - before["user"] - before["system"] >= 0.04
    assert after["steal"] >= before["steal"] >= 0


def test_rounds_of_processes_make_one_row_a_configuration_against_the_first(capsys):
    staged = {"host_gib": 9.16, "staged_gb": 19.7}
    results = {
        "baseline": [process(0.30, 0.017, [11.0, 10.0]), process(0.24, 0.017, [11.0, 10.0])],
        "helper,1": [
            process(0.40, 0.030, [11.0, 10.002], peak_gib=16.6, alloc_retries=2.0, **staged),
            None,  # a process that failed
            process(0.36, 0.010, [11.001, 10.0], 16.5, 1.0, host_loop_ms=23.4, **staged),
        ],
    }
    rows = lms_state_split.summarize(["baseline", "helper,1"], results)
    base, helper = rows
    assert base["step_s"] == pytest.approx(0.27) and base["step_range"] == (0.24, 0.30)
    assert helper["step_s"] == pytest.approx(0.38) and helper["step_range"] == (0.36, 0.40)
    assert (helper["processes"], helper["failed"]) == (3, 1)
    assert helper["vs_first"] == pytest.approx(0.27 / 0.38)
    assert helper["lag_ms"] == pytest.approx(20.0)  # the median of 30, 30, 30, 10, 10, 10 ms
    assert helper["peak_gib"] == 16.6 and helper["staged_gb"] == pytest.approx(19.7)
    assert helper["loss_diff"] == pytest.approx(0.002)
    assert helper["retries"] == pytest.approx(1.5) and base["retries"] == 0
    lms_state_split.print_table(rows)
    printed = capsys.readouterr().out
    assert "helper,1 | 0.380 (0.360-0.400, 1 of 3 failed) | 0.71x | 20 | 16.60" in printed
    # Each process beside its CPU's speed for Python (one from before the figure was kept)
    assert "| 9.16 | 0.00 | 19.70 | 1.50 | 2.0e-03 | 0.400 0.360@23\n" in printed


def test_a_configuration_whose_every_process_failed_is_a_row_that_says_so(capsys):
    results = {"baseline": [process(0.25, 0.0, [1.0])], "0.25,1": [None, None]}
    rows = lms_state_split.summarize(["baseline", "0.25,1"], results)
    assert "step_s" not in rows[1] and rows[1]["failed"] == 2
    lms_state_split.print_table(rows)
    assert "0.25,1 | failed (2 of 2)" in capsys.readouterr().out


def test_rounds_forward_the_probe_and_print_each_process_output_under_its_result(
    monkeypatch, capsys
):
    import json
    import subprocess
    from types import SimpleNamespace

    commands = []

    def fake_run(command, **_):
        commands.append(command)
        config = command[command.index("--one") + 1]
        if config == "0.25,1":
            return SimpleNamespace(returncode=1, stdout="", stderr="OutOfMemoryError: ...")
        step = {"baseline": 0.25, "helper,1": 0.35}[config]
        result = process(step, 0.01, [11.0])
        stdout = f"step {step * 1e3:.0f} ms; CPU a step by thread:\nSPLIT {json.dumps(result)}\n"
        return SimpleNamespace(returncode=0, stdout=stdout, stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(lms_state_split.torch.cuda, "get_device_name", lambda: "a GPU")
    argv = ["lms_state_split.py", "--limit-gib", "16.66", "--rounds", "2", "--probe", "threads"]
    argv += ["--configs", "baseline helper,1 0.25,1"]
    monkeypatch.setattr(sys, "argv", argv)
    lms_state_split.main()
    printed = capsys.readouterr().out
    order = [c[c.index("--one") + 1] for c in commands]
    assert order == ["baseline", "helper,1", "0.25,1"] * 2  # in turn, round after round
    assert all(c[c.index("--probe") + 1] == "threads" for c in commands)
    assert "  helper,1| step 350 ms; CPU a step by thread:" in printed
    assert "0.25,1: failed (rc 1): OutOfMemoryError" in printed
    assert "helper,1 | 0.350 (0.350-0.350) | 0.71x | 10 |" in printed
    assert "0.25,1 | failed (2 of 2)" in printed


def test_a_configuration_carries_its_own_switches_and_an_unknown_one_is_refused(
    monkeypatch, capsys
):
    calls = []

    def fake_run_one(limit, share, free, *args, **kwargs):
        calls.append((share, free, kwargs["switches"]))
        return {"step_s": 0.2}

    monkeypatch.setattr(lms_state_split, "run_one", fake_run_one)
    argv = ["lms_state_split.py", "--limit-gib", "8.94", "--one", "helper,1+clear+noahead"]
    monkeypatch.setattr(sys, "argv", argv)
    lms_state_split.main()
    assert calls == [("helper", True, frozenset({"clear", "noahead"}))]
    assert 'SPLIT {"step_s": 0.2}' in capsys.readouterr().out

    monkeypatch.setattr(sys, "argv", [*argv[:-1], "0.4,0+inplace+fast"])
    with pytest.raises(SystemExit):
        lms_state_split.main()
    assert "unknown switch ['fast']" in capsys.readouterr().err
    assert len(calls) == 1  # nothing ran


def test_host_speed_table_puts_each_condition_against_the_idle_gpu():
    results = {
        "idle": {"python": [0.040, 0.042, 0.060], "launches": [0.030] * 3, "memory": [0.008] * 3},
        "both": {"python": [0.048, 0.050, 0.047], "launches": [0.033] * 3, "memory": [0.016] * 3},
    }
    lines = host_speed_under_copies.report(results, {"idle": 0, "both": 3}, rounds=3)
    assert lines[0] == (
        "condition | Python loop ms (x idle) | 3,000 launches ms (x idle) | "
        "host memcpy 256 MiB ms (x idle) | copying at the end"
    )
    assert lines[1] == "idle | 42.0 (1.00x) | 30.0 (1.00x) | 8.0 (1.00x) | 0 of 3"
    assert lines[2] == "both | 48.0 (1.14x) | 33.0 (1.10x) | 16.0 (2.00x) | 3 of 3"


def test_every_function_the_host_probe_times_is_there_to_time():
    # A renamed session method would drop out of --probe host without a word: it wraps what it
    # finds by name.
    import importlib

    for module_name, owner_name, name in lms_state_split.HOST_TIMED:
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        assert callable(getattr(owner, name, None)), f"{module_name}.{owner_name}.{name}"


def test_a_cpu_list_reads_as_sysfs_writes_it():
    assert pinned_numa_bandwidth.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert pinned_numa_bandwidth.parse_cpulist("5") == {5}


def test_every_cpu_this_process_may_run_on_belongs_to_a_node():
    nodes = pinned_numa_bandwidth.node_cpus()
    assert nodes and set().union(*nodes.values()) >= os.sched_getaffinity(0)


def test_the_pages_of_a_large_buffer_are_counted_on_their_nodes():
    import mmap

    pages = 4096
    buffer = mmap.mmap(-1, pages * 4096)
    buffer.write(b"x" * len(buffer))  # touched: each page is on some node now
    counted = sum(pinned_numa_bandwidth.pages_by_node(min_pages=pages).values())
    assert counted >= pages
    buffer.close()


_MAIN = 'process 7:"python train.py";thread (7): MainThread;main (train.py:10)'
_AUTOGRAD = 'process 7:"python train.py";thread (9)'
RAW_RECORDING = f"""\
{_MAIN};step (train.py:4);_before (/x/lms_session.py:990) 6
{_MAIN};step (train.py:5) 3
{_AUTOGRAD} 2
{_AUTOGRAD};hook (/x/lms_events.py:170);_before (/x/lms_session.py:991) 4
not a sample line
"""


def test_a_pyspy_recording_counts_each_function_once_a_sample(capsys):
    recording = pyspy_summary.read_recording(RAW_RECORDING.splitlines(keepends=True))
    assert recording.total == 15 and recording.frameless == 2
    assert recording.threads == {"thread (7): MainThread": 9, "thread (9)": 6}
    # Lines of one function count together; a function is counted once per stack.
    assert recording.self_samples == {"_before (lms_session.py)": 10, "step (train.py)": 3}
    assert recording.inclusive["step (train.py)"] == 9
    assert recording.inclusive["_before (lms_session.py)"] == 10
    assert pyspy_summary.callers(recording, "_before", depth=1) == {
        "_before (lms_session.py:990) <- step (train.py:4)": 6,
        "_before (lms_session.py:991) <- hook (lms_events.py:170)": 4,
    }
    # 10 samples at 400 Hz over 5 steps: 5 ms a step.
    pyspy_summary.print_summary(recording, steps=5, rate=400.0, names=("_before",))
    out = capsys.readouterr().out
    assert "     10  66.7%    5.00 ms/step  _before (lms_session.py)" in out
    assert "(no Python frame: C++ holding the GIL)" in out


def test_a_retry_in_a_recorded_iteration_teaches_a_cap_with_retrymiss():
    # The switch retrymiss: PyTorch's allocator retrying inside an operator of a recorded
    # iteration is a near miss there. Faked: the retry count steps up once, as the last block
    # of each recorded iteration ends; allocated bytes stay 0 (the cap is a 32nd of the limit).
    sys.path.insert(0, str(ROOT / "tests" / "sim"))
    from lms_training import assert_trained_alike, make_model, session_for, train

    def run(retrymiss):
        model, optimizer = make_model()
        session = session_for(model, optimizer, watch="modules")
        session._allocated = lambda: 0  # no near miss by allocated bytes
        retries = [0]
        if retrymiss:
            read = lambda: {"num_alloc_retries": retries[0], "allocated_bytes.all.current": 0}  # noqa: E731
            lms_state_split.learn_from_retries(session, read)
        model[-1].register_forward_hook(lambda *_: retries.__setitem__(0, retries[0] + 1))
        losses = train(model, optimizer, session, steps=5)
        stats = session.stats()
        session.close()
        return losses, list(model.parameters()), stats

    reference, got = run(retrymiss=False), run(retrymiss=True)
    assert_trained_alike(got[0], got[1], reference[0], reference[1])
    # One retry in each of the two recordings (the first iteration makes AdamW's state); the
    # three replayed iterations retry too, but teach nothing.
    assert got[2]["near_misses"] == 2 and reference[2]["near_misses"] == 0
    assert got[2]["capped_positions"] == reference[2]["capped_positions"] + 1
    assert got[2]["event_iterations"] == 3 and got[2]["event_deviations"] == 0

    model, optimizer = make_model()
    session = session_for(model, optimizer, watch="operators")
    with pytest.raises(ValueError, match="watched by modules"):
        lms_state_split.learn_from_retries(session)
    session.close()


def test_the_small_read_table_starts_from_its_baseline_and_gives_each_piece_size_a_row():
    cases = small_read_behind_copies.cases(512 << 20, "128,2")
    assert cases == [
        ("nothing beside", None),
        ("whole", 512 << 20),
        ("pieces of 128 MiB", 128 << 20),
        ("pieces of 2 MiB", 2 << 20),
    ]
    line = small_read_behind_copies.row("pinned", "whole", [9.7, 9.8, 9.75], [55.0, 55.4, 55.2])
    assert line.split() == ["pinned", "whole", "9.75", "9.70-", "9.80", "55.2"]
    baseline = small_read_behind_copies.row("pageable", "nothing beside", [0.02, 0.01], None)
    assert baseline.split()[-1] == "-"


def test_the_block_end_cost_script_times_the_walk_and_the_question_on_cpu(capsys):
    result = lms_block_end_cost.main(["--device", "cpu", "--repeat", "3"])
    assert set(result) == {"walk_us", "group_question_us"}
    assert all(value > 0 for value in result.values())
    assert "the block's end walk" in capsys.readouterr().out


def test_the_cpu_host_cost_trains_the_same_losses_with_the_session_and_pages():
    printed = []
    small = ["--layers", "4", "--width", "32", "--steps", "3", "--warmup", "5", "--rounds", "1"]
    (result,) = session_host_cost_cpu.main(
        [*small, "--profile", "5", "--limit-share", "0.25"], say=printed.append
    )
    (plain_s, plain_losses, _), (session_s, session_losses, stats) = (
        result["baseline"],
        result["session"],
    )
    assert session_losses == plain_losses and len(plain_losses) == 8  # bit for bit
    assert stats["pageout_bytes"] > 0 and stats["event_iterations"] > 0  # it paged, by events
    assert plain_s > 0 and session_s > 0
    assert printed[0].startswith("round 1: without ") and "losses equal" in printed[0]
    assert len(printed) == 2 + 5 and any("lms_events.py" in line for line in printed[2:])


def test_the_cpu_host_cost_times_the_sessions_parts_unprofiled():
    printed = []
    small = ["--layers", "4", "--width", "32", "--steps", "3", "--warmup", "5", "--rounds", "1"]
    (result,) = session_host_cost_cpu.main([*small, "--parts"], say=printed.append)
    assert result["session"][1] == result["baseline"][1]  # the wrappers change no arithmetic
    assert printed[1] == "the session's parts, a step (unprofiled, 3 steps):"
    parts = result["parts"]
    events = parts["events (the planner calls and copy batches they start included)"]
    assert 0 < parts["planner.before_use"] < events  # most of its calls from the events
    assert parts["copy batches (started by events, gradients, operators)"] > 0  # it pages
    assert any(line.endswith("planner.before_use") for line in printed[2:])


def test_the_cpu_host_cost_says_what_hugging_faces_model_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # its import fails as if absent
    with pytest.raises(SystemExit, match="--model gpt2 needs transformers"):
        session_host_cost_cpu.main(["--model", "gpt2", "--layers", "2", "--rounds", "1"])


def test_the_cold_cost_replays_a_logged_step_warm_and_cold():
    printed = []
    result = planner_cold_cost.main(
        [str(PLANNER_LOG_AHEAD), "--evict-mib", "1", "--repeat", "1"], say=printed.append
    )
    assert set(result) == {"warm", "cold"}
    for side in result.values():  # every kind the log calls, and the property read
        assert {"before_use", "add", "remove", "end_iteration", "a property read"} <= set(side)
        assert all(us > 0 for us in side.values())
    assert printed[0].startswith("call") and "1 MiB written before each before_use" in printed[0]
    assert any(line.startswith("before_use") for line in printed[1:])


def test_the_parts_of_the_gpu_suite_run_each_case_once():
    ids = [f"tests/gpu/test_scenarios.py::test_scenario[case{i}]" for i in range(7)]
    parts = [run_gpu_tests.part_of(ids, f"{k}/3") for k in (1, 2, 3)]
    assert parts[0] == ids[0::3] and parts[1] == ids[1::3]  # round robin: long cases spread
    assert sorted(case for part in parts for case in part) == sorted(ids)
    assert run_gpu_tests.part_of(ids, None) == ids and run_gpu_tests.part_of(ids, "1/1") == ids
    for bad in ("0/2", "3/2", "2", "a/b"):
        with pytest.raises(SystemExit, match="--part"):
            run_gpu_tests.part_of(ids, bad)


def _blocks_and_optimizer(seed: int):
    import torch

    torch.manual_seed(seed)
    blocks = torch.nn.ModuleList(
        torch.nn.Sequential(
            torch.nn.Linear(24, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 24)
        )
        for _ in range(3)
    )
    return blocks, torch.optim.AdamW(blocks.parameters(), lr=1e-2, fused=True)


def test_the_flat_switch_lays_each_block_out_in_one_storage_and_trains_bit_for_bit():
    import torch

    plain, plain_optimizer = _blocks_and_optimizer(0)
    flat, flat_optimizer = _blocks_and_optimizer(0)
    no_state = {id(p) for p in flat[2].parameters()}  # a host group's: its state left alone
    assert lms_state_split.flatten_blocks(flat, flat_optimizer, no_state) == 3 + 2 * 2
    for block in flat:
        assert len({p.untyped_storage().data_ptr() for p in block.parameters()}) == 1
    assert not any(flat_optimizer.state[p] for p in flat[2].parameters())
    moments = {
        flat_optimizer.state[p]["exp_avg"].untyped_storage().data_ptr()
        for p in flat[0].parameters()
    }
    assert len(moments) == 1
    x = torch.randn(5, 24)
    for _ in range(3):
        for blocks, optimizer in ((plain, plain_optimizer), (flat, flat_optimizer)):
            y = x
            for block in blocks:
                y = block(y)
            y.square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), flat.parameters()))


def test_the_helper_configuration_takes_every_keyword_the_benchmark_takes():
    import torch_uvm_saver as tus

    blocks, optimizer = _blocks_and_optimizer(0)
    state_bytes = 2 * sum(p.nbytes for p in blocks.parameters())
    limit = state_bytes // 2  # the helper sends state to the host
    helper = lms_state_split.session_placement("helper", blocks, optimizer, limit, True)
    assert helper == tus.suggest_placement([blocks], [optimizer], limit, gradients_freed=True)
    assert helper["state_returns"] is True
    share = lms_state_split.session_placement("1", blocks, optimizer, limit, True)
    assert share == {"optimizer_state": optimizer.param_groups}
