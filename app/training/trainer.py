"""The GRPO recipe, top to bottom.

    python -m app.training.trainer configs/demo_cpu.yaml [section.key=value ...]      (one process)
    scripts/train.sh configs/demo_cpu.yaml [section.key=value ...]           (NPROC_PER_NODE processes)

One step on every rank, as typed stages (``app.training.trajectory``):
  collect         `prompts_per_rank` prompts -> G completions each from one prefill -> scored (``RewardSet``)
                  -> with dynamic sampling, groups without signal dropped and more drawn      -> Trajectory
  advantages      group-normalised (``grpo.advantages``)
  micro_batches   views of the trajectory, prompts collated and on the device once            -> [MicroBatch]
  reference/old   no-grad log-probs, stored in each MicroBatch
  update          clipped GRPO loss on the grouped forward, micro-batch by micro-batch -> DeepSpeed step
  metrics         declared with their reduction, reduced across ranks once (``StepMetrics``)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext

import torch

from app.config.loading import Config, ConfigError
from app.data.records import EncodedPrompt
from app.grouping import text_before_media, verify_grouping
from app.grouping.decoding.clock import nominal_bandwidth
from app.objectives.grpo import (
    GRPOLoss,
    advantages,
    choose_groups,
    groups_with_signal,
    mismatch_metrics,
)
from app.objectives.router import RouterTerm, replay_metrics, step_router_metrics
from app.rewards.judge import build_judge
from app.rewards.rules import RewardSet
from app.rollout.generate import Rollout, derive_seed, eos_token_ids
from app.runtime import parallel, zero
from app.training.metrics import group_counts, part_timer, rollout_parts, sample_rows, step_metrics, timed
from app.training.recipe import Recipe, run
from app.training.scoring import kl_reference, reference_replays
from app.training.trajectory import MicroBatch, Trajectory

log = logging.getLogger("app.training.trainer")


class GRPOTrainer(Recipe):
    name = "GRPO"

    @staticmethod
    def updates_per_step(cfg: Config) -> int:
        return cfg.grpo.num_iterations

    def setup(self) -> None:
        cfg = self.cfg
        self.reference = kl_reference(cfg, self.engine, self.ds_config, self.device, self.dtype, self.vision_cache)
        self.rewards = RewardSet(cfg.rewards, judge=build_judge(cfg.rewards, cfg.data, cfg.model, self.device,
                                                                 self.ds_config))
        self.loss = GRPOLoss(cfg.grpo.to_options(cfg.rollout.max_completion_length, cfg.rollout.engine))
        log.info("objective %s, as resolved from grpo.policy_loss: %s", cfg.grpo.policy_loss, self.loss.options.settings())
        self.router = RouterTerm(cfg.grpo.router_aux_loss_coef, moe=self.moe is not None)
        # rollout.routing_replay=r3: every micro-batch replays a whole record (or the step stops naming the prompt)
        self.replayed = self.moe if cfg.rollout.routing_replay == "r3" else None
        self.reference_replays = reference_replays(self.reference, self.replayed, cfg.model.reference_path)
        self.rollout_engine = training_rollout_engine(self)
        for warning in data_warnings(cfg, self.stream.records):
            log.warning("%s", warning)

    def batch_plan(self) -> str:
        return batch_plan(self.cfg, self.parallel.dp_size, self.gas)

    def train_step(self, step: int) -> dict:
        cfg, seconds = self.cfg, {}
        learning_rate = self.learning_rate()  # the rate this step's updates use (read before the scheduler moves)
        with timed(seconds, "weight_sync"):  # engines that sample from the policy itself send nothing
            self.pushed_tensors = self.rollout_engine.sync_weights(self.engine)
        with timed(seconds, "rollout"):
            trajectory = self.collect(step)
            trajectory.advantages = advantages(trajectory.total_reward, trajectory.group_sizes,
                                               cfg.grpo.scale_rewards, self.loss.options.loss_type,
                                               self.parallel.dp_sum)
        seconds["data_wait"] = self.data_wait(step)
        weights = self.loss.weights(trajectory.rollout.completion_mask, trajectory.rollout.stop_reasons)
        micro_batches = trajectory.micro_batches(cfg.train.groups_per_micro_batch, weights, self.tokenizer.pad_token_id,
                                                 self.device, share=self.parallel.pixel_share, replay=self.replayed)
        self.agree_vision_calls(micro_batches)
        with timed(seconds, "reference"):
            self.reference_and_old_logprobs(micro_batches)
        if step == self.start_step and cfg.forward.self_check and cfg.forward.grouping == "grouped":
            self.self_check(micro_batches[0])
        with timed(seconds, "policy"):
            updates = self.update(micro_batches, weights)
        return self.step_metrics(step, trajectory, updates, seconds, learning_rate)

    # ---- stages ---------------------------------------------------------------------------------------------
    def collect(self, step: int) -> Trajectory:
        need = self.cfg.train.prompts_per_rank
        draw = lambda k: self.rollout_and_score(step, self.stream.next_prompts(need), draw=k)  # noqa: E731
        return collect_groups(draw, need, self.cfg.grpo, self.tokenizer.pad_token_id, step)

    def rollout_and_score(self, step: int, prompts: list[EncodedPrompt], draw: int = 0) -> Trajectory:
        """G completions per prompt, each prompt its own random stream (independent across steps, draws, ranks
        and batch positions), decoded and scored; with T-GRPO the video prompts again on shuffled frames."""
        seeds = [derive_seed(self.cfg.train.seed, step, self.parallel.dp_rank, draw, i) for i in range(len(prompts))]
        rollout = self.generate(prompts, seeds)
        with part_timer(rollout.parts, "scoring"):  # texts, rewards (and T-GRPO's rollout on shuffled frames)
            texts = self.decode(rollout.completion_ids, rollout.completion_mask)
            shuffled = self.shuffled_rollouts(step, prompts) if self.cfg.rewards.temporal else None
            records = [p.record for p, size in zip(prompts, rollout.group_sizes) for _ in range(size)]
            scored = self.rewards.score(texts, records, rollout.group_sizes, rollout.completion_mask.sum(1).tolist(),
                                        shuffled)
        return Trajectory(prompts, rollout, texts, scored.accuracy, scored.rewards,
                          torch.tensor(scored.total, dtype=torch.float32))

    def shuffled_rollouts(self, step: int, prompts: list[EncodedPrompt]) -> dict[int, list[str]]:
        """T-GRPO: each video prompt again with its frames shuffled -> group index -> completions. These frames
        are no later forward's input, so the vision cache stays out of it (nothing stored or counted)."""
        with paused(self.vision_cache):
            return self.shuffled_texts(step, prompts)

    def shuffled_texts(self, step: int, prompts: list[EncodedPrompt]) -> dict[int, list[str]]:
        video = [i for i, p in enumerate(prompts) if p.record.get("data_type") == "video"]
        encoded = {i: self.stream.encode(prompts[i].record, derive_seed(self.cfg.train.seed, step, i),
                                         epoch=prompts[i].epoch) for i in video}
        video = [i for i in video if encoded[i] is not None]
        collective = zero.forwards_are_collective(self.engine)
        if collective and parallel.all_reduce_max([float(bool(video))])[0] > 0 and not video:
            # Under ZeRO-3 a rollout gathers parameters collectively: this rank has no video but another has, so
            # it joins with a throwaway rollout of its own prompt (discarded) instead of leaving the others hanging.
            self.generate(prompts[:1], [0])
            return {}
        if not video:
            return {}
        rollout = self.generate([encoded[i] for i in video],
                                [derive_seed(self.cfg.train.seed, step, self.parallel.dp_rank, "shuffled", i) for i in video])
        texts, g = self.decode(rollout.completion_ids, rollout.completion_mask), self.cfg.rollout.group_size
        return {i: texts[k * g : (k + 1) * g] for k, i in enumerate(video)}

    def generate(self, prompts: list[EncodedPrompt], seeds: list[int]) -> Rollout:
        """G completions per prompt from the configured engine."""
        return self.rollout_engine.generate(prompts, self.cfg.rollout.group_size, seeds)

    def agree_vision_calls(self, micro_batches: list[MicroBatch]) -> None:
        """The vision-tower calls of every micro-batch's training forward, agreed across ranks (one collective
        for the step; see ``Recipe.vision_calls``)."""
        calls = self.vision_calls_for([mb.inputs for mb in micro_batches], self.engine, training=True)
        for mb, agreed in zip(micro_batches, calls):
            mb.vision_calls = agreed

    def reference_and_old_logprobs(self, micro_batches: list[MicroBatch]) -> None:
        for mb in micro_batches:
            if self.reference is not None:
                mb.reference_logprobs = self.logprobs_without_grad(self.reference, mb, self.reference_replays)
            if self.cfg.grpo.num_iterations > 1:
                mb.old_logprobs = self.logprobs_without_grad(self.engine, mb)

    def logprobs_without_grad(self, model, mb: MicroBatch, replay: bool = True) -> torch.Tensor:
        """Log-probs of the sampled tokens under ``model`` (policy, reference model, or the policy adapters-off), at
        the rollout temperature like the policy forward: ratios and KL compare the same distributions; ``replay``:
        through the rollout's experts (r3), unless the model routes otherwise (a dense reference)."""
        return self.scores_without_grad(model, mb.inputs, mb.completion_ids, mb.completion_mask, mb.group_sizes,
                                        vision_calls=mb.vision_calls, temperature=self.cfg.rollout.temperature,
                                        families=mb.families, **(mb.replay if replay else {}))

    def forward(self, model, mb: MicroBatch, vision_calls=None, return_entropy: bool = False, **routing):
        return self.scores(model, mb.inputs, mb.completion_ids, mb.completion_mask, mb.group_sizes,
                           temperature=self.cfg.rollout.temperature, vision_calls=vision_calls,
                           return_entropy=return_entropy, families=mb.families, **mb.replay, **routing)

    def self_check(self, mb: MicroBatch) -> None:
        run_self_check(self, mb)

    def update(self, micro_batches: list[MicroBatch], weights: torch.Tensor) -> list[dict]:
        """mu passes of the clipped loss over the micro-batches, one DeepSpeed step (accumulation) each."""
        self.loss.start_step(weights, len(micro_batches), self.parallel.dp_size, self.parallel.dp_sum)
        self.engine.train()
        out = []
        for iteration in range(self.cfg.grpo.num_iterations):
            if self.router.needs_counts:  # the step's expert loads first: its load-balancing loss is the step's
                self.router.start_step(router_counts(self, micro_batches), len(micro_batches),
                                       self.parallel.dp_size, self.parallel.dp_sum)
            for mb in micro_batches:
                scores = self.forward(self.engine, mb, vision_calls=mb.vision_calls, return_entropy=iteration == 0,
                                      **self.router.forward_kwargs)
                old = mb.old_logprobs if mb.old_logprobs is not None else scores.logprobs.detach()
                loss, metrics = self.loss(scores.logprobs, old, mb.advantages, mb.loss_weights,
                                          mb.reference_logprobs, mb.sampled_logprobs)
                loss = self.router.add(loss, getattr(scores, "router", None))  # MoE: + coef x load balancing
                self.engine.backward(loss)
                self.engine.step()
                if iteration == 0:
                    metrics.update(mismatch_metrics(old, mb.sampled_logprobs, mb.completion_mask),
                                   **replay_metrics(getattr(scores, "replay_differs", None)))
                    mask = mb.completion_mask
                    metrics["entropy"] = float((scores.entropy * mask).sum() / mask.sum().clamp_min(1))
                out.append({"loss": float(loss.detach()), "metrics": metrics, **token_counts(scores.layout,
                            self.cfg.forward.grouping), "router": getattr(scores, "router", None) if iteration == 0 else None})
        return out

    def step_metrics(self, step: int, t: Trajectory, updates: list[dict], seconds: dict, learning_rate: float) -> dict:
        grad_norm = self.engine.get_global_grad_norm()
        m = step_metrics(t, updates, seconds, grouped=self.cfg.forward.grouping == "grouped")
        m.local("learning_rate", learning_rate)
        m.local("grad_norm", float(grad_norm) if grad_norm is not None else 0.0)
        self.data_metrics(m)
        m.mean("weight_sync/tensors", float(self.pushed_tensors))  # vLLM: all at the first push, then what changes
        self.vision_metrics(m)
        rollout_parts(m, t.rollout.parts, seconds, nominal_bandwidth(self.device))
        values = m.reduce(parallel.all_gather_floats, copies=self.parallel.sp.size)
        values.update(step_router_metrics(values))  # MoE: router/* of the step's sums over every rank
        values["tokens_per_second"] = values["tokens/policy_forward"] / max(seconds["policy"], 1e-9)
        every = self.cfg.logging.sample_table_every
        if every and (step + 1) % every == 0 and self.rank == 0:
            self.tracker.log_samples(step + 1, sample_rows(t, 2 * self.cfg.rollout.group_size))
        return values


