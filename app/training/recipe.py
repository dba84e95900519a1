"""What the training recipes (GRPO in ``app/training/trainer.py``, SFT in ``app/training/sft.py``) share: the policy as configured
(LoRA, frozen towers, activation checkpointing) in a DeepSpeed engine with AdamW and a cosine schedule, the
per-rank prompt stream, the step loop with logging and atomic checkpoints, exact resume, and the Hugging Face export.

A recipe subclasses ``Recipe``, builds what only it needs in ``setup`` and writes ``train_step``.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from app.common.options import OptionError
from app.config.loading import Config, ConfigError
from app.data.records import DataError, decode_threads
from app.data.shares import shares_decoded
from app.data.stream import load_stream
from app.data.video import SettingError
from app.grouping import MODALITIES, present_vision_calls
from app.grouping.experts.blocks import describe_experts, expert_shape, routers_train
from app.grouping.modules import attention_restored
from app.grouping.vision import cache as vision_cache
from app.rollout.registry import needs_engine_views
from app.runtime import checkpoint, distributed, expert_parallel, lora, parallel, zero
from app.runtime.models import (
    enable_activation_checkpointing,
    load_model,
    load_processor,
)
from app.runtime.tracking import StepMetrics, Tracker, configure_logging
from app.training import fingerprint, preflight
from app.training.scoring import GroupScorer, without_grad

log = logging.getLogger("app.training.recipe")
CRASH_ENV = "PREFIX_GRPO_CRASH_AFTER_STEP"  # tests: die right after this step, as a crash would
VISION_PLANS = {
    "outputs": "frozen (projector too): each image/video is encoded once per step and its outputs reused "
               "(forward.vision_cache=step)",
    "blocks": "frozen, projector trains: each image/video goes through the frozen blocks once per step; the "
              "projector runs in every forward (forward.vision_cache=step)",
    "count": "every forward runs it (it trains, or forward.vision_cache=off); its work is counted as vision/*",
}


def schedule_factor(update: int, warmup: int, total: int, min_ratio: float) -> float:
    """The learning rate's share of its peak at optimizer update ``update``: linear warmup, then cosine."""
    if update < warmup:
        return (update + 1) / (warmup + 1)
    progress = (update - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def cosine_with_warmup(optimizer, warmup: int, total: int, min_ratio: float):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: schedule_factor(update, warmup, total,
                                                                                        min_ratio))


