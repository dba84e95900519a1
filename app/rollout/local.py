"""rollout.engine=grouped / hf: sampling from the policy in this process (``app.rollout.generate.generate_groups``).

Under ZeRO-3 the policy is gathered as ``rollout.zero3_gather`` says (``zero.gathered_for_inference``); with
``per_step`` DeepSpeed's hooks stay on, so every rank's prefill makes the same vision-tower calls (``vision_calls``:
agreed across ranks) and the ranks decode in lock step (``synced``).
"""

from __future__ import annotations

import time

from app.data.prompts import collate_prompts
from app.grouping import StaticSteps
from app.grouping.decoding.clock import PartClock
from app.grouping.families import family_sizes
from app.rollout.base import EngineSetup, RolloutEngine
from app.rollout.generate import Rollout, generate_groups
from app.runtime import zero
from app.runtime.heap import heap_peak


class LocalEngine(RolloutEngine):
    """The engine keeps, for the whole run, its static decode steps (``StaticSteps``: captured as a CUDA graph or
    compiled once per shape bucket, replayed in every later rollout; captures run inside ``setup.capture_guard``,
    the trainer's pause of its data-prefetch threads), and times each rollout's parts (``Rollout.parts``)."""

    def __init__(self, name: str, setup: EngineSetup):
        self.name, self.setup = name, setup
        self.kept = StaticSteps(guard=setup.capture_guard)
        self.spreads = name == "grouped"
        # rollout.routing_replay=r3: every rollout carries its routing record (``SharedInGroup`` gathers it too)
        self.records_routing = name == "grouped" and getattr(setup.rollout, "routing_replay", "off") == "r3"

    def generate(self, prompts, group_size: int, seeds, sampling=None, *, spread=None) -> Rollout:
        """``spread``: the sequence-parallel group every rank of which samples these prompts together (``generate_groups``);
        it needs the policy's parameters whole during the rollout (ZeRO-3: rollout.zero3_gather=full)."""
        s = self.setup
        cpu = time.process_time()  # this process's CPU seconds (every thread): what a rank spent where cores are few
        clock = PartClock(s.device)
        share = (spread.rank, spread.size) if spread is not None else None  # a spread rank reads its share of the pixels
        inputs = collate_prompts([p.inputs for p in prompts], s.pad_id, s.device, share=share)
        mode = getattr(s.rollout, "zero3_gather", "full")
        per_step = mode == "per_step"  # DeepSpeed's hooks stay on: the ranks' tower calls must agree
        vision_calls = s.vision_calls(inputs) if per_step and s.vision_calls is not None else None
        decode = decode_step(getattr(s.rollout, "decode", "auto"), zero.parameters_stay_put(s.policy, mode), mode)
        s.policy.eval()
        record = heap_peak(s.device)  # a benchmark's switch (ALLOCATOR_PEAK_ENV): the engine's own peak
        clock.lap("prefill")  # collating the prompts
        with zero.gathered_for_inference(s.policy, mode) as (model, collective):
            clock.lap("gather")
            if spread is not None and collective:
                raise ValueError(f"rollout.zero3_gather={mode} gathers parameters in every forward, collectively over "
                                 "every rank, but a rollout spread over a sequence-parallel group runs different "
                                 "pieces on its ranks between collectives: use rollout.zero3_gather=full")
            rollout = generate_groups(model, inputs, group_size, sampling or s.sampling, tokenizer=s.tokenizer,
                                      eos_ids=s.eos_ids, pad_id=s.pad_id, engine=self.name, synced=collective,
                                      vision_calls=vision_calls, prompt_seeds=list(seeds),
                                      prefill_chunk_size=getattr(s.rollout, "prefill_chunk_size", 0), decode=decode,
                                      families=family_sizes([getattr(p, "share", None) for p in prompts]),
                                      static_steps=self.kept, clock=clock, spread=spread,
                                      record_routing=self.records_routing)
            release = PartClock(s.device)
        release.lap("gather")  # the parameters released (ZeRO-3: partitioned again)
        rollout.parts["gather"] = rollout.parts.get("gather", 0.0) + release.seconds().get("gather", 0.0)
        if record is not None:
            rollout.parts["engine_above_gib"] = record.stop() / 2**30
        rollout.parts["cpu_s"] = time.process_time() - cpu
        return rollout


def decode_step(requested: str, parameters_stay_put: bool, gather_mode: str) -> str:
    """``rollout.decode`` where the policy's parameters move during a rollout (ZeRO-3 gathering layer by layer or
    per step): ``auto`` becomes eager, and an explicit static or graph step is refused (a graph replays fixed
    addresses)."""
    if parameters_stay_put:
        return requested
    if requested in ("static", "graph", "compiled"):
        raise ValueError(f"rollout.decode={requested} needs the policy's parameters in place during the rollout; "
                         f"ZeRO-3 with rollout.zero3_gather={gather_mode} gathers them during every forward. Use "
                         "rollout.zero3_gather=full or rollout.decode=auto")
    return "eager"
