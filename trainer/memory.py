"""Memory a long-lived process gives back, and what it holds.

A training step and an evaluation build an engine, its KV cache and batches of rollouts
whose objects reference each other: they are freed at the next garbage collection, not when
the step ends. And glibc keeps freed heap pages for reuse until it is asked to trim them; on
a CPU, where every tensor lives on that heap and each step's sequences have other lengths,
the pages freed by one step rarely fit the next, and the process grows step after step.
`release_memory` does both, after each evaluation and after a training step that left the
process grown (trainer/rl/grpo.py)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import resource
import sys


def release_memory() -> None:
    """Collect reference cycles, then return glibc's free heap pages to the system."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def rss_gib() -> float:
    """This process's resident memory now, GiB (without /proc, as on macOS: the high-water mark)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize() / 2**30
    except OSError:
        return peak_rss_gib()


def peak_rss_gib() -> float:
    """This process's resident high-water mark, GiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20