class Recipe:
    name = "train"  # the progress bar's label

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rank, self.world = distributed.init_distributed(timeout_s=cfg.train.collective_timeout_s)
        # train.sequence_parallel_size consecutive ranks share each packed row; data parallelism over world / S
        self.parallel = parallel.ParallelContext.start(cfg.train.sequence_parallel_size)
        self.device = distributed.local_device()
        torch.manual_seed(cfg.train.seed)
        self.dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        self.gas = cfg.train.prompts_per_rank // cfg.train.groups_per_micro_batch
        self.ds_config = zero.load_deepspeed_config(
            cfg.train.deepspeed_config, gradient_accumulation_steps=self.gas,
            max_grad_norm=cfg.train.max_grad_norm, dtype=cfg.model.dtype)
        if cfg.train.expert_parallel_size > 1:  # AutoEP replaces the sparse blocks when the engines are built
            from transformers import AutoConfig

            self.ds_config["expert_parallel"] = expert_parallel.section(
                AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code),
                cfg.train.expert_parallel_size)
        self._hf_ds = zero.hf_deepspeed_config(self.ds_config)  # must outlive from_pretrained (weakref)
        self.output_dir = Path(cfg.train.output_dir)
        self.fingerprint = fingerprint.run_fingerprint(cfg)  # written into every checkpoint, checked on resume
        self.resume_from = self._checked_checkpoint() if cfg.train.resume else None  # before any model is loaded

        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # per-rank weight-loading bars would interleave with the training bar
        log.info("loading the policy from %s", cfg.model.path)
        self.processor = load_processor(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        policy = load_model(cfg.model.path, dtype=self.dtype, attn_implementation=cfg.model.vision_attention,
                            trust_remote_code=cfg.model.trust_remote_code,
                            experts_implementation=cfg.model.experts_implementation)
        policy = lora.prepare(policy, cfg.lora, cfg.model, seed=cfg.train.seed)  # frozen parts, adapters (if any)
        self.moe = expert_shape(policy)  # None for a dense model
        if self.moe is not None and self.rank == 0:
            log.info("%s; load-balancing loss x %g (grpo.router_aux_loss_coef)%s", describe_experts(policy),
                     cfg.grpo.router_aux_loss_coef, "; ZeRO-3: each sparse block a leaf module, gathered whole"
                     if zero.zero_stage(self.ds_config) == 3 else "")
        if self.moe is not None and cfg.grpo.router_aux_loss_coef > 0 and not routers_train(policy) and self.rank == 0:
            log.warning("grpo.router_aux_loss_coef=%g with frozen routers%s: the load-balancing loss trains no router; "
                        "its gradient reaches only the weights that train upstream of the routers (through the hidden "
                        "states they route), pushing those toward a balanced routing. Set grpo.router_aux_loss_coef=0 "
                        "to leave them alone, or train the routers (model.train_router=true, full-weight training only)",
                        cfg.grpo.router_aux_loss_coef, " (LoRA keeps them frozen)" if cfg.lora.rank else
                        " (model.train_router=false, the default)")
        if cfg.model.gradient_checkpointing:
            enable_activation_checkpointing(policy)
        optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.train.learning_rate,
                                      weight_decay=cfg.train.weight_decay)
        total_updates = cfg.train.max_steps * self.updates_per_step(cfg)
        scheduler = cosine_with_warmup(optimizer, cfg.train.warmup_steps, total_updates, cfg.train.min_lr_ratio)
        self.engine = zero.build_engine(policy, self.ds_config, optimizer, scheduler)
        if cfg.train.expert_parallel_size > 1 and self.rank == 0:
            log.info("%s", expert_parallel.describe(self.engine.module))
        self.save_sizes = disk_check(self.engine, cfg, zero.zero_stage(self.ds_config), self.output_dir)
        # under sequence parallelism each rank keeps the tower's output of its share of the frames
        sp = self.parallel.sp
        self.vision_cache = vision_cache.install(self.engine, cfg.forward.vision_cache, cfg.forward.vision_chunk_frames,
                                                 cfg.forward.vision_cache_gib, share=(sp.rank, sp.size))
        if self.vision_cache is not None and self.rank == 0:
            log.info("vision tower: %s", VISION_PLANS[self.vision_cache.plan])
        self.stream = load_stream(cfg.data, self.processor, cfg.train.seed, self.parallel.dp_rank, self.parallel.dp_size,
                                  lookahead=cfg.data.prefetch * cfg.train.prompts_per_rank,
                                  skip_log=self.output_dir / "logs" / "skipped_at_load.jsonl",
                                  engine_views=needs_engine_views(cfg.rollout.engine),
                                  pixel_dtype=self.dtype if self.dtype != torch.float32 else None,
                                  sp_share=self.decoded_share(), agree=self.parallel.all_in_group)
        self.start_step = 0
        self.scorer = GroupScorer(cfg.forward, self.parallel.sp)  # a recipe whose groups are trees sets a TreeScorer
        self.setup()
        if self.resume_from is not None:
            self._resume(*self.resume_from)
        if self.rank == 0:
            log.info("batch: %s", self.batch_plan())
        self.tracker = Tracker(cfg.logging, self.output_dir, cfg.to_dict(), self.rank == 0, cfg.train.max_steps,
                               start_step=self.start_step, label=self.name)

    # its batches are collated with this rank's share of the pixels (the GRPO recipe's: Recipe.decoded_share)
    reads_shares = True

    def decoded_share(self) -> tuple[int, int] | None:
        """(rank, S) when this rank's stream decodes only its share of each video (``data.decode_shares``:
        S > 1, a recipe that reads shares, the grouped engine, a rollout that may spread), else None; said once."""
        cfg, sp = self.cfg, self.parallel.sp
        share = shares_decoded(cfg, sp.size, self.reads_shares) and (sp.rank, sp.size) or None
        if self.rank == 0:
            threads = decode_threads(cfg.data)
            how = f"{threads} thread{'s' if threads > 1 else ''} decoding each video" + (
                " (data.decode_threads=0: this host's cores over its ranks and prefetch threads)"
                if not cfg.data.decode_threads else "")
            if sp.size > 1:
                how = (f"each rank of a sequence-parallel group decodes only its share of each video file (1/{sp.size}"
                       " of its frames)" if share else "every rank decodes whole videos") + "; " + how
            log.info("data: %s", how)
        return share

    @staticmethod
    def updates_per_step(cfg: Config) -> int:
        """Optimizer updates per step (for the learning-rate schedule)."""
        return 1

    def setup(self) -> None:
        """What only this recipe needs (a reference model, reward functions...), before a resume."""

    def batch_plan(self) -> str:
        """The step's arithmetic, said once at start-up (rank 0)."""
        t = self.cfg.train
        dp = self.parallel.dp_size
        return (f"{dp} rank(s) x {t.prompts_per_rank} example(s) per rank = {dp * t.prompts_per_rank} "
                f"per step; {t.groups_per_micro_batch} per micro-batch -> {self.gas} micro-batch(es) per rank "
                f"(gradient accumulation {self.gas}); {t.max_steps} steps")

    def learning_rate(self) -> float:
        """The rate the coming optimizer update uses (DeepSpeed's scheduler moves after each update)."""
        return float(self.engine.get_lr()[0])

    def train_step(self, step: int) -> dict:
        raise NotImplementedError

    def data_wait(self, step: int) -> float:
        """Seconds this step waited for its prompts; one log line with the step's skips by reason, if any."""
        waited, self.stream.wait_seconds = self.stream.wait_seconds, 0.0
        skips = self.stream.take_skips()
        if skips:
            log.warning("step %d: skipped %d record(s) (%s); %d in total (the first skip of each record is named "
                        "above)", step + 1, sum(skips.values()), ", ".join(f"{k}: {v}" for k, v in skips.items()),
                        sum(self.stream.skipped.values()))
        return waited

    # ---- the loop -------------------------------------------------------------------------------------------
    def train(self) -> Path | None:
        cfg = self.cfg
        crash_after = int(os.environ.get(CRASH_ENV, "-1"))
        self.stream.prefetch()  # the first step's prompts start decoding now (from the resumed position)
        last = min(cfg.train.stop_at_step or cfg.train.max_steps, cfg.train.max_steps)
        for step in range(self.start_step, last):
            with attention_restored(self.engine):  # the step's forwards switch it; its backwards have run at the end
                metrics = self.train_step(step)
            if self.vision_cache is not None:
                self.vision_cache.clear()  # entries live for one step (the tower is frozen, the memory is not free)
            if (step + 1) % cfg.logging.log_every == 0 or step + 1 == last:
                self.tracker.log(step + 1, metrics)
            if cfg.train.save_every and (step + 1) % cfg.train.save_every == 0 and step + 1 < last:
                self.save(step + 1)
            if step + 1 == crash_after:
                log.error("simulated crash after step %d (%s)", step + 1, CRASH_ENV)
                os._exit(17)
        self.stream.close()
        if self.start_step < last or self.resume_from is None:  # resumed at the end: only the export is left to do
            self.save(last)
        final = None
        if cfg.train.export_hf:
            final = checkpoint.export_hf(self.engine, self.processor, self.output_dir / "final", cfg.model.path,
                                         self.dtype, lora_cfg=cfg.lora if cfg.lora.rank else None,
                                         need_bytes=self.save_sizes["export"])
        self.tracker.close()
        return final

    @staticmethod
    def vision_calls_for(inputs: list[dict], engine, training: bool = False) -> list[tuple[str, ...] | None]:
        """For each of several forwards, the vision-tower passes every rank makes: for each modality the most that
        any rank's prompts need (one small all-reduce for all of them; every rank passes as many forwards; with the
        vision cache a modality takes one pass per item still to encode). Needed under ZeRO-3 with several ranks
        (every module call all-gathers) and, for a training forward, under any data parallelism (a text-only rank
        would otherwise give the vision tower no gradient while the others do, and the gradient all-reduce would
        not match)."""
        if distributed.world_size() == 1 or not (training or zero.forwards_are_collective(engine)):
            return [None] * len(inputs)
        counts = parallel.all_reduce_max([float(present_vision_calls(one, engine).count(m)) for one in inputs
                                             for m in MODALITIES])
        k = len(MODALITIES)
        return [tuple(m for j, m in enumerate(MODALITIES) for _ in range(int(counts[i * k + j])))
                for i in range(len(inputs))]

    def vision_calls(self, inputs: dict, engine, training: bool = False) -> tuple[str, ...] | None:
        return self.vision_calls_for([inputs], engine, training)[0]

    def likelihood_metrics(self, losses: list[float], tokens: int, *, started: float, waited: float,
                           learning_rate: float, extra: dict | None = None) -> dict:
        """A supervised step's metrics (SFT, SFT with tools), reduced across the replicas: the mean loss, target
        tokens, time, the optimizer's rate and gradient norm, skipped records, the vision tower's work, ``extra``."""
        grad_norm = self.engine.get_global_grad_norm()
        m = StepMetrics()
        m.mean("loss", sum(losses) / len(losses))
        m.mean("tokens/target", float(tokens))
        m.mean("time/step", time.perf_counter() - started)
        m.mean("time/data_wait", waited)
        for name, value in (extra or {}).items():
            m.mean(name, value)
        m.local("learning_rate", learning_rate)
        m.local("grad_norm", float(grad_norm) if grad_norm is not None else 0.0)
        m.local("data/skipped", float(sum(self.stream.skipped.values())))
        self.vision_metrics(m)
        return m.reduce(parallel.all_gather_floats, copies=self.parallel.sp.size)

    def data_metrics(self, metrics) -> None:
        """The stream's work: records skipped so far, media files decoded for this step's prompts (with
        data.questions_per_video > 1, once per run of questions on a video)."""
        metrics.local("data/skipped", float(sum(self.stream.skipped.values())))
        metrics.sum("data/media_decoded", float(self.stream.take_decodes()))

    def vision_metrics(self, metrics) -> None:
        """The step's vision-tower work: items encoded, the tower passes they took (more with
        forward.vision_chunk_frames), items served from the cache, and encodings per distinct item (1.0 with the
        cache on: each image/video encoded once per step)."""
        if self.vision_cache is None:
            return
        counts = self.vision_cache.counts()
        metrics.sum("vision/tower_items", counts["tower_items"])
        metrics.sum("vision/cache_hits", counts["cache_hits"])
        metrics.sum("vision/tower_passes", counts["tower_passes"])  # > tower_items: frame-chunked
        metrics.fraction("vision/tower_passes_per_item", counts["tower_items"], counts["items"])

    def decode(self, completion_ids, completion_mask) -> list[str]:
        return [self.tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
                for ids, m in zip(completion_ids, completion_mask)]

    def scores_without_grad(self, model, inputs: dict, completion_ids, completion_mask, group_sizes, *,
                            vision_calls=None, temperature: float = 1.0, families=None, **routing) -> torch.Tensor:
        """Log-probs under ``model`` without gradient (``app.training.scoring.without_grad``: gathered for inference as
        ``rollout.zero3_gather`` says; ``model`` may be the policy with its adapters off)."""
        return without_grad(self.scorer, model, inputs, completion_ids, completion_mask, group_sizes,
                            gather=self.cfg.rollout.zero3_gather, vision_calls=vision_calls, temperature=temperature,
                            families=families, **routing)

    def scores(self, model, inputs: dict, completion_ids, completion_mask, group_sizes, **kwargs):
        """Completion log-probs from the recipe's scorer (``app.training.scoring``: the configured forward)."""
        return self.scorer(model, inputs, completion_ids, completion_mask, group_sizes, **kwargs)

    def trainer_state(self, step: int) -> dict:
        return {"step": step, "stream_position": self.stream.position, "skipped": dict(self.stream.skipped),
                "world_size": self.world, "zero_stage": zero.zero_stage(self.ds_config),
                "sequence_parallel_size": self.cfg.train.sequence_parallel_size,
                "expert_parallel_size": self.cfg.train.expert_parallel_size, "fingerprint": self.fingerprint}

    def save(self, step: int) -> None:
        checkpoint.save_checkpoint(self.engine, self.output_dir, step, self.trainer_state(step),
                                   keep=self.cfg.train.keep_checkpoints, need_bytes=self.save_sizes["checkpoint"])

    def _checked_checkpoint(self) -> tuple[Path, dict] | None:
        """train.resume: the newest checkpoint that is complete (older ones with a warning; none at all refused when
        checkpoints exist), and its fingerprint checked against this run's (``fingerprint.resume_problems``):
        a difference stops the run with one line naming each, unless train.resume_if_different=continue."""
        path, passed_over = checkpoint.latest_checkpoint(self.output_dir, self.world)
        for reason in passed_over:
            log.warning("resume: passing over a checkpoint: %s", reason)
        if path is None:
            log.warning("train.resume=true but %s has no checkpoint yet; starting from step 0", self.output_dir)
            return None
        state = checkpoint.trainer_state_of(path)  # its layout before any model is loaded
        checkpoint.check_layout(path, state, self.world, self.cfg.train.sequence_parallel_size,
                                self.cfg.train.expert_parallel_size)
        old = state.get("fingerprint")
        if old is None:
            log.warning("resume: %s was written before checkpoints recorded their data, settings and model: "
                        "not checked against this run", path)
            return path, {}
        problems = fingerprint.resume_problems(old, self.fingerprint)
        if problems and self.cfg.train.resume_if_different == "stop":
            raise checkpoint.CheckpointError(
                f"{path} was written by a run with other data, settings or model: {'; '.join(problems)}. These define "
                "the data order or the objective, so its stream position would count other prompts. Resume with "
                "the settings it was written with, start a new train.output_dir, or set "
                "train.resume_if_different=continue to resume anyway")
        for problem in problems:
            log.warning("resume despite a difference (train.resume_if_different=continue): %s", problem)
        return path, old

    def rate_at(self, step: int, schedule: dict) -> float:
        """The learning rate of the first update of step ``step`` under a schedule (a fingerprint's)."""
        per_step = self.updates_per_step(self.cfg)
        return schedule["learning_rate"] * schedule_factor(step * per_step, schedule["warmup_steps"],
                                                           schedule["max_steps"] * per_step, schedule["min_lr_ratio"])

    def _resume(self, path: Path, old: dict) -> None:
        """Continue from ``path``: weights, optimizer, data position, random state; a changed schedule (max_steps,
        warmup, learning rate) goes on from here under this run's settings, said in one line."""
        state = checkpoint.load_checkpoint(self.engine, path)
        self.start_step = state["step"]
        self.stream.position = state["stream_position"]
        self.stream.skipped.update(state["skipped"])
        notes = fingerprint.schedule_notes(old, self.fingerprint, self.start_step, self.rate_at)
        for note in notes:
            log.info("%s", note)
        if notes:
            self.follow_schedule()
        log.info("resumed from %s at step %d", path, self.start_step)

    def follow_schedule(self) -> None:
        """This run's schedule from the resumed update on (the checkpoint's scheduler keeps its own peak rate)."""
        scheduler, cfg = self.engine.lr_scheduler, self.cfg.train
        scheduler.base_lrs = [cfg.learning_rate] * len(scheduler.base_lrs)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = cfg.learning_rate * scheduler.lr_lambdas[0](scheduler.last_epoch)


