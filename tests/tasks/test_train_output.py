"""The training stage forwards the trainer's output line by line as it is written, not when
a buffer fills: the child below prints one short progress line and then waits until the
stage has logged it (a handshake through a file), so a stage that held lines back would
leave the child waiting until its timeout and fail."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from tasks.train import run_training


class _Logger:
    def __init__(self, flag: Path):
        self.flag, self.lines = flag, []

    def info(self, message: str, *args) -> None:
        self.lines.append(message % args if args else message)
        if "GRPO: 1/2" in self.lines[-1]:
            self.flag.write_text("seen")


def test_progress_lines_are_forwarded_as_they_are_written(tmp_path: Path) -> None:
    flag = tmp_path / "seen"
    child = textwrap.dedent(f"""
        import pathlib, sys, time
        print("GRPO: 1/2 steps, 0.50/s", flush=True)
        deadline = time.monotonic() + 30
        while not pathlib.Path({str(flag)!r}).exists():
            if time.monotonic() > deadline:
                sys.exit("the stage did not forward the progress line while the trainer ran")
            time.sleep(0.05)
        print("GRPO: 2/2 steps, 0.50/s", flush=True)
    """)
    logger = _Logger(flag)
    run_training([sys.executable, "-c", child], {}, tmp_path / "train.log", logger)
    assert logger.lines[0].startswith("GRPO: 1/2")
    assert (tmp_path / "train.log").read_text().splitlines() == ["GRPO: 1/2 steps, 0.50/s", "GRPO: 2/2 steps, 0.50/s"]
