"""The agent loop with the real engine, a real tiny model and the real tool server.

A model cannot be told what to write, so the fixture *teaches* it: a tiny Qwen3 is fitted
(the same supervised warm start the demo uses) on four scripted conversations, one per
behaviour under test: parallel calls in one turn, more calls than the budget allows, a
malformed tool call, and a plain search-read-answer. At temperature 0 it then replays them
through the engine against the FinQA tool server on loopback, so every assertion below is
about the real loop, real HTTP and real tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from envs.finqa.faults import FaultConfig
from envs.finqa.local import local_tool_endpoints
from tests.taught_model import fit_tiny_model
from trainer.chat_formats import load_chat_format, parse_tool_call_blocks
from trainer.chat_formats.hermes import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from trainer.config.tools import ToolEndpoint
from trainer.data import read_items
from trainer.generation.engine import TransformersBackend
from trainer.rollout.record import RolloutSettings
from trainer.rollout.tool_client import ToolClient

SYSTEM = "Answer with a number."
GRADER = {"type": "numeric", "name": "answer", "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}"}
MALFORMED = f'{TOOL_CALL_OPEN}\n{{"name":"search","arguments":{{"query": oops}}\n{TOOL_CALL_CLOSE}'


def _call(index: int, name: str, arguments: dict) -> dict:
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, separators=(",", ":"))},
    }


async def _script(item: dict, turns: list, endpoints: list[ToolEndpoint]) -> list[dict]:
    """A conversation whose tool outputs come from the real server. `turns` holds lists of
    (name, arguments) per assistant turn, the string MALFORMED, or the final answer."""
    messages = [{"role": "system", "content": SYSTEM}, *item["messages"]]
    index = 0
    async with ToolClient(endpoints, item["tools"]) as client:
        for turn in turns:
            if turn == MALFORMED:
                messages.append({"role": "assistant", "content": MALFORMED})
                # What the loop answers to a malformed block (see rollout._loop_turns).
                error = parse_tool_call_blocks(MALFORMED, first_call_index=index).errors[0]
                messages.append({"role": "tool", "tool_call_id": "invalid", "content": f"Error: {error}"})
                index += 1
            elif isinstance(turn, str):
                messages.append({"role": "assistant", "content": turn})
            else:
                calls = [_call(index + i, name, args) for i, (name, args) in enumerate(turn)]
                index += len(calls)
                messages.append({"role": "assistant", "content": "", "tool_calls": calls})
                for call in calls:
                    result = await client.call(
                        call["function"]["name"], call["function"]["arguments"],
                        item=item, trace_id="trace_script", call_id=call["id"],
                    )
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": result.output})
    return messages


@pytest.fixture(scope="module")
def world(demo_data_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    items = read_items(demo_data_dir / "validation.jsonl", 4)
    corpus = tmp_path_factory.mktemp("corpus")
    for item in items:
        for page in item["gold_pages"]:
            year_dir = Path(page).parent
            shutil.copytree(demo_data_dir / "corpus" / year_dir, corpus / year_dir, dirs_exist_ok=True)
    return items, corpus


@pytest.fixture(scope="module")
def taught(world):
    """A tiny model fitted to one scripted conversation per item."""
    items, corpus = world
    answer = [f"Answer: {item['reference_answer']}" for item in items]
    page = [item["gold_pages"][0] for item in items]
    scripts = [
        [[("search", {"query": items[0]["question"]}), ("list", {"path": str(Path(page[0]).parent)})], answer[0]],
        [[("cat", {"path": page[1]})], [("list", {"path": "reports"})], [("cat", {"path": page[1]})],
         [("list", {"path": str(Path(page[1]).parent)})], answer[1]],
        [MALFORMED, [("cat", {"path": page[2]})], answer[2]],
        [[("search", {"query": items[3]["question"]})], [("cat", {"path": page[3]})], answer[3]],
    ]
    with local_tool_endpoints(corpus) as endpoints:
        conversations = [asyncio.run(_script(item, s, endpoints)) for item, s in zip(items, scripts, strict=True)]
    texts = [json.dumps(c) for c in conversations] + [p.read_text() for p in sorted(corpus.rglob("*.txt"))]
    model, tokenizer, stats = fit_tiny_model([(c, items[0]["tools"]) for c in conversations], texts)
    assert stats["final_loss"] < 0.05, stats
    return model, tokenizer, conversations


def _run(taught, world, *, endpoints, settings=None, seed=0, temperature=0.0, n=1, items=None, grader=GRADER,
         **engine):
    model, tokenizer, _ = taught
    all_items, _ = world
    settings = settings or RolloutSettings(system_prompt=SYSTEM, temperature=temperature, max_new_tokens_per_turn=200)
    engine = {"max_slots": 16, "max_len": 2048, **engine}
    backend = TransformersBackend(model, stop_token_ids=[tokenizer.eos_token_id], seed=seed, **engine)

    async def go():
        async with ToolClient(endpoints, None, backoff_s=0.01, timeout_s=5) as client:
            from trainer.rollout.loop import run_rollouts_async

            return await run_rollouts_async(
                backend, load_chat_format(tokenizer), items or all_items, n_per_item=n, tool_client=client,
                grader=grader, settings=settings,
            )

    return asyncio.run(go())


def test_taught_model_replays_scripts_through_real_tools(taught, world):
    items, corpus = world
    with local_tool_endpoints(corpus, faults=FaultConfig(latency_ms=300)) as endpoints:
        records = _run(taught, world, endpoints=endpoints)
        base = endpoints[0].server_url.rsplit("/tools/", 1)[0]
        traces = {r.trace_id: httpx.get(f"{base}/traces/{r.trace_id}").json() for r in records}
    parallel, budget, malformed, plain = records

    # trace_id: one per rollout, the same on every call of it
    assert len({r.trace_id for r in records}) == len(records)
    for record in records:
        assert record.trace_id.startswith("trace_")
        calls = traces[record.trace_id].get("calls", [])  # a rollout without calls has no trace
        assert len(calls) == len(record.tool_calls)

    # two calls in one turn run concurrently: their server-side intervals overlap
    assert [c.name for c in parallel.tool_calls] == ["search", "list"]
    a, b = traces[parallel.trace_id]["calls"]
    assert a["started_at"] < b["finished_at"] and b["started_at"] < a["finished_at"]
    assert parallel.status == "ok" and parallel.score == 1.0

    # a malformed call ends the rollout by default: graded on what it has (no answer), counted
    assert malformed.malformed_tool_calls == 1 and malformed.tool_calls == []
    assert malformed.status == "malformed_call" and malformed.score == 0.0
    assert malformed.finish_reasons == ["tool_calls"]
    # what the model wrote stays in the record (and its trace): the block that did not parse
    assert malformed.messages[-1]["role"] == "assistant" and malformed.messages[-1]["content"].startswith(
        MALFORMED.strip()[:20])
    assert plain.status == "ok" and plain.score == 1.0
    assert budget.status == "ok" and len(budget.tool_calls) == 4
    assert parallel.finish_reasons == ["tool_calls", "stop"] and plain.finish_reasons == ["tool_calls"] * 2 + ["stop"]


def test_with_feedback_a_malformed_call_is_answered_counted_and_charged(taught, world):
    items, corpus = world
    settings = RolloutSettings(system_prompt=SYSTEM, temperature=0.0, max_new_tokens_per_turn=200,
                               on_malformed_call="feedback", per_tool_call_penalty=0.05)
    with local_tool_endpoints(corpus) as endpoints:
        (malformed,) = _run(taught, world, endpoints=endpoints, settings=settings, items=[items[2]])
        budget = dataclasses.replace(settings, max_episode_steps=1)
        (over,) = _run(taught, world, endpoints=endpoints, settings=budget, items=[items[2]])
    assert malformed.status == "ok" and malformed.score == 1.0 and malformed.malformed_tool_calls == 1
    assert any(m["role"] == "tool" and m["content"].startswith("Error:") for m in malformed.messages)
    # the broken call costs as much as a real one: 1 - 0.05 (cat) - 0.05 (the broken call)
    assert malformed.penalties == {"tool_calls": pytest.approx(0.05), "malformed_calls": pytest.approx(0.05)}
    assert malformed.reward == pytest.approx(0.9)
    # and it counts against the budget: one call allowed, the broken one used it
    assert over.status == "over_budget" and over.tool_calls == []


def test_the_sample_holds_every_call_the_model_wrote_with_its_turn(taught, world):
    items, corpus = world
    # The grader sees the calls as the model wrote them, each with its turn: those the loop ran
    # and the one it stopped on at the turn limit (graded like the rest; a checker such as BFCL's
    # judges what the model answered); a malformed call that parsed counts the same way.
    seen = {"type": "python", "name": "calls", "source": (
        "def grade(sample, item):\n"
        "    calls = [(c['turn'], c['function']['name']) for c in sample['output_tools']]\n"
        "    return 1.0 if calls == [(1, 'cat'), (2, 'list')] else 0.0\n")}
    settings = RolloutSettings(system_prompt=SYSTEM, temperature=0.0, max_new_tokens_per_turn=200, max_turns=2)
    with local_tool_endpoints(corpus) as endpoints:
        (record,) = _run(taught, world, endpoints=endpoints, settings=settings, items=[items[1]], grader=seen)
    assert record.status == "max_turns" and [c.name for c in record.tool_calls] == ["cat"]
    assert record.score == 1.0, record.grader_errors


def test_budget_stops_rollout_as_over_budget(taught, world):
    items, corpus = world
    settings = RolloutSettings(system_prompt=SYSTEM, temperature=0.0, max_episode_steps=3, over_budget_penalty=1.0)
    with local_tool_endpoints(corpus) as endpoints:
        (record,) = _run(taught, world, endpoints=endpoints, settings=settings, items=[items[1]])
    assert record.status == "over_budget"
    assert len(record.tool_calls) == 3
    assert record.score == 0.0
    assert record.reward == pytest.approx(-1.0)
    assert record.penalties == {"over_budget": 1.0}


def test_unreachable_tool_server_is_infra_error_not_a_score(taught, world):
    items, _ = world
    dead = [ToolEndpoint(name=n, server_url=f"http://127.0.0.1:9/tools/{n}") for n in ("search", "list", "cat", "calculator")]
    records = _run(taught, world, endpoints=dead, items=[items[3]])
    (record,) = records
    assert record.status == "infra_error"
    assert record.score is None and record.reward is None
    assert not record.trainable
    assert "attempt" in record.infra_error


def test_same_seed_same_rollouts_and_loss_mask_covers_generated_tokens(taught, world):
    model, tokenizer, _ = taught
    items, corpus = world
    with local_tool_endpoints(corpus) as endpoints:
        first = _run(taught, world, endpoints=endpoints, temperature=1.0, seed=7, n=2)
        again = _run(taught, world, endpoints=endpoints, temperature=1.0, seed=7, n=2)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert [r.final_answer for r in first] == [r.final_answer for r in again]
    for record in first:
        assert len(record.token_ids) == len(record.gen_mask) == len(record.logprobs)
        generated = [t for t, m in zip(record.token_ids, record.gen_mask, strict=True) if m]
        context = [t for t, m in zip(record.token_ids, record.gen_mask, strict=True) if not m]
        assert len(generated) == record.tokens_generated
        # every tool output reached the model as context, never as sampled tokens
        context_text = tokenizer.decode(context)
        for call in record.tool_calls:
            assert call.output in context_text
        # the sampled tokens' log-probabilities are real (negative) numbers, context is 0
        assert all(lp <= 0.0 for lp in record.logprobs)
        assert all(lp == 0.0 for lp, m in zip(record.logprobs, record.gen_mask, strict=True) if not m)
        # the mask is exact: generated tokens re-scored by the model give the same logprobs
        ids = torch.tensor([record.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(record.gen_mask[1:], dtype=torch.bool)
        expected = torch.tensor(record.logprobs[1:])[mask]
        assert torch.allclose(logp[mask], expected, atol=1e-4)


def test_a_turn_gets_the_context_left_and_a_rollout_stops_when_too_little_is(taught, world):
    from trainer.rollout.loop import MIN_TURN_TOKENS

    items, corpus = world
    base = RolloutSettings(system_prompt=SYSTEM, temperature=0.0, max_new_tokens_per_turn=200)
    with local_tool_endpoints(corpus) as endpoints:
        (full,) = _run(taught, world, endpoints=endpoints, items=[items[3]], settings=base)
        prompt = full.gen_mask.index(1)
        first_turn = full.gen_mask[prompt:].index(0)
        assert first_turn > MIN_TURN_TOKENS + 8  # a tool-call turn, long enough to be cut
        room = MIN_TURN_TOKENS + 4
        tight = dataclasses.replace(base, max_total_tokens=prompt + room)
        (cut,) = _run(taught, world, endpoints=endpoints, items=[items[3]], settings=tight)
        none = dataclasses.replace(base, max_total_tokens=prompt + MIN_TURN_TOKENS - 1)
        (stopped,) = _run(taught, world, endpoints=endpoints, items=[items[3]], settings=none)
    assert full.status == "ok" and full.score == 1.0
    # the first turn had only `room` tokens left under a 200-token turn limit: it got all
    # of them (the same tokens as without the limit, cut), and the rollout then stopped
    assert cut.tokens_generated == room and len(cut.token_ids) == prompt + room
    assert cut.token_ids == full.token_ids[: prompt + room]
    # a cut turn is neither a call nor an answer: the rollout ends as truncated
    assert cut.status == "truncated" and cut.finish_reasons == ["length"] and cut.truncated and cut.score == 0.0
    # with fewer than MIN_TURN_TOKENS left, no turn starts at all
    assert stopped.status == "max_turns" and stopped.tokens_generated == 0 and stopped.turns == 0


def test_a_rollout_waiting_for_a_slot_starts_when_the_last_ones_end_in_one_step(taught, world):
    """More rollouts than slots: the third waits in the engine's queue. When the two in the
    slots end in the same step (same prompt, greedy, no prefix cache to stagger them), the
    driver has nothing generating; their release must wake it, or the third waits forever
    (seen in CI as a 600 s hang)."""
    items, corpus = world
    settings = RolloutSettings(system_prompt=SYSTEM, temperature=0.0, max_new_tokens_per_turn=6)

    def bounded(*args, **kwargs):
        import threading

        out: list = []
        worker = threading.Thread(target=lambda: out.append(_run(*args, **kwargs)), daemon=True)
        worker.start()
        worker.join(timeout=120)
        assert not worker.is_alive(), "the queued rollout never started: the driver slept"
        return out[0]

    with local_tool_endpoints(corpus) as endpoints:
        records = bounded(taught, world, endpoints=endpoints, items=[items[0]], settings=settings, n=3,
                          max_slots=2, prefix_cache_tokens=0)
    assert [r.sample_index for r in records] == [0, 1, 2]
    assert all(r.status == "truncated" and r.tokens_generated == 6 for r in records)
    assert len({tuple(r.token_ids) for r in records}) == 1  # greedy: the same turn, ended in the same step
