"""Run under torchrun with S processes (gloo): the sequence-parallel grouped forward against the one-rank grouped
forward on the same inputs, for every CPU attention backend.

Argument: a JSON file {"family", "checkpoint", "videos", "kinds", "group_sizes", "out", "freeze_tower",
"backends", "chunk_size", "plan", "families", "lora"} (backends: default every CPU backend; chunk_size: the output
head's, default 1024, 0 = whole logits; plan + families: questions sharing a video, ``tests.test_families``'s
prompts (per prompt the video it asks about, -1 text) packed as families, each compared with the one-rank forward of
the same families AND the one-rank per-question forward (k = 1), under "k1_logprob" / "k1_grad"; lora: a LoRA rank,
the base frozen; "flash" among the backends runs flash-attn's varlen call played by SDPA). Every rank builds the
same prompts and completions; rank 0 writes the largest relative log-prob and gradient differences (gradients: the
SP ranks' parts summed) per backend, and which parameters got no gradient. A model with QSA layers (Qwen3.8-Flash-Next)
also writes, under "selection", whether every rank's queries chose the keys the one-rank forward's chose in every
QSA layer, and looked up the same n-gram rows in every PLE layer (first backend), and how many queries dropped keys.
"""

from __future__ import annotations

import contextlib
import json
import sys

import torch
import torch.distributed as dist

from app.grouping import completion_logprobs, usable_backends
from app.grouping.sequence_parallel import SequenceParallel, sequence_parallel_scores
from app.runtime.distributed import exit_worker
from tests.helpers import load, max_rel_diff, prompt_batch, random_completions


def main(spec_path: str) -> None:
    dist.init_process_group("gloo")
    run(json.loads(open(spec_path).read()))
    exit_worker()


def run(spec: dict) -> None:
    """One job on the initialised process group (``tests.workers.jobs`` runs several in one launch)."""
    torch.manual_seed(0)
    model, processor = load(spec["family"], {spec["family"]: spec["checkpoint"]})
    if spec.get("freeze_tower"):
        for p in model.model.visual.parameters():
            p.requires_grad_(False)
    if spec.get("lora"):
        from app.config.sections import LoRAConfig
        from app.runtime.lora import apply

        apply(model, LoRAConfig(rank=spec["lora"], alpha=2.0 * spec["lora"]))
        for p in model.parameters():  # adapters start at B = 0: give them values, so their gradients are not trivial
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(p.numel()))
    families = spec.get("families")
    sizes = spec["group_sizes"]
    if families:
        from app.data.prompts import encode_prompts
        from tests.test_families import family_conversations

        prompts = encode_prompts(processor, family_conversations(spec["family"], spec["videos"], spec["plan"]))
    else:
        prompts = prompt_batch(spec["family"], processor, spec["videos"], spec["kinds"])
    had_flash = sys.modules.get("flash_attn")
    if "flash" in (spec.get("backends") or ()):
        import types

        from tests.test_attention import sdpa_varlen

        sys.modules["flash_attn"] = types.SimpleNamespace(flash_attn_varlen_func=sdpa_varlen)
    try:
        _compare(spec, model, prompts, families, sizes)
    finally:  # the next job in the launch sees the modules as they were
        if had_flash is None:
            sys.modules.pop("flash_attn", None)
        else:
            sys.modules["flash_attn"] = had_flash


