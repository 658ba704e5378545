"""Memory a long-lived process gives back, and what it holds.

A training step and an evaluation build an engine, its KV cache and batches of rollouts
whose objects reference each other: they are freed at the next garbage collection, not when
the step ends. And glibc keeps freed heap pages for reuse until it is asked to trim them; on
a CPU, where every tensor lives on that heap and each step's sequences have other lengths,
the pages freed by one step rarely fit the next, and the process grows step after step.
`release_memory` does both, after each evaluation; `StepRelease` after a training step once
the process holds a third of the machine's memory (trainer/rl/grpo.py). Not after every
step: on the 0.9M demo model that made steps 1.00-1.09x as long (three pairs of runs; the
likely cost, the trimmed pages faulted in again by the next step; docs/real-model.md, Memory)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import sys
from pathlib import Path

# A step gives memory back once the process holds this share of the machine's memory and has
# grown by RELEASE_MARGIN_GIB since the last release (so a process that is simply that large is
# not collected after every step).
RELEASE_ABOVE_SHARE = 1 / 3
RELEASE_MARGIN_GIB = 0.25
# A container's memory limit (cgroup v2, then v1; "max" or a huge number where there is none).
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


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


def machine_gib(limits: tuple[Path, ...] = CGROUP_LIMITS) -> float:
    """The memory this process may use, GiB: the machine's physical memory, or its container's
    limit where that is lower (a container's OOM killer counts against the limit, not the host)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in limits:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total / 2**30


class StepRelease:
    """After each training step: `release_memory` when the process holds more than `share` of
    the machine's memory (`machine_gib` by default) and has grown by `margin_gib` since the
    last release. Calling it returns the resident memory after it, GiB, and whether it released."""

    def __init__(self, share: float = RELEASE_ABOVE_SHARE, margin_gib: float = RELEASE_MARGIN_GIB,
                 machine: float | None = None):
        self.limit_gib = share * (machine_gib() if machine is None else machine)
        self.margin_gib = margin_gib
        self.after_last = rss_gib()

    def __call__(self) -> tuple[float, bool]:
        resident = rss_gib()
        if resident <= max(self.limit_gib, self.after_last + self.margin_gib):
            return resident, False
        release_memory()
        self.after_last = rss_gib()
        return self.after_last, True
