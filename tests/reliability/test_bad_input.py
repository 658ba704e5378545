"""Bad input, fuzzed (issue 6, item 3): every mutation is refused clearly and trains nothing.

Seeded random mutations of the shipped configs, of tool schemas in a config, of grader
JSON (the shipped numeric grader and a multi grader), of grader items, of data rows and
of the production traffic log are fed to the real entry points: the `agentrft` CLI in
process (`config validate`, `train`, `grader validate`, `grader run`, `expectations
derive`, `data verify`) and the validate_data stage's checks
(`tasks.validate.validate_datasets`: the shipped GX suite's Checkpoint, leakage,
gradability, row shapes). A refused input exits non-zero with one `error: ...` line
naming the file and the key or row, never a traceback; `train` stops before it writes
anything; data rows are refused with `file:line` or reported with their line; changed
data is caught by DVC. Mutations that are valid by design are not among them: the
pipeline assumes nothing about a row beyond `messages`, the fields its grader reads and
its `tools`, so dropping or nulling a field nothing reads (the demo's `question`,
`category`, `year`) is not an error.

The number of mutations tried is counted per kind, printed at the end and written to
`bad_input_mutations.json` in pytest's base temp directory.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import typing
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from annotated_types import Ge, Gt, Le, Lt
from pydantic import TypeAdapter, ValidationError

from envs.finqa.demo import DEMO_CONFIG
from flows.cli import main
from tasks.data_version import check_pinned, init
from tasks.validate import validate_datasets
from trainer.config.data import DataConfig
from trainer.config.pipeline import PipelineConfig
from trainer.config.section import Section
from trainer.errors import DataError

SEED = 20261129
TRIED: Counter[str] = Counter()
REPO = Path(__file__).resolve().parents[2]
NUMERIC = json.loads((REPO / "envs/finqa/grader.json").read_text())
# The two keys every config must have; the rest has defaults.
REQUIRED = {"model": {"base_model": "some/model"}, "grader": NUMERIC}
BASES = {"demo": DEMO_CONFIG, "job": REPO / "configs" / "job.yaml"}
MULTI = {
    "type": "multi",
    "name": "finqa_multi",
    "graders": {
        "answer": NUMERIC,
        "cites_number": {
            "type": "string_check",
            "name": "cites_number",
            "operation": "ilike",
            "input": "{{sample.output_text}}",
            "reference": "{{item.reference_answer}}",
        },
        "closeness": {
            "type": "text_similarity",
            "name": "closeness",
            "evaluation_metric": "fuzzy_match",
            "input": "{{sample.output_text}}",
            "reference": "{{item.reference_answer}}",
        },
    },
    "calculate_output": "0.8 * answer + 0.2 * max(cites_number, closeness)",
}
WRONG_TYPES = ([1, 2], {"x": 1}, [[]], {"nested": {"deep": True}})
SCALAR_WRONG = {bool: "maybe", int: "many", float: "fast", str: 12345}
BAD_BYTES = (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80")
YAML_BREAKERS = ("{unclosed: [1, 2\n", "\tname: tabbed\n", "key: value: other\n", "- a\nb: [\n")


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str], fragments: list[str], label: str
) -> str:
    code, _, err = cli(argv, capsys)
    shown = f"{label}: {argv}\n{err[:800]}"
    assert code != 0, shown
    assert "Traceback" not in err, shown
    assert err.startswith("error: "), shown
    assert len(err) < 5000, shown  # a huge value is quoted cut, not whole
    for fragment in fragments:
        assert fragment in err, f"missing {fragment!r} in {shown}"
    return err


# --- configs ---------------------------------------------------------------------------


def _sections() -> dict[str, type[Section]]:
    return {
        name: field.annotation
        for name, field in PipelineConfig.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, Section)
    }


def _leaves() -> list[tuple[str, str, Any]]:
    """(section, key, field info) of every key of every section."""
    return [
        (section, key, info)
        for section, cls in _sections().items()
        for key, info in cls.model_fields.items()
    ]


def _scalar(annotation: Any) -> type | None:
    """int, float, str or bool when the annotation is that (or that | None)."""
    members = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return members[0] if len(members) == 1 and members[0] in SCALAR_WRONG else None


def _wrong_for(annotation: Any, values: tuple) -> list[Any]:
    """The values the field's type refuses ({"x": 1} is a valid `dict[str, float]`)."""
    adapter = TypeAdapter(annotation)
    wrong = []
    for value in values:
        try:
            adapter.validate_python(value)
        except ValidationError:
            wrong.append(value)
    return wrong


