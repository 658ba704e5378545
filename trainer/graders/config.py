"""Grader objects as typed models, and `validate_grader` (OpenAI's `graders/validate`).

A grader is a JSON object chosen by its `type`: OpenAI's `string_check`,
`text_similarity`, `score_model`, `label_model`, `python` and `multi`, the `endpoint`
grader of Agent RFT, and our `numeric` and `f1`. Field names are OpenAI's, so a grader
written for OpenAI's fine-tuning API validates here unchanged. The models form a
discriminated union on `type`; unknown keys are errors (a misspelt `pass_treshold` would
otherwise be silently ignored).

Beyond the field types, `validate_grader` checks what OpenAI's validator checks: template
variables use the `item` / `sample` namespaces, a python grader's source compiles and
defines `grade(sample, item)`, a multi grader's formula parses and names only its
graders, multi graders do not nest, and `passing_labels` are among the `labels`. Every
message names the key path, e.g.
`grader.graders.accuracy.operation: expected one of eq, ne, like, ilike, got 'equals'`.
"""

from __future__ import annotations

import ast
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from trainer.errors import ConfigError
from trainer.graders.expression import parse_formula
from trainer.graders.result import GraderError
from trainer.graders.templates import check_template
from trainer.outbound import check_entries

GRADER_TYPES = (
    "string_check",
    "text_similarity",
    "score_model",
    "label_model",
    "python",
    "multi",
    "endpoint",
    "numeric",
    "f1",
)
TEXT_SIMILARITY_METRICS = (
    "fuzzy_match", "bleu", "gleu", "meteor", "cosine",
    "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l",
)  # fmt: skip
# OpenAI's limit on a python grader's source.
MAX_PYTHON_SOURCE_BYTES = 256 * 1024


class GraderConfigError(ConfigError):
    """A grader object is invalid; the message names the key path and what to write."""


class _Grader(BaseModel):
    # NaN and infinity are refused: `abs_tol: Infinity` would give full credit to any answer,
    # and a NaN threshold passes every comparison.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str | None = Field(None, description="Name shown in results (optional).")


class StringCheckGrader(_Grader):
    type: Literal["string_check"]
    operation: Literal["eq", "ne", "like", "ilike"] = Field(
        description="eq / ne: case-sensitive (in)equality; like: input contains reference "
        "(case-sensitive); ilike: contains, ignoring case. Scores 1.0 or 0.0."
    )
    input: str = Field(description="The text graded (a template).")
    reference: str = Field(description="The text compared against (a template).")


class TextSimilarityGrader(_Grader):
    type: Literal["text_similarity"]
    input: str = Field(description="The text graded (a template).")
    reference: str = Field(description="The text compared against (a template).")
    evaluation_metric: Literal[
        "fuzzy_match", "bleu", "gleu", "meteor", "cosine",
        "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l",
    ] = Field(description="The similarity measure; the reward is its value in [0, 1].")  # fmt: skip
    pass_threshold: float | None = Field(
        None, description="A score at or above it passes; the reward is the score itself."
    )