def disk_check(engine, cfg: Config, stage: int, output_dir: Path) -> dict:
    """What a checkpoint and the export of this run take on disk (``checkpoint.save_bytes``, from the engine's
    parameters), warned at start when ``output_dir``'s filesystem cannot hold one more checkpoint (a save writes the
    new one before it removes the oldest) plus the export."""
    total = trainable = adapter = 0
    size, ep = 2, expert_parallel.size_of(engine)
    for name, p in engine.module.named_parameters():
        # an expert-parallel rank holds E / EP of each sparse layer's experts: the checkpoint and export hold all E
        count = int(getattr(p, "ds_numel", p.numel())) * (ep if expert_parallel.is_expert_weight(p) else 1)
        total += count
        trainable += count if p.requires_grad else 0
        adapter += count if ".lora_" in name else 0
        size = p.element_size()
    sizes = checkpoint.save_bytes(total - adapter, trainable, size, stage, adapter=adapter,
                                  save_adapter=bool(cfg.lora.rank and cfg.lora.save_adapter))
    need = sizes["checkpoint"] + (sizes["export"] if cfg.train.export_hf else 0)
    free = checkpoint.free_bytes(output_dir)
    if distributed.rank() == 0 and need > free:
        log.warning("train.output_dir %s has %d bytes (%.2f GiB) free, but a checkpoint takes about %d bytes (%.2f "
                    "GiB)%s: a save or the export will fail (free space or choose another train.output_dir)",
                    output_dir, free, free / 2**30, sizes["checkpoint"], sizes["checkpoint"] / 2**30,
                    f" and the export {sizes['export']} bytes ({sizes['export'] / 2**30:.2f} GiB)"
                    if cfg.train.export_hf else "")
    return sizes


