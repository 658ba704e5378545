"""The OpenAI-compatible model server, spoken to by the official `openai` client and by a
`score_model` grader. The served model is a tiny Qwen3 taught two conversations (a tool
call for a question, a score for a judge prompt), so what it answers is real generation."""

from __future__ import annotations

import json

import openai
import pytest

from envs.finqa.tool_schemas import TOOL_SCHEMAS
from envs.tool_server import serve_in_thread
from tests.taught_model import fit_tiny_model
from trainer.generation.policy import Policy
from trainer.graders import grade
from trainer.serving.model_server import create_model_app

QUESTION = "What was ACME's net revenue in 2019?"
JUDGE_PROMPT = "Grade the answer 12.5 against the reference 12.5. Reply with a score."
CALL = {"id": "call_0", "type": "function", "function": {"name": "search", "arguments": '{"query":"ACME 2019 net revenue"}'}}


@pytest.fixture(scope="module")
def served():
    conversations = [
        ([{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "", "tool_calls": [CALL]}], TOOL_SCHEMAS),
        ([{"role": "user", "content": JUDGE_PROMPT}, {"role": "assistant", "content": "1"}], None),
    ]
    texts = [json.dumps(c) for c, _ in conversations] * 20
    model, tokenizer, stats = fit_tiny_model(conversations, texts, vocab_size=400, extra_tokens=["ACME"], epochs=150,
                                             max_minutes=3)
    assert stats["final_loss"] < 0.05, stats
    app = create_model_app(Policy(model=model, tokenizer=tokenizer, path="tiny"), model_name="tiny-agent", max_len=1024)
    with serve_in_thread(app) as base_url:
        yield base_url


def test_openai_client_gets_a_tool_call(served: str) -> None:
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["tiny-agent"]
    response = client.chat.completions.create(
        model="tiny-agent", messages=[{"role": "user", "content": QUESTION}], tools=TOOL_SCHEMAS, temperature=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "search"
    assert json.loads(call.function.arguments) == {"query": "ACME 2019 net revenue"}
    assert response.usage.completion_tokens > 0


def test_bad_requests_are_openai_errors(served: str) -> None:
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-agent", messages=[])


def test_score_model_grader_uses_the_served_judge(served: str) -> None:
    grader = {
        "type": "score_model",
        "name": "judge",
        "model": "tiny-agent",
        "base_url": f"{served}/v1",
        "input": [{"role": "user", "content": "Grade the answer {{sample.output_text}} against the reference {{item.reference_answer}}. Reply with a score."}],
        "range": [0, 1],
        "sampling_params": {"temperature": 0},
    }
    result = grade(grader, {"output_text": "12.5"}, {"reference_answer": "12.5"})
    assert result.errors == {}
    assert result.reward == 1.0


def test_a_chat_body_past_the_limit_gets_a_413_before_it_is_sent(served: str) -> None:
    from tests.flows.test_api_outbound import send_big

    for chunked in (False, True):
        status, sent = send_big(served, "/v1/chat/completions", total=64 * 1024 * 1024, chunked=chunked)
        assert status == 413 and sent < 16 * 1024 * 1024, (chunked, status, sent)
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="tiny-agent", messages=[{"role": "user", "content": "x" * 1_100_000}])
    assert refused.value.status_code == 413 and "--max-json-bytes" in refused.value.message
