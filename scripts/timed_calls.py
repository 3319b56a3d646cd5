"""A function wrapped to add the seconds of each of its calls to a label: what the dev scripts'
host probes put in place of the functions they time (lms_state_split.py --probe host|alternate,
session_host_cost_cpu.py --parts)."""

from __future__ import annotations

import functools
import time


def timed_into(real, label: str, spent, calls=None):
    """`real`, wrapped to add the seconds of each call to spent[label] (and count it in
    calls[label]), a call that raises included."""

    @functools.wraps(real)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start
            if calls is not None:
                calls[label] += 1

    return timed
