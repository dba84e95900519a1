"""Run under torchrun with 2 processes: grouped rollouts with the policy partitioned by ZeRO-3.

Each rank has its own prompts, group size and an EOS that stops its samples at a different step, so the ranks
decode for different numbers of steps; ZeRO-3 gathers parameters collectively at every forward, so a rank that
finished early must keep stepping with the others. Writes rank{r}.json into the output folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import app  # noqa: F401
from app.data.prompts import encode_prompts
from app.data.video import video_element
from app.rollout.generate import SamplingConfig, generate_groups
from app.runtime import distributed, zero
from app.runtime.models import load_model, load_processor

CHUNK = 16  # prompt positions per prefill call


def main(checkpoint: str, video: str, out: str) -> None:
    rank, world = distributed.init_distributed()
    ds_config = zero.load_deepspeed_config("deepspeed_configs/zero3.json", gradient_accumulation_steps=1,
                                                  max_grad_norm=1.0, dtype="float32")
    keep = zero.hf_deepspeed_config(ds_config)
    model = load_model(checkpoint)
    engine = zero.build_engine(model, ds_config, torch.optim.AdamW(model.parameters(), lr=1e-3), None)
    partitioned = all(getattr(p, "ds_numel", None) is not None for p in engine.module.parameters())
    processor = load_processor(checkpoint)
    tokenizer = processor.tokenizer
    questions = ["What colour is the square?", "How many squares are there, counting the small ones in the corners "
                 "and the large one in the middle, if any of them moves at all during the clip?"][: rank + 1]
    conversations = [[{"role": "user", "content": [video_element(video, fps=2, min_pixels=3136, max_pixels=3136),
                                                   {"type": "text", "text": q}]}] for q in questions]
    prompts = encode_prompts(processor, conversations)
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    free = generate_groups(engine.module, prompts, 2 + rank, greedy, tokenizer=tokenizer, eos_ids=[])
    # Rank 0 stops at its third token, rank 1 runs to the limit: uneven decode lengths across ranks.
    eos = [int(free.completion_ids[0, 2])] if rank == 0 else []
    cut = generate_groups(engine.module, prompts, 2 + rank, greedy, tokenizer=tokenizer, eos_ids=eos)
    # Chunked prefill: rank 1's longer prompt takes more chunks; rank 0 joins with idle calls (collective layers).
    chunked = generate_groups(engine.module, prompts, 2 + rank, greedy, tokenizer=tokenizer, eos_ids=[],
                              prefill_chunk_size=CHUNK)
    sampled = generate_groups(engine.module, prompts, 2 + rank, SamplingConfig(max_new_tokens=6 + 4 * rank, seed=rank),
                              tokenizer=tokenizer)
    # Gathered once, hooks off (rollout.zero3_gather=full): the same greedy tokens, no collective per step.
    with zero.gathered_for_inference(engine, "full") as (module, collective):
        whole_inside = all(p.numel() == p.ds_numel for p in module.parameters())
        gathered = generate_groups(module, prompts, 2 + rank, greedy, tokenizer=tokenizer, eos_ids=[],
                                   synced=collective)
    # Layer by layer (rollout.zero3_gather=layerwise): collective forwards, the same greedy tokens, also when one
    # rank stops early and idles while the other decodes on.
    layer_whole = []
    with zero.gathered_for_inference(engine, "layerwise") as (module, layer_collective):
        probe = zero.decoder_layers(module)[0].register_forward_pre_hook(
            lambda layer, *_: layer_whole.append(all(p.numel() == p.ds_numel for p in layer.parameters())))
        layered = generate_groups(module, prompts, 2 + rank, greedy, tokenizer=tokenizer, eos_ids=[],
                                  synced=layer_collective)
        layered_cut = generate_groups(module, prompts, 2 + rank, greedy, tokenizer=tokenizer, eos_ids=eos,
                                      synced=layer_collective)
        layered_chunked = generate_groups(module, prompts, 2 + rank, greedy, tokenizer=tokenizer, eos_ids=[],
                                          synced=layer_collective, prefill_chunk_size=CHUNK)
        probe.remove()
        other_layers_partitioned = all(p.numel() == 0 for p in zero.decoder_layers(module)[1].parameters()
                                       if not p.ds_persist)
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    repartitioned = all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters()
                        if not p.ds_persist)
    # The hooks are back: a training step through the engine still works and changes the partitions.
    from app.grouping import completion_logprobs

    before = [p.ds_tensor.clone() for p in engine.module.parameters()]
    engine.train()
    scores = completion_logprobs(engine, prompts, gathered.completion_ids, gathered.completion_mask, 2 + rank)
    engine.backward(-scores.logprobs.sum())
    engine.step()
    stepped = any(not torch.equal(a, p.ds_tensor) for a, p in zip(before, engine.module.parameters()))
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({
        "world": world, "partitioned": partitioned, "free": free.completion_ids.tolist(),
        "cut_lengths": cut.completion_mask.sum(1).tolist(), "cut_steps": cut.completion_ids.shape[1],
        "sampled_shape": list(sampled.completion_ids.shape), "prompts": questions, "keep": keep is not None,
        "gathered_equal": torch.equal(gathered.completion_ids, free.completion_ids), "collective": collective,
        "whole_inside": whole_inside, "repartitioned": repartitioned, "stepped_after": stepped,
        "layerwise_equal": torch.equal(layered.completion_ids, free.completion_ids),
        "layerwise_cut_equal": torch.equal(layered_cut.completion_ids, cut.completion_ids),
        "layerwise_collective": layer_collective, "layer_whole_when_run": bool(layer_whole) and all(layer_whole),
        "other_layers_partitioned": other_layers_partitioned,
        "prefill_chunks": -(-prompts["input_ids"].shape[1] // CHUNK),
        "chunked_equal": torch.equal(chunked.completion_ids, free.completion_ids),
        "layerwise_chunked_equal": torch.equal(layered_chunked.completion_ids, free.completion_ids),
    }))
    distributed.exit_worker()  # leaves without the interpreter's finalization, where a worker once aborted


if __name__ == "__main__":
    main(*sys.argv[1:4])
