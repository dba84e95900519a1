"""A model judge that shares the prefix (``rewards.functions: [..., judge]``): the G completions of a group are judged
in ONE grouped forward of the judge model, the question and its video once, each completion with its verdict
suffix as a response (the Prefix Grouper paper's "multi-QA judge modeling"). No generation: the reward is the
judge's probability of "yes" (``rewards.judge_verdict=yes``) or its expected score (``score``).

For a group, the packed row is [P; R1; ...; RG] with
  P  = the question's own prompt as the judge's processor encodes it (system, the video or image, the question;
       the same conversation the policy saw, through ``encode_prompts``), ending with the assistant's turn opening;
  Ri = completion i, then "<|im_end|>\\n<|im_start|>user\\n" + the verdict question (``rewards.judge_template``, with
       the reference answer) + "<|im_end|>\\n<|im_start|>assistant\\n" + "yes".
``yes``: the reward of completion i is p("yes" | P, Ri before it) (the product over its tokens where "yes" is
several). ``score``: the verdict question asks for one digit from 0 to 9, and the reward is the judge's expected
digit, sum_d d p(d) / 9 with p renormalised over the ten digits, read from its distribution at the answer's first
position: what parsing the judge's written score gives on average over its samples, in the same one forward (the
share of probability the digits hold is kept as ``digit_mass``; a low one means the judge is not answering with a
digit). Either equals what the same judge gives on [P; Ri] alone (tested to 1e-5 in float32). The judge runs
without gradient, in ``model.dtype``, on the rank's device: under ZeRO-3 partitioned like the reference model
(every rank judges its groups in lock step, one forward per group, both tower calls made), otherwise its own copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from app.grouping import MODALITIES, GroupLayout, completion_logprobs, unwrap

TEMPLATES = {  # rewards.judge_verdict -> the verdict question asked when rewards.judge_template is empty
    "yes": "Is the answer above correct? The reference answer is: {reference}. Reply with yes or no.",
    "score": "How correct is the answer above? The reference answer is: {reference}. Reply with one digit from 0 "
             "(wrong) to 9 (fully correct).",
}
DEFAULT_TEMPLATE = TEMPLATES["yes"]
VERDICT_WORD = "yes"
SCORE_DIGITS = "0123456789"


class JudgeError(ValueError):
    """A judge that cannot score: no checkpoint, a template without {reference}, "yes" not one token."""


class GroupedJudge:
    """``judge(completions, records, group_sizes) -> [P(yes)]``, one grouped forward per group."""

    group_aware = True  # app.rewards.rules.score passes the group sizes

    def __init__(self, model, processor, data_cfg, data_root: str | Path | None, template: str = "",
                 *, device: torch.device | None = None, chunk_size: int = 1024, verdict: str = "yes",
                 partitioned: bool = False):
        if verdict not in TEMPLATES:
            raise JudgeError(f"rewards.judge_verdict must be one of {sorted(TEMPLATES)}, got {verdict!r}")
        template = template or TEMPLATES[verdict]
        if "{reference}" not in template:
            raise JudgeError(f"rewards.judge_template must contain {{reference}} (the reference answer); got "
                             f"{template!r}")
        model.eval()  # (a DeepSpeed engine's eval() returns None)
        self.model, self.processor, self.data_cfg, self.template = model, processor, data_cfg, template
        self.verdict, self.partitioned = verdict, partitioned
        self.data_root = Path(data_root) if data_root else None
        self.device = device or next(model.parameters()).device
        self.chunk_size = chunk_size
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.yes_ids = self.tokenizer.encode(VERDICT_WORD, add_special_tokens=False)  # one token in Qwen's vocabulary
        if not self.yes_ids:
            raise JudgeError(f"the judge's tokenizer writes {VERDICT_WORD!r} as no token")
        digits = [self.tokenizer.encode(d, add_special_tokens=False) for d in SCORE_DIGITS]
        if verdict == "score" and any(len(d) != 1 for d in digits):
            raise JudgeError("rewards.judge_verdict=score needs each digit 0-9 to be one token of the judge's "
                             f"tokenizer; it writes them as {digits}")
        self.digit_ids = [d[0] for d in digits] if all(len(d) == 1 for d in digits) else []
        self.digit_mass: list[float] = []  # score verdicts: the probability the digits held, per completion

    def response_ids(self, completion: str, reference: str) -> list[int]:
        """Ri: the completion, the verdict turn, the judge's turn opening, then the verdict's token(s): "yes", or
        a digit whose position's distribution is read (the digit itself is a placeholder)."""
        verdict = self.template.format(reference=reference)
        text = f"{completion}<|im_end|>\n<|im_start|>user\n{verdict}<|im_end|>\n<|im_start|>assistant\n"
        ending = list(self.yes_ids) if self.verdict == "yes" else self.digit_ids[:1]
        return self.tokenizer.encode(text, add_special_tokens=False) + ending

    def prompt(self, record: dict):
        """The question's prompt for the judge's processor (the policy's conversation: system, media, question;
        a text judge gets it without the media)."""
        from app.data.prompts import encode_prompts
        from app.data.records import build_conversation
        from app.runtime.models import is_vl_model

        root = self.data_root or Path(record.get("_root", "."))
        conversation = build_conversation(record, root, self.data_cfg)
        if not is_vl_model(unwrap(self.model)):
            conversation = [{**turn, "content": [item for item in turn["content"] if item.get("type") == "text"]}
                            if isinstance(turn["content"], list) else turn for turn in conversation]
        return encode_prompts(self.processor, [conversation])

    def group_scores(self, prompts: dict, completions: Sequence[str], reference: str, mode: str = "grouped"):
        """The reward of each completion of one group: P("yes"), or the expected score in [0, 1]."""
        if self.verdict == "yes":
            return [float(torch.tensor(v).exp()) for v in self.group_log_scores(prompts, completions, reference, mode)]
        log_p = self.digit_logprobs(prompts, completions, reference, mode)  # [N, 10], normalised over the vocabulary
        self.digit_mass += log_p.logsumexp(-1).exp().tolist()
        weights = log_p.softmax(-1)  # renormalised over the digits
        return (weights @ torch.arange(10, dtype=weights.dtype) / 9).tolist()

    def _rows(self, prompts: dict, completions: Sequence[str], reference: str):
        rows = [self.response_ids(c, reference) for c in completions]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=self.device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.device)
        return {k: v.to(self.device) for k, v in prompts.items()}, ids, mask

    def _scores(self, prompts, ids, mask, mode):
        return completion_logprobs(self.model, prompts, ids, mask, [len(ids)], mode=mode, chunk_size=self.chunk_size,
                                   vision_calls=MODALITIES if self.partitioned else None)

    @torch.no_grad()
    def group_log_scores(self, prompts: dict, completions: Sequence[str], reference: str, mode: str = "grouped"):
        """log P("yes") for each completion of one group: ``grouped`` (one packed row) or ``repeated`` ([P; Ri]
        each)."""
        prompts, ids, mask = self._rows(prompts, completions, reference)
        scores = self._scores(prompts, ids, mask, mode)
        k = len(self.yes_ids)  # the verdict's tokens end each row: P(yes) is the product of their probabilities
        last = (mask.sum(1) - 1)[:, None] - torch.arange(k, device=self.device)[None, :]
        return scores.logprobs.float().gather(1, last).sum(1).tolist()

    @torch.no_grad()
    def digit_logprobs(self, prompts: dict, completions: Sequence[str], reference: str, mode: str = "grouped"):
        """[N, 10] float32: log p(digit d) at each completion's answer position, normalised over the whole
        vocabulary. Read in the same forward: a hook on the output head takes the N hidden states that predict
        each row's last token (before the chunked head turns them into target log-probs) and applies the head's
        own weights to them."""
        prompts, ids, mask = self._rows(prompts, completions, reference)
        last = mask.sum(1) - 1
        if mode == "grouped":  # the packed row keeps only predicting positions, in the layout's target order
            layout = GroupLayout.from_masks(prompts["attention_mask"], mask, [len(ids)])
            wanted = torch.arange(len(ids), device=self.device) * ids.shape[1] + last
            order = layout.target_index.to(self.device)
            pick = (order[None, :] == wanted[:, None]).int().argmax(1)

            def select(hidden):
                return hidden[0, pick]
        else:  # [N, width + 1, H]: position j predicts completion token j

            def select(hidden):
                return hidden[torch.arange(len(ids), device=hidden.device), last]

        head = unwrap(self.model).get_output_embeddings()
        found: list[torch.Tensor] = []

        def read(module, args):  # runs after ZeRO-3's own pre-hook has gathered the head's weight
            logits = torch.nn.functional.linear(select(args[0]), module.weight, module.bias).float()
            found.append(logits.log_softmax(-1)[:, self.digit_ids])

        handle = head.register_forward_pre_hook(read)
        try:
            self._scores(prompts, ids, mask, mode)
        finally:
            handle.remove()
        return found[0].cpu()

    def __call__(self, completions: Sequence[str], records: Sequence[dict], group_sizes: Sequence[int]):
        from app.common.groups import group_slices
        from app.rewards.rules import solution_answer

        out: list[float] = []
        for rows in group_slices(group_sizes):
            record = records[rows.start]
            out += self.group_scores(self.prompt(record), completions[rows], solution_answer(record["solution"]))
        return out


