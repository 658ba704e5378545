"""The agent loop: many rollouts at once, tools called while other rollouts decode.

A rollout renders its first prompt with the model's chat format (trainer/chat_formats:
the tokenizer's template and the tool schemas), generates one assistant turn, parses it in
the family's syntax (reasoning, content, tool calls), runs the calls of that turn
concurrently through the tool client, appends the ids of the `tool` messages and the next
generation prompt to the ids it sampled (never re-tokenising them) and continues, until a
final answer (a turn without tool calls), the tool-call budget (`max_episode_steps`), the
turn limit, a turn cut short or a malformed call.

The rules a rollout lives by, and why (`RolloutSettings`):
- A malformed call (a `<tool_call>` block that does not parse, an unknown tool, arguments
  that fail the tool's schema) ends the rollout by default (`on_malformed_call: end`, what
  TRL does): it is graded on what it has, so a broken call never buys a cheaper right
  answer, and the model does not spend turns in a context it never saw. The grader's
  `sample.output_tools` holds every call the model wrote, with its turn, the ones not run
  included (a malformed call that parsed, a call past the budget or the turn limit). With `feedback`
  the error is answered like a 4xx, the call counts against `max_episode_steps` and it is
  charged at least the price of any real call. Malformed calls are counted in every mode.
- A turn cut by `max_new_tokens_per_turn` or the context (finish_reason `length`) ends
  the rollout with status `truncated`; its cut text is neither a call nor an answer. The
  trainer leaves such rollouts out of the loss (`training.mask_truncated`) or charges
  DAPO's soft overlong penalty.
- Every turn records its finish_reason: `tool_calls`, `stop` (a final answer) or `length`.

All rollouts share one generation backend. Each rollout is an asyncio task; the driver
loop hands the backend's `step()` (one prefill/decode iteration over every live sequence)
to a worker thread, so HTTP tool calls of waiting rollouts proceed while the others keep
decoding: a rollout that waits on a tool leaves the batch and rejoins with only the tool
output's tokens to pre-fill, because the backend keeps its KV cache across turns.

Every rollout yields a `RolloutRecord` (docs/architecture.md) with its `trace_id` (the same for all
tool calls of the rollout), its status, score, reward and penalties, and, for training,
the token ids, the mask of model-generated tokens and their sampling log-probabilities.
Infrastructure failures mark the rollout `infra_error` and leave `score` as None: they
are never a score of 0. A grader that cannot run leaves `score` None too, with its error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from trainer.chat_formats import ChatFormat, ParsedToolCall, ParsedTurn, assistant_message
from trainer.errors import InfraError
from trainer.generation.backend import GenerationBackend, SamplingParams, TurnOutput
from trainer.graders import grade_async, sample_from_text
from trainer.rollout.record import (
    RolloutRecord,
    RolloutSettings,
    ToolCallRecord,
    check_tool_call_costs,
    compute_reward,
)
from trainer.rollout.tool_client import ToolClient
from trainer.wire import new_trace_id

MIN_TURN_TOKENS = 32  # a turn with fewer tokens of context left than this ends the rollout


class _Driver:
    """Owns the backend: applies submissions between steps and wakes waiting rollouts."""

    def __init__(self, backend: GenerationBackend):
        self.backend = backend
        self.waiting: dict[str, asyncio.Future[TurnOutput]] = {}
        self.queue: list[tuple[str, list[int], SamplingParams]] = []
        self.wake = asyncio.Event()
        self.closed = False

    def turn(self, seq_id: str, append_ids: list[int], params: SamplingParams) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.waiting[seq_id] = future
        self.queue.append((seq_id, append_ids, params))
        self.wake.set()
        return future

    def release(self, seq_id: str) -> None:
        """Free the sequence's slot and wake the driver: a sequence queued for a slot (more
        rollouts than slots) starts only at a step, and the driver sleeps when nothing else
        is generating."""
        self.backend.release(seq_id)
        self.wake.set()

    async def run(self) -> None:
        while not self.closed:
            for seq_id, append_ids, params in self.queue:
                self.backend.submit(seq_id, append_ids, params)
            self.queue.clear()
            if not self.backend.has_work():
                self.wake.clear()
                await self.wake.wait()
                continue
            outputs = await asyncio.to_thread(self.backend.step)
            for output in outputs:
                future = self.waiting.pop(output.seq_id, None)
                if future is not None and not future.done():
                    future.set_result(output)


async def _one_rollout(
    driver: _Driver,
    chat: ChatFormat,
    item: dict[str, Any],
    sample_index: int,
    *,
    tools: list[dict[str, Any]],
    tool_client: ToolClient,
    grader: dict[str, Any],
    settings: RolloutSettings,
    slots: asyncio.Semaphore,
    policy_version: int,
) -> RolloutRecord:
    item_id = str(item["id"])
    seq_id = f"{item_id}#{sample_index}"
    messages: list[dict[str, Any]] = []
    if settings.system_prompt:
        messages.append({"role": "system", "content": settings.system_prompt})
    messages.extend(m for m in item["messages"] if m.get("role") != "system" or not settings.system_prompt)
    prompt_messages = len(messages)
    record = RolloutRecord(
        trace_id=new_trace_id(),
        item_id=item_id,
        sample_index=sample_index,
        messages=messages,
        tool_calls=[],
        final_answer="",
        status="max_turns",
        policy_version=policy_version,
    )
    params = SamplingParams(
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_new_tokens=settings.max_new_tokens_per_turn,
    )
    async with slots:
        started = time.perf_counter()
        record.started_at = time.time()
        append_ids = chat.prompt_ids(messages, tools)
        try:
            await _loop_turns(driver, chat, record, item, append_ids, params, tools, tool_client, settings, seq_id)
        finally:
            if record.token_ids:  # a sequence exists once its first turn was submitted
                driver.release(seq_id)
        record.latency_s = time.perf_counter() - started
    if record.status != "infra_error":
        await _grade(record, item, grader, prompt_messages)
        compute_reward(record, settings)
    return record


def _sort_calls(
    parsed: ParsedTurn, tool_client: ToolClient, item: dict[str, Any]
) -> tuple[list[ParsedToolCall], list[tuple[str, str]]]:
    """The turn's calls that can be sent, and its malformed ones as (tool_call_id, error):
    blocks that did not parse, unknown tools and arguments failing their schema."""
    valid: list[ParsedToolCall] = []
    malformed = [("invalid", f"Error: {error}") for error in parsed.errors]
    for call in parsed.tool_calls:
        mistake = tool_client.check_call(call.name, call.arguments, item=item)
        if mistake is None:
            valid.append(call)
        else:
            malformed.append((call.call_id, mistake[1]))
    return valid, malformed


async def _loop_turns(
    driver: _Driver,
    chat: ChatFormat,
    record: RolloutRecord,
    item: dict[str, Any],
    append_ids: list[int],
    params: SamplingParams,
    tools: list[dict[str, Any]],
    tool_client: ToolClient,
    settings: RolloutSettings,
    seq_id: str,
) -> None:
    messages = record.messages
    while True:
        # A turn gets the tokens left in the context, up to the per-turn limit; a rollout
        # stops when too few are left for a turn to say anything.
        room = settings.max_total_tokens - len(record.token_ids) - len(append_ids)
        if room < min(MIN_TURN_TOKENS, params.max_new_tokens):
            record.status = "max_turns"
            return
        record.token_ids.extend(append_ids)
        record.gen_mask.extend([0] * len(append_ids))
        record.logprobs.extend([0.0] * len(append_ids))
        turn_params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room))
        turn_started = time.perf_counter()
        output: TurnOutput = await driver.turn(seq_id, append_ids, turn_params)
        record.turn_seconds.append(time.perf_counter() - turn_started)
        record.token_ids.extend(output.token_ids)
        record.gen_mask.extend([1] * len(output.token_ids))
        record.logprobs.extend(output.logprobs)
        record.tokens_generated += len(output.token_ids)
        record.turn_tokens.append(len(output.token_ids))
        record.turns += 1
        parsed = chat.parse(output.token_ids, first_call_index=len(record.tool_calls) + record.malformed_tool_calls,
                            tools=tools)
        record.reasoning_tokens += parsed.reasoning_tokens
        if output.finish_reason != "stop":
            # Cut by the turn's token limit or the context: neither a call nor an answer,
            # kept whole as the text it is (a call cut mid-JSON stays visible, never lost).
            record.finish_reasons.append("length")
            messages.append({"role": "assistant", "content": chat.decode(output.token_ids)})
            record.status = "truncated"
            return
        assistant = assistant_message(parsed)
        if not parsed.tool_calls and not parsed.errors:
            record.finish_reasons.append("stop")
            messages.append(assistant)
            record.final_answer = parsed.content
            record.status = "ok"
            return
        record.finish_reasons.append("tool_calls")
        if parsed.errors:  # what the model wrote, whole: the call that did not parse is the thing to read
            assistant["content"] = chat.decode(output.token_ids)
        messages.append(assistant)
        valid, malformed = _sort_calls(parsed, tool_client, item)
        record.malformed_tool_calls += len(malformed)
        if malformed and settings.on_malformed_call == "end":
            record.status = "malformed_call"
            return
        if len(record.tool_calls) + record.malformed_tool_calls + len(valid) > settings.max_episode_steps:
            record.status = "over_budget"
            return
        if record.turns >= settings.max_turns:
            record.status = "max_turns"
            return
        n_done = len(messages)
        try:
            results = await tool_client.call_many(
                [(call.name, call.arguments, call.call_id) for call in valid],
                item=item,
                trace_id=record.trace_id,
            )
        except InfraError as exc:
            record.status = "infra_error"
            record.infra_error = str(exc)
            return
        for call, result in zip(valid, results, strict=True):
            record.tool_calls.append(
                ToolCallRecord(call.name, call.arguments, result.output, result.latency_s, result.error, call.call_id,
                               turn=record.turns)
            )
            messages.append({"role": "tool", "tool_call_id": call.call_id, "content": result.output})
        for call_id, error in malformed:  # feedback: answered like a 4xx, the model reads what went wrong
            messages.append({"role": "tool", "tool_call_id": call_id, "content": error})
        # The model sampled the end-of-turn token; the format writes what follows it (the
        # tool results, the next generation prompt) after the sampled ids.
        append_ids = chat.bridge_ids(messages, n_done, tools)


async def _grade(record: RolloutRecord, item: dict[str, Any], grader: dict[str, Any], prompt_messages: int) -> None:
    """The grader's sample: the final answer and every tool call the model wrote, in order, each
    with the assistant `turn` (1-based) that wrote it. Calls the loop did not run count too (a
    malformed call that parsed, a call past the budget or the turn limit): they are what the model
    answered, and a benchmark's checker judges what the model answered (BFCL's irrelevance
    categories fail any call at all). Blocks that did not parse as a call are not calls."""
    output_tools = []
    turn = 0
    for message in record.messages[prompt_messages:]:
        if message.get("role") != "assistant":
            continue
        turn += 1
        output_tools.extend({**call, "turn": turn} for call in message.get("tool_calls") or [])
    result = await grade_async(grader, sample_from_text(record.final_answer, output_tools), item,
                               trace_id=record.trace_id)
    record.score = result.reward
    record.grader_errors = dict(result.errors)
    record.sub_rewards = dict(result.sub_rewards)


async def run_rollouts_async(
    backend: GenerationBackend,
    chat: ChatFormat,
    items: Sequence[dict[str, Any]],
    *,
    n_per_item: int,
    tool_client: ToolClient,
    grader: dict[str, Any],
    settings: RolloutSettings,
    tools: list[dict[str, Any]] | None = None,
    max_concurrent: int = 64,
    policy_version: int = 0,
    progress: Any = None,
) -> list[RolloutRecord]:
    """Run `n_per_item` rollouts of every item; records come back grouped by item, in
    order (item 0 samples 0..n-1, item 1, ...). `progress(done, total)` hears of every
    finished rollout."""
    check_tool_call_costs(settings.tool_call_costs, items, "the items to roll out", tools)
    driver = _Driver(backend)
    driver_task = asyncio.create_task(driver.run())
    slots = asyncio.Semaphore(max_concurrent)
    total = len(items) * n_per_item
    done = 0

    async def tracked(job: Any) -> RolloutRecord:
        nonlocal done
        record = await job
        done += 1
        if progress is not None:
            progress(done, total)
        return record

    try:
        jobs = [
            tracked(_one_rollout(
                driver, chat, item, index,
                tools=tools if tools is not None else item.get("tools", []),
                tool_client=tool_client, grader=grader, settings=settings, slots=slots,
                policy_version=policy_version,
            ))
            for item in items
            for index in range(n_per_item)
        ]
        gathered = asyncio.gather(*jobs)
        done_tasks, _ = await asyncio.wait({gathered, driver_task}, return_when=asyncio.FIRST_COMPLETED)
        if driver_task in done_tasks:
            gathered.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gathered  # retrieved, so asyncio does not report it as never retrieved
            driver_task.result()  # re-raise the backend's failure
        return gathered.result()
    finally:
        driver.closed = True
        driver.wake.set()
        if not driver_task.done():
            await driver_task
