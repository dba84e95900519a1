"""Know before you launch: memory per rank and FLOPs per step of a training config, from the model's shape alone.

Every figure is a formula over the architecture (``Shape``), the sequence lengths a step sees (``Workload``) and
the world; nothing is allocated at full size. What each formula counts is what the code of this project keeps:

- model states: the standard ZeRO arithmetic (Rajbhandari et al. 2020, sec. 3/5): bf16 weights and gradients,
  fp32 master weights and two Adam moments (12 bytes per trainable parameter), each partitioned by its stage;
- activations: per token and decoder layer, the tensors autograd saves in the transformers Qwen layer (two RMSNorms,
  the linear inputs, the SwiGLU MLP's four intermediate tensors) plus what the attention backend saves; checked
  tensor by tensor against ``torch.autograd.graph.saved_tensors_hooks`` on the real classes (tests/test_plan.py);
- the backward's first moment: every saved tensor still live, plus the output head's chunk of logits and its weight
  gradient (the largest single gradient);
- FLOPs: matmuls and attention rectangles as the kernels compute them (what ``torch.utils.flop_counter`` counts) and
  the causal pairs a perfect kernel would; the backward is 2x the forward for matmuls, 2.5x for fused attention.

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

    @property
    def layer_matmul_params(self) -> int:
        """Weights one token meets in a decoder layer's matmuls (q, k, v, o, gate, up, down; biases aside)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate

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
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    tied = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
    base = dict(family=config.model_type, hidden=text.hidden_size, layers=text.num_hidden_layers, heads=heads,
                kv_heads=text.num_key_value_heads, head_dim=head_dim, intermediate=text.intermediate_size,
                vocab=text.vocab_size, tied=tied)
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
    return Shape(**base, vision_hidden=vh, vision_depth=vision.depth, vision_intermediate=vi, vision_gated=gated,
                 patch=vision.patch_size, merge=vision.spatial_merge_size, temporal_patch=vision.temporal_patch_size,
                 **windows)


@dataclass(frozen=True)
class Workload:
    """The sequences of one micro-batch on one rank: ``groups`` groups of one prompt (``prefix`` tokens, of which
    ``visual`` are vision tokens from ``patches`` patches) and ``group_size`` completions of ``completion`` tokens."""

    prefix: int
    completion: int
    group_size: int
    groups: int = 1
    visual: int = 0
    patches: int = 0
    temporal: int = 0  # temporal patches of the video (frames / temporal_patch_size)

    @property
    def grouped_tokens(self) -> int:
        return self.groups * (self.prefix + self.group_size * self.completion)

    @property
    def repeated_tokens(self) -> int:
        return self.groups * self.group_size * (self.prefix + self.completion)

    @property
    def scored(self) -> int:
        """Completion tokens the output head scores."""
        return self.groups * self.group_size * self.completion


