"""The configured grader as an MLflow scorer: production traces and datasets scored as
training scores its rollouts.

    from tasks.scoring import grader_scorer
    scorer = grader_scorer(config.grader)          # any grader object of the config
    mlflow.set_experiment(experiment_id=traces_experiment)  # assessments land on the traces
    mlflow.genai.evaluate(data=traces_or_rows, scorers=[scorer])

The scorer builds the grader's sample as the rollout loop does (`sample_from_text`: the
final text, its JSON, the tool calls in Chat Completions shape) from what it is given:

- `outputs`: a rollout trace's (`{"final_answer", ...}`), a served chat completion's
  (`{"choices": [{"message": ...}]}`, as `serve-model --trace-to` records), a message
  (`{"content", "tool_calls"}`) or plain text;
- tool calls: the trace's TOOL spans when there is a trace, else the message's `tool_calls`;
- the item (what `{{item.*}}` templates and reference fields read): the expectation named
  `item` (the pipeline logs one on every rollout it keeps as a trace), else the row's
  `expectations` as they are, plus `inputs`.

It returns the grader's score as `<name>` (a Feedback carrying the grader's error, never a
0, when it cannot score) and, when the trace is one of this project's rollouts (its grade
span records the penalties), the reward as `<name>_reward`: that score less the penalties
the rollout recorded.
"""

from __future__ import annotations

import json
from typing import Any

from trainer.graders import grade, sample_from_text, validate_grader

ITEM_EXPECTATION = "item"  # the expectation that carries a rollout's item (its reference fields)
SOURCE_ID = "agentrft-grader"


def assistant_message(outputs: Any) -> dict[str, Any]:
    """The assistant message in what a model answered: a rollout trace's outputs, a chat
    completion, a message, or text."""
    if isinstance(outputs, str):
        return {"content": outputs}
    if not isinstance(outputs, dict):
        return {"content": "" if outputs is None else json.dumps(outputs, default=str)}
    if "final_answer" in outputs:
        return {"content": outputs.get("final_answer") or ""}
    if outputs.get("choices"):
        return dict(outputs["choices"][0].get("message") or {})
    return outputs


def _trace_tool_calls(trace: Any) -> list[dict[str, Any]] | None:
    spans = [s for s in trace.data.spans if str(s.span_type) == "TOOL"] if trace is not None else []
    if not spans:
        return None
    return [{"id": span.attributes.get("call_id") or span.span_id, "type": "function",
             "function": {"name": (span.inputs or {}).get("name", span.name.removeprefix("tool ")),
                          "arguments": (span.inputs or {}).get("arguments", "{}")}} for span in spans]


def _recorded_penalties(trace: Any) -> float | None:
    if trace is None:
        return None
    for span in trace.data.spans:
        if str(span.span_type) == "EVALUATOR" and isinstance(span.outputs, dict) and "penalties" in span.outputs:
            return float(sum((span.outputs.get("penalties") or {}).values()))
    return None


def grader_scorer(grader: dict[str, Any], *, name: str = "grader") -> Any:
    """An MLflow scorer that grades with `grader` (validated now: a bad grader fails here,
    naming its key, not at the first row)."""
    from mlflow.entities import AssessmentSource, AssessmentSourceType, Feedback
    from mlflow.genai.scorers import scorer

    validate_grader(grader)
    source = AssessmentSource(source_type=AssessmentSourceType.CODE, source_id=SOURCE_ID)

    def score(inputs: Any = None, outputs: Any = None, expectations: dict[str, Any] | None = None,
              trace: Any = None) -> list[Any]:
        message = assistant_message(outputs)
        content = message.get("content")
        text = content if isinstance(content, str) else json.dumps(content or "", default=str)
        tools = _trace_tool_calls(trace)
        if tools is None:
            tools = [call for call in message.get("tool_calls") or [] if isinstance(call, dict)]
        expectations = dict(expectations or {})
        given = expectations.get(ITEM_EXPECTATION)
        item = dict(given) if isinstance(given, dict) else expectations
        if isinstance(inputs, dict):
            item = {**inputs, **item}
        trace_id = trace.info.trace_id if trace is not None else None
        result = grade(grader, sample_from_text(text, tools), item, trace_id=trace_id)
        if result.reward is None:
            error = "; ".join(f"{kind}: {message}" for kind, message in result.errors.items())
            return [Feedback(name=name, error=error, source=source)]
        feedback = [Feedback(name=name, value=result.reward, source=source,
                             metadata={"sub_rewards": json.dumps(result.sub_rewards)} if result.sub_rewards else None)]
        penalties = _recorded_penalties(trace)
        if penalties is not None:
            feedback.append(Feedback(name=f"{name}_reward", value=result.reward - penalties, source=source))
        return feedback

    return scorer(score, name=name)