def run(recipe: Callable[[Config], Recipe], doc: str, argv: list[str] | None = None) -> None:
    """The command line of a recipe: CONFIG [section.key=value ...]; ``recipe``: a Recipe class, or a function of
    the config that builds one (``app.training.train`` picks GRPO or GRPO with tools)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(doc)
        print("Configuration keys (python -m app.config lists them with help):")
        raise SystemExit(0 if argv else 2)
    configure_logging()
    cfg = preflight.check(argv)  # the config, the checkpoints, what config.json decides: before any weight is read
    configure_logging(Path(cfg.train.output_dir) / "logs" / f"rank{os.environ.get('RANK', '0')}.log",
                      rank=int(os.environ.get("RANK", "0")))
    try:
        with distributed.collective_failures(cfg.train.collective_timeout_s):
            trainer = recipe(cfg)
            trainer.train()
    except ConfigError as error:  # what only the recipe can check
        raise SystemExit(f"config error: {error}") from None
    except OptionError as error:  # what only a stage can check, once it sees the model (the setting named)
        raise SystemExit(f"config error: '{error.field}'{error.message}") from None
    except checkpoint.CheckpointError as error:
        raise SystemExit(f"resume error: {error}") from None
    except checkpoint.SaveError as error:
        raise SystemExit(f"save error: {error}") from None
    except (DataError, SettingError) as error:  # named in one line, like a config error (details in logs/)
        raise SystemExit(f"data error: {error}") from None
    distributed.shutdown()
