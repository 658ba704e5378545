"""The endpoint grader: the reward comes from the user's own HTTP service.

`POST url` with `{"sample", "item", "trace_id"}` (the same trace id as the rollout's
tool calls, so the service can look up what the tools did) and read back
`{"score": float}`. Header values may name environment variables (`"Bearer
${GRADER_TOKEN}"`), resolved at call time by the tool client's `resolve_headers`: a
missing variable is a ConfigError naming it, and values never reach logs or messages.

An endpoint that cannot answer (5xx, timeouts, refused connections, after 3 tries with
backoff), answers 4xx, or answers something other than `{"score": <finite number>}` gives
an `endpoint_grader_server_error` with reward None: the sample was not graded, which is
not the same as graded 0.
"""

from __future__ import annotations

import math
from typing import Any

from trainer.graders.config import EndpointGrader
from trainer.graders.context import GraderContext
from trainer.graders.http_post import post_json
from trainer.graders.result import GraderError
from trainer.wire import new_trace_id, resolve_headers


async def endpoint_score(
    grader: EndpointGrader,
    sample: dict[str, Any],
    item: dict[str, Any],
    context: GraderContext,
    *,
    trace_id: str | None,
    where: str,
) -> float:
    headers = resolve_headers(grader.headers, where=f"{where}.headers")
    body = {"sample": sample, "item": item, "trace_id": trace_id or new_trace_id()}
    answer = await post_json(
        grader.url, body, headers=headers, context=context, kind="endpoint_grader_server_error",
        allowed_hosts=grader.allowed_hosts,
    )
    score = answer.get("score") if isinstance(answer, dict) else None
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
        raise GraderError(
            "endpoint_grader_server_error",
            f'the grader endpoint must answer {{"score": <number>}}, got {str(answer)[:200]!r}',
        )
    return float(score)
