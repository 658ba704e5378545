"""Polling clients share one read of a job (flows/openai_api/coalesce.py)."""

from __future__ import annotations

import threading
import time

from flows.openai_api.coalesce import Coalesced, digest


def _at_once(n: int, call) -> list:
    start = threading.Barrier(n)
    results: list = [None] * n

    def one(i: int) -> None:
        start.wait()
        try:
            results[i] = call()
        except Exception as exc:  # noqa: BLE001 - kept to compare
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_reads_that_arrive_together_share_one_computation_and_a_later_one_reads_afresh():
    reads = Coalesced(ttl_s=0.2)
    calls = []

    def slow() -> dict:
        calls.append(1)
        time.sleep(0.3)
        return {"status": "running", "n": len(calls)}

    results = _at_once(50, lambda: reads.get(("view", "ftjob-1", "d1"), slow))
    assert len(calls) == 1 and all(r == {"status": "running", "n": 1} for r in results)
    assert reads.get(("view", "ftjob-1", "d1"), slow)["n"] == 1  # within ttl: the same answer
    time.sleep(0.25)
    assert reads.get(("view", "ftjob-1", "d1"), slow)["n"] == 2  # past it: read again
    assert reads.get(("view", "ftjob-1", "d2"), slow)["n"] == 3  # a changed record: read again at once


def test_a_failed_read_is_raised_to_every_waiter_and_not_kept():
    reads = Coalesced(ttl_s=10)
    attempts = []

    def failing() -> None:
        attempts.append(1)
        time.sleep(0.2)
        raise RuntimeError("Prefect is not answering")

    results = _at_once(10, lambda: reads.get("k", failing))
    assert len(attempts) == 1 and all(isinstance(r, RuntimeError) for r in results)
    assert reads.get("k", lambda: "answered") == "answered"


def test_a_record_digest_follows_its_content():
    record = {"id": "ftjob-1", "events": [], "status": "queued"}
    assert digest(record) == digest(dict(reversed(record.items())))
    assert digest(record) != digest({**record, "events": [{"message": "cancel requested"}]})


def test_with_no_ttl_only_reads_in_flight_are_shared():
    reads = Coalesced(ttl_s=0.0)
    assert reads.get("k", lambda: 1) == 1
    time.sleep(0.01)
    assert reads.get("k", lambda: 2) == 2
