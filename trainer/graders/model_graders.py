"""OpenAI's model graders: a judge model at an OpenAI-compatible chat endpoint.

`score_model` asks the judge for a number, `label_model` for one of `labels`. The prompt
is the grader's `input` messages with templates rendered; the request goes to
`{base_url}/chat/completions`, where `base_url` is the grader's (our extension field)
or `$OPENAI_BASE_URL` or `https://api.openai.com/v1`, so a local vLLM or llama.cpp
server, or a hosted API, can judge. The API key is read from the environment variable
named by `api_key_env` (default `OPENAI_API_KEY`) and sent only as a header.

As OpenAI does, the request asks for structured output: `{"result": <number>, "steps":
[{"description", "conclusion"}]}` for score_model (`result` a label for label_model).
Judges that ignore response_format are still read: a JSON object with `result` (or
`score` / `label`), a bare JSON value, or a bare number or label as the whole text.

Errors (reward None, never a score): HTTP failures after retries are
`model_grader_server_error`; a refusal (the message's `refusal`, or finish_reason
`content_filter`) is `model_grader_refusal_error`; an answer without a usable number or
label is `model_grader_parse_error`. OpenAI scores non-numeric judge output 0; we do not,
since a silent 0 teaches the policy that a fine answer was wrong. Scores are clipped to
`range` (default [0, 1]).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from trainer.graders.config import LabelModelGrader, ModelMessage, ScoreModelGrader
from trainer.graders.context import GraderContext
from trainer.graders.http_post import post_json
from trainer.graders.result import GraderError
from trainer.graders.templates import render_template

DEFAULT_BASE_URL = "https://api.openai.com/v1"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_BARE_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_STEPS_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"description": {"type": "string"}, "conclusion": {"type": "string"}},
        "required": ["description", "conclusion"],
        "additionalProperties": False,
    },
}


async def score_model_score(
    grader: ScoreModelGrader, sample: dict[str, Any], item: dict[str, Any], context: GraderContext
) -> float:
    text = await _ask_judge(grader, sample, item, context, result_schema={"type": "number"})
    low, high = grader.range
    return min(high, max(low, parse_score_output(text)))


async def label_model_score(
    grader: LabelModelGrader, sample: dict[str, Any], item: dict[str, Any], context: GraderContext
) -> float:
    schema = {"type": "string", "enum": list(grader.labels)}
    label = parse_label_output(
        await _ask_judge(grader, sample, item, context, result_schema=schema), grader.labels
    )
    return 1.0 if label in grader.passing_labels else 0.0


def parse_score_output(text: str) -> float:
    """The judge's numeric result (see module doc), or GraderError(model_grader_parse_error)."""
    value = _json_or_none(text)
    if isinstance(value, dict):
        value = next((value[key] for key in ("result", "score") if key in value), None)
    if isinstance(value, str):
        value = value.strip()
    if isinstance(value, str) and _BARE_NUMBER.fullmatch(value):
        value = float(value)
    if value is None and _BARE_NUMBER.fullmatch(_unfenced(text)):
        value = float(_unfenced(text))
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise GraderError(
        "model_grader_parse_error", f"the judge's answer has no numeric result: {text[:200]!r}"
    )


def parse_label_output(text: str, labels: list[str]) -> str:
    """The judge's label, one of `labels`, or GraderError(model_grader_parse_error)."""
    value = _json_or_none(text)
    if isinstance(value, dict):
        value = next((value[key] for key in ("result", "label") if key in value), None)
    if value is None:
        value = _unfenced(text)
    if isinstance(value, str):
        candidate = value.strip().strip("\"'.`").strip()
        if candidate in labels:
            return candidate
        folded = [label for label in labels if label.casefold() == candidate.casefold()]
        if len(folded) == 1:
            return folded[0]
    raise GraderError(
        "model_grader_parse_error",
        f"the judge's answer is not one of the labels {labels}: {text[:200]!r}",
    )


async def _ask_judge(
    grader: ScoreModelGrader | LabelModelGrader,
    sample: dict[str, Any],
    item: dict[str, Any],
    context: GraderContext,
    *,
    result_schema: dict[str, Any],
) -> str:
    base_url = grader.base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
    url = base_url.rstrip("/") + "/chat/completions"
    headers = {}
    api_key = os.environ.get(grader.api_key_env)
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    body: dict[str, Any] = {
        "model": grader.model,
        "messages": [_render_message(message, sample, item) for message in grader.input],
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": f"{grader.type}_result",
                "strict": True,
                "schema": {
                    "type": "object",
                    "properties": {"steps": _STEPS_SCHEMA, "result": result_schema},
                    "required": ["steps", "result"],
                    "additionalProperties": False,
                },
            },
        },
    }
    body.update(_sampling_params(grader))
    answer = await post_json(
        url, body, headers=headers, context=context, kind="model_grader_server_error",
        allowed_hosts=grader.allowed_hosts,
    )
    try:
        choice = answer["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise GraderError(
            "model_grader_server_error",
            f"the judge's answer is not a chat completion: {str(answer)[:200]!r}",
        ) from None
    if message.get("refusal") or choice.get("finish_reason") == "content_filter":
        reason = message.get("refusal") or "finish_reason content_filter"
        raise GraderError("model_grader_refusal_error", f"the judge refused: {str(reason)[:200]}")
    content = message.get("content")
    if not isinstance(content, str) or not content.strip():
        raise GraderError("model_grader_parse_error", "the judge's answer has no text content")
    return content


def _render_message(
    message: ModelMessage, sample: dict[str, Any], item: dict[str, Any]
) -> dict[str, Any]:
    """A chat message; Responses-style content parts become chat content parts."""
    if isinstance(message.content, str):
        return {"role": message.role, "content": render_template(message.content, sample, item)}
    parts = message.content if isinstance(message.content, list) else [message.content]
    rendered: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part.get("text"), str):
            rendered.append({"type": "text", "text": render_template(part["text"], sample, item)})
        elif part.get("type") == "input_image" and isinstance(part.get("image_url"), str):
            url = render_template(part["image_url"], sample, item)
            rendered.append(
                {
                    "type": "image_url",
                    "image_url": {"url": url, "detail": part.get("detail", "auto")},
                }
            )
        else:
            raise GraderError(
                "other_error", f"unsupported content part in the judge prompt: {str(part)[:120]}"
            )
    if all(part["type"] == "text" for part in rendered):  # plain text suits every server
        return {"role": message.role, "content": "".join(part["text"] for part in rendered)}
    return {"role": message.role, "content": rendered}


def _sampling_params(grader: ScoreModelGrader | LabelModelGrader) -> dict[str, Any]:
    params = grader.sampling_params
    if params is None:
        return {}
    chosen = {
        "seed": params.seed,
        "top_p": params.top_p,
        "temperature": params.temperature,
        "max_completion_tokens": params.max_completion_tokens or params.max_completions_tokens,
        "reasoning_effort": params.reasoning_effort,
    }
    return {key: value for key, value in chosen.items() if value is not None}


def _unfenced(text: str) -> str:
    text = text.strip()
    match = _FENCE.match(text)
    return match.group(1) if match else text


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(_unfenced(text))
    except json.JSONDecodeError:
        return None
