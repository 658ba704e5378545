"""Every model family through every stage, token-exact.

For each family (Qwen3 with thinking, Qwen2.5, Llama 3, Mistral, gpt-oss) a tiny
random-weight model of its real architecture, with its real vocabulary and published chat
template (tests/model_families.py), is taught one scripted rollout of a FinQA item: a
thought where the family has one, two calls in one turn (gpt-oss, which calls one tool a
turn, makes them in two turns), their results from the real tool server on loopback, and
the answer. Taught, not forced: the rollout is then sampled for real, greedily, by the
embedded engine and by a real vLLM server, and the tests compare what came out:

- the same token ids on both, the generation mask exactly over the sampled tokens (the
  script encoded as a rollout builds it), the calls parsed to OpenAI's format with their
  arguments, reasoning tokens counted, and the trainer's log-probabilities of the sampled
  tokens equal to each sampler's within float32 tolerance;
- a turn cut mid-call is `finish_reason: length`, status `truncated`, its text kept;
- two GRPO steps, the saved model registered in MLflow, loaded back from the registry and
  served by `serve-model`, which answers the official `openai` SDK with the two tool calls.

The vLLM servers (one per family, one process each) start together, in threads. The
gpt-oss fixture unties its embeddings as gpt-oss does: vLLM 0.32.0's GptOssForCausalLM
never ties them, and with a tied fixture it sampled from all-equal logits
(log-probability log(1/201088) for every token).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from envs.finqa.local import local_tool_endpoints
from tests import model_families
from tests.taught_model import GRADER, OUTPUT_CHARS, SYSTEM, TOOLS, copy_items
from trainer.config.loading import config_from_dict
from trainer.config.tools import ToolEndpoint
from trainer.data import read_items
from trainer.generation.engine import TransformersBackend
from trainer.generation.policy import load_policy
from trainer.rollout.evaluate import summarize
from trainer.rollout.loop import run_rollouts_async
from trainer.rollout.record import RolloutRecord, RolloutSettings
from trainer.rollout.tool_client import ToolClient

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
FAMILIES = ["qwen3", "qwen2.5", "llama3", "mistral", "gpt-oss"]
THINKING = {"qwen3", "gpt-oss"}
FP32_TOLERANCE = 1e-4
MAX_TOTAL_TOKENS = 1024

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def world(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("families")
    items = read_items(demo_data_dir / "train.jsonl", 1)
    copy_items(demo_data_dir, items, root, "train.jsonl")
    copy_items(demo_data_dir, items, root, "validation.jsonl")
    return root


@pytest.fixture(scope="module")
def endpoints(world: Path):
    with local_tool_endpoints(world / "corpus", max_output_chars=OUTPUT_CHARS) as served:
        yield served


def _call(call_id: str, name: str, path: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps({"path": path})}}


async def script(family: str, item: dict, endpoints: list[ToolEndpoint], ids: list[str]) -> list[dict]:
    """The scripted rollout, its tool results from the real server."""
    page = item["gold_pages"][0]
    calls = [_call(ids[0], "list", str(Path(page).parent)), _call(ids[1], "cat", page)]
    thought = {"reasoning_content": "List the year, then read the page."} if family in THINKING else {}
    turns = [calls[:1], calls[1:]] if family == "gpt-oss" else [calls]
    messages = [{"role": "system", "content": SYSTEM}, *item["messages"]]
    async with ToolClient(endpoints, TOOLS, max_output_chars=OUTPUT_CHARS) as client:
        for turn in turns:
            messages.append({"role": "assistant", "content": "", "tool_calls": turn, **thought})
            for call in turn:
                result = await client.call(call["function"]["name"], call["function"]["arguments"], item=item,
                                           trace_id="trace_script", call_id=call["id"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result.output})
    final = {"reasoning_content": "The page says it."} if family in THINKING else {}
    messages.append({"role": "assistant", "content": str(item["reference_answer"]), **final})
    return messages


@pytest.fixture(scope="module")
def taught(world: Path, endpoints: list[ToolEndpoint]) -> dict[str, tuple[Path, list[dict]]]:
    """Each family's model taught its scripted rollout: (model directory, script)."""
    from trainer.chat_formats import load_chat_format

    item = read_items(world / "train.jsonl")[0]
    out = {}
    for family in FAMILIES:
        chat = load_chat_format(model_families.tokenizer(model_families.FAMILY_MODELS[family].template))
        messages = asyncio.run(script(family, item, endpoints, [chat.probe_call_id(i) for i in range(2)]))
        out[family] = (model_families.taught_model(family, [(messages, TOOLS)]), messages)
    return out


