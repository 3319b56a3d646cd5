"""The rollout process of examples/rl_colocate.py, on the CPU: calls answer in order, a failure in
the rollout comes back as an error with its traceback and leaves the process serving, and stop
ends it. The loop itself needs a GPU: tests/gpu/test_rl_colocate_example.py runs it."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

ENGINE = """
import os


class Counter:
    def __init__(self, start):
        self.count = start

    def add(self, amount):
        self.count += amount
        return self.count

    def fail(self):
        raise ValueError("the rollout refused")

    def pid(self):
        return os.getpid()
"""


@pytest.fixture
def rollout_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "counter_engine.py").write_text(textwrap.dedent(ENGINE))
    monkeypatch.syspath_prepend(str(tmp_path))  # a spawned process gets our sys.path
    monkeypatch.syspath_prepend(str(EXAMPLES))
    sys.modules.pop("rl_common", None)
    import rl_common

    return rl_common


def test_calls_run_in_another_process_in_order(rollout_module) -> None:
    import os

    rollout = rollout_module.RolloutProcess("counter_engine:Counter", timeout_s=120, start=10)
    try:
        assert rollout.call("add", amount=5) == 15
        assert rollout.call("add", amount=1) == 16
        assert rollout.call("pid") != os.getpid()
    finally:
        rollout.stop()
    assert not rollout._process.is_alive()


def test_a_failure_comes_back_with_the_traceback_and_the_rollout_goes_on(rollout_module) -> None:
    rollout = rollout_module.RolloutProcess("counter_engine:Counter", timeout_s=120, start=0)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)fail failed:.*the rollout refused"):
            rollout.call("fail")
        assert rollout.call("add", amount=2) == 2
    finally:
        rollout.stop()


def test_an_engine_that_cannot_start_is_an_error(rollout_module) -> None:
    with pytest.raises(RuntimeError, match=r"(?s)start failed:.*unexpected keyword"):
        rollout_module.RolloutProcess("counter_engine:Counter", timeout_s=120, begin=0)
