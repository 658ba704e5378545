"""Typed pipeline configuration.

One YAML file describes a whole Agent RFT job: the base model, the DVC-pinned data, the
tool endpoints, the grader, the rollout limits, the baseline gates, the prompt variants,
the training hyperparameters (named as in OpenAI's fine-tuning API, the loss options as in
TRL's GRPOConfig), the promotion gates and where MLflow lives. The model here is also the
Prefect flow's parameter, so every field carries a description: it becomes the UI form and
the CLI help. Nothing here knows an environment: the demo's tools, data and model are what
its own config file declares, like anyone's.

Unknown keys, keys written twice, wrong types, NaN or infinite numbers, missing files and
tool sections that contradict themselves (two endpoints for one tool, a host outside
`allowed_hosts`, a schema that does not compile) are `ConfigError`s that name the file, the
key path and what was expected, when the file loads: before any model or server starts.
Header values keep their `${VAR}` templates: secrets are resolved only when a tool client
is built and never appear in the config text, its hash, MLflow params or logs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from trainer.config.pipeline import PipelineConfig
from trainer.errors import ConfigError
from trainer.wire import ENV_REF

# Steps pydantic adds to an error's location for each member of a union (`int | "auto"`
# fails as `constrained-int` and as `literal['auto']`): not keys the user wrote.
_UNION_STEP = re.compile(
    r"^(?:constrained-\w+|literal\[.*\]|function-[\w-]+\[.*\]|int|float|str|bool|none"
    r"|(?:list|dict|tuple)\[.*\])$"
)


def _describe_errors(errors: list[Any]) -> list[str]:
    """One line per bad key path; the complaints of a union's members are joined by "or"."""
    problems: dict[str, tuple[list[str], str]] = {}
    for error in errors:
        steps = [p for p in error["loc"] if not (isinstance(p, str) and _UNION_STEP.match(p))]
        path = ".".join(str(step) for step in steps) or "(top level)"
        kind = error["type"]
        shown = ""
        if kind == "extra_forbidden":
            text = "unknown key; check the spelling against the documented keys"
        elif kind == "missing":
            text = "required key is missing"
        else:
            text = error["msg"]
            shown = repr(error.get("input"))
            shown = f" (got {shown[:77] + '...' if len(shown) > 80 else shown})"
        texts, _ = problems.setdefault(path, ([], shown))
        if text not in texts:
            texts.append(text)
    return [f"{path}: {' or '.join(texts)}{shown}" for path, (texts, shown) in problems.items()]


def config_from_dict(raw: Any, *, source: str = "<config>") -> PipelineConfig:
    """Validate a parsed config mapping; errors name `source` and every bad key path."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the config must be a mapping of sections, got {type(raw).__name__}")
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        lines = _describe_errors(exc.errors())
        raise ConfigError(f"{source}: invalid config:\n  " + "\n  ".join(lines)) from None
    except ConfigError as exc:  # the grader validator raises our own type
        raise ConfigError(f"{source}: {exc}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping: PyYAML would keep the
    last one silently, so a repeated section or key would drop the first one's settings."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue  # `<<: *anchor` merges may repeat; complex keys are PyYAML's to judge
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key_node.value!r} appears twice in one mapping; keep one",
                    key_node.start_mark,
                )
            seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Load a YAML pipeline config; `overrides` are merged section by section on top."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found; pass a YAML file such as envs/finqa/demo.yaml or configs/job.yaml")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid UTF-8 (byte {exc.start}); save the file as UTF-8") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if overrides:
        raw = merge_overrides(raw or {}, overrides)
    return config_from_dict(raw, source=str(path))


def merge_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `overrides` into `raw` (dicts merge, everything else replaces)."""
    merged = dict(raw)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_overrides(assignments: list[str] | None) -> dict[str, Any]:
    """`section.key=value` assignments (torchtune-style `--set`) as a nested mapping; each
    value is read as YAML (`2`, `true`, `[a, b]`, `null`), so types follow the config's."""
    overrides: dict[str, Any] = {}
    for assignment in assignments or []:
        path, sep, text = assignment.partition("=")
        keys = path.strip().split(".")
        if not sep or not all(keys):
            raise ConfigError(f"--set {assignment!r}: expected section.key=value, e.g. training.max_steps=2")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {assignment!r}: the value is not valid YAML ({exc})") from None
        node = overrides
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {assignment!r}: {key} was already set to a value")
        node[keys[-1]] = value
    return overrides


def missing_env_vars(config: PipelineConfig) -> list[str]:
    """Names of `${VAR}` references in tool headers that the environment lacks."""
    missing = []
    for index, endpoint in enumerate(config.tools.endpoints):
        for header, value in endpoint.headers.items():
            for name in ENV_REF.findall(value):
                if name not in os.environ:
                    missing.append(f"{name} (tools.endpoints[{index}].headers.{header})")
    return missing
