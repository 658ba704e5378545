"""The GRPO trainer end to end: a taught tiny model, the real tool server, real steps.

The fixture *teaches* a tiny Qwen3 (the demo's supervised warm start) three ways to answer
each of two items: list the year's directory then answer right, read the page then answer
right, or answer "0" at once. Sampled at temperature 1 it mixes them, so the groups'
rewards vary and GRPO has something to move; tool outputs are cut to 256 characters and
only two short tool schemas are offered, which keeps every rollout under ~400 tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from envs.finqa.local import local_tool_endpoints
from tests.taught_model import GRADER, OUTPUT_CHARS, SYSTEM, TOOLS, copy_items, teach_model
from trainer.config.loading import config_from_dict
from trainer.config.tools import ToolEndpoint
from trainer.data import read_items, read_jsonl
from trainer.errors import ConfigError
from trainer.rl.batches import fill_batch, in_loss, resample_share
from trainer.rl.checkpoint import latest_checkpoint
from trainer.rl.grpo import GRPOTrainer, train
from trainer.rl.launch import launch_command, node_topology
from trainer.rl.loss import batch_advantages, chunked_logprobs, policy_loss, token_weights
from trainer.rollout.loop import run_rollouts_async
from trainer.rollout.record import RolloutRecord, RolloutSettings
from trainer.rollout.tool_client import ToolClient

REPO = Path(__file__).resolve().parents[2]
NAMED_METRICS = [
    "train/reward_mean", "train/score_mean", "train/tool_calls_mean", "train/tool_calls_p95",
    "train/tokens_mean", "train/latency_s_mean", "train/infra_error_rate", "train/kl", "train/loss",
    "train/grad_norm", "train/rollouts_per_s", "train/tokens_per_s", "train/grader_errors",
    "train/zero_variance_group_share", "train/lr", "timing/sampling_s", "timing/training_s",
    "timing/eval_s", "timing/step_s", "memory/rss_gib", "memory/peak_rss_gib",
    "rollout/prefix_cache_hit_tokens", "rollout/prefix_cache_hit_share",
]
# One optimizer update per pass (micro-batches cover the batch), so 1 and 2 processes
# partition the work identically and must end with the same weights.
TRAINING = {
    "batch_size": 2, "compute_multiplier": 0.5, "n_epochs": 2, "learning_rate": 1e-3, "eval_interval": 2,
    "eval_samples": 2, "ppo_epochs": 2, "micro_batch_size": 8, "kl_coef": 0.05, "checkpoint_interval": 1,
    "seed": 3, "scale_rewards": "group",
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """A model this small runs faster on one thread, and several times faster when other
    work shares the two cores (OpenMP threads wait for each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def world(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two training items (also the eval items), their corpus pages, and the tool server."""
    root = tmp_path_factory.mktemp("grpo")
    items = read_items(demo_data_dir / "train.jsonl", 2)
    copy_items(demo_data_dir, items, root, "train.jsonl")
    copy_items(demo_data_dir, items, root, "validation.jsonl")  # the same items: a tiny world
    copy_items(demo_data_dir, items, root, "test.jsonl")  # never read by the trainer
    return root


@pytest.fixture(scope="module")
def endpoints(world: Path):
    with local_tool_endpoints(world / "corpus", max_output_chars=OUTPUT_CHARS) as served:
        yield served


@pytest.fixture(scope="module")
def taught_model(world: Path, endpoints: list[ToolEndpoint]) -> Path:
    return teach_model([world / "train.jsonl"], world / "corpus", endpoints, world / "model")


def micro_config(world: Path, endpoints: list[ToolEndpoint], **training):
    return config_from_dict({
        "model": {"base_model": "unused: passed as model_path"},
        "data": {"train_file": str(world / "train.jsonl"), "validation_file": str(world / "validation.jsonl"),
                 "test_file": str(world / "test.jsonl")},
        "tools": {"endpoints": [e.model_dump() for e in endpoints], "schemas": TOOLS,
                  "max_output_chars": OUTPUT_CHARS, "max_retries": 2},
        "grader": GRADER,
        # One rollout at a time: with several, which sequences share an engine batch depends
        # on when tool answers arrive, and the logits move in the last bits with the batch;
        # alone, every run samples bit-identical rollouts and runs can be compared exactly.
        "rollout": {"system_prompt": SYSTEM, "max_turns": 3, "max_new_tokens_per_turn": 48, "max_total_tokens": 768,
                    "max_concurrent_rollouts": 1},
        "training": {**TRAINING, **training},
        "mlflow": {"tracking_uri": f"sqlite:///{world / 'mlflow.db'}"},
    })


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def _comparable(row: dict) -> dict:
    """Metrics that do not depend on wall time or the process's memory."""
    return {k: v for k, v in row.items() if not (k.startswith(("timing/", "memory/")) or "latency" in k or k.endswith("_per_s"))}


@pytest.fixture(scope="module")
def two_step_run(world: Path, endpoints: list[ToolEndpoint], taught_model: Path):
    """The uninterrupted 2-step run, through the CLI entry point, logging to MLflow."""
    from flows.cli import main
    from tasks.tracking import mlflow_client

    config = micro_config(world, endpoints)
    config_file = world / "micro.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    client = mlflow_client(config.mlflow.tracking_uri)
    run_id = client.create_run(client.create_experiment("grpo-test")).info.run_id
    out = world / "run"
    code = main(["train", "--config", str(config_file), "--model", str(taught_model), "--output-dir", str(out),
                 "--mlflow-run-id", run_id])
    assert code == 0
    return out, run_id, client


def test_two_steps_change_the_weights_and_log_every_metric(two_step_run, taught_model: Path):
    out, run_id, client = two_step_run
    rows = read_jsonl(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:
        missing = [name for name in NAMED_METRICS if row.get(name) is None]
        assert not missing, missing
        assert row["train/rollouts"] == 8 and row["train/lr"] == pytest.approx(1e-3)
        assert 0 <= row["train/zero_variance_group_share"] <= 1
        # a group's 4 samples share the prompt; the two items, the system prompt and tool schemas
        assert 0.5 < row["rollout/prefix_cache_hit_share"] < 1
    # eval before training and after the last step, on both items
    assert rows[0]["eval/rollouts"] == 2 and rows[2]["eval/rollouts"] == 2 and "eval/score_mean" not in rows[1]
    updates = sum(row["train/updates"] for row in rows[1:])
    assert updates > 0, "no group varied: the taught model should mix right and wrong answers"
    assert any(row["train/loss"] != 0 and row["train/grad_norm"] > 0 for row in rows[1:])

    before, after = _weights(taught_model), _weights(out / "final")
    assert set(before) == set(after)
    assert max((before[k] - after[k]).abs().max().item() for k in before) > 1e-4

    # the same values reached the MLflow run
    history = client.get_metric_history(run_id, "train/reward_mean")
    assert sorted((m.step, round(m.value, 6)) for m in history) == [
        (row["step"], round(row["train/reward_mean"], 6)) for row in rows[1:]
    ]
    assert {m.step for m in client.get_metric_history(run_id, "eval/score_mean")} == {0, 2}
    assert {m.step for m in client.get_metric_history(run_id, "rollout/prefix_cache_hit_share")} == {1, 2}
    artifacts = {a.path for a in client.list_artifacts(run_id, "figures")}
    assert artifacts == {"figures/reward_curve.png", "figures/tool_calls_tokens.png", "figures/policy_shift.png"}

    kept = read_jsonl(out / "rollouts" / "step_1.jsonl")
    assert kept and all(row["step"] == 1 and row["messages"] for row in kept)
    assert {row["kept_as"] for row in kept} <= {"best", "worst"}
    assert (out / "best" / "step_2" / "config.json").is_file()
    result = json.loads((out / "train_result.json").read_text())
    assert result["steps"] == 2 and result["best_checkpoints"][0]["step"] == 2


def test_stopped_and_resumed_run_matches_the_uninterrupted_one(two_step_run, world, endpoints, taught_model):
    reference_dir, _, _ = two_step_run
    config = micro_config(world, endpoints)
    out = world / "resumed"
    first = GRPOTrainer(config, model_path=str(taught_model), output_dir=out)
    first.setup()
    try:
        stopped = first.train(stop_after=1)
    finally:
        first.cleanup()
    assert stopped.steps == 1 and stopped.model_dir is None
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_1"]

    result = train(config, model_path=str(taught_model), output_dir=out, resume=True)
    assert result.steps == 2
    expected = [_comparable(r) for r in read_jsonl(reference_dir / "metrics.jsonl")]
    got = [_comparable(r) for r in read_jsonl(out / "metrics.jsonl")]
    assert [r["step"] for r in got] == [0, 1, 2]
    for want, have in zip(expected, got, strict=True):
        assert want.keys() == have.keys()
        for key in want:
            assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    reference, resumed = _weights(reference_dir / "final"), _weights(out / "final")
    assert max((reference[k] - resumed[k]).abs().max().item() for k in reference) < 1e-6

    # a finished run's directory is not silently reused, nor resumed with another data order
    for changed, resume, message in (({}, False, "pass --resume"), ({"seed": 4}, True, "seed: now 4, checkpoint 3")):
        trainer = GRPOTrainer(micro_config(world, endpoints, **changed), model_path=str(taught_model),
                              output_dir=out, resume=resume)
        with pytest.raises(ConfigError, match=message):
            trainer.setup()
        trainer.cleanup()


def test_cli_launches_several_cpu_processes_with_torchrun_and_gloo(world, endpoints):
    from trainer.rl.launch import launch_command

    config = micro_config(world, endpoints, num_processes=2)
    command, env = launch_command(config, ["--config", "x.yaml"])
    assert command[-5:] == ["-m", "flows.cli", "train", "--config", "x.yaml"]
    assert command[command.index("--num_processes") + 1] == "2" and env["AGENTRFT_LAUNCHED"] == "1"
    if not torch.cuda.is_available():
        assert "--multi_gpu" in command and "--cpu" not in command and env["ACCELERATE_USE_CPU"] == "true"


def test_one_process_launch_names_every_setting_accelerate_would_warn_about(world, endpoints):
    from trainer.rl.launch import launch_command

    command, _ = launch_command(micro_config(world, endpoints), ["--config", "x.yaml"])
    launcher = command[: command.index("flows.cli")]  # `python -m accelerate.commands.launch ...`
    expected_mixed = "bf16" if torch.cuda.is_available() else "no"
    flags = ("--num_processes", "--num_machines", "--mixed_precision", "--dynamo_backend")
    assert {flag: launcher[launcher.index(flag) + 1] for flag in flags if flag in launcher} == {
        "--num_processes": "1", "--num_machines": "1", "--mixed_precision": expected_mixed, "--dynamo_backend": "no"}
    if not torch.cuda.is_available():
        threads = launcher[launcher.index("--num_cpu_threads_per_process") + 1]
        assert int(threads) >= 1 and "--cpu" in launcher


def test_infra_failures_are_left_out_of_the_loss_and_counted(world, endpoints, taught_model):
    # `cat` points at a port nobody listens on: rollouts that read a page fail as infra.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    broken = [e if e.name != "cat" else ToolEndpoint(name="cat", server_url=f"http://127.0.0.1:{dead_port}/tools/cat")
              for e in endpoints]
    config = micro_config(world, broken, max_steps=1, kl_coef=0.0)
    trainer = GRPOTrainer(config, model_path=str(taught_model), output_dir=world / "infra")
    trainer.setup()
    try:
        records = trainer.rollouts(read_items(world / "train.jsonl"), 12, seed=11, version=0)
        trainer.train()
    finally:
        trainer.cleanup()
    infra = [r for r in records if r.status == "infra_error"]
    assert infra and len(infra) < len(records)
    rewards = [r.reward if in_loss(r, mask_truncated=True) else None for r in records]
    advantages, _ = batch_advantages(rewards, 4, scale_rewards="group")
    for record, advantage in zip(records, advantages, strict=True):
        if record.status == "infra_error":
            assert record.reward is None and advantage is None
    for start in range(0, len(records), 4):
        group = list(zip(records[start : start + 4], advantages[start : start + 4], strict=True))
        used = [(r, a) for r, a in group if a is not None]
        if used:  # centred over the rollouts that have a reward, and only those
            assert sum(a for _, a in used) == pytest.approx(0.0, abs=1e-6)
            assert len(used) == sum(1 for r, _ in group if r.trainable)

    (row,) = [r for r in read_jsonl(world / "infra" / "metrics.jsonl") if r["step"] == 1]
    assert 0 < row["train/infra_error_rate"] < 1
    infra_count = round(row["train/infra_error_rate"] * row["train/rollouts"])
    assert row["train/rollouts_in_loss"] <= row["train/rollouts"] - infra_count


def test_loss_gives_no_gradient_to_tool_output_tokens(world, endpoints, taught_model):
    from trainer.generation.policy import load_policy

    policy = load_policy(str(taught_model), device="cpu")
    settings = RolloutSettings(system_prompt=SYSTEM, temperature=0.7, max_turns=3, max_new_tokens_per_turn=48,
                               max_total_tokens=768)

    async def rollouts() -> list[RolloutRecord]:
        backend = policy.backend(max_slots=16, max_len=768, seed=5)
        async with ToolClient(endpoints, TOOLS, max_output_chars=OUTPUT_CHARS) as client:
            return await run_rollouts_async(backend, policy.chat, read_items(world / "train.jsonl"), n_per_item=4,
                                            tool_client=client, grader=GRADER, settings=settings, tools=TOOLS)

    record = next(r for r in asyncio.run(rollouts()) if r.tool_calls and r.status == "ok")
    ids = torch.tensor([record.token_ids])
    gen = torch.tensor([record.gen_mask], dtype=torch.bool)
    mask = gen[:, 1:]
    first = int(gen[0].nonzero()[0])
    tool_output = ~gen[0] & (torch.arange(len(record.token_ids)) > first)  # context after the first generated token
    assert tool_output.sum() > 10

    with torch.no_grad():
        base_logits = policy.model(ids).logits
    # The trainer recomputes the sampler's logprobs from logits / T, at the same temperature.
    recomputed, _ = chunked_logprobs(base_logits[:, :-1], ids[:, 1:], 0.7, chunk=64)
    assert torch.allclose(recomputed[mask], torch.tensor([record.logprobs[1:]])[mask], atol=1e-4)

    def loss_and_grad(token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = base_logits.clone().requires_grad_(True)
        new, _ = chunked_logprobs(logits[:, :-1], token_ids[:, 1:], 0.7, chunk=64)
        old = torch.tensor([record.logprobs[1:]]) - 0.05  # off-policy: clipping and ratios all in play
        weights = token_weights(mask, loss_type="dapo", update_tokens=float(mask.sum()), update_rollouts=1.0,
                                generation_budget=768)
        loss, _ = policy_loss(new, old, torch.tensor([1.0]), mask, weights, epsilon=0.2, kl_coef=0.1,
                              ref=new.detach() + 0.1)
        loss.backward()
        return loss.detach(), logits.grad[0]

    loss, grad = loss_and_grad(ids)
    predicts_context = ~mask[0]  # row t predicts token t + 1
    assert grad[:-1][predicts_context].abs().max() == 0
    assert grad[:-1][mask[0]].abs().sum(-1).gt(0).all()
    assert grad[-1].abs().max() == 0  # the last position predicts nothing

    # Perturbing the tool outputs' tokens changes neither the loss nor its gradient.
    perturbed = ids.clone()
    perturbed[0, tool_output] = torch.randint(0, len(policy.tokenizer), (int(tool_output.sum()),),
                                              generator=torch.Generator().manual_seed(0))
    assert not torch.equal(perturbed, ids)
    loss2, grad2 = loss_and_grad(perturbed)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)


def test_lora_run_saves_merged_weights(world, endpoints, taught_model):
    from transformers import AutoModelForCausalLM

    config = micro_config(world, endpoints, max_steps=1, eval_samples=1,
                          lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    result = train(config, model_path=str(taught_model), output_dir=world / "lora")
    weights = _weights(result.model_dir)
    base = _weights(taught_model)
    assert set(weights) == set(base)  # merged: plain weights, no adapter tensors
    assert read_jsonl(world / "lora" / "metrics.jsonl")[-1]["train/updates"] > 0
    # the adapters moved, merged into the projections they wrap, and only there
    changed = [k for k in base if not torch.equal(base[k], weights[k])]
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed)
    AutoModelForCausalLM.from_pretrained(result.model_dir)


TWO_PROCESSES = textwrap.dedent("""
    import hashlib, sys
    from pathlib import Path
    from trainer.config.loading import load_config
    from trainer.rl.grpo import GRPOTrainer

    config_file, model, out, stop_after, resume = sys.argv[1:6]
    trainer = GRPOTrainer(load_config(config_file), model_path=model, output_dir=Path(out), resume=resume == "1")
    trainer.setup()
    try:
        trainer.train(stop_after=int(stop_after) or None)
        digest = hashlib.sha256()
        state = trainer.sampling_model().state_dict()
        for name in sorted(state):
            digest.update(name.encode())
            digest.update(state[name].detach().cpu().numpy().tobytes())
        rank = trainer.accelerator.process_index
        (Path(out) / f"weights_{rank}.sha256").write_text(digest.hexdigest())
    finally:
        trainer.cleanup()
""")


def two_processes(config, taught_model: Path, tmp_path: Path, out: Path, *, stop_after: int = 0,
                  resume: bool = False) -> None:
    """Run the trainer as two gloo CPU processes under `accelerate launch`. (`accelerate
    launch --cpu --num_processes 2` would start one process: accelerate spawns several CPU
    processes through MPI only. Its torchrun launcher with ACCELERATE_USE_CPU=true starts
    two gloo processes, as `trainer.train_cli` does.)"""
    config_file = tmp_path / "micro.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    script = tmp_path / "two_processes.py"
    script.write_text(TWO_PROCESSES)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--main_process_port", str(port), str(script), str(config_file), str(taught_model), str(out),
         str(stop_after), "1" if resume else "0"],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    hashes = [(out / f"weights_{rank}.sha256").read_text() for rank in (0, 1)]
    assert hashes[0] == hashes[1]  # every process samples with the same whole model


def assert_same_run(one: Path, two: Path) -> None:
    """Two processes end where one does, on the same global batch: weights within 1e-4
    (float32 sums in another order, over two steps of AdamW), metrics within 1e-4."""
    final, reference = _weights(two / "final"), _weights(one / "final")
    assert max((reference[k] - final[k]).abs().max().item() for k in reference) < 1e-4
    for want, have in zip(read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl"), strict=True):
        for key in ("train/reward_mean", "train/rollouts_in_loss", "train/loss", "eval/score_mean"):
            if key in want:
                assert have[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (want["step"], key)


@pytest.mark.slow
def test_two_ddp_processes_end_with_the_weights_of_one(two_step_run, world, endpoints, taught_model, tmp_path):
    """Rollouts sharded by item, DDP update: the same weights on both processes, and the
    same as the one-process run."""
    reference_dir, _, _ = two_step_run
    config = micro_config(world, endpoints, num_processes=2, distributed="ddp")
    two_processes(config, taught_model, tmp_path, tmp_path / "run")
    assert_same_run(reference_dir, tmp_path / "run")


@pytest.mark.slow
def test_two_fsdp_processes_stopped_and_resumed_end_with_the_weights_of_one(world, endpoints, taught_model,
                                                                           tmp_path):
    """FSDP2 over two gloo processes with the KL reference sharded too, `scale_rewards:
    batch` (the std of both processes' rewards), stopped after step 1 and resumed from its
    sharded checkpoint: the model directory saved whole equals the one-process run's."""
    config = micro_config(world, endpoints, scale_rewards="batch")
    one = train(config, model_path=str(taught_model), output_dir=tmp_path / "one")
    assert one.model_dir is not None
    sharded = micro_config(world, endpoints, scale_rewards="batch", num_processes=2, distributed="fsdp")
    two_processes(sharded, taught_model, tmp_path, tmp_path / "two", stop_after=1)
    shards = tmp_path / "two" / "checkpoints" / "step_1" / "model_shards"
    assert len(list(shards.glob("*.distcp"))) == 2  # each process wrote its own shards
    two_processes(sharded, taught_model, tmp_path, tmp_path / "two", resume=True)
    assert_same_run(tmp_path / "one", tmp_path / "two")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "final")


@pytest.mark.slow
def test_two_fsdp_processes_train_lora_as_one_process_does(world, endpoints, taught_model, tmp_path):
    """LoRA under FSDP2 (frozen base and trainable adapters sharded in the same groups; the
    KL reference is the base with the adapters off): the merged model directory equals the
    one-process run's."""
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    config = micro_config(world, endpoints, max_steps=1, eval_samples=1, lora=lora)
    assert train(config, model_path=str(taught_model), output_dir=tmp_path / "one").model_dir is not None
    sharded = micro_config(world, endpoints, max_steps=1, eval_samples=1, lora=lora, num_processes=2,
                           distributed="fsdp")
    two_processes(sharded, taught_model, tmp_path, tmp_path / "two")
    assert_same_run(tmp_path / "one", tmp_path / "two")
    assert set(_weights(tmp_path / "two" / "final")) == set(_weights(taught_model))  # merged


def test_fsdp_on_one_process_trains_as_without_it(world, endpoints, taught_model, tmp_path):
    """FSDP on one device (a world of one: what a single GPU runs) is the plain update."""
    plain = train(micro_config(world, endpoints, max_steps=1, eval_samples=1), model_path=str(taught_model),
                  output_dir=tmp_path / "plain")
    sharded = train(micro_config(world, endpoints, max_steps=1, eval_samples=1, distributed="fsdp"),
                    model_path=str(taught_model), output_dir=tmp_path / "fsdp")
    a, b = _weights(plain.model_dir), _weights(sharded.model_dir)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4  # as two processes: AdamW over float32 sums


def test_dynamic_sampling_gives_every_process_distinct_items():
    shares = [resample_share(10, 3, 2, rank, seed=7) for rank in (0, 1)]
    assert all(len(share) == 3 for share in shares) and not set(shares[0]) & set(shares[1])
    # the draw does not depend on the process count: two processes cover one process's items
    assert sorted(shares[0] + shares[1]) == sorted(resample_share(10, 6, 1, 0, seed=7))
    small = [resample_share(3, 2, 2, rank, seed=7) for rank in (0, 1)]
    assert [len(share) for share in small] == [1, 1] and not set(small[0]) & set(small[1])


def test_batch_scaling_over_processes_is_the_one_process_value():
    rewards = [1.0, 0.0, 0.5, None, 0.9, 0.1, 0.2, 0.2]
    whole, _ = batch_advantages(rewards, 2, scale_rewards="batch")
    everyone = [r for r in rewards if r is not None]
    halves = [batch_advantages(rewards[:4], 2, scale_rewards="batch", batch_rewards=everyone)[0],
              batch_advantages(rewards[4:], 2, scale_rewards="batch", batch_rewards=everyone)[0]]
    assert halves[0] + halves[1] == pytest.approx(whole)
    alone, _ = batch_advantages(rewards[:4], 2, scale_rewards="batch")
    assert alone != pytest.approx(halves[0])  # a process's own std would differ


def _record(item: str, reward: float | None, *, truncated: bool = False) -> RolloutRecord:
    return RolloutRecord(trace_id="t", item_id=item, sample_index=0, messages=[], tool_calls=[], final_answer="",
                         status="truncated" if truncated else "ok", score=reward, reward=reward,
                         finish_reasons=["length" if truncated else "stop"])


def test_dynamic_sampling_never_keeps_a_silent_group_and_stops_at_its_cap():
    silent = [_record("a", 1.0), _record("a", 1.0)]
    varied = [_record("b", 1.0), _record("b", 0.0)]
    cut = [_record("c", 1.0), _record("c", 0.0, truncated=True)]  # varies only through a masked rollout
    calls = []

    def sample(round_: int) -> list[RolloutRecord]:
        calls.append(round_)
        return [*silent, *(varied if round_ == 2 else cut)]

    kept, rounds, dropped = fill_batch(sample, [*silent, *varied], group_size=2, want_groups=2, max_rounds=3,
                                       mask_truncated=True)
    assert kept == [*varied, *varied] and rounds == 2 and calls == [1, 2]
    assert dropped == 4  # silent (first batch), silent and cut (round 1), silent (round 2)
    kept, rounds, _ = fill_batch(lambda r: [*silent, *silent], [*silent, *varied], group_size=2, want_groups=2,
                                 max_rounds=2, mask_truncated=True)
    assert kept == varied and rounds == 2  # the cap ends it with what varies, never a silent group


def test_one_pass_takes_the_trainer_as_old_policy_and_reports_the_sampler_mismatch(world, endpoints, taught_model):
    config = micro_config(world, endpoints, max_steps=1, ppo_epochs=1, kl_coef=0.0, dynamic_sampling=True,
                          max_resample_batches=1)
    result = train(config, model_path=str(taught_model), output_dir=world / "one_pass")
    (row,) = [r for r in read_jsonl(world / "one_pass" / "metrics.jsonl") if r["step"] == 1]
    assert row["train/updates"] == 1
    assert row["train/kl"] == pytest.approx(0.0, abs=1e-9) and row["train/clip_fraction"] == 0.0  # ratio exactly 1
    # the sampler (the engine, fp32 on CPU) and the trainer agree to float noise; TIS weights are ~1
    assert row["train/sampler_diff_max"] < 1e-3 and row["train/tis_capped_share"] == 0.0
    assert row["train/resample_rounds"] <= 1 and row["train/zero_variance_group_share"] == 0.0
    assert result.steps == 1


def _with_sampler(config, sampler: str):
    return config.model_copy(update={"rollout": config.rollout.model_copy(update={"overlap_sampler": sampler})})


def test_one_step_off_policy_samples_the_next_step_during_the_update(two_step_run, world, endpoints, taught_model):
    """`max_staleness: 1` on the embedded engine: a frozen copy of the weights samples step
    2's rollouts while step 1 trains, in a child process or in a thread. Step 1 is the
    on-policy run's (same weights, same seeds); step 2 trains on rollouts exactly one
    version old, whose sampler log-probs differ from the trainer's by the update (what TIS
    weighs), not by float noise; the copy holds the final weights after the last sync; and
    the process samples what the thread samples."""
    from trainer.rollout.generators import ProcessSampler

    reference_dir, _, _ = two_step_run
    reference = {r["step"]: r for r in read_jsonl(reference_dir / "metrics.jsonl")}
    assert reference[2]["train/policy_lag_max"] == 0
    runs = {}
    for sampler in ("process", "thread"):
        out = world / f"one_step_off_{sampler}"
        trainer = GRPOTrainer(_with_sampler(micro_config(world, endpoints, max_staleness=1), sampler),
                              model_path=str(taught_model), output_dir=out)
        trainer.setup()
        try:
            assert isinstance(trainer.generator, ProcessSampler) == (sampler == "process")
            assert trainer.train().steps == 2
            frozen, trained = trainer.generator.copy.state_dict(), trainer.sampling_model().state_dict()
            assert all(torch.equal(frozen[name], tensor) for name, tensor in trained.items())
        finally:
            trainer.cleanup()
        if sampler == "process":
            assert not trainer.generator.process.is_alive()  # stopped with the trainer
        rows = runs[sampler] = {r["step"]: r for r in read_jsonl(out / "metrics.jsonl")}
        # Step 1's update shares the cores with step 2's sampling, which moves its float sums in
        # the last bits (OpenMP teams); its rollouts (sampled before) are the same ones.
        # The sampler's own difference from the trainer on step 1 is float noise in both runs
        # (a few 1e-6, different by OpenMP's order): held below the bound, not compared.
        for key, value in _comparable(reference[1]).items():
            if key.startswith("train/sampler_"):
                assert rows[1][key] < 1e-3 and value < 1e-3, (sampler, key)
                continue
            assert rows[1][key] == pytest.approx(value, rel=1e-3, abs=1e-6), (sampler, key)
        assert rows[1]["train/policy_lag_max"] == 0 and rows[2]["train/policy_lag_max"] == 1
        step_2 = read_jsonl(out / "rollouts" / "step_2.jsonl")
        assert {r["policy_version"] for r in step_2} == {0}
        assert reference[2]["train/sampler_diff_max"] < 1e-3 < rows[2]["train/sampler_diff_max"]
        # Step 2's rollouts were sampled while step 1 was updating (wall clock): they started
        # as the update began, not after it, and were not all done before it began.
        learn_start, learn_end = rows[1]["timing/learn_start_unix"], rows[1]["timing/learn_end_unix"]
        assert learn_start - 1.0 < min(r["started_at"] for r in step_2) < learn_end, sampler
        assert max(r["started_at"] + r["latency_s"] for r in step_2) > learn_start, sampler
    for step in (1, 2):
        for key, value in _comparable(runs["thread"][step]).items():
            if step == 1 and key.startswith("train/sampler_"):
                continue  # float noise, bounded above
            assert runs["process"][step][key] == pytest.approx(value, rel=1e-3, abs=1e-6), (step, key)


def test_a_sampler_process_that_dies_ends_the_run_with_its_exit_code(world, endpoints, taught_model):
    """The child that samples is killed (as the kernel's out-of-memory killer would): the
    next sampling raises an InfraError that names the process and its signal, not a hang
    and not rollouts scored 0."""

    from trainer.errors import InfraError

    trainer = GRPOTrainer(micro_config(world, endpoints, max_staleness=1, n_epochs=1),
                          model_path=str(taught_model), output_dir=world / "sampler_killed")
    trainer.setup()
    try:
        os.kill(trainer.generator.process.pid, signal.SIGKILL)
        with pytest.raises(InfraError, match=r"sampler process \(pid \d+\) died while sampling \(exit code -9"):
            trainer.train()
        assert not (world / "sampler_killed" / "rollouts" / "step_1.jsonl").exists()
    finally:
        trainer.cleanup()


def test_an_error_in_the_sampler_process_is_raised_in_the_trainer(world, endpoints, taught_model):
    """An exception raised while the child samples reaches the trainer as itself, with the
    child's traceback as a note; the child goes on serving."""
    trainer = GRPOTrainer(micro_config(world, endpoints, max_staleness=1), model_path=str(taught_model),
                          output_dir=world / "sampler_error")
    trainer.setup()
    try:
        generator = trainer.generator
        with pytest.raises(Exception) as raised:
            generator.sample([{"id": "no-messages"}], 1, 0, 0)
        assert any("raised in the sampler process" in note for note in getattr(raised.value, "__notes__", []))
        records = generator.sample(trainer.train_items[:1], 2, 0, 0)
        assert len(records) == 2 and all(r.policy_version == 0 for r in records)
        assert generator.process.is_alive()
    finally:
        trainer.cleanup()


def test_overlap_sampler_process_needs_a_cpu_model(world, endpoints):
    from trainer.rollout.generators import overlap_in_process

    config = micro_config(world, endpoints, max_staleness=1)
    with torch.device("meta"):
        off_cpu = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="rollout.overlap_sampler: process needs a model on the CPU"):
        overlap_in_process(_with_sampler(config, "process"), off_cpu)
    assert overlap_in_process(config, off_cpu) is False  # auto: a thread
    assert overlap_in_process(config, torch.nn.Linear(4, 4)) is True
    assert overlap_in_process(_with_sampler(config, "thread"), torch.nn.Linear(4, 4)) is False


@pytest.mark.slow
def test_kl_coef_by_group_over_every_items_group_trains_as_the_same_kl_coef(world, endpoints, taught_model):
    groups = {item["category"] for item in read_jsonl(world / "train.jsonl")}
    weights = []
    # Two passes: in the first the policy is the reference and the KL term has no gradient.
    for name, training in (("kl_global", {"kl_coef": 0.5}),
                           ("kl_by_group", {"kl_coef": 0.0, "group_by": "category",
                                            "kl_coef_by_group": dict.fromkeys(groups, 0.5)}),
                           ("kl_none", {"kl_coef": 0.0})):
        config = micro_config(world, endpoints, max_steps=1, eval_samples=1, ppo_epochs=2, **training)
        weights.append(_weights(train(config, model_path=str(taught_model), output_dir=world / name).model_dir))
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])  # the KL term moved them