# ---- the stages that need no model: called by the trainer, and by tests directly -------------------------------
def training_rollout_engine(t: GRPOTrainer):
    """``rollout.engine`` (``app.rollout.registry``) for a trainer, built once; with sequence parallelism the group's ranks
    keep its first rank's rollout, with ``rollout.record`` every rollout is written for a later replay."""
    from app.rollout.registry import EngineSetup, Recorded, SharedInGroup, build_rollout_engine
    from app.rollout.vllm import choose_sleep_level

    cfg = t.cfg
    everything_trains = not cfg.lora.rank and all(p.requires_grad for p in t.engine.parameters())
    setup = EngineSetup(
        policy=t.engine, tokenizer=t.tokenizer, sampling=cfg.rollout.to_sampling(), device=t.device,
        eos_ids=eos_token_ids(t.engine, t.tokenizer), pad_id=t.tokenizer.pad_token_id,
        rollout=cfg.rollout, model_path=cfg.model.path, dtype=cfg.model.dtype, world=t.world,
        seed=cfg.train.seed, max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_completion_length,
        sleep_level=choose_sleep_level(cfg.rollout.vllm_sleep, t.device.type, everything_trains),
        vision_calls=lambda inputs: t.vision_calls(inputs, t.engine), replay_dir=cfg.rollout.replay_dir,
        capture_guard=t.stream.paused)
    engine = build_rollout_engine(cfg.rollout.engine, setup)
    engine = SharedInGroup(engine, t.parallel, pad_id=t.tokenizer.pad_token_id,  # S = 1: each rank keeps its own
                           collective=zero.zero_stage(t.ds_config) == 3, setting=cfg.rollout.sp_split,
                           priced=split_pricer(cfg, t.engine, t.device, t.world, zero.zero_stage(t.ds_config)))
    if cfg.rollout.record:
        engine = Recorded(engine, t.output_dir / "rollouts", sampling=setup.sampling)
    return engine


