"""The training command line: GRPO, or GRPO with tools when ``rollout.tools`` lists any (``app.training.agent``).

    python -m app.training.train CONFIG [section.key=value ...]     (scripts/train.sh runs this on every rank)
"""

from __future__ import annotations

from app.config.loading import Config
from app.training.agent import AgentGRPOTrainer
from app.training.recipe import run
from app.training.trainer import GRPOTrainer
from app.training.trainer import __doc__ as GRPO_DOC


def recipe_for(cfg: Config) -> GRPOTrainer:
    return AgentGRPOTrainer(cfg) if cfg.rollout.tools else GRPOTrainer(cfg)


def main(argv: list[str] | None = None) -> None:
    run(recipe_for, GRPO_DOC, argv)


if __name__ == "__main__":
    main()
