"""Which storages the LMS session moves at open (torch_uvm_saver/segment_move.py): those whose
memory lies in a fixed segment of the session's device. The move itself needs a GPU
(tests/gpu/lms_session_scenarios.py: storages_made_before_the_session_...)."""

import torch

from torch_uvm_saver import segment_move

MiB = 1 << 20


class FakeStorage:
    def __init__(self, address, nbytes):
        self.address, self.size = address, nbytes

    def data_ptr(self):
        return self.address

    def nbytes(self):
        return self.size


SEGMENTS = [
    {"device": 0, "address": 100 * MiB, "total_size": 20 * MiB, "is_expandable": False},
    {"device": 0, "address": 200 * MiB, "total_size": 64 * MiB, "is_expandable": True},
    {"device": 0, "address": 300 * MiB, "total_size": 2 * MiB, "is_expandable": False},
    {"device": 1, "address": 400 * MiB, "total_size": 20 * MiB, "is_expandable": False},
]


def test_storages_in_fixed_segments_of_the_device_are_found(monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: SEGMENTS)
    storages = [
        FakeStorage(100 * MiB, 4 * MiB),  # first byte of a fixed segment
        FakeStorage(119 * MiB, MiB),  # its last MiB
        FakeStorage(120 * MiB, MiB),  # just past it: no segment of ours
        FakeStorage(210 * MiB, 4 * MiB),  # expandable
        FakeStorage(301 * MiB, MiB),  # the second fixed segment
        FakeStorage(405 * MiB, MiB),  # a fixed segment of another device
        FakeStorage(0, 0),  # paged out: no memory at all
        FakeStorage(50 * MiB, MiB),  # below every segment
    ]
    found = segment_move.in_fixed_segments(storages, torch.device("cuda", 0))
    assert found == [0, 1, 4]


def test_a_snapshot_without_the_expandable_key_counts_segments_as_fixed(monkeypatch):
    # An older PyTorch that does not say: moving a storage that was expandable costs a copy,
    # leaving one in a fixed segment costs the holes it leaves.
    segments = [{"device": 0, "address": 100 * MiB, "total_size": 20 * MiB}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    storages = [FakeStorage(101 * MiB, MiB)]
    assert segment_move.in_fixed_segments(storages, torch.device("cuda", 0)) == [0]


def test_an_allocator_without_segments_moves_nothing(monkeypatch):
    # PyTorch's cudaMallocAsync backend and pluggable allocators refuse to snapshot.
    def refuse():
        raise RuntimeError("snapshot is not supported by this allocator backend")

    monkeypatch.setattr(torch.cuda, "memory_snapshot", refuse)
    storages = [FakeStorage(101 * MiB, MiB)]
    assert segment_move.in_fixed_segments(storages, torch.device("cuda", 0)) == []
