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


def test_a_run_stopped_around_the_trainer_takes_the_trainer_with_it(tmp_path: Path) -> None:
    """A cancelled or failed flow (here an interrupt while the stage waits) kills the
    trainer rather than leaving it to train on, holding the CPUs, with nobody reading it."""
    import os
    import signal

    import pytest

    child = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_training([sys.executable, "-c", child], {}, tmp_path / "train.log", _Logger(tmp_path / "flag"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    pid = int((tmp_path / "train.log").read_text().split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_progress_line_right_after_another_line_is_forwarded(tmp_path: Path) -> None:
    """Only progress lines throttle progress lines: a validation line just before one used
    to hold it back, leaving ~30 s of silence in the demo's log."""
    child = 'print("step 5: validation score 0.7", flush=True); print("GRPO: 5/30 steps, 0.04/s", flush=True)'
    logger = _Logger(tmp_path / "flag")
    run_training([sys.executable, "-c", child], {}, tmp_path / "train.log", logger)
    assert logger.lines == ["step 5: validation score 0.7", "GRPO: 5/30 steps, 0.04/s"]