def _set(raw: dict, section: str, key: str, value: Any) -> None:
    if not isinstance(raw.get(section), dict):
        raw[section] = {}
    raw[section][key] = value


def config_mutations(rng: random.Random, base: dict) -> Iterator[tuple[str, Any, list[str]]]:
    """(kind, raw config dict or bytes, fragments the error must name), forever."""
    leaves = _leaves()
    bounded = [
        (s, k, i, m) for s, k, i in leaves for m in i.metadata if isinstance(m, Ge | Gt | Le | Lt)
    ]
    floats = [(s, k) for s, k, i in leaves if _scalar(i.annotation) is float]
    literals = [
        (s, k) for s, k, i in leaves if typing.get_origin(i.annotation) is typing.Literal
    ]
    sections = list(_sections())
    while True:
        raw = copy.deepcopy(base)
        kind = rng.choice(
            ["unknown_key", "wrong_type", "out_of_range", "non_finite", "literal", "missing_key",
             "missing_section", "grader", "endpoint", "invalid_utf8", "invalid_yaml", "not_a_mapping",
             "duplicate_key"]
        )  # fmt: skip
        if kind == "unknown_key":
            section = rng.choice([*sections, None])
            if section is None:
                key = rng.choice(sections) + "s"
                raw[key] = {"x": 1}
                yield kind, raw, [key]
                continue
            known = _sections()[section].model_fields
            key = rng.choice(list(known)) + rng.choice(["_", "s", "x", "_mode"])
            if key in known:
                continue
            _set(raw, section, key, rng.choice([1, "x", True]))
            yield kind, raw, [f"{section}.{key}", "unknown key"]
        elif kind == "wrong_type":
            section, key, info = rng.choice(leaves)
            scalar = _scalar(info.annotation)
            wrong = _wrong_for(info.annotation, WRONG_TYPES + ((SCALAR_WRONG[scalar],) if scalar else ()))
            if not wrong:
                continue
            _set(raw, section, key, rng.choice(wrong))
            yield kind, raw, [f"{section}.{key}"]
        elif kind == "out_of_range":
            section, key, info, bound = rng.choice(bounded)
            is_int = _scalar(info.annotation) is int
            huge = 10**30 if is_int else 1e300
            _set(raw, section, key, -huge if isinstance(bound, Ge | Gt) else huge)
            yield kind, raw, [f"{section}.{key}"]
        elif kind == "non_finite":
            section, key = rng.choice(floats)
            _set(raw, section, key, rng.choice([float("inf"), float("-inf"), float("nan")]))
            yield kind, raw, [f"{section}.{key}", "finite"]
        elif kind == "literal":
            section, key = rng.choice(literals)
            word = rng.choice(["fp8", "bfloat", "AUTO", "cosine_warm", "x" * 2_000_000])
            _set(raw, section, key, word)
            yield kind, raw, [f"{section}.{key}"]
        elif kind == "missing_key":
            if rng.random() < 0.5:
                entry = {"name": "search", "server_url": "http://127.0.0.1:9/tools/search"}
                dropped = rng.choice(["name", "server_url"])
                del entry[dropped]
                _set(raw, "tools", "endpoints", [entry])
                yield kind, raw, [f"tools.endpoints.0.{dropped}", "missing"]
            else:
                _set(raw, "prompt_optimization", "variants", [{"system_prompt": "Be brief."}])
                yield kind, raw, ["prompt_optimization.variants.0.name", "missing"]
        elif kind == "missing_section":
            section = rng.choice(["model", "grader"])
            del raw[section]
            yield kind, raw, [f"{section}: required key is missing"]
        elif kind == "grader":
            grader, fragment = rng.choice(
                [
                    ({"type": rng.choice(["numerik", "regex", "llm_judge", ""])}, "grader.type"),
                    ({"name": "no_type", "input": "{{sample.output_text}}"}, "grader.type"),
                    ({**NUMERIC, "rel_tol": -0.5}, "grader.rel_tol"),
                    ({**NUMERIC, "abs_tol": float("inf")}, "grader.abs_tol"),
                    ({**NUMERIC, "reference": "{{reference_answer}}"}, "grader.reference"),
                    ({**MULTI, "calculate_output": "answer +"}, "grader.calculate_output"),
                ]
            )
            raw["grader"] = grader
            yield kind, raw, [fragment]
        elif kind == "endpoint":
            url = f"http://{rng.choice(['10.0.0.9', 'tools.internal', 'evil.example'])}:8765/tools/x"
            case = rng.choice(["scheme", "duplicate", "allowlist", "header"])
            if case == "scheme":
                _set(raw, "tools", "endpoints", [{"name": "x", "server_url": "ftp" + url[4:]}])
                yield kind, raw, ["tools.endpoints.0.server_url", "http(s)"]
            elif case == "duplicate":
                endpoint = {"name": "cat", "server_url": url}
                _set(raw, "tools", "endpoints", [endpoint, dict(endpoint)])
                yield kind, raw, ["tools.endpoints[1]", "two endpoints"]
            elif case == "allowlist":
                _set(raw, "tools", "endpoints", [{"name": "cat", "server_url": url}])
                _set(raw, "tools", "allowed_hosts", ["127.0.0.1"])
                yield kind, raw, ["tools.endpoints[0].server_url", "allowed_hosts"]
            else:
                endpoint = {"name": "cat", "server_url": url, "headers": {"X-Key": 12345}}
                _set(raw, "tools", "endpoints", [endpoint])
                yield kind, raw, ["tools.endpoints.0.headers.X-Key"]
        elif kind == "invalid_utf8":
            text = yaml.safe_dump(raw, sort_keys=False).encode()
            at = rng.randrange(len(text))
            yield kind, text[:at] + rng.choice(BAD_BYTES) + text[at:], ["not valid UTF-8"]
        elif kind == "invalid_yaml":
            lines = yaml.safe_dump(raw, sort_keys=False).splitlines(keepends=True)
            at = rng.randrange(len(lines) + 1)
            text = "".join(lines[:at]) + rng.choice(YAML_BREAKERS) + "".join(lines[at:])
            yield kind, text.encode(), ["invalid YAML"]
        elif kind == "not_a_mapping":
            value = rng.choice([[raw], "envs/finqa/demo.yaml", 42, [1, 2, 3]])
            yield kind, yaml.safe_dump(value).encode(), ["must be a mapping"]
        else:  # duplicate_key: a leaf line written twice in its section
            lines = yaml.safe_dump(raw, sort_keys=False).splitlines(keepends=True)
            candidates = [i for i, line in enumerate(lines) if line.startswith("  ") and
                          line[2] not in " -" and ":" in line and not line.rstrip().endswith(":")]  # fmt: skip
            at = rng.choice(candidates)
            key = lines[at].strip().split(":", 1)[0]
            text = "".join(lines[: at + 1]) + lines[at] + "".join(lines[at + 1 :])
            yield kind, text.encode(), ["appears twice", key]


