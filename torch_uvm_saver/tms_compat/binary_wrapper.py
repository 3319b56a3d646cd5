"""The C library torch_memory_saver's callers reach through ctypes (``_binary_wrapper.cdll``).

Ours is the preload library: it carries the tms_* functions in both hook modes (opened with
dlopen it interposes nothing). A name it does not define is looked up in the process, as
torch_memory_saver's library, which links the CUDA runtime, lets its callers do
(``cdll.cudaHostGetFlags``).
"""

from __future__ import annotations

import ctypes

__all__ = ["BinaryWrapper"]

_SIGNATURES = {
    "tms_set_current_tag": ([ctypes.c_char_p], None),
    "tms_get_current_tag": ([], ctypes.c_char_p),
    "tms_set_interesting_region": ([ctypes.c_bool], None),
    "tms_get_interesting_region": ([], ctypes.c_bool),
    "tms_set_enable_cpu_backup": ([ctypes.c_bool], None),
    "tms_get_enable_cpu_backup": ([], ctypes.c_bool),
    "tms_set_cpu_backup_backend": ([ctypes.c_char_p], None),
    "tms_get_cpu_backup_backend": ([], ctypes.c_char_p),
    "tms_set_enable_disk_backup": ([ctypes.c_bool], None),
    "tms_get_enable_disk_backup": ([], ctypes.c_bool),
    "tms_set_disk_backup_dir": ([ctypes.c_char_p], None),
    "tms_pause": ([ctypes.c_char_p], ctypes.c_int),
    "tms_resume": ([ctypes.c_char_p], ctypes.c_int),
    "set_memory_margin_bytes": ([ctypes.c_uint64], None),
    "tms_set_retain_cpu_backup": ([ctypes.c_bool], None),
    "tms_get_retain_cpu_backup": ([], ctypes.c_bool),
    "tms_get_cpu_backup_pointer": (
        [ctypes.POINTER(ctypes.c_uint8), ctypes.c_uint64],
        ctypes.POINTER(ctypes.c_uint8),
    ),
    "tus_apply_backup_environment": ([], None),
}


class _Library:
    def __init__(self, path: str) -> None:
        self._own = ctypes.CDLL(path)
        self._process = ctypes.CDLL(None)
        for name, (argtypes, restype) in _SIGNATURES.items():
            function = getattr(self._own, name)
            function.argtypes = argtypes
            function.restype = restype

    def __getattr__(self, name: str):
        try:
            function = getattr(self._own, name)
        except AttributeError:
            function = getattr(self._process, name)
        setattr(self, name, function)
        return function


class BinaryWrapper:
    def __init__(self, path_binary: str) -> None:
        self.cdll = _Library(path_binary)
