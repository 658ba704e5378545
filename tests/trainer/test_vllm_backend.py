"""Rollouts on a real vLLM server on loopback, against the embedded transformers engine.

One server for the module, launched by the trainer itself (`rollout.backend: vllm`,
`launch: true`) from the separate vLLM environment (`.venv-vllm`, scripts/vllm_env.sh),
serving a tiny Qwen3 taught scripted tool use (tests/taught_model.py) in float32 on the
CPU. The FinQA tool server runs on loopback. The tests compare numbers: the server's
log-probabilities of multi-turn tool rollouts with a transformers forward over the same
tokens, before and after a weight sync, with a LoRA adapter loaded, after an evaluation
backend reloaded a model directory, through three GRPO steps; and a killed server must end
the batch with an `InfraError` naming it, quickly.
The tests share the server and run in file order; the last one kills it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from envs.finqa.local import local_tool_endpoints
from tests.taught_model import GRADER, OUTPUT_CHARS, SYSTEM, TOOLS, copy_items, teach_model
from tests.vllm_env import VLLM_MARKS, VLLM_PYTHON
from trainer.config.loading import config_from_dict
from trainer.config.tools import ToolEndpoint
from trainer.data import read_items, read_jsonl, split_items
from trainer.errors import InfraError
from trainer.generation.backend import GenerationBackend, SamplingParams
from trainer.generation.engine import TransformersBackend
from trainer.generation.vllm_backend import VllmBackend, vllm_eval_backend
from trainer.generation.vllm_generator import VllmGenerator
from trainer.generation.vllm_launch import launched_server, server_args
from trainer.generation.vllm_servers import VllmServers
from trainer.rl.grpo import GRPOTrainer
from trainer.rollout.loop import run_rollouts_async
from trainer.rollout.record import RolloutRecord
from trainer.rollout.tool_client import ToolClient

pytestmark = VLLM_MARKS

# Two cores, float32, no CUDA graphs, a small KV cache; LoRA enabled for the adapter test.
# One process (the engine and its worker inside the API server: SINGLE_PROCESS below) starts
# in about half the time of vLLM's three on two cores.
# No memory setting: a launched server's KV cache is sized from the model, the rollouts and
# what the machine has free (trainer/generation/vllm_servers.py kv_cache_bytes).
SERVER_ARGS = [
    "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "16",
    "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--distributed-executor-backend=uni",
]
SINGLE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
FP32_TOLERANCE = 1e-4  # the same float32 weights, different kernels


@pytest.fixture(scope="module", autouse=True)
def single_process_servers():
    """The servers this module launches inherit the environment: one process each."""
    before = {key: os.environ.get(key) for key in SINGLE_PROCESS}
    os.environ.update(SINGLE_PROCESS)
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The trainer's tiny model runs faster on one thread next to the server."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def world(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vllm")
    items = read_items(demo_data_dir / "train.jsonl", 2)
    copy_items(demo_data_dir, items, root, "train.jsonl")
    copy_items(demo_data_dir, items, root, "validation.jsonl")
    return root


@pytest.fixture(scope="module")
def endpoints(world: Path):
    with local_tool_endpoints(world / "corpus", max_output_chars=OUTPUT_CHARS) as served:
        yield served


@pytest.fixture(scope="module")
def taught_model(world: Path, endpoints: list[ToolEndpoint]) -> Path:
    return teach_model([world / "train.jsonl"], world / "corpus", endpoints, world / "model")


def vllm_config(world: Path, endpoints: list[ToolEndpoint], *, vllm: dict, **training):
    return config_from_dict({
        "model": {"base_model": "unused: passed as model_path"},
        "data": {"train_file": str(world / "train.jsonl"), "validation_file": str(world / "validation.jsonl"),
                 "test_file": None},
        "tools": {"endpoints": [e.model_dump() for e in endpoints], "schemas": TOOLS,
                  "max_output_chars": OUTPUT_CHARS, "max_retries": 2},
        "grader": GRADER,
        "rollout": {"system_prompt": SYSTEM, "max_turns": 3, "max_new_tokens_per_turn": 48, "max_total_tokens": 768,
                    "max_concurrent_rollouts": 8, "backend": "vllm",
                    "vllm": {"python": str(VLLM_PYTHON), "startup_timeout_s": 600, **vllm}},
        "training": {"batch_size": 2, "compute_multiplier": 0.5, "learning_rate": 1e-3, "n_epochs": 3, "max_steps": 3,
                     "eval_interval": 100, "eval_samples": 1, "checkpoint_interval": 100, "seed": 5, **training},
        "mlflow": {"tracking_uri": f"sqlite:///{world / 'mlflow.db'}"},
    })


@pytest.fixture(scope="module")
def trainer(world: Path, endpoints: list[ToolEndpoint], taught_model: Path):
    """A GRPO trainer set up on the vLLM backend: it launched the module's server."""
    config = vllm_config(world, endpoints, vllm={"launch": True, "extra_args": SERVER_ARGS})
    trainer = GRPOTrainer(config, model_path=str(taught_model), output_dir=world / "run", endpoints=endpoints)
    trainer.setup()
    yield trainer
    trainer.cleanup()


