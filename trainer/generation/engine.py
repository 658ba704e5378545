"""Batched multi-turn generation that keeps each sequence's KV cache across turns.

An agent rollout alternates between the model and tools: the model generates until a stop token
(end of turn), a tool runs for 0-100+ ms, its output is appended, and the model goes on. This
module is the token-level engine under that loop (no tokenizer, no tools, no HTTP):

- every sequence owns a *slot* of a fixed-capacity padded KV cache (`[slots, kv_heads, len,
  head_dim]` per layer) and keeps it until `release`, so a new turn only pre-fills the appended
  tokens: 8 turns cost about twice 4 turns, not four times;
- each `step()` decodes one token for every sequence that is generating, and pre-fills the
  appended tokens of sequences that were just (re)submitted, in a second forward call: sequences
  waiting on a tool simply are not in either call, and rejoin when `submit` gives their tokens
  (continuous batching);
- a new sequence starts from the prefix cache: its prompt's longest cached prefix (in whole
  blocks of 16 tokens: the system prompt, the tool schemas and demonstrations every item shares,
  or a whole prompt that a group's samples share) is copied into its slot, and only the rest is
  pre-filled. A prompt's first sequence pre-fills it and stores its blocks; the others that
  share the prefix wait for that (a step or two) instead of computing it again. The cache holds
  at most `prefix_cache_tokens` tokens of keys and values and evicts the least recently used
  blocks; `prefix_stats()` counts what it saved. The prompt's last token is always pre-filled
  (its logits give the first sample), and a later turn's pre-fill stays incremental, in the
  sequence's own slot;
- each row is written and read at its own positions: per-row `position_ids`, a 4-D additive
  attention mask over each row's valid keys, and a `transformers.Cache` subclass that scatters
  the new keys/values to `(slot, position)` and hands the attention the rows of this call;
- sampling draws one uniform number per token from a CPU `torch.Generator` seeded by
  `(seed, seq_id)` and inverts the CDF on the model's device, so a sequence's tokens do not
  depend on which other sequences share the batch, nor on the device;
- `logprobs` are `log_softmax(logits / temperature)` at the sampled token: the distribution at
  the sampling temperature, *before* top-k/top-p truncation (the trainer recomputes them from
  the same tokens with the same temperature). With temperature 0 (greedy) they are at T = 1.

Why not transformers' own continuous batching (`model.init_continuous_batching()`,
`generate_batch`, paged attention)? It runs on CPU and returns logprobs, and with prefix
sharing a turn re-submitted as prompt + generated + tool tokens reuses the cached pages
(full pages only). But it samples with one global RNG over the whole batch (a sequence's tokens
change with the batch it lands in), drives the model from its own background thread, and cached
pages may be evicted; its strengths (flash/paged kernels, CUDA graphs) matter for large models on
GPU. `GenerationBackend` is the seam where such a backend, or vLLM, can be added.

Thread use: `submit` and `release` may be called from any thread (an asyncio loop whose tools
finish while `step()` runs in a worker thread); they only queue commands that the next `step()`
applies. `step()` and `has_work()` belong to one driver thread.

The model must use `sdpa` or `eager` attention (the 4-D mask) and be in `eval()` mode.
After a weight update the cached keys/values (the prefix cache's too) are stale: start a new engine.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass, field

import torch

from trainer.errors import ConfigError
from trainer.generation.backend import GenerationBackend, SamplingParams, TurnOutput
from trainer.generation.kv_cache import PREFIX_BLOCK, SlotKVCache, _ForwardPlan, prefix_block_keys
from trainer.generation.sampling import _cache_kwarg, sample_tokens, sequence_generator


@dataclass
class _Sequence:
    seq_id: str
    epoch: int  # tells a released-and-resubmitted seq_id apart from the old one
    generator: torch.Generator
    params: SamplingParams
    pending: list[int]  # tokens to feed next (not yet in the cache)
    slot: int | None = None
    length: int = 0  # tokens whose keys/values are in the cache
    state: str = "queued"  # queued -> prefill -> decode -> idle -> prefill ...
    turn_tokens: list[int] = field(default_factory=list)
    turn_logprobs: list[float] = field(default_factory=list)
    turn_logits: list[torch.Tensor] = field(default_factory=list)
    # The prefix cache: the block keys of the prompt (set at its first pre-fill), the blocks this
    # sequence pre-fills for the cache (index, key), and cached rows to copy into its slot.
    block_keys: list[bytes] | None = None
    leading: list[tuple[int, bytes]] = field(default_factory=list)
    copy_rows: list[int] = field(default_factory=list)


class TransformersBackend(GenerationBackend):
    """The engine for a transformers causal LM (Qwen3, Llama, ... with sdpa or eager attention),
    on whatever device the model is on.

    max_slots: sequences holding a cache at once (an idle sequence waiting on a tool keeps its
    slot); more submissions queue until a release frees a slot. max_len: tokens per sequence.
    prefill_chunk: appended tokens pre-filled per sequence per step (longer appends take several
    steps, so decoding sequences are not stalled by one long prompt). max_prefill_tokens: padded
    tokens in one prefill forward call (bounds the activations and the mask).
    prefix_cache_tokens: tokens of prompt-prefix keys/values kept for new sequences to start
    from (0: none, every prompt pre-filled whole); memory is this times the model's keys and
    values per token (2 x layers x kv_heads x head_dim x dtype bytes).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        stop_token_ids: list[int],
        max_slots: int = 64,
        max_len: int = 4096,
        seed: int = 0,
        prefill_chunk: int = 512,
        max_prefill_tokens: int = 4096,
        prefix_cache_tokens: int = 8192,
    ):
        config = model.config
        attn = config._attn_implementation
        if attn not in ("sdpa", "eager"):
            raise ConfigError(
                f"the generation engine needs sdpa or eager attention, the model uses {attn!r}: "
                "load it with attn_implementation='sdpa'"
            )
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if not layer_types <= {"full_attention", "sliding_attention"}:
            raise ConfigError(
                f"the generation engine supports full and sliding-window attention layers, "
                f"the model has {sorted(layer_types)}"
            )
        for name, value in (
            ("max_slots", max_slots),
            ("max_len", max_len),
            ("prefill_chunk", prefill_chunk),
            ("max_prefill_tokens", max_prefill_tokens),
        ):
            if value < 1:
                raise ConfigError(f"generation engine {name} must be >= 1, got {value}")
        if prefix_cache_tokens < 0:
            raise ConfigError(f"generation engine prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        self.model = model
        self.device = next(model.parameters()).device
        self.stop_token_ids = frozenset(stop_token_ids)
        self.max_slots = max_slots
        self.max_len = max_len
        self.seed = seed
        self.prefill_chunk = prefill_chunk
        self.max_prefill_tokens = max_prefill_tokens
        self._vocab_size = config.vocab_size
        self._layer_types = layer_types
        self._sliding_window = getattr(config, "sliding_window", None)
        self._cache_kw = _cache_kwarg(model)
        self.cache = SlotKVCache(config.num_hidden_layers, max_slots, max_len, prefix_cache_tokens)
        self._inflight: dict[bytes, str] = {}  # prefix block -> the sequence pre-filling it now
        self.prefix_prompt_tokens = 0  # prompt tokens of the sequences started so far
        self.prefix_hit_tokens = 0  # of them, copied from the prefix cache

        # Shared with submit/release (any thread); everything else is owned by step().
        self._lock = threading.Lock()
        self._inbox: list[tuple[str, str, int, list[int], SamplingParams | None]] = []
        self._live: dict[str, int] = {}  # seq_id -> epoch, from submit to release
        self._busy: set[str] = set()  # submitted, turn not yet returned
        self._epochs = 0

        self._seqs: dict[str, _Sequence] = {}
        self._queue: list[_Sequence] = []  # waiting for a slot, FIFO
        self._free_slots = list(range(max_slots))  # a heap: lowest first keeps rows consecutive
        # A decode step over rows with gaps runs over the whole slot span (gap rows filled)
        # when the span is at most this many times the rows, else it gathers the rows.
        self.gap_fill_factor = 2.0
        self.gap_filled_steps = 0

    # -- public API ------------------------------------------------------------------------------

    def submit(self, seq_id: str, append_ids: list[int], params: SamplingParams) -> None:
        bad = [t for t in append_ids if not 0 <= t < self._vocab_size]
        if bad:
            raise ValueError(
                f"token ids out of the vocabulary (size {self._vocab_size}): {bad[:5]}"
            )
        with self._lock:
            if seq_id in self._busy:
                raise ValueError(f"sequence {seq_id!r} is generating; submit again after its turn")
            if seq_id not in self._live:
                if not append_ids:
                    raise ValueError(f"new sequence {seq_id!r} needs a non-empty prompt")
                self._epochs += 1
                self._live[seq_id] = self._epochs
            self._busy.add(seq_id)
            self._inbox.append(("submit", seq_id, self._live[seq_id], list(append_ids), params))

    def release(self, seq_id: str) -> None:
        with self._lock:
            if seq_id not in self._live:
                raise KeyError(f"unknown or already released sequence {seq_id!r}")
            epoch = self._live.pop(seq_id)
            self._busy.discard(seq_id)
            self._inbox.append(("release", seq_id, epoch, [], None))

    def has_work(self) -> bool:
        with self._lock:
            if self._inbox:
                return True
        return bool(
            any(s.state in ("prefill", "decode") for s in self._seqs.values())
            or (self._queue and self._free_slots)
        )

    def step(self) -> list[TurnOutput]:
        with self._lock:
            commands, self._inbox = self._inbox, []
        finished: list[tuple[int, TurnOutput]] = []
        for kind, seq_id, epoch, tokens, params in commands:
            if kind == "release":
                self._apply_release(seq_id, epoch)
            elif refused := self._apply_submit(seq_id, epoch, tokens, params):
                finished.append((epoch, refused))
        while self._queue and self._free_slots:
            seq = self._queue.pop(0)
            seq.slot = heapq.heappop(self._free_slots)
            seq.state = "prefill"

        decoding = [s for s in self._seqs.values() if s.state == "decode"]
        with torch.inference_mode():
            if decoding:
                finished += self._run(decoding, [s.pending for s in decoding])
            prefill, chunks = self._pick_prefill()
            if prefill:
                finished += self._run(prefill, chunks)
        return self._deliver(finished)

    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache now (it grows with the slots and lengths in use), the
        prefix cache's included."""
        return self.cache.nbytes() + self.cache.prefix.nbytes()

    def prefix_stats(self) -> dict[str, float]:
        """What the prefix cache saved: prompt tokens of the sequences started, those copied
        from the cache instead of pre-filled, the blocks evicted, the cache's bytes."""
        return {
            "prompt_tokens": self.prefix_prompt_tokens,
            "hit_tokens": self.prefix_hit_tokens,
            "evicted_blocks": self.cache.prefix.evicted_blocks,
            "bytes": self.cache.prefix.nbytes(),
        }

    # -- scheduling ------------------------------------------------------------------------------

    def _apply_submit(
        self, seq_id: str, epoch: int, tokens: list[int], params: SamplingParams
    ) -> TurnOutput | None:
        """Start the turn; or, if the tokens do not fit in max_len, return the refused turn."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = _Sequence(seq_id, epoch, sequence_generator(self.seed, seq_id), params, [])
        seq.params = params
        total = seq.length + len(seq.pending) + len(tokens)
        # +1: there must be room for at least one generated token
        if total + 1 > self.max_len:
            return TurnOutput(seq_id, [], [], "context", total - len(tokens))
        seq.pending = seq.pending + tokens  # after the last sampled token, not yet in the cache
        seq.turn_tokens, seq.turn_logprobs, seq.turn_logits = [], [], []
        if seq_id in self._seqs:
            seq.state = "prefill"
        else:
            self._seqs[seq_id] = seq
            self._queue.append(seq)
        return None

    def _apply_release(self, seq_id: str, epoch: int) -> None:
        seq = self._seqs.get(seq_id)
        if seq is None or seq.epoch != epoch:
            return
        del self._seqs[seq_id]
        self._drop_lead(seq)
        if seq.slot is None:
            self._queue.remove(seq)
        else:
            heapq.heappush(self._free_slots, seq.slot)

    def _pick_prefill(self) -> tuple[list[_Sequence], list[list[int]]]:
        """Sequences with appended tokens, in order, up to max_prefill_tokens padded tokens."""
        rows: list[_Sequence] = []
        chunks: list[list[int]] = []
        width = 0
        for seq in self._seqs.values():
            if seq.state != "prefill":
                continue
            pending, cached = seq.pending, None
            if seq.length == 0 and self.cache.prefix.enabled:
                cached = self._cached_prefix(seq)
                if cached is None:
                    continue  # another sequence is pre-filling its prefix now
                pending = pending[len(cached) * PREFIX_BLOCK :]
            chunk = pending[: self.prefill_chunk]
            new_width = max(width, len(chunk))
            if rows and new_width * (len(rows) + 1) > self.max_prefill_tokens:
                break
            if cached is not None:
                self._start_from_prefix(seq, cached)
            rows.append(seq)
            chunks.append(chunk)
            width = new_width
        return rows, chunks

    def _cached_prefix(self, seq: _Sequence) -> list[int] | None:
        """The prefix-cache rows of a new sequence's prompt's longest cached prefix; None (it
        waits) when another sequence is pre-filling the next block of that prefix now."""
        if seq.block_keys is None:
            # Whole blocks, short of the last token: its logits give the first sample.
            seq.block_keys = prefix_block_keys(seq.pending, (len(seq.pending) - 1) // PREFIX_BLOCK)
        keys = seq.block_keys
        rows = self.cache.prefix.match(keys)
        if len(rows) < len(keys) and keys[len(rows)] in self._inflight:
            return None
        return rows

    def _start_from_prefix(self, seq: _Sequence, rows: list[int]) -> None:
        """Start a new sequence from the cached blocks `rows` (copied into its slot by the
        next forward call); it pre-fills the rest of its prompt's blocks for the cache."""
        keys, hit = seq.block_keys, len(rows)
        for index in range(hit, len(keys)):
            if self._inflight.setdefault(keys[index], seq.seq_id) == seq.seq_id:
                seq.leading.append((index, keys[index]))
        self.prefix_prompt_tokens += len(seq.pending)
        self.prefix_hit_tokens += hit * PREFIX_BLOCK
        if hit:
            seq.copy_rows = rows
            seq.length = hit * PREFIX_BLOCK
            seq.pending = seq.pending[seq.length :]

    def _store_prefix(self, seq: _Sequence) -> None:
        """Put the blocks this sequence pre-fills for the cache there once they are in its slot."""
        done = [(index, key) for index, key in seq.leading if (index + 1) * PREFIX_BLOCK <= seq.length]
        if not done:
            return
        seq.leading = seq.leading[len(done) :]
        self.cache.store_prefix([seq.slot] * len(done), [i for i, _ in done], [k for _, k in done], seq.block_keys)
        for _, key in done:
            self._inflight.pop(key, None)

    def _drop_lead(self, seq: _Sequence) -> None:
        for _, key in seq.leading:
            if self._inflight.get(key) == seq.seq_id:
                del self._inflight[key]
        seq.leading = []

    # -- one forward call ------------------------------------------------------------------------

    def _run(self, rows: list[_Sequence], chunks: list[list[int]]) -> list[tuple[int, TurnOutput]]:
        """Feed each row its chunk, sample for the rows whose pending tokens are all in, and
        return the (epoch, turn) of the turns that ended."""
        order = sorted(range(len(rows)), key=lambda i: rows[i].slot)
        rows = [rows[i] for i in order]
        chunks = [chunks[i] for i in order]
        logits = self._forward(rows, chunks)
        sampling = [
            b for b, (s, c) in enumerate(zip(rows, chunks, strict=True)) if len(c) == len(s.pending)
        ]
        for seq, chunk in zip(rows, chunks, strict=True):
            seq.length += len(chunk)
            seq.pending = seq.pending[len(chunk) :]
            if seq.leading:
                self._store_prefix(seq)
        if not sampling:
            return []
        picked = logits[sampling]
        seqs = [rows[b] for b in sampling]
        tokens, logprobs = sample_tokens(
            picked, [s.params for s in seqs], [s.generator for s in seqs]
        )
        ended = []
        for b, (seq, token, logprob) in enumerate(zip(seqs, tokens, logprobs, strict=True)):
            seq.pending = [token]
            seq.turn_tokens.append(token)
            seq.turn_logprobs.append(logprob)
            if seq.params.return_logits:
                seq.turn_logits.append(picked[b].cpu())
            seq.state = "decode"
            if token in self.stop_token_ids:
                reason = "stop"
            elif len(seq.turn_tokens) >= seq.params.max_new_tokens:
                reason = "length"
            elif seq.length + 1 >= self.max_len:  # the sampled token makes max_len tokens
                reason = "context"
            else:
                continue
            seq.state = "idle"
            turn = TurnOutput(
                seq_id=seq.seq_id,
                token_ids=seq.turn_tokens,
                logprobs=seq.turn_logprobs,
                finish_reason=reason,
                seq_len=seq.length + 1,
                logits=torch.stack(seq.turn_logits) if seq.params.return_logits else None,
            )
            ended.append((seq.epoch, turn))
        return ended

    def _forward(self, rows: list[_Sequence], chunks: list[list[int]]) -> torch.Tensor:
        """One model call over `rows`, each fed its chunk left-padded to the widest; returns the
        float32 logits at each row's last token, [rows, vocab]."""
        if self.model.training:
            # dropout would make sampling irreproducible, and gradient checkpointing drops the cache
            raise RuntimeError(
                "the generation engine needs the model in eval mode: call model.eval()"
            )
        width = max(len(c) for c in chunks)
        slots = torch.tensor([s.slot for s in rows])
        first = int(slots[0])
        span = int(slots[-1]) - first + 1  # rows come sorted by slot
        consecutive = span == len(rows)
        # A decode step whose rows leave gaps (sequences waiting on a tool, or prefilling) runs
        # over every slot of the span instead of gathering the rows' keys and values: a gap row
        # is one pad token that reads key 0 and writes nothing, far cheaper than copying
        # [rows, kv_len] keys and values in every layer at every step.
        fill = width == 1 and not consecutive and span <= self.gap_fill_factor * len(rows)
        self.gap_filled_steps += fill
        kept = (slots - first) if fill else torch.arange(len(rows))  # batch row of each sequence
        n_batch = span if fill else len(rows)
        starts = torch.zeros(n_batch, dtype=torch.long)
        lengths = torch.zeros(n_batch, dtype=torch.long)
        starts[kept] = torch.tensor([s.length for s in rows])
        lengths[kept] = torch.tensor([len(c) for c in chunks])
        input_ids = torch.zeros(n_batch, width, dtype=torch.long)
        for b, chunk in zip(kept.tolist(), chunks, strict=True):
            input_ids[b, width - len(chunk) :] = torch.tensor(chunk)
        col = torch.arange(width)
        pad = (width - lengths)[:, None]
        real = col[None, :] >= pad  # a gap row has no real column: nothing of it is written
        # Padding columns take the row's first position: they attend to real keys only and are
        # never written to the cache, so they change nothing.
        positions = starts[:, None] + (col[None, :] - pad).clamp(min=0)
        write_row, write_col = real.nonzero(as_tuple=True)
        if fill:
            slots, consecutive = torch.arange(first, first + span), True
        kv_len = int((starts + lengths).max())

        dev = self.device
        self.cache.reserve(int(slots.max()) + 1, kv_len)
        copies = [(s.slot, row, j) for s in rows for j, row in enumerate(s.copy_rows)]
        for s in rows:
            s.copy_rows = []
        self.cache.plan = _ForwardPlan(
            slots=slots.to(dev),
            first_slot=first if consecutive else None,
            write_row=write_row.to(dev),
            write_col=write_col.to(dev),
            write_slot=slots[write_row].to(dev),
            write_pos=positions[write_row, write_col].to(dev),
            kv_len=kv_len,
        )
        if copies:
            copy_slot, copy_rows, block = (torch.tensor(c) for c in zip(*copies, strict=True))
            self.cache.plan.copy_slot = copy_slot[:, None].to(dev)
            self.cache.plan.copy_pos = (block[:, None] * PREFIX_BLOCK + torch.arange(PREFIX_BLOCK)).to(dev)
            self.cache.plan.copy_rows = copy_rows.to(dev)
        positions = positions.to(dev)
        key_pos = torch.arange(kv_len, device=dev)
        dtype = self.model.dtype
        allowed = key_pos[None, None, :] <= positions[:, :, None]  # [rows, cols, keys]
        masks = {"full_attention": self._additive(allowed, dtype)}
        if "sliding_attention" in self._layer_types:
            window = key_pos[None, None, :] > positions[:, :, None] - self._sliding_window
            masks["sliding_attention"] = self._additive(allowed & window, dtype)
        # A plain 4-D mask works for every model; the per-layer-type dict only for hybrid ones.
        mask = masks if len(masks) > 1 else masks["full_attention"]
        out = self.model(
            input_ids=input_ids.to(dev),
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: self.cache},
        )
        logits = out.logits[:, -1].float()
        return logits[kept.to(dev)] if fill else logits

    @staticmethod
    def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]

    def _deliver(self, finished: list[tuple[int, TurnOutput]]) -> list[TurnOutput]:
        with self._lock:
            # a turn whose sequence was released (or released and re-created) meanwhile is dropped
            kept = [turn for epoch, turn in finished if self._live.get(turn.seq_id) == epoch]
            self._busy.difference_update(turn.seq_id for turn in kept)
        return kept
