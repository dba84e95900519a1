"""The planner's model of a run: a training config and a world in, memory per rank, FLOPs per phase, step time
by phase, disk and a verdict out (``plan``). The memory formulas are ``app/planning/costs.py``, the step time's
``app/planning/timing.py``, what to change when it does not fit ``app/planning/remedies.py``; the command line is
``app/planning/plan.py``."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from app.objectives.router import counting_passes
from app.planning import costs, flops, timing, traffic
from app.planning.costs import GiB, Shape, Workload
from app.planning.host import data_phase
from app.planning.inputs import (
    cached_outputs,
    disk,
    distinct_videos,
    frame_pixels,
    host_memory,
    pixel_bytes,
    video_tokens,
)
from app.planning.layers import (
    exchange_buffer,
    expert_params,
    kv_bytes_per_token,
    layer_expert_params,
    routing_record,
    state_bytes,
)
from app.planning.parallelism import (  # noqa: F401  (re-exported: the planner's face)
    SP_SIZES,
    PlanError,
    check_expert_parallel,
    check_sequence_parallel,
    sequence_parallel_sizes,
)
from app.planning.shapes import model_of, model_source  # noqa: F401  (re-exported: the planner's face)
from app.rollout.registry import BASELINE_ENGINE, memory_kind

TEXT_TOKENS = 200  # system prompt, question and template around the video (Video-R1's prompt is about 150)
QUESTION_TOKENS = 180  # of those, what follows the video (question, options, instruction): a question's own part
LAYOUTS = ("grouped", *flops.REPEATED_KERNELS)  # this config, and the TRL-style run under each kernel it may use


@dataclass(frozen=True)
class World:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    peak_tflops: float = 989.0  # H100 SXM / H200 dense bf16
    bandwidth_tbs: float = 3.35  # HBM bandwidth: H100 SXM 3.35, H200 4.8, A100-80GB 2.0
    link_tbs: float = 0.45  # between GPUs (ZeRO-3 gathers): NVLink 4 on H100 / H200 about 0.45 per direction
    host_memory_gib: float = 2048.0  # CPU memory of one node (a DGX H100 / H200 has 2 TiB)
    device: str = "cuda"  # what runs it: cuda, or cpu (a rehearsal here: its attention kernels hold other buffers)
    headroom: float = 0.9  # the share of GPU memory a plan may fill (CUDA context, fragmentation)
    calibration: timing.Calibration = timing.CALIBRATION  # efficiencies and overheads (timing.SOURCES)
    varlen: bool = True  # torch's varlen flash kernel runs there (torch >= 2.10, sm80+): the tower's one call per
    #                      block and the decode's K/V reads (app.grouping.kernels)

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    def check(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise PlanError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("gpu_memory_gib", "peak_tflops", "bandwidth_tbs", "link_tbs", "headroom", "host_memory_gib"):
            if not getattr(self, name) > 0:
                raise PlanError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.device not in ("cuda", "cpu"):
            raise PlanError(f"--device must be cuda or cpu, got {self.device!r}")
        for name, value in asdict(self.calibration).items():
            if not value > 0:
                raise PlanError(f"--calibration {name} must be > 0, got {value}")


def lora_parameters(cfg, meta) -> int:
    """Adapter parameters, rank x (in + out): per Linear ``lora.target_names`` picks, per expert of every fused
    expert weight ``lora.target_parameters`` names (peft's ParamWrapper)."""
    from app.runtime.lora import target_names, target_parameter_names

    modules, params = dict(meta.named_modules()), dict(meta.named_parameters())
    linear = sum(cfg.lora.rank * (modules[name].in_features + modules[name].out_features)
                 for name in target_names(meta, cfg.lora))
    experts = sum(cfg.lora.rank * params[name].shape[0] * (params[name].shape[1] + params[name].shape[2])
                  for name in target_parameter_names(meta, cfg.lora) if params[name].ndim == 3)
    return linear + experts


def deepspeed_settings(cfg) -> dict:
    path = Path(cfg.train.deepspeed_config)
    if not path.is_file():
        raise PlanError(f"train.deepspeed_config {str(path)!r} does not exist")
    try:
        zero = json.loads(path.read_text()).get("zero_optimization", {})
    except json.JSONDecodeError as error:
        raise PlanError(f"train.deepspeed_config {str(path)!r} is not JSON ({error})") from None
    return {"stage": int(zero.get("stage", 0)), "offload_optimizer": "offload_optimizer" in zero,
            "offload_param": "offload_param" in zero, "prefetch": float(zero.get("stage3_prefetch_bucket_size", 5e7))}


def grouped_backend(cfg) -> str:
    """The grouped attention backend planned for: ``auto`` is FlexAttention (a GPU without flash-attn); set
    forward.attention_backend=flash to plan flash-attn."""
    backend = cfg.forward.attention_backend
    return "flex" if backend == "auto" else backend


def attention_backend(cfg) -> str:
    return "repeated" if cfg.forward.grouping == "repeated" else grouped_backend(cfg)


def layout_backend(cfg, layout: str) -> str:
    """The attention the planner counts for a layout: the config's own for ``grouped``; for the TRL-style run the
    repeated rows under masked SDPA (``repeated``) or flash-attn (``repeated_flash``)."""
    return attention_backend(cfg) if layout == "grouped" else layout


def workload(cfg, shape: Shape, frames: int, text_tokens: int = TEXT_TOKENS,
             video_size: tuple[int, int] | None = None) -> Workload:
    """A training micro-batch; with data.questions_per_video = k > 1 its groups in families of k questions (at most
    the micro-batch's groups) sharing the system prompt and the video. Its visual tokens are the data path's:
    each frame at data.max_pixels (or data.video_total_pixels' share), resized from ``video_size`` (width,
    height) as qwen-vl-utils resizes it, or filling max_pixels when the size is not given (the upper bound)."""
    d = cfg.data
    pixels = frame_pixels(d.max_pixels, d.min_pixels, frames, getattr(d, "video_total_pixels", 0),
                                shape.patch * shape.merge)
    visual, patches, temporal = (video_tokens(shape, frames, pixels, size=video_size, min_pixels=d.min_pixels)
                                 if shape.vision_depth else (0, 0, 0))
    groups = cfg.train.groups_per_micro_batch
    questions = max(1, min(getattr(cfg.data, "questions_per_video", 1), groups))
    return Workload(prefix=visual + text_tokens, completion=cfg.rollout.max_completion_length,
                    group_size=cfg.rollout.group_size, groups=groups, visual=visual, patches=patches,
                    temporal=temporal, questions=questions,
                    question=min(QUESTION_TOKENS, text_tokens - 1) if questions > 1 else 0)


def tower_chunk(cfg, work: Workload) -> int:
    """Patches per no-grad tower pass (forward.vision_chunk_frames temporal patches; 0: the whole video)."""
    return cfg.forward.vision_chunk_frames * (work.patches // max(1, work.temporal))


def plan(cfg, world: World, source: str, frames: int | None = None, videos: int | None = None,
         video_size: tuple[int, int] | None = None, *, data_host=None) -> dict:
    """The whole prediction for one config, as a dict of bytes (per rank), FLOPs (per rank and step), seconds per
    phase (``timing``) and disk. ``videos``: distinct videos among a step's prompts of one replica when fewer than
    its families (data that asks a video several questions at k = 1: the vision cache encodes each once).
    ``data_host``: (cores per node, ``host.Source``, ``host.HostRates``) adds the data phase beside the GPU step."""
    world.check()
    config, counts, meta = model_of(source)
    shape = costs.shape_of(config)
    size = cfg.train.sequence_parallel_size
    check_sequence_parallel(config, world.ranks, size)
    ds = deepspeed_settings(cfg)
    check_expert_parallel(cfg, shape, world.ranks, ds["stage"])
    b = 2 if cfg.model.dtype == "bfloat16" else 4
    frames = frames or cfg.data.max_frames
    work = workload(cfg, shape, frames, video_size=video_size)
    lora = cfg.lora.rank > 0
    cfg, split = timing.resolve_split(cfg, shape, counts, work, world, ds=ds, lora=lora, tower_trains=tower_trains(
        cfg), backend=attention_backend(cfg), question_tokens=QUESTION_TOKENS)  # sp_split=auto: priced both ways
    frozen = (counts.vision if cfg.model.freeze_vision_tower else 0) + (counts.projector if cfg.model.freeze_projector
                                                                        else 0)
    trainable = lora_parameters(cfg, meta) if lora else counts.total - frozen
    states = costs.model_states(costs.StatesInput(
        total=counts.total, trainable=trainable, reference=cfg.grpo.beta > 0 and not lora, stage=ds["stage"],
        ranks=world.ranks, dtype_bytes=b, offload_optimizer=ds["offload_optimizer"],
        offload_param=ds["offload_param"]))
    gpu = world.gpu_memory_gib * GiB
    rollout = rollout_memory(cfg, shape, counts, work, ds=ds, b=b, gpu=gpu, ranks=world.ranks, device=world.device,
                             varlen=timing.varlen_runs(cfg, world))
    training = training_memory(cfg, shape, work, ds, b, gpu, tower_trains=tower_trains(cfg), trains_head=not lora,
                               parameters=counts.total)
    peak = states["total"] + max(rollout["total"], training["total"])
    usable = world.headroom * gpu
    host = host_memory(cfg, shape, work, world, states, b, tables=counts.host)
    flops = {layout: step_flops(cfg, shape, work, layout) for layout in LAYOUTS}
    terms = {layout: timing.phase_terms(layout_cfg(cfg, layout), shape, counts, work, world, ds=ds, lora=lora,
                                        tower_trains=tower_trains(cfg), backend=layout_backend(cfg, layout),
                                        videos=videos) for layout in LAYOUTS}
    seconds = {layout: timing.seconds(t, world.calibration) for layout, t in terms.items()}
    moved = traffic.expert_traffic(cfg, shape, work, timing.rank_work(cfg, work, videos), ranks=world.ranks,
                                   stage=ds["stage"], lora=lora, b=b)
    return {"model": source, "parameters": asdict(counts), "trainable": trainable, "shape": asdict(shape),
            "world": asdict(world), "ranks": world.ranks, "sequence_parallel": size, "zero": ds,
            "dtype_bytes": b, "frames": frames, "workload": asdict(work), "attention": attention_backend(cfg),
            "states": states, "rollout": rollout, "training": training, "peak": peak, "usable": usable,
            "fits": peak <= usable, "host": host, "flops_per_group": flops, "phase_seconds": seconds, "phase_terms": terms,
            "activations_by_layout": layout_activations(cfg, shape, work, b, trains_head=not lora),
            "prompts_per_rank": cfg.train.prompts_per_rank, "questions": timing.rank_work(cfg, work).questions,
            "rollout_split": split, "experts": traffic.experts_summary(
                shape, work, moved, b=b, ranks=world.ranks, ep=timing.expert_parallel(cfg, shape), stage=ds["stage"]),
            "disk": disk(cfg, counts, trainable, b, ds["stage"], lora), "warnings": plan_warnings(cfg, work),
            "data": data_phase(cfg, shape, work, seconds["grouped"], world.gpus_per_node, host=data_host,
                               videos=videos)}



def plan_warnings(cfg, work: Workload) -> list[str]:
    """What the planned run would do that its author likely does not want."""
    out = []
    if work.prefix > cfg.data.max_prompt_length:
        out.append(f"a prompt of about {work.prefix} tokens is over data.max_prompt_length="
                   f"{cfg.data.max_prompt_length}: the trainer would skip every such record (raise it)")
    return out


def layout_cfg(cfg, layout: str):
    """``cfg`` as the A/B's other side runs it: the repeated layout trains [P;Ri] rows and samples with HF generate
    (each sample its own copy of the prompt; no questions share a video); under flash-attn (``repeated_flash``) the
    vision tower's attention is flash-attn's too (one call per block)."""
    if layout == "grouped":
        return cfg
    overrides = {"forward.grouping": "repeated", "rollout.engine": BASELINE_ENGINE, "data.questions_per_video": 1}
    if layout == "repeated_flash":
        overrides["model.vision_attention"] = "flash_attention_2"
    return with_overrides(cfg, overrides)


def rollout_memory(cfg, shape: Shape, counts, work: Workload, *, ds: dict, b: int, gpu: float, ranks: int = 1,
                   device: str = "cuda", varlen: bool = False) -> dict:
    """Bytes the rollout adds on one rank: gathered weights (ZeRO-3), the K/V cache, the prefill's working set, the
    vision tower's pass, the sampling logits; or the share an engine reserves (vLLM). Under sequence parallelism a
    rank samples its share of the replica's families (``timing.rank_work``: whole families spread over S), or, with
    fewer families than ranks, every family spread over the S ranks: 1/S of their K/V (by heads), of each prefill
    chunk's positions and of the tower's frames, every prompt's embeddings and every sample's logits whole."""
    rank = timing.rank_work(cfg, work)
    share = rank.share
    prompts = min(rank.prompts, rank.families_here * rank.questions)
    kv_token = kv_bytes_per_token(shape, b)  # the attention layers' (a hybrid's GDN layers: a state per sample)
    kind = memory_kind(cfg.rollout.engine)
    if kind in ("reserved", "none"):
        share = cfg.rollout.vllm_gpu_memory_utilization * gpu if kind == "reserved" else 0.0
        return {"engine_reserved": share, "total": share}
    gathered = 0.0
    ep = timing.expert_parallel(cfg, shape)
    if ds["stage"] == 3:  # what the gather adds to the rank's own partition (which the states count already)
        away = b * expert_params(shape) * (1 - 1 / ep)  # under EP the other ranks' experts: never gathered here
        layer = b * counts.decoder_layer - away / shape.layers
        whole = b * counts.total - away
        held = {"full": whole, "layerwise": whole - layer * (shape.layers - 1),
                "per_step": max(layer, b * shape.vocab * shape.hidden)}[cfg.rollout.zero3_gather]
        gathered = max(0.0, held - b * counts.total / ranks)
    shared = kind == "shared_prefix"
    k = min(getattr(cfg.data, "questions_per_video", 1), prompts) if shared else 1  # questions sharing a video
    video = work.prefix - (work.question or QUESTION_TOKENS) if k > 1 else 0  # held once for k questions
    kv = prompts * kv_token * ((work.prefix - video * (k - 1) / k + work.group_size * work.completion) if shared
                               else work.group_size * (work.prefix + work.completion)) * timing.kv_share(shape, rank)
    rows = min(cfg.rollout.prefill_chunk_size or work.prefix, work.prefix) * share  # a spread chunk's piece
    batch = prompts / k * (1 if shared else work.group_size)  # the rows prefilled together (a family's video once)
    if rank.spread:
        batch = 1  # a spread rollout prefills one root at a time
    prefill = chunk_work = batch * min(rows, work.prefix) * b * (4 * shape.hidden + 3 * shape.intermediate) + \
        exchange_buffer(shape, batch * min(rows, work.prefix), b, ep)  # EP: a chunk's dispatch buffers
    chunk = cfg.rollout.prefill_chunk_size
    if chunk and chunk < work.prefix and not varlen:  # each chunk's causal attention to itself (decoding.prefill)
        if device == "cuda":  # two batched products: float32 scores per query head
            prefill += batch * shape.heads * chunk * chunk * 4
        elif batch > 1:  # CPU: the fused kernel's causal mask, but a padded batch needs its own [B, 1, c, c] mask
            prefill += (batch + 1) * chunk * chunk * 4
    tower = costs.vision_activations(shape, int(work.patches * share), training=False,
                                     chunk_patches=tower_chunk(cfg, work), dtype_bytes=b) if work.patches else 0.0
    # the prefill embeds each prompt (a family's video once) whole before its decoder runs, chunked or not: the
    # token embeddings and their copy with the tower's outputs scattered in, and those outputs (its chunks' and
    # their concatenation)
    prefill += batch / (1 if shared else work.group_size) * (2 * work.prefix + 2 * work.visual) * shape.hidden * b
    if rank.spread:  # one root at a time (spread.root_prefill): its prompt embedded whole, then the larger of its
        # tower pass (the tower's table of the video's embeddings and the copy its share goes into) and its chunks
        # (the root's K/V share allocated whole); the earlier roots' K/V beside it, and after the roots all of it
        roots = max(1, round(prompts / k))
        root_kv = (kv - prompts * kv_token * work.group_size * work.completion * timing.kv_share(shape, rank)) / roots
        embed = work.prefix * shape.hidden * b
        exchange = min(rows, work.prefix) * b * 3 * shape.hidden  # Ulysses: a chunk's queries out and in, its output
        root = embed + max(2 * work.visual * shape.hidden * b + tower, root_kv + chunk_work + exchange)
        prefill = max(0.0, (roots - 1) * root_kv + root - kv - tower)
    logits = prompts * work.group_size * shape.vocab * 4 * 2
    # a hybrid's GDN states: one per sample (copied from its prompt's, this rank's heads when spread) and one per
    # prompt held while its samples are made
    states = (prompts * work.group_size + prompts) * state_bytes(shape, b) * timing.kv_share(shape, rank)
    parts = {"gathered_weights": gathered, "kv_cache": kv, "gdn_states": states, "prefill": prefill,
             "vision_tower": tower,
             "vision_cache": cached_outputs(shape, work, distinct_videos(prompts, k if shared else 1), b) * share
             if cfg.forward.vision_cache in ("step", "run") and not tower_trains(cfg) else 0.0,
             "sampling_logits": logits, "routing_record": routing_record(  # rollout.routing_replay=r3
                 shape, prompts, work.prefix, prompts * work.group_size, work.completion)
             if getattr(cfg.rollout, "routing_replay", "off") == "r3" else 0.0,
             # a spread rank collates only its share of each video's pixels (media.keep_share)
             "inputs": pixel_bytes(shape, work.patches, b) * distinct_videos(prompts, k if shared else 1) * share}
    parts["total"] = sum(parts.values())
    return parts


def training_memory(cfg, shape: Shape, work: Workload, ds: dict, b: int, gpu: float, *, tower_trains: bool,
                    trains_head: bool, parameters: int = 0) -> dict:
    """Bytes the policy forward+backward adds on one rank (and what stays of the rollout: vLLM awake)."""
    size = cfg.train.sequence_parallel_size
    act = costs.training_activations(shape, work, backend=attention_backend(cfg), dtype_bytes=b,
                                     checkpointing=cfg.model.gradient_checkpointing,
                                     chunk=cfg.forward.logprob_chunk_size, trains_head=trains_head,
                                     sequence_parallel=size)
    patches = int(work.patches * work.families)  # a family's video once
    checkpointing = cfg.model.gradient_checkpointing
    if not patches:
        tower, whole = 0.0, act["peak"]
    elif tower_trains:  # the tower's backward comes after the language model's
        tower = costs.vision_activations(shape, patches, training=True, chunk_patches=0, dtype_bytes=b,
                                         checkpointing=checkpointing) / size
        held = costs.vision_held(shape, patches, checkpointing=checkpointing, dtype_bytes=b) / size
        whole = costs.pass_with_trained_tower(shape, act["peak"], tower, held, trains_head=trains_head,
                                              dtype_bytes=b)
    elif cfg.forward.vision_cache in ("step", "run"):
        tower = work.visual * work.families * shape.hidden * b  # cached outputs, held for the step
        whole = act["peak"] + tower
    else:  # a frozen tower's no-grad pass is over before the language model's begins
        tower = costs.vision_activations(shape, patches, training=False, chunk_patches=tower_chunk(cfg, work),
                                         dtype_bytes=b) / size
        whole = max(act["peak"], tower + work.visual * work.families * shape.hidden * b)
    # ZeRO-3's prefetch bucket (at most the model itself) and the head gathered for the output's chunks; a sparse
    # layer's routed experts gathered whole at once (a leaf module; under EP the rank's E / EP: AutoEP's grouped
    # experts), and EP's dispatch buffers for the micro-batch's tokens
    bucket = min(ds["prefetch"], parameters) if parameters else ds["prefetch"]
    zero3 = b * (bucket + shape.vocab * shape.hidden) if ds["stage"] == 3 else 0.0
    ep = timing.expert_parallel(cfg, shape)
    experts = b * layer_expert_params(shape) / ep if ds["stage"] == 3 else 0.0
    exchange = exchange_buffer(shape, work.grouped_tokens / size, b, ep)
    awake = memory_kind(cfg.rollout.engine) == "reserved" and not cfg.rollout.vllm_sleep
    reserved = cfg.rollout.vllm_gpu_memory_utilization * gpu if awake else 0.0
    # every micro-batch's prompts are collated on the device once for the step: their pixels (in the tower's dtype;
    # a family's video once) stay while the step runs
    batches = max(1, cfg.train.prompts_per_rank // cfg.train.groups_per_micro_batch)
    inputs = pixel_bytes(shape, work.patches, b) * distinct_videos(work.groups, work.questions) * batches
    parts = {"activations": act["peak"], "saved": act["saved"], "vision_tower": tower, "whole_pass": whole,
             "zero3_buffers": zero3, "experts_gathered": experts, "expert_exchange": exchange,
             "engine_awake": reserved, "inputs": inputs}
    parts["total"] = whole + zero3 + experts + exchange + reserved + inputs
    return parts


def layout_activations(cfg, shape: Shape, work: Workload, b: int, *, trains_head: bool) -> dict:
    """The policy forward+backward's activation peak on one rank in each layout (the grouped backend planned)."""
    return {layout: costs.training_activations(
        shape, work, backend="repeated" if layout == "repeated" else grouped_backend(cfg), dtype_bytes=b,
        checkpointing=cfg.model.gradient_checkpointing, chunk=cfg.forward.logprob_chunk_size,
        trains_head=trains_head, sequence_parallel=cfg.train.sequence_parallel_size)["peak"]
        for layout in ("grouped", "repeated")}


def step_flops(cfg, shape: Shape, work: Workload, layout: str) -> dict:
    """FLOPs of each phase for one group (one prompt and its G completions) in the grouped or repeated layout; with
    questions sharing a video (``work.questions`` > 1, grouped), a family's FLOPs over its questions."""
    k = work.questions if layout == "grouped" else 1
    one = Workload(prefix=work.prefix, completion=work.completion, group_size=work.group_size, visual=work.visual,
                   patches=work.patches, temporal=work.temporal, groups=k, questions=k, question=work.question)
    backend = grouped_backend(cfg) if layout == "grouped" else layout
    prefill_rows = Workload(prefix=work.prefix, completion=0, group_size=1, groups=k, questions=k,
                            question=work.question)  # V once, each question on top of it (attending to V)
    prefill = flops.forward_flops(shape, prefill_rows, "flash")["total"] / k * (1 if layout == "grouped" else
                                                                               work.group_size)
    forward = flops.forward_flops(shape, one, backend)["total"] / k
    train = flops.train_flops(shape, one, backend, checkpointing=cfg.model.gradient_checkpointing,
                              chunk=cfg.forward.logprob_chunk_size,
                              deepspeed_linear=deepspeed_settings(cfg)["stage"] == 3)["total"] / k
    iterations = cfg.grpo.num_iterations
    tower = flops.vision_flops(shape, work.patches, work.temporal) / k  # one forward, a video shared by k
    if cfg.forward.vision_cache in ("step", "run") and not tower_trains(cfg):
        vision = tower  # once a step, its outputs served to every later forward
    else:  # the rollout's prefill, the reference, the old policy, then each policy pass (trained or frozen)
        trained = flops.vision_flops(shape, work.patches, work.temporal, training=True,
                                     checkpointing=cfg.model.gradient_checkpointing) / k if tower_trains(cfg) else tower
        vision = tower * (1 + (cfg.grpo.beta > 0) + (iterations > 1)) + trained * iterations
    return {"vision_tower": vision,
            "rollout_prefill": prefill, "rollout_decode": flops.decode_flops(shape, one) / k,
            "reference": forward if cfg.grpo.beta > 0 else 0.0, "old_policy": forward if iterations > 1 else 0.0,
            "router_counts": forward * counting_passes(bool(shape.sparse_layers), cfg.grpo.router_aux_loss_coef, iterations),
            "policy": train * iterations}


def tower_trains(cfg) -> bool:
    return not (cfg.model.freeze_vision_tower or (cfg.lora.rank > 0 and not cfg.lora.vision_tower))


def with_overrides(cfg, overrides: dict):
    """A copy of ``cfg`` with ``{"section.key": value}`` set."""
    cfg = copy.deepcopy(cfg)
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg
