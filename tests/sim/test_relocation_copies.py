"""_C.queue_relocation_copies on the simulated driver (Note [Copies queued in one call] in
torch_uvm_saver/queued_copies.py): the bytes arrive both ways, the waits come before the copies
and the batch's end after them, bad arguments queue nothing, a driver error stops the batch at
the copy it names, and each batch's end event is given back once nothing holds it."""

from __future__ import annotations

import ctypes

import pytest

from torch_uvm_saver import _C
from torch_uvm_saver.errors import CudaError, InvalidArgumentError, OutOfMemoryError

SIZE = 4096


@pytest.fixture
def driver():
    return _C.SimDriver(1 << 30)


def host_buffer(fill: int | None = None):
    buffer = (ctypes.c_ubyte * SIZE)()
    if fill is not None:
        ctypes.memset(buffer, fill, SIZE)
    return buffer


def address(buffer) -> int:
    return ctypes.addressof(buffer)


def queue(driver, copies, to_host, after_streams=(), after_events=(), handover=None, stream=None):
    """The batch's stream and the event that ends it."""
    stream = driver.stream_create(0) if stream is None else stream
    handover = driver.event_create(0) if handover is None else handover
    done = _C.queue_relocation_copies(
        driver, 0, stream, handover, list(after_streams), list(after_events), copies, to_host
    )
    return stream, done


def test_a_batch_carries_each_copy_to_the_device_and_back(driver):
    blocks = [driver.mem_alloc(0, SIZE) for _ in range(3)]
    sources = [host_buffer(fill=10 + i) for i in range(3)]
    queue(driver, [(b, address(s), SIZE) for b, s in zip(blocks, sources)], to_host=False)
    backs = [host_buffer() for _ in range(3)]
    queue(driver, [(b, address(h), SIZE) for b, h in zip(blocks, backs)], to_host=True)
    assert [bytes(back) for back in backs] == [bytes([10 + i]) * SIZE for i in range(3)]


def test_the_waits_are_queued_once_each_before_the_copies_and_the_end_after(driver):
    others = [driver.stream_create(0) for _ in range(2)]
    events = [_C.CopyDoneEvent(driver, 0) for _ in range(3)]
    block, host, handover = driver.mem_alloc(0, SIZE), host_buffer(), driver.event_create(0)
    driver.reset_call_counts()
    _, done = queue(driver, [(block, address(host), SIZE)], True, others, events, handover)
    counts = driver.call_counts()
    # Each stream waited for through the handover event: a record and a wait; each event: a wait;
    # the batch's end: one event made and recorded.
    assert counts["event_create"] == 1
    assert counts["event_record"] == 2 + 1
    assert counts["stream_wait_event"] == 2 + 3
    assert counts["copy_device_to_host"] == 1
    assert isinstance(done, _C.CopyDoneEvent) and done.device == 0


def test_a_batchs_end_is_what_a_stream_waits_for_and_the_host_asks_about(driver):
    """The order on a GPU is the scenario copies_queued_in_one_call_follow_the_streams_and_events
    (tests/gpu); here, that each call reaches the driver with the batch's own event."""
    block, host = driver.mem_alloc(0, SIZE), host_buffer()
    driver.hold_events(True)  # recorded events stay pending until the device synchronizes
    _, done = queue(driver, [(block, address(host), SIZE)], to_host=True)
    assert not done.query()
    reader = driver.stream_create(0)
    driver.reset_call_counts()
    done.wait(reader)
    assert driver.call_counts() == {"stream_wait_event": 1}
    driver.hold_events(False)
    assert done.query()
    done.synchronize()


