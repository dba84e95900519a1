"""What a run checks before it loads a single weight, once: the config (``app.config``), each checkpoint's folder
(``models.check_checkpoint``) and what the checkpoint's config.json alone decides: sequence parallelism against the
attention heads and a hybrid model's Gated DeltaNet heads (``sequence_parallel.check_heads``, the same check the
planner reports), expert parallelism against the routed experts, the world being launched and the ZeRO stage
(``expert_parallel.problems``). A failure is one line, ``config error: ...`` or ``model error: ...``, and exit status 1.

    python -m app.training.preflight CONFIG.yaml [section.key=value ...]

``scripts/train.sh`` runs it before it starts several processes, so a bad setting is said once, not by every rank
under torchrun's failure report; a single process runs the same checks at the start of ``recipe.run``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from app.config.loading import Config, ConfigError, load_config
from app.runtime.models import CheckpointPathError, check_checkpoint


def text_config(path: str | Path) -> SimpleNamespace:
    """The checkpoint's text config as attributes, read from config.json alone (no weights, no transformers)."""
    parsed = json.loads((Path(path) / "config.json").read_text())
    return SimpleNamespace(**parsed.get("text_config", parsed))


def expert_shape_of(path: str | Path):
    """The checkpoint's ``ExpertShape`` from its config.json (``experts.blocks.config_expert_shape``, the one rule of
    what is a mixture of experts); None for a dense model."""
    from app.grouping.experts.blocks import config_expert_shape

    return config_expert_shape(text_config(path))


def check_model_settings(cfg: Config) -> None:
    """Settings that the checkpoint's shape must allow, from its config.json: ``ConfigError`` naming the key."""
    from app.grouping.sequence_parallel import check_heads

    if cfg.rollout.routing_replay != "off":
        from app.rollout.base import UNREAD, replay_problems

        separate = cfg.model.reference_path and cfg.grpo.beta and not cfg.lora.rank  # else: the policy's own routing
        for problem in replay_problems(shape=expert_shape_of(cfg.model.path), model=cfg.model.path,
                                       reference=expert_shape_of(cfg.model.reference_path) if separate else UNREAD,
                                       reference_path=cfg.model.reference_path):
            raise ConfigError(f"'rollout.routing_replay'={cfg.rollout.routing_replay} {problem}")
    from app.rollout.base import family_problems

    model_type = json.loads((Path(cfg.model.path) / "config.json").read_text()).get("model_type", "?")
    for problem in family_problems(model_type, engine=cfg.rollout.engine):
        raise ConfigError(f"{problem} ({cfg.model.path})")
    if cfg.grpo.router_aux_loss_coef > 0 and cfg.rollout.tools and expert_shape_of(cfg.model.path) is not None:
        raise ConfigError(f"'grpo.router_aux_loss_coef'={cfg.grpo.router_aux_loss_coef} needs router sums, which "
                          "prefix trees (rollout.tools) do not return yet; set grpo.router_aux_loss_coef=0")
    size = cfg.train.sequence_parallel_size
    if size > 1:
        try:
            check_heads(text_config(cfg.model.path), size)
        except ValueError as error:
            raise ConfigError(f"'train.sequence_parallel_size'={size} does not fit {cfg.model.path}: {error}") from None
    check_expert_parallel(cfg)


def launch_world() -> int:
    """The ranks of the run being launched: torchrun's WORLD_SIZE inside it, else what the launchers start
    (NNODES x NPROC_PER_NODE, each 1 when unset)."""
    import os

    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"])
    return int(os.environ.get("NNODES", "1") or 1) * int(os.environ.get("NPROC_PER_NODE", "1") or 1)


def zero_stage_of(path: str | Path) -> int:
    """The ZeRO stage a DeepSpeed JSON asks for (0 when it names none); a missing or broken file is named."""
    try:
        return int(json.loads(Path(path).read_text()).get("zero_optimization", {}).get("stage", 0))
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"'train.deepspeed_config' {path} cannot be read as JSON ({error})") from None


def check_expert_parallel(cfg: Config) -> None:
    """train.expert_parallel_size against the checkpoint (a mixture of experts whose experts it divides), the world
    being launched and the DeepSpeed config's stage (``expert_parallel.problems``)."""
    size = cfg.train.expert_parallel_size
    if size == 1:
        return
    from app.runtime.expert_parallel import problems

    parsed = json.loads((Path(cfg.model.path) / "config.json").read_text())
    shape = expert_shape_of(cfg.model.path)
    experts = shape.experts if shape is not None else 0
    found = problems(size=size, model_type=parsed.get("model_type", "?"), experts=experts,
                     world=launch_world(), sequence_parallel=cfg.train.sequence_parallel_size,
                     zero_stage=zero_stage_of(cfg.train.deepspeed_config))
    if found:
        raise ConfigError(f"'train.expert_parallel_size'={size} {'; it also '.join(found)} ({cfg.model.path})")


def check(argv: list[str]) -> Config:
    """CONFIG [section.key=value ...] -> the config, every check before the load passed; else SystemExit(one line)."""
    try:
        cfg = load_config(argv[0], argv[1:])
        check_checkpoint(cfg.model.path)
        if cfg.model.reference_path:
            check_checkpoint(cfg.model.reference_path, "model.reference_path")
        if "judge" in cfg.rewards.functions and cfg.rewards.judge_path:
            check_checkpoint(cfg.rewards.judge_path, "rewards.judge_path")
        check_model_settings(cfg)
    except ConfigError as error:
        raise SystemExit(f"config error: {error}") from None
    except CheckpointPathError as error:
        raise SystemExit(f"model error: {error}") from None
    return cfg


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(0 if argv else 2)  # the recipe prints its own help
    check(argv)


if __name__ == "__main__":
    main()