def roll(trainer: GRPOTrainer, backend: GenerationBackend, *, temperature: float, n: int,
         seed: int = 7) -> list[RolloutRecord]:
    settings = dataclasses.replace(trainer.settings, temperature=temperature)
    tools = trainer.config.tools

    async def run() -> list[RolloutRecord]:
        async with ToolClient.from_config(tools, trainer.endpoints, seed=seed) as client:
            return await run_rollouts_async(
                backend, trainer.chat, trainer.train_items, n_per_item=n, tool_client=client,
                grader=trainer.config.grader, settings=settings, tools=tools.schemas, max_concurrent=8,
            )

    return asyncio.run(run())


def policy(trainer: GRPOTrainer) -> torch.nn.Module:
    return trainer.accelerator.unwrap_model(trainer.model).eval()


def forward_logprobs(model: torch.nn.Module, record: RolloutRecord, temperature: float) -> list[float]:
    """log_softmax(logits / T) of every generated token of `record`, by one forward pass."""
    ids = torch.tensor([record.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return [logprobs[i - 1].item() for i, generated in enumerate(record.gen_mask) if generated]


def sampled(record: RolloutRecord) -> list[float]:
    return [lp for lp, generated in zip(record.logprobs, record.gen_mask, strict=True) if generated]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def prefix_cache_counters(generator: VllmGenerator) -> tuple[float, float]:
    """The server's prefix-cache counters (tokens queried, tokens found), from its /metrics."""
    text = httpx.get(f"{generator.servers.urls[0]}/metrics", timeout=10).text
    totals = {}
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        totals[name] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
    return totals["vllm:prefix_cache_queries_total"], totals["vllm:prefix_cache_hits_total"]


def test_multi_turn_tool_rollouts_agree_with_the_transformers_engine(trainer: GRPOTrainer):
    generator = trainer.generator
    assert isinstance(generator, VllmGenerator) and generator.launched and generator.version == 0
    assert "--enable-prefix-caching" in generator.launched[0].process.args

    # Sampled at temperature 1: the server's log-probabilities of its own tokens are the
    # trainer's, token by token, over prompts, tool outputs and turns.
    queries, hits = prefix_cache_counters(generator)
    records = roll(trainer, generator.backend(seed=11), temperature=1.0, n=4)
    assert all(r.status != "infra_error" for r in records)
    # Each item's 4 samples went out together: 3 of them found the prompt in the server's
    # cache (whole blocks of it), and later turns their own earlier turns.
    queried, found = (after - before for after, before in zip(prefix_cache_counters(generator), (queries, hits),
                                                              strict=True))
    prompt = min(r.gen_mask.index(1) for r in records)
    assert found >= len(trainer.train_items) * 3 * (prompt - 16) and found / queried > 0.5
    multi_turn = [r for r in records if r.turns >= 2 and r.tool_calls]
    assert multi_turn, "the taught model calls a tool in most rollouts"
    model = policy(trainer)
    for record in records:
        assert record.finish_reasons[-1] in ("stop", "tool_calls", "length")
        assert max_diff(sampled(record), forward_logprobs(model, record, 1.0)) < FP32_TOLERANCE
        # the stop token closes every turn that was not cut, as in the embedded engine
        ends = [i for i in range(1, len(record.gen_mask)) if record.gen_mask[i - 1] and not record.gen_mask[i]]
        assert all(record.token_ids[i - 1] in trainer.stop_token_ids for i in ends)

    # Greedy: both engines write the same conversations, token for token.
    engine = TransformersBackend(model, stop_token_ids=trainer.stop_token_ids, max_slots=8, max_len=768, seed=11)
    on_vllm = roll(trainer, generator.backend(seed=11), temperature=0.0, n=1)
    on_engine = roll(trainer, engine, temperature=0.0, n=1)
    for a, b in zip(on_vllm, on_engine, strict=True):
        assert a.token_ids == b.token_ids and a.gen_mask == b.gen_mask
        assert max_diff(sampled(a), sampled(b)) < FP32_TOLERANCE
        assert a.final_answer == b.final_answer and a.score == b.score


def test_a_weight_sync_makes_the_server_sample_the_new_weights(trainer: GRPOTrainer):
    generator, model = trainer.generator, policy(trainer)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    old_model = type(model)(model.config).eval()
    old_model.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    try:
        generator.sync(1)
        assert generator.version == 1 and generator.sync_seconds[-1] < 60
        records = roll(trainer, generator.backend(seed=12), temperature=1.0, n=2)
        new = [max_diff(sampled(r), forward_logprobs(model, r, 1.0)) for r in records]
        old = [max_diff(sampled(r), forward_logprobs(old_model, r, 1.0)) for r in records]
        assert max(new) < FP32_TOLERANCE
        assert min(old) > 0.01, "the server still samples with the old weights"
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(original[name])
        generator.sync(2)  # the server holds the trainer's weights again
    records = roll(trainer, generator.backend(seed=12), temperature=1.0, n=1)
    assert max(max_diff(sampled(r), forward_logprobs(old_model, r, 1.0)) for r in records) < FP32_TOLERANCE


def test_a_lora_adapter_swap_changes_the_log_probabilities(trainer: GRPOTrainer, world: Path, endpoints,
                                                          taught_model: Path):
    # A second trainer, with LoRA, samples from the module's server (urls, no launch).
    config = vllm_config(world, endpoints, vllm={"urls": [trainer.generator.servers.urls[0]], "sync": "lora"},
                         lora={"r": 8, "alpha": 16})
    lora_trainer = GRPOTrainer(config, model_path=str(taught_model), output_dir=world / "lora-run",
                               endpoints=endpoints)
    lora_trainer.setup()
    try:
        generator = lora_trainer.generator
        assert generator.model == "policy-step-0"  # loaded at setup: B = 0, the base policy
        peft_model = policy(lora_trainer)
        base_records = roll(lora_trainer, generator.backend(seed=13), temperature=1.0, n=1)
        with peft_model.disable_adapter():
            assert max(max_diff(sampled(r), forward_logprobs(peft_model, r, 1.0)) for r in base_records) \
                < FP32_TOLERANCE
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
        generator.sync(1)
        served = {m["id"] for m in generator.servers.get(generator.servers.urls[0], "/v1/models")["data"]}
        assert generator.model == "policy-step-1" and "policy-step-1" in served and "policy-step-0" not in served
        records = roll(lora_trainer, generator.backend(seed=13), temperature=1.0, n=1)
        assert max(max_diff(sampled(r), forward_logprobs(peft_model, r, 1.0)) for r in records) < FP32_TOLERANCE
        with peft_model.disable_adapter():
            assert min(max_diff(sampled(r), forward_logprobs(peft_model, r, 1.0)) for r in records) > 0.01
    finally:
        lora_trainer.cleanup()


@pytest.mark.parametrize("sync", ["lora", "full"])
def test_weights_reach_a_server_over_http_without_its_folder(trainer: GRPOTrainer, world: Path, endpoints,
                                                             taught_model: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch, sync: str):
    """`weight_source: http`, the module's server given by URL as a remote one would be: every
    sync names the trainer's weight server, never a path of its folder; the server downloads
    into a folder of its own and samples with the trainer's weights (full and LoRA)."""
    sent: list[dict] = []
    post = VllmServers.post

    def recorded(self, url, path, body=None, **kwargs):  # the real request, its body kept
        sent.append({"path": path, "body": body})
        return post(self, url, path, body, **kwargs)

    monkeypatch.setattr(VllmServers, "post", recorded)
    url = trainer.generator.servers.urls[0]
    config = vllm_config(world, endpoints, vllm={"urls": [url], "weight_source": "http", "sync": sync},
                         max_steps=1, **({"lora": {"r": 8, "alpha": 16}} if sync == "lora" else {}))
    remote = GRPOTrainer(config, model_path=str(taught_model), output_dir=tmp_path / "run", endpoints=endpoints)
    remote.setup()
    try:
        assert remote.train().steps == 1 and remote.generator.version == 1
        print(f"\n{sync} sync over HTTP: {remote.generator.sync_seconds} s")
    finally:
        remote.cleanup()
        monkeypatch.undo()
        trainer.generator.sync(trainer.step)  # the module's server holds the module trainer's weights again
    row = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]
    assert row["train/sampler_diff_max"] < 1e-3  # the server sampled with the trainer's weights
    syncs = [r for r in sent if r["path"] in ("/collective_rpc", "/v1/load_lora_adapter")]
    assert syncs and str(tmp_path) not in json.dumps(syncs)  # no path of the trainer's folder crossed over
    fetched = [r for r in syncs if r["path"] == "/collective_rpc"
               and r["body"]["method"] in ("agentrft_fetch", "agentrft_fetch_and_reload")]
    assert fetched and all(r["body"]["args"][0].startswith("http://127.0.0.1:") for r in fetched)
    if sync == "lora":
        loads = [r["body"]["lora_path"] for r in syncs if r["path"] == "/v1/load_lora_adapter"]
        assert loads and all("agentrft-weights" in path for path in loads)  # the server's own folder


def test_an_evaluation_backend_reloads_a_model_directory_on_the_servers(trainer: GRPOTrainer, world: Path,
                                                                        taught_model: Path):
    # Another model directory (the taught model, perturbed) is evaluated on the module's server,
    # then the taught model is put back.
    model = policy(trainer)
    other = type(model)(model.config).eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
    other.save_pretrained(world / "other-model")
    vllm = trainer.config.rollout.vllm.model_copy(update={"launch": False, "urls": trainer.generator.servers.urls})
    for directory, weights in ((world / "other-model", other), (taught_model, model)):
        with vllm_eval_backend(vllm, str(directory), rollout=trainer.config.rollout, tokenizer=trainer.tokenizer,
                               stop_token_ids=trainer.stop_token_ids, seed=15) as backend:
            records = roll(trainer, backend, temperature=1.0, n=1)
        assert max(max_diff(sampled(r), forward_logprobs(weights, r, 1.0)) for r in records) < FP32_TOLERANCE


def served_requests(url: str) -> float:
    """Requests the server finished, from its Prometheus metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def test_agentrft_eval_generates_on_vllm(trainer: GRPOTrainer, world: Path, taught_model: Path, tmp_path: Path):
    """`agentrft eval` calls what the stages call: with `rollout.backend: vllm` the rollouts
    are the server's (it reloads the model directory, here the taught model it already holds)."""
    from flows.cli import main

    url = trainer.generator.servers.urls[0]
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(trainer.config.model_dump(mode="json")))
    before = served_requests(url)
    code = main(["eval", "--config", str(config_file), "--model", str(taught_model), "--k", "1", "--max-items", "2",
                 "--out", str(tmp_path / "eval"), "--set", "rollout.vllm.launch=false",
                 "--set", f"rollout.vllm.urls=[{url}]"])
    assert code == 0
    rollouts = read_jsonl(tmp_path / "eval" / "rollouts.jsonl")
    turns = sum(r["turns"] for r in rollouts)
    assert len(rollouts) == len(split_items(trainer.config.data, "validation", 2)) and turns >= len(rollouts)
    assert served_requests(url) - before == turns  # every turn of every rollout was generated there


