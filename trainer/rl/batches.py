"""Which items each step trains on: a seeded order per epoch, per-process shares, and
DAPO's dynamic sampling (groups whose rewards all tie are replaced)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from trainer.data import split_items
from trainer.errors import ConfigError
from trainer.rollout.record import RolloutRecord, check_tool_call_costs


def check_groups(training: Any, items: list[dict[str, Any]], file: str) -> None:
    """Every group that `training.kl_coef_by_group` or `training.group_weights` names occurs in
    the training items: a misspelt group would silently train without its KL term or weight."""
    found = {training.group_of(item) for item in items} - {None}
    for key in ("kl_coef_by_group", "group_weights"):
        named = getattr(training, key)
        if not named:
            continue
        if not found:
            raise ConfigError(
                f"{file}: no training item has the field {training.group_by!r} that training.group_by names; "
                f"name a field the items have or drop training.{key}"
            )
        unknown = sorted(set(named) - found)
        if unknown:
            raise ConfigError(
                f"training.{key}: group(s) {unknown} do not occur in {file} (field "
                f"{training.group_by!r} has {sorted(found)}); fix the names"
            )


class DataOrder:
    """Which items each step trains on: every epoch a seeded permutation, cut in batches.

    With `weights` (one per item) the permutation is a weighted shuffle (Efraimidis-Spirakis:
    item i's key is u_i ** (1 / w_i), in descending order), so heavier items tend to come
    earlier in the epoch; every item still comes exactly once an epoch."""

    def __init__(self, n_items: int, batch_size: int, seed: int, weights: list[float] | None = None):
        if weights is not None and len(weights) != n_items:
            raise ValueError(f"DataOrder: {len(weights)} weights for {n_items} items")
        self.n_items = n_items
        self.batch_size = batch_size
        self.seed = seed
        self.weights = weights
        self.steps_per_epoch = n_items // batch_size
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            rng = random.Random(f"{self.seed}:epoch:{epoch}")
            if self.weights is None:
                order = list(range(self.n_items))
                rng.shuffle(order)
            else:
                keys = [rng.random() ** (1.0 / w) for w in self.weights]
                order = sorted(range(self.n_items), key=lambda i: -keys[i])
            self._orders[epoch] = order
        return self._orders[epoch]

    def restore(self, epoch: int, order: list[int]) -> None:
        """Use a checkpoint's order for `epoch`."""
        self._orders[epoch] = list(order)

    def batch(self, step: int) -> tuple[int, int, list[int]]:
        """(epoch, position after this batch in the epoch's order, item indices) of the
        1-based `step`."""
        epoch, index = divmod(step - 1, self.steps_per_epoch)
        start = index * self.batch_size
        return epoch, start + self.batch_size, self.order(epoch)[start : start + self.batch_size]


def resample_share(n_items: int, per_process: int, processes: int, rank: int, seed: int) -> list[int]:
    """Dynamic sampling's fresh items for one process: one seeded draw without replacement
    for all processes (the same on each), cut in shares, so no two processes roll out the
    same item in a round. With fewer items than processes x share, the shares shrink."""
    order = list(range(n_items))
    random.Random(seed).shuffle(order)  # a prefix of one permutation: the same draw for any process count
    drawn = order[: per_process * processes]
    share = len(drawn) // processes
    return drawn[rank * share : (rank + 1) * share]


def in_loss(record: RolloutRecord, *, mask_truncated: bool) -> bool:
    """Whether a rollout's reward enters its group's advantages and the loss."""
    return record.trainable and not (mask_truncated and record.truncated)


def fill_batch(
    sample: Any, first: list[Any], *, group_size: int, want_groups: int, max_rounds: int, mask_truncated: bool
) -> tuple[list[RolloutRecord], int, int]:
    """Dynamic sampling: keep the groups of `first` (records, `group_size` a group) whose
    rewards vary and call `sample(round)` for fresh groups until `want_groups` are kept or
    `max_rounds` extra rounds ran. Returns the kept records, the extra rounds and the
    groups dropped."""
    kept: list[RolloutRecord] = []
    dropped, rounds, records = 0, 0, first
    while True:
        for start in range(0, len(records), group_size):
            group = records[start : start + group_size]
            rewards = [r.reward for r in group if in_loss(r, mask_truncated=mask_truncated)]
            if len(kept) // group_size < want_groups and len(rewards) > 1 and max(rewards) - min(rewards) > 1e-9:
                kept += group
            else:
                dropped += 1
        if len(kept) // group_size >= want_groups or rounds >= max_rounds:
            return kept, rounds, dropped
        rounds += 1
        records = sample(rounds)


@dataclass
class Sample:
    """A step's rollouts, before the update that learns from them."""

    step: int
    data_state: tuple[int, int]  # (epoch, position) of the data order at this step
    records: list[RolloutRecord]  # the batch (after dynamic sampling)
    sampled: list[RolloutRecord]  # everything sampled for it, the dropped groups too
    resampled: int
    dropped: int
    seconds: float


def without_tokens(record: RolloutRecord) -> RolloutRecord:
    """The record as gathered across processes: the token arrays stay where they are used."""
    return dataclasses.replace(record, token_ids=[], gen_mask=[], logprobs=[])


def plan_batches(config: Any, hp: dict[str, Any], settings: Any, *, processes: int
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], DataOrder, int]:
    """The training items, the validation items each evaluation reads, the data order and
    the number of steps; errors name the setting or file that makes the run impossible."""
    training, data = config.training, config.data
    for name in ("n_epochs", "batch_size", "eval_interval"):
        if hp[name] < 1:
            raise ConfigError(f"training.{name} must be at least 1 (or 'auto'), got {hp[name]}")
    train_items = split_items(data, "train")
    validation = split_items(data, "validation")
    for items, file in ((train_items, data.train_file), (validation, data.validation_file)):
        check_tool_call_costs(settings.tool_call_costs, items, file, config.tools.schemas)
    check_groups(training, train_items, data.train_file)
    batch_size = hp["batch_size"]
    if batch_size % processes:
        raise ConfigError(f"training.batch_size ({batch_size}) must be a multiple of the {processes} "
                          "processes: each process runs whole groups")
    weights = [training.weight_of(item) for item in train_items] if training.group_weights else None
    order = DataOrder(len(train_items), batch_size, training.seed, weights)
    if order.steps_per_epoch == 0:
        raise ConfigError(f"training.batch_size ({batch_size}) exceeds the {len(train_items)} training items "
                          f"of {data.train_file}; lower it or add items")
    total_steps = hp["n_epochs"] * order.steps_per_epoch
    if training.max_steps:
        total_steps = min(total_steps, training.max_steps)
    return train_items, validation[: hp["eval_samples"]], order, total_steps
