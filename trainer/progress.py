"""Progress of long steps: a bar in a terminal, a line at least every 30 s elsewhere.

Evaluations, training and the demo model's build run for minutes; none of them may be
silent. `Progress` counts units (rollouts, steps) and reports done/total, the rate and the
ETA: through a tqdm bar when stderr is a terminal, and as plain lines through `log` (the
Prefect run logger in a pipeline task, `print` in a subprocess whose output the stage
forwards) at most every `every_s` seconds otherwise, plus one at the end.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

EVERY_S = float(os.environ.get("AGENTRFT_PROGRESS_EVERY_S", "20"))  # a line at least every 30 s


class Progress:
    """`update(n)` as units finish; `close()` at the end (or use it as a context manager)."""

    def __init__(self, total: int, desc: str, *, log: Callable[[str], Any] | None = None, unit: str = "rollouts",
                 every_s: float | None = None):
        self.total, self.desc, self.unit = total, desc, unit
        self.every_s = EVERY_S if every_s is None else every_s
        self.log = log or (lambda line: print(line, flush=True))
        self.done = 0
        self.started = self._last = time.monotonic()
        self.postfix = ""
        self._bar = None
        self._stop = threading.Event()
        if sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit[:-1] if unit.endswith("s") else unit)
        else:
            # A unit can take longer than every_s (a training step): a heartbeat keeps the
            # log moving between them.
            threading.Thread(target=self._heartbeat, daemon=True, name="progress").start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.every_s / 4):
            if time.monotonic() - self._last >= self.every_s:
                self.log(self.line())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: int = 1, postfix: str = "") -> None:
        self.done += n
        self.postfix = postfix or self.postfix
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix_str(postfix)
        elif time.monotonic() - self._last >= self.every_s:
            self.log(self.line())

    def set_done(self, done: int) -> None:
        """Report an absolute count (callbacks that say done/total)."""
        self.update(done - self.done)

    def line(self) -> str:
        self._last = time.monotonic()
        elapsed = self._last - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta_text = f"{eta:.0f} s" if eta == eta else "?"
        extra = f", {self.postfix}" if self.postfix else ""
        return (f"{self.desc}: {self.done}/{self.total} {self.unit}, {rate:.2f}/s, "
                f"{elapsed:.0f} s elapsed, ETA {eta_text}{extra}")

    def close(self) -> None:
        self._stop.set()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.done:
            self.log(self.line())
