"""The engine's slot KV cache: one row per live sequence, written and read at each row's
own positions, grown in steps of `_LEN_QUANTUM` positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

# The cache grows in steps of this many positions, so its length dimension is rarely reallocated.
_LEN_QUANTUM = 256


@dataclass
class _ForwardPlan:
    """Where one forward call writes its new keys/values and which rows its attention reads."""

    slots: torch.Tensor  # [rows] slot of each batch row
    first_slot: int | None  # set when slots are consecutive: the rows are a view, not a gather
    write_row: torch.Tensor  # [n] batch row of each real (non-padding) token
    write_col: torch.Tensor  # [n] its column in the input
    write_slot: torch.Tensor  # [n] its slot
    write_pos: torch.Tensor  # [n] its position in the sequence
    kv_len: int  # keys read per row: the longest row's length after this call


class _SlotLayer(CacheLayerMixin):
    """One layer's keys and values, `[slots, kv_heads, length, head_dim]`, grown on demand."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: SlotKVCache):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys = key_states.new_zeros((0, key_states.shape[1], 0, key_states.shape[3]))
        self.values = value_states.new_zeros((0, value_states.shape[1], 0, value_states.shape[3]))
        self.is_initialized = True

    def _grow(self, rows: int, length: int) -> None:
        # Zeros, not empty: masked-out positions still enter q.k, and NaN garbage would poison softmax.
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((rows, old.shape[1], length, old.shape[3]))
            new[: old.shape[0], :, : old.shape[2]] = old
            setattr(self, name, new)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, length = self.owner.capacity
        if self.keys.shape[0] < rows or self.keys.shape[2] < length:
            self._grow(rows, length)
        plan = self.owner.plan
        # [rows, heads, cols, dim] -> the real tokens, [n, heads, dim], scattered to (slot, position)
        new_k = key_states.transpose(1, 2)[plan.write_row, plan.write_col]
        new_v = value_states.transpose(1, 2)[plan.write_row, plan.write_col]
        self.keys[plan.write_slot, :, plan.write_pos] = new_k
        self.values[plan.write_slot, :, plan.write_pos] = new_v
        if plan.first_slot is not None:
            rows_of = slice(plan.first_slot, plan.first_slot + plan.slots.shape[0])
            return self.keys[rows_of, :, : plan.kv_len], self.values[rows_of, :, : plan.kv_len]
        return (
            self.keys[:, :, : plan.kv_len].index_select(0, plan.slots),
            self.values[:, :, : plan.kv_len].index_select(0, plan.slots),
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("the engine builds the attention mask itself")

    def get_seq_length(self) -> int:
        # Lengths are per slot; the engine always passes position_ids and the mask explicitly.
        return 0

    def get_max_length(self) -> int:
        return self.owner.max_len


class SlotKVCache(Cache):
    """A `transformers.Cache` whose rows are sequence slots with their own lengths. Before each
    forward call the engine sets `plan` (which slots, which positions) and `capacity`."""

    def __init__(self, num_layers: int, max_slots: int, max_len: int):
        self.max_slots = max_slots
        self.max_len = max_len
        self.capacity = (0, 0)
        self.plan: _ForwardPlan | None = None
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])

    def reserve(self, rows: int, length: int) -> None:
        """Make room for `rows` slots of `length` positions, growing geometrically (in place of
        allocating max_slots x max_len up front, so memory follows use)."""
        cap_rows, cap_len = self.capacity
        if rows > cap_rows:
            cap_rows = min(self.max_slots, max(rows, 2 * cap_rows))
        if length > cap_len:
            cap_len = min(self.max_len, max(-(-length // _LEN_QUANTUM) * _LEN_QUANTUM, 2 * cap_len))
        self.capacity = (cap_rows, cap_len)

    def nbytes(self) -> int:
        return sum(
            layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized
        )
