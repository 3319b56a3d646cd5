"""Refused inputs, as one table: each row is a call as a user writes it (or a number in the
environment that the simulated driver reads), the error it raises and what its message says.
Every row runs against the process registry on the simulated driver, and after each refused call
everything a user can observe is as it was (Note [Argument errors] in bindings/arguments.h).

README.md's table of refused arguments is generated from ROWS by scripts/gen_error_table.py;
test_the_readme_table_is_generated_from_these_rows fails when the two drift.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import torch_uvm_saver as tus
from torch_uvm_saver import _C, residency
from torch_uvm_saver.errors import InvalidArgumentError

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


class Row(NamedTuple):
    argument: str  # the kind of argument, README's first column
    call: str  # Python as a user writes it (t: a CPU tensor, m: a managed one), or NAME=value
    error: type[Exception]
    says: str  # a piece of the message


ENVIRONMENT = "a number in the environment"

ROWS: list[Row] = [
    # Tensors: only Python sees them (Note [Where arguments are checked] in _native.py).
    Row("a tensor", "tus.manage_memory(None)", TypeError, "manage_memory(t): expected a torch.Tensor, got None"),
    Row("a tensor", "tus.unmanage_memory(None)", TypeError, "unmanage_memory(t): expected a torch.Tensor"),
    Row("a tensor", "tus.is_managed([1, 2])", TypeError, "is_managed(t): expected a torch.Tensor, got [1, 2] (list)"),
    Row("a tensor", "tus.to(None, 'cpu')", TypeError, "to(t): expected a torch.Tensor"),
    Row("a tensor", "tus.prefetch(None, 'cpu')", TypeError, "prefetch(t): expected a torch.Tensor"),
    Row("a tensor", "tus.advise(None, read_mostly=True)", TypeError, "advise(t): expected a torch.Tensor"),
    Row("a tensor", "tus.memory_attributes(None)", TypeError, "memory_attributes(t): expected a torch.Tensor"),
    Row("a tensor", "tus.pin(None)", TypeError, "pin(t): expected a torch.Tensor, got None"),
    Row("a tensor", "tus.unpin(None)", TypeError, "unpin(t): expected a torch.Tensor"),
    Row("a tensor", "tus.pinned(t, None)", TypeError, "pin(t): expected a torch.Tensor"),
    Row("a tensor", "tus.get_cpu_backup(b'bytes')", TypeError, "get_cpu_backup(tensor): expected a torch.Tensor"),
    Row("a tensor", "tus.record_stream(None, None)", TypeError, "record_stream(t): expected a torch.Tensor"),
    # Numbers of bytes (or of blocks): bindings/arguments.h.
    Row("a number of bytes", "tus.set_limit_lms(-1)", InvalidArgumentError, "set_limit_lms(limit): expected a number of bytes >= 0, got -1"),
    Row("a number of bytes", "tus.set_limit_lms(2**64)", InvalidArgumentError, "expected a number of bytes up to 2**64 - 1, got 18446744073709551616"),
    Row("a number of bytes", "tus.set_limit_lms(None)", TypeError, "set_limit_lms(limit): expected an int (a number of bytes), got None"),
    Row("a number of bytes", "tus.set_limit_lms(float('nan'))", TypeError, "expected an int (a number of bytes), got nan (float)"),
    Row("a number of bytes", "tus.set_limit_lms('8GiB')", TypeError, "expected an int (a number of bytes), got '8GiB' (str)"),
    Row("a number of bytes", "tus.set_limit_lms(1.5)", TypeError, "expected an int (a number of bytes), got 1.5 (float)"),
    Row("a number of bytes", "tus.set_limit_lms(True)", TypeError, "got True (bool)"),
    Row("a number of bytes", "tus.set_device_budget(1.5)", TypeError, "set_device_budget(budget): expected an int (a number of bytes) or None, got 1.5 (float)"),
    Row("a number of bytes", "tus.set_device_budget(float('nan'))", TypeError, "set_device_budget(budget): expected an int"),
    Row("a number of bytes", "tus.set_device_budget('1GiB')", TypeError, "set_device_budget(budget): expected an int"),
    Row("a number of bytes", "tus.set_device_budget(-1)", InvalidArgumentError, "set_device_budget(budget): expected a number of bytes >= 0"),
    Row("a number of bytes", "tus.set_device_budget(2**64)", InvalidArgumentError, "set_device_budget(budget): expected a number of bytes up to 2**64 - 1"),
    Row("a number of bytes", "tus.set_managed_limit(1.5)", TypeError, "set_managed_limit(limit): expected an int (a number of bytes) or None, got 1.5 (float)"),
    Row("a number of bytes", "tus.set_managed_limit(float('nan'))", TypeError, "set_managed_limit(limit): expected an int"),
    Row("a number of bytes", "tus.set_managed_limit('all')", TypeError, "set_managed_limit(limit): expected an int"),
    Row("a number of bytes", "tus.set_managed_limit(-1)", InvalidArgumentError, "set_managed_limit(limit): expected a number of bytes >= 0"),
    Row("a number of bytes", "tus.set_managed_limit(2**64)", InvalidArgumentError, "set_managed_limit(limit): expected a number of bytes up to 2**64 - 1"),
    Row("a number of bytes", "tus.set_size_lms(-1)", InvalidArgumentError, "set_size_lms(size): expected a number of bytes >= 0"),
    Row("a number of bytes", "tus.set_size_lms(0.5)", TypeError, "set_size_lms(size): expected an int"),
    Row("a number of bytes", "tus.set_headroom_lms(-1)", InvalidArgumentError, "set_headroom_lms(headroom): expected a number of bytes >= 0"),
    Row("a number of bytes", "tus.set_headroom_lms('auto')", TypeError, "set_headroom_lms(headroom): expected an int (a number of bytes) or None"),
    Row("a number of bytes", "tus.set_disk_backup_chunk_bytes(1.5)", TypeError, "set_disk_backup_chunk_bytes(nbytes): expected an int"),
    Row("a number of bytes", "tus.set_disk_backup_chunk_bytes(-4096)", InvalidArgumentError, "set_disk_backup_chunk_bytes(nbytes): expected a number of bytes >= 0"),
    Row("a number of bytes", "tus.lms_session('8GiB')", TypeError, "lms_session(limit): expected an int (a number of bytes), got '8GiB' (str)"),
    Row("a number of bytes", "tus.lms_session(2**30, budget=1.5)", TypeError, "lms_session(budget): expected an int (a number of bytes), got 1.5 (float)"),
    Row("a number of bytes", "tus.lms_session(0)", InvalidArgumentError, "lms_session: the limit must be > 0 bytes, got 0"),
    Row("a number of bytes", "tus.lms_session(2**30, prefetch_depth=-1)", InvalidArgumentError, "lms_session(prefetch_depth): expected a number of operators >= 0, got -1"),
    Row("a number of blocks", "tus.set_prefetch_lms(-1)", InvalidArgumentError, "set_prefetch_lms(depth): expected a number of blocks >= 0"),
    Row("a number of blocks", "tus.set_prefetch_lms(2.0)", TypeError, "set_prefetch_lms(depth): expected an int (a number of blocks)"),
    # Flags: True or False, nothing else (bindings/arguments.h).
    Row("a flag", "tus.advise(m, read_mostly='no')", TypeError, "advise(read_mostly): expected True or False, got 'no' (str)"),
    Row("a flag", "tus.set_backup_policy('w', retain='no')", TypeError, "set_backup_policy(retain): expected True or False"),
    Row("a flag", "tus.set_backup_policy('w', pinned=1)", TypeError, "set_backup_policy(pinned): expected True or False, got 1 (int)"),
    Row("a flag", "tus.set_speculation_lms('no')", TypeError, "set_speculation_lms(enabled): expected True or False"),
    Row("a flag", "tus.set_pin_ahead('no')", TypeError, "set_pin_ahead(enabled): expected True or False"),
    Row("a flag", "tus.set_enabled_uvm('no')", TypeError, "set_enabled_uvm(enabled): expected True or False"),
    Row("a flag", "tus.set_enabled_lms('no')", TypeError, "set_enabled_lms(enabled): expected True or False"),
    Row("a flag", "tus.region('r', enable_cpu_backup='yes')", TypeError, "region(enable_cpu_backup): expected True or False"),
    Row("a flag", "tus.region('r', mode='managed', read_mostly='yes')", TypeError, "region(read_mostly): expected True or False"),
    Row("a flag", "tus.lms_session(2**30, quiet='no')", TypeError, "lms_session(quiet): expected True or False"),
    Row("a flag", "tus.lms_session(2**30, state_returns='yes')", TypeError, "lms_session(state_returns): expected True or False"),
    Row("a flag or events", "tus.lms_session(2**30, clear_autocast_cache=None)", TypeError, 'lms_session(clear_autocast_cache): expected True, False, "events" or "auto", got None'),
    Row("a flag or events", "tus.lms_session(2**30, clear_autocast_cache='modules')", TypeError, "lms_session(clear_autocast_cache): expected True, False, \"events\" or \"auto\", got 'modules'"),
    Row("events to go by", "tus.lms_session(2**30, clear_autocast_cache='events')", InvalidArgumentError, 'lms_session: clear_autocast_cache="events" empties the cache in the iterations watched by events, which needs watch="modules"; got watch=\'operators\''),
    Row("a way of watching", "tus.lms_session(2**30, watch='layers')", InvalidArgumentError, "lms_session: watch must be one of operators, modules, got 'layers'"),
    Row("a share of the limit", "tus.suggest_placement([], [], 2**30, persistent_share=1.5)", InvalidArgumentError, "suggest_placement(persistent_share): expected a share of the limit, 0 < share <= 1, got 1.5"),
    Row("a share of the limit", "tus.suggest_placement([], [], 2**30, persistent_share=float('nan'))", InvalidArgumentError, "suggest_placement(persistent_share): expected a share of the limit, 0 < share <= 1, got nan"),
    Row("a share of the limit", "tus.suggest_placement([], [], 2**30, persistent_share='half')", TypeError, "suggest_placement(persistent_share): expected a share of the limit (a number), got 'half' (str)"),
    Row("an optimizer", "tus.step_in_backward(None)", TypeError, "step_in_backward(optimizer): expected a torch.optim.Optimizer, got None (NoneType)"),
    # Devices: Python reads PyTorch's spellings, the native registry checks the index.
    Row("a device", "tus.memory_stats(device='bogus')", InvalidArgumentError, "device: 'bogus' is not a device; expected an index, 'cuda', 'cuda:<index>' or a torch.device"),
    Row("a device", "tus.memory_stats(device=1.5)", TypeError, "device: expected an index, 'cuda', 'cuda:<index>' or a torch.device, got 1.5 (float)"),
    Row("a device", "tus.memory_stats(device=-1)", InvalidArgumentError, "device -1 does not exist: the sim driver sees 1 device"),
    Row("a device", "tus.memory_stats(device='cuda:5')", InvalidArgumentError, "device 5 does not exist"),
    Row("a device", "tus.memory_stats(device='cpu')", InvalidArgumentError, "device: expected a CUDA device, got 'cpu'"),
    Row("a device", "tus.empty_cache(device=-1)", InvalidArgumentError, "device -1 does not exist"),
    Row("a device", "tus.empty_cache(device='bogus')", InvalidArgumentError, "'bogus' is not a device"),
    Row("a device", "tus.set_limit_lms(0, device='bogus')", InvalidArgumentError, "'bogus' is not a device"),
    Row("a device", "tus.to(m, 'bogus')", InvalidArgumentError, "'bogus' is not a device"),
    Row("a device", "tus.prefetch(m, 'bogus')", InvalidArgumentError, "device: a location is None, 'cpu' or a CUDA device, got 'bogus'"),
    Row("a device", "tus.prefetch(m, None)", InvalidArgumentError, "prefetch() needs a destination device"),
    Row("a device", "tus.advise(m, preferred_location='tpu')", InvalidArgumentError, "preferred_location: a location is None, 'cpu' or a CUDA device"),
    # Tags, modes and regions (bindings/arguments.h, bindings/region_args.h).
    Row("a tag", "tus.pause('')", InvalidArgumentError, "pause(tag): a tag must be a non-empty string, got ''"),
    Row("a tag", "tus.pause(3)", TypeError, "pause(tag): expected a non-empty string (a tag), got 3 (int)"),
    Row("a tag", "tus.pause('never-used')", InvalidArgumentError, "pause('never-used'): unknown tag (known tags: "),
    Row("a tag", "tus.is_paused(None)", TypeError, "is_paused(tag): expected a non-empty string (a tag), got None"),
    Row("a tag", "tus.set_backup_policy(None)", TypeError, "set_backup_policy(tag): expected a non-empty string (a tag)"),
    Row("a tag", "tus.region('')", InvalidArgumentError, "region(tag): a tag must be a non-empty string"),
    Row("a tag", "tus.region(3)", TypeError, "region(tag): expected a non-empty string (a tag), got 3 (int)"),
    Row("a tag", "tus.cuda_graph(None, tag='')", InvalidArgumentError, "cuda_graph(tag): a tag must be a non-empty string"),
    Row("a mode", "tus.region('r', mode='x')", InvalidArgumentError, "region(mode): unknown mode 'x'; the modes are 'vmm', 'device', 'managed' and 'lms'"),
    Row("a mode", "tus.region('r', mode=3)", TypeError, "region(mode): expected a string, got 3 (int)"),
    Row("a mode", "tus.region('r', mode='managed', enable_cpu_backup=True)", InvalidArgumentError, "enable_cpu_backup applies to mode='vmm' only"),
    Row("a mode", "tus.region('r', preferred_location='cpu')", InvalidArgumentError, "preferred_location, accessed_by and read_mostly apply to mode='managed' only"),
    Row("a mode", "tus.set_backing_lms('device')", InvalidArgumentError, "an LMS backing is 'vmm' or 'managed', not 'device'"),
    Row("a mode", "tus.use_global_allocator('vmm')", InvalidArgumentError, "the global hook serves mode 'device', 'managed' or 'lms', not 'vmm'"),
    # The simulated driver's size, read when the registry makes its driver (TUS_DRIVER=sim).
    Row(ENVIRONMENT, "TUS_SIM_CAPACITY=-1", InvalidArgumentError, "TUS_SIM_CAPACITY=-1 is not a whole number of bytes"),
    Row(ENVIRONMENT, "TUS_SIM_CAPACITY=64MiB", InvalidArgumentError, "TUS_SIM_CAPACITY=64MiB is not a whole number of bytes"),
    Row(ENVIRONMENT, "TUS_SIM_CAPACITY=18446744073709551616", InvalidArgumentError, "is out of range: a number of bytes from 1 to 18446744073709551615"),
    Row(ENVIRONMENT, "TUS_SIM_CAPACITY=0", InvalidArgumentError, "TUS_SIM_CAPACITY=0 is out of range"),
    Row(ENVIRONMENT, "TUS_SIM_DEVICES=4294967297", InvalidArgumentError, "TUS_SIM_DEVICES=4294967297 is out of range: a number of devices from 1 to 64"),
    Row(ENVIRONMENT, "TUS_SIM_DEVICES=0", InvalidArgumentError, "TUS_SIM_DEVICES=0 is out of range"),
    Row(ENVIRONMENT, "TUS_SIM_DEVICES=-1", InvalidArgumentError, "TUS_SIM_DEVICES=-1 is not a whole number of devices"),
]  # fmt: skip


@pytest.fixture
def world(process):
    """The process registry with something in every piece of state a refused call could touch:
    a backed segment under 'held', a managed tensor m, LMS and managed settings that differ from
    their defaults (a value truncated or coerced into them would show)."""
    _, allocator = process
    chunk_bytes = _C.disk_backup_chunk_bytes()
    allocator.malloc(4 * MiB, tag="held", cpu_backup=True)
    tus.set_limit_lms(96 * MiB)
    tus.set_size_lms(2 * MiB)
    tus.set_headroom_lms(3 * MiB)
    tus.set_device_budget(64 * MiB)
    tus.set_managed_limit(128 * MiB)
    tus.set_disk_backup_chunk_bytes(8 * MiB)
    m = tus.manage_memory(torch.arange(1024, dtype=torch.float32))
    assert allocator.wait_pin_ahead(30)  # the background pin settles (Note [Pinning ahead])
    yield allocator, {"tus": tus, "t": torch.zeros(4), "m": m}
    del m
    tus.set_disk_backup_chunk_bytes(chunk_bytes)


def observable(allocator: _C.Allocator, names: dict) -> dict:
    """Everything a refused call might have changed, as a user can read it."""
    return {
        "allocators": [a.device for a in _C.allocators()],
        "stats": allocator.stats(),
        "segments": allocator.segments(),
        "tags": {t: (allocator.is_paused(t), allocator.backup_policy(t)) for t in allocator.tags()},
        "policies": dict(residency._policies),
        "lms": (
            tus.get_limit_lms(),
            tus.get_size_lms(),
            tus.get_headroom_lms(),
            tus.get_backing_lms(),
        ),
        "managed": (
            tus.get_device_budget(),
            tus.get_managed_limit(),
            tus.memory_attributes(names["m"]),
        ),
        "disk backup": (_C.disk_backup_dir(), _C.disk_backup_chunk_bytes()),
        "pin ahead": _C.get_pin_ahead(),
        "hook": (tus.hook_mode(), _C.global_hook()),
        "thread region": _C.get_thread_region(),
        "default policy": _C.default_backup_policy(),
        "Tensor.to": torch.Tensor.to,
    }


def run_call(code: str, names: dict) -> None:
    """Evaluates a row's call; a context manager it returns is entered, as `with` would."""
    value = eval(code, dict(names))  # the README shows this very text
    if hasattr(value, "__enter__"):
        with value:
            pass


