"""What a GRPO step measured (``step_metrics``: each value declared with its reduction over ranks), the rollout's
parts (``rollout_parts``), the samples table, the groups' counts, and the stage timers (``timed``: wall seconds; on
CUDA also the allocator's peak; ``part_timer``: seconds added to a dict).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

from app.objectives.grpo import zero_variance_groups
from app.objectives.router import declare_sums
from app.runtime.heap import ALLOCATOR_PEAK_ENV, heap_peak
from app.runtime.tracking import StepMetrics
from app.training.trajectory import Trajectory


def step_metrics(t: Trajectory, updates: list[dict], seconds: dict, grouped: bool) -> StepMetrics:
    """What a step measured, each declared with its reduction over ranks. ``updates``: one dict per micro-batch
    update (loss, metrics, tokens); ``seconds``: rollout, data_wait, reference, policy."""
    reasons, n = t.rollout.stop_reasons, max(len(t.texts), 1)
    first = [u["metrics"] for u in updates if "entropy" in u["metrics"]]  # the first pass over the micro-batches
    m = StepMetrics()
    m.mean("reward/mean", float(t.total_reward.mean()))
    m.mean("reward/std", float(t.total_reward.std()) if t.total_reward.numel() > 1 else 0.0)
    for name, values in t.rewards.items():
        m.mean(f"reward/{name}", sum(values) / len(values))
    m.mean("accuracy", sum(t.accuracy) / n)
    m.mean("completion_length", float(t.rollout.completion_mask.sum(1).float().mean()))
    m.sum("completions/empty", float(sum(1 for text in t.texts if not text.strip())))
    m.mean("completions/eos_fraction", sum(r != "length" for r in reasons) / n)
    m.mean("completions/truncated_fraction", sum(r == "length" for r in reasons) / n)
    m.mean("loss", sum(u["loss"] for u in updates) / len(updates))
    for key in ("kl", "clip_fraction", "clip_fraction_low", "clip_fraction_high", "ratio/mean"):
        m.mean(key, mean_of([u["metrics"] for u in updates], key))
    m.min("ratio/min", min((u["metrics"]["ratio/min"] for u in updates if "ratio/min" in u["metrics"]), default=1.0))
    m.max("ratio/max", max((u["metrics"]["ratio/max"] for u in updates if "ratio/max" in u["metrics"]), default=1.0))
    m.mean("entropy", mean_of(first, "entropy"))
    m.mean("mismatch/mean_abs_logprob_diff", mean_of(first, "mismatch/mean_abs_logprob_diff"))
    m.max("mismatch/max_ratio", max((u.get("mismatch/max_ratio", 1.0) for u in first), default=1.0))
    if any("routing/replayed" in u for u in first):  # rollout.routing_replay=r3, on every rank alike
        m.fraction("routing/replay_differs", sum(u.get("routing/replayed_otherwise", 0.0) for u in first),
                   sum(u.get("routing/replayed", 0.0) for u in first))
    for key in ("rollout", "data_wait", "reference", "policy", "weight_sync"):
        if key in seconds:
            m.mean(f"time/{key}", seconds[key])
    m.mean("time/step", seconds["rollout"] + seconds["reference"] + seconds["policy"] + seconds.get("weight_sync", 0.0))
    for key, value in seconds.items():  # CUDA: the allocator's peak per stage, the largest over ranks
        if key.startswith("peak_gib/"):
            m.max(f"memory/{key.removeprefix('peak_gib/')}_peak_gib", value)
        elif key.startswith("above_gib/"):  # CPU, a benchmark's switch: above what the stage began with
            m.max(f"memory/{key.removeprefix('above_gib/')}_above_start_gib", value)
            m.each(f"memory/{key.removeprefix('above_gib/')}_above_start_gib", value)
    m.sum("tokens/policy_forward", float(sum(u["tokens"] for u in updates)))
    saved = sum(p.length * (size - 1) for p, size in zip(t.prompts, t.group_sizes))  # prefix tokens not re-encoded
    m.sum("tokens/prefix_saved_by_grouping", float(saved if grouped else 0))
    m.sum("tokens/shared_video", float(sum(u.get("shared", 0) for u in updates)))  # V once per family, not per question
    m.fraction("tokens/shared_video_fraction", float(sum(u.get("shared", 0) for u in updates)),
               float(sum(u.get("prompt_tokens", 0) for u in updates)))
    rollout = t.rollout  # every draw's: the prompt tokens it was given and those it prefilled (a reused prefix not)
    m.sum("rollout/prompt_tokens", float(rollout.prompt_tokens))
    m.sum("rollout/prefill_tokens", float(rollout.prefill_tokens))
    m.fraction("rollout/prefix_cache_hit_rate", float(max(rollout.prompt_tokens - rollout.prefill_tokens, 0)),
               float(rollout.prompt_tokens))
    m.sum("groups/trained", float(len(t.prompts)))
    router = [u["router"] for u in updates if u.get("router") is not None]  # the first pass's (MoE)
    declare_sums(m, sum(router[1:], router[0]) if router else None)
    for key, value in t.counts.items():
        m.sum(key, value)
    for key, value in t.draws.items():
        if key.startswith("groups/") and key != "groups/drawn":
            m.fraction(key, value, t.draws.get("groups/drawn", 0.0))  # of the groups drawn, over all ranks
        elif key == "dynamic_sampling/extra_draws":
            m.mean(key, value)  # every rank draws equally often
        elif key.startswith("dynamic_sampling/"):
            m.sum(key, value)
    return m


def sample_rows(t: Trajectory, limit: int) -> list[dict]:
    """The first ``limit`` completions with their question, for the samples table."""
    records = t.records
    return [{"problem_id": str(records[i].get("problem_id", "")), "question": records[i]["problem"][:200],
             "solution": records[i]["solution"], "completion": t.texts[i], "reward": float(t.total_reward[i])}
            for i in range(min(len(t.texts), limit))]


def group_counts(trajectories: list[Trajectory]) -> dict[str, float]:
    """Among every group the step drew: all correct (accuracy 1), all wrong (accuracy 0), and zero reward
    variance (no advantage signal). Counts here; fractions of the groups drawn after the reduction."""
    correct = wrong = flat = total = 0
    for t in trajectories:
        flat += sum(zero_variance_groups(t.total_reward.tolist(), t.group_sizes))
        for rows in t.groups():
            correct += all(a >= 1.0 for a in t.accuracy[rows])
            wrong += all(a <= 0.0 for a in t.accuracy[rows])
            total += 1
    return {"groups/all_correct": float(correct), "groups/all_wrong": float(wrong),
            "groups/zero_variance": float(flat), "groups/drawn": float(total)}


def mean_of(metrics: list[dict], key: str) -> float:
    values = [m[key] for m in metrics if key in m]
    return sum(values) / len(values) if values else 0.0


@contextmanager
def timed(seconds: dict, key: str):
    """``seconds[key]``: the block's wall time; on CUDA also ``seconds["peak_gib/" + key]``, the allocator's peak
    during the block (``torch.cuda.max_memory_allocated``, everything this process holds). On CPU with
    ``ALLOCATOR_PEAK_ENV`` set (a benchmark's switch), ``seconds["above_gib/" + key]``: the heap's peak above what
    it held when the block began (``app.runtime.heap``), what the planner calls a stage's memory on top of the
    states."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    record = heap_peak("cpu") if not cuda and key != "rollout" else None  # the engine records its own
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[key] = time.perf_counter() - start
        if cuda:
            seconds[f"peak_gib/{key}"] = torch.cuda.max_memory_allocated() / 2**30
        if record is not None:
            seconds[f"above_gib/{key}"] = record.stop() / 2**30


ROLLOUT_PARTS = ("gather", "tower", "prefill", "capture", "decode", "sampling", "scoring")  # engine's, then trainer's


@contextmanager
def part_timer(parts: dict, key: str):
    """Adds the block's wall seconds to ``parts[key]`` (on CUDA after the device finished its work)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    start = time.perf_counter()
    try:
        yield
    finally:
        if cuda:
            torch.cuda.synchronize()
        parts[key] = parts.get(key, 0.0) + time.perf_counter() - start


def rollout_parts(m: StepMetrics, parts: dict, seconds: dict, bandwidth_tb_s: float | None) -> None:
    """Where ``time/rollout`` went: the engine's parts (weight gathering, the tower, the prefill, graph capture or
    compilation, decode steps, sampling with the host's bookkeeping), the trainer's (waiting for data, scoring), and
    ``rollout/other_s``, what none of them covers; the decode steps and their milliseconds; on CUDA the bytes a step
    reads over its time against the card's nominal bandwidth; whether the step replayed a kept graph, and what the
    kept steps did (captures, compiles, recompiles)."""
    for name in ROLLOUT_PARTS:  # every rank declares the same metrics (a rank that sampled nothing: zeros)
        m.mean(f"rollout/{name}_s", parts.get(name, 0.0))
    accounted = sum(parts.get(name, 0.0) for name in ROLLOUT_PARTS) + seconds.get("data_wait", 0.0)
    m.mean("rollout/other_s", seconds["rollout"] - accounted)
    steps = parts.get("decode_steps", 0.0)
    m.mean("rollout/decode_steps", steps)
    per_step = parts.get("decode", 0.0) / steps if steps else 0.0
    m.mean("rollout/decode_ms_per_step", 1e3 * per_step)
    m.mean("rollout/graph_replayed", parts.get("graph_replayed", 0.0))
    for key in ("tower_patches", "prefill_tokens", "kv_bytes"):  # each rank's own (1/S of a spread family's)
        m.each(f"rollout/work/{key}", parts.get(f"work/{key}", 0.0))
    m.each("rollout/cpu_s", parts.get("cpu_s", 0.0))  # the rollout's CPU time in this process (threads included)
    for key in ("captures", "compiles", "recaptures"):
        m.sum(f"rollout/{key}", parts.get(f"kept/{key}", 0.0))
    m.sum("rollout/recompiles", parts.get("recompiles", 0.0))
    if os.environ.get(ALLOCATOR_PEAK_ENV) == "1":  # CPU benchmarks: the engine's allocator peak above its start
        m.max("memory/rollout_engine_above_start_gib", parts.get("engine_above_gib", 0.0))
        m.each("memory/rollout_engine_above_start_gib", parts.get("engine_above_gib", 0.0))
    if bandwidth_tb_s:  # the fastest rank's decode step against the card's bandwidth (1.0: at the bandwidth)
        achieved = parts["decode_bytes_per_step"] / per_step / 1e12 if per_step and \
            parts.get("decode_bytes_per_step") else 0.0
        m.max("rollout/decode_tb_s", achieved)
        m.min("rollout/decode_vs_bandwidth_limit", bandwidth_tb_s / achieved if achieved else 1e9)
