"""Which node a training process runs on, and which one stopped when a collective fails.

Over several machines a node can die mid-step (a preempted instance, a kernel OOM kill, a
pulled cable). Its peers then fail in their next collective: at once when its sockets
close, or after `training.collective_timeout_s` when it vanishes from the network. The
error torch raises names a socket, not a machine. `NodeWatch` keeps the answer ready: at
setup every process tells the others its node rank (the one its environment gave it, see
trainer/rl/launch.py), hostname and pid, and every few seconds it writes a heartbeat into
the run's c10d store. When a collective fails, the processes whose heartbeats stopped are
the ones that died, and their nodes are named; when the store itself no longer answers,
the node that holds it (the node of rank 0) is the one that went.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

HEARTBEAT_S = 1.0
_KEY = "agentrft/heartbeat/{rank}"


@dataclass(frozen=True)
class Process:
    rank: int
    node: int
    host: str
    pid: int


def is_collective_failure(exc: BaseException) -> bool:
    """Whether an exception is a collective that failed (a peer gone or timed out)."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistBackendError", ())) or isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        mark in text for mark in ("Connection closed by peer", "Connection reset by peer", "Gloo", "gloo", "NCCL"))


class NodeWatch:
    """The run's processes by node, and their heartbeats in the c10d store."""

    def __init__(self, accelerator: Any):
        from accelerate.utils import gather_object

        self.rank = accelerator.process_index
        mine = Process(rank=self.rank, node=int(os.environ.get("AGENTRFT_NODE_RANK", "0") or 0),
                       host=socket.gethostname(), pid=os.getpid())
        self.processes = sorted(gather_object([mine]), key=lambda p: p.rank)
        self._store = None
        self._stop = threading.Event()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and len(self.processes) > 1:
            from torch.distributed.distributed_c10d import _get_default_store

            self._store = _get_default_store()
            self._thread = threading.Thread(target=self._beat, daemon=True, name="heartbeat")
            self._beat_once()
            self._thread.start()

    def _beat_once(self) -> None:
        self._store.set(_KEY.format(rank=self.rank), str(time.time()))

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat_once()
            except Exception:  # the store is gone: the failure that ends the run says so
                return

    def close(self) -> None:
        self._stop.set()

    def nodes(self) -> dict[int, str]:
        return {p.node: p.host for p in self.processes}

    def stopped(self, grace_s: float = 4 * HEARTBEAT_S) -> tuple[list[Process], bool]:
        """(the processes whose heartbeats stopped, whether the store itself still answers)."""
        if self._store is None:
            return [], True
        time.sleep(grace_s)  # the peers that are alive (this one too) beat again meanwhile
        try:
            now = time.time()
            beats = {p.rank: float(self._store.get(_KEY.format(rank=p.rank)).decode()) for p in self.processes
                     if p.rank != self.rank}
        except Exception:
            return [p for p in self.processes if p.rank == 0], False
        return [p for p in self.processes if p.rank in beats and now - beats[p.rank] > grace_s], True

    def explain(self, exc: BaseException, *, step: int, checkpoint: str | None) -> str:
        """The sentence that ends a run whose collective failed: which node, what it ran."""
        dead, store_answers = self.stopped()
        if dead:
            nodes = sorted({(p.node, p.host) for p in dead})
            names = ", ".join(f"node {node} ({host}, processes {sorted(p.rank for p in dead if p.node == node)})"
                              for node, host in nodes)
            why = "stopped answering" if store_answers else "is gone with the run's store (it held it)"
        else:
            names, why = "a peer", "failed in a collective"
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        resume = (f"the last checkpoint is {checkpoint}; resume with --resume once every node is back"
                  if checkpoint else "no checkpoint was written yet; start again once every node is back")
        return f"training stopped at step {step}: {names} {why} ({first}); {resume}"