@pytest.mark.parametrize("settings", [
    {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2}},
    {"distributed_type": "FSDP", "fsdp_config": {}},
])
def test_deepspeed_and_fsdp_are_refused_with_the_alternative(world, endpoints, taught_model, tmp_path, settings):
    accelerate_config = tmp_path / "accelerate.yaml"
    accelerate_config.write_text(yaml.safe_dump(settings))
    config = micro_config(world, endpoints, accelerate_config=str(accelerate_config))
    trainer = GRPOTrainer(config, model_path=str(taught_model), output_dir=tmp_path / "out")
    with pytest.raises(ConfigError, match=f"{settings['distributed_type']}: the trainer shards the model itself; "
                                          "set training.distributed: fsdp"):
        trainer.setup()
    trainer.cleanup()


def test_training_on_vllm_refuses_top_p_below_one_and_lora_syncs_its_adapter(world, endpoints, taught_model,
                                                                             tmp_path):
    from trainer.generation.weight_sync import resolved_sync

    config = micro_config(world, endpoints)
    config = config.model_copy(update={"rollout": config.rollout.model_copy(update={
        "backend": "vllm", "top_p": 0.9,
        "vllm": config.rollout.vllm.model_copy(update={"urls": ["http://127.0.0.1:9"]})})})
    trainer = GRPOTrainer(config, model_path=str(taught_model), output_dir=tmp_path / "out")
    with pytest.raises(ConfigError, match="rollout.top_p is 0.9 on the vLLM backend.*train with top_p 1"):
        trainer.setup()  # before any server is asked anything
    trainer.cleanup()
    lora = micro_config(world, endpoints, lora={"r": 4}).training.lora
    assert resolved_sync(config.rollout.vllm, lora) == "lora" and resolved_sync(config.rollout.vllm, None) == "full"
    assert resolved_sync(config.rollout.vllm.model_copy(update={"sync": "full"}), lora) == "full"


