"""FLOPs of a training step's phases, from the model's shape alone: matmuls, and attention as the kernels compute it
(whole rectangles for torch's masked kernels, which ``torch.utils.flop_counter`` counts; the tiles a block-skipping
kernel keeps for flash and flex; the causal pairs a perfect kernel would); the backward is 2x the forward for
matmuls, 2.5x for fused attention; the vision tower with Qwen2.5-VL's windows, per-frame attention, deepstack
mergers and checkpoint recompute. Checked against the flop counter and FlexAttention's block masks
(tests/test_plan.py, tests/test_planner_accuracy.py).
"""

from __future__ import annotations

from app.planning.costs import Shape, Workload

KERNEL_BLOCK = 128  # FlexAttention's block, and flash-attn's row tile at the head sizes of Qwen-VL
# The repeated layout ([P;Ri] rows, what TRL-style trainers run) by the kernel that computes it: masked SDPA (a
# padding mask makes torch pick a kernel that computes every tile: whole rectangles) or flash-attn (varlen, the
# masked tiles skipped). The planner gives the TRL-style baseline with both and says which each ratio uses.
REPEATED_KERNELS = {"repeated": "masked SDPA", "repeated_flash": "flash-attn"}


def is_repeated(backend: str) -> bool:
    """Whether ``backend`` is the repeated layout (under either kernel of ``REPEATED_KERNELS``)."""
    return backend in REPEATED_KERNELS


