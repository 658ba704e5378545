"""Run by test_shared_prefix.py under `torchrun --nproc_per_node 2` (gloo, CPU): the demo
model sharded with FSDP2 twice, one update each of one group per process, with
`training.shared_prefix` on and off; rank 0 writes how far the two updates' gradients (as
the optimizer is given them, reduced over both processes) are apart.

    python -m torch.distributed.run --nproc_per_node 2 tests/trainer/shared_prefix_fsdp.py out.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.trainer.test_shared_prefix import DEMO_MODEL, records_of
from trainer.config.rollout import RolloutConfig
from trainer.config.training import TrainingConfig
from trainer.generation.policy import load_policy
from trainer.rl.sharding import full_state_dict, shard
from trainer.rl.update import PolicyUpdate


class Recording(torch.optim.SGD):
    """SGD that keeps the whole gradients it steps with."""

    def step(self, closure=None):
        self.grads = [p.grad.full_tensor().clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


def main(out: Path) -> None:
    from types import SimpleNamespace

    from accelerate import Accelerator

    acc = Accelerator()
    policy = load_policy(str(DEMO_MODEL), device="cpu", dtype="float32")
    records = records_of(policy.chat, "demo", sizes=(3, 3))
    mine = records[3 * acc.process_index : 3 * acc.process_index + 3]  # one group a process
    advantages = [[1.0, -0.5, -0.5], [0.8, -0.2, -0.6]][acc.process_index]
    ends, losses, shared = {}, {}, []
    for on in (True, False):
        model = load_policy(str(DEMO_MODEL), device="cpu", dtype="float32").model.train()
        shard(model, mixed_precision="no")
        optimizer = Recording(model.parameters(), lr=0.5)
        config = SimpleNamespace(training=TrainingConfig(shared_prefix=on, micro_batch_size=4),
                                 rollout=RolloutConfig(max_turns=4, max_new_tokens_per_turn=64, max_total_tokens=4096))
        up = PolicyUpdate(acc, model, optimizer, config=config, tokenizer=policy.tokenizer, reference=None,
                          temperature=1.0, kl_coef_of=lambda record: 0.0, sharded=True)
        metrics = up.update(mine, advantages, 1)
        shared.append(bool(up.shared))
        ends[on] = dict(zip([name for name, _ in model.named_parameters()], optimizer.grads, strict=True))
        full_state_dict(model)  # the update ran through to the end: the shards gather whole
        losses["shared" if on else "plain"] = metrics["train/loss"]
    flags = [None, None]
    torch.distributed.all_gather_object(flags, shared[0])
    if acc.is_main_process:
        # the gradients' difference relative to their norm: per parameter and over the whole model
        apart = {k: float((ends[True][k] - ends[False][k]).norm()) for k in ends[False]}
        norms = {k: float(ends[False][k].norm()) for k in ends[False]}
        relative = {k: apart[k] / norms[k] for k in norms if norms[k] > 0}
        worst = max(relative, key=relative.get)
        whole = sum(a * a for a in apart.values()) ** 0.5 / sum(m * m for m in norms.values()) ** 0.5
        out.write_text(json.dumps({"shared": flags, "relative_difference": whole, "worst_parameter": worst,
                                   "worst_relative_difference": relative[worst], "loss": losses,
                                   "gradient_norm": sum(m * m for m in norms.values()) ** 0.5}))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