def _write_config(path: Path, content: Any) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(yaml.safe_dump(content, sort_keys=False, allow_unicode=True))
    return path


@pytest.mark.parametrize("base_name", list(BASES))
def test_fuzzed_configs_are_refused_naming_file_and_key(
    base_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOOLS_TOKEN", "t0ken")  # configs/job.yaml's header secret
    rng = random.Random(f"{SEED}:{base_name}")
    base = yaml.safe_load(BASES[base_name].read_text())
    path = _write_config(tmp_path / "unmutated.yaml", base)
    assert cli(["config", "validate", str(path)], capsys)[0] == 0  # the mutations are what is refused
    mutations = config_mutations(rng, base)
    for index in range(60):
        kind, content, fragments = next(mutations)
        path = _write_config(tmp_path / f"{index:03d}_{kind}.yaml", content)
        assert_refused(["config", "validate", str(path)], capsys, [str(path), *fragments], kind)
        TRIED[f"config:{kind}"] += 1
        if index % 4 == 0:  # `train` refuses it too, before it writes anything
            out = tmp_path / f"out_{index:03d}"
            argv = ["train", "--config", str(path), "--output-dir", str(out)]
            assert_refused(argv, capsys, [str(path), *fragments], f"train {kind}")
            assert not out.exists()
            TRIED[f"train:{kind}"] += 1


def test_empty_config_names_the_required_keys(tmp_path: Path, capsys) -> None:
    """A job must name its model and its grader; with just those, the rest is defaults."""
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert_refused(["config", "validate", str(path)], capsys,
                   [str(path), "model: required key is missing", "grader: required key is missing"], "empty")
    TRIED["config:empty"] += 1
    path.write_text(yaml.safe_dump(REQUIRED))
    code, out, _ = cli(["config", "validate", str(path)], capsys)
    assert code == 0 and json.loads(out)["valid"] is True


# --- tool schemas in a config ---------------------------------------------------------------


def schema_mutations(rng: random.Random, schemas: list[dict]) -> Iterator[tuple[str, Any, str]]:
    """(kind, tools.schemas value, fragment the error must name), forever."""
    while True:
        mutated = copy.deepcopy(schemas)
        i = rng.randrange(len(mutated))
        name = mutated[i]["function"]["name"]
        kind = rng.choice(
            ["no_name", "empty_name", "name_type", "bad_parameters", "parameters_type",
             "duplicate", "not_an_object", "not_a_list", "unknown_tool"]
        )  # fmt: skip
        if kind == "no_name":
            del mutated[i]["function"]["name"]
            yield kind, mutated, f"tools.schemas[{i}]: function.name is missing"
        elif kind == "empty_name":
            mutated[i]["function"]["name"] = ""
            yield kind, mutated, f"tools.schemas[{i}]: function.name is missing"
        elif kind == "name_type":
            mutated[i]["function"]["name"] = rng.choice([7, ["cat"], None])
            yield kind, mutated, f"tools.schemas[{i}]: function.name is missing"
        elif kind == "bad_parameters":
            params = mutated[i]["function"]["parameters"]
            change = rng.choice(
                [("type", "objekt"), ("required", "path"), ("properties", 5), ("minProperties", -1)]
            )
            params[change[0]] = change[1]
            yield kind, mutated, f"tools.schemas[{i}] ({name}): parameters is not a valid JSON schema"
        elif kind == "parameters_type":
            mutated[i]["function"]["parameters"] = rng.choice([["query"], "object", 3])
            yield kind, mutated, f"tools.schemas[{i}] ({name}): parameters must be a JSON schema"
        elif kind == "duplicate":
            mutated.append(copy.deepcopy(mutated[i]))
            yield kind, mutated, f"tools.schemas[{len(mutated) - 1}]: tool {name!r} is declared twice"
        elif kind == "not_an_object":
            mutated[i] = rng.choice(["search", 1, ["cat"]])
            yield kind, mutated, f"tools.schemas.{i}"
        elif kind == "not_a_list":
            yield kind, {"search": mutated[0]}, "tools.schemas"
        else:
            mutated[i]["function"]["name"] = name + "_v2"
            yield kind, mutated, f"tools.schemas[{i}]: tool {name + '_v2'!r} is offered"


def test_fuzzed_tool_schemas_are_refused_at_config_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked when the config loads (`config validate`, every stage), not at the first
    rollout: before this, a bad schema passed `config validate` and stopped training late."""
    from envs.finqa.tool_schemas import TOOL_SCHEMAS

    rng = random.Random(f"{SEED}:schemas")
    endpoints = [
        {"name": s["function"]["name"], "server_url": f"http://127.0.0.1:9/tools/{s['function']['name']}"}
        for s in TOOL_SCHEMAS
    ]
    mutations = schema_mutations(rng, TOOL_SCHEMAS)
    for index in range(30):
        kind, schemas, fragment = next(mutations)
        raw = {**REQUIRED, "tools": {"schemas": schemas, "endpoints": endpoints}}
        path = _write_config(tmp_path / f"{index:03d}_{kind}.yaml", raw)
        assert_refused(["config", "validate", str(path)], capsys, [str(path), fragment], kind)
        TRIED[f"tool_schema:{kind}"] += 1
    # Unmutated, the same config is valid: the mutation is what was refused.
    path = _write_config(tmp_path / "ok.yaml", {**REQUIRED, "tools": {"schemas": TOOL_SCHEMAS, "endpoints": endpoints}})
    assert cli(["config", "validate", str(path)], capsys)[0] == 0


# --- grader JSON ------------------------------------------------------------------------------


def _grader_leaves(grader: dict, path: str = "grader") -> list[tuple[list[str], str]]:
    """(key steps, printed key path) of every value in a grader object."""
    leaves = []
    for key, value in grader.items():
        leaves.append(([key], f"{path}.{key}"))
        if key == "graders":
            for name, sub in value.items():
                leaves += [([key, name, *steps], shown) for steps, shown in
                           _grader_leaves(sub, f"{path}.graders.{name}")]  # fmt: skip
    return leaves


def _put(grader: dict, steps: list[str], value: Any) -> None:
    node = grader
    for step in steps[:-1]:
        node = node[step]
    if value is KeyError:
        del node[steps[-1]]
    else:
        node[steps[-1]] = value


def grader_mutations(rng: random.Random, base: dict) -> Iterator[tuple[str, Any, list[str]]]:
    """(kind, grader object or bytes, fragments), forever."""
    text = json.dumps(base, indent=2).encode()
    leaves = _grader_leaves(base)
    subs = [("", "grader")] + [(name, f"grader.graders.{name}") for name in base.get("graders", {})]
    while True:
        grader = copy.deepcopy(base)
        kind = rng.choice(
            ["unknown_type", "missing_type", "wrong_type", "unknown_key", "non_finite", "negative",
             "bad_template", "bad_formula", "invalid_json", "invalid_utf8", "empty", "not_an_object",
             "huge_source", "nested_multi"]
        )  # fmt: skip
        sub, where = rng.choice(subs)
        node = grader["graders"][sub] if sub else grader
        if kind == "unknown_type":
            node["type"] = rng.choice(["numerik", "regex", "llm_judge", "Multi", "x" * 1_000_000])
            yield kind, grader, [f"{where}.type", "expected one of"]
        elif kind == "missing_type":
            del node["type"]
            yield kind, grader, [f"{where}.type", "it is missing"]
        elif kind == "wrong_type":
            steps, shown = rng.choice(leaves)
            _put(grader, steps, rng.choice(WRONG_TYPES))
            yield kind, grader, [shown]
        elif kind == "unknown_key":
            key = rng.choice(["pass_treshold", "refrence", "operator", "weights"])
            node[key] = 1
            yield kind, grader, [f"{where}.{key}", "unknown field"]
        elif kind in ("non_finite", "negative"):
            numeric, shown = (grader, "grader") if base["type"] == "numeric" else (
                grader["graders"]["answer"], "grader.graders.answer")  # fmt: skip
            key = rng.choice(["rel_tol", "abs_tol", "zero_at_rel_error", "pass_threshold"])
            if kind == "negative":
                key = rng.choice(["rel_tol", "abs_tol", "zero_at_rel_error"])
            numeric[key] = rng.choice([float("inf"), float("nan"), float("-inf")]) if kind == "non_finite" else -rng.random()
            yield kind, grader, [f"{shown}.{key}"]
        elif kind == "bad_template":
            target = node if "input" in node else grader["graders"]["answer"]
            shown = where if "input" in node else "grader.graders.answer"
            target["input"] = rng.choice(
                ["{{answer.output_text}}", "{{sample.output_text", "{{ }}", "{{item}}x{{foo.bar}}"]
            )
            yield kind, grader, [f"{shown}.input"]
        elif kind == "bad_formula":
            grader = copy.deepcopy(MULTI)
            grader["calculate_output"] = rng.choice(
                ["answer +", "answr * 2", "__import__('os')", "answer ** cites_number", "max(", ""]
            )
            yield kind, grader, ["grader.calculate_output"]
        elif kind == "invalid_json":
            cut = rng.randrange(1, len(text) - 2)
            yield kind, text[:cut], ["invalid JSON at line"]
        elif kind == "invalid_utf8":
            at = rng.randrange(len(text))
            yield kind, text[:at] + rng.choice(BAD_BYTES) + text[at:], ["not valid UTF-8"]
        elif kind == "empty":
            yield kind, rng.choice([b"", b"\n", b"   "]), ["invalid JSON at line 1"]
        elif kind == "not_an_object":
            yield kind, json.dumps(rng.choice([[base], "numeric", 1, None])).encode(), ["must be a JSON object"]
        elif kind == "huge_source":
            source = "def grade(sample, item):\n    return 1.0\n" + "#" * 300_000 + "\n"
            yield kind, {"type": "python", "source": source}, ["grader.source", "256 kB"]
        else:
            grader = copy.deepcopy(MULTI)
            grader["graders"]["inner"] = copy.deepcopy(MULTI)
            yield kind, grader, ["grader.graders.inner", "cannot contain another multi"]


@pytest.mark.parametrize("base_name", ["numeric", "multi"])
def test_fuzzed_graders_are_refused_naming_file_and_key(
    base_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = NUMERIC if base_name == "numeric" else MULTI
    item = tmp_path / "item.json"
    item.write_text(json.dumps({"id": "i1", "reference_answer": "37.25%"}))
    rng = random.Random(f"{SEED}:grader:{base_name}")
    mutations = grader_mutations(rng, base)
    for index in range(35):
        kind, content, fragments = next(mutations)
        path = tmp_path / f"{index:03d}_{kind}.json"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(json.dumps(content))
        assert_refused(["grader", "validate", "--grader", str(path)], capsys, [str(path), *fragments], kind)
        TRIED[f"grader:{kind}"] += 1
        if index % 5 == 0:
            argv = ["grader", "run", "--grader", str(path), "--item", str(item), "--sample", "37.3"]
            assert_refused(argv, capsys, [str(path), *fragments], f"run {kind}")
            TRIED[f"grader_run:{kind}"] += 1
    # Unmutated, both graders validate and score: the mutations are what was refused.
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(base))
    code, out, _ = cli(["grader", "run", "--grader", str(path), "--item", str(item), "--sample", "37.25"], capsys)
    assert code == 0 and json.loads(out)["reward"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"", "invalid JSON at line 1"),
        (b'{"id": "i1", "reference_answer": "3', "invalid JSON at line 1"),
        (b'{"id": "i1", "reference_answer": "\xff"}', "not valid UTF-8"),
        (b'[{"id": "i1"}]', "an item must be one JSON object"),
        (b'"37.25%"', "an item must be one JSON object"),
    ],
)
def test_bad_item_files_are_refused(content: bytes, fragment: str, tmp_path: Path, capsys) -> None:
    grader, item = tmp_path / "grader.json", tmp_path / "item.json"
    grader.write_text(json.dumps(NUMERIC))
    item.write_bytes(content)
    argv = ["grader", "run", "--grader", str(grader), "--item", str(item), "--sample", "1"]
    assert_refused(argv, capsys, [str(item), fragment], "item")
    TRIED["grader_item:file"] += 1


@pytest.mark.parametrize(
    ("item", "variable"),
    [
        ({"id": "i1"}, "item.reference_answer"),
        ({"id": "i1", "reference_answer": None}, "reference_parse_error"),
        ({"id": "i1", "reference_answer": "no number here"}, "reference"),
    ],
)
def test_item_the_grader_cannot_use_is_a_grader_error_not_a_score(
    item: dict, variable: str, tmp_path: Path, capsys
) -> None:
    """`grader run` answers like OpenAI's graders/run: the errors, and no reward (not 0)."""
    grader, path = tmp_path / "grader.json", tmp_path / "item.json"
    grader.write_text(json.dumps(NUMERIC))
    path.write_text(json.dumps(item))
    code, out, err = cli(["grader", "run", "--grader", str(grader), "--item", str(path), "--sample", "1"], capsys)
    result = json.loads(out)
    assert result["reward"] is None and "Traceback" not in err
    assert variable in json.dumps(result["errors"])
    TRIED["grader_item:unusable"] += 1


# --- data rows ---------------------------------------------------------------------------------

SPLITS = ("train", "validation", "test")


@pytest.fixture(scope="module")
def base_rows(demo_data_dir: Path) -> dict[str, list[str]]:
    counts = {"train": 30, "validation": 6, "test": 6}
    return {split: (demo_data_dir / f"{split}.jsonl").read_text().splitlines()[:n] for split, n in counts.items()}


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the shipped GX context (the demo's suite and its Checkpoint): running the
    Checkpoint writes results and Data Docs, which stay out of the repository."""
    root = tmp_path_factory.mktemp("gx") / "expectations"
    shutil.copytree(REPO / "expectations", root, ignore=shutil.ignore_patterns("uncommitted"))
    return root


def data_section(paths: dict[str, Path], context: Path | None) -> DataConfig:
    return DataConfig(train_file=str(paths["train"]), validation_file=str(paths["validation"]),
                      test_file=str(paths["test"]), expectations_dir=str(context or "expectations"),
                      expectations_suite="production_traffic" if context else None)


def write_splits(tmp_path: Path, prefix: str, rows: dict[str, list]) -> dict[str, Path]:
    paths = {}
    for split, lines in rows.items():
        paths[split] = tmp_path / f"{prefix}_{split}.jsonl"
        paths[split].write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return paths


def test_fuzzed_unreadable_rows_raise_data_error_with_file_and_line(base_rows, tmp_path: Path) -> None:
    rng = random.Random(f"{SEED}:rows:unreadable")
    for index in range(24):
        lines = [line.encode() for line in base_rows["train"]]
        at = rng.randrange(len(lines))
        kind = rng.choice(["truncated_json", "invalid_utf8", "not_an_object", "empty_file"])
        if kind == "truncated_json":
            lines[at] = lines[at][: rng.randrange(1, len(lines[at]) - 1)]
            fragment = f":{at + 1}: invalid JSON"
        elif kind == "invalid_utf8":
            cut = rng.randrange(len(lines[at]))
            lines[at] = lines[at][:cut] + rng.choice(BAD_BYTES) + lines[at][cut:]
            fragment = f":{at + 1}: invalid UTF-8"
        elif kind == "not_an_object":
            lines[at] = json.dumps(rng.choice([[1, 2], "row", 3.5, None, True])).encode()
            fragment = f":{at + 1}: expected a JSON object"
        else:
            lines = [rng.choice([b"", b"   ", b"\t"])] * rng.randrange(1, 4)
            fragment = ": the train file has no rows"
        paths = write_splits(tmp_path, f"{index:03d}", {k: v for k, v in base_rows.items() if k != "train"})
        paths["train"] = tmp_path / f"{index:03d}_train.jsonl"
        paths["train"].write_bytes(b"\n".join(lines) + b"\n")
        with pytest.raises(DataError) as failure:
            validate_datasets(data_section(paths, None), NUMERIC)
        assert f"{paths['train']}{fragment}" in str(failure.value), (kind, str(failure.value))
        TRIED[f"rows:{kind}"] += 1


def row_mutations(rng: random.Random, base: dict[str, list[dict]]):
    """(kind, rows by split, which split and 1-based line the report must name), forever.

    Only what the pipeline relies on is mutated: `messages`, `tools`, the grader's
    `reference_answer`, ids, and the values and JSON types of the fields production sends.
    """
    kinds = ["missing_key", "wrong_type", "null", "duplicate_id", "unknown_category", "shared_id",
             "shared_question", "unparseable_reference", "bad_messages", "bad_tools", "huge_row"]  # fmt: skip
    order: list[str] = []
    while True:
        if not order:  # every kind once per round, in a seeded order
            order = rng.sample(kinds, len(kinds))
        kind = order.pop()
        rows = copy.deepcopy(base)
        at = rng.randrange(len(rows["train"]))
        row = rows["train"][at]
        split = "train"
        if kind == "missing_key":
            del row[rng.choice(["messages", "reference_answer", "tools"])]
        elif kind == "wrong_type":
            key, value = rng.choice(
                [("id", 123), ("question", ["what?"]), ("question", 12.5), ("category", 5), ("messages", "hi"),
                 ("year", "2019"), ("exe_ans", "12.5"), ("gold_pages", "page_1.txt"), ("reference_answer", 37.2),
                 ("ticker", True), ("tools", {})]
            )  # fmt: skip
            row[key] = value
        elif kind == "null":
            row[rng.choice(["id", "messages", "reference_answer", "tools"])] = None
        elif kind == "duplicate_id":
            other = rng.choice([i for i in range(len(rows["train"])) if i != at])
            row["id"] = rows["train"][other]["id"]
        elif kind == "unknown_category":
            row["category"] = rng.choice(["astrology", "", "RATIO"])
        elif kind == "shared_id":
            split = rng.choice(["validation", "test"])
            at = rng.randrange(len(rows[split]))
            rows[split][at]["id"] = rng.choice(rows["train"])["id"]
        elif kind == "shared_question":
            split = rng.choice(["validation", "test"])
            at = rng.randrange(len(rows[split]))
            asked = rng.choice(rows["train"])["messages"][0]["content"]
            # the same request, differently written: case, punctuation and spaces
            rows[split][at]["messages"] = [{"role": "user", "content": "  " + asked.upper().replace("?", " ?!")}]
        elif kind == "unparseable_reference":
            row["reference_answer"] = rng.choice(["n/a", "", "about a third", "TBD%"])
        elif kind == "bad_messages":
            row["messages"] = rng.choice(
                [[], [{"role": "user"}], ["What was revenue?"], [{"content": "hi"}], [{"role": "user", "content": 5}]]
            )
        elif kind == "bad_tools":
            tools = row["tools"]
            i = rng.randrange(len(tools))
            change = rng.choice(["no_name", "bad_parameters", "duplicate"])
            if change == "no_name":
                del tools[i]["function"]["name"]
            elif change == "bad_parameters":
                tools[i]["function"]["parameters"]["type"] = "objekt"
            else:
                tools.append(copy.deepcopy(tools[i]))
        else:
            row["question"] = row["question"] + " " + "x" * 1_100_000
        yield kind, rows, split, at + 1


def test_fuzzed_rows_are_reported_with_their_line(base_rows, context: Path, tmp_path: Path) -> None:
    """Through the shipped GX suite derived from production traffic, and the leakage,
    gradability and row shape checks: each mutated row is a failure whose samples name
    its line in its file."""
    base = {split: [json.loads(line) for line in lines] for split, lines in base_rows.items()}
    rng = random.Random(f"{SEED}:rows:content")
    mutations = row_mutations(rng, base)
    for index in range(11):  # each of the 11 kinds once (each runs GX on three splits, ~6 s)
        kind, rows, split, line = next(mutations)
        paths = write_splits(tmp_path, f"{index:03d}", rows)
        report, _ = validate_datasets(data_section(paths, context), NUMERIC)
        named = [
            f for f in report.failures
            if any(isinstance(s, dict) and s.get("line") == line for s in f["samples"])
            and str(paths[split]) in f["dataset"]
        ]  # fmt: skip
        assert report.failures and named, (kind, split, line, report.failures)
        TRIED[f"rows:{kind}"] += 1


def test_clean_rows_pass(base_rows, context: Path, tmp_path: Path) -> None:
    """The unmutated sample passes, so every failure above comes from its mutation."""
    report, docs = validate_datasets(data_section(write_splits(tmp_path, "clean", base_rows), context), NUMERIC)
    assert report.failures == []
    assert [d.split for d in report.datasets] == list(SPLITS) and all(d.evaluated > 10 for d in report.datasets)
    assert (docs / "index.html").is_file() and str(docs).startswith(str(context))


# --- production traffic and the data pin ---------------------------------------------------------


def test_fuzzed_traffic_is_refused_by_expectations_derive(
    demo_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = (demo_data_dir / "production_traffic.jsonl").read_bytes().splitlines()[:40]
    rng = random.Random(f"{SEED}:traffic")
    for index in range(16):
        mutated = list(lines)
        at = rng.randrange(len(mutated))
        kind = rng.choice(["truncated_json", "invalid_utf8", "not_an_object", "empty", "no_messages"])
        if kind == "truncated_json":
            mutated[at] = mutated[at][: rng.randrange(1, len(mutated[at]) - 1)]
            fragments = [f":{at + 1}: invalid JSON"]
        elif kind == "invalid_utf8":
            mutated[at] = mutated[at][:5] + rng.choice(BAD_BYTES) + mutated[at][5:]
            fragments = [f":{at + 1}: invalid UTF-8"]
        elif kind == "not_an_object":
            mutated[at] = b"[1, 2, 3]"
            fragments = [f":{at + 1}: expected a JSON object"]
        elif kind == "empty":
            mutated = [rng.choice([b"", b"  "])]
            fragments = ["the traffic log has no rows"]
        else:  # no row carries a `messages` list: not an OpenAI RFT log
            value = rng.choice([None, "What was revenue?", {"role": "user"}])
            mutated = [json.dumps({**json.loads(m), "messages": value}).encode() for m in mutated]
            fragments = ["no row has a `messages` list"]
        traffic, context = tmp_path / f"traffic_{index:03d}.jsonl", tmp_path / f"gx_{index:03d}"
        traffic.write_bytes(b"\n".join(mutated) + b"\n")
        argv = ["expectations", "derive", "--from", str(traffic), "--dir", str(context), "--name", "suite"]
        assert_refused(argv, capsys, [str(traffic), *fragments], kind)
        assert not (context / "expectations" / "suite.json").exists()
        TRIED[f"traffic:{kind}"] += 1


def test_changed_data_is_caught_by_dvc_and_restored_by_data_verify(
    demo_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    init(tmp_path)
    shutil.copy(REPO / "data.dvc", tmp_path / "data.dvc")
    data = tmp_path / "data"
    shutil.copytree(demo_data_dir, data, ignore=shutil.ignore_patterns(".*"))
    pinned = (data / "train.jsonl").read_bytes()
    lines = pinned.decode().splitlines(keepends=True)
    lines[7] = lines[7].replace('"year": ', '"year": 1')  # one changed row
    (data / "train.jsonl").write_text("".join(lines))
    # Every pipeline run checks the pin first: the changed data stops it, naming the fix.
    with pytest.raises(DataError, match=rf"{data}: differs from the version .*data\.dvc pins \(modified: data/\); "
                       "restore it with `dvc checkout"):
        check_pinned(tmp_path / "data.dvc")
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    config["data"].update(dvc_file=str(tmp_path / "data.dvc"), train_file=str(data / "train.jsonl"),
                          validation_file=str(data / "validation.jsonl"), test_file=str(data / "test.jsonl"),
                          production_traffic_file=str(data / "production_traffic.jsonl"))
    path = _write_config(tmp_path / "demo.yaml", config)
    # The demo's own data is regenerated from its seed, saying why, and matches its pin again.
    code, out, err = cli(["data", "verify", "--config", str(path)], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert f"regenerating {data} from seed 0" in out and "modified: data/" in out
    assert (data / "train.jsonl").read_bytes() == pinned
    TRIED["data_verify:changed_row"] += 1


# --- the count ----------------------------------------------------------------------------------


def test_zz_mutation_count(tmp_path_factory: pytest.TempPathFactory, capsys) -> None:
    """Runs last (file order): prints and records how many mutations the tests above tried."""
    total = sum(TRIED.values())
    record = tmp_path_factory.getbasetemp() / "bad_input_mutations.json"
    record.write_text(json.dumps({"total": total, "by_kind": dict(sorted(TRIED.items()))}, indent=2))
    with capsys.disabled():
        print(f"\nbad-input mutations tried: {total} (by kind in {record})")
    if len(TRIED) > 20:  # the whole file ran, not a -k selection
        assert total >= 200
