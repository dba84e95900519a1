"""Run under torchrun with 2 processes: one DeepSpeed ZeRO-2 step for every policy objective and loss type with the
trainer's loss (GRPOLoss), each on its own table in one engine.

Each rank owns 2 micro-batches of tests/test_loss.py's step data (unequal token counts); the "policy" is a table
of log-probs, the optimiser SGD with lr 1, so the parameter change is minus the gradient DeepSpeed applied. Rank 0
writes rank0.json with the change per loss type.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from app.objectives.grpo import GRPOLoss, LossOptions
from app.runtime import distributed, parallel, zero
from tests.test_loss import L_MAX, combinations, step_data


class Tables(torch.nn.Module):
    """One table of log-probs per objective and loss type, in one engine: each combination's loss reaches only its
    own table, so the step moves each by its own gradient (one DeepSpeed engine instead of one per combination)."""

    def __init__(self, values: torch.Tensor, names: list[str]):
        super().__init__()
        self.names = names
        self.tables = torch.nn.ParameterList([torch.nn.Parameter(values.clone()) for _ in names])

    def forward(self, index: int) -> list[torch.Tensor]:
        return [table[index] for table in self.tables]


def main(out: str) -> None:
    rank, world = distributed.init_distributed()
    data = step_data(seed=4)
    mine = data[2 * rank : 2 * rank + 2]
    names = [f"{policy}/{loss_type}" for policy, loss_type in combinations()]
    ds_config = zero.load_deepspeed_config("deepspeed_configs/zero2.json", gradient_accumulation_steps=2,
                                           max_grad_norm=0.0, dtype="float32")
    model = Tables(torch.stack([mb["logp"].detach().float() for mb in data]), names)
    before = [table.detach().clone() for table in model.tables]
    engine = zero.build_engine(model, ds_config, torch.optim.SGD(model.parameters(), lr=1.0), None)
    losses = []
    for policy, loss_type in combinations():
        options = LossOptions(loss_type=loss_type, beta=0.04, epsilon_low=0.2, epsilon_high=0.28,
                              max_completion_length=L_MAX, policy_loss=policy)
        loss_fn = GRPOLoss(options)  # the trainer's loss: the DAPO denominator over the step's ranks
        loss_fn.start_step(torch.cat([mb["mask"] for mb in mine]), len(mine), world, parallel.all_reduce_sum)
        losses.append(loss_fn)
    for k, mb in enumerate(mine):
        old = mb["old"].float()
        total = sum(loss_fn(logp, old, mb["adv"].float(), mb["mask"], mb["ref"].float(), sampled_logprobs=old)[0]
                    for loss_fn, logp in zip(losses, engine(2 * rank + k), strict=True))
        engine.backward(total)
        engine.step()
    moved = {name: (table.detach() - start).flatten().tolist()
             for name, table, start in zip(names, engine.module.tables, before, strict=True)}
    if rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "rank0.json").write_text(json.dumps(moved))
    distributed.exit_worker()  # leaves without the interpreter's finalization, where a worker once aborted


if __name__ == "__main__":
    main(sys.argv[1])
