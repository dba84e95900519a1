"""Run under torchrun with S processes (gloo, or several replicas of S): a rollout spread over each sequence-parallel
group (``generate_groups(..., spread=...)``: every rank of a group samples every prompt, each with 1/S of the
tower, the prefills and the K/V) against one process's plain rollout of the same prompts, greedy or seeded.

Argument: a JSON file {"family", "checkpoint", "videos", "plan", "out", "chunk", "sp", "decode", "setup",
"temperature", "max_new"}: ``plan`` as in ``tests.test_families``; ``sp``: S (the world holds world / S
replicas, each sampling the same prompts); ``setup``: "plain", "lora" or "frozen" (the tower frozen, LoRA on the
language model). Every rank writes its report to out.RANK.json: whether its tokens, masks and stop reasons equal
the plain rollout's, the largest log-prob difference, and its own work: the tower's patch rows, the prompt
positions it ran through the layers, the K/V bytes it holds after the prefill; on a mixture-of-experts family both
rollouts record their routing (``routing_replay``), and the report says where the records part.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from app.data.prompts import encode_prompts
from app.grouping.families import family_sizes
from app.grouping.sequence_parallel import SequenceParallel
from app.rollout.generate import SamplingConfig, generate_groups
from app.runtime.distributed import exit_worker
from app.runtime.models import MOE_FAMILIES
from tests.helpers import load
from tests.test_families import family_conversations


def prepared(model, setup: str):
    if setup == "plain":
        return model
    from types import SimpleNamespace

    from app.config.sections import LoRAConfig
    from app.runtime import lora

    torch.manual_seed(0)  # the adapters start alike on every rank, as the trainer seeds them
    model_cfg = SimpleNamespace(freeze_vision_tower=True, freeze_projector=setup == "frozen")
    model = lora.prepare(model, LoRAConfig(rank=4 if setup == "lora" else 0, alpha=8), model_cfg)
    with torch.no_grad():  # adapters that change the outputs (peft starts them at zero)
        generator = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=generator)
    return model


def run_case(spec: dict, case: dict, sp: SequenceParallel) -> dict:
    family = spec["family"]
    model, processor = load(family, {family: spec["checkpoint"]})
    model = prepared(model, case.get("setup", "plain")).eval()
    tok = getattr(processor, "tokenizer", processor)
    inputs = encode_prompts(processor, family_conversations(family, spec["videos"], case["plan"]))
    shares = [("video", w) if w >= 0 else None for w in case["plan"]]
    sampling = SamplingConfig(temperature=case.get("temperature", 0.0), max_new_tokens=case.get("max_new", 10),
                              seed=3)
    seeds = [11 * i + 3 for i in range(len(case["plan"]))]
    common = dict(tokenizer=tok, eos_ids=case.get("eos", []), pad_id=tok.pad_token_id, prompt_seeds=seeds,
                  prefill_chunk_size=case.get("chunk", 0), synced=False, families=family_sizes(shares),
                  decode=case.get("decode", "eager"))
    moe = family in MOE_FAMILIES  # routing replay: the experts of every token recorded, spread and plain
    if moe:
        common["record_routing"] = True
    patches = []
    visual = getattr(getattr(model, "model", model), "visual", None)
    hook = visual.register_forward_pre_hook(lambda m, args: patches.append(int(args[0].shape[0]))) \
        if visual is not None else None
    kv = {}

    def count(layers):  # a hybrid's GDN layers hold no K/V (None): their states are counted apart
        return sum(x.numel() * x.element_size() for layer in layers for x in layer if x is not None)

    from app.grouping.decoding import decode as decoding

    original = decoding.GroupedDecoder.__init__

    def spying(self, *args, **kwargs):
        original(self, *args, **kwargs)
        kv["roots"] = count(zip(self.cache.roots.keys, self.cache.roots.values)) if self.cache.roots is not None \
            else 0
        kv["questions"] = count(filter(None, self.cache.prefix))
        kv["states"] = self.cache.recurrent.nbytes()  # every sample's GDN states (this rank's heads when spread)

    decoding.GroupedDecoder.__init__ = spying
    from app.grouping.media import keep_share

    held = keep_share(dict(inputs), sp.rank, sp.size)  # this rank's share of the videos' pixels only
    try:
        with torch.no_grad():
            spread = generate_groups(model, held, 2, sampling, spread=sp, **common)
            mine = {"tower_rows": sum(patches), "prefill_tokens": spread.prefill_tokens, **kv,
                    "pixel_rows": int(held["pixel_values_videos"].shape[0])
                    if held.get("pixel_values_videos") is not None else 0}
            patches.clear()
            plain = generate_groups(model, inputs, 2, sampling, **common)
            whole = {"tower_rows": sum(patches), "prefill_tokens": plain.prefill_tokens, **kv,
                     "pixel_rows": int(inputs["pixel_values_videos"].shape[0])
                     if inputs.get("pixel_values_videos") is not None else 0}
    finally:
        decoding.GroupedDecoder.__init__ = original
        if hook is not None:
            hook.remove()
    routing = {}
    if moe:
        from app.grouping.checks.routing import disagreements

        real, record = inputs["attention_mask"].bool(), spread.routing
        fed = plain.completion_mask.bool() & (torch.arange(plain.completion_mask.shape[1])[None]
                                              < (plain.completion_mask.sum(1) - 1)[:, None])
        routing = {"routing_differs": disagreements(record, plain.routing, real, fed),
                   "routing_complete": bool((record.prompt[real] >= 0).all() and (record.prompt[~real] == -1).all()
                                            and (record.completion[fed] >= 0).all())}
    return {**routing, "tokens_equal": bool(torch.equal(spread.completion_ids, plain.completion_ids)),
            "mask_equal": bool(torch.equal(spread.completion_mask, plain.completion_mask)),
            "reasons_equal": spread.stop_reasons == plain.stop_reasons, "reasons": spread.stop_reasons,
            "logprob": float((spread.logprobs - plain.logprobs).abs().max()), "mine": mine, "whole": whole,
            "tokens": spread.completion_ids.tolist()}


def main(spec_path: str) -> None:
    dist.init_process_group("gloo")
    run(json.loads(open(spec_path).read()))
    exit_worker()


def run(spec: dict) -> None:
    """One job on the initialised process group (``tests.workers.jobs`` runs several in one launch)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    size = spec.get("sp", world)
    group = None
    for first in range(0, world, size):  # every rank creates every group, in the same order
        made = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            group = made
    sp = SequenceParallel(rank=rank % size, size=size, group=group)
    cases = spec.get("cases") or [spec]
    report = {"rank": rank, "size": size, "world": world, "cases": [run_case(spec, case, sp) for case in cases]}
    with open(f"{spec['out']}.{rank}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
