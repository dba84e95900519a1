"""Run under torchrun with S processes (gloo): the sequence-parallel grouped forward against the one-rank grouped
forward on the same inputs, for every CPU attention backend.

Argument: a JSON file {"family", "checkpoint", "videos", "kinds", "group_sizes", "out", "freeze_tower",
"backends", "chunk_size"} (backends: default every CPU backend; chunk_size: the output head's, default 1024, 0 =
whole logits). Every rank
builds the same prompts and completions; rank 0 writes the largest relative log-prob and gradient differences
(gradients: the SP ranks' parts summed) per backend, and which parameters got no gradient.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from app.grouping import completion_logprobs, usable_backends
from app.grouping.sequence_parallel import SequenceParallel, sequence_parallel_scores
from app.runtime.distributed import exit_worker
from tests.helpers import load, max_rel_diff, prompt_batch, random_completions


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, processor = load(spec["family"], {spec["family"]: spec["checkpoint"]})
    if spec.get("freeze_tower"):
        for p in model.model.visual.parameters():
            p.requires_grad_(False)
    prompts = prompt_batch(spec["family"], processor, spec["videos"], spec["kinds"])
    sizes = spec["group_sizes"]
    lengths = [5, 9, 3, 7, 4, 8, 6, 2][: sum(sizes)]
    ids, mask = random_completions(lengths, model.config.get_text_config().vocab_size, 0, seed=2)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    sp = SequenceParallel(rank=rank, size=size)
    report = {}
    for backend in spec.get("backends") or usable_backends("cpu"):
        model.zero_grad(set_to_none=True)
        scores = completion_logprobs(model, prompts, ids, mask, sizes, backend=backend, return_entropy=True)
        ref = scores.logprobs
        (ref * weights).sum().backward()
        ref_grads = {n: p.grad.clone() for n, p in params.items()}
        model.zero_grad(set_to_none=True)
        mine = sequence_parallel_scores(model, prompts, ids, mask, sizes, sp, backend=backend, return_entropy=True,
                                        chunk_size=spec.get("chunk_size", 1024))
        got = mine.logprobs
        (got * weights).sum().backward()
        grads = {}
        for n, p in params.items():
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            grads[n] = g
        worst = max(params, key=lambda n: max_rel_diff(grads[n], ref_grads[n]))
        report[backend] = {"logprob": max_rel_diff(got.detach(), ref.detach()),
                           "entropy": max_rel_diff(mine.entropy, scores.entropy),
                           "grad": max_rel_diff(grads[worst], ref_grads[worst]), "worst": worst,
                           "no_grad": sorted(n for n in params if params[n].grad is None and
                                             ref_grads[n].abs().sum() > 0 and rank == 0),
                           "masked_zero": bool((got.detach()[~mask.bool()] == 0).all())}
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump({"size": size, "report": report}, f)
    exit_worker()


if __name__ == "__main__":
    main(sys.argv[1])
