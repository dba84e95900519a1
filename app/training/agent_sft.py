"""SFT with tools: supervised training on written multi-turn trajectories, the tools run for real between the turns
(``scripts/sft.sh CONFIG rollout.tools=[...]``, picked by ``app.training.sft`` when ``rollout.tools`` lists any).

A record carries ``turns``: the model's turns as text, in order; every turn but the last is expected to end with a
``<tool_call>...</tool_call>``, the last to be the answer (it ends with the end-of-turn token). One step draws
``prompts_per_rank`` records, writes their turns into a rollout through the same loop GRPO with tools samples with
(``tree_rollout``: the call runs, its observation is encoded as the next turn's context, media included), and trains
the negative log-likelihood of the model's own tokens only (observations are context) through the same prefix-tree
scorer. This is the warm start that teaches what to write after an observation, which a single-turn SFT cannot.
A call that cannot run still becomes an error observation, as in GRPO; ``tools/*`` counts them.
"""

from __future__ import annotations

import time

import torch

from app.rollout.generate import Rollout
from app.training.agent import AgentGRPOTrainer

TURNS = "turns"  # the record field holding the model's turns


class AgentSFT(AgentGRPOTrainer):
    name = "SFT with tools"

    def setup(self) -> None:
        super().setup()
        self.sampler = self.written_turn
        self.end_of_turn = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.turn = 0

    def written_turn(self, asked, group_size: int, seeds, max_new_tokens: int) -> Rollout:
        """The records' own text for this turn (``tree_rollout`` asks once per turn, in order): a call stops at its
        ``</tool_call>`` as a sampled one would, the last turn ends with the end-of-turn token."""
        rows, reasons = [], []
        for prompt in asked:
            turns = prompt.record[TURNS]
            last = self.turn + 1 >= len(turns)
            ids = self.tokenizer(turns[min(self.turn, len(turns) - 1)], add_special_tokens=False)["input_ids"]
            ids = ids + [self.end_of_turn] if last else ids
            rows += [ids] * group_size
            reasons += ["eos" if last else "stop_string"] * group_size
        self.turn += 1
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return Rollout(ids, mask, torch.zeros(ids.shape), [group_size] * len(asked), reasons, 0)

    def examples(self) -> list:
        """This step's prompts; a record without ``turns`` (a list of strings) is skipped with its reason."""
        out = []
        while len(out) < self.cfg.train.prompts_per_rank:
            for prompt in self.stream.next_prompts(self.cfg.train.prompts_per_rank - len(out)):
                turns = prompt.record.get(TURNS)
                if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
                    self.stream.skip(prompt.record, f"SFT with tools needs `{TURNS}`: the model's turns as a list "
                                                    "of strings")
                elif len(turns) > self.cfg.rollout.max_turns:
                    self.stream.skip(prompt.record, f"{len(turns)} turns > rollout.max_turns="
                                                    f"{self.cfg.rollout.max_turns}")
                else:
                    out.append(prompt)
        return out

    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        start = time.perf_counter()
        learning_rate = self.learning_rate()
        prompts = self.examples()
        waited = self.data_wait(step)
        self.turn = 0
        trajectory = self.rollout_and_score(step, prompts)
        trajectory.advantages = torch.zeros(len(trajectory.texts))
        mask = trajectory.rollout.completion_mask
        micro_batches = trajectory.micro_batches(cfg.train.groups_per_micro_batch, mask.float(),
                                                 self.tokenizer.pad_token_id, self.device)
        self.agree_vision_calls(micro_batches)
        self.engine.train()
        losses, tokens = [], 0
        for mb in micro_batches:
            scores = self.scores(self.engine, mb.inputs, mb.completion_ids, mb.completion_mask, mb.group_sizes,
                                 vision_calls=mb.vision_calls)
            trained = mb.completion_mask.float()
            loss = -(scores.logprobs * trained).sum() / trained.sum().clamp_min(1)  # the model's tokens only
            self.engine.backward(loss)
            self.engine.step()
            losses.append(float(loss.detach()))
            tokens += int(trained.sum())
        return self.likelihood_metrics(losses, tokens, started=start, waited=waited, learning_rate=learning_rate,
                                       extra=trajectory.counts)
