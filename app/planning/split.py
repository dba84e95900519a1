"""Whole families or spread: a sequence-parallel group's rollout priced both ways by the planner's model
(``timing.split_seconds``), for the trainer's rollout (``rollout.sp_split=auto``: ``app.rollout.base.choose_split``);
the plan itself resolves it the same way (``timing.resolve_split``).

A spread rollout gives every rank 1/S of each family's prefill and K/V (and tower), but every rank runs each decode
step's linear layers and sampling for all the samples, and each step exchanges the heads' outputs (one collective per
layer). Whole families give each rank its families alone; with fewer families than ranks some ranks idle. So a long
video spreads and a short one stays whole; the crossover depends on the model, G, the completion length and the
device, which is why it is priced, not fixed.

The price is the busiest rank's rollout seconds (prefill, decode, overhead). The tower is left out (the prompts'
loads are token counts), in the plan too so that both choose alike: that understates what spreading saves on a long video, so the price
leans to whole families. On a CPU (``CPU_WORLD``) the numbers are set for this project's 2-core test machine, to agree
with two measurements (``CPU_SOURCES``); on CUDA they are the planner's own (``planner.World``, the calibrated
constants).
"""

from __future__ import annotations

from dataclasses import replace

from app.planning import timing
from app.planning.planner import QUESTION_TOKENS, World, attention_backend, deepspeed_settings, tower_trains

CPU_WORLD = World(device="cpu", gpus_per_node=2, peak_tflops=0.05, bandwidth_tbs=0.01, link_tbs=0.002,
                  calibration=timing.CALIBRATION.changed(prefill_efficiency=1.0, weight_efficiency=1.0,
                                                         kv_efficiency=1.0, varlen_kv_efficiency=1.0,
                                                         eager_launch_ms=0.05, graph_launch_ms=0.05,
                                                         collective_ms=1.0, link_efficiency=1.0, rollout_s=0.0),
                  varlen=False)
CPU_SOURCES = ("a spread rollout at 640 frames (20,480 prompt tokens) took the busiest rank 0.48x of one rank's CPU "
               "time at S = 2 and 0.27x at S = 4 (docs/benchmarks.md, long_rehearsal; priced 0.51x, 0.26x); at 48 "
               "frames it cost 1.28x (issue 74's measurement; priced 2-4x: the price overstates the loss at short "
               "prompts but picks the same side). Peak 50 GFLOP/s, 10 GB/s, a gloo collective 1 ms: set for this "
               "2-core machine, not measured on a CPU in general")


def runtime_world(device: str, ranks: int) -> World:
    """The world a run's own rollout is priced on: this machine's numbers on a CPU, the planner's on CUDA."""
    if device == "cuda":
        return World(gpus_per_node=max(1, ranks))
    return replace(CPU_WORLD, gpus_per_node=max(1, ranks))


def rollout_pricer(cfg, model_config, *, device: str, ranks: int, zero_stage: int | None = None):
    """``priced(loads, questions, size)`` -> (seconds spread, seconds whole families) for
    ``app.rollout.base.choose_split``: this run's rollout priced both ways on ``device``
    (``timing.split_seconds``, as the planner prices it: ``timing.resolve_split``). ``zero_stage``: the run's own
    (else read from train.deepspeed_config)."""
    from app.planning import costs, shapes

    shape, counts = costs.shape_of(model_config), shapes.count_parameters(model_config)
    world = runtime_world(device, ranks)
    ds = deepspeed_settings(cfg) if zero_stage is None else {"stage": zero_stage}
    fixed = dict(ds=ds, lora=cfg.lora.rank > 0, tower_trains=tower_trains(cfg), backend=attention_backend(cfg),
                 question_tokens=QUESTION_TOKENS)

    def priced(loads, questions, size):
        return timing.split_seconds(cfg, shape, counts, world, loads=list(loads), questions=list(questions),
                                    size=size, **fixed)

    return priced
