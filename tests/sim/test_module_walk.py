"""each_module_once: the walk by which the session's events, step_in_backward's waits and
autocast's cache hook modules. A module hooked twice would fire twice per forward."""

from __future__ import annotations

import torch

from torch_uvm_saver.module_walk import each_module_once


def test_a_shared_module_comes_once_where_it_was_first_reached():
    shared = torch.nn.Linear(2, 2)
    first = torch.nn.Sequential(torch.nn.Linear(2, 2), shared)
    second = torch.nn.Sequential(shared, torch.nn.ReLU())
    walked = list(each_module_once([first, second, first]))
    assert walked == [first, first[0], shared, second, second[1]]


def test_a_module_shared_by_two_parents_of_one_root_comes_once():
    shared = torch.nn.Linear(2, 2)
    root = torch.nn.ModuleDict({"a": torch.nn.Sequential(shared), "b": torch.nn.Sequential(shared)})
    walked = list(each_module_once([root]))
    assert walked == [root, root["a"], shared, root["b"]]
    assert list(each_module_once([])) == []