def video_tokens(shape: Shape, frames: int, max_pixels: int) -> tuple[int, int, int]:
    """(merged visual tokens, tower patches, temporal patches) of a video of ``frames`` frames at most
    ``max_pixels`` pixels per frame (the upper bound: the processor rounds each side to the patch grid)."""
    temporal = max(1, -(-frames // shape.temporal_patch))
    per_temporal = max(1, max_pixels // shape.pixels_per_token)
    tokens = temporal * per_temporal
    return tokens, tokens * shape.merge**2, temporal


# ---------------------------------------------------------------------------------------------------- activations
ATTENTION_BACKENDS = ("split", "flash", "flex", "packed", "paper", "repeated")


def attention_saved(shape: Shape, work: Workload, backend: str, dtype_bytes: int) -> float:
    """Bytes the attention of one decoder layer saves for the backward, per micro-batch.

    split (CPU): q whole, P's q/k/v/out as contiguous per-head copies (k/v repeated to every query head), the
    responses' q/k/v/out against P and against themselves, and both log-sum-exps. flash: P's q/k/v and out,
    the responses' q and out, and the gathered [P;Ri] keys/values of every response (kv heads). flex: q, k, v, out
    once (kv heads). repeated (SDPA with GQA): q, k, v over G rows of [P;Ri] (its output is o_proj's input)."""
    qd, kvd, b = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, dtype_bytes
    p, r, g = work.groups * work.prefix, work.scored, work.group_size
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
    """Bytes one decoder layer saves for the backward: two RMSNorms, o_proj's input, the MLP's gate, act, up and
    product (4 x intermediate), and the attention."""
    tokens = work.repeated_tokens if backend == "repeated" else work.grouped_tokens
    per_token = 2 * norm_bytes(shape.hidden, dtype_bytes) + dtype_bytes * (shape.hidden + 4 * shape.intermediate)
    return tokens * per_token + attention_saved(shape, work, backend, dtype_bytes)


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
    saved = (kept + model_saved(shape, work, backend, dtype_bytes)) / sequence_parallel
    t = backward_transients(shape, work, chunk=chunk, dtype_bytes=dtype_bytes, trains_head=trains_head,
                            backend=backend, entropy=entropy)
    peak = max(saved + t["forward_head"], saved + t["head"], saved + (recompute + t["layer"]) / sequence_parallel,
               t["end"])
    return {"saved": saved, "per_layer": per_layer / sequence_parallel, "recompute": recompute / sequence_parallel,
            "transients": t, "peak": peak}


VISION_RECOMPUTE_SHARE = 0.75  # of a block's saved tensors, at the recomputed block's backward (fitted, see below)
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
    """Peak bytes of the vision tower's pass. Training: every block's saved tensors (or, under activation
    checkpointing, which the trainer applies to the tower's blocks too, every block's input and one recomputed
    block's share), the backward's working set beyond them, and one block's weight gradients before they are
    accumulated. Frozen: one block's working set over one chunk of patches. The training terms are fitted to
    passes of the Qwen2.5-VL-3B and Qwen3-VL-2B towers (2-4 blocks, 512-1024 patches, with and without
    checkpointing) measured by the allocator; tests/test_plan.py checks others."""
    vh, vi = shape.vision_hidden, shape.vision_intermediate
    if training:
        # Qwen3-VL's deepstack mergers keep their own activations (about 4 x hidden per patch each)
        block = vision_block_saved(shape, patches, dtype_bytes) + shape.vision_deepstack * patches * dtype_bytes * 4 * vh
        grads = shape.vision_block_params * dtype_bytes
        if checkpointing:
            return shape.vision_depth * patches * vh * dtype_bytes + VISION_RECOMPUTE_SHARE * block + grads
        return (shape.vision_depth + VISION_BACKWARD_SHARE) * block + grads
    rows = min(chunk_patches, patches) if chunk_patches else patches
    return rows * dtype_bytes * (6 * vh + 3 * vi)


# ---------------------------------------------------------------------------------------------------------- FLOPs
def attention_pairs(work: Workload, backend: str) -> tuple[float, float]:
    """(query-key pairs the kernels compute, causal pairs a perfect kernel would) of one forward."""
    p, c, g, n = work.prefix, work.completion, work.group_size, work.groups
    if backend == "repeated":
        rows = g * (p + c)
        return n * g * (p + c) ** 2, n * rows * (p + c + 1) / 2
    causal = p * (p + 1) / 2 + g * (c * p + c * (c + 1) / 2)
    if backend == "split":  # P causally (full square), all responses x P, each response x itself
        return n * (p * p + g * c * p + g * c * c), n * causal
    return n * (p * p + g * c * (p + c)), n * causal  # flash / flex / packed / paper: P, then each [P;Ri]


def forward_flops(shape: Shape, work: Workload, backend: str) -> dict:
    """Forward FLOPs of the language model over one micro-batch: matmuls, attention rectangles (and causal),
    output head on the scored tokens."""
    tokens = work.repeated_tokens if backend == "repeated" else work.grouped_tokens
    rect, causal = attention_pairs(work, backend)
    per_pair = 4 * shape.heads * shape.head_dim * shape.layers
    linear = 2 * shape.layer_matmul_params * shape.layers * tokens
    head = 2 * shape.hidden * shape.vocab * work.scored
    return {"linear": linear, "attention": rect * per_pair, "attention_causal": causal * per_pair, "head": head,
            "total": linear + rect * per_pair + head, "total_causal": linear + causal * per_pair + head}


def train_flops(shape: Shape, work: Workload, backend: str, *, checkpointing: bool, chunk: int,
                deepspeed_linear: bool = False) -> dict:
    """Forward+backward FLOPs of the policy update over one micro-batch: the backward is twice the forward for
    matmuls and 2.5 times for fused attention; checkpointing runs each layer's forward again but its last matmul
    (all of it with ``deepspeed_linear``); the chunked head (``chunk`` > 0) recomputes its logits in the backward.

    ``deepspeed_linear``: ``torch.nn.functional.linear`` is DeepSpeed's ZeRO-3 replacement, which loading a model
    under ZeRO-3 installs for the rest of the process (``app.runtime.zero``)."""
    f = forward_flops(shape, work, backend)
    again = 1 if checkpointing else 0
    # torch's non-reentrant checkpoint stops recomputing once every saved tensor is back: each layer's last matmul
    # (down_proj, hidden x intermediate of its weights) is not run again (measured with the flop counter). DeepSpeed's
    # linear is an autograd function that saves its inputs AFTER its matmul, so under it that matmul runs again too.
    last = 0.0 if deepspeed_linear else shape.hidden * shape.intermediate / shape.layer_matmul_params
    recompute = f["linear"] * (1 - last) if checkpointing else 0.0
    linear = 3 * f["linear"] + recompute + (4 if chunk else 3) * f["head"]
    # fused attention backward recomputes the scores: 5 matmuls against the forward's 2 (torch's flop_counter)
    attention = 3.5 + again
    return {"total": linear + attention * f["attention"], "total_causal": linear + attention * f["attention_causal"]}


def vision_attention_pairs(shape: Shape, patches: int, temporal: int) -> float:
    """Query-key pairs of the tower's attention over ``patches`` patches of ``temporal`` temporal patches (a video's
    frames pairwise): every block attends within one temporal patch's frame (Qwen2-VL, Qwen3-VL; Qwen2.5-VL's full
    blocks), except Qwen2.5-VL's windowed blocks, within windows of ``vision_window`` pixels squared (one window
    holds at most a frame)."""
    per_frame = patches / max(temporal, 1)
    depth = shape.vision_depth
    if shape.vision_full_blocks < 0:
        return depth * patches * per_frame
    window = min((shape.vision_window // shape.patch) ** 2, per_frame)
    full = shape.vision_full_blocks
    return full * patches * per_frame + (depth - full) * patches * window


def vision_flops(shape: Shape, patches: int, temporal: int = 1, *, training: bool = False,
                 checkpointing: bool = False) -> float:
    """FLOPs of the tower over ``patches`` patches of ``temporal`` temporal patches: patch embedding, blocks (their
    matmuls and attention as ``vision_attention_pairs`` says), the merger (and Qwen3-VL's deepstack mergers).
    Training: the backward twice the forward's matmuls (the patch embedding's weight gradient only: the pixels need
    none) and 2.5 times its attention; under activation checkpointing every block's forward once more but its last
    matmul (torch's non-reentrant checkpoint stops once the saved tensors are back, as in the language model)."""
    if not patches:
        return 0.0
    vh = shape.vision_hidden
    embed = 2 * 3 * shape.temporal_patch * shape.patch**2 * vh * patches
    blocks = 2 * shape.vision_block_params * patches * shape.vision_depth
    attention = 4 * vh * vision_attention_pairs(shape, patches, temporal)
    merged = patches // shape.merge**2
    merger = (1 + shape.vision_deepstack) * 2 * merged * (vh * shape.merge**2) * (vh * shape.merge**2 + shape.hidden)
    forward = embed + blocks + attention + merger
    if not training:
        return forward
    last = shape.vision_hidden * shape.vision_intermediate / shape.vision_block_params  # the MLP's second matmul
    again = (blocks * (1 - last) + attention) if checkpointing else 0.0
    return 2 * embed + 3 * (blocks + merger) + 3.5 * attention + again


def decode_flops(shape: Shape, work: Workload) -> float:
    """FLOPs of sampling ``completion`` tokens for each of the G samples of every group after the prefill: each new
    token through the layers, attending to its prompt and its own earlier tokens, and the head's full vocabulary."""
    g, c, p = work.group_size * work.groups, work.completion, work.prefix
    per_token = 2 * shape.layer_matmul_params * shape.layers + 2 * shape.hidden * shape.vocab
    attention = 4 * shape.heads * shape.head_dim * shape.layers * g * (c * p + c * (c + 1) / 2)
    return g * c * per_token + attention


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
