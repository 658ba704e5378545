"""What an engine held is given back when an evaluation or a training step ends (trainer/memory.py
`release_memory`)."""

from __future__ import annotations

import psutil
import torch

from trainer.memory import release_memory


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
