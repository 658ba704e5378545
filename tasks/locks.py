"""One pipeline at a time trains and promotes a registered model.

A nightly cron run and a run someone starts from the Prefect UI (or a double click on
Run) can overlap; both would train, evaluate and try to move `champion`. `model_lock`
makes the training-to-promotion part exclusive per registered model, and the other run
waits for it (`promotion.concurrent_runs: wait`, up to `lock_timeout_s`) or stops at once
with a message naming the model (`stop`). Either way the registry ends as one run alone
would have left it.

Two mechanisms, both released if the holder dies:
- With a Prefect server (`PREFECT_API_URL` set: deployments, workers on other machines),
  a Prefect global concurrency limit `agentrft-model-<name>` of one slot, created on
  first use; slots are leases the holder renews, so a crashed worker's slot expires.
- In Prefect's ephemeral mode (`agentrft run` on one machine), an exclusive OS file lock
  under `~/.cache/agentrft/locks/`, which the OS drops with the process.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from trainer.errors import AgentRFTError

LOCK_DIR = Path(os.environ.get("AGENTRFT_LOCK_DIR", Path.home() / ".cache" / "agentrft" / "locks"))
POLL_S = 1.0


class ModelBusy(AgentRFTError):
    """Another pipeline run holds the registered model."""


def limit_name(model: str) -> str:
    """The name of a registered model's lock (the Prefect limit, the lock file's stem)."""
    return "agentrft-model-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", model)


def _busy(model: str, waited: float | None) -> ModelBusy:
    how = "is training or promoting it" if waited is None else f"still held it after {waited:.0f} s"
    return ModelBusy(
        f"another pipeline run {how} (registered model {model!r}); this run stops before training so the registry "
        "is changed by one run at a time. Wait for it, or set promotion.concurrent_runs: wait (and "
        "promotion.lock_timeout_s) to queue behind it"
    )


@contextmanager
def _file_lock(model: str, *, wait: bool, timeout_s: float, log: Callable[[str], Any]) -> Iterator[None]:
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    path = LOCK_DIR / f"{limit_name(model)}.lock"
    with path.open("a+") as handle:
        started, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not wait:
                    raise _busy(model, None) from None
                if time.monotonic() - started > timeout_s:
                    raise _busy(model, time.monotonic() - started) from None
                if not told:
                    log(f"registered model {model!r} is held by another pipeline run; waiting (lock {path})")
                    told = True
                time.sleep(POLL_S)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def _prefect_limit(model: str, *, wait: bool, timeout_s: float, log: Callable[[str], Any]) -> Iterator[None]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    name = limit_name(model)
    with get_client(sync_client=True) as client:
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except ObjectAlreadyExists:
            pass
    started, held = time.monotonic(), ExitStack()
    # `wait` queues up to timeout_s; `stop` asks once, with no timeout (a short one would
    # also fire on a merely slow server, and two runs would both stop): the server's
    # answer "locked" (HTTP 423) is the only reading of busy.
    options = {"timeout_seconds": timeout_s} if wait else {"max_retries": 0}
    try:
        # A failed lease renewal (a busy or restarting server) is logged by Prefect and
        # training goes on: stopping hours of training for it would cost more than the
        # rare overlap it guards against (Prefect's advice for long-running holders).
        held.enter_context(concurrency(name, occupy=1, strict=True, raise_on_lease_renewal_failure=False, **options))
    except TimeoutError:  # only the acquisition: an error of the run itself keeps its own message
        raise _busy(model, time.monotonic() - started) from None
    except Exception as exc:
        if not _locked(exc):
            raise
        raise _busy(model, None) from None
    with held:
        yield


def _locked(exc: BaseException | None) -> bool:
    """Whether Prefect's acquisition error comes from the server's 423 Locked."""
    import httpx

    while exc is not None:
        if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 423:
            return True
        exc = exc.__cause__
    return False


@contextmanager
def model_lock(model: str, *, mode: str = "wait", timeout_s: float = 6 * 3600.0,
               log: Callable[[str], Any] = print) -> Iterator[None]:
    """Hold the registered model `model` for training and promotion (see the module
    docstring); `mode` is `wait` or `stop`."""
    server = os.environ.get("PREFECT_API_URL") or _configured_api_url()
    lock = _prefect_limit if server else _file_lock
    with lock(model, wait=mode == "wait", timeout_s=timeout_s, log=log):
        yield


def _configured_api_url() -> str | None:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()
