"""score_model, label_model and endpoint graders against real HTTP servers on loopback.

One FastAPI app plays both an OpenAI-compatible judge (`/v1/chat/completions`, whose
answer is chosen by the requested model name) and the user's grading endpoints. It runs
under uvicorn on a free port in a background thread; every request it receives is
recorded so the tests can check what was sent on the wire.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from trainer.errors import ConfigError
from trainer.graders import GraderContext, grade, grade_async

# Fast retries: the tests exercise the retry logic, not the wall clock.
CONTEXT = GraderContext(http_timeout_s=2.0, retry_backoff_s=0.01)

JUDGE_ANSWERS: dict[str, Any] = {
    "judge-json": {
        "content": json.dumps({"steps": [{"description": "d", "conclusion": "c"}], "result": 0.7})
    },
    "judge-bare": {"content": "0.9"},
    "judge-fenced": {"content": '```json\n{"score": 0.25}\n```'},
    "judge-high": {"content": '{"result": 7, "steps": []}'},
    "judge-garbage": {"content": "I think the answer is quite good."},
    "judge-refuse": {"content": None, "refusal": "I can't help with grading this."},
    "label-correct": {"content": '{"steps": [], "result": "correct"}'},
    "label-incorrect": {"content": '{"steps": [], "result": "incorrect"}'},
    "label-bare": {"content": "Correct"},
    "label-unknown": {"content": '{"steps": [], "result": "maybe"}'},
    "o4-mini-2025-04-16": {"content": '{"steps": [], "result": 0.5}'},
}


def make_app() -> FastAPI:
    app = FastAPI()
    app.state.requests = []  # (path, headers, body) of every request
    app.state.hits = Counter()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        app.state.requests.append((request.url.path, dict(request.headers), body))
        model = body["model"]
        app.state.hits[model] += 1
        if model == "judge-500":
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=500)
        if model == "judge-flaky" and app.state.hits[model] == 1:
            return JSONResponse({"error": "try again"}, status_code=503)
        if model == "judge-404":
            return JSONResponse({"error": {"message": "model not found"}}, status_code=404)
        answer = JUDGE_ANSWERS.get(model, {"content": '{"steps": [], "result": 1.0}'})
        message = {
            "role": "assistant",
            "content": answer["content"],
            "refusal": answer.get("refusal"),
        }
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    @app.post("/grade/{behaviour}")
    async def grade_endpoint(behaviour: str, request: Request) -> Any:
        body = await request.json()
        app.state.requests.append((request.url.path, dict(request.headers), body))
        app.state.hits[behaviour] += 1
        match behaviour:
            case "ok":
                return {"score": len(body["sample"]["output_text"]) / 10}
            case "500":
                return JSONResponse({"detail": "database down"}, status_code=500)
            case "flaky" if app.state.hits[behaviour] < 3:
                return JSONResponse({"detail": "busy"}, status_code=503)
            case "flaky":
                return {"score": 0.25}
            case "422":
                return JSONResponse({"detail": "sample.output_text is required"}, status_code=422)
            case "malformed":
                return {"reward": 1.0}
            case "slow":
                await asyncio.sleep(1.0)
                return {"score": 1.0}
        return JSONResponse({"detail": "unknown behaviour"}, status_code=404)

    return app


@pytest.fixture(scope="module")
def server() -> Any:
    app = make_app()
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    uv_server = uvicorn.Server(config)
    thread = threading.Thread(target=uv_server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv_server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    port = uv_server.servers[0].sockets[0].getsockname()[1]
    app.state.base_url = f"http://127.0.0.1:{port}"
    yield app.state
    uv_server.should_exit = True
    thread.join(timeout=5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def score_model(state: Any, model: str, **extra: Any) -> dict[str, Any]:
    return {
        "type": "score_model",
        "name": "judge",
        "model": model,
        "base_url": f"{state.base_url}/v1",
        "input": [
            {"role": "system", "content": "Grade the answer."},
            {
                "role": "user",
                "content": "Reference: {{ item.reference_answer }}. Answer: {{sample.output_text}}",
            },
        ],
        **extra,
    }


def label_model(state: Any, model: str) -> dict[str, Any]:
    return {
        "type": "label_model",
        "name": "labeler",
        "model": model,
        "base_url": f"{state.base_url}/v1",
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "Is {{sample.output_text}} right?"}],
            }
        ],
        "labels": ["correct", "incorrect"],
        "passing_labels": ["correct"],
    }


SAMPLE = {"output_text": "42", "output_json": 42, "output_tools": []}
ITEM = {"reference_answer": "42"}


def last_request(state: Any) -> tuple[str, dict[str, str], dict[str, Any]]:
    return state.requests[-1]


# ---- score_model -----------------------------------------------------------------------


def test_score_model_reads_result_and_sends_rendered_prompt(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-secret-value")
    result = grade(score_model(server, "judge-json"), SAMPLE, ITEM, context=CONTEXT)
    assert result.reward == 0.7 and result.errors == {}
    path, headers, body = last_request(server)
    assert path == "/v1/chat/completions"
    assert headers["authorization"] == "Bearer sk-test-secret-value"
    assert body["messages"] == [
        {"role": "system", "content": "Grade the answer."},
        {"role": "user", "content": "Reference: 42. Answer: 42"},
    ]
    schema = body["response_format"]["json_schema"]["schema"]
    assert schema["required"] == ["steps", "result"] and schema["properties"]["result"] == {
        "type": "number"
    }


@pytest.mark.parametrize(
    ("model", "extra", "reward"),
    [
        ("judge-bare", {}, 0.9),  # a bare number
        ("judge-fenced", {}, 0.25),  # ```json {"score": ...}```
        ("judge-high", {}, 1.0),  # 7 clipped to the default range [0, 1]
        ("judge-high", {"range": [0, 10]}, 7.0),
        ("judge-json", {"pass_threshold": 0.8}, 0.7),
    ],
)
def test_score_model_output_forms_and_range(
    server: Any, model: str, extra: dict, reward: float
) -> None:
    result = grade(score_model(server, model, **extra), SAMPLE, ITEM, context=CONTEXT)
    assert result.reward == reward
    assert result.passed is (None if "pass_threshold" not in extra else False)


def test_score_model_server_error_is_not_a_zero(server: Any) -> None:
    server.hits["judge-500"] = 0
    result = grade(score_model(server, "judge-500"), SAMPLE, ITEM, context=CONTEXT)
    assert result.reward is None
    assert list(result.errors) == ["model_grader_server_error"]
    assert "failed after 3 attempts" in result.errors["model_grader_server_error"]
    assert "HTTP 500" in result.errors["model_grader_server_error"]
    assert server.hits["judge-500"] == 3


def test_score_model_retries_a_flaky_judge(server: Any) -> None:
    result = grade(score_model(server, "judge-flaky"), SAMPLE, ITEM, context=CONTEXT)
    assert result.reward == 1.0 and server.hits["judge-flaky"] == 2


def test_score_model_4xx_is_not_retried(server: Any) -> None:
    result = grade(score_model(server, "judge-404"), SAMPLE, ITEM, context=CONTEXT)
    assert result.reward is None
    assert "HTTP 404" in result.errors["model_grader_server_error"]
    assert server.hits["judge-404"] == 1


def test_score_model_refusal_and_parse_errors(server: Any) -> None:
    refused = grade(score_model(server, "judge-refuse"), SAMPLE, ITEM, context=CONTEXT)
    assert refused.reward is None
    assert refused.errors == {
        "model_grader_refusal_error": "the judge refused: I can't help with grading this."
    }
    garbage = grade(score_model(server, "judge-garbage"), SAMPLE, ITEM, context=CONTEXT)
    assert garbage.reward is None and list(garbage.errors) == ["model_grader_parse_error"]


def test_score_model_connection_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    config = {
        "type": "score_model",
        "model": "m",
        "base_url": f"http://127.0.0.1:{free_port()}/v1",
        "input": [{"role": "user", "content": "x"}],
    }
    result = grade(config, SAMPLE, ITEM, context=CONTEXT)
    assert result.reward is None
    assert "connection failed" in result.errors["model_grader_server_error"]


def test_openai_docs_score_model_example_unchanged(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The score_model grader of OpenAI's graders guide, verbatim; the base URL comes from
    the environment as it would for the OpenAI SDK."""
    grader = {
        "type": "score_model",
        "name": "my_score_model",
        "input": [
            {
                "role": "system",
                "content": "You are an expert grader. If the reference and model answer are exact matches, output a score of 1. If they are somewhat similar in meaning, output a score in 0.5. Otherwise, give a score of 0.",
            },
            {
                "role": "user",
                "content": "Reference: {{ item.reference_answer }}. Model answer: {{ sample.output_text }}",
            },
        ],
        "pass_threshold": 0.5,
        "model": "o4-mini-2025-04-16",
        "range": [0, 1],
        "sampling_params": {
            "max_completions_tokens": 32768,
            "top_p": 1,
            "reasoning_effort": "medium",
        },
    }
    monkeypatch.setenv("OPENAI_BASE_URL", f"{server.base_url}/v1")
    # The guide's run call: item {"reference_answer": 1.0}, model_sample "0.9".
    result = grade(grader, {"output_text": "0.9"}, {"reference_answer": 1.0}, context=CONTEXT)
    assert result.to_json() == {"reward": 0.5, "errors": {}, "sub_rewards": {}}
    assert result.passed is True
    _, _, body = last_request(server)
    assert body["messages"][1]["content"] == "Reference: 1.0. Model answer: 0.9"
    assert body["max_completion_tokens"] == 32768
    assert body["top_p"] == 1 and body["reasoning_effort"] == "medium"


