"""Config loading: defaults, overrides, and errors that name the file and key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import (
    PipelineConfig,
    config_from_dict,
    load_config,
    missing_env_vars,
    resolved_hyperparameters,
)
from trainer.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["demo.yaml", "test.yaml", "gpu.yaml"])
def test_shipped_configs_load(name: str) -> None:
    config = load_config(CONFIGS / name)
    assert isinstance(config, PipelineConfig)


def test_defaults_and_auto_resolution() -> None:
    config = config_from_dict({})
    hp = resolved_hyperparameters(config.training)
    assert hp["n_epochs"] == 1
    assert hp["batch_size"] == 8
    assert hp["learning_rate"] == pytest.approx(1e-5)
    assert hp["group_size"] == 8
    config = config_from_dict({"training": {"learning_rate_multiplier": 3, "compute_multiplier": 0.5}})
    hp = resolved_hyperparameters(config.training)
    assert hp["learning_rate"] == pytest.approx(3e-5)
    assert hp["group_size"] == 4


def test_unknown_key_names_file_and_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("training:\n  n_epoch: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message
    assert "training.n_epoch" in message
    assert "unknown key" in message


def test_wrong_type_names_key_and_value(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  max_episode_steps: many\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "rollout.max_episode_steps" in str(err.value)
    assert "'many'" in str(err.value)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "not found"),
        (b"\xff\xfe bad", "UTF-8"),
        (b"training: [1, 2\n", "invalid YAML at line"),
        (b"- a\n- b\n", "mapping"),
    ],
)
def test_file_level_errors(tmp_path: Path, content: bytes | None, expected: str) -> None:
    path = tmp_path / "c.yaml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=expected):
        load_config(path)


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path).training.seed == 42


def test_invalid_grader_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"grader": {"type": "no_such_grader"}}, source="job.yaml")
    assert "job.yaml" in str(err.value)
    assert "grader" in str(err.value)


def test_header_secrets_stay_templates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FINQA_TOKEN", "s3cr3t-value")
    config = config_from_dict(
        {
            "tools": {
                "endpoints": [
                    {
                        "name": "search",
                        "server_url": "http://127.0.0.1:1/tools/search",
                        "headers": {"Authorization": "Bearer ${FINQA_TOKEN}"},
                    }
                ]
            }
        }
    )
    assert missing_env_vars(config) == []
    flat = config.flat_params()
    assert all("s3cr3t-value" not in value for value in flat.values())
    assert "s3cr3t-value" not in config.model_dump_json()
    monkeypatch.delenv("FINQA_TOKEN")
    assert missing_env_vars(config) == ["FINQA_TOKEN (tools.endpoints[0].headers.Authorization)"]


def test_section_hash_tracks_only_named_sections() -> None:
    a = config_from_dict({})
    b = config_from_dict({"training": {"seed": 7}})
    assert a.section_hash("data", "baseline") == b.section_hash("data", "baseline")
    assert a.section_hash("training") != b.section_hash("training")


def test_openai_hyperparameters_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="training.batch_size"):
        config_from_dict({"training": {"batch_size": 0}})
    assert config_from_dict({"training": {"batch_size": 4}}).training.batch_size == 4
