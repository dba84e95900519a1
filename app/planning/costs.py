"""Know before you launch: memory per rank of a training config, from the model's shape alone (FLOPs:
``app.planning.flops``).

Every figure is a formula over the architecture (``Shape``), the sequence lengths a step sees (``Workload``) and
the world; nothing is allocated at full size. What each formula counts is what the code of this project keeps:

- model states: the standard ZeRO arithmetic (Rajbhandari et al. 2020, sec. 3/5): bf16 weights and gradients,
  fp32 master weights and two Adam moments (12 bytes per trainable parameter), each partitioned by its stage;
- activations: per token and decoder layer, the tensors autograd saves in the transformers Qwen layer (two RMSNorms,
  the linear inputs, the SwiGLU MLP's four intermediate tensors) plus what the attention backend saves; checked
  tensor by tensor against ``torch.autograd.graph.saved_tensors_hooks`` on the real classes (tests/test_plan.py);
- the backward's first moment: every saved tensor still live, plus the output head's chunk of logits and its weight
  gradient (the largest single gradient);
- the vision tower: each block's saved tensors, or under activation checkpointing each block's input and one
  recomputed block; its backward after the language model's (``pass_with_trained_tower``).

The plan is a prediction: ``docs/planner.md`` says which parts were checked against measurement and which were not.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30
ADAM_BYTES = 12  # fp32 master weight + two fp32 Adam moments per trainable parameter (mixed precision)


@dataclass(frozen=True)
class Shape:
    """What the formulas need of a Qwen-VL architecture."""

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    vision_hidden: int = 0
    vision_depth: int = 0
    vision_intermediate: int = 0
    vision_gated: bool = False  # SwiGLU MLP in the tower (Qwen2.5-VL) or fc1/fc2 (Qwen2-VL, Qwen3-VL)
    patch: int = 14
    merge: int = 2
    temporal_patch: int = 2
    vision_full_blocks: int = -1  # Qwen2.5-VL: blocks attending over a whole frame (the others: windows); -1 all
    vision_window: int = 0  # Qwen2.5-VL: the windows' side in pixels
    vision_deepstack: int = 0  # Qwen3-VL: blocks whose outputs get a merger of their own (deepstack taps)
    # Qwen3.5: of ``layers``, this many are Gated DeltaNet (linear attention; the others gated full attention)
    linear_layers: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_head_dim: int = 128
    conv_kernel: int = 4
    attention_gate: bool = False  # Qwen3.5's attention: q_proj also writes the output gate (twice as wide)
    # Qwen3.8-Flash-Next: its attention layers are QSA (a query attends to at most ``index_budget`` keys: the chosen
    # blocks and the tail; 0: full attention), scored by ``index_heads`` index heads of ``index_dim`` against blocks of
    # ``index_compress`` keys; a residual stream of ``hc_count`` copies mixed through a rank-``hc_lowrank`` map; PLE
    # on ``ple_layers`` layers, projecting ``ple_dim`` n-gram features (its table is host memory: ``Counts.host``)
    index_budget: int = 0
    index_heads: int = 0
    index_dim: int = 0
    index_compress: int = 4
    hc_count: int = 1
    hc_lowrank: int = 0
    ple_layers: int = 0
    ple_dim: int = 0
    # mixture of experts: sparse layers, their experts (k per token) and shared expert (``layers.moe_shape``)
    sparse_layers: int = 0
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0

    @property
    def attention_layers(self) -> int:
        """Decoder layers with softmax attention: the ones that keep K/V (every layer but a hybrid's GDN layers)."""
        return self.layers - self.linear_layers

    @property
    def layer_matmul_params(self) -> float:
        """Weights one token meets in a decoder layer's matmuls, on average over the layer kinds (``layers``):
        attention's q, k, v, o or a GDN layer's projections, then gate, up, down; biases aside."""
        from app.planning.layers import kinds

        return sum(kind.count * kind.matmul_params for kind in kinds(self)) / self.layers + 3 * self.hidden * \
            self.intermediate  # a sparse layer's router is a kind of its own (``layers.kinds``)

    @property
    def pixels_per_token(self) -> int:
        """Pixels of one frame (of a temporal patch) per merged visual token: (patch x merge)^2."""
        return (self.patch * self.merge) ** 2

    @property
    def vision_block_params(self) -> int:
        vh, vi = self.vision_hidden, self.vision_intermediate
        return 4 * vh * vh + (3 if self.vision_gated else 2) * vh * vi


def shape_of(config) -> Shape:
    """The ``Shape`` of a transformers config (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, or a text-only Qwen)."""
    from app.planning.layers import moe_shape

    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    tied = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
    base = dict(family=config.model_type, hidden=text.hidden_size, layers=text.num_hidden_layers, heads=heads,
                kv_heads=text.num_key_value_heads, head_dim=head_dim, intermediate=getattr(text, "intermediate_size", 0),
                vocab=text.vocab_size, tied=tied)
    base.update(moe_shape(text))  # a mixture of experts: intermediate becomes what a token meets
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return Shape(**base)
    if config.model_type == "qwen2_vl":
        vh, vi, gated = vision.embed_dim, int(vision.embed_dim * vision.mlp_ratio), False
    else:
        vh, vi, gated = vision.hidden_size, vision.intermediate_size, config.model_type == "qwen2_5_vl"
    windows = {}
    if config.model_type == "qwen2_5_vl":
        windows = dict(vision_full_blocks=len(vision.fullatt_block_indexes), vision_window=vision.window_size)
    windows["vision_deepstack"] = len(getattr(vision, "deepstack_visual_indexes", None) or [])
    kinds = list(getattr(text, "layer_types", None) or ())
    if getattr(text, "indexer_budget", None):  # Qwen3.8-Flash-Next: QSA, hyper-connections, PLE
        compress = int(text.indexer_compress_ratio)
        base.update(index_budget=int(text.indexer_budget) + compress - 1, index_heads=int(text.indexer_n_heads),
                    index_dim=int(text.indexer_head_dim), index_compress=compress, hc_count=int(text.hc_count),
                    hc_lowrank=int(text.hc_lowrank), ple_layers=len(text.ple_layer_ids or ()),
                    ple_dim=int(text.ple_embed_dim or text.hidden_size))
    if "linear_attention" in kinds:  # a hybrid (Qwen3.5): its Gated DeltaNet layers' heads
        base.update(linear_layers=kinds.count("linear_attention"), linear_key_heads=text.linear_num_key_heads,
                    linear_value_heads=text.linear_num_value_heads, linear_head_dim=text.linear_key_head_dim,
                    conv_kernel=text.linear_conv_kernel_dim, attention_gate=True)
    return Shape(**base, vision_hidden=vh, vision_depth=vision.depth, vision_intermediate=vi, vision_gated=gated,
                 patch=vision.patch_size, merge=vision.spatial_merge_size, temporal_patch=vision.temporal_patch_size,
                 **windows)


@dataclass(frozen=True)
class Workload:
    """The sequences of one micro-batch on one rank: ``groups`` groups of one prompt (``prefix`` tokens, of which
    ``visual`` are vision tokens from ``patches`` patches) and ``group_size`` completions of ``completion`` tokens.
    ``questions`` > 1 (data.questions_per_video): groups come in families of that many questions on one video,
    sharing all of the prompt but its last ``question`` tokens (V = prefix - question: the system prompt and the
    video), packed [V; Q1; R1*; Q2; R2*; ...] with V and its media once."""

    prefix: int
    completion: int
    group_size: int
    groups: int = 1
    visual: int = 0
    patches: int = 0
    temporal: int = 0  # temporal patches of the video (frames / temporal_patch_size)
    questions: int = 1
    question: int = 0

    @property
    def families(self) -> float:
        """Families of questions sharing a video in the micro-batch (groups when nothing is shared)."""
        return self.groups / self.questions

    @property
    def shared(self) -> int:
        """V: the prompt tokens a family holds once (0 when nothing is shared)."""
        return self.prefix - self.question if self.questions > 1 else 0

    @property
    def grouped_tokens(self) -> int:
        return int(self.groups * (self.prefix + self.group_size * self.completion)
                   - (self.groups - self.families) * self.shared)

    @property
    def repeated_tokens(self) -> int:
        return self.groups * self.group_size * (self.prefix + self.completion)

    @property
    def scored(self) -> int:
        """Completion tokens the output head scores."""
        return self.groups * self.group_size * self.completion


ATTENTION_BACKENDS = ("split", "flash", "flex", "packed", "paper", "repeated")


def attention_saved(shape: Shape, work: Workload, backend: str, dtype_bytes: int) -> float:
    """Bytes the attention of one decoder layer saves for the backward, per micro-batch.

    split (CPU): q whole, P's q/k/v/out as contiguous per-head copies (k/v repeated to every query head), the
    responses' q/k/v/out against P and against themselves, and both log-sum-exps. flash: P's q/k/v and out,
    the responses' q and out, and the gathered [P;Ri] keys/values of every response (kv heads). flex: q, k, v, out
    once (kv heads). repeated (SDPA with GQA): q, k, v over G rows of [P;Ri] (its output is o_proj's input)."""
    qd, kvd, b = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, dtype_bytes
    p, r, g = work.grouped_tokens - work.scored, work.scored, work.group_size  # prompt tokens in the row
    t = p + r
    lse = 4 * shape.heads
    if backend == "split":
        return b * qd * (t + 5 * p + 4 * r) + lse * t
    if backend == "flash":
        return b * (2 * qd * t + 2 * kvd * (p + g * p + r)) + lse * t
    if backend in ("flex", "packed", "paper"):  # one rectangle set over the packed row (packed/paper: approx.)
        return b * (2 * qd * t + 2 * kvd * t) + lse * t
    if backend == "repeated":  # SDPA's output is laid out as o_proj reads it: one tensor, counted in the layer
        t = work.repeated_tokens
        return b * (qd * t + 2 * kvd * t) + lse * t
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {ATTENTION_BACKENDS}")


def norm_bytes(hidden: int, dtype_bytes: int) -> int:
    """Per token, what one RMSNorm saves: the input and input x rsqrt in float32 (transformers upcasts), rsqrt, and
    the output in the model's dtype (saved by the linears that read it)."""
    return 4 * (2 * hidden + 1) + dtype_bytes * hidden


def layer_saved(shape: Shape, work: Workload, backend: str, dtype_bytes: int) -> float:
    """Bytes one decoder layer saves for the backward: two RMSNorms, the mixer's output projection's input, the
    MLP's gate, act, up and product (4 x intermediate), and the mixer: attention, or on average over a hybrid's
    layers its GDN layers' share (``layers.linear_saved``)."""
    from app.planning.layers import experts_saved, linear_saved

    tokens = work.repeated_tokens if backend == "repeated" else work.grouped_tokens
    per_token = 2 * norm_bytes(shape.hidden, dtype_bytes) + dtype_bytes * (shape.hidden + 4 * shape.intermediate)
    if shape.hc_count > 1:  # hyper-connections: each of the two mixers' norms over the S-wide stream, and its mix
        per_token += 2 * (norm_bytes(shape.hc_count * shape.hidden, dtype_bytes) - norm_bytes(shape.hidden, dtype_bytes)
                          + dtype_bytes * (shape.hc_count * shape.hidden + 2 * shape.hc_lowrank))
    mixer = (shape.attention_layers * attention_saved(shape, work, backend, dtype_bytes)
             + shape.linear_layers * linear_saved(shape, tokens, dtype_bytes)) / shape.layers
    return tokens * per_token + mixer + experts_saved(shape, tokens, dtype_bytes)


def model_saved(shape: Shape, work: Workload, backend: str, dtype_bytes: int) -> float:
    """Bytes saved once per forward outside the layers: RoPE's cos and sin, the final norm (its output is not kept:
    only the scored rows reach the head), the head's input rows, token ids."""
    tokens = work.repeated_tokens if backend == "repeated" else work.grouped_tokens
    final_norm = tokens * 4 * (2 * shape.hidden + 1)
    return tokens * 2 * shape.head_dim * dtype_bytes + final_norm + work.scored * shape.hidden * dtype_bytes + 8 * tokens


def backward_transients(shape: Shape, work: Workload, *, chunk: int, dtype_bytes: int, trains_head: bool,
                        backend: str, entropy: bool = True) -> dict:
    """Bytes a pass adds on top of the saved tensors at its high points (``logprobs`` and autograd as they are),
    each fitted to a plain training pass measured by the allocator (``app.bench.measure.allocator_peak``):

    - ``forward_head``: the chunked head's forward on one chunk of rows: the float32 logits and logsumexp's
      temporary of the same size; with the entropy the trainer asks for on its first pass, the log-softmax, its
      exponential and their product instead (four [chunk, vocab] float32 buffers in all); in low precision also
      the head's own output before its cast;
    - ``head``: the head's backward (one chunk of float32 logits, the float32 head-weight gradient and its cast);
    - ``layer``: the last decoder layer's MLP backward (activation gradients);
    - ``end``: the embedding's backward at the end: its gradient, and with tied weights the head's, held since the
      start (two vocabulary-sized buffers; a third appeared only under a Python dispatch mode, the old meter)."""
    b, v, h = dtype_bytes, shape.vocab, shape.hidden
    rows = min(chunk, work.scored) if chunk else work.scored
    tokens = work.repeated_tokens if backend == "repeated" else work.grouped_tokens
    logits = rows * v * 4 + (rows * v * b if b != 4 else 0)
    head = (v * h * 4 + (v * h * b if b != 4 else 0)) if trains_head else 0
    held = v * h * b if (shape.tied and trains_head) else 0  # a tied head's gradient waits for the embedding's
    # the last layer's MLP backward: the gradients of act and up (2 x intermediate per token) and of the hidden
    # state, while the final norm's saved tensors (freed before it) no longer count
    layer = tokens * (2 * shape.intermediate + h) * b - tokens * 4 * (2 * h + 1)
    end = (2 if shape.tied else 1) * v * h * b if trains_head else 0
    forward_head = rows * v * 4 * (4 if entropy else 2) + (rows * v * b if b != 4 else 0)
    return {"forward_head": forward_head, "head": logits + head + work.scored * h * b, "layer": held + layer,
            "end": end}


def qsa_joined(shape: Shape, tokens: int, dtype_bytes: int, sequence_parallel: int) -> float:
    """Bytes a QSA layer holds beyond its 1/S share under sequence parallelism: it joins the whole row's keys and
    values (``grouping.sparse.layer``), saved for its backward; 0 for other layers and at S = 1."""
    if not shape.index_budget or sequence_parallel == 1:
        return 0.0
    return tokens * 2 * shape.kv_heads * shape.head_dim * dtype_bytes * (1 - 1 / sequence_parallel)


def training_activations(shape: Shape, work: Workload, *, backend: str, dtype_bytes: int, checkpointing: bool,
                         chunk: int, trains_head: bool = True, sequence_parallel: int = 1,
                         entropy: bool = True) -> dict:
    """Peak bytes of one policy forward+backward on one rank above the model states (weights, preallocated
    gradients): the saved tensors of every layer, plus the largest backward transient while they are live."""
    per_layer = layer_saved(shape, work, backend, dtype_bytes)
    tokens = work.repeated_tokens if backend == "repeated" else work.grouped_tokens
    # checkpointing: each layer keeps only its input; the backward recomputes one layer at a time
    kept = shape.layers * tokens * shape.hidden * dtype_bytes if checkpointing else shape.layers * per_layer
    recompute = per_layer if checkpointing else 0.0
    joined = qsa_joined(shape, tokens, dtype_bytes, sequence_parallel)
    saved = (kept + model_saved(shape, work, backend, dtype_bytes)) / sequence_parallel
    saved += 0.0 if checkpointing else shape.attention_layers * joined
    t = backward_transients(shape, work, chunk=chunk, dtype_bytes=dtype_bytes, trains_head=trains_head,
                            backend=backend, entropy=entropy)
    peak = max(saved + t["forward_head"], saved + t["head"],
               saved + (recompute + t["layer"]) / sequence_parallel + (joined if checkpointing else 0.0), t["end"])
    return {"saved": saved, "per_layer": per_layer / sequence_parallel, "recompute": recompute / sequence_parallel,
            "transients": t, "peak": peak}


# Under activation checkpointing, the recomputed block's backward holds this share of one block's saved tensors
# beside every block's input and the block's largest weight gradient: the slope of the allocator's peak over 2,048-
# 4,096 patches (3 blocks), per family (their attention and MLP backwards differ; docs/planner.md).
VISION_RECOMPUTE_SHARE = {"qwen2_vl": 1.28, "qwen2_5_vl": 1.19, "qwen3_vl": 1.0}
VISION_MERGER_FLOATS = 7  # per patch and hidden unit, beside the merger's first weight gradient (fitted, 512 patches)
VISION_BACKWARD_SHARE = 0.5  # of a block's saved tensors, the backward's working set beyond them (fitted)


def vision_block_saved(shape: Shape, patches: int, dtype_bytes: int) -> float:
    """Bytes one tower block saves for its backward over ``patches`` patches, as measured by the allocator:
    Qwen2.5-VL's (SwiGLU MLP, RMSNorms: 13 x hidden + 4 x intermediate per patch), Qwen3-VL's (fc1, tanh-GELU, fc2,
    LayerNorms: 11 x hidden + 2 x intermediate), Qwen2-VL's (its QuickGELU keeps a third intermediate-sized
    tensor: 11 x hidden + 3 x intermediate)."""
    vh, vi = shape.vision_hidden, shape.vision_intermediate
    if shape.vision_gated:
        floats = 13 * vh + 4 * vi
    else:
        floats = 11 * vh + (3 if shape.family == "qwen2_vl" else 2) * vi
    return patches * dtype_bytes * floats


def vision_activations(shape: Shape, patches: int, *, training: bool, chunk_patches: int, dtype_bytes: int,
                       checkpointing: bool = False) -> float:
    """Peak bytes of the vision tower's pass. Training: every block's saved tensors, the backward's working set
    beyond them, and one block's weight gradients before they are accumulated; under activation checkpointing
    (which the trainer applies to the tower's blocks too), every block's input, then the larger of the recomputed
    block's backward and the merger's. Frozen: one block's working set over one chunk of patches. The shares are
    fitted to passes of the Qwen2-VL-2B, Qwen2.5-VL-7B, Qwen3-VL-2B and -8B towers (3 blocks, 512-4,096 patches)
    measured by the allocator; tests/test_planner_accuracy.py checks other depths and sizes."""
    vh, vi = shape.vision_hidden, shape.vision_intermediate
    if training:
        # Qwen3-VL's deepstack mergers keep their own activations (about 4 x hidden per patch each)
        block = vision_block_saved(shape, patches, dtype_bytes) + shape.vision_deepstack * patches * dtype_bytes * 4 * vh
        grads = shape.vision_block_params * dtype_bytes
        if checkpointing:
            inputs = shape.vision_depth * patches * vh * dtype_bytes
            recompute = VISION_RECOMPUTE_SHARE.get(shape.family, 1.28) * block + vh * vi * dtype_bytes
            # short videos peak earlier, in the merger's backward: its first weight's gradient, (hidden x merge^2)^2
            merger = (vh * shape.merge**2) ** 2 * dtype_bytes + VISION_MERGER_FLOATS * patches * vh * dtype_bytes
            return inputs + max(recompute, merger)
        return (shape.vision_depth + VISION_BACKWARD_SHARE) * block + grads
    rows = min(chunk_patches, patches) if chunk_patches else patches
    # a frozen block's working set without gradients: its input and a few hidden-sized tensors, and the MLP's
    # intermediates (three for SwiGLU and QuickGELU, two for GELU), measured on the three towers
    wide = 3 if (shape.vision_gated or shape.family == "qwen2_vl") else 2
    return rows * dtype_bytes * (4 * vh + wide * vi)


def vision_held(shape: Shape, patches: int, *, checkpointing: bool, dtype_bytes: int) -> float:
    """Bytes a trained tower keeps while the language model runs its forward and backward: every block's saved
    tensors, or under activation checkpointing every block's input."""
    if checkpointing:
        return shape.vision_depth * patches * shape.vision_hidden * dtype_bytes
    return shape.vision_depth * (vision_block_saved(shape, patches, dtype_bytes)
                                 + shape.vision_deepstack * patches * dtype_bytes * 4 * shape.vision_hidden)


def pass_with_trained_tower(shape: Shape, language_peak: float, tower_peak: float, tower_held: float, *,
                            trains_head: bool, dtype_bytes: int) -> float:
    """Peak of a policy pass whose tower trains: the language model's forward+backward runs beside what the tower
    holds (``vision_held``); the tower's backward runs after the language model's, beside, for a tied head that
    trains, the head's weight gradient (autograd sums a weight's gradients before accumulating them, and the
    embedding, the tied weight's other use, runs its backward after the tower's). Measured on the whole pass at
    the Qwen2-VL-2B width with a 64-frame video (app/bench/planning/accuracy.py)."""
    head = shape.vocab * shape.hidden * dtype_bytes if shape.tied and trains_head else 0.0
    return max(language_peak + tower_held, tower_peak + head)


# ---------------------------------------------------------------------------------------------------------- states
@dataclass(frozen=True)
class StatesInput:
    total: int
    trainable: int
    reference: bool  # a separate reference model is loaded (beta > 0, no LoRA)
    stage: int
    ranks: int
    dtype_bytes: int
    offload_optimizer: bool = False
    offload_param: bool = False


def model_states(s: StatesInput) -> dict:
    """Bytes per rank of weights, gradients, optimizer states (with fp32 master weights) and the reference model."""
    weights = s.dtype_bytes * s.total
    grads = s.dtype_bytes * s.trainable
    optimizer = (ADAM_BYTES if s.dtype_bytes == 2 else 8) * s.trainable
    if s.stage >= 1:
        optimizer /= s.ranks
    if s.stage >= 2:
        grads /= s.ranks
    if s.stage >= 3:
        weights /= s.ranks
    host = 0.0
    if s.offload_optimizer:
        host += optimizer
        optimizer = 0.0
    if s.offload_param and s.stage >= 3:
        host += weights
        weights = 0.0
    reference = weights if s.reference else 0.0
    if s.reference and s.offload_param and s.stage >= 3:
        host += s.dtype_bytes * s.total / s.ranks
    return {"weights": weights, "gradients": grads, "optimizer": optimizer, "reference": reference,
            "total": weights + grads + optimizer + reference, "host": host}
