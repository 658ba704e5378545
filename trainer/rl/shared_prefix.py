"""A group's shared prompt, forwarded once in the update.

The rollouts of a group begin with the same tokens: the prompt, and sometimes a first turn
that two samples wrote alike. Forwarded one by one, each rollout recomputes them. Packed, a
row of the forward holds the group's shared prefix once and then each rollout's own rest,
`[prefix, rest_1, ..., rest_n]`: the position ids restart after the prefix for every rest,
and the attention mask lets a rest see the prefix and its own earlier tokens, never another
rest (and, on sliding-window layers, only the window). Every hidden state is then the one
the rollout's own forward computes, from the same keys and values at the same positions, so
the log-probabilities are the unshared ones up to float rounding; the prefix's activations
feed every rest, and autograd sums their gradients. A group of G rollouts of P shared and R
own tokens forwards P + G*R tokens instead of G*(P+R).

One forward call per micro-batch, as without sharing, so DDP's and FSDP's hooks and
gradient checkpointing see what they always see. The cost: the mask is a [T, T] tensor per
row (T = P + G*R; one byte a pair under sdpa, four under eager), and attention is computed
over the whole row, masked, rather than over each rollout's own P + R keys.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

ATTENTION = ("sdpa", "eager")  # the implementations that take a 4D mask as given
LAYER_TYPES = {"full_attention", "sliding_attention"}


def common_prefix(sequences: list[list[int]]) -> int:
    """The length of the longest prefix every sequence shares."""
    first, length = sequences[0], min(len(s) for s in sequences)
    for other in sequences[1:]:
        n = 0
        while n < length and other[n] == first[n]:
            n += 1
        length = n
    return length


def prompt_key(record: Any) -> tuple[int, ...]:
    """What a group's rollouts share for sure: every token before the first generated one."""
    mask = record.gen_mask
    first = mask.index(1) if 1 in mask else len(mask)
    return tuple(record.token_ids[:first])


def unsupported(model: Any) -> str | None:
    """Why the packed forward cannot apply to `model` (the unwrapped model), or None."""
    config = getattr(model, "config", None)
    if config is None:
        return f"{type(model).__name__} has no transformers config"
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ATTENTION:
        return f"attention implementation {implementation!r} does not take a 4D mask (sdpa and eager do)"
    other = set(getattr(config, "layer_types", None) or []) - LAYER_TYPES
    if other:
        return f"layer types {sorted(other)} (only full and sliding-window attention take the mask)"
    parameters = inspect.signature(model.forward).parameters
    if "position_ids" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return f"{type(model).__name__}.forward takes no position_ids"
    return None


@dataclass
class Packed:
    """A micro-batch packed by group: one row per group."""

    input_ids: torch.Tensor  # [rows, T]
    position_ids: torch.Tensor  # [rows, T]: each token's position in its own rollout
    segment: torch.Tensor  # [rows, T]: 0 the shared prefix, j + 1 the rest of the row's j-th rollout, -1 padding
    source: torch.Tensor  # [rollouts, longest]: row * T + column of each rollout position; -1 past its end

    @property
    def tokens(self) -> int:
        return int((self.segment >= 0).sum())


def pack(sequences: list[list[int]], rows: list[list[int]], pad: int) -> Packed:
    """`sequences` packed as `rows` (lists of indices into `sequences`, one row each): a row
    is its members' common prefix, then each member's tokens after it."""
    laid_out = []
    for members in rows:
        shared = common_prefix([sequences[i] for i in members])
        ids, positions, segment = list(sequences[members[0]][:shared]), list(range(shared)), [0] * shared
        starts = {}
        for j, index in enumerate(members):
            rest = sequences[index][shared:]
            starts[index] = len(ids) - shared  # the rest's column, less the prefix length
            ids += rest
            positions += range(shared, shared + len(rest))
            segment += [j + 1] * len(rest)
        laid_out.append((ids, positions, segment, shared, starts))
    width = max(len(ids) for ids, *_ in laid_out)
    longest = max(len(s) for s in sequences)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    segment_ids = torch.full((len(rows), width), -1, dtype=torch.long)
    source = torch.full((len(sequences), longest), -1, dtype=torch.long)
    for row, (ids, positions, segment, shared, starts) in enumerate(laid_out):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        position_ids[row, : len(ids)] = torch.tensor(positions, dtype=torch.long)
        segment_ids[row, : len(ids)] = torch.tensor(segment, dtype=torch.long)
        for index, start in starts.items():
            length = len(sequences[index])
            columns = torch.arange(length)
            columns[shared:] += start  # the rest sits after the earlier members' rests
            source[index, :length] = row * width + columns
    return Packed(input_ids, position_ids, segment_ids, source)


def _mask(packed: Packed, window: int | None) -> torch.Tensor:
    """[rows, 1, T, T], True where a query (dim 2) sees a key (dim 3)."""
    seg_q, seg_k = packed.segment[:, :, None], packed.segment[:, None, :]
    pos_q, pos_k = packed.position_ids[:, :, None], packed.position_ids[:, None, :]
    visible = (seg_k >= 0) & (seg_q >= 0) & ((seg_k == 0) | (seg_k == seg_q)) & (pos_k <= pos_q)
    if window is not None:
        visible &= pos_q - pos_k < window
    # padding sees itself, so that no softmax row is empty (a NaN there would reach the
    # real tokens' gradients through 0 * NaN); no real token sees padding
    width = packed.segment.size(1)
    visible |= torch.eye(width, dtype=torch.bool, device=visible.device) & (seg_q < 0)
    return visible[:, None]


def attention_masks(config: Any, packed: Packed, device: torch.device) -> torch.Tensor | dict[str, torch.Tensor]:
    """The mask the model's layers take, in the form its attention implementation adds or
    selects by: one tensor, or one per layer type where a sliding window binds (a window
    shorter than the longest rollout) and the model mixes layer types."""
    window = getattr(config, "sliding_window", None)
    longest = int(packed.position_ids.max()) + 1
    types = sorted(set(getattr(config, "layer_types", None) or []))
    binds = window is not None and window < longest

    def form(window: int | None) -> torch.Tensor:
        visible = _mask(packed, window).to(device)
        if config._attn_implementation == "sdpa":
            return visible
        return torch.zeros(visible.shape, dtype=torch.float32, device=device).masked_fill_(
            ~visible, torch.finfo(torch.float32).min)

    if not binds:
        return form(None)
    if types:
        return {kind: form(window if kind == "sliding_attention" else None) for kind in types}
    return form(window)  # a sliding window and no layer types (Mistral): every layer slides
