"""string_check and text_similarity, with values computed by hand."""

from __future__ import annotations

import pytest

from trainer.graders import grade

ITEM = {"reference_answer": "the cat sat on a mat", "city": "Paris"}


def string_check(operation: str, reference: str = "{{item.city}}") -> dict:
    return {
        "type": "string_check",
        "name": "city",
        "operation": operation,
        "input": "{{sample.output_text}}",
        "reference": reference,
    }


@pytest.mark.parametrize(
    ("operation", "output", "reward"),
    [
        ("eq", "Paris", 1.0),
        ("eq", "paris", 0.0),  # case-sensitive
        ("eq", "Paris ", 0.0),  # nothing is stripped
        ("ne", "London", 1.0),
        ("ne", "Paris", 0.0),
        ("like", "The capital is Paris.", 1.0),
        ("like", "The capital is PARIS.", 0.0),
        ("ilike", "The capital is PARIS.", 1.0),
        ("ilike", "The capital is Lyon.", 0.0),
    ],
)
def test_string_check(operation: str, output: str, reward: float) -> None:
    result = grade(string_check(operation), {"output_text": output}, ITEM)
    assert result.to_json() == {"reward": reward, "errors": {}, "sub_rewards": {}}


def similarity(
    metric: str, output: str, reference: str = "{{item.reference_answer}}", **extra: object
) -> float | None:
    grader = {
        "type": "text_similarity",
        "name": metric,
        "input": "{{sample.output_text}}",
        "reference": reference,
        "evaluation_metric": metric,
        **extra,
    }
    return grade(grader, {"output_text": output}, ITEM).reward


HYPOTHESIS = "the cat sat on the mat"  # against the reference "the cat sat on a mat"


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        # Indel similarity 2 * LCS / (22 + 20 characters); the longest common subsequence
        # is "the cat sat on " (15) + "e mat" vs "a mat" -> " mat" (4) = 19
        ("fuzzy_match", 2 * 19 / 42),
        # n-gram precisions 5/6, 3/5, 2/4, 1/3; equal lengths, so no brevity penalty
        ("bleu", (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25),
        # GLEU: matching 1-4-grams 5 + 3 + 2 + 1 = 11 of 6 + 5 + 4 + 3 = 18 on both sides
        ("gleu", 11 / 18),
        # unigram overlap 5 of 6 on both sides
        ("rouge_1", 5 / 6),
        # bigram overlap 3 of 5
        ("rouge_2", 3 / 5),
        ("rouge_3", 2 / 4),
        ("rouge_4", 1 / 3),
        ("rouge_5", 0.0),  # the shared 5-grams: none ("the cat sat on a" != "the cat sat on the")
        # longest common subsequence "the cat sat on mat": 5 of 6
        ("rouge_l", 5 / 6),
    ],
)
def test_text_similarity_metrics(metric: str, expected: float) -> None:
    assert similarity(metric, HYPOTHESIS) == pytest.approx(expected)


def test_meteor_exact_and_stem_matching() -> None:
    # "the quick red fox jumps" vs "the quick brown fox jumps": 4 matches of 5 on both
    # sides, so P = R = F = 0.8; 2 chunks ("the quick", "fox jumps") -> fragmentation 2/4,
    # penalty 0.5 * 0.5^3 = 0.0625; METEOR = 0.8 * (1 - 0.0625) = 0.75
    assert similarity(
        "meteor", "the quick red fox jumps", "the quick brown fox jumps"
    ) == pytest.approx(0.75)
    # "cats" matches "cat" through the Porter stem: 3 matches in 1 chunk,
    # penalty 0.5 * (1/3)^3; METEOR = 1 - 1/54
    assert similarity("meteor", "the cats sat", "the cat sat") == pytest.approx(1 - 1 / 54)


def test_identical_and_empty_texts() -> None:
    for metric in ("fuzzy_match", "bleu", "gleu", "meteor", "rouge_1", "rouge_l"):
        # METEOR keeps a fragmentation penalty of 0.5 * (1 chunk / 3 matches)^3 even here
        perfect = 1 - 0.5 / 27 if metric == "meteor" else 1.0
        assert similarity(metric, "Net revenue rose", "Net revenue rose") == pytest.approx(
            perfect
        ), metric
        assert similarity(metric, "", "Net revenue rose") == 0.0, metric


def test_pass_threshold_decides_pass_not_the_reward() -> None:
    grader = {
        "type": "text_similarity",
        "input": "{{sample.output_text}}",
        "reference": "{{item.reference_answer}}",
        "evaluation_metric": "rouge_1",
        "pass_threshold": 0.8,
    }
    passing = grade(grader, {"output_text": HYPOTHESIS}, ITEM)
    assert passing.reward == pytest.approx(5 / 6) and passing.passed is True
    failing = grade({**grader, "pass_threshold": 0.9}, {"output_text": HYPOTHESIS}, ITEM)
    assert failing.reward == pytest.approx(5 / 6) and failing.passed is False


@pytest.mark.slow
def test_cosine_with_the_local_minilm_model() -> None:
    """Loads the bundled all-MiniLM-L6-v2 (offline); a few seconds on CPU."""
    same = similarity("cosine", "The cat sat on the mat.", "The cat sat on the mat.")
    close = similarity("cosine", "The cat sat on the mat.", "A cat was sitting on the mat.")
    unrelated = similarity(
        "cosine", "The cat sat on the mat.", "Quarterly revenue grew 12 percent."
    )
    assert same == pytest.approx(1.0, abs=1e-5)
    assert 0.85 < close < 1.0
    assert unrelated is not None and unrelated < 0.2
