"""What crosses the link between GPUs in a step, beside the FLOPs and the memory reads (``timing`` prices it at the
link's bandwidth, ``link_efficiency``, and each collective call at ``collective_ms``): a rollout spread over a
sequence-parallel group's exchanges (``spread_exchanges``), and the routed experts' traffic: their ZeRO-3 gathers and,
under expert parallelism, the all-to-all that sends each token to its experts' ranks (``expert_traffic``)."""

from __future__ import annotations

import math

from app.planning.costs import Shape, Workload
from app.rollout.registry import memory_kind

MOVING = ("prefill", "decode", "rollout_overhead", "reference", "old_policy", "router_counts", "update")  # the phases that move them


def expert_traffic(cfg, shape: Shape, work: Workload, rank, *, ranks: int, stage: int, lora: bool,
                   b: int) -> dict:
    """Per phase, what one rank moves of the routed experts in a step: ``gather``, the bytes ZeRO-3 gathers of them
    (``layers.expert_gather_bytes``: in each training forward, again in the backward, and their gradients'
    reduce-scatter when they train; the rollout's gather: once with rollout.zero3_gather=full, at every decode step
    otherwise); ``exchange``, the bytes of expert parallelism's all-to-all (``layers.exchange_bytes``: each training
    pass's tokens, a checkpointed layer's recompute a third time; the rollout's prompt tokens and each decode step's
    samples); ``calls``, its collective calls (three per sparse layer and pass, each paying ``collective_ms``). The
    rest of the model's ZeRO-3 traffic is not here (the dense part's gathers in the training passes are folded into
    ``update_layer_s``, as before)."""
    from app.objectives.router import counting_passes
    from app.planning.layers import EXCHANGE_COLLECTIVES, exchange_bytes, expert_gather_bytes

    ep = expert_parallel(cfg, shape)
    none = {"gather": 0.0, "exchange": 0.0, "calls": 0.0}
    out = {phase: dict(none) for phase in MOVING}
    if not shape.sparse_layers:
        return out
    gather = expert_gather_bytes(shape, b, ranks, ep) if stage == 3 else 0.0
    calls = EXCHANGE_COLLECTIVES * shape.sparse_layers * (ep > 1)
    batches, mu = rank.micro_batches, cfg.grpo.num_iterations
    one_pass = exchange_bytes(shape, work.grouped_tokens / rank.size, b, ep)  # a micro-batch's packed row (its share)
    recompute = 1 if cfg.model.gradient_checkpointing else 0
    forward = {"gather": batches * gather, "exchange": batches * one_pass, "calls": batches * calls}
    if cfg.grpo.beta > 0:
        out["reference"] = forward
    if mu > 1:
        out["old_policy"] = {k: v * mu for k, v in forward.items()}
    counting = counting_passes(True, cfg.grpo.router_aux_loss_coef, mu)
    out["router_counts"] = {k: v * counting for k, v in forward.items()}
    out["update"] = {"gather": batches * mu * (2 + (not lora)) * gather,  # LoRA freezes the routed experts
                     "exchange": batches * mu * (2 + recompute) * one_pass,
                     "calls": batches * mu * (2 + recompute) * calls}
    k = rank.questions
    prompts = min(rank.prompts, rank.families_here * k)
    shared = work.prefix - work.question if k > 1 else 0
    copies = work.group_size if memory_kind(cfg.rollout.engine) == "per_sample" else 1
    prompt_tokens = (rank.families_here * shared + prompts * (work.prefix - shared)) * copies * rank.share
    chunk = cfg.rollout.prefill_chunk_size
    chunks = rank.families_here * (max(1, math.ceil(work.prefix / chunk)) if chunk else 1)
    out["prefill"] = {"gather": 0.0, "exchange": exchange_bytes(shape, prompt_tokens, b, ep), "calls": chunks * calls}
    steps, samples = work.completion, prompts * work.group_size
    per_step = 0.0 if cfg.rollout.zero3_gather == "full" else gather
    out["decode"] = {"gather": steps * per_step, "exchange": steps * exchange_bytes(shape, samples, b, ep),
                     "calls": steps * calls}
    out["rollout_overhead"] = {"gather": gather - per_step, "exchange": 0.0, "calls": 0.0}
    return out


