"""Config loading: defaults, overrides, and errors that name the file and key path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks.tracking import flat_params
from trainer.config.loading import (
    config_from_dict,
    load_config,
    merge_overrides,
    missing_env_vars,
    parse_overrides,
)
from trainer.config.pipeline import PipelineConfig
from trainer.config.training import resolved_hyperparameters
from trainer.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SHIPPED = [REPO / "envs" / "finqa" / "demo.yaml", *sorted((REPO / "configs").glob("*.yaml"))]
# The two keys every job must name; the rest has defaults.
MINIMAL = {"model": {"base_model": "Qwen/Qwen3-0.6B"},
           "grader": {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
                      "reference": "{{item.answer}}", "operation": "eq"}}


def minimal(**sections: dict) -> PipelineConfig:
    return config_from_dict(merge_overrides(MINIMAL, sections))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_configs_load(path: Path) -> None:
    config = load_config(path)
    assert isinstance(config, PipelineConfig)


def test_model_and_grader_are_required(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: job\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value)
    assert "model: required key is missing" in str(err.value)
    assert "grader: required key is missing" in str(err.value)


def test_registered_model_defaults_to_the_job_name() -> None:
    assert minimal(name="support-agent").registered_model == "support-agent"
    assert minimal(name="support-agent", promotion={"registered_model": "prod"}).registered_model == "prod"


def test_defaults_and_auto_resolution() -> None:
    config = minimal()
    hp = resolved_hyperparameters(config.training)
    assert hp["n_epochs"] == 1
    assert hp["batch_size"] == 8
    assert hp["learning_rate"] == pytest.approx(1e-5)
    assert hp["group_size"] == 8
    config = minimal(training={"learning_rate_multiplier": 3, "compute_multiplier": 0.5})
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
    with pytest.raises(ConfigError, match="model: required key is missing"):
        load_config(path)


def test_a_file_with_the_required_keys_gets_defaults(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    config = load_config(path)
    assert config.training.seed == 42 and config.training.loss_type == "dapo"
    assert config.training.scale_rewards == "group" and config.data.test_file == "data/test.jsonl"
    assert config.promotion.group_by is None and config.data.dvc_file is None


def test_invalid_grader_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({**MINIMAL, "grader": {"type": "no_such_grader"}}, source="job.yaml")
    assert "job.yaml" in str(err.value)
    assert "grader" in str(err.value)


def test_header_secrets_stay_templates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FINQA_TOKEN", "s3cr3t-value")
    config = minimal(
        tools={
            "endpoints": [
                {
                    "name": "search",
                    "server_url": "http://127.0.0.1:1/tools/search",
                    "headers": {"Authorization": "Bearer ${FINQA_TOKEN}"},
                }
            ]
        }
    )
    assert missing_env_vars(config) == []
    flat = flat_params(dict(config))  # what the pipeline logs as MLflow params
    assert flat["tools.endpoints"].count("Bearer ${FINQA_TOKEN}") == 1
    assert all("s3cr3t-value" not in value for value in flat.values())
    assert "s3cr3t-value" not in config.model_dump_json()
    monkeypatch.delenv("FINQA_TOKEN")
    assert missing_env_vars(config) == ["FINQA_TOKEN (tools.endpoints[0].headers.Authorization)"]


def test_section_hash_tracks_only_named_sections() -> None:
    a = minimal()
    b = minimal(training={"seed": 7})
    assert a.section_hash("data", "baseline") == b.section_hash("data", "baseline")
    assert a.section_hash("training") != b.section_hash("training")


def test_openai_hyperparameters_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="training.batch_size"):
        minimal(training={"batch_size": 0})
    assert minimal(training={"batch_size": 4}).training.batch_size == 4


def test_set_overrides_are_typed_like_yaml(tmp_path: Path) -> None:
    overrides = parse_overrides(["training.max_steps=2", "training.lora.r=8", "rollout.system_prompt=Be brief.",
                                 "data.test_file=null", "promotion.check_hack_patterns=false"])
    assert overrides == {"training": {"max_steps": 2, "lora": {"r": 8}}, "rollout": {"system_prompt": "Be brief."},
                         "data": {"test_file": None}, "promotion": {"check_hack_patterns": False}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "training": {"batch_size": 4, "max_steps": 10}}))
    config = load_config(path, overrides)
    assert config.training.max_steps == 2 and config.training.batch_size == 4  # merged, not replaced
    assert config.training.lora.r == 8 and config.data.test_file is None and config.promotion.check_hack_patterns is False
    with pytest.raises(ConfigError, match=r"training\.max_step: unknown key"):
        load_config(path, parse_overrides(["training.max_step=2"]))


@pytest.mark.parametrize("assignment", ["training.max_steps", "=2", "training..seed=1", "a.b=[1, 2"])
def test_malformed_set_overrides_are_config_errors(assignment: str) -> None:
    with pytest.raises(ConfigError, match="--set"):
        parse_overrides([assignment])


def test_scale_rewards_takes_trl_booleans() -> None:
    assert minimal(training={"scale_rewards": True}).training.scale_rewards == "group"
    assert minimal(training={"scale_rewards": False}).training.scale_rewards == "none"
    with pytest.raises(ConfigError, match="training.scale_rewards"):
        minimal(training={"scale_rewards": "item"})


def test_kl_coef_by_group_needs_a_group_field_and_falls_back_to_kl_coef() -> None:
    with pytest.raises(ConfigError, match="training.group_by is not set"):
        minimal(training={"kl_coef_by_group": {"ratio": 0.1}})
    with pytest.raises(ConfigError, match="kl_coef_by_group"):
        minimal(training={"group_by": "category", "kl_coef_by_group": {"ratio": -0.1}})
    training = minimal(training={"kl_coef": 0.01, "group_by": "category",
                                 "kl_coef_by_group": {"ratio": 0.2}}).training
    assert training.kl_coef_of({"id": "a", "category": "ratio"}) == 0.2
    assert training.kl_coef_of({"id": "b", "category": "change"}) == 0.01
    assert training.kl_coef_of({"id": "c"}) == 0.01  # no group: kl_coef
    assert training.uses_reference
    assert minimal(training={"group_by": "category", "kl_coef_by_group": {"ratio": 0.2}}).training.uses_reference
    assert not minimal(training={}).training.uses_reference


def test_groups_must_occur_in_the_training_items() -> None:
    from trainer.rl.batches import check_groups

    items = [{"id": "a", "category": "ratio"}, {"id": "b", "category": "change"}]
    for key, value in (("kl_coef_by_group", 0.1), ("group_weights", 2.0)):
        training = minimal(training={"group_by": "category", key: {"ratios": value}}).training
        with pytest.raises(ConfigError, match=rf"training.{key}: group\(s\) \['ratios'\] do not occur in "
                           r"data/train.jsonl .*\['change', 'ratio'\]"):
            check_groups(training, items, "data/train.jsonl")
        training = minimal(training={"group_by": "kind", key: {"ratio": value}}).training
        with pytest.raises(ConfigError, match=rf"data/train.jsonl: no training item has the field 'kind'.*{key}"):
            check_groups(training, items, "data/train.jsonl")
        check_groups(minimal(training={"group_by": "category", key: {"ratio": value}}).training,
                     items, "data/train.jsonl")


def test_group_weights_need_group_by_and_positive_weights() -> None:
    with pytest.raises(ConfigError, match="training.group_weights names groups but training.group_by is not set"):
        minimal(training={"group_weights": {"ratio": 2.0}})
    with pytest.raises(ConfigError, match="group_weights"):
        minimal(training={"group_by": "category", "group_weights": {"ratio": 0}})
    training = minimal(training={"group_by": "category", "group_weights": {"ratio": 3.0}}).training
    assert training.weight_of({"category": "ratio"}) == 3.0
    assert training.weight_of({"category": "change"}) == 1.0
    assert training.weight_of({"id": "x"}) == 1.0


def test_weighted_order_puts_heavier_items_first_and_keeps_every_item_once_an_epoch() -> None:
    from trainer.rl.batches import DataOrder

    n = 1000
    weights = [3.0 if i % 4 == 0 else 1.0 for i in range(n)]  # a quarter of the items, three times as heavy
    data = DataOrder(n, 10, seed=7, weights=weights)
    for epoch in (0, 1):
        order = data.order(epoch)
        assert sorted(order) == list(range(n))  # a permutation: every item once
        heavy_first = sum(i % 4 == 0 for i in order[:200]) / 200
        assert heavy_first > 0.4  # 0.25 unweighted; about 3/6 = 0.5 expected at the start of the order
    assert data.order(0) != data.order(1)
    assert DataOrder(n, 10, seed=7, weights=weights).order(0) == data.order(0)  # seeded
    plain = DataOrder(n, 10, seed=7)
    assert sum(i % 4 == 0 for i in plain.order(0)[:200]) / 200 < 0.35
    with pytest.raises(ValueError, match="3 weights for 1000 items"):
        DataOrder(n, 10, seed=7, weights=[1.0, 1.0, 1.0])
