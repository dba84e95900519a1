"""What to change when a plan does not fit (``remedies``: cheapest first, each checked by the trainer's own config
checks, so every printed change is one the trainer accepts), and the largest video that fits (``largest_frames``)."""

from __future__ import annotations

from app.planning.costs import GiB
from app.planning.planner import PlanError, World, plan, with_overrides

SEARCH_LIMIT = 4096  # frames: the largest video searched for


def largest_frames(cfg, world: World, source: str, size: int, limit: int = SEARCH_LIMIT) -> int:
    """The most frames (even, at the config's max_pixels) that fit with sequence parallelism ``size``; 0 if none."""
    cfg = with_overrides(cfg, {"train.sequence_parallel_size": size})
    if not plan(cfg, world, source, frames=2)["fits"]:
        return 0
    low, high = 1, limit // 2  # in temporal pairs of frames
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if plan(cfg, world, source, frames=2 * mid)["fits"] else (low, mid - 1)
    return 2 * low


REMEDIES = (  # (what to change, overrides), cheapest first
    ("activation checkpointing", {"model.gradient_checkpointing": True}),
    ("chunked prefill of 4096 positions", {"rollout.prefill_chunk_size": 4096}),
    # mixture of experts, full weights: a rank gathers E / EP of a layer's experts, in the rollout's gather too (a
    # size that is not enough is not kept for the changes below: sequence parallelism does not run beside it)
    ("expert parallelism EP=2", {"train.expert_parallel_size": 2}),
    ("expert parallelism EP=4", {"train.expert_parallel_size": 4}),
    ("expert parallelism EP=8", {"train.expert_parallel_size": 8}),
    ("layer-by-layer ZeRO-3 gather in the rollout", {"rollout.zero3_gather": "layerwise"}),
    ("sequence parallelism S=2", {"train.sequence_parallel_size": 2}),
    ("sequence parallelism S=4", {"train.sequence_parallel_size": 4}),
    ("sequence parallelism S=8", {"train.sequence_parallel_size": 8}),
    ("frozen vision tower, 4 temporal patches per tower pass",
     {"model.freeze_vision_tower": True, "forward.vision_chunk_frames": 4}),
    ("LoRA rank 64", {"lora.rank": 64}),
    ("ZeRO-3 with CPU offload", {"train.deepspeed_config": "deepspeed_configs/zero3_offload.json"}),
)


def already_done(cfg, overrides: dict) -> bool:
    """Whether the config already has this change, or one that saves at least as much: the setting itself, a
    sequence-parallel size as large, any LoRA rank (a larger one saves nothing), a prefill chunk as small, a
    ZeRO-3 gather at most layer by layer."""
    for key, value in overrides.items():
        section, name = key.split(".")
        current = getattr(getattr(cfg, section), name)
        if key in ("train.sequence_parallel_size", "train.expert_parallel_size"):
            done = current >= value
        elif key == "lora.rank":
            done = current > 0
        elif key == "rollout.prefill_chunk_size":
            done = 0 < current <= value
        elif key == "rollout.zero3_gather":
            done = current in ("layerwise", "per_step")
        elif key == "forward.vision_chunk_frames":
            done = 0 < current <= value
        else:
            done = current == value
        if not done:
            return False
    return True


def refusal(cfg) -> str | None:
    """What the config checks (``app.config.checks.validate``, the trainer's own) say against ``cfg``, or None."""
    from app.config.checks import validate
    from app.config.fields import ConfigError

    try:
        validate(cfg)
    except ConfigError as error:
        return str(error)
    return None


def remedies(cfg, world: World, source: str) -> list[dict]:
    """Each single change of ``REMEDIES`` that the config does not already have (``already_done``), applied on top
    of the ones before it that were not enough, with the peak it gives; the first that fits ends the list. A change
    the config checks refuse (sequence parallelism with rollout.tools, say) is listed with the checks' own words and
    not applied: every change printed as a remedy is one the trainer accepts."""
    from app.planning.costs import shape_of
    from app.planning.planner import model_of

    found, current = [], cfg
    moe = bool(shape_of(model_of(source)[0]).experts)
    for name, overrides in REMEDIES:
        if already_done(current, overrides) or ("train.expert_parallel_size" in overrides and not moe):
            continue
        trial = with_overrides(current, overrides)
        refused = refusal(trial)
        if refused is not None and "rollout.zero3_gather" in refused and "train.sequence_parallel_size" in overrides:
            # a rollout spread over the group needs the policy gathered whole: SP undoes an earlier layerwise gather
            overrides = {**overrides, "rollout.zero3_gather": "full"}
            name = f"{name} (the rollout gathered whole again: rollout.zero3_gather=full)"
            trial = with_overrides(current, overrides)
            refused = refusal(trial)
        if refused is not None:
            found.append({"change": name, "overrides": overrides, "refused": refused})
            continue
        try:
            result = plan(trial, world, source)
        except PlanError:
            continue
        kept = result["fits"] or "train.expert_parallel_size" not in overrides
        found.append({"change": name, "overrides": overrides, "peak_gib": result["peak"] / GiB, "fits": result["fits"],
                      "kept": kept})
        if result["fits"]:
            break
        if kept:
            current = trial
    return found


def expert_parallel_options(cfg, world: World, source: str) -> list[dict]:
    """A mixture-of-experts config planned at each EP the model, the world and the ZeRO stage allow
    (``parallelism.expert_parallel_sizes``): peak, fit, step and the experts' traffic per rank and step; a size the
    trainer's config checks refuse (LoRA, say) is listed with their words. Empty for a dense model."""
    from app.planning.costs import shape_of
    from app.planning.parallelism import expert_parallel_sizes
    from app.planning.planner import deepspeed_settings, model_of

    shape = shape_of(model_of(source)[0])
    out = []
    for size in expert_parallel_sizes(cfg, shape, world.ranks, deepspeed_settings(cfg)["stage"]):
        trial = with_overrides(cfg, {"train.expert_parallel_size": size})
        refused = refusal(trial) if size > 1 else None
        if refused is not None:
            out.append({"ep": size, "refused": refused})
            continue
        result = plan(trial, world, source)
        experts = result["experts"]
        out.append({"ep": size, "peak_gib": result["peak"] / GiB, "fits": result["fits"],
                    "step_s": result["phase_seconds"]["grouped"]["step"],
                    "rollout_s": result["phase_seconds"]["grouped"]["rollout"],
                    "gather_gib": experts["gather_bytes"] / GiB, "exchange_gib": experts["exchange_bytes"] / GiB})
    return out


def suggested_expert_parallel(options: list[dict], current: int) -> dict | None:
    """The EP that fits with the shortest step, when it is not the config's own and beats it (None otherwise)."""
    fitting = [o for o in options if "refused" not in o and o["fits"]]
    if not fitting:
        return None
    best = min(fitting, key=lambda o: o["step_s"])
    mine = next((o for o in options if o["ep"] == current and "refused" not in o), None)
    if best["ep"] == current or (mine is not None and mine["fits"] and mine["step_s"] <= best["step_s"]):
        return None
    return best