def split_pricer(cfg, policy, device, world: int, stage: int):
    """With sequence parallelism and rollout.sp_split=auto: the planner's price of a spread rollout against whole
    families (``app.planning.split``), which the rollout asks for each step's prompt lengths."""
    if cfg.train.sequence_parallel_size < 2 or cfg.rollout.sp_split != "auto":
        return None
    from app.planning.split import rollout_pricer

    module = getattr(policy, "module", policy)  # a DeepSpeed engine holds the model
    return rollout_pricer(cfg, module.config, device=device.type, ranks=world, zero_stage=stage)


def token_counts(layout, grouping: str) -> dict:
    """A policy forward's tokens (its packed row, or the repeated rows) and the prompt tokens its families did not
    repeat (questions sharing a video, ``tokens/shared_video``)."""
    grouped = grouping == "grouped"
    return {"tokens": layout.packed_tokens if grouped else layout.repeated_tokens,
            "shared": getattr(layout, "shared_tokens", 0) if grouped else 0,
            "prompt_tokens": sum(getattr(layout, "prefix_lens", ()))}


@torch.no_grad()
def router_counts(trainer, micro_batches: list[MicroBatch]) -> list:
    """Each micro-batch's router sums at the current weights, without gradient (``RouterTerm.start_step``)."""
    return [trainer.forward(trainer.engine, mb, vision_calls=mb.vision_calls, router_statistics="metrics").router
            for mb in micro_batches]


