"""Which parallel layouts a world and a model allow, in the trainer's own words: sequence parallelism S (the world
and the model's heads: ``sequence_parallel.check_heads``) and expert parallelism EP (the routed experts, the world,
the ZeRO stage: ``expert_parallel.problems``); the sizes the plan's tables try (``SP_SIZES``, ``EP_SIZES``)."""

from __future__ import annotations

SP_SIZES = (1, 2, 4, 8)
EP_SIZES = (1, 2, 4, 8)


class PlanError(ValueError):
    """Bad planner input (the message names the argument or key)."""


def check_sequence_parallel(config, ranks: int, size: int) -> None:
    """The world and the model's heads allow S = ``size`` (the heads by the trainer's own check)."""
    from app.grouping.sequence_parallel import check_heads

    if ranks % size:
        raise PlanError(f"a world of {ranks} ranks cannot be split into sequence-parallel groups of {size} "
                        f"(train.sequence_parallel_size)")
    try:
        check_heads(config, size)
    except ValueError as error:  # the trainer's own sentence (attention or Gated DeltaNet heads), so both agree
        raise PlanError(str(error)) from None


def check_expert_parallel(cfg, shape, ranks: int, stage: int, size: int | None = None) -> None:
    """The model, the world and the ZeRO stage allow EP = ``size`` (default train.expert_parallel_size), in the
    trainer's own words (``app.runtime.expert_parallel.problems``)."""
    from app.runtime.expert_parallel import problems

    size = cfg.train.expert_parallel_size if size is None else size
    found = problems(size=size, model_type=shape.family if shape.experts else "dense", experts=shape.experts,
                     world=ranks, sequence_parallel=cfg.train.sequence_parallel_size, zero_stage=stage)
    if found:
        raise PlanError(f"train.expert_parallel_size={size}: {'; it also '.join(found)}")


def sequence_parallel_sizes(config, ranks: int) -> list[int]:
    """The S of ``SP_SIZES`` the world and the model's heads allow."""
    allowed = []
    for size in SP_SIZES:
        try:
            check_sequence_parallel(config, ranks, size)
        except PlanError:
            continue
        allowed.append(size)
    return allowed


def expert_parallel_sizes(cfg, shape, ranks: int, stage: int) -> list[int]:
    """The EP of ``EP_SIZES`` the model, the world and the ZeRO stage allow (empty for a dense model)."""
    if not shape.experts:
        return []
    allowed = []
    for size in EP_SIZES:
        try:
            check_expert_parallel(cfg, shape, ranks, stage, size)
        except PlanError:
            continue
        allowed.append(size)
    return allowed
