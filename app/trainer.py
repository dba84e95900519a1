"""The GRPO recipe, top to bottom.

    python -m app.trainer configs/demo_cpu.yaml [section.key=value ...]      (one process)
    scripts/train.sh configs/demo_cpu.yaml [section.key=value ...]           (NPROC_PER_NODE processes)

One step on every rank: take `prompts_per_rank` prompts -> sample G completions each from one prefill ->
score them -> group-normalised advantages -> reference (and old) log-probs -> clipped GRPO loss on the grouped
forward, micro-batch by micro-batch -> DeepSpeed step -> metrics, checkpoint.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from app import distributed, lora
from app.config import Config, scale_rewards
from app.data.prompts import collate_prompts
from app.data.records import EncodedPrompt
from app.grouping import completion_logprobs, verify_grouping
from app.grpo import (
    LossOptions,
    group_advantages,
    grpo_loss,
    loss_mask,
    mismatch_metrics,
    truncated_importance_weights,
    zero_variance_groups,
)
from app.models import load_model
from app.recipe import Recipe, run, to_device
from app.rewards import accuracy_of, build_rewards, length_bonus, score, temporal_bonus
from app.rollout import Rollout, SamplingConfig, derive_seed, generate_groups, select_groups

log = logging.getLogger("app.trainer")


def tokens_per_micro_batch(loss_type: str, weights: torch.Tensor, micro_batches: int) -> float | None:
    """DAPO's denominator (see ``grpo.aggregate``): the loss tokens of the whole step, summed over ranks, divided by
    the number of micro-batch losses that DeepSpeed averages (micro-batches per rank x ranks). One all-reduce."""
    if loss_type != "dapo":
        return None
    total = distributed.all_reduce_sum([float(weights.sum())])[0]
    return total / (micro_batches * distributed.world_size())


def mean_of(metrics: list[dict], key: str) -> float:
    values = [m[key] for m in metrics if key in m]
    return sum(values) / len(values) if values else 0.0


@dataclass
class StepBatch:
    prompts: list[EncodedPrompt]
    rollout: Rollout
    texts: list[str]
    accuracy: list[float]  # per completion, scored once (metrics and the bonuses reuse it)
    rewards: dict[str, list[float]]
    total_reward: torch.Tensor
    advantages: torch.Tensor | None = None  # set once the step's groups are chosen
    sampling: dict = field(default_factory=dict)  # what the step drew: group counts for the metrics


def select(batches: list[StepBatch], picks: list[tuple[int, int]], group_size: int, pad_id: int) -> StepBatch:
    """The groups ``picks`` = [(batch index, group index)] of several scored batches, as one batch."""
    rows = [(k, g * group_size + j) for k, g in picks for j in range(group_size)]
    return StepBatch(
        prompts=[batches[k].prompts[g] for k, g in picks],
        rollout=select_groups([b.rollout for b in batches], picks, pad_id),
        texts=[batches[k].texts[i] for k, i in rows],
        accuracy=[batches[k].accuracy[i] for k, i in rows],
        rewards={name: [batches[k].rewards[name][i] for k, i in rows] for name in batches[0].rewards},
        total_reward=torch.stack([batches[k].total_reward[i] for k, i in rows]) if rows else torch.zeros(0),
    )


class GRPOTrainer(Recipe):
    name = "GRPO"

    @staticmethod
    def updates_per_step(cfg: Config) -> int:
        return cfg.grpo.num_iterations

    def setup(self) -> None:
        cfg = self.cfg
        self.reference = None
        if cfg.grpo.beta > 0 and cfg.lora.rank:
            self.reference = lora.AdaptersOff(self.engine)  # the base weights are the policy's own, frozen
        elif cfg.grpo.beta > 0:
            reference = load_model(cfg.model.reference_path or cfg.model.path, dtype=self.dtype,
                                   attn_implementation=cfg.model.vision_attention,
                                   trust_remote_code=cfg.model.trust_remote_code)
            self.reference = distributed.build_reference(reference, self.ds_config, self.device)

        self.rewards = build_rewards(cfg.rewards.functions, cfg.rewards.weights, cfg.rewards.regression)
        if cfg.rewards.temporal and not any(r.get("data_type") == "video" for r in self.stream.records):
            log.warning("rewards.temporal=true but %s has no video records: no temporal bonus can be paid "
                        "(the shuffled-frame rollout needs a video)", cfg.data.train_file)
        self.loss_options = LossOptions(
            loss_type=cfg.grpo.loss_type, beta=cfg.grpo.beta, epsilon_low=cfg.grpo.epsilon_low,
            epsilon_high=cfg.grpo.epsilon_high, delta=cfg.grpo.delta, kl_estimator=cfg.grpo.kl_estimator,
            max_completion_length=cfg.rollout.max_completion_length)

    def batch_plan(self) -> str:
        cfg, t, g = self.cfg, self.cfg.train, self.cfg.rollout.group_size
        per_step = self.world * t.prompts_per_rank
        packed = cfg.data.max_prompt_length + g * cfg.rollout.max_completion_length
        return (f"{self.world} rank(s) x {t.prompts_per_rank} prompt(s) per rank = {per_step} prompts per step; "
                f"G={g} -> {per_step * g} completions per step; {t.groups_per_micro_batch} group(s) per micro-batch "
                f"-> {self.gas} micro-batch(es) per rank (gradient accumulation {self.gas}) x mu="
                f"{cfg.grpo.num_iterations} update pass(es); token budget per packed group <= {packed} "
                f"(prompt <= data.max_prompt_length {cfg.data.max_prompt_length} + G x "
                f"rollout.max_completion_length {cfg.rollout.max_completion_length}); {t.max_steps} steps")

    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        timings = {}
        learning_rate = self.learning_rate()  # the rate this step's updates use (read before the scheduler moves)
        start = time.perf_counter()
        batch = self.collect(step)
        batch.advantages = self.advantages(batch)
        timings["rollout"] = time.perf_counter() - start
        timings["data"] = self.data_wait(step)

        micro_batches = [list(range(i, i + cfg.train.groups_per_micro_batch))
                         for i in range(0, len(batch.prompts), cfg.train.groups_per_micro_batch)]
        start = time.perf_counter()
        reference = [self.logprobs(self.reference, batch, mb) for mb in micro_batches] if self.reference else None
        old = ([self.logprobs(self.engine, batch, mb) for mb in micro_batches]
               if cfg.grpo.num_iterations > 1 else None)
        timings["reference"] = time.perf_counter() - start
        if step == self.start_step and cfg.grpo.self_check and cfg.grpo.grouping == "grouped":
            self.self_check(batch, micro_batches[0])

        start = time.perf_counter()
        losses, loss_metrics, tokens = [], [], 0
        weights = loss_mask(batch.rollout.completion_mask, batch.rollout.stop_reasons,
                            cfg.grpo.mask_truncated_completions)
        per_micro_batch = tokens_per_micro_batch(cfg.grpo.loss_type, weights, len(micro_batches))
        self.engine.train()
        for iteration in range(cfg.grpo.num_iterations):
            for index, mb in enumerate(micro_batches):
                inputs, ids, mask, sizes, rows = self.micro_batch(batch, mb)
                scores = completion_logprobs(self.engine, inputs, ids, mask, sizes, mode=cfg.grpo.grouping,
                                             backend=self.backend, temperature=cfg.rollout.temperature,
                                             return_entropy=iteration == 0, chunk_size=cfg.grpo.logprob_chunk_size,
                                             vision_calls=self.vision_calls(inputs, self.engine, training=True))
                old_lp = old[index] if old is not None else scores.logprobs.detach()
                ref_lp = reference[index] if reference is not None else None
                sampled_lp = batch.rollout.logprobs[rows, : ids.shape[1]].to(self.device)
                is_weights = (truncated_importance_weights(old_lp, sampled_lp, cfg.grpo.importance_sampling_cap)
                              if cfg.grpo.importance_sampling_cap > 0 else None)
                loss, metrics = grpo_loss(scores.logprobs, old_lp, batch.advantages[rows].to(self.device),
                                          weights[rows, : ids.shape[1]].to(self.device), ref_lp, self.loss_options,
                                          is_weights, per_micro_batch)
                self.engine.backward(loss)
                self.engine.step()
                if iteration == 0:
                    metrics.update(mismatch_metrics(old_lp, sampled_lp, mask))
                    metrics["entropy"] = float((scores.entropy * mask).sum() / mask.sum().clamp_min(1))
                losses.append(float(loss.detach()))
                loss_metrics.append(metrics)
                layout = scores.layout
                tokens += layout.packed_tokens if cfg.grpo.grouping == "grouped" else layout.repeated_tokens
        timings["policy"] = time.perf_counter() - start
        metrics = self.step_metrics(step, batch, losses, loss_metrics, timings, tokens)
        metrics["learning_rate"] = learning_rate
        return metrics

    # ---- stages ---------------------------------------------------------------------------------------------
    def collect(self, step: int) -> StepBatch:
        """This rank's groups for the step: one draw of prompts, rolled out and scored. With dynamic sampling,
        groups without signal are dropped and further draws made (every rank draws as often as the neediest one,
        since rollouts may be collective) up to ``dynamic_sampling_max_draws``; a step still short is filled
        with dropped groups."""
        cfg = self.cfg
        need = cfg.train.prompts_per_rank
        batches = [self.rollout_and_score(step, self.stream.next_prompts(need), draw=0)]
        if not cfg.grpo.dynamic_sampling:
            batches[0].sampling = self.group_counts(batches)
            return batches[0]
        kept, dropped = [], []
        while True:
            k = len(batches) - 1
            metric = (batches[k].accuracy if cfg.grpo.dynamic_sampling_metric == "accuracy"
                      else batches[k].total_reward.tolist())
            for g, flat in enumerate(zero_variance_groups(metric, batches[k].rollout.group_sizes)):
                (dropped if flat else kept).append((k, g))
            short = distributed.all_reduce_max([float(need - len(kept))])[0]
            if short <= 0 or k >= cfg.grpo.dynamic_sampling_max_draws:
                break
            batches.append(self.rollout_and_score(step, self.stream.next_prompts(need), draw=k + 1))
        filled = max(0, need - len(kept))
        if filled:
            log.warning("step %d: dynamic sampling found %d of %d groups with signal after %d extra draws; filling "
                        "with %d groups without (raise grpo.dynamic_sampling_max_draws?)", step + 1, len(kept), need,
                        len(batches) - 1, filled)
        chosen = select(batches, kept[:need] + dropped[:filled], cfg.rollout.group_size, self.tokenizer.pad_token_id)
        chosen.sampling = {**self.group_counts(batches), "dynamic_sampling/dropped": float(len(dropped)),
                           "dynamic_sampling/filled": float(filled),
                           "dynamic_sampling/extra_draws": float(len(batches) - 1)}
        return chosen

    @staticmethod
    def group_counts(batches: list[StepBatch]) -> dict[str, float]:
        """Among every group the step drew: all correct (accuracy 1), all wrong (accuracy 0), and zero reward
        variance (no advantage signal). Counts here; fractions after the all-reduce."""
        correct = wrong = flat = total = 0
        for batch in batches:
            start = 0
            flat += sum(zero_variance_groups(batch.total_reward.tolist(), batch.rollout.group_sizes))
            for size in batch.rollout.group_sizes:
                group = batch.accuracy[start : start + size]
                correct += all(a >= 1.0 for a in group)
                wrong += all(a <= 0.0 for a in group)
                total += 1
                start += size
        return {"groups/all_correct": float(correct), "groups/all_wrong": float(wrong),
                "groups/zero_variance": float(flat), "groups/drawn": float(total)}

    def advantages(self, batch: StepBatch) -> torch.Tensor:
        scale = scale_rewards(self.cfg.grpo)
        batch_std = None
        if scale == "batch":  # the std of every reward of the step, over all ranks (unbiased)
            r = batch.total_reward.double()
            n, total, squares = distributed.all_reduce_sum([float(r.numel()), float(r.sum()), float((r * r).sum())])
            batch_std = math.sqrt(max(squares - total * total / n, 0.0) / max(n - 1, 1))
        return group_advantages(batch.total_reward, batch.rollout.group_sizes, scale=scale, batch_std=batch_std)

    def rollout_and_score(self, step: int, prompts: list[EncodedPrompt], draw: int = 0) -> StepBatch:
        cfg = self.cfg
        inputs = to_device(collate_prompts([p.inputs for p in prompts], self.tokenizer.pad_token_id), self.device)
        sampling = SamplingConfig(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                  top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_completion_length,
                                  stop_strings=tuple(cfg.rollout.stop_strings),
                                  seed=None)
        # Every prompt its own random stream: independent across steps, draws, ranks and positions in the batch.
        seeds = [derive_seed(cfg.train.seed, step, self.rank, draw, i) for i in range(len(prompts))]
        self.engine.eval()
        rollout = self.generate(inputs, sampling, seeds)
        texts = self.decode(rollout)
        records = [p.record for p in prompts for _ in range(cfg.rollout.group_size)]
        rewards = score(self.rewards, texts, records)
        accuracy = [accuracy_of(t, r, cfg.rewards.regression) for t, r in zip(texts, records)]
        g, rc = cfg.rollout.group_size, cfg.rewards
        if rc.length:
            lengths = rollout.completion_mask.sum(1).tolist()
            rewards["length"] = [bonus for i in range(len(prompts)) for bonus in length_bonus(
                accuracy[i * g : (i + 1) * g], lengths[i * g : (i + 1) * g], rc.length_min_tokens,
                rc.length_max_tokens, rc.length_bonus, rc.bonus_rules)]
        if rc.temporal:
            rewards["temporal"] = self.temporal_rewards(step, prompts, accuracy, records, sampling)
        weights = {name: weight for name, _, weight in self.rewards}
        total = torch.tensor([sum(weights.get(name, 1.0) * values[i] for name, values in rewards.items())
                              for i in range(len(texts))], dtype=torch.float32)
        return StepBatch(prompts, rollout, texts, accuracy, rewards, total)

    def temporal_rewards(self, step, prompts, accuracy, records, sampling) -> list[float]:
        """T-GRPO: the same prompts with shuffled frames; bonus when ordered frames answer better."""
        shuffled = []
        for i, prompt in enumerate(prompts):
            if prompt.record.get("data_type") != "video":
                shuffled.append(None)
                continue
            again = self.stream.encode(prompt.record, shuffle_frames_seed=derive_seed(self.cfg.train.seed, step, i))
            shuffled.append(again)
        bonus = [0.0] * len(accuracy)
        video = [i for i, s in enumerate(shuffled) if s is not None]
        collective = distributed.forwards_are_collective(self.engine)
        if collective and distributed.all_reduce_max([float(bool(video))])[0] > 0 and not video:
            # Under ZeRO-3 a rollout gathers parameters collectively: this rank has no video but another has, so
            # it joins with a throwaway rollout of its own prompt (discarded) instead of leaving the others hanging.
            dummy = to_device(collate_prompts([prompts[0].inputs], self.tokenizer.pad_token_id), self.device)
            self.generate(dummy, sampling, [0])
            return bonus
        if not video:
            return bonus
        inputs = to_device(collate_prompts([shuffled[i].inputs for i in video], self.tokenizer.pad_token_id),
                           self.device)
        rollout = self.generate(inputs, sampling, [derive_seed(self.cfg.train.seed, step, self.rank, "shuffled", i)
                                                   for i in video])
        shuffled_texts = self.decode(rollout)
        g, rc = self.cfg.rollout.group_size, self.cfg.rewards
        for k, i in enumerate(video):
            ordered = accuracy[i * g : (i + 1) * g]
            mixed = [accuracy_of(t, records[i * g], rc.regression) for t in shuffled_texts[k * g : (k + 1) * g]]
            bonus[i * g : (i + 1) * g] = temporal_bonus(ordered, mixed, rc.temporal_alpha, rc.temporal_ratio,
                                                        rc.bonus_rules)
        return bonus

    def generate(self, inputs: dict, sampling: SamplingConfig, seeds: list[int]) -> Rollout:
        vision_calls = self.hooked_vision_calls(inputs, self.engine)  # agreed before: gathering is collective too
        with distributed.gathered_for_inference(self.engine, self.cfg.rollout.zero3_gather) as (model, collective):
            return generate_groups(model, inputs, self.cfg.rollout.group_size, sampling, tokenizer=self.tokenizer,
                                   engine=self.cfg.rollout.engine, synced=collective, vision_calls=vision_calls,
                                   prompt_seeds=seeds)

    def hooked_vision_calls(self, inputs: dict, engine) -> tuple[str, ...] | None:
        """Agreed vision calls for a no-grad forward, needed only when it keeps DeepSpeed's hooks (per_step)."""
        return self.vision_calls(inputs, engine) if self.cfg.rollout.zero3_gather == "per_step" else None

    def decode(self, rollout: Rollout) -> list[str]:
        return [self.tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]

    def micro_batch(self, batch: StepBatch, group_indices: list[int]):
        g = self.cfg.rollout.group_size
        rows = torch.tensor([i * g + j for i in group_indices for j in range(g)])
        mask = batch.rollout.completion_mask[rows]
        width = int(mask.sum(1).max())
        inputs = to_device(collate_prompts([batch.prompts[i].inputs for i in group_indices],
                                           self.tokenizer.pad_token_id), self.device)
        ids = batch.rollout.completion_ids[rows, :width].to(self.device)
        return inputs, ids, mask[:, :width].to(self.device), [g] * len(group_indices), rows

    @torch.no_grad()
    def logprobs(self, model, batch: StepBatch, group_indices: list[int]) -> torch.Tensor:
        inputs, ids, mask, sizes, _ = self.micro_batch(batch, group_indices)
        model, adapters_off = lora.resolve(model)  # a LoRA policy's reference is itself with the adapters off
        vision_calls = self.hooked_vision_calls(inputs, model)
        with (distributed.gathered_for_inference(model, self.cfg.rollout.zero3_gather) as (module, _),
              lora.adapters_disabled(module, adapters_off)):
            was_training = module.training
            module.eval()
            # At the rollout temperature, like the policy forward: ratios and KL compare the same distributions.
            scores = completion_logprobs(module, inputs, ids, mask, sizes, mode=self.cfg.grpo.grouping,
                                         backend=self.backend, temperature=self.cfg.rollout.temperature,
                                         vision_calls=vision_calls, chunk_size=self.cfg.grpo.logprob_chunk_size)
            module.train(was_training)
        return scores.logprobs

    @torch.no_grad()
    def self_check(self, batch: StepBatch, group_indices: list[int]) -> None:
        inputs, ids, mask, sizes, _ = self.micro_batch(batch, group_indices)
        # Gathered whole: in low precision the check also runs a float32 forward, upcasting layer by layer.
        with distributed.gathered_for_inference(self.engine, "full") as (module, _):
            result = verify_grouping(module, inputs, ids, mask, sizes, backend=self.backend)
        log.info("self-check passed: %s", result.describe())

    # ---- bookkeeping ----------------------------------------------------------------------------------------
    def step_metrics(self, step, batch: StepBatch, losses, loss_metrics, timings, tokens) -> dict:
        cfg = self.cfg
        rollout = batch.rollout
        lengths = rollout.completion_mask.sum(1).float()
        layouts_saved = sum(
            (p.length * (cfg.rollout.group_size - 1)) for p in batch.prompts)  # prefix tokens not re-encoded
        local = {
            "reward/mean": float(batch.total_reward.mean()),
            "reward/std": float(batch.total_reward.std()) if batch.total_reward.numel() > 1 else 0.0,
            "accuracy": sum(batch.accuracy) / len(batch.accuracy),
            "completion_length": float(lengths.mean()),
            "completions/empty": float(sum(1 for t in batch.texts if not t.strip())),
            "completions/eos_fraction": sum(r != "length" for r in rollout.stop_reasons) / len(rollout.stop_reasons),
            "loss": sum(losses) / len(losses),
            **{key: mean_of(loss_metrics, key) for key in ("kl", "clip_fraction", "clip_fraction_low",
                                                            "clip_fraction_high", "entropy",
                                                            "mismatch/mean_abs_logprob_diff")},
            "completions/truncated_fraction": sum(r == "length" for r in rollout.stop_reasons) / len(rollout.stop_reasons),
            "time/rollout": timings["rollout"],
            "time/data_wait": timings["data"],
            "time/reference": timings["reference"],
            "time/policy": timings["policy"],
            "tokens/policy_forward": float(tokens),
            "tokens/prefix_saved_by_grouping": float(layouts_saved if cfg.grpo.grouping == "grouped" else 0),
        }
        for name, values in batch.rewards.items():
            local[f"reward/{name}"] = sum(values) / len(values)
        keys = sorted(local)
        summed = distributed.all_reduce_sum([local[k] for k in keys])
        averaged = {k: v / self.world for k, v in zip(keys, summed)}
        for key in ("completions/empty", "tokens/policy_forward", "tokens/prefix_saved_by_grouping"):
            averaged[key] = averaged[key] * self.world  # totals, not means
        counts = sorted(batch.sampling)
        *summed_counts, trained = distributed.all_reduce_sum([batch.sampling[k] for k in counts]
                                                             + [float(len(batch.prompts))])
        totals = dict(zip(counts, summed_counts))
        drawn = max(totals.pop("groups/drawn", 0.0), 1.0)
        averaged["groups/trained"] = trained
        for key, value in totals.items():  # fractions of the groups drawn; dynamic-sampling figures as totals
            averaged[key] = value / drawn if key.startswith("groups/") else value
        if "dynamic_sampling/extra_draws" in averaged:  # every rank draws equally often
            averaged["dynamic_sampling/extra_draws"] /= self.world
        averaged["mismatch/max_ratio"] = distributed.all_reduce_max(
            [max((m.get("mismatch/max_ratio", 1.0) for m in loss_metrics), default=1.0)])[0]
        step_time = timings["rollout"] + timings["reference"] + timings["policy"]
        averaged["time/step"] = step_time
        averaged["tokens_per_second"] = averaged["tokens/policy_forward"] / max(timings["policy"], 1e-9)
        grad_norm = self.engine.get_global_grad_norm()
        averaged["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        averaged["data/skipped"] = float(sum(self.stream.skipped.values()))
        every = cfg.logging.sample_table_every
        if every and (step + 1) % every == 0 and self.rank == 0:
            g = cfg.rollout.group_size
            self.tracker.log_samples(step + 1, [
                {"problem_id": str(batch.prompts[i // g].record.get("problem_id", "")),
                 "question": batch.prompts[i // g].record["problem"][:200],
                 "solution": batch.prompts[i // g].record["solution"], "completion": batch.texts[i],
                 "reward": float(batch.total_reward[i])}
                for i in range(min(len(batch.texts), 2 * g))])
        return averaged



def main(argv: list[str] | None = None) -> None:
    run(GRPOTrainer, __doc__, argv)


if __name__ == "__main__":
    main()