def run_self_check(t: GRPOTrainer, mb: MicroBatch) -> None:
    """Grouped vs repeated on the first micro-batch's first completions (``checked_grouping``). With sequence
    parallelism the whole row is what needed S ranks, so the check runs on the text before each prompt's first
    image/video and the first completion tokens (``text_before_media``): layout, positions, backend and dtype,
    not the tower; the SP forward itself is tested against one rank in the suite."""
    batch, sizes = first_completions(mb, SELF_CHECK_COMPLETIONS)
    if t.parallel.sp.size > 1:
        batch = text_before_media(t.engine, *batch)
    with paused(t.vision_cache):
        result = checked_grouping(t.engine, batch, sizes, t.cfg.forward.backend, mb.families)
    what = " (sequence parallel: on the text before the media and the first completion tokens)" if \
        t.parallel.sp.size > 1 else ""
    if result is not None:
        log.info("self-check passed%s: %s (%d completion(s): the first %d of each group)", what,
                 result.describe(), sum(sizes), SELF_CHECK_COMPLETIONS)


SELF_CHECK_COMPLETIONS = 2  # per group: enough to see a layout fault (sample 0 and one after it), cheap to repeat


def checked_grouping(engine, batch: tuple, sizes: list[int], backend: str | None, families=None):
    """``verify_grouping`` on the policy gathered whole (in low precision it also runs a float32 forward, upcasting
    layer by layer). The repeated reference is the expensive side (an 8k video prompt, 8 repeated rows in float32:
    62 GiB of attention scores asked for on one H200, hence ``first_completions``); a check that still runs out of
    memory is skipped with a warning rather than stop the run."""
    try:
        with zero.gathered_for_inference(engine, "full") as (module, _):
            return verify_grouping(module, *batch, sizes, backend=backend, families=families)
    except torch.OutOfMemoryError as error:
        torch.cuda.empty_cache()
        log.warning("self-check skipped: its repeated reference forward ran out of memory (%s); training goes on "
                    "unchecked (forward.self_check=false skips it)", str(error).splitlines()[0][:200])
        return None


