"""Run under torchrun with 2 or 4 processes: a tiny mixture-of-experts model under ZeRO-3, once as transformers builds
it (EP = 1) and once with its sparse blocks split over groups of 2 ranks by DeepSpeed's AutoEP (EP = 2, the section
the trainer writes: ``app.runtime.expert_parallel.section``), both in this process.

Each rank has its own prompts (its own video question, its own group size; an even and an odd rank differ), so the
ranks route differently and decode for different numbers of steps; under EP = 2 every sparse layer is an all-to-all between them, so a rank
that finished must keep stepping with the other. Writes rank{r}.json: the two models' rollouts (grouped engine
greedy with an early stop on rank 0, chunked prefill, seeded sampling with the routing recorded; hf generate
seeded), their log-probs with that record replayed (grouped, and repeated on each), two questions on one video packed
as one family against apart on each, and one SGD step (lr 1: the
change is the gradient) on the same loss with the router statistics' gradient in it, compared in transformers' names
and layout (``zero.gathered_state_dict``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import app  # noqa: F401
from app.data.prompts import encode_prompts
from app.data.video import video_element
from app.grouping import completion_logprobs
from app.rollout.generate import SamplingConfig, generate_groups
from app.runtime import distributed, expert_parallel, zero
from app.runtime.models import load_model, load_processor

CHUNK = 16  # prompt positions per prefill call


def engine_of(checkpoint: str, ds_config: dict):
    model = load_model(checkpoint)
    model.requires_grad_(True)
    return zero.build_engine(model, ds_config, torch.optim.SGD(model.parameters(), lr=1.0), None)


def rollouts(engine, prompts, size, tokenizer, eos) -> dict:
    greedy = SamplingConfig(temperature=0, max_new_tokens=10)
    sampled = SamplingConfig(max_new_tokens=8, seed=7)
    with zero.gathered_for_inference(engine, "full") as (module, collective):
        out = {"collective": collective,
               "greedy": generate_groups(module, prompts, size, greedy, tokenizer=tokenizer, eos_ids=eos,
                                         synced=collective),
               "chunked": generate_groups(module, prompts, size, greedy, tokenizer=tokenizer, eos_ids=eos,
                                          synced=collective, prefill_chunk_size=CHUNK),
               "sampled": generate_groups(module, prompts, size, sampled, tokenizer=tokenizer, synced=collective,
                                          record_routing=True),
               "hf": generate_groups(module, prompts, size, sampled, tokenizer=tokenizer, synced=collective,
                                     engine="hf")}
    return out


def main(checkpoint: str, video: str, out: str) -> None:
    rank, world = distributed.init_distributed()
    base = zero.load_deepspeed_config("deepspeed_configs/zero3.json", gradient_accumulation_steps=1,
                                      max_grad_norm=1e9, dtype="float32")
    from transformers import AutoConfig

    split = {**base, "expert_parallel": expert_parallel.section(AutoConfig.from_pretrained(checkpoint), 2)}
    keep = zero.hf_deepspeed_config(base)
    torch.manual_seed(0)
    engines = {1: engine_of(checkpoint, base), 2: engine_of(checkpoint, split)}
    processor = load_processor(checkpoint)
    tokenizer = processor.tokenizer
    question = ["What colour is the square?", "How many squares are there, counting the small ones in the corners "
                "and the large one in the middle, if any of them moves at all during the clip?"][rank % 2]
    conversation = [{"role": "user", "content": [video_element(video, fps=2, min_pixels=3136, max_pixels=3136),
                                                 {"type": "text", "text": question}]}]
    prompts = encode_prompts(processor, [conversation])
    size = 2 + rank % 2
    free = None
    result = {"world": world, "ep_of": {str(ep): expert_parallel.size_of(e) for ep, e in engines.items()},
              "keep": keep is not None, "prefill_chunks": -(-prompts["input_ids"].shape[1] // CHUNK)}
    runs = {}
    for ep, engine in engines.items():
        engine.eval()
        if free is None:  # rank 0 stops at its third greedy token, rank 1 runs to the limit
            with zero.gathered_for_inference(engine, "full") as (module, collective):
                free = generate_groups(module, prompts, size, SamplingConfig(temperature=0, max_new_tokens=10),
                                       tokenizer=tokenizer, eos_ids=[], synced=collective)
        eos = [int(free.completion_ids[0, 2])] if rank % 2 == 0 else []
        runs[ep] = rollouts(engine, prompts, size, tokenizer, eos)
        result[f"collective_{ep}"] = runs[ep]["collective"]
        result[f"greedy_steps_{ep}"] = runs[ep]["greedy"].completion_ids.shape[1]
    one, two = runs[1], runs[2]
    for name in ("greedy", "chunked", "sampled", "hf"):
        result[f"{name}_equal"] = torch.equal(one[name].completion_ids, two[name].completion_ids)
    record = one["sampled"].routing
    from app.grouping.checks.routing import disagreements

    agree = disagreements(record, two["sampled"].routing, prompts["attention_mask"], one["sampled"].completion_mask)
    result["record_tokens_apart"], result["record_tokens"] = agree["tokens"], agree["real_tokens"]
    ids, mask = one["sampled"].completion_ids, one["sampled"].completion_mask
    for ep, engine in engines.items():  # grouped against repeated on each model, the record replayed
        with torch.no_grad():
            repeated = completion_logprobs(engine, prompts, ids, mask, size, mode="repeated", routing=record)
            grouped = completion_logprobs(engine, prompts, ids, mask, size, routing=record)
        result[f"repeated_max_abs_{ep}"] = float((repeated.logprobs - grouped.logprobs).abs().max())
    # two questions on one video, packed as one family [V; Q1; R1*; Q2; R2*] against apart, on both models
    family = encode_prompts(processor, [conversation, [{"role": "user", "content": [
        conversation[0]["content"][0], {"type": "text", "text": "Is anything moving?"}]}]])
    generator = torch.Generator().manual_seed(50 + rank)
    family_ids = torch.randint(10, 400, (4, 6), generator=generator)
    family_mask = torch.ones_like(family_ids)
    shared = {}
    for ep, engine in engines.items():
        with torch.no_grad():
            shared[ep] = completion_logprobs(engine, family, family_ids, family_mask, [2, 2], families=[2]).logprobs
            apart = completion_logprobs(engine, family, family_ids, family_mask, [2, 2]).logprobs
        result[f"family_vs_apart_{ep}"] = float((shared[ep] - apart).abs().max())
    result["family_max_abs"] = float((shared[1] - shared[2]).abs().max())
    scores, deltas, weights_after = {}, {}, {}
    for ep, engine in engines.items():
        before = zero.gathered_state_dict(engine)
        engine.train()
        got = completion_logprobs(engine, prompts, ids, mask, size, routing=record, router_statistics="loss")
        weights = torch.linspace(0.5, 1.5, ids.numel()).view_as(ids)
        loss = -(got.logprobs * weights).sum() + 0.1 * got.router.probability.pow(2).sum()
        engine.backward(loss)
        engine.step()
        after = zero.gathered_state_dict(engine)
        scores[ep] = got.logprobs.detach()
        result[f"finite_after_{ep}"] = all(bool(torch.isfinite(v).all()) for v in (after or {}).values())
        if rank == 0:
            deltas[ep] = {k: after[k] - before[k] for k in after}
            weights_after[ep] = after
    result["logprob_max_abs"] = float((scores[1] - scores[2]).abs().max())
    if rank == 0:
        assert deltas[1].keys() == deltas[2].keys(), sorted(set(deltas[1]) ^ set(deltas[2]))

        def relative(a, b):
            return float((a - b).norm() / b.norm().clamp_min(1e-12))

        moved = [k for k in deltas[1] if deltas[1][k].norm() > 0]
        routed = [k for k in moved if ".mlp.experts." in k or k.endswith("mlp.gate.weight")]
        result["gradient_worst_routed"] = max((relative(deltas[2][k], deltas[1][k]), k) for k in routed)
        result["weights_worst"] = max((relative(weights_after[2][k], weights_after[1][k]), k) for k in moved)
        result["moved"] = [len(moved), len(deltas[1])]
        result["experts_moved"] = sum(1 for k in routed if ".mlp.experts." in k)
        result["routers_moved"] = sum(1 for k in routed if k.endswith("mlp.gate.weight"))
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    distributed.exit_worker()


if __name__ == "__main__":
    main(*sys.argv[1:4])