# ---- label_model -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "reward"), [("label-correct", 1.0), ("label-incorrect", 0.0), ("label-bare", 1.0)]
)
def test_label_model(server: Any, model: str, reward: float) -> None:
    result = grade(label_model(server, model), {"output_text": "42"}, ITEM, context=CONTEXT)
    assert result.reward == reward and result.errors == {}
    _, _, body = last_request(server)
    assert body["messages"] == [{"role": "user", "content": "Is 42 right?"}]
    assert body["response_format"]["json_schema"]["schema"]["properties"]["result"]["enum"] == [
        "correct",
        "incorrect",
    ]


def test_label_model_unknown_label_is_a_parse_error(server: Any) -> None:
    result = grade(
        label_model(server, "label-unknown"), {"output_text": "42"}, ITEM, context=CONTEXT
    )
    assert result.reward is None
    assert "not one of the labels" in result.errors["model_grader_parse_error"]


# ---- endpoint --------------------------------------------------------------------------


def endpoint(state: Any, behaviour: str, **extra: Any) -> dict[str, Any]:
    return {
        "type": "endpoint",
        "name": "service",
        "url": f"{state.base_url}/grade/{behaviour}",
        **extra,
    }


def test_endpoint_grader_posts_sample_item_and_trace_id(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADER_TOKEN", "s3cret-token-value")
    config = endpoint(server, "ok", headers={"Authorization": "Bearer ${GRADER_TOKEN}"})
    sample = {
        "output_text": "four",
        "output_tools": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    result = grade(config, sample, ITEM, trace_id="trace_abc", context=CONTEXT)
    assert result.to_json() == {"reward": 0.4, "errors": {}, "sub_rewards": {}}
    _, headers, body = last_request(server)
    assert headers["authorization"] == "Bearer s3cret-token-value"
    assert body == {
        "sample": {
            "output_text": "four",
            "output_json": None,
            "output_tools": sample["output_tools"],
        },
        "item": ITEM,
        "trace_id": "trace_abc",
    }


def test_endpoint_grader_makes_a_trace_id_when_none_is_given(server: Any) -> None:
    grade(endpoint(server, "ok"), {"output_text": "ab"}, ITEM, context=CONTEXT)
    assert last_request(server)[2]["trace_id"].startswith("trace_")


def test_endpoint_grader_5xx_after_retries_is_an_error_not_zero(server: Any) -> None:
    server.hits["500"] = 0
    result = grade(endpoint(server, "500"), SAMPLE, ITEM, context=CONTEXT)
    assert result.reward is None
    message = result.errors["endpoint_grader_server_error"]
    assert "failed after 3 attempts" in message and "database down" in message
    assert server.hits["500"] == 3


def test_endpoint_grader_recovers_within_its_retries(server: Any) -> None:
    result = grade(endpoint(server, "flaky"), SAMPLE, ITEM, context=CONTEXT)
    assert result.reward == 0.25 and server.hits["flaky"] == 3


@pytest.mark.parametrize(
    ("behaviour", "expected"),
    [("422", "HTTP 422"), ("malformed", 'must answer {"score": <number>}')],
)
def test_endpoint_grader_4xx_and_malformed_answers(
    server: Any, behaviour: str, expected: str
) -> None:
    server.hits[behaviour] = 0
    result = grade(endpoint(server, behaviour), SAMPLE, ITEM, context=CONTEXT)
    assert result.reward is None
    assert expected in result.errors["endpoint_grader_server_error"]
    assert server.hits[behaviour] == 1


def test_endpoint_grader_timeout_and_refused_connection(server: Any) -> None:
    quick = GraderContext(http_timeout_s=0.2, retry_backoff_s=0.01)
    timed_out = grade(endpoint(server, "slow"), SAMPLE, ITEM, context=quick)
    assert "timed out" in timed_out.errors["endpoint_grader_server_error"]
    refused = grade(
        {"type": "endpoint", "url": f"http://127.0.0.1:{free_port()}/grade"},
        SAMPLE,
        ITEM,
        context=quick,
    )
    assert (
        refused.reward is None
        and "connection failed" in refused.errors["endpoint_grader_server_error"]
    )


def test_endpoint_grader_missing_header_variable_is_a_config_error(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MISSING_GRADER_TOKEN", raising=False)
    config = endpoint(server, "ok", headers={"Authorization": "Bearer ${MISSING_GRADER_TOKEN}"})
    with pytest.raises(
        ConfigError,
        match=r"grader\.headers\.Authorization: environment variable MISSING_GRADER_TOKEN",
    ):
        grade(config, SAMPLE, ITEM, context=CONTEXT)


def test_allowed_hosts_blocks_other_hosts(server: Any) -> None:
    context = GraderContext(allowed_hosts=("judge.internal",))
    result = grade(endpoint(server, "ok"), SAMPLE, ITEM, context=context)
    assert result.reward is None
    assert "is not in allowed_hosts (judge.internal)" in result.errors["other_error"]
    assert (
        grade(
            endpoint(server, "ok"),
            SAMPLE,
            ITEM,
            context=GraderContext(allowed_hosts=("127.0.0.1",)),
        ).reward
        == 0.2
    )


def test_secrets_never_appear_in_errors(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADER_TOKEN", "s3cret-token-value")
    config = endpoint(server, "500", headers={"Authorization": "Bearer ${GRADER_TOKEN}"})
    result = grade(config, SAMPLE, ITEM, context=CONTEXT)
    assert "s3cret" not in json.dumps(result.to_json())


# ---- sync / async entry points ------------------------------------------------------------


def test_grade_async_runs_graders_concurrently_inside_a_loop(server: Any) -> None:
    async def main() -> list[float | None]:
        results = await asyncio.gather(
            *(
                grade_async(endpoint(server, "ok"), {"output_text": "x" * n}, ITEM, context=CONTEXT)
                for n in range(1, 6)
            )
        )
        return [result.reward for result in results]

    assert asyncio.run(main()) == [0.1, 0.2, 0.3, 0.4, 0.5]


def test_sync_grade_works_from_a_thread_and_inside_a_running_loop(server: Any) -> None:
    rewards: list[float | None] = []
    worker = threading.Thread(
        target=lambda: rewards.append(
            grade(endpoint(server, "ok"), {"output_text": "abc"}, ITEM, context=CONTEXT).reward
        )
    )
    worker.start()
    worker.join()

    async def called_from_async_code() -> float | None:
        return grade(endpoint(server, "ok"), {"output_text": "abcd"}, ITEM, context=CONTEXT).reward

    rewards.append(asyncio.run(called_from_async_code()))
    assert rewards == [0.3, 0.4]
