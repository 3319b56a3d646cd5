"""torch_memory_saver's Python API, served by torch_uvm_saver.

Code written for torch_memory_saver runs unchanged once ``import torch_memory_saver`` resolves
here (``torch-uvm-saver install-tms-compat`` writes the one-file package that does that); new
code can write ``from torch_uvm_saver import torch_memory_saver``. The module layout
(``entrypoint``, ``utils``, ``hooks.mode_preload``, ``testing_utils``, ``binary_wrapper``) is
torch_memory_saver's, because its callers import those modules by name. Where we behave
differently (typed errors instead of exit, no crash at exit, graphs in both hook modes), the
README's compatibility table says so.
"""

from .entrypoint import TorchMemorySaver
from .hooks.mode_preload import configure_subprocess

torch_memory_saver = TorchMemorySaver()

__all__ = ["TorchMemorySaver", "configure_subprocess", "torch_memory_saver"]
