"""GRPO with tools: multi-turn rollouts drawn as prefix trees and trained as prefix trees (``rollout.tools``).

    scripts/train.sh CONFIG rollout.tools=[get_frames,zoom] rollout.branching=[4,2] ...

The recipe is GRPO's (``app.training.trainer.GRPOTrainer``) with two parts replaced:
- the rollout: ``app.rollout.multiturn.tree_rollout`` over the configured local engine (each turn one call on
  [P; path] prompts; the model stops at ``</tool_call>``, the tool runs, its result is the next turn), so each group
  is a tree whose leaves are its G rollouts;
- the scorer: ``app.training.scoring.TreeScorer``, all trees of a micro-batch in one packed row, each node once (the
  policy, old and reference log-probs alike).
Everything else is GRPO's as configured: rewards read each leaf's last model turn (plus ``rewards.tool_call_cost``
per call and ``rewards.valid_call_bonus``), advantages are normalised over the group of leaves, the loss covers the
model's own tokens only (observation tokens are context: ``completion_mask`` 0), KL and the clipped ratio per
token as for plain groups. Tool calls and their failures are counted per step (``tools/*``).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from app.grouping.tree.forward import forest_logprobs
from app.rollout.generate import Rollout, derive_seed
from app.rollout.multiturn import TurnLimits, observation_encoder, tree_rollout
from app.rollout.tools import STOP, ToolLimits, build_tools, context_for
from app.runtime import parallel, zero
from app.training.scoring import TreeScorer
from app.training.trainer import GRPOTrainer, paused
from app.training.trajectory import Trajectory

log = logging.getLogger("app.training.agent")
LEAF_STOP = {"eos": "eos", "answered": "eos", "length": "length", "max_turns": "length", "budget": "length"}


def leaf_rollout(trees, sampled, reasons, pad_id: int) -> Rollout:
    """The trees' leaves as rollout rows: every path token (observations included) in ``completion_ids``, the
    model's own in ``completion_mask``, their sampled log-probs (0 elsewhere)."""
    ids, masks, logprobs = [], [], []
    for tree, per_node in zip(trees, sampled):
        for path in tree.paths:
            ids.append(tree.path_tokens(path))
            masks.append(tree.path_tokens(path, "trained").long())
            logprobs.append(torch.cat([per_node[n] for n in path]))
    width = max(len(i) for i in ids)

    def pad(rows, value):
        return torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=value) for r in rows])

    return Rollout(completion_ids=pad(ids, pad_id), completion_mask=pad(masks, 0), logprobs=pad(logprobs, 0.0),
                   group_sizes=[len(t.paths) for t in trees],
                   stop_reasons=[LEAF_STOP[r] for rs in reasons for r in rs],
                   prefill_tokens=sum(t.prompt_len for t in trees), prompt_tokens=sum(t.prompt_len for t in trees))


def tool_rewards(calls, cost: float, bonus: float) -> dict[str, list[float]]:
    """Per leaf: -cost per call it made, +bonus when one of its calls ran."""
    flat = [path for per_tree in calls for path in per_tree]
    return {"tool_cost": [-cost * len(path) for path in flat],
            "tool_bonus": [bonus if any(r.error is None for r in path) else 0.0 for path in flat]}


class AgentGRPOTrainer(GRPOTrainer):
    name = "GRPO with tools"
    reads_shares = False  # its trees hold whole prompts (observations appended to them)

    def setup(self) -> None:
        super().setup()
        cfg = self.cfg
        r = cfg.rollout
        self.tools = build_tools(r.tools)
        self.limits = TurnLimits(max_turns=r.max_turns, max_total_tokens=r.max_total_tokens,
                                 max_new_tokens=r.max_completion_length,
                                 branching=tuple(r.branching) or (r.group_size,))
        self.tool_limits = ToolLimits(max_frames=r.tool_max_frames, min_pixels=cfg.data.min_pixels,
                                      max_pixels=r.tool_max_pixels, zoom_max_pixels=r.tool_zoom_max_pixels)
        self.data_root = Path(cfg.data.data_root or Path(cfg.data.train_file).parent)
        self.encode = observation_encoder(self.processor)
        self.scorer = TreeScorer(cfg.forward)
        sampling = cfg.rollout.to_sampling()
        self.turn_sampling = dataclasses.replace(sampling, stop_strings=(*sampling.stop_strings, STOP))
        self.sampler = self.sample_turn

    def keep_pace(self, busy: bool) -> bool:
        """Whether any rank samples this turn, where sampling gathers parameters collectively (ZeRO-3)."""
        if not zero.forwards_are_collective(self.engine):
            return busy
        return parallel.all_reduce_max([float(busy)])[0] > 0

    def sample_turn(self, prompts, group_size: int, seeds, max_new_tokens: int) -> Rollout:
        """One turn of every open rollout: the configured engine on [P; path] prompts."""
        sampling = dataclasses.replace(self.turn_sampling, max_new_tokens=max_new_tokens)
        return self.rollout_engine.generate(prompts, group_size, seeds, sampling=sampling)

    def rollout_and_score(self, step: int, prompts, draw: int = 0) -> Trajectory:
        cfg = self.cfg
        seeds = [derive_seed(cfg.train.seed, step, self.parallel.dp_rank, draw, i) for i in range(len(prompts))]
        contexts = [context_for(p.record, self.data_root, self.tool_limits) for p in prompts]
        drawn = tree_rollout(self.sampler, prompts, contexts, tools=self.tools, encode=self.encode,
                             limits=self.limits, tokenizer=self.tokenizer, seeds=seeds, keep_pace=self.keep_pace)
        rollout = leaf_rollout(drawn.trees, drawn.sampled, drawn.leaf_reasons, self.tokenizer.pad_token_id)
        texts = [answer for per_tree in drawn.answers for answer in per_tree]
        records = [p.record for p, size in zip(prompts, rollout.group_sizes) for _ in range(size)]
        scored = self.rewards.score(texts, records, rollout.group_sizes, rollout.completion_mask.sum(1).tolist())
        extra = tool_rewards(drawn.calls, cfg.rewards.tool_call_cost, cfg.rewards.valid_call_bonus)
        total = torch.tensor(scored.total, dtype=torch.float32) + torch.tensor(extra["tool_cost"]) \
            + torch.tensor(extra["tool_bonus"])
        return Trajectory(prompts, rollout, texts, scored.accuracy, {**scored.rewards, **extra}, total,
                          trees=drawn.trees, counts=drawn.stats.metrics())

    @torch.no_grad()
    def self_check(self, mb) -> None:
        """The packed trees against every path as its own row, on the first micro-batch (fp32 tolerance 1e-5 of
        the largest log-prob, as the grouped self-check)."""
        from app.grouping import GroupingMismatchError

        with zero.gathered_for_inference(self.engine, "full") as (module, _), paused(self.vision_cache):
            tree = forest_logprobs(module, mb.inputs["trees"], "tree").logprobs.float()
            paths = forest_logprobs(module, mb.inputs["trees"], "paths").logprobs.float()
        worst = float((tree - paths).abs().max() / paths.abs().max().clamp_min(1e-30))
        bound = 1e-5 if tree.dtype == torch.float32 and self.dtype == torch.float32 else 5e-2
        if worst > bound:
            raise GroupingMismatchError(f"prefix-tree self-check failed: the packed trees differ from their paths "
                                        f"by {worst:.2e} (relative; bound {bound:g})")
        log.info("self-check passed: packed trees vs their paths, largest relative difference %.1e over %d paths",
                 worst, len(mb.rows))

