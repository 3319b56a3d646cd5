"""How bench_oversubscription.py makes one column's result of several processes (--processes):
the figures of the median process, the highest peak, each process's step kept. No GPU needed:
the results are what children report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_oversubscription as bench  # noqa: E402
from oversub_child import settle  # noqa: E402
from oversub_report import analyze, ideal_of, losses_line, make_row, row_line  # noqa: E402

GiB = 1 << 30


def child_result(step: float, peak_gib: float, tag: str) -> dict:
    return {
        "step_median_s": step,
        "step_s": [step] * 3,
        "peak_bytes": int(peak_gib * GiB),
        "tokens_per_step": 8192,
        "losses": [1.0],
        "tag": tag,
        "wall_s": 30.0,
        "host_python_ms": [22.0, 24.0],
    }


def test_one_process_is_its_own_result():
    only = child_result(0.2, 8.0, "a")
    assert bench.combine_processes([only]) is only


def test_the_median_process_gives_the_figures_and_the_highest_peak_is_kept():
    results = [
        child_result(0.25, 8.0, "slow"),
        child_result(0.19, 8.5, "fast"),
        child_result(0.21, 8.2, "middle"),
    ]
    combined = bench.combine_processes(results)
    assert combined["tag"] == "middle" and combined["step_median_s"] == 0.21
    assert combined["peak_bytes"] == int(8.5 * GiB)  # a limit holds only if it held in all
    assert combined["process_step_medians"] == [0.19, 0.21, 0.25]
    assert [p["step_median_s"] for p in combined["processes"]] == [0.25, 0.19, 0.21]
    assert "warning" not in combined


def test_an_even_count_takes_the_slower_middle_process():
    results = [child_result(s, 8.0, str(s)) for s in (0.30, 0.20, 0.22, 0.26)]
    assert bench.combine_processes(results)["step_median_s"] == 0.26
    two = [child_result(s, 8.0, str(s)) for s in (0.375, 0.666)]
    assert bench.combine_processes(two)["step_median_s"] == 0.666  # the worse reading


def test_an_ideal_from_an_even_count_takes_the_faster_middle_reference():
    # The judged column takes its slower middle process; the reference of its ideal the faster
    # one, so that an even count makes no target easier (XL 2x: checkpointing 0.252 and 0.294 s).
    bandwidth = {"h2d": {"median_gbps": 50.0}, "d2h": {"median_gbps": 50.0}}
    two = bench.combine_processes([child_result(s, 27.0, str(s)) for s in (0.294, 0.252)])
    assert two["step_median_s"] == 0.294
    ideal = ideal_of(two, 17 * GiB, bandwidth)
    assert ideal["reference_step_s"] == 0.252 and ideal["step_s"] == 0.252
    four = bench.combine_processes([child_result(s, 27.0, str(s)) for s in (0.3, 0.2, 0.22, 0.26)])
    assert ideal_of(four, 17 * GiB, bandwidth)["reference_step_s"] == 0.22
    three = bench.combine_processes([child_result(s, 27.0, str(s)) for s in (0.3, 0.2, 0.22)])
    assert ideal_of(three, 17 * GiB, bandwidth)["reference_step_s"] == 0.22  # the median
    alone = ideal_of(child_result(0.25, 27.0, "one"), 17 * GiB, bandwidth)
    assert alone["reference_step_s"] == 0.25
    # A link-bound ideal stays the link's: 20 GiB out (and in) at 50 GB/s
    assert ideal_of(two, 7 * GiB, bandwidth)["step_s"] == pytest.approx(20 * GiB / 50e9)


def test_a_failed_process_is_named_and_the_others_still_count():
    results = [
        child_result(0.2, 8.0, "a"),
        {"error": "CUDA out of memory", "wall_s": 10.0},
        child_result(0.3, 8.0, "b"),
    ]
    combined = bench.combine_processes(results)
    assert combined["step_median_s"] == 0.3 and "error" not in combined
    assert combined["warning"] == "1 of 3 processes failed"
    assert combined["processes"][1]["error"] == "CUDA out of memory"


def test_all_failed_stays_a_failure():
    results = [{"error": "first"}, {"error": "second"}]
    assert bench.combine_processes(results)["error"] == "second"


def test_the_table_names_the_processes_range():
    combined = bench.combine_processes([child_result(s, 8.0, str(s)) for s in (0.19, 0.25, 0.2)])
    native = {"step_median_s": 0.1, "tokens_per_step": 8192, "losses": [1.0]}
    row = make_row(combined, "lms-v2-overlap", 9 * GiB, None, native)
    assert row["step_median_s"] == 0.2
    assert "3 processes 0.190-0.250 s" in row_line("lms-v2-overlap", row, {})


def test_the_table_says_how_fast_each_processs_cpu_ran_python():
    results = [child_result(s, 8.0, str(s)) for s in (0.19, 0.25, 0.2)]
    results[1]["host_python_ms"] = [38.5, 41.2]  # the slow process ran on a slow CPU
    combined = bench.combine_processes(results)
    assert combined["process_host_python_ms"] == [24.0, 24.0, 41.2]
    assert [p["host_python_ms"] for p in combined["processes"]][1] == [38.5, 41.2]
    native = {"step_median_s": 0.1, "tokens_per_step": 8192, "losses": [1.0]}
    row = make_row(combined, "lms-v2-overlap", 9 * GiB, None, native)
    lines = row_line("lms-v2-overlap", row, {}).splitlines()
    assert "3 processes 0.190-0.250 s" in lines[0]
    assert lines[1] == "    step / host loop: 0.190 s / 24 ms, 0.200 s / 24 ms, 0.250 s / 41 ms"
    alone = make_row(child_result(0.2, 8.0, "one"), "lms-v2-overlap", 9 * GiB, None, native)
    assert row_line("lms-v2-overlap", alone, {}).splitlines()[1] == (
        "    step / host loop: 0.200 s / 24 ms"
    )
    earlier = make_row(  # a result from before host_python_ms: no line
        {**child_result(0.2, 8.0, "old"), "host_python_ms": None},
        "lms-v2-overlap",
        9 * GiB,
        None,
        native,
    )
    assert len(row_line("lms-v2-overlap", earlier, {}).splitlines()) == 1


def test_back_to_back_steps_synchronize_only_around_the_run_and_count_its_end(monkeypatch):
    """--measure back-to-back: no device synchronization between steps; each step's time runs
    from the previous one's end, and the last one's takes the final synchronization (the work
    still queued) with it, so the times add up to the whole run."""
    import time

    import oversub_child

    calls = []

    def synchronize():  # the device finishing what the last step left queued
        calls.append(len(losses))
        if len(losses) == 3:
            time.sleep(0.05)

    losses = []

    def step():
        losses.append(len(losses))
        time.sleep(0.01)
        return float(losses[-1]), None

    monkeypatch.setattr(oversub_child.torch.cuda, "synchronize", synchronize)
    started = time.perf_counter()
    times, seen = oversub_child.back_to_back_steps(step, 3)
    whole = time.perf_counter() - started
    assert calls == [0, 3]  # before the first step and after the last, not between
    assert seen == [0.0, 1.0, 2.0]
    assert len(times) == 3 and all(t >= 0.01 for t in times)
    assert times[-1] >= 0.06  # the final synchronization is the last step's
    assert sum(times) == pytest.approx(whole, abs=0.005)


def test_the_table_gives_the_other_measure_under_each_row():
    results = [child_result(s, 8.0, str(s)) for s in (0.19, 0.25, 0.2)]
    for result, synchronized in zip(results, (0.23, 0.31, 0.22), strict=True):
        result.update(
            measure="back-to-back",
            synchronized_median_s=synchronized,
            back_to_back_median_s=result["step_median_s"],
        )
    combined = bench.combine_processes(results)
    native = {"step_median_s": 0.1, "tokens_per_step": 8192, "losses": [1.0]}
    row = make_row(combined, "lms-v2-overlap", 9 * GiB, None, native)
    assert row["step_median_s"] == 0.2 and row["measure"] == "back-to-back"
    lines = row_line("lms-v2-overlap", row, {}).splitlines()
    assert lines[-1] == "    synchronized: 0.220, 0.230, 0.310 s"
    alone = make_row(results[0], "lms-v2-overlap", 9 * GiB, None, native)
    assert row_line("lms-v2-overlap", alone, {}).splitlines()[-1] == "    synchronized: 0.230 s"
    earlier = make_row(child_result(0.2, 8.0, "old"), "lms-v2-overlap", 9 * GiB, None, native)
    assert row_line("lms-v2-overlap", earlier, {}).splitlines()[-1].startswith("    step / host")


def test_the_table_says_where_the_state_lived_and_what_came_back():
    native = {"step_median_s": 0.1, "tokens_per_step": 8192, "losses": [1.0]}
    result = child_result(0.3, 16.6, "xl")
    result["placement"] = "host for the last 20 of 25 parameter groups"
    result["session_stats"] = {
        "host_returned_groups": 7,
        "host_returned_bytes": 3_440_640_000,
        "host_placed_bytes": 6_389_760_000,
    }
    row = make_row(result, "lms-v2-overlap", 17 * GiB, None, native)
    assert row_line("lms-v2-overlap", row, {}).splitlines()[-1] == (
        "    optimizer state: host for the last 20 of 25 parameter groups; 7 back on the device "
        "(3.4 GB), 6.4 GB left on the host"
    )
    result["session_stats"] = {"host_returned_groups": 0, "host_placed_bytes": 9_830_400_000}
    row = make_row(result, "lms-v2-overlap", 17 * GiB, None, native)
    assert row_line("lms-v2-overlap", row, {}).splitlines()[-1] == (
        "    optimizer state: host for the last 20 of 25 parameter groups"
    )
    del result["placement"]  # a column that names none (lms-v2): no line
    row = make_row(result, "lms-v2", 17 * GiB, None, native)
    assert "optimizer state" not in row_line("lms-v2", row, {})


def test_the_host_loop_is_the_same_work_and_its_best_run_is_kept(monkeypatch):
    import _bench_common

    readings = iter([0.040, 0.022, 0.031])
    monkeypatch.setattr(_bench_common, "python_loop_s", lambda: next(readings))
    assert _bench_common.host_python_ms(runs=3) == pytest.approx(22.0)
    monkeypatch.undo()
    assert 0 < _bench_common.python_loop_s() < 5.0  # it runs here, on this CPU


def test_bytes_moved_count_the_state_staged_from_the_host_both_ways():
    # GPT-2 XL at 2x pages nothing and stages its state: 0 GB a step was reported before.
    from oversub_child import session_result

    before = {"pageout_bytes": 0, "prefetch_bytes": 0, "host_staged_bytes": 0}
    after = {"pageout_bytes": 4e9, "prefetch_bytes": 4e9, "host_staged_bytes": 20e9}
    result = session_result(before, after, steps=2)
    assert result["staged_bytes_per_step"] == 20e9  # 10 GB in and 10 GB out a step
    assert result["moved_bytes_per_step"] == 24e9


def test_placement_share_and_settle_steps_reach_the_child(monkeypatch):
    """--placement-share is handed to each child (lms-v2-overlap's suggest_placement takes it),
    and so is --settle-steps."""
    from types import SimpleNamespace

    commands = []

    def fake_child(command, mark, timeout, env=None):
        commands.append(command)
        return {"result": {"error": "not run"}, "timed_out": False, "returncode": 1,
                "wall_s": 0.0, "stderr_tail": ""}  # fmt: skip

    monkeypatch.setattr(bench, "run_marked_child", fake_child)
    monkeypatch.setattr(bench, "child_env", dict)
    options = dict(steps=2, warmup=1, settle_steps=5, measure="synchronized", seed=0, seq=8,
                   activation_batch=1,
                   state_batch=1,
                   bandwidth_gib=1.0, pin_parameters=True, size_lms_mib=1.0,
                   overlap_state="auto", time_budget=600, child_timeout=60,
                   child_target_s=30, out=None)  # fmt: skip
    for share, expected in ((0.75, ["--placement-share", "0.75"]), (None, [])):
        runner = bench.Runner(SimpleNamespace(placement_share=share, **options), [], [], [], [])
        runner.launch("lms-v2-overlap", "state", 2.0, limit=GiB, native_peak=2 * GiB)
        tail = commands[-1][commands[-1].index("--overlap-state") + 2 :]
        assert tail == expected
        flag = commands[-1].index("--settle-steps")
        assert commands[-1][flag + 1] == "5"
        assert commands[-1][commands[-1].index("--measure") + 1] == "synchronized"


class FakeSession:
    """Steps whose quietness is scripted: one_step() runs the next, quiet_iterations() counts."""

    def __init__(self, quiet: list[bool]) -> None:
        self.script = list(quiet)
        self.quiet = 0
        self.ran = 0

    def one_step(self):
        self.quiet += self.script[self.ran]
        self.ran += 1
        return self.ran / 10, 5.0 - self.ran, None

    def settle(self, settle_steps=8, quiet_so_far=0, time_left=lambda last_s: True):
        return settle(self.one_step, lambda: self.quiet, settle_steps, quiet_so_far, time_left)


def test_warm_up_goes_on_until_two_steps_in_a_row_ran_quiet():
    # Watched twice more, then quiet: settled after the second quiet step, none run after it.
    session = FakeSession([False, False, True, True, True])
    ran, settled = session.settle()
    assert settled and session.ran == 4
    assert ran == [(0.1, 4.0), (0.2, 3.0), (0.3, 2.0), (0.4, 1.0)]
    # A quiet step then a watched one starts the count again.
    session = FakeSession([True, False, True, True, False])
    assert session.settle()[1] and session.ran == 4
    # Quiet at the end of --warmup already: nothing more runs.
    session = FakeSession([False])
    assert session.settle(quiet_so_far=2) == ([], True) and session.ran == 0
    # One quiet step at the end of --warmup counts: one more settles it.
    session = FakeSession([True, False])
    assert session.settle(quiet_so_far=1)[1] and session.ran == 1


def test_a_session_that_never_goes_quiet_runs_the_settle_steps_and_says_so():
    session = FakeSession([False] * 10)
    ran, settled = session.settle(settle_steps=3)
    assert not settled and len(ran) == 3 and session.ran == 3
    session = FakeSession([False] * 10)
    assert session.settle(settle_steps=0) == ([], False) and session.ran == 0


def test_settling_stops_when_the_time_left_does_not_fit_another_step():
    session = FakeSession([False] * 10)
    asked = []

    def time_left(last_s):
        asked.append(last_s)
        return len(asked) < 2

    ran, settled = session.settle(time_left=time_left)
    assert not settled and len(ran) == session.ran == 2 and asked == [0.1, 0.2]


def test_a_session_that_went_quiet_while_timed_is_flagged_as_not_settled():
    native = {**child_result(0.10, 30.0, "native"), "model": {"n_layer": 2}}
    run = {**child_result(0.40, 16.0, "overlap"), "model": {"n_layer": 2}}
    run["session_counters_delta"] = {"iterations": 1, "quiet_iterations": 3}
    row = make_row(run, "lms-v2-overlap", 20 * GiB, None, native)
    assert "1 of 4 timed steps ran watched: not the steady state" in row["warning"]
    # Printed whole under the row when the row's line has no room left for it.
    row["process_step_medians"] = [0.40, 0.432]
    printed = row_line("lms-v2-overlap", row, {"winner": "lms-v2-overlap", "judged": "x"})
    assert printed.splitlines()[1].strip() == row["warning"]
    run["session_counters_delta"] = {"iterations": 4, "quiet_iterations": 0}  # never quiet
    assert "warning" not in make_row(run, "lms-v2-overlap", 20 * GiB, None, native)
    run["session_counters_delta"] = {"iterations": 0, "quiet_iterations": 4}  # quiet all along
    assert "warning" not in make_row(run, "lms-v2-overlap", 20 * GiB, None, native)


def loss_runs(session_losses: list[float], checkpointing_losses: list[float]) -> dict:
    """A regime's native, checkpointing and 3x lms-v2-overlap results with these losses."""
    model = {"n_layer": 24, "n_embd": 1024, "n_head": 16, "batch": 8, "seq": 1024}
    common = {"regime": "activation", "model": model, "tokens_per_step": 8192, "step_s": [0.2]}
    native = [10.5, 10.2, 10.5, 10.0]  # a spike at the third step
    session_processes = [[10.5, 10.2, 10.45, 10.0], session_losses, [10.5, 10.2, 10.40, 10.0]]
    return {
        "activation/native": {
            **common,
            "step_median_s": 0.12,
            "peak_bytes": 27 * GiB,
            "losses": native,
        },
        "activation/checkpointing": {
            **common,
            "step_median_s": 0.155,
            "peak_bytes": 12 * GiB,
            "losses": checkpointing_losses,
        },
        "activation/3x/lms-v2-overlap": {
            **common,
            "step_median_s": 0.19,
            "peak_bytes": 9 * GiB - 1,
            "losses": session_losses,
            "processes": [{"losses": losses} for losses in session_processes],
        },
    }


def judged_losses(runs: dict) -> tuple[dict, dict, dict]:
    """analyze()'s loss target at 3x, the session's row and the regime's loss summary."""
    data = {"runs": runs, "ratios": [3.0], "bandwidth": {}}
    analyze(data)
    row = data["analysis"]["groups"]["activation/3x"]["columns"]["lms-v2-overlap"]
    return data["targets"]["activation/3x losses"], row, data["analysis"]["losses"]["activation"]


def test_a_step_where_pytorch_alone_is_off_native_is_set_aside_and_reported():
    # checkpointing, PyTorch alone, lands 0.024 off native at the spike; the session 0.084
    runs = loss_runs([10.5, 10.201, 10.416, 10.011], [10.5, 10.2, 10.524, 10.001])
    target, row, check = judged_losses(runs)
    assert target["verdict"] == "PASS" and target["value"] == pytest.approx(0.011)
    assert target["every_step"] == pytest.approx(0.084)  # reported, not hidden
    assert row["loss_steps_compared"] == 3
    (entry,) = row["loss_set_aside"]
    assert entry["step"] == 3 and entry["diff"] == pytest.approx(0.084)
    assert entry["process_range"] == pytest.approx(0.05)  # 10.40 to 10.45 at that step
    assert losses_line(row) == (
        "    losses: step 3 set aside (checkpointing 2.4e-02 off there, this 8.4e-02, "
        "its processes 5.0e-02 apart)"
    )
    assert "1.1e-02 over 3; step 3 set aside" in target["shown"]
    native, checkpointing = runs["activation/native"], runs["activation/checkpointing"]
    peer = make_row(checkpointing, "checkpointing", 9 * GiB, None, native, {2: entry})
    assert peer["loss_set_aside"] == []  # its own spike is not repeated under its row
    assert make_row(native, "native", 9 * GiB, None, native, {2: entry})["loss_set_aside"] == []
    assert list(check["chaotic_steps"]) == [3]
    assert check["chaotic_steps"][3]["peer_diff"] == pytest.approx(0.024)
    assert check["max_abs_diff"]["activation/3x/lms-v2-overlap"] == pytest.approx(0.011)


def test_without_such_a_step_every_step_is_judged_and_a_far_loss_fails():
    # checkpointing within the tolerance at every step: the session's 0.084 counts
    runs = loss_runs([10.5, 10.201, 10.416, 10.011], [10.5, 10.2, 10.51, 10.001])
    # FSDP2's AdamW steps on the CPU, another arithmetic: its being off names no step
    fsdp = {**runs["activation/checkpointing"], "losses": [10.5, 10.2, 10.6, 10.0]}
    runs["activation/fsdp2-cpu-offload"] = fsdp
    target, row, _ = judged_losses(runs)
    assert target["verdict"] == "FAIL" and target["value"] == pytest.approx(0.084)
    assert row["loss_steps_compared"] == 4 and row["loss_set_aside"] == []
    assert losses_line(row) == ""


def test_a_far_loss_after_the_spike_still_fails():
    # A fault shows in the steps after the spike too: setting the spike aside hides nothing there
    runs = loss_runs([10.5, 10.201, 10.416, 10.2], [10.5, 10.2, 10.524, 10.001])
    target, _, _ = judged_losses(runs)
    assert target["verdict"] == "FAIL" and target["value"] == pytest.approx(0.2)


def test_each_processs_losses_are_kept():
    results = [child_result(s, 8.0, str(s)) for s in (0.19, 0.25, 0.2)]
    results[1]["losses"] = [2.0]
    combined = bench.combine_processes(results)
    assert [p["losses"] for p in combined["processes"]] == [[1.0], [2.0], [1.0]]


def test_the_ideal_target_says_what_the_median_reading_leaves_out():
    """GPT-2 medium 4x read 0.803x with the session's median process at a 34 ms host loop and
    checkpointing's at 45 ms: the verdict stays the median's, and the line beside it gives the
    fastest processes' ratio and the two host loops, and says the pass may be the CPUs'."""
    from oversub_report import IDEAL_FRACTION, against_the_reference, ratio_text

    def column(steps, loops):
        results = [child_result(s, 8.0, str(s)) for s in steps]
        for result, loop in zip(results, loops):
            result["host_python_ms"] = [loop]
        return bench.combine_processes(results)

    native = {"step_median_s": 0.1, "tokens_per_step": 8192, "losses": [1.0]}
    bandwidth = {"h2d": {"median_gbps": 55.0}, "d2h": {"median_gbps": 55.0}}
    ckpt = column([0.159, 0.169, 0.172], [41, 45, 46])
    session = column([0.202, 0.211, 0.270], [24, 34, 24])
    ideal = ideal_of(ckpt, 7 * GiB, bandwidth)  # 1 GiB over the limit: the reference sets it
    reference = make_row(ckpt, "checkpointing", 7 * GiB, ideal, native)
    row = make_row(session, "lms-v2-overlap", 7 * GiB, ideal, native)
    assert row["vs_ideal"] == pytest.approx(0.169 / 0.211) and row["vs_ideal"] > IDEAL_FRACTION
    found = against_the_reference(row, reference, ideal, row["vs_ideal"])
    assert found["fastest"] == pytest.approx(0.159 / 0.202)
    assert found["host_loops_ms"] == [34, 45]
    assert found["context"].endswith("(the column's CPU ran faster: a pass that may be the CPUs')")
    # Comparable CPUs: no such word; a link-bound ideal: nothing to add.
    even = make_row(
        column([0.202, 0.211, 0.270], [40, 44, 41]), "lms-v2-overlap", 7 * GiB, ideal, native
    )
    assert "CPUs'" not in against_the_reference(even, reference, ideal, even["vs_ideal"])["context"]
    slow_link = {"h2d": {"median_gbps": 20.0}, "d2h": {"median_gbps": 20.0}}
    link_bound = ideal_of(ckpt, 2 * GiB, slow_link)  # 6 GiB each way: 0.32 s
    assert link_bound["step_s"] > link_bound["reference_step_s"]
    assert against_the_reference(row, reference, link_bound, 0.5) == {}
    # A ratio that two decimals would show as the line itself keeps four.
    assert ratio_text(0.7998097) == "0.7998" and ratio_text(0.803) == "0.8030"
    assert ratio_text(0.81) == "0.81"
    assert ratio_text(0.8) == "0.80" and ratio_text(2.9996) == "2.9996"
