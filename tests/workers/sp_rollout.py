"""Run under torchrun with S processes (gloo): the rollout of a sequence-parallel group (``SharedInGroup`` over the
grouped engine) against one rank's rollout of every prompt, greedy.

Argument: a JSON file {"family", "checkpoint", "videos", "plan", "out", "chunk"}: ``plan`` as in
``tests.test_families`` (per prompt the video it asks about; consecutive equal entries are a family sharing it);
``chunk``: rollout.prefill_chunk_size; ``setting``: rollout.sp_split; ``record``: routing replay's record (a MoE
family), gathered with the rollout. Rank 0 writes whether tokens, masks and stop reasons are equal, the largest
log-prob difference, and how many prompt tokens each rank prefilled.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from app.data.prompts import encode_prompts
from app.grouping.sequence_parallel import SequenceParallel
from app.rollout.base import EngineSetup, SharedInGroup
from app.rollout.generate import SamplingConfig, generate_groups
from app.rollout.local import LocalEngine
from app.runtime.distributed import exit_worker
from app.runtime.parallel import ParallelContext
from tests.helpers import load, tokenizer_of
from tests.test_families import family_conversations


def main(spec_path: str) -> None:
    dist.init_process_group("gloo")
    run(json.loads(open(spec_path).read()))
    exit_worker()


def run(spec: dict) -> None:
    """One job on the initialised process group (``tests.workers.jobs`` runs several in one launch)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    model, processor = load(spec["family"], {spec["family"]: spec["checkpoint"]})
    model.eval()
    tok = tokenizer_of(processor)
    conversations = family_conversations(spec["family"], spec["videos"], spec["plan"])
    prompts = []
    for i, (conversation, which) in enumerate(zip(conversations, spec["plan"])):
        inputs = encode_prompts(processor, [conversation])
        prompts.append(SimpleNamespace(inputs=inputs, share=("video", which) if which >= 0 else None,
                                       length=int(inputs["attention_mask"].sum()), record={"problem_id": i}))
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=12)
    seeds = [11 * i + 3 for i in range(len(prompts))]
    record = bool(spec.get("record"))  # routing replay on a MoE family: the record travels with the rollout
    rollout_cfg = SimpleNamespace(zero3_gather="full", decode="auto", prefill_chunk_size=spec.get("chunk", 0),
                                  routing_replay="r3" if record else "off")
    setup = EngineSetup(policy=model, tokenizer=tok, sampling=sampling, device=torch.device("cpu"), eos_ids=[],
                        pad_id=tok.pad_token_id, rollout=rollout_cfg)
    group = ParallelContext(rank=rank, world=size, sp=SequenceParallel(rank=rank, size=size, group=None))
    seen = []
    inner = LocalEngine("grouped", setup)
    generate = inner.generate

    def counting(ps, g, s, sampling=None, **kwargs):
        out = generate(ps, g, s, sampling, **kwargs)
        seen.append(out.prefill_tokens)
        return out

    inner.generate = counting
    adapter = SharedInGroup(inner, group, pad_id=tok.pad_token_id, setting=spec.get("setting", "auto"))
    got = adapter.generate(prompts, 2, seeds)
    from app.data.prompts import collate_prompts
    from app.grouping.families import family_sizes

    whole = generate_groups(model, collate_prompts([p.inputs for p in prompts], tok.pad_token_id, torch.device("cpu")),
                            2, sampling, tokenizer=tok, eos_ids=[], pad_id=tok.pad_token_id, prompt_seeds=seeds,
                            prefill_chunk_size=spec.get("chunk", 0), synced=False,
                            families=family_sizes([p.share for p in prompts]), record_routing=record)
    prefilled = [torch.zeros(1, dtype=torch.long) for _ in range(size)]
    dist.all_gather(prefilled, torch.tensor([sum(seen)]))
    if rank == 0:
        report = {"size": size, "tokens_equal": bool(torch.equal(got.completion_ids, whole.completion_ids)),
                  "mask_equal": bool(torch.equal(got.completion_mask, whole.completion_mask)),
                  "reasons_equal": got.stop_reasons == whole.stop_reasons, "sizes": got.group_sizes,
                  "logprob": float((got.logprobs - whole.logprobs).abs().max()),
                  "prefilled_per_rank": [int(p) for p in prefilled], "prefill_whole": whole.prefill_tokens,
                  "prefill_group": got.prefill_tokens, "prompt_tokens": got.prompt_tokens, "split": adapter.split}
        if record:
            from app.grouping.checks.routing import disagreements

            mask = whole.completion_mask
            fed = mask.bool() & (torch.arange(mask.shape[1])[None] < (mask.sum(1) - 1)[:, None])
            real = collate_prompts([p.inputs for p in prompts], tok.pad_token_id, torch.device("cpu"))["attention_mask"]
            report["routing"] = {**disagreements(got.routing, whole.routing, real, fed),
                                 "shapes_equal": got.routing.prompt.shape == whole.routing.prompt.shape,
                                 "layers_equal": got.routing.layers == whole.routing.layers}
        with open(spec["out"], "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