def expert_parallel(cfg, shape: Shape) -> int:
    """EP, ``train.expert_parallel_size``, for a mixture-of-experts model (1 for a dense one, which the trainer
    refuses at EP > 1 before loading; ``planner.check_expert_parallel`` says so first)."""
    return int(getattr(cfg.train, "expert_parallel_size", 1)) if shape.sparse_layers else 1


def spread_exchanges(shape: Shape, work: Workload, rank, b: int, *, steps: int, samples: int,
                     chunk: int) -> dict:
    """What a spread rollout moves between the S ranks of its group (``app.grouping.decoding.spread``), per rank:

    - the tower's table of embeddings summed over the group (a ring all-reduce: 2 (S - 1) / S of it);
    - the prefills' all-to-alls: per layer and position, q and the output over all query heads and k, v over the
      KV heads (repeated up to S), (S - 1) / S of them leaving the rank; four exchanges per layer and chunk;
    - each decode step's gather of the heads' outputs: one per layer, (S - 1) / S of the samples' outputs.

    Bytes, and collective calls (each also paying a latency: ``collective_ms``, an assumption)."""
    size = rank.size
    away = (size - 1) / size
    positions = rank.families_here * (work.prefix + (rank.questions - 1) * work.question)
    from app.planning.layers import conv_channels

    per_position = (2 * shape.heads + 2 * max(shape.kv_heads, size)) * shape.head_dim * b
    # a GDN layer's exchange: its conv input (q|k|v channels), b and a there; its heads' output back
    per_gdn_position = (conv_channels(shape) + 2 * shape.linear_value_heads
                        + shape.linear_value_heads * shape.linear_head_dim) * b
    moved = per_position * shape.attention_layers + per_gdn_position * shape.linear_layers
    chunks = rank.families_here * max(1, math.ceil(work.prefix / chunk)) if chunk else rank.families_here
    step_out = shape.heads * shape.head_dim * shape.attention_layers + (
        shape.linear_value_heads * shape.linear_head_dim * shape.linear_layers)
    return {"tower_bytes": 2 * away * work.visual * shape.hidden * b * rank.videos_here,
            "prefill_bytes": away * positions * moved / size,
            "prefill_collectives": 4.0 * shape.layers * (chunks + rank.families_here),
            "decode_bytes": away * steps * samples * step_out * b,
            "decode_collectives": float(steps * shape.layers)}


def experts_summary(shape: Shape, work: Workload, moved: dict, *, b: int, ranks: int, ep: int, stage: int) -> dict:
    """A mixture-of-experts plan's expert traffic per rank and step (``traffic.expert_traffic``, summed over the
    phases: the routed experts' ZeRO-3 gathers, EP's all-to-all), and per sparse layer for one micro-batch's
    forward: what ZeRO-3 gathers of its experts against what EP's all-to-all sends. {} for a dense model."""
    from app.planning.layers import exchange_bytes, expert_gather_bytes

    if not shape.sparse_layers:
        return {}
    layers = shape.sparse_layers
    return {"ep": ep, "gather_bytes": sum(m["gather"] for m in moved.values()),
            "exchange_bytes": sum(m["exchange"] for m in moved.values()),
            "collectives": sum(m["calls"] for m in moved.values()),
            "layer_gather_bytes": (expert_gather_bytes(shape, b, ranks, ep) if stage == 3 else 0.0) / layers,
            "layer_gather_bytes_without_ep": (expert_gather_bytes(shape, b, ranks, 1) if stage == 3 else 0.0) / layers,
            "layer_exchange_bytes": exchange_bytes(shape, work.grouped_tokens, b, ep) / layers}