def test_each_batchs_end_is_given_back_once_nothing_holds_it(driver):
    block, host = driver.mem_alloc(0, SIZE), host_buffer()
    handover = driver.event_create(0)
    held = driver.held()["events"]
    ends = [queue(driver, [(block, address(host), SIZE)], True, handover=handover)[1]]
    ends.append(queue(driver, [(block, address(host), SIZE)], True, handover=handover)[1])
    assert driver.held()["events"] == held + 2
    ends.clear()
    assert driver.held()["events"] == held


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"device": 0}, "copy 1 of 2 has a null address"),
        ({"host": 0}, "copy 1 of 2 has a null address"),
        ({"size": 0}, "copy 1 of 2 has a null address or no bytes"),
        ({"event": None}, "event 0 is null"),
        ({"handover": 0}, "needs a handover event"),
    ],
)
def test_a_bad_argument_is_refused_before_anything_is_queued(driver, bad, match):
    block, first, source = driver.mem_alloc(0, SIZE), host_buffer(), host_buffer(fill=7)
    second = {"device": block, "host": address(source), "size": SIZE}
    second.update({k: v for k, v in bad.items() if k in second})
    copies = [
        (block, address(first), SIZE),
        (second["device"], second["host"], second["size"]),
    ]
    events = [bad.get("event", _C.CopyDoneEvent(driver, 0))]
    other, stream = driver.stream_create(0), driver.stream_create(0)
    handover = bad["handover"] if "handover" in bad else driver.event_create(0)
    held = driver.held()["events"]
    driver.reset_call_counts()
    with pytest.raises(InvalidArgumentError, match=match):
        queue(driver, copies, True, [other], events, handover, stream)
    counts = driver.call_counts()
    assert not {"event_record", "stream_wait_event", "copy_device_to_host"} & set(counts)
    assert driver.held()["events"] == held  # the batch's end, made first, given back


@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize("code, error", [(2, OutOfMemoryError), (999, CudaError)])
def test_a_driver_error_stops_the_batch_at_the_copy_it_names(driver, to_host, code, error):
    call = "copy_device_to_host" if to_host else "copy_host_to_device"
    blocks = [driver.mem_alloc(0, SIZE) for _ in range(3)]
    hosts = [host_buffer(fill=0 if to_host else 20 + i) for i in range(3)]
    if to_host:
        sources = [host_buffer(fill=30 + i) for i in range(3)]
        queue(driver, [(b, address(s), SIZE) for b, s in zip(blocks, sources)], to_host=False)
    driver.fail_on(call, 2, code)
    direction = "to the host" if to_host else "to the device"
    with pytest.raises(error, match=f"copy 1 of 3 \\({direction}, 1 queued before it\\)"):
        queue(driver, [(b, address(h), SIZE) for b, h in zip(blocks, hosts)], to_host)
    # The first copy ran, the third was never queued.
    if to_host:
        assert [bytes(h)[0] for h in hosts] == [30, 0, 0]
    else:
        landed = [host_buffer() for _ in range(3)]
        queue(driver, [(b, address(h), SIZE) for b, h in zip(blocks, landed)], to_host=True)
        assert [bytes(h)[0] for h in landed] == [20, 0, 0]


def test_streams_and_events_made_for_a_batch_can_be_given_back(driver):
    stream, event = driver.stream_create(0), driver.event_create(0)
    assert (driver.held()["streams"], driver.held()["events"]) == (1, 1)
    driver.stream_destroy(0, stream)
    driver.event_destroy(0, event)
    assert (driver.held()["streams"], driver.held()["events"]) == (0, 0)


def test_a_batch_whose_end_cannot_be_recorded_says_its_copies_were_all_queued(driver):
    blocks = [driver.mem_alloc(0, SIZE) for _ in range(2)]
    sources = [host_buffer(fill=40 + i) for i in range(2)]
    held = driver.held()["events"]
    driver.fail_on("event_record", 1, 999)  # no stream to wait for: the only record is the end
    with pytest.raises(CudaError, match="recording the end of 2 copies, all queued"):
        queue(driver, [(b, address(s), SIZE) for b, s in zip(blocks, sources)], to_host=False)
    assert driver.held()["events"] == held + 1  # the handover the helper made; the end given back
    landed = [host_buffer() for _ in range(2)]
    queue(driver, [(b, address(h), SIZE) for b, h in zip(blocks, landed)], to_host=True)
    assert [bytes(h)[0] for h in landed] == [40, 41]
