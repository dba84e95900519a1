"""The training command line: GRPO, or GRPO with tools when ``rollout.tools`` lists any (``app.agent``).

    python -m app.train CONFIG [section.key=value ...]     (scripts/train.sh runs this on every rank)
"""

from __future__ import annotations

from app.agent import AgentGRPOTrainer
from app.config import Config
from app.recipe import run
from app.trainer import GRPOTrainer
from app.trainer import __doc__ as GRPO_DOC


def recipe_for(cfg: Config) -> GRPOTrainer:
    return AgentGRPOTrainer(cfg) if cfg.rollout.tools else GRPOTrainer(cfg)


def main(argv: list[str] | None = None) -> None:
    run(recipe_for, GRPO_DOC, argv)


if __name__ == "__main__":
    main()
