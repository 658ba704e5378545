"""Grade one sample: validate the grader object, pick the grader by `type`, run it.

`grade_async` is the one entry point the rollout code awaits; `grade` is the same for
synchronous callers (a CLI, a notebook, a thread of a pool). Graders that block (the
python grader's subprocess, cosine embeddings) run in a worker thread, so the event
loop keeps serving other rollouts meanwhile.

An invalid grader object raises GraderConfigError (and a missing `${VAR}` in endpoint
headers raises ConfigError): those are the user's to fix, for every sample alike. Any
failure while grading one sample becomes an error of its kind in the result, with
reward None.
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainer.errors import ConfigError
from trainer.graders.config import (
    EndpointGrader,
    F1Grader,
    LabelModelGrader,
    MultiGrader,
    NumericGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
    parse_grader,
)
from trainer.graders.context import GraderContext
from trainer.graders.endpoint import endpoint_score
from trainer.graders.f1 import f1_score_grader
from trainer.graders.model_graders import label_model_score, score_model_score
from trainer.graders.multi import grade_multi
from trainer.graders.numeric import numeric_score_grader
from trainer.graders.python_grader import python_grader_score
from trainer.graders.result import GraderError, GraderResult
from trainer.graders.string_check import string_check_score
from trainer.graders.text_similarity import text_similarity_score

logger = logging.getLogger(__name__)


def sample_from_text(
    output_text: str, output_tools: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The grader's sample from a model's final text and its tool calls (Chat Completions
    shape): `output_json` is the text parsed when it is a JSON object (as OpenAI's
    graders/run fills it), else None. The one place a sample is built."""
    try:
        output_json = json.loads(output_text)
    except json.JSONDecodeError:
        output_json = None
    if not isinstance(output_json, dict):
        output_json = None
    return {
        "output_text": output_text,
        "output_json": output_json,
        "output_tools": list(output_tools or []),
    }


def grade(
    config: dict[str, Any],
    sample: dict[str, Any],
    item: dict[str, Any],
    *,
    trace_id: str | None = None,
    context: GraderContext | None = None,
) -> GraderResult:
    """Synchronous `grade_async`; safe from any thread, with or without a running loop."""
    coroutine = grade_async(config, sample, item, trace_id=trace_id, context=context)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    # Called from synchronous code inside a running loop: that loop is blocked by this
    # very call, so the grade gets a loop of its own on a worker thread.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def grade_async(
    config: dict[str, Any],
    sample: dict[str, Any],
    item: dict[str, Any],
    *,
    trace_id: str | None = None,
    context: GraderContext | None = None,
) -> GraderResult:
    """Grade `sample` (`{"output_text", "output_json", "output_tools"}`) against the data
    row `item` with the grader object `config`."""
    grader = parse_grader(config)
    if not isinstance(sample, dict) or not isinstance(item, dict):
        return GraderResult.failed(
            "sample_parse_error", "the sample and the item must both be JSON objects"
        )
    sample = {"output_text": "", "output_json": None, "output_tools": [], **sample}
    return await _grade(grader, sample, item, context or GraderContext(), trace_id, "grader")


async def _grade(
    grader: Any,
    sample: dict[str, Any],
    item: dict[str, Any],
    context: GraderContext,
    trace_id: str | None,
    where: str,
) -> GraderResult:
    if isinstance(grader, MultiGrader):

        async def grade_sub(sub: Any, sub_where: str) -> GraderResult:
            return await _grade(sub, sample, item, context, trace_id, sub_where)

        return await grade_multi(grader, grade_sub, where=where)
    try:
        reward = await _score(grader, sample, item, context, trace_id, where)
    except GraderError as exc:
        return GraderResult.failed(exc.kind, str(exc))
    except ConfigError:
        raise
    except Exception as exc:  # a grader bug must not kill the training run; it is reported
        logger.exception("%s (%s) failed", where, grader.type)
        return GraderResult.failed("other_error", f"{type(exc).__name__}: {exc}")
    threshold = getattr(grader, "pass_threshold", None)
    return GraderResult(reward=reward, passed=None if threshold is None else reward >= threshold)


async def _score(
    grader: Any,
    sample: dict[str, Any],
    item: dict[str, Any],
    context: GraderContext,
    trace_id: str | None,
    where: str,
) -> float:
    match grader:
        case StringCheckGrader():
            return string_check_score(grader, sample, item)
        case TextSimilarityGrader():
            return await asyncio.to_thread(text_similarity_score, grader, sample, item, context)
        case ScoreModelGrader():
            return await score_model_score(grader, sample, item, context)
        case LabelModelGrader():
            return await label_model_score(grader, sample, item, context)
        case PythonGrader():
            return await asyncio.to_thread(python_grader_score, grader, sample, item, context)
        case EndpointGrader():
            return await endpoint_score(
                grader, sample, item, context, trace_id=trace_id, where=where
            )
        case NumericGrader():
            return numeric_score_grader(grader, sample, item)
        case F1Grader():
            return f1_score_grader(grader, sample, item)
    raise AssertionError(f"no grader for type {grader.type!r}")
