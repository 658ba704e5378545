"""Run an OpenAI reinforcement fine-tuning job body as this pipeline.

`agentrft run --openai-job job.json` takes what one would POST to OpenAI's
`/v1/fine_tuning/jobs` with `method.type = "reinforcement"` and maps it onto the pipeline
config, so a job written for OpenAI runs here unchanged:

| job field | pipeline config |
| --- | --- |
| `model` | `model.base_model` (here: a local path or hub id; `--model` overrides) |
| `training_file`, `validation_file` | `data.train_file`, `data.validation_file` (local JSONL paths) |
| (ours) `test_file` | `data.test_file`; without it a seeded half of the validation file is the test split |
| `method.reinforcement.grader` | `grader` |
| `method.reinforcement.hyperparameters` | `training` (`n_epochs`, `batch_size`, `learning_rate_multiplier`, `compute_multiplier`, `eval_interval`, `eval_samples`) |
| `method.reinforcement.tools` | `tools.endpoints` (`name`, `server_url`, `headers`) |
| `method.reinforcement.max_episode_steps` | `rollout.max_episode_steps` |
| `seed` | `training.seed` |
| `suffix` | `name` and `promotion.registered_model` |

Files given as OpenAI file ids (`file-...`) cannot be fetched here: the error says to pass
local paths (`agentrft api` takes uploads and their ids, and calls this mapping). Hyperparameters OpenAI has and this trainer does not (`reasoning_effort`)
are reported and ignored. A job's data is usually not under DVC, so the data version is
the md5 of its files, and no expectation suite is applied unless the base config
(`--config`) names one; leakage, gradability and shape checks run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.config.loading import config_from_dict, merge_overrides
from trainer.config.pipeline import PipelineConfig
from trainer.errors import ConfigError

_HYPERPARAMETERS = ("n_epochs", "batch_size", "learning_rate_multiplier", "compute_multiplier", "eval_interval",
                    "eval_samples")
_IGNORED = ("reasoning_effort",)


def _endpoint(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise ConfigError(f"{where}: expected an object with name and server_url")
    body = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    name, url = body.get("name") or tool.get("name"), tool.get("server_url") or body.get("server_url")
    if not name or not url:
        raise ConfigError(f"{where}: a tool needs `name` and `server_url` (got keys {sorted(tool)})")
    return {"name": name, "server_url": url, "headers": tool.get("headers") or body.get("headers") or {}}


def config_from_openai_job(job: Any, *, source: str, base: dict[str, Any] | None = None,
                           model: str | None = None) -> tuple[PipelineConfig, list[str]]:
    """The pipeline config for an OpenAI RFT job body; also returns notes on what was ignored."""
    if not isinstance(job, dict):
        raise ConfigError(f"{source}: an OpenAI fine-tuning job is a JSON object")
    method = job.get("method") or {}
    if method.get("type") != "reinforcement" or not isinstance(method.get("reinforcement"), dict):
        raise ConfigError(f"{source}: method.type must be 'reinforcement' with a method.reinforcement object")
    rft = method["reinforcement"]
    notes: list[str] = []
    files = {}
    for key in ("training_file", "validation_file", "test_file"):
        value = job.get(key)
        if not value:
            if key == "test_file":
                continue
            raise ConfigError(f"{source}: {key} is required (a local JSONL path)")
        if str(value).startswith("file-") or not Path(value).is_file():
            raise ConfigError(f"{source}: {key} {value!r} is not a local file; download it and give its path")
        files[key] = str(value)
    if "grader" not in rft:
        raise ConfigError(f"{source}: method.reinforcement.grader is required")
    hyper = dict(rft.get("hyperparameters") or {})
    for key in _IGNORED:
        if hyper.pop(key, None) is not None:
            notes.append(f"method.reinforcement.hyperparameters.{key} has no equivalent here and is ignored")
    unknown = sorted(set(hyper) - set(_HYPERPARAMETERS))
    if unknown:
        raise ConfigError(f"{source}: method.reinforcement.hyperparameters: unknown keys {unknown}")
    tools = rft.get("tools") or []
    raw: dict[str, Any] = {
        "model": {"base_model": model or job.get("model") or ""},
        "data": {"train_file": files["training_file"], "validation_file": files["validation_file"],
                 "test_file": files.get("test_file"), "dvc_file": None, "production_traffic_file": None,
                 "expectations_suite": None},
        "grader": rft["grader"],
        "training": {**hyper, **({"seed": job["seed"]} if "seed" in job else {})},
        "tools": {"endpoints": [_endpoint(t, f"{source}: method.reinforcement.tools[{i}]") for i, t in enumerate(tools)]},
    }
    if "max_episode_steps" in rft:
        raw["rollout"] = {"max_episode_steps": rft["max_episode_steps"]}
    if job.get("suffix"):
        raw["name"] = str(job["suffix"])
        raw["promotion"] = {"registered_model": str(job["suffix"])}
    if not raw["model"]["base_model"]:
        raise ConfigError(f"{source}: model is required (a local path or hub id here; or pass --model)")
    # Laid over the base section by section, but what the job gives whole replaces the base's
    # whole: its grader (a grader of another type has other fields), and its tools (endpoints
    # with the schemas of its rows, not the base's).
    merged = merge_overrides(base or {}, {key: value for key, value in raw.items() if key not in ("grader", "tools")})
    merged["grader"] = raw["grader"]
    if tools:
        merged["tools"] = {**merged.get("tools", {}), "endpoints": raw["tools"]["endpoints"], "schemas": None}
    return config_from_dict(merged, source=source), notes


def load_openai_job(path: Path, *, base: dict[str, Any] | None = None,
                    model: str | None = None) -> tuple[PipelineConfig, list[str]]:
    try:
        job = json.loads(Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: job file not found") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    return config_from_openai_job(job, source=str(path), base=base, model=model)