class ModelMessage(BaseModel):
    """One chat message of a model grader's prompt (OpenAI's EvalItem)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | dict[str, Any] | list[dict[str, Any]] = Field(
        description="Text (a template), or input_text / output_text / input_image parts."
    )
    type: Literal["message"] | None = None


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    seed: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    max_completions_tokens: int | None = Field(None, description="OpenAI's (sic) name.")
    max_completion_tokens: int | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class _ModelGrader(_Grader):
    model: str = Field(description="The judge model's name at the chat completions endpoint.")
    input: list[ModelMessage] = Field(min_length=1, description="The judge's prompt messages.")
    sampling_params: SamplingParams | None = None
    base_url: str | None = Field(
        None,
        description="(ours) OpenAI-compatible API base, e.g. http://127.0.0.1:8000/v1; "
        "default: $OPENAI_BASE_URL, else https://api.openai.com/v1.",
    )
    api_key_env: str = Field(
        "OPENAI_API_KEY", description="(ours) Environment variable holding the judge's API key."
    )
    allowed_hosts: list[str] | None = Field(
        None, description="(ours) Hosts this grader may call (host, host:port or CIDR entries, as api.allowed_hosts), "
        "checked again on the resolved address at connect time; None: any. `agentrft api` writes its own list here "
        "into the graders of the jobs it accepts, so the limit travels with the job to any work pool.")

    @field_validator("allowed_hosts")
    @classmethod
    def _entries(cls, entries: list[str] | None) -> list[str] | None:
        return check_entries(entries, "allowed_hosts")


class ScoreModelGrader(_ModelGrader):
    type: Literal["score_model"]
    range: tuple[float, float] = Field((0.0, 1.0), description="Scores are clipped to it.")
    pass_threshold: float | None = None


class LabelModelGrader(_ModelGrader):
    type: Literal["label_model"]
    labels: list[str] = Field(min_length=1, description="The labels the judge may answer.")
    passing_labels: list[str] = Field(min_length=1, description="Labels that score 1.0.")


class PythonGrader(_Grader):
    type: Literal["python"]
    source: str = Field(description="Python source defining grade(sample, item) -> float.")
    image_tag: str | None = Field(None, description="OpenAI's runtime image; accepted, unused.")
    pass_threshold: float | None = None
    fence: Literal["required", "best_effort"] | None = Field(
        None, description="(ours) required: the grader runs only inside its fence (Landlock on the file system, a "
        "seccomp filter on processes and sockets) and is an error where the machine cannot put it in place; "
        "best_effort or unset: it runs behind the fences that hold, and the run says once which did not. "
        "`agentrft api` sets required on the graders of the jobs it accepts.")


class EndpointGrader(_Grader):
    type: Literal["endpoint"]
    url: str = Field(description='POSTed {"sample", "item", "trace_id"}; answers {"score"}.')
    headers: dict[str, str] = Field(
        default_factory=dict, description="HTTP headers; values may name ${ENV_VARS}."
    )
    pass_threshold: float | None = None
    allowed_hosts: list[str] | None = Field(
        None, description="(ours) Hosts this grader may call (host, host:port or CIDR entries, as api.allowed_hosts), "
        "checked again on the resolved address at connect time; None: any. `agentrft api` writes its own list here "
        "into the graders of the jobs it accepts, so the limit travels with the job to any work pool.")

    @field_validator("allowed_hosts")
    @classmethod
    def _entries(cls, entries: list[str] | None) -> list[str] | None:
        return check_entries(entries, "allowed_hosts")


class NumericGrader(_Grader):
    type: Literal["numeric"]
    input: str = Field("{{sample.output_text}}", description="The answer text (a template).")
    reference: str = Field("{{item.reference_answer}}", description="The reference (a template).")
    rel_tol: float = Field(0.01, ge=0, description="Relative error that still earns full credit.")
    abs_tol: float = Field(0.0, ge=0, description="Absolute error that still earns full credit.")
    partial_credit: bool = Field(
        True, description="Linear falloff from full credit at rel_tol to 0 at zero_at_rel_error."
    )
    zero_at_rel_error: float = Field(0.1, gt=0, description="Relative error that earns 0.")
    pass_threshold: float | None = None


class F1Grader(_Grader):
    type: Literal["f1"]
    input: str = Field(description="The chosen items: a JSON list or comma/newline separated.")
    reference: str = Field(description="The gold items, in the same forms.")
    case_sensitive: bool = Field(False, description="Compare items with their case.")
    pass_threshold: float | None = None


class MultiGrader(_Grader):
    type: Literal["multi"]
    graders: dict[str, SubGrader] = Field(min_length=1, description="Sub-graders by name.")
    calculate_output: str = Field(description="Formula over the sub-graders' names.")
    pass_threshold: float | None = None


SubGrader = Annotated[
    StringCheckGrader
    | TextSimilarityGrader
    | ScoreModelGrader
    | LabelModelGrader
    | PythonGrader
    | EndpointGrader
    | NumericGrader
    | F1Grader
    | MultiGrader,
    Field(discriminator="type"),
]
GraderConfig = SubGrader
MultiGrader.model_rebuild()
_ADAPTER: TypeAdapter[Any] = TypeAdapter(GraderConfig)


def validate_grader(config: dict[str, Any], *, where: str = "grader") -> None:
    """Raise GraderConfigError when `config` is not a valid grader object."""
    parse_grader(config, where=where)


def parse_grader(config: Any, *, where: str = "grader") -> Any:
    """The typed model of a grader object (one of the classes above), validated."""
    if not isinstance(config, dict):
        raise GraderConfigError(
            f"{where}: a grader must be a JSON object, got {type(config).__name__}"
        )
    try:
        model = _ADAPTER.validate_python(config)
    except ValidationError as exc:
        lines = [_describe(error, where) for error in exc.errors()]
        raise GraderConfigError("\n".join(dict.fromkeys(lines))) from None
    _check(model, where, nested=False)
    return model


def _check(model: Any, where: str, *, nested: bool) -> None:
    """The checks a field type cannot express, each naming its key path."""
    for field in ("input", "reference"):
        value = getattr(model, field, None)
        if isinstance(value, str):
            _check_template(value, f"{where}.{field}")
    match model:
        case ScoreModelGrader(range=(low, high)) if low >= high:
            raise GraderConfigError(
                f"{where}.range: the low end must be below the high end, got [{low}, {high}]"
            )
        case ScoreModelGrader() | LabelModelGrader():
            for index, message in enumerate(model.input):
                for text in _message_texts(message.content):
                    _check_template(text, f"{where}.input[{index}].content")
            if isinstance(model, LabelModelGrader):
                unknown = [label for label in model.passing_labels if label not in model.labels]
                if unknown:
                    raise GraderConfigError(
                        f"{where}.passing_labels: {unknown} are not among labels {model.labels}"
                    )
        case PythonGrader():
            _check_python_source(model.source, f"{where}.source")
        case NumericGrader(rel_tol=rel_tol, zero_at_rel_error=zero_at) if zero_at <= rel_tol:
            raise GraderConfigError(
                f"{where}.zero_at_rel_error: must be above rel_tol ({rel_tol}), got {zero_at}"
            )
        case MultiGrader():
            if nested:
                raise GraderConfigError(
                    f"{where}: a multi grader cannot contain another multi grader"
                )
            try:
                formula = parse_formula(model.calculate_output)
            except GraderError as exc:
                raise GraderConfigError(f"{where}.{exc}") from None
            unknown = sorted(formula.names - set(model.graders))
            if unknown:
                raise GraderConfigError(
                    f"{where}.calculate_output: unknown name(s) {', '.join(unknown)}; "
                    f"the formula may use the graders {', '.join(model.graders)}"
                )
            for name, sub in model.graders.items():
                _check(sub, f"{where}.graders.{name}", nested=True)


def _check_template(template: str, where: str) -> None:
    problem = check_template(template)
    if problem:
        raise GraderConfigError(f"{where}: {problem}")


def _message_texts(content: str | dict[str, Any] | list[dict[str, Any]]) -> list[str]:
    parts = content if isinstance(content, list) else [content]
    texts = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part.get("text"), str):
            texts.append(part["text"])
    return texts


def _check_python_source(source: str, where: str) -> None:
    if len(source.encode()) > MAX_PYTHON_SOURCE_BYTES:
        raise GraderConfigError(f"{where}: the source is over 256 kB (OpenAI's limit too)")
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise GraderConfigError(f"{where}: syntax error at line {exc.lineno}: {exc.msg}") from None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "grade":
            positional = node.args.posonlyargs + node.args.args
            required = len(positional) - len(node.args.defaults)
            if required <= 2 and (len(positional) >= 2 or node.args.vararg):
                return
            raise GraderConfigError(f"{where}: grade must take two arguments (sample, item)")
    raise GraderConfigError(f"{where}: no top-level function grade(sample, item) is defined")


def _describe(error: dict[str, Any], where: str) -> str:
    """One pydantic error as `key.path: what is wrong`, without the union's tag steps."""
    loc = list(error["loc"])
    path = [where]
    for index, part in enumerate(loc):
        is_tag = part in GRADER_TYPES and (
            index == 0 or (index >= 2 and loc[index - 2] == "graders")
        )
        if is_tag:
            continue
        path.append(f"[{part}]" if isinstance(part, int) else f".{part}")
    key = "".join(path)
    kind = error["type"]
    received = error.get("input")
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tag = error.get("ctx", {}).get("tag")
        got = f"got {_shown(tag)}" if tag is not None else "it is missing"
        return f"{key}.type: expected one of {', '.join(GRADER_TYPES)}, {got}"
    if kind == "literal_error":
        expected = re.findall(r"'([^']*)'", error["ctx"]["expected"])
        return f"{key}: expected one of {', '.join(expected)}, got {_shown(received)}"
    if kind == "missing":
        return f"{key}: required field missing"
    if kind == "extra_forbidden":
        return f"{key}: unknown field; check the spelling against the grader's documented fields"
    return f"{key}: {error['msg']} (got {_shown(received)})"


def _shown(value: Any) -> str:
    """A value as an error message quotes it: its repr, cut (a field may hold megabytes)."""
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."