@functools.cache
def environment_refusals() -> dict:
    """Each environment row's setting tried in one child process: what get_driver() raised, and
    which allocators existed after. A refusal makes no driver, so the next try reads the
    environment again; the last line checks that a good value then works."""
    settings = [row.call for row in ROWS if row.argument == ENVIRONMENT]
    code = textwrap.dedent(
        """
        import json, os, sys
        import torch_uvm_saver
        from torch_uvm_saver import _C
        seen = {}
        for setting in json.loads(sys.argv[1]):
            name, value = setting.split("=", 1)
            kept = os.environ.get(name)
            os.environ[name] = value
            try:
                _C.get_driver()
                seen[setting] = ["", "", []]
            except Exception as error:
                seen[setting] = [type(error).__name__, str(error), [a.device for a in _C.allocators()]]
            os.environ.pop(name)
            if kept is not None:
                os.environ[name] = kept
        seen["afterwards"] = _C.get_driver().capacity
        print(json.dumps(seen))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUS_SIM_")}
    env.update(TUS_DRIVER="sim", TUS_SIM_CAPACITY=str(64 * MiB))
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(settings)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("row", ROWS, ids=[row.call for row in ROWS])
def test_a_bad_input_is_refused_with_a_clear_error_and_changes_nothing(world, row: Row) -> None:
    allocator, names = world
    if row.argument == ENVIRONMENT:
        refusals = environment_refusals()
        error, message, made = refusals[row.call]
        assert error == row.error.__name__, (row.call, error, message)
        assert row.says in message
        assert made == []  # no allocator, and no driver kept: the next read works
        assert refusals["afterwards"] == 64 * MiB
        return
    before = observable(allocator, names)
    with pytest.raises(row.error) as raised:
        run_call(row.call, names)
    assert type(raised.value) is row.error, raised.value  # TypeError: ours, not a subclass
    assert row.says in str(raised.value)
    after = observable(allocator, names)
    changed = {key for key in before if before[key] != after[key]}
    if "stats" in changed:  # say which counters
        changed |= {k for k, v in after["stats"].items() if before["stats"].get(k) != v}
    assert after == before, sorted(changed)


def test_every_kind_of_refusal_has_a_row() -> None:
    # Both errors for numbers, flags, tags and devices: a wrong type and a wrong value.
    kinds = {(row.argument, row.error) for row in ROWS}
    for argument in ("a number of bytes", "a tag", "a device"):
        assert (argument, TypeError) in kinds and (argument, InvalidArgumentError) in kinds


def load_generator():
    spec = importlib.util.spec_from_file_location(
        "gen_error_table", ROOT / "scripts" / "gen_error_table.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_table_is_generated_from_these_rows() -> None:
    generator = load_generator()
    readme = (ROOT / "README.md").read_text()
    assert generator.section_of(readme) == generator.render(ROWS), (
        "README.md's table of refused arguments differs from tests/sim/test_bad_inputs.py's "
        "ROWS: run `python scripts/gen_error_table.py` and commit README.md"
    )
