"""The generation engine against plain full-sequence forwards of random-init tiny models.

The engine keeps each sequence's KV cache across turns and batches sequences of different
lengths; a full forward of the same tokens from scratch is the ground truth for its logits.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from trainer.errors import ConfigError
from trainer.generation.backend import SamplingParams, TurnOutput
from trainer.generation.engine import TransformersBackend
from trainer.generation.kv_cache import prefix_block_keys
from trainer.generation.sampling import (
    generate_all,
    sample_tokens,
    sequence_generator,
    sequential_generate,
)

VOCAB = 300


def tiny_qwen3(**overrides) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        **overrides,
    )
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # Tiny matmuls gain nothing from threads, and on a loaded machine their spin-waits cost 10x.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def qwen3() -> Qwen3ForCausalLM:
    return tiny_qwen3()


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def full_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def check_turn_against_full_forward(
    model: torch.nn.Module, context: list[int], turn: TurnOutput, temperature: float = 1.0
) -> None:
    """The logits of each sampled step, and the logprobs, equal a full forward of the context."""
    n = len(turn.token_ids)
    expected = full_logits(model, context + turn.token_ids)[len(context) - 1 : len(context) - 1 + n]
    torch.testing.assert_close(turn.logits, expected, atol=1e-4, rtol=0)
    logprobs = torch.log_softmax(expected / temperature, -1)
    expected_lp = logprobs.gather(1, torch.tensor(turn.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(turn.logprobs), expected_lp, atol=1e-4, rtol=0)
    assert turn.seq_len == len(context) + n


def drive(backend: TransformersBackend, n_turns: int) -> list[TurnOutput]:
    """Step until `n_turns` turns are returned."""
    got: list[TurnOutput] = []
    for _ in range(10_000):
        got += backend.step()
        if len(got) >= n_turns:
            return got
    raise AssertionError("the engine stopped making progress")


@pytest.mark.parametrize("gap_fill_factor", [2.0, 0.0], ids=["gap-rows-filled", "rows-gathered"])
def test_logits_match_full_forward_across_turns_joins_and_leaves(qwen3, gap_fill_factor):
    # 3 slots for 5 sequences: two queue; chunked, budget-split prefill; tools of different
    # latencies (sequences idle while others decode); one sequence leaves early and its slot goes
    # to a queued one, so rows are non-consecutive: decoded over the span with gap rows filled,
    # or (factor 0) read through the gather path.
    backend = TransformersBackend(
        qwen3, stop_token_ids=[], max_slots=3, max_len=512, prefill_chunk=16, max_prefill_tokens=40
    )
    backend.gap_fill_factor = gap_fill_factor
    params = SamplingParams(temperature=1.0, max_new_tokens=9, return_logits=True)
    contexts = {f"s{i}": random_ids(7 + 13 * i, seed=i) for i in range(5)}
    turns_left = {"s0": 1, "s1": 3, "s2": 3, "s3": 2, "s4": 2}
    tool_latency = {"s0": 0, "s1": 1, "s2": 4, "s3": 0, "s4": 2}  # in steps
    for seq_id, ids in contexts.items():
        backend.submit(seq_id, ids, params)
    due: dict[str, tuple[int, list[int]]] = {}
    checked = 0
    step = 0
    while backend.has_work() or due:
        step += 1
        assert step < 2000
        for seq_id, (at, tool_ids) in list(due.items()):
            if at <= step:
                backend.submit(seq_id, tool_ids, params)
                del due[seq_id]
        for turn in backend.step():
            check_turn_against_full_forward(qwen3, contexts[turn.seq_id], turn)
            checked += 1
            contexts[turn.seq_id] += turn.token_ids
            turns_left[turn.seq_id] -= 1
            if turns_left[turn.seq_id] == 0:
                backend.release(turn.seq_id)
            else:
                tool_ids = random_ids(3 + 11 * turns_left[turn.seq_id], seed=100 + step)
                contexts[turn.seq_id] += tool_ids
                due[turn.seq_id] = (step + tool_latency[turn.seq_id], tool_ids)
    assert checked == 11
    assert backend.cache.capacity[0] == 3  # never more rows than slots
    assert (backend.gap_filled_steps > 0) == (gap_fill_factor > 0)


def test_same_seed_same_tokens_whatever_the_batch(qwen3):
    params = SamplingParams(temperature=1.0, max_new_tokens=20)
    prompt = random_ids(30, seed=1)

    alone = generate_all(
        TransformersBackend(qwen3, stop_token_ids=[], seed=7), {"a": prompt}, params
    )
    crowd_prompts = {
        "x": random_ids(50, 2),
        "a": prompt,
        "y": random_ids(9, 3),
        "z": random_ids(70, 4),
    }
    crowd = generate_all(
        TransformersBackend(qwen3, stop_token_ids=[], seed=7), crowd_prompts, params
    )
    other_seed = generate_all(
        TransformersBackend(qwen3, stop_token_ids=[], seed=8), {"a": prompt}, params
    )

    assert alone["a"].token_ids == crowd["a"].token_ids
    torch.testing.assert_close(alone["a"].logprobs, crowd["a"].logprobs, atol=1e-5, rtol=0)
    assert other_seed["a"].token_ids != alone["a"].token_ids
    # the reference (no batching, no cache across turns) draws the same tokens from the same stream
    reference = sequential_generate(qwen3, prompt, params, [], sequence_generator(7, "a"))
    assert reference.token_ids == alone["a"].token_ids
    torch.testing.assert_close(reference.logprobs, alone["a"].logprobs, atol=1e-4, rtol=0)


def test_multi_turn_matches_sequential_reference_with_threaded_submits(qwen3):
    # Tools finish on another thread while the driver keeps stepping.
    params = SamplingParams(temperature=0.8, top_k=50, max_new_tokens=8)
    backend = TransformersBackend(qwen3, stop_token_ids=[], max_slots=4, seed=3)
    prompts = {f"r{i}": random_ids(20 + 5 * i, seed=10 + i) for i in range(4)}
    tools = {
        seq_id: [random_ids(6, seed=20 + i), random_ids(4, seed=30 + i)]
        for i, seq_id in enumerate(prompts)
    }
    turns: dict[str, list[list[int]]] = {seq_id: [] for seq_id in prompts}

    def run_tool(seq_id: str, ids: list[int], delay: float) -> None:
        time.sleep(delay)
        backend.submit(seq_id, ids, params)

    threads = []
    for seq_id, ids in prompts.items():
        backend.submit(seq_id, ids, params)
    while sum(len(t) for t in turns.values()) < 12:
        for turn in backend.step():
            assert turn.finish_reason == "length"
            done = turns[turn.seq_id]
            done.append(turn.token_ids)
            if len(done) < 3:
                delay = 0.002 * (len(threads) % 3)
                thread = threading.Thread(
                    target=run_tool, args=(turn.seq_id, tools[turn.seq_id][len(done) - 1], delay)
                )
                thread.start()
                threads.append(thread)
        if not backend.has_work():
            time.sleep(0.001)
    for thread in threads:
        thread.join()

    for seq_id, prompt in prompts.items():
        generator = sequence_generator(3, seq_id)
        context = list(prompt)
        for turn_ids, tool_ids in zip(turns[seq_id], [*tools[seq_id], []], strict=True):
            expected = sequential_generate(qwen3, context, params, [], generator)
            assert expected.token_ids == turn_ids
            context += turn_ids + tool_ids


def test_stop_token_ends_turn_and_next_turn_continues_after_it(qwen3):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, return_logits=True)
    prompt = random_ids(25, seed=5)
    free_run = generate_all(TransformersBackend(qwen3, stop_token_ids=[]), {"g": prompt}, greedy)[
        "g"
    ]
    stop = free_run.token_ids[3]
    first = free_run.token_ids.index(stop)

    backend = TransformersBackend(qwen3, stop_token_ids=[stop])
    backend.submit("g", prompt, greedy)
    (turn,) = drive(backend, 1)
    assert turn.finish_reason == "stop"
    assert turn.token_ids == free_run.token_ids[: first + 1]
    # greedy logprobs are at T = 1
    check_turn_against_full_forward(qwen3, prompt, turn)

    backend.submit(
        "g", [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=4, return_logits=True)
    )
    (turn2,) = drive(backend, 1)
    check_turn_against_full_forward(qwen3, prompt + turn.token_ids + [1, 2, 3], turn2)


def test_each_token_is_encoded_once_across_turns(qwen3):
    # Keeping the KV cache means a turn pre-fills only what was appended: over a whole rollout the
    # engine writes each token of the context to the cache exactly once.
    backend = TransformersBackend(qwen3, stop_token_ids=[], prefill_chunk=7)
    written: list[int] = []
    hook = qwen3.register_forward_hook(
        lambda *_: written.append(backend.cache.plan.write_pos.numel())
    )
    try:
        params = SamplingParams(max_new_tokens=5)
        context = random_ids(30, 1)
        backend.submit("a", context, params)
        for turn_no in range(4):
            (turn,) = drive(backend, 1)
            context += turn.token_ids
            if turn_no < 3:
                backend.submit("a", [4, 5, 6, 7], params)
                context += [4, 5, 6, 7]
    finally:
        hook.remove()
    assert sum(written) == len(context) - 1  # the last sampled token is not fed yet
    assert backend._seqs["a"].length == len(context) - 1


def test_max_new_tokens_gives_length(qwen3):
    out = generate_all(
        TransformersBackend(qwen3, stop_token_ids=[]),
        {"a": random_ids(10, 1)},
        SamplingParams(max_new_tokens=5),
    )["a"]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == len(out.logprobs) == 5


def test_max_len_gives_context(qwen3):
    backend = TransformersBackend(qwen3, stop_token_ids=[], max_len=26)
    params = SamplingParams(max_new_tokens=100, return_logits=True)
    prompt = random_ids(20, 2)
    backend.submit("a", prompt, params)
    (turn,) = drive(backend, 1)
    assert turn.finish_reason == "context"
    assert len(turn.token_ids) == 6 and turn.seq_len == 26
    check_turn_against_full_forward(qwen3, prompt, turn)
    # appended tokens that cannot fit are refused, not appended
    backend.submit("a", [1, 2], params)
    (turn,) = drive(backend, 1)
    assert (turn.finish_reason, turn.token_ids, turn.seq_len) == ("context", [], 26)
    # a prompt that leaves no room for a token
    backend.submit("b", random_ids(26, 3), params)
    (turn,) = drive(backend, 1)
    assert (turn.seq_id, turn.finish_reason, turn.token_ids) == ("b", "context", [])


def test_logprobs_at_sampling_temperature_and_truncation(qwen3):
    params = SamplingParams(
        temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12, return_logits=True
    )
    prompt = random_ids(15, 4)
    turn = generate_all(TransformersBackend(qwen3, stop_token_ids=[]), {"a": prompt}, params)["a"]
    check_turn_against_full_forward(qwen3, prompt, turn, temperature=0.7)
    top20 = turn.logits.topk(20, dim=-1).indices
    assert all(tok in top20[i].tolist() for i, tok in enumerate(turn.token_ids))


def test_sample_tokens_respects_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.6), SamplingParams()]
    seen: list[set[int]] = [set(), set(), set()]
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    for _ in range(400):
        tokens, logprobs = sample_tokens(logits, params, generators)
        for row, token in enumerate(tokens):
            seen[row].add(token)
        assert logprobs == pytest.approx(
            torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[tokens].tolist()
        )
    assert seen == [{0, 1}, {0, 1}, {0, 1, 2, 3}]


def test_release_frees_slots_for_queued_sequences(qwen3):
    backend = TransformersBackend(qwen3, stop_token_ids=[], max_slots=2)
    params = SamplingParams(max_new_tokens=3)
    for i in range(3):
        backend.submit(f"q{i}", random_ids(10 + i, i), params)
    first = drive(backend, 2)
    assert {t.seq_id for t in first} == {"q0", "q1"}
    assert not backend.has_work()  # q2 waits for a slot; q0 and q1 are idle, keeping theirs

    with pytest.raises(ValueError, match="generating"):
        backend.submit("q2", [1], params)
    backend.release("q0")
    with pytest.raises(KeyError):
        backend.release("q0")
    assert backend.has_work()
    (turn,) = drive(backend, 1)
    assert turn.seq_id == "q2"
    assert backend._seqs["q2"].slot == 0  # q0's slot, reused
    assert backend.cache.capacity[0] == 2

    with pytest.raises(RuntimeError, match="release"):
        generate_all(backend, {"m": [1, 2]}, params)  # both slots held by idle q1 and q2
    backend.release("m")
    backend.release("q1")
    backend.release("q2")
    many = generate_all(backend, {f"m{i}": random_ids(5, 50 + i) for i in range(5)}, params)
    assert sorted(many) == [f"m{i}" for i in range(5)]
    assert all(len(t.token_ids) == 3 for t in many.values())


def test_release_drops_turn_in_flight(qwen3):
    backend = TransformersBackend(qwen3, stop_token_ids=[])
    backend.submit("a", random_ids(10, 1), SamplingParams(max_new_tokens=50))
    backend.step()
    backend.release("a")
    assert backend.step() == []
    assert not backend.has_work()


def test_llama_with_eager_attention_matches_full_forward():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).eval()
    backend = TransformersBackend(model, stop_token_ids=[], max_slots=2)
    params = SamplingParams(max_new_tokens=6, return_logits=True)
    contexts = {"a": random_ids(12, 1), "b": random_ids(31, 2)}
    for seq_id, ids in contexts.items():
        backend.submit(seq_id, ids, params)
    for _ in range(2):
        for turn in drive(backend, 2):
            check_turn_against_full_forward(model, contexts[turn.seq_id], turn)
            contexts[turn.seq_id] += turn.token_ids + [7, 8, 9]
            backend.submit(turn.seq_id, [7, 8, 9], params)


def test_sliding_window_layers_match_full_forward():
    model = tiny_qwen3(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert "sliding_attention" in model.config.layer_types
    backend = TransformersBackend(model, stop_token_ids=[], prefill_chunk=5)
    params = SamplingParams(max_new_tokens=10, return_logits=True)
    prompts = {"a": random_ids(20, 1), "b": random_ids(6, 2)}
    out = generate_all(backend, prompts, params)
    for seq_id, turn in out.items():
        check_turn_against_full_forward(model, prompts[seq_id], turn)


def test_rejects_flash_attention_and_bad_params(qwen3):
    qwen3.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ConfigError, match="sdpa"):
            TransformersBackend(qwen3, stop_token_ids=[])
    finally:
        qwen3.config._attn_implementation = "sdpa"
    backend = TransformersBackend(qwen3, stop_token_ids=[])
    backend.submit("a", [1, 2], SamplingParams())
    qwen3.train()
    try:
        with pytest.raises(RuntimeError, match="eval"):
            backend.step()
    finally:
        qwen3.eval()
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=0)
    backend = TransformersBackend(qwen3, stop_token_ids=[])
    with pytest.raises(ValueError, match="vocabulary"):
        backend.submit("a", [VOCAB], SamplingParams())


def grouped_prompts(shared: int, own: int, items: int, group: int) -> dict[str, list[int]]:
    """`items` prompts that begin with the same `shared` tokens, each sampled `group` times."""
    head = random_ids(shared, seed=7)
    return {f"i{i}-{g}": head + random_ids(own + i, seed=20 + i) for i in range(items) for g in range(group)}


def run_groups(model, prompts: dict[str, list[int]], *, prefix_cache_tokens: int, turns: int = 2,
               temperature: float = 0.0, **kwargs) -> tuple[dict[str, list[list[int]]], TransformersBackend]:
    """Every prompt through `turns` turns (each later turn appends the same tool tokens); the
    sampled tokens of each turn, by sequence."""
    backend = TransformersBackend(model, stop_token_ids=[], max_len=1024, prefix_cache_tokens=prefix_cache_tokens,
                                  **kwargs)
    params = SamplingParams(temperature=temperature, max_new_tokens=6, return_logits=True)
    contexts = {seq_id: list(ids) for seq_id, ids in prompts.items()}
    tokens: dict[str, list[list[int]]] = {seq_id: [] for seq_id in prompts}
    for seq_id, ids in prompts.items():
        backend.submit(seq_id, ids, params)
    for turn in range(turns):
        for out in drive(backend, len(prompts)):
            check_turn_against_full_forward(model, contexts[out.seq_id], out, temperature=temperature or 1.0)
            contexts[out.seq_id] += out.token_ids
            tokens[out.seq_id].append(out.token_ids)
            if turn + 1 < turns:
                tool = random_ids(5, seed=turn)
                contexts[out.seq_id] += tool
                backend.submit(out.seq_id, tool, params)
    return tokens, backend


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prefix_cache_gives_the_same_tokens_and_saves_the_shared_prompt(qwen3, temperature):
    # 3 items of 4 samples, sharing a 40-token head: the first sample pre-fills, the others copy.
    prompts = grouped_prompts(40, 21, items=3, group=4)
    shared, backend = run_groups(qwen3, prompts, prefix_cache_tokens=4096, temperature=temperature)
    unshared, plain = run_groups(qwen3, prompts, prefix_cache_tokens=0, temperature=temperature)
    assert shared == unshared
    stats = backend.prefix_stats()
    assert stats["prompt_tokens"] == sum(len(p) for p in prompts.values())
    # each prompt's whole blocks short of its last token: 3 blocks of the 61-63 tokens; the
    # first item's first sample computes them, each other item its own 3rd block (the 2 of the
    # shared head hit), each other sample all 3
    assert stats["hit_tokens"] == 16 * (3 * 3 * 3 + 2 * 2)
    assert plain.prefix_stats()["hit_tokens"] == 0 and plain.prefix_stats()["bytes"] == 0
    assert stats["bytes"] > 0 and stats["evicted_blocks"] == 0


def test_prefix_cache_is_bounded_and_evicts_the_least_recently_used(qwen3):
    # Room for 4 blocks (79 tokens round down to 4 blocks of 16): item 0's 3 blocks, then
    # items 1 and 2 each their third (the head's 2 are shared): item 2's evicts item 0's
    # third, the least recently used block and the end of its chain.
    prompts = grouped_prompts(40, 21, items=3, group=2)
    bounded, backend = run_groups(qwen3, prompts, prefix_cache_tokens=4 * 16 + 15)
    unshared, _ = run_groups(qwen3, prompts, prefix_cache_tokens=0)
    assert bounded == unshared
    stats = backend.prefix_stats()
    assert stats["evicted_blocks"] == 1
    keys = {seq_id: prefix_block_keys(ids, 3) for seq_id, ids in prompts.items()}
    assert set(backend.cache.prefix.rows) == {*keys["i1-0"], *keys["i2-0"]}
    # the second samples of items 1 and 2 copied all 3 blocks; item 0's second copied before
    assert stats["hit_tokens"] == 16 * (3 + 2 + 3 + 2 + 3)
    layers, kv_heads, head_dim = 2, 2, 16
    assert stats["bytes"] == 4 * 16 * layers * 2 * kv_heads * head_dim * 4  # float32 keys and values


def test_prefix_cache_on_sliding_window_layers_and_chunked_prefill():
    model = tiny_qwen3(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    prompts = grouped_prompts(50, 30, items=2, group=3)
    shared, backend = run_groups(model, prompts, prefix_cache_tokens=4096, prefill_chunk=16, max_prefill_tokens=48)
    unshared, _ = run_groups(model, prompts, prefix_cache_tokens=0, prefill_chunk=16, max_prefill_tokens=48)
    assert shared == unshared
    assert backend.prefix_stats()["hit_tokens"] > 0


@pytest.mark.parametrize("tokens", [0, 32, 8192])
def test_rollout_prefix_cache_tokens_bounds_the_trainers_engine(qwen3, tokens):
    from tests.trainer.test_config import MINIMAL
    from trainer.config.loading import config_from_dict
    from trainer.rollout.generators import RolloutContext

    config = config_from_dict({**MINIMAL, "rollout": {"prefix_cache_tokens": tokens}})
    context = RolloutContext(chat=None, config=config, endpoints=[], settings=None, stop_token_ids=[])
    backend = context.engine(qwen3, seed=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=2)
    prompts = grouped_prompts(40, 21, items=1, group=3)
    for seq_id, ids in prompts.items():
        backend.submit(seq_id, ids, params)
    drive(backend, len(prompts))
    # the prompt's 3 whole blocks, as many as the bound holds, copied by the 2 later samples
    assert backend.prefix_stats()["hit_tokens"] == 2 * 16 * min(3, tokens // 16)