def test_checkpoints_are_ranked_by_validation_reward_unless_told_score(world, endpoints, taught_model):
    """With a price per token, reward and score differ: the kept checkpoint carries the
    figure `metric_for_best_model` names."""
    for metric in ("reward", "score"):
        config = micro_config(world, endpoints, max_steps=1, metric_for_best_model=metric)
        config = config.model_copy(update={"penalties": config.penalties.model_copy(update={"per_token": 0.002})})
        out = world / f"ranked_by_{metric}"
        trainer = GRPOTrainer(config, model_path=str(taught_model), output_dir=out)
        trainer.setup()
        try:
            result = trainer.train()
        finally:
            trainer.cleanup()
        last = read_jsonl(out / "metrics.jsonl")[-1]
        assert last["eval/reward_mean"] != pytest.approx(last["eval/score_mean"])
        assert result.best_checkpoints[0][1] == pytest.approx(last[f"eval/{metric}_mean"])

# --- past one machine: two "nodes" on loopback --------------------------------------------------
# Two launchers of one gloo process each, meeting at a c10d rendezvous, started with the command
# `agentrft train` builds from each node's environment (trainer/rl/launch.py).


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_nodes(config, taught_model: Path, tmp_path: Path, out: Path, *, stop_after: int = 0,
                resume: bool = False, extra_env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Each node: the launch command `agentrft train` makes from its environment, running the
    trainer script (which can stop after a step) in place of `-m flows.cli train`."""
    config_file = tmp_path / "nodes.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    script = tmp_path / "node_process.py"
    script.write_text(TWO_PROCESSES)
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = []
    for rank in range(config.training.nodes):
        env = {**os.environ, "AGENTRFT_NODE_RANK": str(rank), "AGENTRFT_RDZV_ENDPOINT": endpoint,
               "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(extra_env or {})}
        saved = {key: os.environ.get(key) for key in ("AGENTRFT_NODE_RANK", "AGENTRFT_RDZV_ENDPOINT")}
        os.environ.update({key: env[key] for key in saved})
        try:
            command, added = launch_command(config, [])
        finally:
            for key, value in saved.items():
                os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
        launcher = command[: command.index("-m", 3)]  # `python -m accelerate.commands.launch ...`
        log = (tmp_path / f"node_{rank}_{len(list(tmp_path.glob('node_*.log')))}.log").open("w")
        node = subprocess.Popen(
            [*launcher, str(script), str(config_file), str(taught_model), str(out), str(stop_after),
             "1" if resume else "0"], env={**env, **added}, cwd=REPO, start_new_session=True,
            stdout=log, stderr=subprocess.STDOUT)
        node.log = Path(log.name)  # a file, not a pipe: a full pipe would stall a node in a collective
        nodes.append(node)
        if rank == 0:  # on loopback every node could host the store: node 0 does, as the head node would
            _wait_for_port(int(endpoint.rsplit(":", 1)[1]), node)
    _STARTED.extend(nodes)
    return nodes


_STARTED: list[subprocess.Popen] = []


def _wait_for_port(port: int, node: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert node.poll() is None, f"node 0 exited:\n{output(node)[-3000:]}"
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"node 0 did not open the rendezvous port:\n{output(node)[-3000:]}")


def _kill_node(node: subprocess.Popen) -> None:
    """A node's launcher and its processes (torchrun starts each process in a session of its
    own, so the launcher's process group does not hold them)."""
    import psutil

    for process in [*psutil.Process(node.pid).children(recursive=True), psutil.Process(node.pid)]:
        process.kill()
    node.wait()


@pytest.fixture(autouse=True)
def _no_node_left_behind():
    """Nodes a failed test leaves running are killed, launcher and processes: they hold ports."""
    yield
    while _STARTED:
        node = _STARTED.pop()
        if node.poll() is None:
            _kill_node(node)


def output(node: subprocess.Popen) -> str:
    return node.log.read_text(errors="replace")


def wait_all(nodes: list[subprocess.Popen], timeout: float = 400) -> list[str]:
    for node in nodes:
        node.wait(timeout=timeout)
    outputs = [output(node) for node in nodes]
    for rank, (node, text) in enumerate(zip(nodes, outputs, strict=True)):
        assert node.returncode == 0, f"node {rank}:\n{text[-3000:]}"
    return outputs


def test_the_node_rank_and_rendezvous_come_from_the_environment(world, endpoints):
    config = micro_config(world, endpoints, num_processes=2, nodes=2, distributed="ddp")
    assert node_topology(micro_config(world, endpoints), {}) is None  # one machine
    assert node_topology(config, {"SLURM_NODEID": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29400"}) == (
        1, "10.0.0.5", 29400)
    assert node_topology(config, {"AGENTRFT_NODE_RANK": "0", "AGENTRFT_RDZV_ENDPOINT": "head:1234"}) == (0, "head", 1234)
    with pytest.raises(ConfigError, match="AGENTRFT_NODE_RANK, NODE_RANK, SLURM_NODEID"):
        node_topology(config, {"MASTER_ADDR": "head"})
    with pytest.raises(ConfigError, match="a node rank is 0 to 1"):
        node_topology(config, {"NODE_RANK": "2", "MASTER_ADDR": "head"})
    with pytest.raises(ConfigError, match="AGENTRFT_RDZV_ENDPOINT"):
        node_topology(config, {"NODE_RANK": "1"})
    with pytest.raises(ConfigError, match="multiple of training.nodes"):
        micro_config(world, endpoints, num_processes=3, nodes=2, distributed="ddp")
    os.environ.update({"NODE_RANK": "1", "MASTER_ADDR": "head", "MASTER_PORT": "29400"})
    try:
        command, env = launch_command(config, ["--config", "x.yaml"])
    finally:
        for key in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key)
    assert command[command.index("--machine_rank") + 1] == "1" and "--rdzv_backend" in command
    assert command[command.index("--main_process_ip") + 1] == "head" and env["AGENTRFT_NODE_RANK"] == "1"


@pytest.mark.slow
def test_two_nodes_on_loopback_train_as_one_node_of_two_processes_and_resume(two_step_run, world, endpoints,
                                                                             taught_model, tmp_path):
    """Two launchers of one process each (the run the two-process test above checks against the
    one-process run): stopped after step 1, resumed, the same weights as the 2-step run."""
    reference_dir, _, _ = two_step_run
    two_nodes = micro_config(world, endpoints, num_processes=2, nodes=2, distributed="ddp")
    out = tmp_path / "two_nodes"
    wait_all(start_nodes(two_nodes, taught_model, tmp_path, out, stop_after=1))
    assert (out / "checkpoints" / "step_1").is_dir() and not (out / "final").exists()
    outputs = wait_all(start_nodes(two_nodes, taught_model, tmp_path, out, resume=True))
    assert any("resumed from" in output for output in outputs)
    hashes = [(out / f"weights_{rank}.sha256").read_text() for rank in (0, 1)]
    assert hashes[0] == hashes[1]
    assert_same_run(reference_dir, out)


@pytest.mark.slow
def test_a_node_that_dies_mid_step_is_named_and_the_last_checkpoint_stays(world, endpoints, taught_model,
                                                                         tmp_path):
    config = micro_config(world, endpoints, num_processes=2, nodes=2, distributed="ddp", checkpoint_interval=1,
                          n_epochs=6, collective_timeout_s=60)  # steps enough that node 1 dies mid-run
    out = tmp_path / "run"
    nodes = start_nodes(config, taught_model, tmp_path, out)
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / "step_1" / "trainer_state.json").is_file():
        assert time.monotonic() < deadline and all(node.poll() is None for node in nodes), "no step 1"
        time.sleep(0.2)
    time.sleep(1.0)  # into step 2
    _kill_node(nodes[1])  # as a machine going away
    nodes[0].wait(timeout=200)
    text = output(nodes[0])
    assert nodes[0].returncode != 0
    latest = latest_checkpoint(out / "checkpoints")  # step_1 or later: where the kill landed depends on the machine
    assert latest is not None
    assert "node 1" in text and "stopped answering" in text and f"checkpoint is {latest}" in text, text[-3000:]
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["step"] == int(latest.name.removeprefix("step_"))  # written whole: the state file is last
    weights = load_file(str(latest / "accelerate" / "model.safetensors"))
    assert weights and all(torch.isfinite(tensor).all() for tensor in weights.values())