@pytest.fixture(scope="module")
def vllm_urls(taught: dict, world: Path) -> dict[str, str]:
    """One vLLM server per family, started together."""
    if not VLLM_PYTHON.exists():
        pytest.skip("no vLLM environment: create .venv-vllm with scripts/vllm_env.sh (make vllm)")
    from trainer.generation.vllm_launch import launched_server, server_args

    # One process a server (the engine and its worker inside the API server): half the start-up.
    args, env = server_args(max_model_len=MAX_TOTAL_TOKENS, dtype="float32", extra_args=[
        "--enforce-eager", "--kv-cache-memory-bytes", str(32 << 20), "--max-num-seqs", "4",
        "--distributed-executor-backend=uni"])
    env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    urls: dict[str, str] = {}
    errors: dict[str, BaseException] = {}
    with contextlib.ExitStack() as stack:
        lock = threading.Lock()

        def start(family: str) -> None:
            try:
                server = launched_server(str(VLLM_PYTHON), str(taught[family][0]), args=args, env=env,
                                         log_path=world / f"vllm-{family}.log", startup_timeout_s=600)
                url = server.__enter__().url
                with lock:
                    stack.push(server.__exit__)
                    urls[family] = url
            except BaseException as exc:  # reported by the family's test
                errors[family] = exc

        threads = [threading.Thread(target=start, args=(f,)) for f in FAMILIES]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        yield {**urls, **{f"{family}:error": str(exc) for family, exc in errors.items()}}


def settings(**changed) -> RolloutSettings:
    return RolloutSettings(**{"system_prompt": SYSTEM, "temperature": 0.0, "max_new_tokens_per_turn": 200,
                              "max_total_tokens": MAX_TOTAL_TOKENS, **changed})


def roll(backend, chat, item: dict, endpoints: list[ToolEndpoint], rollout: RolloutSettings) -> RolloutRecord:
    (record,) = roll_group(backend, chat, item, endpoints, rollout, 1)
    return record


def roll_group(backend, chat, item: dict, endpoints: list[ToolEndpoint], rollout: RolloutSettings,
               n: int) -> list[RolloutRecord]:
    async def go() -> list[RolloutRecord]:
        async with ToolClient(endpoints, TOOLS, max_output_chars=OUTPUT_CHARS) as client:
            return await run_rollouts_async(backend, chat, [item], n_per_item=n, tool_client=client, grader=GRADER,
                                            settings=rollout, tools=TOOLS)

    return asyncio.run(go())


