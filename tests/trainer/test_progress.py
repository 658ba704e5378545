"""Progress off a terminal: a heartbeat line while a long unit runs, and silence once the
block ends, however it ends (a failed training step used to leave its heartbeat printing
`GRPO: 0/3 steps ...` for the rest of the process)."""

from __future__ import annotations

import sys
import time

import pytest

from trainer.progress import Progress


def test_the_heartbeat_speaks_during_a_long_unit_and_stops_when_the_block_fails(monkeypatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    lines: list[str] = []
    with pytest.raises(RuntimeError, match="a failed step"):
        with Progress(3, "GRPO", unit="steps", log=lines.append, every_s=0.2):
            time.sleep(0.6)
            raise RuntimeError("a failed step")
    assert lines and all(line.startswith("GRPO: 0/3 steps") for line in lines)
    heard = len(lines)
    time.sleep(0.6)
    assert len(lines) == heard
