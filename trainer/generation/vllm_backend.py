"""Rollouts on vLLM servers: token ids in, token ids and log-probabilities out, and the
trainer's weights pushed to the servers after every optimizer step.

The agent loop (trainer/rollout/loop.py) renders the chat template itself and hands the
backend token ids, so what the trainer scores is exactly what the server sampled. Each
turn of a rollout is one `POST /v1/completions` whose prompt is the sequence's whole
token list (prompt, earlier turns, tool outputs); vLLM's prefix cache finds the earlier
tokens' keys and values, so a turn costs about its new tokens, like the embedded engine's
kept KV cache. Every request asks for `return_token_ids` and `logprobs: 0` (the sampled
token's log-probability); the stop token comes back as the last token id, as our engine
returns it. The server must run with `--logprobs-mode processed_logprobs`: vLLM then
reports log_softmax(logits / temperature), which is our engine's definition as long as
top-p and top-k are off (with them vLLM renormalizes over the kept tokens, ours does not);
the default `raw_logprobs` would be at temperature 1.

Launched servers run with `--enable-prefix-caching`. A group's samples of one prompt are
submitted together (the agent loop starts every rollout at once, and each submission is a
request on the pool at once), so vLLM computes the prompt once and the group's other
requests hit its cache. Several servers (replicas) share the rollouts: a new sequence goes
to the replica that holds a live sequence of the same prompt (a group stays on one replica,
where its prompt is cached), else to the one with the fewest live sequences, and stays
there (its cached prefix is there); every request
carries vLLM's session header `X-Session-ID` with the sequence's key, so a router in front
of many replicas can keep a rollout on one of them too. Each turn is sampled with a seed
derived from (backend seed, seq id, turn), so a run is reproducible up to the kernels'
batch-dependent rounding. A refused connection, a timeout or a 5xx is retried with
backoff (3 attempts, on another replica when there is one); then `InfraError` names the
servers, and the rollout batch stops with it rather than waiting forever.

Weight sync (`rollout.vllm.sync`; unset: `lora` when training LoRA, else `full`), after
each optimizer step and after a resume:
- `full`: the policy's weights (LoRA merged) are written as one safetensors file in the
  run directory and every server reloads them in place through the worker extension
  (trainer/generation/vllm_worker.py, `POST /collective_rpc`), then its prefix cache is reset
  (cached keys and values of the old weights would otherwise be reused). The servers must
  read the run directory: loopback, or a shared filesystem for servers on other machines.
  With LoRA on a bf16 server this rounds the merged weights to bf16, dropping the adapter's
  small early changes: a warning says so.
- `lora`: the adapter is saved and loaded under a new name per step
  (`/v1/load_lora_adapter`), requests name it, and the previous one is unloaded.
- `nccl` (GPUs, untested here): vLLM's weight transfer (`/init_weight_transfer_engine`,
  `/start_weight_update`, `/update_weights`, `/finish_weight_update`) broadcasts the
  weights from the trainer's GPU to the servers' GPUs; it needs `vllm` importable in the
  training process.
A sync that fails leaves the generator refusing to hand out a backend: no rollout is
sampled with weights that are not the trainer's.

Processes: with `accelerate launch` every process runs its share of the rollouts against
the same servers, but only the main process starts servers and pushes weights (DDP keeps
every replica of the model identical); the others wait for it at each sync and learn the
URLs and the adapter's name from it, so no process samples before the sync is done and an
error on the main process stops every process instead of hanging them.

    VLLM_SERVER_DEV_MODE=1 PYTHONPATH=/path/to/agentrft python -m vllm.entrypoints.openai.api_server \
        --model MODEL_DIR --logprobs-mode processed_logprobs \
        --worker-extension-cls trainer.generation.vllm_worker.WeightSyncExtension
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import InfraError
from trainer.generation.backend import GenerationBackend, SamplingParams, TurnOutput
from trainer.generation.vllm_launch import launched_server, server_args
from trainer.generation.vllm_servers import SESSION_HEADER, VllmServers, reset_prefix_cache

_POLL_S = 0.02  # how long step() waits for a turn before handing control back to the loop


def turn_seed(seed: int, seq_id: str, turn: int) -> int:
    """The sampling seed of one turn: a function of (seed, seq_id, turn) only."""
    digest = hashlib.sha256(f"{seed}\x00{seq_id}\x00{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class _Sequence:
    key: str  # what the servers see of it (session header)
    url: str
    epoch: int
    prompt: str = ""  # digest of its first submission (a group's samples share it)
    tokens: list[int] = field(default_factory=list)
    turns: int = 0
    busy: bool = False


class VllmBackend(GenerationBackend):
    """`GenerationBackend` over vLLM servers: each turn is one completion request whose
    prompt is the sequence's tokens so far. `submit` sends the request (from any thread);
    `step` waits briefly for requests to finish and returns their turns."""

    def __init__(
        self,
        servers: VllmServers,
        *,
        model: str,
        stop_token_ids: list[int],
        max_len: int,
        seed: int = 0,
        deadline: tuple[float, float] = (60.0, 0.5),
    ):
        self.servers = servers
        self.deadline = deadline  # a turn's: seconds, plus seconds per requested token
        self.model = model
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.max_len = max_len
        self.seed = seed
        self._prefix = hashlib.sha256(os.urandom(16)).hexdigest()[:12]  # this backend's sessions
        self._lock = threading.Lock()
        self._seqs: dict[str, _Sequence] = {}
        self._inflight: dict[Future, tuple[str, int, int]] = {}  # future -> (seq_id, epoch, turn limit)
        self._ready: list[TurnOutput] = []  # turns refused at submit (no room), delivered by step
        self._epochs = 0

    def submit(self, seq_id: str, append_ids: list[int], params: SamplingParams) -> None:
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is not None and seq.busy:
                raise ValueError(f"sequence {seq_id!r} is generating; submit again after its turn")
            if seq is None:
                if not append_ids:
                    raise ValueError(f"new sequence {seq_id!r} needs a non-empty prompt")
                self._epochs += 1
                prompt = hashlib.sha256(repr(append_ids).encode()).hexdigest()
                same = next((s.url for s in self._seqs.values() if s.prompt == prompt), None)
                seq = _Sequence(f"{self._prefix}/{seq_id}", self.servers.assign(prefer=same), self._epochs, prompt)
                self._seqs[seq_id] = seq
            total = len(seq.tokens) + len(append_ids)
            if total + 1 > self.max_len:  # no room for one generated token: refuse, append nothing
                self._ready.append(TurnOutput(seq_id, [], [], "context", len(seq.tokens)))
                return
            seq.tokens.extend(append_ids)
            seq.busy = True
            max_tokens = min(params.max_new_tokens, self.max_len - total)
            body = {
                "model": self.model,
                "prompt": list(seq.tokens),
                "max_tokens": max_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k or -1,
                # Explicit neutral values: a server's generation config must not add its own.
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "seed": turn_seed(self.seed, seq_id, seq.turns),
                "stop_token_ids": self.stop_token_ids,
                "logprobs": 0,
                "return_token_ids": True,
                "skip_special_tokens": False,
                "session_id": seq.key,
            }
            future = self.servers.pool.submit(self._complete, seq_id, seq, body)
            self._inflight[future] = (seq_id, seq.epoch, params.max_new_tokens)

    def _complete(self, seq_id: str, seq: _Sequence, body: dict[str, Any]) -> dict[str, Any]:
        def failover(url: str) -> str:
            # The sequence moves to another replica (its prefix is recomputed there once),
            # unless it was released meanwhile (its answer will be dropped).
            with self._lock:
                if self._seqs.get(seq_id) is seq:
                    self.servers.unassign(url)
                    seq.url = self.servers.assign(avoid=url)
                return seq.url

        base, per_token = self.deadline
        _, answer = self.servers.request(
            "POST", seq.url, "/v1/completions", json=body, headers={SESSION_HEADER: seq.key}, failover=failover,
            timeout_s=base + per_token * body["max_tokens"],
        )
        return answer

    def step(self) -> list[TurnOutput]:
        with self._lock:
            finished, self._ready = self._ready, []
            pending = list(self._inflight)
        if pending and not finished:
            wait(pending, timeout=_POLL_S, return_when=FIRST_COMPLETED)
        for future in [f for f in pending if f.done()]:
            with self._lock:
                seq_id, epoch, turn_limit = self._inflight.pop(future)
            answer = future.result()  # InfraError / ConfigError end the batch here
            with self._lock:
                seq = self._seqs.get(seq_id)
                if seq is None or seq.epoch != epoch:
                    continue  # released (or released and re-created) meanwhile: dropped
                finished.append(self._turn(seq_id, seq, answer, turn_limit))
        return finished

    def _turn(self, seq_id: str, seq: _Sequence, answer: dict[str, Any], turn_limit: int) -> TurnOutput:
        choice = answer["choices"][0]
        token_ids = [int(t) for t in choice.get("token_ids") or []]
        logprobs = [float(lp) for lp in ((choice.get("logprobs") or {}).get("token_logprobs") or [])]
        if len(logprobs) != len(token_ids):
            raise InfraError(
                f"vLLM server {seq.url} returned {len(token_ids)} token ids but {len(logprobs)} log-probabilities "
                "(it must accept return_token_ids and logprobs)", endpoint=seq.url,
            )
        seq.tokens.extend(token_ids)
        seq.turns += 1
        seq.busy = False
        # The engine's order: a stop token, then the turn's own limit, then the context.
        if token_ids and token_ids[-1] in self.stop_token_ids:
            reason = "stop"
        elif len(token_ids) >= turn_limit:
            reason = "length"
        elif len(seq.tokens) >= self.max_len:
            reason = "context"
        else:
            reason = "length"
        return TurnOutput(seq_id, token_ids, logprobs, reason, len(seq.tokens))

    def release(self, seq_id: str) -> None:
        with self._lock:
            seq = self._seqs.pop(seq_id, None)
            if seq is None:
                raise KeyError(f"unknown or already released sequence {seq_id!r}")
            self.servers.unassign(seq.url)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._ready or self._inflight)


@contextlib.contextmanager
def vllm_eval_backend(
    vllm_config: Any,
    model_path: str,
    *,
    rollout: Any,
    tokenizer: Any,
    stop_token_ids: list[int],
    seed: int,
) -> Iterator[VllmBackend]:
    """A backend that samples `model_path` (a local model directory) on vLLM: a server
    launched for it (`launch: true`), or the configured servers after reloading their
    weights from it (full reload through the worker extension). `tokenizer` is accepted
    for symmetry with the embedded engine; the servers take token ids."""
    del tokenizer  # token ids in and out: the caller renders and decodes
    with contextlib.ExitStack() as stack:
        logs: dict[str, tuple[Path, int]] = {}
        if vllm_config.launch:
            args, env = server_args(max_model_len=rollout.max_total_tokens, extra_args=vllm_config.extra_args,
                                    model_dir=model_path, max_concurrent=rollout.max_concurrent_rollouts)
            server = stack.enter_context(launched_server(
                vllm_config.python, str(Path(model_path).resolve()), args=args,
                log_path=Path(tempfile.mkdtemp(prefix="agentrft-vllm-eval-")) / "server.log",
                startup_timeout_s=vllm_config.startup_timeout_s, api_key=vllm_config.api_key, env=env,
            ))
            urls, logs = [server.url], {server.url: server.log}
        else:
            urls = list(vllm_config.urls)
        servers = VllmServers(urls, api_key=vllm_config.api_key, request_timeout_s=vllm_config.request_timeout_s,
                              max_concurrent=rollout.max_concurrent_rollouts, logs=logs)
        stack.callback(servers.close)
        infos = servers.check(max_total_tokens=rollout.max_total_tokens, temperature=rollout.temperature,
                              top_p=rollout.top_p)
        if not vllm_config.launch:
            for url in urls:
                servers.post(url, "/collective_rpc", {
                    "method": "agentrft_reload_weights", "args": [str(Path(model_path).resolve()), "eval"],
                })
                reset_prefix_cache(servers, url)
        yield VllmBackend(servers, model=infos[0].model, stop_token_ids=stop_token_ids,
                          max_len=rollout.max_total_tokens, seed=seed,
                          deadline=(vllm_config.turn_deadline_s, vllm_config.turn_deadline_per_token_s))
