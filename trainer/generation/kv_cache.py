"""The engine's slot KV cache: one row per live sequence, written and read at each row's
own positions, grown in steps of `_LEN_QUANTUM` positions; and its prefix cache, the keys and
values of prompt prefixes that a new sequence starts from instead of pre-filling them."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
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
    # Prefix blocks copied into slots before this call's keys are written (None: none):
    copy_slot: torch.Tensor | None = None  # [m, 1] destination slot of each block
    copy_pos: torch.Tensor | None = None  # [m, PREFIX_BLOCK] its positions there
    copy_rows: torch.Tensor | None = None  # [m] its row in the prefix cache


class _SlotLayer(CacheLayerMixin):
    """One layer's keys and values, `[slots, kv_heads, length, head_dim]`, grown on demand."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: SlotKVCache, index: int):
        super().__init__()
        self.owner = owner
        self.index = index

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
        if plan.copy_rows is not None:  # sequences starting from a cached prefix
            keys, values = self.owner.prefix.pool(self.index)
            self.keys[plan.copy_slot, :, plan.copy_pos] = keys[plan.copy_rows]
            self.values[plan.copy_slot, :, plan.copy_pos] = values[plan.copy_rows]
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

    def __init__(self, num_layers: int, max_slots: int, max_len: int, prefix_tokens: int = 0):
        self.max_slots = max_slots
        self.max_len = max_len
        self.capacity = (0, 0)
        self.plan: _ForwardPlan | None = None
        self.prefix = PrefixCache(num_layers, prefix_tokens)
        super().__init__(layers=[_SlotLayer(self, i) for i in range(num_layers)])

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
        """Bytes of the slots' keys and values (the prefix cache's are `prefix.nbytes()`)."""
        return sum(
            layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized
        )

    def store_prefix(self, slots: list[int], blocks: list[int], keys: list[bytes], chain: list[bytes]) -> None:
        """Copy block `blocks[i]` (positions `blocks[i] * PREFIX_BLOCK` on) of slot `slots[i]`
        into the prefix cache under `keys[i]` (blocks of `chain`, the prompt's keys, in order)."""
        rows, kept = self.prefix.allocate(keys, chain)
        if not rows:
            return
        slot = torch.tensor(slots[:kept])[:, None]
        pos = torch.tensor(blocks[:kept])[:, None] * PREFIX_BLOCK + torch.arange(PREFIX_BLOCK)[None, :]
        rows_t = torch.tensor(rows)
        for layer in self.layers:
            device = layer.keys.device
            pool_k, pool_v = self.prefix.pool(layer.index, like=layer.keys)
            index = rows_t.to(device)
            pool_k[index] = layer.keys[slot.to(device), :, pos.to(device)]
            pool_v[index] = layer.values[slot.to(device), :, pos.to(device)]


# Tokens a prefix-cache block holds: a prompt shares its cached prefix in whole blocks.
PREFIX_BLOCK = 16


def prefix_block_keys(tokens: list[int], n_blocks: int) -> list[bytes]:
    """The key of each of the first `n_blocks` whole blocks of `tokens`: a digest of every token
    up to the block's end (a chain, so that equal keys mean equal prefixes)."""
    keys, digest = [], b""
    for i in range(n_blocks):
        block = array("q", tokens[i * PREFIX_BLOCK : (i + 1) * PREFIX_BLOCK]).tobytes()
        digest = hashlib.blake2b(digest + block, digest_size=16).digest()
        keys.append(digest)
    return keys


class PrefixCache:
    """Keys and values of prompt prefixes, in blocks of `PREFIX_BLOCK` tokens, for at most
    `max_tokens` tokens; the least recently used block goes first when it is full.

    A block is keyed by the content of its whole prefix (`prefix_block_keys`), so a lookup
    walks a prompt's blocks from the start and stops at the first one not cached. A lookup
    touches a chain's blocks last-first: a block is always more recent than the blocks after
    it, so eviction takes the ends of chains and never leaves a block whose prefix is gone.
    Each layer's blocks are one tensor, `[blocks, PREFIX_BLOCK, kv_heads, head_dim]`, grown
    on demand up to the bound.
    """

    def __init__(self, num_layers: int, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"prefix cache tokens must be >= 0, got {max_tokens}")
        self.max_blocks = max_tokens // PREFIX_BLOCK
        self.rows: OrderedDict[bytes, int] = OrderedDict()  # key -> row of the pool, oldest first
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._allocated = 0  # pool rows ever handed out (rows of evicted blocks are reused)
        self.evicted_blocks = 0

    @property
    def enabled(self) -> bool:
        return self.max_blocks > 0

    def match(self, keys: list[bytes]) -> list[int]:
        """The pool rows of the longest run of cached blocks at the start of `keys`, touched."""
        rows = []
        for key in keys:
            row = self.rows.get(key)
            if row is None:
                break
            rows.append(row)
        for key in reversed(keys[: len(rows)]):
            self.rows.move_to_end(key)
        return rows

    def allocate(self, keys: list[bytes], chain: list[bytes]) -> tuple[list[int], int]:
        """Rows for the blocks `keys` (blocks of `chain`, in order; keys already cached are
        refreshed and reused), evicting the least recently used block that is not in `chain`
        (a block's prefix stays); stops where the bound leaves none. Returns the rows and how
        many of `keys` they cover."""
        protected = set(chain)
        rows: list[int] = []
        for key in keys:
            if key in self.rows:
                rows.append(self.rows[key])
                self.rows.move_to_end(key)
                continue
            if self._allocated < self.max_blocks:
                row = self._allocated
                self._allocated += 1
            else:
                oldest = next((k for k in self.rows if k not in protected), None)
                if oldest is None:  # the chain fills the cache
                    break
                row = self.rows.pop(oldest)
                self.evicted_blocks += 1
            self.rows[key] = row
            rows.append(row)
        for key in reversed(chain[: chain.index(keys[len(rows) - 1]) + 1] if rows else []):
            if key in self.rows:
                self.rows.move_to_end(key)
        return rows, len(rows)

    def pool(self, layer: int, like: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s block tensors; with `like` (a slot layer's keys), grown to hold every
        row allocated so far."""
        keys = self._keys[layer]
        if like is not None and (keys is None or keys.shape[0] < self._allocated):
            rows = min(self.max_blocks, max(self._allocated, 2 * (0 if keys is None else keys.shape[0])))
            shape = (rows, PREFIX_BLOCK, like.shape[1], like.shape[3])
            for store in (self._keys, self._values):
                new = like.new_zeros(shape)
                if store[layer] is not None:
                    new[: store[layer].shape[0]] = store[layer]
                store[layer] = new
        return self._keys[layer], self._values[layer]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self._keys, *self._values) if t is not None)
