"""What an engine held is given back when an evaluation or a training step ends (trainer/memory.py
`release_memory`)."""

from __future__ import annotations

import gc
from pathlib import Path

import psutil
import torch

from trainer.memory import StepRelease, machine_gib, release_memory, rss_gib


class _Engine:
    """Cyclic garbage holding a large tensor, as an engine and its batches reference each other."""

    def __init__(self) -> None:
        self.cache = torch.ones(300 * 2**20 // 4)  # 300 MiB of float32
        self.me = self


def test_cyclic_garbage_is_collected_and_the_heap_trimmed():
    process = psutil.Process()
    _Engine()  # unreachable at once, but kept by its cycle until a collection
    held = process.memory_info().rss
    release_memory()
    assert held - process.memory_info().rss > 200 * 2**20


def test_a_step_releases_only_above_its_share_of_the_machine_and_after_growing():
    """StepRelease keeps what a step left while the process is under its share of the machine,
    gives it back above it, and not again until the process has grown by the margin."""
    gc.disable()  # the cycle stays until StepRelease collects it
    try:
        machine = rss_gib() + 1.0  # a machine of which a third is well under what the process will hold
        roomy = StepRelease(share=1.0, machine=machine + 100.0)
        tight = StepRelease(share=1 / 3, margin_gib=0.25, machine=machine)
        _Engine()
        held = rss_gib()
        resident, released = roomy()
        assert not released and resident >= held - 0.05
        resident, released = tight()
        assert released and held - resident > 200 / 1024
        again, released = tight()  # large, but not grown since: left alone
        assert not released and abs(again - resident) < 0.1
        _Engine()
        _, released = tight()  # grown by 300 MiB: given back again
        assert released
    finally:
        gc.enable()


def test_the_machine_is_the_container_where_its_limit_is_lower(tmp_path: Path):
    """A cgroup limit below the physical memory is what the share is taken of; "max" and
    v1's no-limit number are not limits."""
    physical = machine_gib(limits=())
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("max\n")
    v1.write_text("9223372036854771712\n")
    assert machine_gib(limits=(v2, v1)) == physical
    v2.write_text(f"{2 * 2**30}\n")
    assert machine_gib(limits=(v2, v1)) == 2.0
    assert machine_gib(limits=(tmp_path / "absent",)) == physical