def _compare(spec: dict, model, prompts, families, sizes) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    lengths = [5, 9, 3, 7, 4, 8, 6, 2, 5, 3, 7, 4][: sum(sizes)]
    ids, mask = random_completions(lengths, model.config.get_text_config().vocab_size, 0, seed=2)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    sp = SequenceParallel(rank=rank, size=size)
    from app.grouping.checks.routing import disagreements
    from app.grouping.experts.blocks import expert_shape
    from app.objectives.router import load_balancing_loss

    moe = expert_shape(model) is not None

    def objective(scores):
        aux = load_balancing_loss(scores.router) if moe else 0.0
        return (scores.logprobs * weights).sum() + 10.0 * aux

    def one_rank(backend, families):
        model.zero_grad(set_to_none=True)
        router = {"router_statistics": "loss", "record_routing": True} if moe else {}
        scores = completion_logprobs(model, prompts, ids, mask, sizes, backend=backend, return_entropy=True,
                                     families=families, **router)
        objective(scores).backward()
        return scores, {n: p.grad.clone() for n, p in params.items()}

    qsa = bool(getattr(model.config.get_text_config(), "indexer_budget", None))
    report = {}
    for backend in spec.get("backends") or usable_backends("cpu"):
        probe = qsa and "selection" not in report
        with recorded(model, probe) as ref_choices:
            scores, ref_grads = one_rank(backend, families)
        ref = scores.logprobs
        model.zero_grad(set_to_none=True)
        with recorded(model, probe) as sp_choices:
            if moe:  # through completion_logprobs, as the trainer asks for the routers' sums
                mine = completion_logprobs(model, prompts, ids, mask, sizes, backend=backend, return_entropy=True,
                                           chunk_size=spec.get("chunk_size", 1024), families=families,
                                           sequence_parallel=sp, router_statistics="loss", record_routing=True)
            else:
                mine = sequence_parallel_scores(model, prompts, ids, mask, sizes, sp, backend=backend,
                                                return_entropy=True, chunk_size=spec.get("chunk_size", 1024),
                                                families=families)
        if probe:
            report["selection"] = same_choices(ref_choices, sp_choices, mine.layout.total_len, sp)
        got = mine.logprobs
        objective(mine).backward()
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
                           "masked_zero": bool((got.detach()[~mask.bool()] == 0).all()),
                           "shared_tokens": int(getattr(mine.layout, "shared_tokens", 0)),
                           "adapters": sum(".lora_" in n for n in params), "params": len(params)}
        if moe:
            ours, theirs = mine.router, scores.router
            report[backend].update(
                router=max(max_rel_diff(getattr(ours, k).detach(), getattr(theirs, k).detach())
                           for k in ("load", "probability", "entropy", "tokens")),
                aux=abs(float(load_balancing_loss(ours)) - float(load_balancing_loss(theirs))),
                flipped=disagreements(mine.routing, scores.routing, prompts["attention_mask"], mask)["tokens"])
        if moe and not report.get("replay"):  # routing replay (r3) under SP, first backend: a record that sends
            # every completion token to a neighbouring expert (so replay changes the log-probs), on both sides
            from app.grouping.experts.record import Routing

            record = scores.routing
            shifted = Routing(record.prompt, torch.where(record.completion >= 0, (record.completion + 1) %
                                                         expert_shape(model).experts, record.completion), record.layers)
            replay = {"routing": shifted, "router_statistics": "loss"}
            model.zero_grad(set_to_none=True)
            alone = completion_logprobs(model, prompts, ids, mask, sizes, backend=backend, families=families, **replay)
            objective(alone).backward()
            alone_grads = {n: p.grad.clone() for n, p in params.items()}
            model.zero_grad(set_to_none=True)
            spread = completion_logprobs(model, prompts, ids, mask, sizes, backend=backend, families=families,
                                         sequence_parallel=sp, chunk_size=spec.get("chunk_size", 1024), **replay)
            objective(spread).backward()
            differs = spread.replay_differs  # summed over the group's shards
            worst = 0.0
            for n, p in params.items():
                g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(g)
                worst = max(worst, max_rel_diff(g, alone_grads[n]))
            report["replay"] = {"logprob": max_rel_diff(spread.logprobs.detach(), alone.logprobs.detach()),
                                "moved": float((alone.logprobs - ref).abs().max()), "grad": worst,
                                "differs": differs.tolist(), "alone_differs": alone.replay_differs.tolist()}
        if families:  # against the one-rank forward of each question on its own (k = 1)
            k1, k1_grads = one_rank(backend if backend in ("split", "masked", "flash") else "split", None)
            worst = max(params, key=lambda n: max_rel_diff(grads[n], k1_grads[n]))
            report[backend].update(k1_logprob=max_rel_diff(got.detach(), k1.logprobs.detach()),
                                   k1_grad=max_rel_diff(grads[worst], k1_grads[worst]), k1_worst=worst)
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump({"size": size, "report": report}, f)


def recorded(model, on: bool):
    """``checks.sparse.recorded_choices`` when ``on`` (the QSA key masks and PLE lookups of the block), else None."""
    from app.grouping.checks.sparse import recorded_choices

    return recorded_choices(model) if on else contextlib.nullcontext(None)


def same_choices(whole: dict, mine: dict, total: int, sp) -> dict:
    """This rank's shard of every QSA layer's key masks and every PLE layer's n-gram rows against the one-rank
    forward's rows for the same positions; the verdicts agreed over the group (every rank's must hold)."""
    from app.grouping.checks.sparse import by_layer
    from app.grouping.sequence_parallel import shard_bounds

    start, end = shard_bounds(total, sp.size)[sp.rank]
    ref_layers, sp_layers = by_layer(whole["qsa"], total), by_layer(mine["qsa"], end - start)
    qsa = len(ref_layers) == len(sp_layers) > 0 and all(
        torch.equal(a[0][start:end], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ref_layers, sp_layers))
    ngram = len(whole["ngram"]) == len(mine["ngram"]) > 0 and all(
        torch.equal(a.reshape(total, -1)[start:end], b.reshape(end - start, -1))
        for a, b in zip(whole["ngram"], mine["ngram"]))
    dropped = sum(int((m.sum(1) < ranks[:total] + 1).sum()) for m, ranks, _ in ref_layers)  # fewer than it sees
    verdict = torch.tensor([int(qsa), int(ngram)])
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    return {"qsa_equal": bool(verdict[0]), "ngram_equal": bool(verdict[1]), "layers": len(ref_layers),
            "ple_calls": len(whole["ngram"]), "dropped_queries": dropped}


if __name__ == "__main__":
    main(sys.argv[1])