def first_completions(mb: MicroBatch, count: int) -> tuple[tuple, list[int]]:
    """(prompts, completion ids, mask) of the micro-batch with each group cut to its first ``count`` completions
    (prompts and media unchanged), and the groups' new sizes."""
    starts = [0, *torch.tensor(mb.group_sizes).cumsum(0).tolist()]
    rows = [r for g, size in enumerate(mb.group_sizes) for r in range(starts[g], starts[g] + min(count, size))]
    index = torch.tensor(rows, device=mb.completion_ids.device)
    sizes = [min(count, size) for size in mb.group_sizes]
    return (mb.inputs, mb.completion_ids[index], mb.completion_mask[index]), sizes


def data_warnings(cfg: Config, records: list[dict]) -> list[str]:
    """Settings that the data makes pointless (config-only contradictions are ``config.warnings_for``)."""
    out = []
    if cfg.rewards.temporal and not any(r.get("data_type") == "video" for r in records):
        out.append(f"rewards.temporal=true but {cfg.data.train_file} has no video records: no temporal bonus can be "
                   "paid (the shuffled-frame rollout needs a video)")
    return out


def batch_plan(cfg: Config, world: int, accumulation: int) -> str:
    """The step's arithmetic, said once at start-up."""
    t, g = cfg.train, cfg.rollout.group_size
    per_step = world * t.prompts_per_rank
    packed = cfg.data.max_prompt_length + g * cfg.rollout.max_completion_length
    ranks = "rank(s)" if t.sequence_parallel_size == 1 else \
        f"data-parallel replica(s) of {t.sequence_parallel_size} sequence-parallel ranks"
    each = "rank" if t.sequence_parallel_size == 1 else "replica"
    return (f"{world} {ranks} x {t.prompts_per_rank} prompt(s) per {each} = {per_step} prompts per step; "
            f"G={g} -> {per_step * g} completions per step; {t.groups_per_micro_batch} group(s) per micro-batch "
            f"-> {accumulation} micro-batch(es) per rank (gradient accumulation {accumulation}) x mu="
            f"{cfg.grpo.num_iterations} update pass(es); token budget per packed group <= {packed} "
            f"(prompt <= data.max_prompt_length {cfg.data.max_prompt_length} + G x "
            f"rollout.max_completion_length {cfg.rollout.max_completion_length}); {t.max_steps} steps")


