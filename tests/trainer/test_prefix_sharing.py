"""The engine's prefix cache on real models through the real agent loop: at temperature 0 the
rollouts (every token, tool call and answer) are the ones without it, on the demo model in the
FinQA world and on SmolLM2-135M on the units recipe's few-shot prompt, while most prompt
tokens come from the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench_prefix import demo_world, rollouts, units_world

pytestmark = pytest.mark.integration


def same_rollouts_with_and_without_the_cache(world, tmp_path: Path, *, items: int, k: int) -> float:
    """Run `items` x `k` greedy rollouts with the cache and without; the share of prompt tokens
    the cache gave."""
    from trainer.generation.policy import load_config_policy

    config, model_dir, all_items, tools = world(tmp_path)
    config.rollout.max_concurrent_rollouts = items * k
    policy = load_config_policy(config.model, str(model_dir), device="cpu", dtype="float32")
    with tools() as endpoints:
        runs = [rollouts(config, policy, all_items[:items], endpoints, k=k, seed=5, prefix_cache_tokens=tokens,
                         temperature=0.0) for tokens in (8192, 0)]
    (shared, backend, _), (unshared, plain, _) = runs
    assert [r.token_ids for r in shared] == [r.token_ids for r in unshared]
    assert [r.final_answer for r in shared] == [r.final_answer for r in unshared]
    assert [[c.output for c in r.tool_calls] for r in shared] == [[c.output for c in r.tool_calls] for r in unshared]
    for a, b in zip(shared, unshared, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert plain.prefix_stats()["hit_tokens"] == 0
    stats = backend.prefix_stats()
    # Each sample but the first copies the longest prefix it shares with an earlier prompt, in
    # whole blocks of 16 and short of its own last token (whose logits give its first token).
    prompts = [r.token_ids[: r.gen_mask.index(1)] for r in shared]
    expected = 0
    for i, prompt in enumerate(prompts):
        common = max((next((n for n, (a, b) in enumerate(zip(prompt, other, strict=False)) if a != b),
                           min(len(prompt), len(other))) for other in prompts[:i]), default=0)
        expected += min(common, len(prompt) - 1) // 16 * 16
    assert stats["prompt_tokens"] == sum(map(len, prompts)) and stats["hit_tokens"] == expected
    return stats["hit_tokens"] / stats["prompt_tokens"]


def test_demo_model_rollouts_are_the_same_with_the_prefix_cache(demo_data_dir, tmp_path):
    share = same_rollouts_with_and_without_the_cache(demo_world, tmp_path, items=2, k=3)
    # 2 of 3 samples copy their whole prompt but its last partial block; the two items share the
    # system prompt and the tool schemas
    assert share > 0.7


def test_smollm2_rollouts_are_the_same_with_the_prefix_cache(tmp_path):
    share = same_rollouts_with_and_without_the_cache(units_world, tmp_path, items=2, k=2)
    # 412 of the 427 tokens are the same for every item: 3 of the 4 samples copy 416, 400 and
    # 416 tokens of their 427 (1232 of 1708)
    assert share > 0.7
