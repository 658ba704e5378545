"""vLLM servers as the trainer sees them: HTTP with retries, replica choice, launching.

`VllmServers` talks to one or more vLLM OpenAI servers: requests with backoff (a refused
connection, a timeout or a 5xx is retried, on another replica when there is one, then an
`InfraError` names the servers), the least-loaded replica for a new sequence, and the
start-up checks (the vLLM version against the tested ones, the context length, the
logprobs mode). `launched_server` starts one server on loopback from the separate vLLM
environment (`make vllm`), waits until it is ready (or fails with its log's tail) and stops
its whole process group at the end; `server_args` is the command line it uses, with the
worker extension that reloads weights (trainer/generation/vllm_worker.py). The backend and the weight
sync built on these are in trainer/generation/vllm_backend.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from trainer.api_key import resolve_api_key
from trainer.errors import AgentRFTError, ConfigError, InfraError
from trainer.generation.vllm_launch import root_cause

TESTED_VLLM_VERSIONS = ("0.32.",)  # version prefixes this module was tested against




SESSION_HEADER = "X-Session-ID"  # vLLM's header for requests of one session


T = TypeVar("T")


@dataclass
class ServerInfo:
    """What a server says about itself at start."""

    url: str
    version: str
    model: str  # the served base model's name
    max_model_len: int
    logprobs_mode: str | None  # None when the server does not expose its config (no dev mode)


class VllmServers:
    """One or more vLLM OpenAI-compatible servers serving the same model.

    Requests that fail for reasons of infrastructure (refused connection, timeout, 5xx)
    are retried `max_retries` times in all, waiting `backoff_s * 2**k` between attempts,
    on another replica when there is one; then `InfraError`. A 4xx is a request the
    server will never accept (a context too long for its `--max-model-len`, an unknown
    adapter): `ConfigError` at once, with the server's words.

    Replicas that die: after a failed request the replica's `/health` is asked (a few
    seconds); one that does not answer it is taken out of rotation for good (`alive()`):
    no new sequence goes there, no weight sync, and its sequences move to the others. With
    none left every request is an `InfraError` that names why each one went. A hung
    request is bounded by the deadline its caller gives (`timeout_s`).
    """

    def __init__(
        self,
        urls: list[str],
        *,
        api_key: str | None = None,
        request_timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_concurrent: int = 64,
        logs: dict[str, tuple[Path, int]] | None = None,
    ):
        if not urls:
            raise ConfigError("rollout.vllm.urls is empty and rollout.vllm.launch is false: give the URLs of "
                              "running vLLM servers, or set launch: true")
        self.urls = [url.rstrip("/") for url in urls]
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        key = resolve_api_key(api_key)
        self._http = httpx.Client(
            timeout=httpx.Timeout(request_timeout_s, connect=min(10.0, request_timeout_s)),
            limits=httpx.Limits(max_connections=max_concurrent + 8, max_keepalive_connections=max_concurrent + 8),
            headers={"Authorization": f"Bearer {key}"} if key else {},
        )
        # One pool for every backend over these servers: a turn is a blocking HTTP request.
        self.pool = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="vllm-request")
        self._lock = threading.Lock()
        self._load = {url: 0 for url in self.urls}  # live sequences per replica
        self._dead: dict[str, str] = {}  # replica -> why it was taken out of rotation
        # url -> (log file, where this server's part of it starts), for the servers launched here
        self.logs = {url.rstrip("/"): log for url, log in (logs or {}).items()}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    # -- replica choice --------------------------------------------------------------------------

    def alive(self) -> list[str]:
        """The replicas in rotation."""
        with self._lock:
            return [u for u in self.urls if u not in self._dead]

    def mark_dead(self, url: str, reason: str) -> None:
        """Take `url` out of rotation (and out of weight syncs) for good."""
        if log := self.logs.get(url):
            cause = root_cause(*log)
            reason += f"; its log ({log[0]}) says: {cause}" if cause else ""
        with self._lock:
            if url in self._dead:
                return
            self._dead[url] = reason
            alive = len(self.urls) - len(self._dead)
        print(f"vLLM replica {url} taken out of rotation ({reason}); {alive} of {len(self.urls)} alive", flush=True)

    def no_replica(self) -> InfraError:
        why = "; ".join(f"{u}: {r}" for u, r in self._dead.items())
        return InfraError(f"no vLLM replica is alive ({why})", endpoint=self.urls[-1])

    def healthy(self, url: str, timeout_s: float = 5.0) -> bool:
        try:
            return self._http.get(f"{url}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def assign(self, avoid: str | None = None, prefer: str | None = None) -> str:
        """`prefer` when it is alive, else the alive replica with the fewest live sequences
        (the first of equals); counted as one more."""
        with self._lock:
            alive = [u for u in self.urls if u not in self._dead]
            if not alive:
                raise self.no_replica()
            if prefer in alive and prefer != avoid:
                self._load[prefer] += 1
                return prefer
            candidates = [u for u in alive if u != avoid] or alive
            url = min(candidates, key=lambda u: self._load[u])
            self._load[url] += 1
            return url

    def unassign(self, url: str) -> None:
        with self._lock:
            self._load[url] = max(0, self._load[url] - 1)

    # -- requests --------------------------------------------------------------------------------

    def request(
        self,
        method: str,
        url: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
        failover: Callable[[str], str] | None = None,
    ) -> tuple[str, Any]:
        """Send one request with retries; returns (the URL that answered, its JSON or None).
        `failover(url)` names the replica to try after `url` failed (default: `url` again)."""
        reason = ""
        tried: list[str] = []
        for attempt in range(1, self.max_retries + 1):
            if url in self._dead:
                if failover is None:
                    break  # a replica out of rotation is not asked again
                url = failover(url)
            tried.append(url)
            try:
                response = self._http.request(
                    method, f"{url}{path}", json=json, params=params, headers=headers,
                    timeout=httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s,
                )
            except httpx.TimeoutException as exc:
                reason = f"no answer within the timeout ({type(exc).__name__})"
            except httpx.TransportError as exc:
                reason = f"{type(exc).__name__}: {exc or 'connection failed'}"
            else:
                if response.status_code < 400:
                    json_answer = response.headers.get("content-type", "").startswith("application/json")
                    return url, (response.json() if json_answer else response.text or None)
                detail = response.text[:500]
                if response.status_code in (401, 403):
                    raise ConfigError(f"vLLM server {url} refused the API key (HTTP {response.status_code}); "
                                      "check rollout.vllm.api_key")
                if response.status_code < 500 and response.status_code != 429:
                    raise ConfigError(f"vLLM server {url} refused {method} {path} (HTTP {response.status_code}): "
                                      f"{detail}")
                reason = f"HTTP {response.status_code}: {detail}"
            if not self.healthy(url):
                self.mark_dead(url, f"{reason}, then no answer to /health")
            if attempt < self.max_retries:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
                url = failover(url) if failover is not None else url
        if not tried:
            raise InfraError(f"vLLM server {url} is out of rotation ({self._dead.get(url)})", endpoint=url)
        servers = ", ".join(dict.fromkeys(tried))
        causes = [(url, log[0], root_cause(*log)) for url in dict.fromkeys(tried) if (log := self.logs.get(url))]
        said = "".join(f" The log of {url} ({path}) says: {cause}." for url, path, cause in causes if cause)
        raise InfraError(
            f"vLLM server {servers} failed {method} {path} after {self.max_retries} attempts; last: {reason}."
            + (said or " Check that the server is running and reachable (rollout.vllm.urls), or its log"),
            endpoint=tried[-1], attempts=self.max_retries,
        )

    def post(self, url: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        return self.request("POST", url, path, json=body, **kwargs)[1]

    def get(self, url: str, path: str, **kwargs: Any) -> Any:
        return self.request("GET", url, path, **kwargs)[1]

    def describe(self, url: str) -> ServerInfo:
        """Version, served model and context length of one server."""
        version = (self.get(url, "/version") or {}).get("version", "unknown")
        models = (self.get(url, "/v1/models") or {}).get("data", [])
        base = [m for m in models if not m.get("parent")] or models
        if not base:
            raise InfraError(f"vLLM server {url} serves no model (GET /v1/models)", endpoint=url)
        logprobs_mode = None
        with contextlib.suppress(AgentRFTError):  # /server_info exists only in dev mode
            config = self.get(url, "/server_info", params={"config_format": "json"})["vllm_config"]
            logprobs_mode = config["model_config"]["logprobs_mode"]
        return ServerInfo(url, version, base[0]["id"], int(base[0].get("max_model_len") or 0), logprobs_mode)

    def check(self, *, max_total_tokens: int, temperature: float, top_p: float) -> list[ServerInfo]:
        """Refuse servers that cannot serve the rollouts as configured; warn about untested versions."""
        infos = [self.describe(url) for url in self.urls]
        for info in infos:
            if not info.version.startswith(TESTED_VLLM_VERSIONS):
                warnings.warn(
                    f"vLLM server {info.url} runs vLLM {info.version}; this trainer was tested with "
                    f"{', '.join(v + 'x' for v in TESTED_VLLM_VERSIONS)} (scripts/vllm_env.sh installs it)",
                    stacklevel=2,
                )
            if info.max_model_len and info.max_model_len < max_total_tokens:
                raise ConfigError(
                    f"vLLM server {info.url} serves {info.max_model_len} tokens of context, less than "
                    f"rollout.max_total_tokens ({max_total_tokens}); start it with --max-model-len "
                    f"{max_total_tokens} or lower max_total_tokens"
                )
            sampling_differs = temperature not in (0.0, 1.0) or top_p < 1.0
            if info.logprobs_mode not in (None, "processed_logprobs") and sampling_differs:
                raise ConfigError(
                    f"vLLM server {info.url} reports {info.logprobs_mode} log-probabilities, which ignore the "
                    f"rollout temperature ({temperature}); start it with --logprobs-mode processed_logprobs"
                )
        names = {info.model for info in infos}
        if len(names) > 1:
            raise ConfigError(f"the vLLM servers serve different models ({sorted(names)}); "
                              "every replica in rollout.vllm.urls must serve the same one")
        return infos


def reset_prefix_cache(servers: VllmServers, url: str) -> None:
    """Drop the server's cached keys and values: after a weight change they belong to the old
    weights. vLLM refuses while blocks are held (requests finishing): try again shortly."""
    for _ in range(50):
        if (servers.post(url, "/reset_prefix_cache") or {}).get("success", True):
            return
        time.sleep(0.2)
    raise InfraError(f"vLLM server {url} did not reset its prefix cache after the weight change", endpoint=url)
