"""Step time by phase, each phase with the bound that limits it, from the model's shape, the run's settings and a
calibration measured on GPUs (``Calibration``: every constant names its source).

- **FLOP-bound** (at a share of the card's peak): the vision tower and the prefill in the rollout, the reference
  and old-policy forwards, the policy update (LoRA's frozen weights get no weight gradient: its backward is one
  forward of matmuls, not two).
- **The tower's attention calls**: without flash-attn, transformers' Qwen vision attention runs one SDPA call per
  window (Qwen2.5-VL) or per frame (Qwen2-VL, Qwen3-VL) of every block, a fixed cost per call: at 448 x 448 and 64
  frames, 12,896 calls per pass of Qwen2.5-VL-7B's tower cut to 28 blocks.
- **Bandwidth-bound decode**: each step reads the weights (at the card's measured copy bandwidth) and the K/V of
  the prefixes and of the completions so far (our decode attention reads K/V at a lower share), plus a launch
  cost per layer (a replayed CUDA graph, or eager steps where ZeRO-3 gathers during the rollout). HF generate
  (rollout.engine=hf, the TRL-style A/B) prefills and reads G copies of each prompt and steps eagerly: planned with
  the same constants, not fitted to a measured HF rollout.
- **Overheads**: a fixed cost per rollout (gather, graph capture, collation, sampling), and per decoder layer of
  every update pass (ZeRO-3's hooks, the optimizer step).

Each phase is a sum of terms, a feature of the workload times one calibration constant (``phase_terms``), so the
constants are fitted to the committed GPU points by ``app/bench/planning/calibrate.py`` (``docs/gpu/points.json``)
and ``tests/test_planner_timing.py`` checks the fit at every point. Phases run per rank; under sequence
parallelism the training forwards split over S ranks and the rollout's families spread over them.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from app.objectives.router import counting_passes
from app.planning import flops, traffic
from app.planning.costs import Shape, Workload
from app.planning.traffic import expert_parallel  # noqa: F401  (the phases' EP)
from app.rollout.registry import memory_kind

PHASES = ("tower", "prefill", "decode", "rollout_overhead", "reference", "old_policy", "router_counts", "update",
          "weight_sync")
ROLLOUT_PHASES = ("tower", "prefill", "decode", "rollout_overhead")


@dataclass(frozen=True)
class Calibration:
    """Efficiencies (shares of the card's peak FLOP/s or bandwidth) and fixed costs of the step's phases. The
    committed values are data (``calibration.json``, written by ``app/bench/planning/calibrate.py``)."""

    prefill_efficiency: float  # the rollout's tower and prefill: share of peak FLOP/s
    forward_efficiency: float  # reference and old-policy forwards (the packed row, no gradient)
    train_efficiency: float  # the policy's forward and backward
    tower_call_ms: float  # one attention call of the vision tower (per window or frame of a block)
    update_layer_s: float  # per decoder layer and update pass: ZeRO-3 hooks, the optimizer step
    rollout_s: float  # per rollout: gather, graph capture, collation, sampling
    weight_efficiency: float  # decode: weights read at this share of the card's bandwidth
    kv_efficiency: float  # decode: the prefixes' and completions' K/V read at this share (the two-bmm path)
    varlen_kv_efficiency: float  # the same through torch's varlen flash kernel (CUDA, bf16: the default there)
    graph_launch_ms: float  # decode: per layer and step, a replayed CUDA graph of the step
    eager_launch_ms: float  # decode: per layer and step, eager steps (ZeRO-3 gathering during the rollout)
    link_efficiency: float  # ZeRO-3 gathers during a rollout: share of the link's bandwidth (not measured)
    collective_ms: float  # one collective call between GPUs (a spread rollout's exchanges): its latency
    push_tensor_ms: float  # vLLM's in-place reload, per checkpoint tensor pushed (its loader's work beside the copy)

    def changed(self, **values) -> Calibration:
        return replace(self, **values)


SOURCES = {  # where each constant comes from (docs/gpu/points.json holds the numbers; calibrate.py fits them)
    "prefill_efficiency": "fitted to the rollouts of the 4 H200 points (docs/gpu/points.json)",
    "forward_efficiency": "fitted to the reference phases of the 4 H200 points",
    "train_efficiency": "fitted to the update phases of the 4 H200 points",
    "tower_call_ms": "fitted to the rollouts, references and updates of the 4 H200 points (the 4-layer full-model "
                     "rehearsal runs the tower in every pass)",
    "update_layer_s": "fitted to the update phases of the 4 H200 points (4 and 28 layers)",
    "rollout_s": "fitted to the rollouts of the 4 H200 points",
    "weight_efficiency": "the H200's measured copy bandwidth, 4.22 of 4.8 TB/s (docs/gpu/2026-11-26_h200_run2, "
                         "decode part)",
    "kv_efficiency": "the decode step at 8k and 16k prefixes, 9.64 and 10.66 ms (docs/gpu/2026-11-26_h200_run2): "
                     "0.47 GB more K/V read per step cost 1.02 ms",
    "varlen_kv_efficiency": "not measured yet: the two-bmm path's value (kv_efficiency) until scripts/gpu_check.sh's "
                            "varlen part runs and calibrate --merge adds its decode steps",
    "graph_launch_ms": "the 8k decode step captured as a CUDA graph, 9.64 ms, less its weights and K/V reads, over "
                       "28 layers (docs/gpu/2026-11-26_h200_run2)",
    "eager_launch_ms": "the 8k decode step stepped eagerly, 36.3 ms, less its reads, over 28 layers (same run)",
    "collective_ms": "an assumption (nothing gathered across GPUs has been measured): an NCCL all-gather or all-to-all "
                     "of a few hundred KB within one NVLink node takes about 30 microseconds",
    "link_efficiency": "an assumption (nothing gathered across GPUs has been measured): NCCL all-gathers reach about "
                       "70% of NVLink's bandwidth",
    "push_tensor_ms": "an assumption (no push into vLLM's CUDA build has been timed): its reload maps each tensor's "
                      "name and calls its layer's loader in Python, about 0.1 ms a tensor beside the copy",
}
COMMITTED = json.loads((Path(__file__).with_name("calibration.json")).read_text())
CALIBRATION = Calibration(**COMMITTED["constants"])
SOURCES.update(COMMITTED.get("sources", {}))  # constants measured since (calibrate --merge) name their runs
LEAVE_ONE_OUT = COMMITTED["leave_one_out"]  # each GPU point predicted by the fit on the others (summary)


def leave_one_out_line() -> str:
    """One line: how far the planned step has been from the measured one on GPU points left out of the fit."""
    s = LEAVE_ONE_OUT
    return (f"step time on GPU points left out of the fit: {s['step_low']:.2f}-{s['step_high']:.2f}x of measured "
            f"(worst {s['worst_step']:.2f}x; leave-one-out over the {s['points']} points measured on "
            f"{COMMITTED['card'] or 'a GPU'}: docs/planner.md)")


def calibration_from(values: dict | None) -> Calibration:
    """``CALIBRATION`` with ``values`` ({field: number}) set; an unknown field is named."""
    names = {f.name for f in fields(Calibration)}
    unknown = sorted(set(values or {}) - names)
    if unknown:
        raise ValueError(f"unknown calibration key(s) {unknown}; known: {sorted(names)}")
    return CALIBRATION.changed(**{k: float(v) for k, v in (values or {}).items()})


@dataclass(frozen=True)
class Rank:
    """What one rank does in a step (``rank_work``)."""

    prompts: int  # the replica's prompts (train.prompts_per_rank)
    questions: int  # k: questions per family
    families_here: int  # families this rank samples (all of them when spread, else its share of whole families)
    videos_here: int  # tower passes of this rank's rollout (a family's video once; the cache: each video once)
    micro_batches: int
    size: int  # S
    spread: bool = False  # each family's rollout spread over the S ranks (``rollout.base.split_of``)
    share: float = 1.0  # the part of each of its families' tower, prefill and K/V this rank does (1/S spread)


def rank_work(cfg, work: Workload, videos: int | None = None) -> Rank:
    """This rank's share: the replica's prompts in families of k (of equal load), each family spread over the S
    ranks of its replica or whole families shared out among them, as rollout.sp_split says (the planner resolves
    ``auto`` by price first: ``resolve_split``; unresolved, ``app.rollout.base.split_of``'s rule:
    spread with fewer families than ranks, or too few to share out evenly, on the grouped engine)."""
    from app.rollout.base import split_of

    prompts = cfg.train.prompts_per_rank
    k = max(1, min(getattr(cfg.data, "questions_per_video", 1), prompts))
    families = math.ceil(prompts / k)
    size = cfg.train.sequence_parallel_size
    setting = getattr(cfg.rollout, "sp_split", "auto")
    spreads = cfg.rollout.engine == "grouped"
    spread = size > 1 and spreads and (setting == "spread" or (setting == "auto" and split_of(
        [1] * families, size, spreads) == "spread"))
    here = families if spread else math.ceil(families / size)
    distinct = min(videos, families) if videos else families
    cached = size == 1 and cfg.forward.vision_cache in ("step", "run")
    video_passes = distinct if spread else (math.ceil(distinct / size) if cached else here)
    return Rank(prompts=prompts, questions=k, families_here=here, videos_here=video_passes if work.patches else 0,
                micro_batches=max(1, prompts // cfg.train.groups_per_micro_batch), size=size, spread=spread,
                share=1 / size if spread else 1.0)


def busiest(loads: list[float], questions: list[int], size: int) -> tuple[float, int, int]:
    """The busiest rank under whole families (``app.rollout.base.owners_of``, the rollout's own rule): its (load,
    families, prompts)."""
    from app.rollout.base import owners_of

    held = [[0.0, 0, 0] for _ in range(size)]
    for f, rank in enumerate(owners_of(loads, size)):
        held[rank] = [held[rank][0] + loads[f], held[rank][1] + 1, held[rank][2] + questions[f]]
    load, families, prompts = max(held, key=lambda row: (row[0], row[1]))
    return load, families, prompts


def split_seconds(cfg, shape: Shape, counts, world, *, loads: list[float], questions: list[int], size: int,
                  ds: dict, lora: bool, tower_trains: bool, backend: str, question_tokens: int) -> tuple[float, float]:
    """(seconds spread, seconds whole families): the busiest rank's rollout (``ROLLOUT_PHASES``) for families of
    these ``loads`` (their prompts' tokens, the tower left out) of ``questions`` prompts each on ``size`` ranks."""
    k = max(1, round(sum(questions) / len(loads)))

    def priced(load: float, families: int, prompts: int, spread: bool) -> float:
        prefix = max(1, round(load / max(1, prompts)))
        work = Workload(prefix=prefix, completion=cfg.rollout.max_completion_length, group_size=cfg.rollout.group_size,
                        questions=k, question=min(question_tokens, prefix - 1) if k > 1 else 0)
        rank = Rank(prompts=prompts, questions=k, families_here=families, videos_here=0, micro_batches=1, size=size,
                    spread=spread, share=1 / size if spread else 1.0)
        terms = phase_terms(cfg, shape, counts, work, world, ds=ds, lora=lora, tower_trains=tower_trains,
                            backend=backend, rank=rank)
        return seconds(terms, world.calibration)["rollout"]

    return (priced(sum(loads), len(loads), sum(questions), True),
            priced(*busiest(loads, questions, size), False))


def resolve_split(cfg, shape: Shape, counts, work: Workload, world, **priced) -> tuple[object, dict | None]:
    """``cfg`` with rollout.sp_split=auto decided as the trainer decides it (``app.planning.split.rollout_pricer``) for equal
    families of this workload, and {"split", "spread_s", "families_s"} (None where there is nothing to choose).
    ``priced``: ``split_seconds``' keywords after ``size``."""
    size = cfg.train.sequence_parallel_size
    if size < 2 or cfg.rollout.engine != "grouped" or getattr(cfg.rollout, "sp_split", "auto") != "auto":
        return cfg, None
    k = max(1, min(getattr(cfg.data, "questions_per_video", 1), cfg.train.prompts_per_rank))
    families = -(-cfg.train.prompts_per_rank // k)
    spread_s, families_s = split_seconds(cfg, shape, counts, world, loads=[float(work.prefix * k)] * families,
                                         questions=[k] * families, size=size, **priced)
    cfg = copy.deepcopy(cfg)
    cfg.rollout.sp_split = "spread" if spread_s < families_s else "families"
    return cfg, {"split": cfg.rollout.sp_split, "spread_s": spread_s, "families_s": families_s}


def kv_share(shape: Shape, rank: Rank) -> float:
    """The part of a family's K/V one rank holds: 1/S spread (heads shared out), 1/Hkv when S exceeds the KV heads
    (each KV head held by S / Hkv ranks), all of it otherwise."""
    if not rank.spread:
        return 1.0
    return 1 / min(rank.size, shape.kv_heads)


def planned_vision_attention(cfg, world) -> str:
    """The tower's attention a run of ``cfg`` gets on ``world``'s device: ``auto`` is torch's varlen flash kernel
    (one call per block) on CUDA in bfloat16, sdpa (per frame or window) elsewhere
    (``app.grouping.vision.attention.vision_attention_for``; a card or torch without the kernel gets sdpa)."""
    from app.grouping.vision.attention import TOWER_ATTENTION

    setting = cfg.model.vision_attention
    if setting != "auto":
        return setting
    return TOWER_ATTENTION if varlen_runs(cfg, world) else "sdpa"


def varlen_runs(cfg, world) -> bool:
    """Whether torch's varlen flash kernel runs in a run of ``cfg`` on ``world``: CUDA, bfloat16, and a torch and
    card that have it (``World.varlen``; the H200 points were measured without it)."""
    return world.device == "cuda" and cfg.model.dtype == "bfloat16" and world.varlen


def tower_calls(shape: Shape, work: Workload, vision_attention: str, *, chunk_frames: int = 0,
                share: float = 1.0) -> float:
    """Attention calls of one pass of the tower over one video (``share`` of its temporal patches: a spread
    rollout's rank): one per block and tower pass with a varlen kernel (flash-attn's or torch's; a pass per
    ``chunk_frames`` temporal patches), else one per window (Qwen2.5-VL's windowed blocks) or per frame of every
    block."""
    if not work.patches or not shape.vision_depth:
        return 0.0
    if "flash" in vision_attention:
        mine = max(1, math.ceil(work.temporal * share))
        return float(shape.vision_depth * (math.ceil(mine / chunk_frames) if chunk_frames else 1))
    if share < 1:
        return tower_calls(shape, work, vision_attention) * share
    temporal = max(1, work.temporal)
    if shape.vision_full_blocks < 0:
        return float(shape.vision_depth * temporal)
    side = math.sqrt(work.patches / temporal) / shape.merge  # merged tokens on a frame's side
    per_window = max(1, shape.vision_window // shape.merge // shape.patch)
    windows = math.ceil(side / per_window) ** 2
    full = shape.vision_full_blocks
    return float(full * temporal + (shape.vision_depth - full) * temporal * windows)


def phase_terms(cfg, shape: Shape, counts, work: Workload, world, *, ds: dict, lora: bool, tower_trains: bool,
                backend: str, videos: int | None = None, rank: Rank | None = None) -> dict:
    """Per phase, {calibration constant: its coefficient} (seconds = sum of coefficient x constant, with the
    efficiencies entering as their inverses: ``seconds``). FLOPs per rank over the card's peak, bytes over its
    bandwidth, counts of calls, layers and rollouts."""
    rank = rank or rank_work(cfg, work, videos)
    k, peak, bandwidth = rank.questions, world.peak_tflops * 1e12, world.bandwidth_tbs * 1e12
    b = 2 if cfg.model.dtype == "bfloat16" else 4
    attention = planned_vision_attention(cfg, world)
    chunk_frames = cfg.forward.vision_chunk_frames
    calls = tower_calls(shape, work, attention, chunk_frames=chunk_frames)
    rollout_calls = tower_calls(shape, work, attention, chunk_frames=chunk_frames, share=rank.share)
    tower = flops.vision_flops(shape, work.patches, work.temporal)
    family = Workload(prefix=work.prefix, completion=0, group_size=1, groups=k, questions=k,
                      question=work.question if k > 1 else 0)
    prefill = flops.forward_flops(shape, family, "flash")["total"] * rank.families_here * rank.share
    prompts_here = min(rank.prompts, rank.families_here * k)
    samples, steps = prompts_here * work.group_size, work.completion
    from app.planning.layers import expert_params, experts_read, kv_bytes_per_token, state_bytes

    kv_token = kv_bytes_per_token(shape, b)  # the attention layers' (a hybrid's GDN layers keep a state instead)
    shared = work.prefix - work.question if k > 1 else 0
    prefixes = rank.families_here * shared + prompts_here * (work.prefix - shared)
    kind = memory_kind(cfg.rollout.engine)
    copies = work.group_size if kind == "per_sample" else 1  # HF generate: every sample its own prompt copy
    weights = b * (shape.layers * counts.decoder_layer + shape.vocab * shape.hidden)
    ep = expert_parallel(cfg, shape)
    experts = b * expert_params(shape)  # all sparse layers' routed experts, E of them a layer
    # a decode step reads the experts its samples meet: under EP the rank's E / EP, met by every rank's samples
    read = weights - experts + experts / ep * experts_read(shape, samples * ep)
    kv = kv_token * (prefixes * copies + samples * steps / 2) * kv_share(shape, rank)  # the completions': half
    if shape.index_budget:  # QSA: a step reads each sample's chosen keys (at most the budget) and scores all blocks
        seen = work.prefix + steps / 2
        kv = (kv_token * samples * min(seen, shape.index_budget)
              + b * shape.index_dim * shape.attention_layers * samples * seen) * kv_share(shape, rank)
    # each step reads and writes every sample's GDN states (this rank's heads under a spread rollout)
    kv += 2 * samples * state_bytes(shape, b) * kv_share(shape, rank)
    # a graph replays fixed addresses and no collective: not under EP (its all-to-all needs host-side split sizes)
    graph = (ds["stage"] != 3 or cfg.rollout.zero3_gather == "full") and copies == 1 and ep == 1
    tower_copies = 1 if cfg.forward.vision_cache in ("step", "run") and not tower_trains else copies
    # ZeRO-3 gathering during the rollout (layerwise: each decoder layer per step; per_step: everything per step),
    # what the other ranks hold crossing the link; "full" gathers once, before the rollout
    share = 1 - 1 / world.ranks
    # the routed experts' gathers are priced apart (``traffic.expert_traffic``: under EP a rank gathers its E / EP)
    gathered = ({"full": weights, "layerwise": b * shape.layers * counts.decoder_layer,
                 "per_step": weights}.get(cfg.rollout.zero3_gather, 0.0) - experts) * share if ds["stage"] == 3 else 0.0
    per_step_gather = 0.0 if cfg.rollout.zero3_gather == "full" else gathered
    link = world.link_tbs * 1e12
    spread = traffic.spread_exchanges(shape, work, rank, b, steps=steps, samples=samples,
                              chunk=cfg.rollout.prefill_chunk_size) if rank.spread else {}
    # the training forwards: every micro-batch's packed row, split over the S ranks
    batches, size, mu = rank.micro_batches, rank.size, cfg.grpo.num_iterations
    counting = counting_passes(bool(shape.sparse_layers), cfg.grpo.router_aux_loss_coef, mu)
    forward = flops.forward_flops(shape, work, backend)["total"] * batches / size
    train = flops.train_flops(shape, work, backend, checkpointing=cfg.model.gradient_checkpointing,
                              chunk=cfg.forward.logprob_chunk_size, deepspeed_linear=ds["stage"] == 3,
                              weight_grads=not lora)["total"] * batches * mu / size
    families_step = max(1.0, work.families) * batches / size  # tower passes of a training forward (no cache)
    # a frozen tower's outputs cached (forward.vision_cache): encoded by the rollout for S = 1 and for a spread
    # rollout (each rank's share of the frames), by the reference forward under whole families per rank (the
    # rollout encoded whole videos; the training forwards ask for shares), by none of them otherwise
    keeps = cfg.forward.vision_cache in ("step", "run") and not tower_trains
    cached = keeps and (size == 1 or rank.spread)
    forward_calls = 0.0 if cached else calls * families_step
    update_calls = 0.0 if keeps else calls * families_step
    experts_moved = traffic.expert_traffic(cfg, shape, work, rank, ranks=world.ranks, stage=ds["stage"],
                                           lora=lora, b=b)
    terms = {
        "tower": {"prefill_efficiency": tower * rank.videos_here * tower_copies * rank.share / peak,
                  "tower_call_ms": rollout_calls * rank.videos_here * tower_copies / 1e3,
                  **({"link_efficiency": spread["tower_bytes"] / link} if spread else {})},
        "prefill": {"prefill_efficiency": prefill * copies / peak,
                    **({"link_efficiency": spread["prefill_bytes"] / link,
                        "collective_ms": spread["prefill_collectives"] / 1e3} if spread else {})},
        "decode": {"weight_efficiency": steps * read / bandwidth,
                   ("varlen_kv_efficiency" if varlen_runs(cfg, world) else "kv_efficiency"): steps * kv / bandwidth,
                   ("graph_launch_ms" if graph else "eager_launch_ms"): steps * shape.layers / 1e3,
                   "link_efficiency": (steps * per_step_gather + spread.get("decode_bytes", 0.0)) / link,
                   **({"collective_ms": spread["decode_collectives"] / 1e3} if spread else {})},
        "rollout_overhead": {"rollout_s": 1.0, "link_efficiency": (gathered - per_step_gather) / link},
        "reference": ({"forward_efficiency": forward / peak, "tower_call_ms": forward_calls / 1e3}
                      if cfg.grpo.beta > 0 else {}),
        "old_policy": ({"forward_efficiency": forward / peak * mu, "tower_call_ms": forward_calls * mu / 1e3}
                       if mu > 1 else {}),
        # a load-balancing loss: each update pass first counts the step's expert loads (no gradient, every micro-batch)
        "router_counts": ({"forward_efficiency": forward / peak * counting, "tower_call_ms": forward_calls * counting / 1e3}
                          if counting else {}),
        "update": {"train_efficiency": train / peak,
                   "tower_call_ms": (3 * calls * families_step if tower_trains else update_calls) * mu / 1e3,
                   "update_layer_s": shape.layers * batches * mu},
        "weight_sync": {},
    }
    for phase, moved in experts_moved.items():  # the routed experts' gathers, EP's all-to-alls
        if terms[phase] and (moved["gather"] or moved["exchange"] or moved["calls"]):
            terms[phase]["link_efficiency"] = terms[phase].get("link_efficiency", 0.0) + (
                moved["gather"] + moved["exchange"]) / link
            terms[phase]["collective_ms"] = terms[phase].get("collective_ms", 0.0) + moved["calls"] / 1e3
    if kind == "reserved":  # vLLM: every weight pushed into the engine (LoRA: merged, whole)
        terms["weight_sync"] = weight_sync_terms(counts, b, ranks=world.ranks, stage=ds["stage"],
                                                 bandwidth=bandwidth, link=link)
    return terms


def weight_sync_terms(counts, b: float, *, ranks: int, stage: int, bandwidth: float, link: float) -> dict:
    """A push of every weight into vLLM (``vllm_weights.policy_weights``): under ZeRO-3 each parameter tensor
    gathered alone (one collective each, (ranks - 1) / ranks of its bytes over the link), then each tensor of the
    released layout (a MoE's experts one by one: ``Counts.pushed``) through vLLM's loader and copied in."""
    terms = {"weight_efficiency": b * counts.total / bandwidth, "push_tensor_ms": (counts.pushed or counts.tensors) / 1e3}
    if stage == 3 and ranks > 1:
        terms.update(link_efficiency=b * counts.total * (ranks - 1) / ranks / link,
                     collective_ms=counts.tensors / 1e3)
    return terms


def seconds(terms: dict, calibration: Calibration = CALIBRATION) -> dict:
    """Seconds per phase (and ``rollout`` and ``step`` totals) from ``phase_terms``."""
    values = asdict(calibration)
    out = {}
    for phase, parts in terms.items():
        total = 0.0
        for name, coefficient in parts.items():
            value = values[name]
            total += coefficient / value if name.endswith("efficiency") else coefficient * value
        out[phase] = total
    out["rollout"] = sum(out[p] for p in ROLLOUT_PHASES)
    out["step"] = sum(out[p] for p in PHASES)
    return out
