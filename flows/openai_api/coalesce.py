"""Reads that many clients make at once, made once.

OpenAI's clients poll: a dashboard, a notebook and a CI job may all retrieve the same job and
list its events every second. Each read asks Prefect for the flow run and MLflow for the
training runs and their metric history, and on a busy machine (the same one that trains) a
hundred of them at once queued behind each other for 20-30 s. `Coalesced` makes the reads
of one key that arrive together share one computation, and its result serve for `ttl_s`
after; a key names the job's record as it is (its digest), so any change to the record (a
cancel, a pause, a new event) is read afresh at once.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any


def digest(record: dict[str, Any]) -> str:
    """A short digest of a JSON record: the part of a key that changes when the record does."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:16]


class _Entry:
    __slots__ = ("done", "error", "finished", "value")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.finished = 0.0


class Coalesced:
    """One computation per key at a time, its result shared for `ttl_s`; errors are not kept."""

    def __init__(self, ttl_s: float = 1.0, max_keys: int = 1024):
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._entries: dict[Hashable, _Entry] = {}
        self.computed = 0  # how many computations ran (what the tests count)

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            fresh = entry is not None and (not entry.done.is_set() or time.monotonic() - entry.finished <= self.ttl_s)
            owner = not fresh
            if owner:
                if len(self._entries) >= self.max_keys:
                    self._drop_stale()
                entry = self._entries[key] = _Entry()
                self.computed += 1
        if owner:
            try:
                entry.value = compute()
            except BaseException as exc:
                entry.error = exc
                with self._lock:
                    if self._entries.get(key) is entry:
                        del self._entries[key]
            finally:
                entry.finished = time.monotonic()
                entry.done.set()
        else:
            entry.done.wait()
        if entry.error is not None:
            raise entry.error
        return entry.value

    def _drop_stale(self) -> None:
        now = time.monotonic()
        for key in [k for k, e in self._entries.items() if e.done.is_set() and now - e.finished > self.ttl_s]:
            del self._entries[key]
