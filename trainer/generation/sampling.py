"""Drawing tokens: one CPU generator per (seed, sequence), so a sequence's tokens do not
depend on the batch it shares or the device, plus plain reference generators the engine
is tested against."""

from __future__ import annotations

import hashlib
import inspect

import torch
from transformers.cache_utils import DynamicCache

from trainer.generation.backend import GenerationBackend, SamplingParams, TurnOutput


def sequence_generator(seed: int, seq_id: str) -> torch.Generator:
    """The CPU generator a sequence samples from: a function of (seed, seq_id) only."""
    digest = hashlib.sha256(f"{seed}\x00{seq_id}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Sample one token per row of `logits` ([rows, vocab], float32) and return the tokens and
    their log-probabilities under softmax(logits / temperature), before top-k/top-p truncation."""
    device, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([p.temperature or 1.0 for p in params], device=device)
    logprobs_all = torch.log_softmax(logits / temps[:, None], dim=-1)
    probs = logprobs_all.exp()

    # Truncate in the order of HF generate: top-k, then top-p of the renormalized remainder.
    # (Whether to truncate is decided from the params, in Python: no device sync.)
    top_k = [min(p.top_k or vocab, vocab) for p in params]
    if min(top_k) < vocab:
        kth_index = torch.tensor(top_k, device=device)[:, None] - 1
        kth = probs.topk(max(top_k), dim=-1).values.gather(1, kth_index)
        probs = probs.masked_fill(probs < kth, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if min(p.top_p for p in params) < 1:
        top_p = torch.tensor([p.top_p for p in params], device=device)
        sorted_probs = probs.sort(dim=-1, descending=True).values
        # keep a token while the mass before it is below top_p (the first token is always kept)
        n_keep = ((sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None]).sum(-1, keepdim=True)
        threshold = sorted_probs.gather(1, n_keep - 1)
        probs = probs.masked_fill(probs < threshold, 0.0)

    # Inverse CDF with one uniform per row from the row's own generator: the draw depends only on
    # the sequence's history, not on the batch. The first index whose CDF exceeds u has p > 0;
    # clamping to the last p > 0 guards against u * total rounding up to the total.
    uniforms = torch.tensor([float(torch.rand((), generator=g)) for g in generators])
    cdf = probs.cumsum(-1)
    target = uniforms.to(device)[:, None] * cdf[:, -1:]
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(1)
    last_positive = (probs > 0).cumsum(-1).argmax(-1)
    sampled = torch.minimum(sampled, last_positive)
    greedy = torch.tensor([p.temperature == 0 for p in params], device=device)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    logprobs = logprobs_all.gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), logprobs.tolist()


def _cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5 renamed the forward's `past_key_values` to `cache`; accept both spellings."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # unwrap PEFT
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def sequential_generate(
    model: torch.nn.Module,
    input_ids: list[int],
    params: SamplingParams,
    stop_token_ids: list[int],
    generator: torch.Generator,
) -> TurnOutput:
    """Reference: generate one turn for one sequence, encoding `input_ids` from scratch (the
    naive way a multi-turn loop re-encodes its whole context every turn). With the same
    generator it samples the same tokens as the engine, up to floating-point ties."""
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    cache_kw = _cache_kwarg(model)
    stops = set(stop_token_ids)
    feed = torch.tensor([input_ids], device=device)
    tokens: list[int] = []
    logprobs: list[float] = []
    logits_rows: list[torch.Tensor] = []
    finish_reason = "length"
    with torch.inference_mode():
        while len(tokens) < params.max_new_tokens:
            out = model(input_ids=feed, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
            logits = out.logits[:, -1].float()
            (token,), (logprob,) = sample_tokens(logits, [params], [generator])
            tokens.append(token)
            logprobs.append(logprob)
            if params.return_logits:
                logits_rows.append(logits[0].cpu())
            if token in stops:
                finish_reason = "stop"
                break
            feed = torch.tensor([[token]], device=device)
    return TurnOutput(
        seq_id="",
        token_ids=tokens,
        logprobs=logprobs,
        finish_reason=finish_reason,
        seq_len=len(input_ids) + len(tokens),
        logits=torch.stack(logits_rows) if params.return_logits else None,
    )


def generate_all(
    backend: GenerationBackend, prompts: dict[str, list[int]], params: SamplingParams
) -> dict[str, TurnOutput]:
    """Single-turn use: generate one turn for every prompt and release each sequence when done
    (so more prompts than slots simply queue)."""
    for seq_id, prompt in prompts.items():
        backend.submit(seq_id, prompt, params)
    results: dict[str, TurnOutput] = {}
    while len(results) < len(prompts):
        if not backend.has_work():
            raise RuntimeError(
                "generate_all: prompts wait for slots that idle sequences hold; release those first"
            )
        for turn in backend.step():
            results[turn.seq_id] = turn
            backend.release(turn.seq_id)
    return results