def build_judge(rewards_cfg, data_cfg, model_cfg, device: torch.device, ds_config: dict | None = None):
    """The configured judge (``rewards.judge_path``), loaded in ``model.dtype`` on ``device`` (partitioned like the
    reference model when ``ds_config`` is ZeRO-3); None when ``rewards.functions`` has no ``judge``."""
    if "judge" not in rewards_cfg.functions:
        return None
    from app.runtime.models import DTYPES, check_checkpoint, load_model, load_processor
    from app.runtime.zero import build_reference, zero_stage

    if not rewards_cfg.judge_path:
        raise JudgeError("rewards.functions lists judge but rewards.judge_path is empty (a local checkpoint)")
    path = check_checkpoint(rewards_cfg.judge_path, "rewards.judge_path")
    model = load_model(path, dtype=DTYPES[model_cfg.dtype], attn_implementation=model_cfg.vision_attention,
                       trust_remote_code=model_cfg.trust_remote_code)
    partitioned = bool(ds_config) and zero_stage(ds_config) == 3
    model = build_reference(model, ds_config or {}, device) if partitioned else model.requires_grad_(False).to(device)
    root = data_cfg.data_root or str(Path(data_cfg.train_file).parent)
    return GroupedJudge(model, load_processor(path, trust_remote_code=model_cfg.trust_remote_code), data_cfg, root,
                        rewards_cfg.judge_template, device=device, verdict=rewards_cfg.judge_verdict,
                        partitioned=partitioned)