def collect_groups(draw: Callable[[int], Trajectory], need: int, grpo_cfg, pad_id: int, step: int = 0,
                   reduce_max: Callable[[list[float]], list[float]] = parallel.all_reduce_max) -> Trajectory:
    """A rank's groups for the step from ``draw(k)`` (the k-th batch of ``need`` prompts, rolled out and scored).
    With dynamic sampling, groups without signal are dropped and further batches drawn (every rank draws as often
    as the neediest one, ``reduce_max``, since rollouts may be collective) up to ``dynamic_sampling_max_draws``;
    a step still short is filled with dropped groups (warned and counted)."""
    draws = [draw(0)]
    if not grpo_cfg.dynamic_sampling:
        draws[0].draws = group_counts(draws)
        return draws[0]
    kept, dropped = [], []
    while True:
        k = len(draws) - 1
        values = draws[k].accuracy if grpo_cfg.dynamic_sampling_metric == "accuracy" else \
            draws[k].total_reward.tolist()
        with_signal, flat = groups_with_signal(values, draws[k].group_sizes)
        kept += [(k, g) for g in with_signal]
        dropped += [(k, g) for g in flat]
        short = reduce_max([float(need - len(kept))])[0]
        if short <= 0 or k >= grpo_cfg.dynamic_sampling_max_draws:
            break
        draws.append(draw(k + 1))
    picks, filled = choose_groups(kept, dropped, need)
    if filled:
        log.warning("step %d: dynamic sampling found %d of %d groups with signal after %d extra draws; filling "
                    "with %d groups without (raise grpo.dynamic_sampling_max_draws?)", step + 1, len(kept), need,
                    len(draws) - 1, filled)
    chosen = Trajectory.select(draws, picks, pad_id)
    chosen.draws = {**group_counts(draws), "dynamic_sampling/dropped": float(len(dropped)),
                    "dynamic_sampling/filled": float(filled), "dynamic_sampling/extra_draws": float(len(draws) - 1)}
    return chosen


def paused(cache):
    return cache.pause() if cache is not None else nullcontext()


def plain_grpo(cfg: Config) -> GRPOTrainer:
    if cfg.rollout.tools:  # the multi-turn recipe (app.training.agent) is what scripts/train.sh runs for these
        raise ConfigError("rollout.tools is set: run python -m app.training.train (what scripts/train.sh runs), which picks "
                          "the multi-turn recipe")
    return GRPOTrainer(cfg)


def main(argv: list[str] | None = None) -> None:
    run(plain_grpo, __doc__, argv)


if __name__ == "__main__":
    main()
