"""A model judge that shares the prefix (``rewards.functions: [..., judge]``): the G completions of a group are judged
in ONE grouped forward of the judge model, the question and its video once, each completion with its verdict
suffix as a response (the Prefix Grouper paper's "multi-QA judge modeling"). No generation: the reward is the
judge's probability of "yes".

For a group, the packed row is [P; R1; ...; RG] with
  P  = the question's own prompt as the judge's processor encodes it (system, the video or image, the question;
       the same conversation the policy saw, through ``encode_prompts``), ending with the assistant's turn opening;
  Ri = completion i, then "<|im_end|>\\n<|im_start|>user\\n" + the verdict question (``rewards.judge_template``, with
       the reference answer) + "<|im_end|>\\n<|im_start|>assistant\\n" + "yes".
The reward of completion i is p("yes" | P, Ri before it) (the product over its tokens where "yes" is several): what the same judge gives on [P; Ri] alone
(tested equal to 1e-5 in float32). The judge runs without gradient, in ``model.dtype``, on the rank's device, as
its own unpartitioned copy (under ZeRO-3 too: its partitioning is not built).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from app.grouping import completion_logprobs

DEFAULT_TEMPLATE = ("Is the answer above correct? The reference answer is: {reference}. Reply with yes or no.")
VERDICT_WORD = "yes"


class JudgeError(ValueError):
    """A judge that cannot score: no checkpoint, a template without {reference}, "yes" not one token."""


class GroupedJudge:
    """``judge(completions, records, group_sizes) -> [P(yes)]``, one grouped forward per group."""

    group_aware = True  # app.rewards.score passes the group sizes

    def __init__(self, model, processor, data_cfg, data_root: str | Path | None, template: str = DEFAULT_TEMPLATE,
                 *, device: torch.device | None = None, chunk_size: int = 1024):
        if "{reference}" not in template:
            raise JudgeError(f"rewards.judge_template must contain {{reference}} (the reference answer); got "
                             f"{template!r}")
        self.model, self.processor, self.data_cfg, self.template = model.eval(), processor, data_cfg, template
        self.data_root = Path(data_root) if data_root else None
        self.device = device or next(model.parameters()).device
        self.chunk_size = chunk_size
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.yes_ids = self.tokenizer.encode(VERDICT_WORD, add_special_tokens=False)  # one token in Qwen's vocabulary
        if not self.yes_ids:
            raise JudgeError(f"the judge's tokenizer writes {VERDICT_WORD!r} as no token")

    def response_ids(self, completion: str, reference: str) -> list[int]:
        verdict = self.template.format(reference=reference)
        text = f"{completion}<|im_end|>\n<|im_start|>user\n{verdict}<|im_end|>\n<|im_start|>assistant\n"
        return self.tokenizer.encode(text, add_special_tokens=False) + list(self.yes_ids)

    def prompt(self, record: dict):
        """The question's prompt for the judge's processor (the policy's conversation: system, media, question)."""
        from app.data.prompts import encode_prompts
        from app.data.records import build_conversation

        root = self.data_root or Path(record.get("_root", "."))
        return encode_prompts(self.processor, [build_conversation(record, root, self.data_cfg)])

    def group_scores(self, prompts: dict, completions: Sequence[str], reference: str, mode: str = "grouped"):
        """P("yes") for each completion of one group (``group_log_scores``, exponentiated)."""
        return [float(torch.tensor(v).exp()) for v in self.group_log_scores(prompts, completions, reference, mode)]

    @torch.no_grad()
    def group_log_scores(self, prompts: dict, completions: Sequence[str], reference: str, mode: str = "grouped"):
        """log P("yes") for each completion of one group: ``grouped`` (one packed row) or ``repeated`` ([P; Ri]
        each)."""
        rows = [self.response_ids(c, reference) for c in completions]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=self.device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.device)
        prompts = {k: v.to(self.device) for k, v in prompts.items()}
        scores = completion_logprobs(self.model, prompts, ids, mask, [len(rows)], mode=mode,
                                     chunk_size=self.chunk_size)
        k = len(self.yes_ids)  # the verdict's tokens end each row: P(yes) is the product of their probabilities
        last = (mask.sum(1) - 1)[:, None] - torch.arange(k, device=self.device)[None, :]
        return scores.logprobs.float().gather(1, last).sum(1).tolist()

    def __call__(self, completions: Sequence[str], records: Sequence[dict], group_sizes: Sequence[int]):
        from app.groups import group_slices
        from app.rewards import solution_answer

        out: list[float] = []
        for rows in group_slices(group_sizes):
            record = records[rows.start]
            out += self.group_scores(self.prompt(record), completions[rows], solution_answer(record["solution"]))
        return out


def build_judge(rewards_cfg, data_cfg, model_cfg, device: torch.device):
    """The configured judge (``rewards.judge_path``), loaded in ``model.dtype`` on ``device``; None when
    ``rewards.functions`` has no ``judge``."""
    if "judge" not in rewards_cfg.functions:
        return None
    from app.models import DTYPES, check_checkpoint, load_model, load_processor

    if not rewards_cfg.judge_path:
        raise JudgeError("rewards.functions lists judge but rewards.judge_path is empty (a local checkpoint)")
    path = check_checkpoint(rewards_cfg.judge_path, "rewards.judge_path")
    model = load_model(path, dtype=DTYPES[model_cfg.dtype], attn_implementation=model_cfg.vision_attention,
                       trust_remote_code=model_cfg.trust_remote_code).to(device)
    model.requires_grad_(False)
    root = data_cfg.data_root or str(Path(data_cfg.train_file).parent)
    return GroupedJudge(model, load_processor(path, trust_remote_code=model_cfg.trust_remote_code), data_cfg, root,
                        rewards_cfg.judge_template, device=device)