def causal_tiles(rows: int, keys: int, block: int = KERNEL_BLOCK) -> int:
    """Tiles (``block`` x ``block``) a block-skipping kernel computes for ``rows`` queries against ``keys`` keys,
    bottom-right causal (query j sees keys ``[0, keys - rows + j]``): flash-attn varlen's loop over one sequence."""
    tiles = 0
    for start in range(0, rows, block):
        last = min(start + block, rows) - 1
        tiles += -(-(keys - rows + last + 1) // block)
    return tiles


def packed_tiles(prefix: int, group: int, completion: int, block: int = KERNEL_BLOCK) -> int:
    """Tiles FlexAttention computes for one packed group [P;R1..RG]: a tile runs when any of its pairs is allowed
    (causal, prefix keys, or keys of the query's own response). Equals the block mask's tiles (tested)."""
    total = prefix + group * completion
    prefix_blocks = -(-prefix // block)
    tiles = 0
    for r in range(-(-total // block)):
        low, high = r * block, min((r + 1) * block, total) - 1
        left = 0  # [0, left): the prefix keys' blocks
        if low < prefix:
            left = min(high, prefix - 1) // block + 1
        if high >= prefix:  # responses' rows: the whole prefix, and each response from its start to the diagonal
            left = max(left, prefix_blocks)
            first = prefix + (max(low, prefix) - prefix) // completion * completion
            own = first // block
            tiles += left + (r - own + 1) - max(0, left - own)
        else:
            tiles += left
    return tiles


def attention_pairs(work: Workload, backend: str) -> tuple[float, float]:
    """(query-key pairs the kernel computes, causal pairs a perfect kernel would) of one forward.

    ``split`` and ``repeated`` (torch's fused kernels given a mask, or the CPU's) compute whole rectangles; flash,
    flex and ``repeated_flash`` (the repeated rows under flash-attn) skip the tiles their mask rules out and compute
    the rest whole, so they are counted in tiles of ``KERNEL_BLOCK`` (groups of a micro-batch counted one by one,
    as if each began on a tile boundary)."""
    p, c, g, n = work.prefix, work.completion, work.group_size, work.groups
    tile = KERNEL_BLOCK**2
    if backend == "repeated":
        rows = g * (p + c)
        return n * g * (p + c) ** 2, n * rows * (p + c + 1) / 2
    if backend == "repeated_flash":
        return n * g * tile * causal_tiles(p + c, p + c), n * g * (p + c) * (p + c + 1) / 2
    if work.questions > 1 and backend != "masked":
        return family_pairs(work, backend)
    causal = p * (p + 1) / 2 + g * (c * p + c * (c + 1) / 2)
    if backend == "split":  # P causally (full square), all responses x P, each response x itself
        return n * (p * p + g * c * p + g * c * c), n * causal
    if backend == "flash":  # P causally, then each response against [P;Ri]
        return n * tile * (causal_tiles(p, p) + g * causal_tiles(c, p + c) * (c > 0)), n * causal
    if backend == "flex":
        return n * tile * packed_tiles(p, g, c), n * causal
    return n * (p * p + g * c * (p + c)), n * causal  # packed / paper / masked: P, then each [P;Ri]


def family_pairs(work: Workload, backend: str) -> tuple[float, float]:
    """``attention_pairs`` of families of ``questions`` questions sharing V ([V; Q1; R1*; ...]): V causally, every
    later token against V, each question and its responses against the question, each response against itself
    (split's calls); flash's varlen calls (V causally, each question against [V; Q], each response against
    [V; Q; R]) in tiles; flex in tiles as flash's plus each question's rows against V whole (approximate at
    block edges)."""
    v, q, c, g, k = work.shared, work.question, work.completion, work.group_size, work.questions
    tile, families = KERNEL_BLOCK**2, work.families
    own = q + g * c  # a question and its responses
    causal = v * (v + 1) / 2 + k * (own * v + q * (q + 1) / 2 + g * (c * q + c * (c + 1) / 2))
    if backend == "split":
        return families * (v * v + k * own * v + k * (own * q + g * c * c)), families * causal
    if backend == "flash":
        tiles = causal_tiles(v, v) + k * (causal_tiles(q, v + q) + g * causal_tiles(c, v + q + c))
        return families * tile * tiles, families * causal
    if backend == "flex":
        rows = -(-own // KERNEL_BLOCK)
        tiles = causal_tiles(v, v) + k * (rows * -(-v // KERNEL_BLOCK) + packed_tiles(q, g, c))
        return families * tile * tiles, families * causal
    raise ValueError(f"attention backend {backend!r} does not share a video across questions")


def forward_flops(shape: Shape, work: Workload, backend: str) -> dict:
    """Forward FLOPs of the language model over one micro-batch: matmuls, attention as the backend's kernel computes
    it (and as a perfect causal kernel would), output head on the scored tokens."""
    from app.planning.layers import rule_flops

    tokens = work.repeated_tokens if is_repeated(backend) else work.grouped_tokens
    rect, causal = attention_pairs(work, backend)
    per_pair = 4 * shape.heads * shape.head_dim * shape.attention_layers
    index = 0.0
    if shape.index_budget:  # QSA: each query's chosen keys (a kernel reading only those), and the indexer's scores
        from app.planning.layers import qsa_work

        rect, index = qsa_work(shape, work, is_repeated(backend))
        causal, index = rect, index * shape.attention_layers
    linear = 2 * shape.layer_matmul_params * shape.layers * tokens
    head = 2 * shape.hidden * shape.vocab * work.scored
    rule = rule_flops(shape, tokens)  # a hybrid's GDN layers: their conv and chunked delta rule
    return {"linear": linear, "attention": rect * per_pair, "attention_causal": causal * per_pair, "head": head,
            "rule": rule, "index": index, "total": linear + rect * per_pair + rule + index + head,
            "total_causal": linear + causal * per_pair + rule + index + head}


def train_flops(shape: Shape, work: Workload, backend: str, *, checkpointing: bool, chunk: int,
                deepspeed_linear: bool = False, weight_grads: bool = True) -> dict:
    """Forward+backward FLOPs of the policy update over one micro-batch: the backward is twice the forward for
    matmuls and 2.5 times for fused attention; checkpointing runs each layer's forward again but its last matmul
    (all of it with ``deepspeed_linear``); the chunked head (``chunk`` > 0) recomputes its logits in the backward.
    ``weight_grads`` False (LoRA: the base weights frozen): the matmuls' backward computes the input's gradient
    only, once the forward (the adapters' own FLOPs are rank / hidden of it: left out).

    ``deepspeed_linear``: ``torch.nn.functional.linear`` is DeepSpeed's ZeRO-3 replacement, which loading a model
    under ZeRO-3 installs for the rest of the process (``app.runtime.zero``)."""
    f = forward_flops(shape, work, backend)
    again = 1 if checkpointing else 0
    # torch's non-reentrant checkpoint stops recomputing once every saved tensor is back: each layer's last matmul
    # (down_proj, hidden x intermediate of its weights) is not run again (measured with the flop counter). DeepSpeed's
    # linear is an autograd function that saves its inputs AFTER its matmul, so under it that matmul runs again too.
    last = 0.0 if deepspeed_linear else shape.hidden * shape.intermediate / shape.layer_matmul_params
    recompute = f["linear"] * (1 - last) if checkpointing else 0.0
    backward = 2 if weight_grads else 1
    linear = (1 + backward) * f["linear"] + recompute + (backward + (2 if chunk else 1)) * f["head"]
    # fused attention backward recomputes the scores: 5 matmuls against the forward's 2 (torch's flop_counter)
    attention = 3.5 + again
    from app.planning.layers import RULE_BACKWARD

    rule = (1 + RULE_BACKWARD + again) * f["rule"] + (1 + again) * f["index"]  # the indexer has no backward
    return {"total": linear + attention * f["attention"] + rule,
            "total_causal": linear + attention * f["attention_causal"] + rule}


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
    from app.planning.layers import decode_rule_flops

    g, c, p = work.group_size * work.groups, work.completion, work.prefix
    per_token = 2 * shape.layer_matmul_params * shape.layers + 2 * shape.hidden * shape.vocab
    keys = c * p + c * (c + 1) / 2  # what a sample's steps attend to in all
    if shape.index_budget:  # QSA: at most the budget, and each step scores every complete block it sees
        from app.planning.layers import bounded_keys

        index = 2 * shape.index_heads * shape.index_dim * shape.attention_layers * g * keys / shape.index_compress
        keys = bounded_keys(p, c, shape.index_budget)
        per_token += index / max(g * c, 1)
    attention = 4 * shape.heads * shape.head_dim * shape.attention_layers * g * keys
    return g * c * per_token + attention + c * decode_rule_flops(shape, g)
