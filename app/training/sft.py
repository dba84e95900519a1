"""The SFT cold start, top to bottom (Video-R1 trains on Video-R1-COT-165k before GRPO).

    python -m app.training.sft CONFIG [section.key=value ...]        (one process)
    scripts/sft.sh CONFIG [section.key=value ...]           (NPROC_PER_NODE processes)

The same rooms as GRPO (``app.training.recipe.Recipe``): records, prompt template and processor from ``data.*``, the
policy as configured (LoRA, frozen towers), DeepSpeed, checkpoints and exact resume, wandb / metrics.jsonl, and the
Hugging Face export to OUTPUT_DIR/final that ``model.path`` of a GRPO run can point at.

One step on every rank: `prompts_per_rank` records -> prompt as GRPO builds it, target = the record's `process`
(its `<think>...</think>`), a newline, and its `solution` (Video-R1's SFT target), then `<|im_end|>` -> the mean
negative log-likelihood of the target tokens only (the prompt carries no loss), micro-batch by micro-batch, through
the grouped forward with one completion per prompt (a packed row without padding) -> DeepSpeed step.
"""

from __future__ import annotations

import logging
import time

import torch

from app.data.prompts import collate_prompts
from app.data.records import EncodedPrompt, where
from app.training.agent_sft import AgentSFT
from app.training.recipe import Recipe, run

log = logging.getLogger("app.training.sft")
END_OF_TURN = "<|im_end|>"


def has_process(record: dict) -> bool:
    process = record.get("process")
    return isinstance(process, str) and bool(process.strip())


def target_text(record: dict) -> str:
    """Video-R1's SFT target: ``process + "\\n" + solution`` (the solution alone when a record has no process,
    which ``sft.without_process=answer_only`` allows; by default such records are skipped)."""
    return f"{record['process']}\n{record['solution']}" if has_process(record) else record["solution"]


class SFTTrainer(Recipe):
    name = "SFT"
    reads_shares = False  # its batches hold whole prompts

    def setup(self) -> None:
        end = self.tokenizer.convert_tokens_to_ids(END_OF_TURN)
        if end is None or end == self.tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer of {self.cfg.model.path} has no {END_OF_TURN} token (not a ChatML model)")
        self.end_of_turn = end

    def examples(self) -> list[tuple[EncodedPrompt, list[int]]]:
        """This step's prompts with their target ids; a target over ``sft.max_target_length`` tokens is
        skipped with its reason (never cut) and another record drawn."""
        out = []
        limit = self.cfg.sft.max_target_length
        while len(out) < self.cfg.train.prompts_per_rank:
            for prompt in self.stream.next_prompts(self.cfg.train.prompts_per_rank - len(out)):
                if not has_process(prompt.record) and self.cfg.sft.without_process == "skip":
                    self.stream.skip(prompt.record, "no process for SFT: `process` (the chain of thought) is missing "
                                                    "or empty (sft.without_process=answer_only trains on the "
                                                    "solution alone)")
                    continue
                ids = self.tokenizer(target_text(prompt.record), add_special_tokens=False)["input_ids"]
                ids.append(self.end_of_turn)
                if len(ids) > limit:
                    self.stream.skip(prompt.record, f"target too long: {len(ids)} tokens > "
                                                    f"sft.max_target_length={limit} (never truncated)")
                    continue
                out.append((prompt, ids))
        return out

    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        start = time.perf_counter()
        learning_rate = self.learning_rate()  # the rate this step's update uses (read before the scheduler moves)
        examples = self.examples()
        waited = self.data_wait(step)
        self.engine.train()
        losses, tokens = [], 0
        per = cfg.train.groups_per_micro_batch
        for first in range(0, len(examples), per):
            chunk = examples[first:first + per]
            width = max(len(ids) for _, ids in chunk)
            pad = self.tokenizer.pad_token_id
            ids = torch.tensor([t + [pad] * (width - len(t)) for _, t in chunk], device=self.device)
            mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for _, t in chunk], device=self.device)
            inputs = collate_prompts([p.inputs for p, _ in chunk], pad, self.device)
            scores = self.scores(self.engine, inputs, ids, mask, [1] * len(chunk),
                                 vision_calls=self.vision_calls(inputs, self.engine, training=True))
            loss = -(scores.logprobs * mask).sum() / mask.sum()  # token mean over this micro-batch's targets
            self.engine.backward(loss)
            self.engine.step()
            losses.append(float(loss.detach()))
            tokens += int(mask.sum())
        if step == self.start_step:
            log.info("SFT target of %s: %r", where(examples[0][0].record), target_text(examples[0][0].record)[:200])
        return self.likelihood_metrics(losses, tokens, started=start, waited=waited, learning_rate=learning_rate)


def recipe_for(cfg):
    """SFT, or SFT with tools (written multi-turn trajectories, ``app.training.agent_sft``) when ``rollout.tools`` lists any."""
    return AgentSFT(cfg) if cfg.rollout.tools else SFTTrainer(cfg)


def main(argv: list[str] | None = None) -> None:
    run(recipe_for, __doc__, argv)


if __name__ == "__main__":
    main()