def test_three_grpo_steps_on_vllm_sync_every_step(trainer: GRPOTrainer):
    syncs = len(trainer.generator.sync_seconds)
    result = trainer.train()
    assert result.steps == 3
    rows = read_jsonl(trainer.output_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert len(trainer.generator.sync_seconds) == syncs + 3 and trainer.generator.version == 3
    for row in rows[1:]:
        assert row["train/rollouts"] == 8 and row["train/infra_error_rate"] == 0
        # The sampler's log-probabilities are the trainer's: each step's weights reached the server.
        assert row["train/sampler_diff_max"] < 1e-3


def test_one_step_off_policy_on_vllm_samples_beside_the_update(trainer: GRPOTrainer, world: Path, endpoints,
                                                               taught_model: Path, tmp_path: Path):
    """`max_staleness: 1` on the module's server: step t+1's rollouts are generated while
    step t trains, with the weights of step t - 1 (the server gets step t's once both are
    done). Step 1 is on-policy; steps 2 and 3 train on rollouts exactly one version old, and
    their sampler log-probs differ from the trainer's by that update (what TIS weighs)."""
    url = trainer.generator.servers.urls[0]
    config = vllm_config(world, endpoints, vllm={"launch": False, "urls": [url]}, max_staleness=1)
    stale = GRPOTrainer(config, model_path=str(taught_model), output_dir=tmp_path / "run", endpoints=endpoints)
    stale.setup()
    try:
        assert stale.train().steps == 3
        assert stale.generator.version == 3 and len(stale.generator.sync_seconds) == 4  # at the start, then per step
    finally:
        stale.cleanup()
    rows = {row["step"]: row for row in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    assert [rows[s]["train/policy_lag_max"] for s in (1, 2, 3)] == [0, 1, 1]
    for step in (2, 3):
        assert {r["policy_version"] for r in read_jsonl(tmp_path / "run" / "rollouts" / f"step_{step}.jsonl")} == {
            step - 2}
        assert rows[step]["train/sampler_diff_max"] > 1e-3 and rows[step]["train/infra_error_rate"] == 0
    assert rows[1]["train/sampler_diff_max"] < 1e-3


def test_rollouts_spread_over_replicas_and_leave_a_dead_one(trainer: GRPOTrainer):
    with socket.socket() as sock:  # a port nobody listens on: a replica that is down
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    live = trainer.generator.servers.urls[0]
    servers = VllmServers([dead, live], backoff_s=0.05, max_concurrent=8)
    try:
        backend = VllmBackend(servers, model=trainer.generator.model, stop_token_ids=trainer.stop_token_ids,
                              max_len=768, seed=16)
        # least loaded first: four sequences are spread two and two
        assert [servers.assign() for _ in range(4)] == [dead, live, dead, live]
        for url in (dead, live, dead, live):
            servers.unassign(url)
        prompts = {f"s{i}": trainer.tokenizer.encode(f"Question {i}:", add_special_tokens=False) for i in range(4)}
        for seq_id, prompt in prompts.items():
            backend.submit(seq_id, prompt, SamplingParams(max_new_tokens=8))
        turns = {}
        while len(turns) < len(prompts):
            turns.update((turn.seq_id, turn) for turn in backend.step())
        # the two on the dead replica moved to the live one and were answered there
        assert servers._load == {dead: 0, live: 4}
        assert all(len(t.token_ids) == len(t.logprobs) > 0 and t.finish_reason in ("stop", "length")
                   for t in turns.values())
        for seq_id in prompts:
            backend.release(seq_id)
        assert servers._load == {dead: 0, live: 0}
        assert servers.alive() == [live]  # it did not answer /health: out of rotation
    finally:
        servers.close()


def test_training_goes_on_when_one_replica_is_killed_and_another_hangs(trainer: GRPOTrainer, world: Path, endpoints,
                                                                      taught_model: Path, tmp_path: Path):
    """Three real servers (the module's and two more) serve a 2-step run: one is killed as
    step 1's rollouts start, one stopped (SIGSTOP: it accepts connections and never
    answers) as step 2's start (at once rather than after a delay: a step of this tiny
    model takes under a second). Their turns move to the survivor, no rollout is an
    infra_error (none is scored for a server's failure), the dead replicas leave the
    weight syncs, `infra/replicas_alive` says 2 then 1, and the hang costs the turn
    deadline (5 s + 0.1 s a token here) and a /health probe, not request_timeout_s."""
    args, env = server_args(max_model_len=768, extra_args=SERVER_ARGS, model_dir=taught_model, max_concurrent=8)
    with contextlib.ExitStack() as stack:
        killed, hung = (stack.enter_context(launched_server(
            str(VLLM_PYTHON), str(taught_model), args=args, env=env, log_path=tmp_path / f"{name}.log",
            startup_timeout_s=600)) for name in ("killed", "hung"))
        stack.callback(lambda: os.killpg(hung.process.pid, signal.SIGCONT))
        urls = [trainer.generator.servers.urls[0], killed.url, hung.url]
        config = vllm_config(world, endpoints, max_steps=2, eval_interval=2,
                             vllm={"urls": urls, "turn_deadline_s": 5.0, "turn_deadline_per_token_s": 0.1})
        run = GRPOTrainer(config, model_path=str(taught_model), output_dir=tmp_path / "run", endpoints=endpoints)
        run.setup()
        calls = []
        rollouts = run.rollouts

        def with_failures(items, n, seed, version):  # the real rollouts, a failure injected as they start
            calls.append(version)
            if len(calls) == 2:  # step 1's rollouts (after the evaluation of step 0)
                os.killpg(killed.process.pid, signal.SIGKILL)
            if len(calls) == 3:  # step 2's
                os.killpg(hung.process.pid, signal.SIGSTOP)
            return rollouts(items, n, seed, version)

        run.rollouts = with_failures
        try:
            result = run.train()
            alive = run.generator.servers.alive()
        finally:
            run.cleanup()
    assert result.steps == 2 and alive == urls[:1]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")[1:]
    assert [row["infra/replicas_alive"] for row in rows] == [2.0, 1.0]
    assert all(row["train/infra_error_rate"] == 0 and row["train/rollouts"] == 8 for row in rows)
    assert rows[1]["timing/sampling_s"] < 60  # not the 600 s of request_timeout_s


def test_a_killed_server_ends_the_batch_with_a_clear_error_quickly(trainer: GRPOTrainer):
    server = trainer.generator.launched[0]
    killer = threading.Timer(0.5, os.killpg, (server.process.pid, signal.SIGKILL))
    started = time.perf_counter()
    killer.start()
    try:
        with pytest.raises(InfraError) as failure:
            for _ in range(20):  # the kill lands during one of these batches, or before the next
                roll(trainer, trainer.generator.backend(seed=14), temperature=1.0, n=4)
    finally:
        killer.cancel()
    assert f"no vLLM replica is alive ({server.url}: " in str(failure.value)
    assert time.perf_counter() - started < 60


def test_a_dead_engine_is_reported_with_the_root_cause_from_its_log(trainer: GRPOTrainer, tmp_path: Path):
    """vLLM 0.32.0's CPU attention has no kernel for a head of 16 dimensions: its engine
    starts, then dies at the first batch. The client's error names that cause, read from
    the server's log, not only its own last retry."""
    from envs.finqa.tiny_model import build_model, tiny_config

    model_dir = tmp_path / "head-dim-16"
    config = tiny_config(len(trainer.tokenizer), hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                         intermediate_size=128, max_position_embeddings=1024)
    build_model(config, seed=0).save_pretrained(model_dir)
    trainer.tokenizer.save_pretrained(model_dir)
    vllm = trainer.config.rollout.vllm.model_copy(update={"launch": True, "urls": [], "extra_args": [
        "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(32 << 20), "--max-num-seqs", "4",
        "--distributed-executor-backend=uni"]})
    with pytest.raises(InfraError) as failure:
        with vllm_eval_backend(vllm, str(model_dir), rollout=trainer.config.rollout, tokenizer=trainer.tokenizer,
                               stop_token_ids=trainer.stop_token_ids, seed=3) as backend:
            roll(trainer, backend, temperature=1.0, n=1)
    assert "Unsupported CPU attention configuration: head_dim=16" in str(failure.value)


def test_a_server_that_cannot_start_is_a_clear_error_with_its_log(tmp_path: Path):
    (tmp_path / "not-a-model").mkdir()
    started = time.perf_counter()
    with pytest.raises(InfraError, match="exited with code") as failure:
        with launched_server(str(VLLM_PYTHON), str(tmp_path / "not-a-model"), args=[], log_path=tmp_path / "log",
                             startup_timeout_s=300):
            pass
    assert str(tmp_path / "log") in str(failure.value) and "not-a-model" in str(failure.value)
    assert time.perf_counter() - started < 300