def trainer_logprobs(model: torch.nn.Module, record: RolloutRecord) -> list[float]:
    """What the trainer computes: log_softmax of one forward pass, at every sampled token."""
    ids = torch.tensor([record.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return [logprobs[i - 1].item() for i, sampled in enumerate(record.gen_mask) if sampled]


def sampled_logprobs(record: RolloutRecord) -> list[float]:
    return [lp for lp, sampled in zip(record.logprobs, record.gen_mask, strict=True) if sampled]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def check_scripted(record: RolloutRecord, chat, family: str, messages: list[dict], item: dict) -> None:
    ids, mask = chat.encode_conversation(messages, TOOLS)
    assert record.status == "ok", (family, record.status, record.messages[-1])
    assert record.token_ids == ids
    assert record.gen_mask == mask  # exactly the tokens the model sampled
    assert [(c.name, json.loads(c.arguments)) for c in record.tool_calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for m in messages if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    assert record.finish_reasons == ["tool_calls"] * (2 if family == "gpt-oss" else 1) + ["stop"]
    assert record.final_answer == str(item["reference_answer"]) and record.score == 1.0
    if family in THINKING:
        assert record.reasoning_tokens > 0
        assert record.messages[2]["reasoning_content"] == "List the year, then read the page."
    else:
        assert record.reasoning_tokens == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_scripted_rollout_on_the_engine_is_token_exact(family, taught, world, endpoints):
    model_dir, messages = taught[family]
    policy = load_policy(str(model_dir), device="cpu", dtype="float32")
    assert policy.chat.name == family  # auto picked it from the template
    item = read_items(world / "train.jsonl")[0]
    backend = policy.backend(max_slots=2, max_len=MAX_TOTAL_TOKENS, seed=0)
    # A group of 3 on 2 slots: the first sample pre-fills the prompt, the others start from
    # the prefix cache (the third once the first leaves its slot); each is the script.
    group = roll_group(backend, policy.chat, item, endpoints, settings(), 3)
    for record in group:
        check_scripted(record, policy.chat, family, messages, item)
    assert backend.prefix_stats()["hit_tokens"] >= 2 * (group[0].gen_mask.index(1) - 16)
    record = group[0]
    assert max_diff(sampled_logprobs(record), trainer_logprobs(policy.model, record)) < FP32_TOLERANCE
    metrics = summarize([record], prefix="eval").metrics
    assert metrics["eval/reasoning_tokens_mean"] == record.reasoning_tokens
    assert metrics["eval/tokens_mean"] == record.tokens_generated


@pytest.mark.parametrize("family", FAMILIES)
def test_scripted_rollout_on_vllm_is_the_engines(family, taught, world, endpoints, vllm_urls):
    assert family in vllm_urls, vllm_urls.get(f"{family}:error")
    from trainer.generation.vllm_backend import VllmBackend
    from trainer.generation.vllm_launch import SERVED_NAME
    from trainer.generation.vllm_servers import VllmServers

    model_dir, messages = taught[family]
    policy = load_policy(str(model_dir), device="cpu", dtype="float32")
    item = read_items(world / "train.jsonl")[0]
    servers = VllmServers([vllm_urls[family]], max_concurrent=4)
    try:
        backend = VllmBackend(servers, model=SERVED_NAME, stop_token_ids=policy.stop_token_ids,
                              max_len=MAX_TOTAL_TOKENS, seed=0)
        on_vllm = roll(backend, policy.chat, item, endpoints, settings())
    finally:
        servers.close()
    check_scripted(on_vllm, policy.chat, family, messages, item)
    on_engine = roll(policy.backend(max_slots=2, max_len=MAX_TOTAL_TOKENS, seed=0), policy.chat, item, endpoints,
                     settings())
    assert on_vllm.token_ids == on_engine.token_ids and on_vllm.gen_mask == on_engine.gen_mask
    assert max_diff(sampled_logprobs(on_vllm), sampled_logprobs(on_engine)) < FP32_TOLERANCE
    assert max_diff(sampled_logprobs(on_vllm), trainer_logprobs(policy.model, on_vllm)) < FP32_TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_a_turn_cut_mid_call_is_length_and_keeps_its_text(family, taught, world, endpoints):
    model_dir, messages = taught[family]
    policy = load_policy(str(model_dir), device="cpu", dtype="float32")
    chat = policy.chat
    first_turn = chat.encode(chat.assistant_text(messages[:2], messages[2], TOOLS))
    # cut inside the first call's arguments, right after their key
    cut_at = next(n for n in range(1, len(first_turn)) if '"path"' in chat.decode(first_turn[:n]))
    item = read_items(world / "train.jsonl")[0]
    backend = TransformersBackend(policy.model.eval(), stop_token_ids=policy.stop_token_ids, max_slots=2,
                                  max_len=MAX_TOTAL_TOKENS)
    record = roll(backend, chat, item, endpoints, settings(max_new_tokens_per_turn=cut_at))
    assert record.status == "truncated" and record.finish_reasons == ["length"]
    assert record.tool_calls == [] and record.tokens_generated == cut_at
    assert record.messages[-1]["content"] == chat.decode(first_turn[:cut_at])  # kept, not lost


@pytest.mark.parametrize("family", FAMILIES)
def test_two_grpo_steps_then_the_registry_then_serve_model(family, taught, world, endpoints, tmp_path):
    import openai

    from envs.tool_server import serve_in_thread
    from tasks.promote import register_candidate
    from tasks.tracking import RunContext, log_transformers_model
    from trainer.generation.policy import load_registered_policy
    from trainer.rl.grpo import train
    from trainer.serving.model_server import create_model_app

    model_dir, messages = taught[family]
    tracking_uri = f"sqlite:///{world / 'mlflow.db'}"
    config = config_from_dict({
        "name": f"family-{family}",
        "model": {"base_model": str(model_dir), "dtype": "float32", "device": "cpu"},
        "data": {"train_file": str(world / "train.jsonl"), "validation_file": str(world / "validation.jsonl"),
                 "test_file": None},
        "tools": {"endpoints": [e.model_dump() for e in endpoints], "schemas": TOOLS,
                  "max_output_chars": OUTPUT_CHARS},
        "grader": GRADER,
        "rollout": {"system_prompt": SYSTEM, "max_turns": 4, "max_new_tokens_per_turn": 200,
                    "max_total_tokens": MAX_TOTAL_TOKENS, "max_concurrent_rollouts": 4},
        "training": {"batch_size": 1, "compute_multiplier": 0.25, "learning_rate": 1e-4, "n_epochs": 2, "max_steps": 2,
                     "eval_interval": 100, "eval_samples": 1, "checkpoint_interval": 100, "seed": 3},
        "mlflow": {"tracking_uri": tracking_uri},
    })
    result = train(config, model_path=str(model_dir), output_dir=tmp_path / "run", endpoints=endpoints)
    assert result.steps == 2 and result.model_dir is not None

    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    experiment = mlflow.set_experiment(f"families-{family}")
    run = mlflow.MlflowClient(tracking_uri).create_run(experiment.experiment_id)
    ctx = RunContext(tracking_uri=tracking_uri, experiment_id=experiment.experiment_id, parent_run_id=run.info.run_id,
                     data_md5="", config_hash="", git_commit="", flow_run_id="", flow_run_url="", mlflow_ui_url="")
    model_uri, _ = log_transformers_model(ctx, run.info.run_id, Path(result.model_dir), "model")
    version, _, _ = register_candidate(tracking_uri, f"family-{family}", model_uri, run.info.run_id, {}, passed=True,
                                       reasons=[])
    policy = load_registered_policy(f"models:/family-{family}/{version}", tracking_uri=tracking_uri, device="cpu")
    assert policy.chat.name == family
    app = create_model_app(policy, model_name=f"family-{family}", max_len=MAX_TOTAL_TOKENS)
    with serve_in_thread(app) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        response = client.chat.completions.create(model=f"family-{family}", messages=messages[:2], tools=TOOLS,
                                                  temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    expected = messages[2]["tool_calls"]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in expected]
    if family in THINKING:
        assert choice.message.model_extra["reasoning_content"] == "List the year, then read the page."
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
