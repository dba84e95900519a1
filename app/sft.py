"""A short supervised warm start that teaches the answer FORMAT only.

Targets are ``<think>{reasoning}</think><answer>{letter}</answer>`` with the letter drawn uniformly at random,
independent of the video: the model learns to write the tags and a valid option letter, and its accuracy stays at
chance. Any accuracy gain after this stage comes from GRPO.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from app.data.prompts import collate_prompts
from app.data.records import load_stream
from app.grouping import completion_logprobs
from app.models import load_model, load_processor

FORMAT_REASONING = "I look at the video and the options."


def format_target(record: dict, rng: random.Random) -> str:
    options = record.get("options") or ["A", "B", "C", "D"]
    letter = "ABCDEFGH"[rng.randrange(len(options))]
    return f"<think>{FORMAT_REASONING}</think><answer>{letter}</answer>"


def warm_start(model_dir: str | Path, out_dir: str | Path, data_cfg, steps: int = 60, batch_size: int = 8,
               learning_rate: float = 2e-3, seed: int = 0, log=print) -> Path:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    processor = load_processor(model_dir)
    tokenizer = getattr(processor, "tokenizer", processor)
    model = load_model(model_dir)
    model.train()
    stream = load_stream(data_cfg, processor, seed, 0, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for step in range(steps):
        prompts = stream.next_prompts(batch_size)
        targets = [tokenizer(format_target(p.record, rng), add_special_tokens=False)["input_ids"] + [eos]
                   for p in prompts]
        width = max(len(t) for t in targets)
        ids = torch.tensor([t + [tokenizer.pad_token_id] * (width - len(t)) for t in targets])
        mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in targets])
        batch = collate_prompts([p.inputs for p in prompts], tokenizer.pad_token_id)
        scores = completion_logprobs(model, batch, ids, mask, 1)
        loss = -(scores.logprobs.sum() / mask.sum())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == steps - 1:
            log(f"format warm start {step + 1}/{steps}: loss {loss.item():.3f}")
    out = Path(out_dir)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out
