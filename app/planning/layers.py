"""One place per decoder-layer kind: what a token costs in it and what a sequence keeps of it between decode steps.
The phases (``costs``, ``flops``, ``timing``, ``planner``) ask here and sum over a model's kinds, so a hybrid
(Qwen3.5: Gated DeltaNet layers with gated full attention every 4th) is planned by the same formulas as an
attention-only model, whose one kind is attention.

- **attention**: q, k, v, o (Qwen3.5's q also writes its output gate); FLOPs per query-key pair (``flops``); K/V
  per token kept for decoding, read by every step.
- **gdn** (Gated DeltaNet): its projections (q|k|v, z, b, a, out); the causal conv and the chunked delta rule
  (``RULE_CHUNK`` tokens a chunk: per value head and token C (5 dk + 3 dv) + 6 dk dv multiply-adds, counted from
  the chunked form's products: the chunk's k k^T and q k^T, two triangular solves, the reads of the state and its
  update); no K/V: a state per sequence, [value heads, dk, dv] float32 and the conv's last W - 1 inputs, read and
  written by every decode step.

- **experts** (mixture of experts: Qwen3-VL-MoE, Qwen3.5-MoE): the MLP's weights a token meets are its k routed
  experts' and the shared expert's (``Shape.intermediate`` is that average, so FLOPs and saved activations are k
  experts' per token); the **router** is a kind of its own, [E, hidden] per sparse layer, met by every token. The
  parameters (weights, gradients, optimizer state) are all E experts' (``shapes.count_parameters``), and so is what
  ZeRO-3 gathers per layer. What the experts save beyond a dense MLP (the top-k ids and weights, grouped_mm's
  tokens sorted by expert: ``EXPERTS_SAVED``) is a GUESS until a GPU measures it. Under expert parallelism
  (``train.expert_parallel_size`` = EP, DeepSpeed's AutoEP) a rank holds E / EP experts of each sparse layer: what
  ZeRO-3 gathers of a layer's experts is E / EP of them over world / EP ranks (``expert_gather_bytes``), and each
  token's k routed copies cross to their experts' ranks and back in an all-to-all (``exchange_bytes``).

What a GDN layer saves for the backward is a GUESS until a GPU measures it (``GDN_SAVED``: fla's chunked kernel
keeps q, k, v, g, beta and its per-chunk WY factors; the conv its input; the gated norm its input and gate), as
are ``RULE_BACKWARD`` (the delta rule's backward against its forward) and the decode step's efficiency on the
state (taken as the K/V's): docs/planner.md says so where it prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RULE_CHUNK = 64  # the chunked delta rule's chunk (fla's and transformers' torch fallback's)
RULE_BACKWARD = 2.5  # the delta rule's backward against its forward, as fused attention's (a guess: not measured)
# per token of a GDN layer, saved for the backward, in units of (hidden | conv channels | value dims): the layer's
# input (read by four projections), the conv's input and output, the rule's q, k, v (post-conv, L2-normalised in
# float32 inside the kernel), its output, z and the norm's input. A guess from the kernels' code, not measured.
GDN_SAVED = {"hidden": 1, "conv": 3, "value": 3, "float32_heads": 3}


# per token and sparse layer, saved beyond a dense MLP of the same active width, in units of hidden (in the model's
# dtype): the tokens permuted into expert order for grouped_mm (k copies of the input) and the routing weights
# applied to the k outputs (k more). A guess from transformers' grouped_mm path, not measured.
EXPERTS_SAVED = {"hidden_per_slot": 2}


@dataclass(frozen=True)
class Kind:
    """One decoder-layer kind of a model: how many layers have it and the weights a token meets in its mixer."""

    name: str
    count: int
    matmul_params: int


def attention_params(shape) -> int:
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return h * q * (2 if shape.attention_gate else 1) + 2 * h * kv + q * h


def conv_channels(shape) -> int:
    """A GDN layer's q|k|v channels (the conv runs over each)."""
    return 2 * shape.linear_key_heads * shape.linear_head_dim + shape.linear_value_heads * shape.linear_head_dim


def gdn_params(shape) -> int:
    h, value = shape.hidden, shape.linear_value_heads * shape.linear_head_dim
    return h * conv_channels(shape) + h * value + 2 * h * shape.linear_value_heads + value * h


def kinds(shape) -> list[Kind]:
    out = [Kind("attention", shape.attention_layers, attention_params(shape))]
    if shape.index_budget:  # QSA's indexer: index queries and one raw key per token
        out.append(Kind("indexer", shape.attention_layers, shape.hidden * (shape.index_heads + 1) * shape.index_dim))
    if shape.hc_count > 1:  # hyper-connections: two mixers a layer (down, up, inject) over the S-wide stream
        wide = shape.hc_count * shape.hidden
        out.append(Kind("hyper", shape.layers, 2 * (2 * wide * shape.hc_lowrank + wide * shape.hc_count)))
    if shape.ple_layers:  # PLE's key (one per stream) and value projections of the n-gram features
        out.append(Kind("ple", shape.ple_layers, shape.ple_dim * (shape.hc_count + 1) * shape.hidden))
    if shape.linear_layers:
        out.append(Kind("gdn", shape.linear_layers, gdn_params(shape)))
    if shape.sparse_layers:
        out.append(Kind("router", shape.sparse_layers, shape.hidden * shape.experts))
    return out


def moe_shape(text) -> dict:
    """A mixture-of-experts text config's sparse layers (``decoder_sparse_step`` / ``mlp_only_layers`` as
    transformers reads them; Qwen3.5-MoE: every layer), and the intermediate one token meets on average."""
    from app.grouping.experts.blocks import config_expert_shape

    found = config_expert_shape(text)
    if found is None:
        return {}
    layers, sparse, experts, k = text.num_hidden_layers, len(found.layers), found.experts, found.top_k
    moe = int(text.moe_intermediate_size)
    shared = int(getattr(text, "shared_expert_intermediate_size", 0) or 0)
    dense = int(getattr(text, "intermediate_size", 0) or 0)
    active = (sparse * (k * moe + shared) + (layers - sparse) * dense) / layers
    return dict(sparse_layers=sparse, experts=experts, experts_per_token=k, moe_intermediate=moe,
                shared_intermediate=shared, intermediate=int(round(active)))


def experts_saved(shape, tokens: float, dtype_bytes: int) -> float:
    """Bytes one decoder layer saves beyond its dense-equivalent MLP over ``tokens`` tokens, on average over the
    layers (``EXPERTS_SAVED``, a guess): 0 for a dense model."""
    if not shape.sparse_layers:
        return 0.0
    per_token = EXPERTS_SAVED["hidden_per_slot"] * shape.experts_per_token * shape.hidden * dtype_bytes
    return tokens * per_token * shape.sparse_layers / shape.layers


def rule_flops(shape, tokens: float) -> float:
    """Forward FLOPs of the GDN layers' conv and chunked delta rule over ``tokens`` tokens (all GDN layers)."""
    if not shape.linear_layers:
        return 0.0
    dk = dv = shape.linear_head_dim
    per_head = RULE_CHUNK * (5 * dk + 3 * dv) + 6 * dk * dv  # multiply-adds per token and value head
    return 2.0 * shape.linear_layers * tokens * (shape.linear_value_heads * per_head
                                                 + shape.conv_kernel * conv_channels(shape))


def decode_rule_flops(shape, samples: float) -> float:
    """FLOPs of one decode step's GDN layers for ``samples`` sequences: each value head's state decayed, read by k,
    updated and read by q (about 4 dk dv multiply-adds), and the conv's window."""
    if not shape.linear_layers:
        return 0.0
    dk = dv = shape.linear_head_dim
    return 2.0 * shape.linear_layers * samples * (4 * shape.linear_value_heads * dk * dv
                                                 + shape.conv_kernel * conv_channels(shape))


def linear_saved(shape, tokens: float, dtype_bytes: int) -> float:
    """Bytes one GDN layer saves for the backward over ``tokens`` tokens (``GDN_SAVED``: a guess)."""
    if not shape.linear_layers:
        return 0.0
    value = shape.linear_value_heads * shape.linear_head_dim
    per_token = dtype_bytes * (GDN_SAVED["hidden"] * shape.hidden + GDN_SAVED["conv"] * conv_channels(shape)
                               + GDN_SAVED["value"] * value) + 4 * GDN_SAVED["float32_heads"] * (
        shape.linear_value_heads * (2 * shape.linear_head_dim + 2 + RULE_CHUNK))
    return tokens * per_token


def kv_bytes_per_token(shape, dtype_bytes: int) -> float:
    """K/V one token keeps for decoding, over the attention layers only (QSA's also its raw index key)."""
    return (2 * shape.kv_heads * shape.head_dim + shape.index_dim) * shape.attention_layers * dtype_bytes


def state_bytes(shape, dtype_bytes: int) -> float:
    """What one sequence keeps of the GDN layers, whatever its length: the float32 state and the conv's last W - 1
    inputs, per GDN layer (0 for an attention-only model)."""
    if not shape.linear_layers:
        return 0.0
    state = 4 * shape.linear_value_heads * shape.linear_head_dim * shape.linear_head_dim
    return shape.linear_layers * (state + dtype_bytes * conv_channels(shape) * (shape.conv_kernel - 1))


def experts_read(shape, tokens: float) -> float:
    """Of a sparse layer's E routed experts, the fraction one step over ``tokens`` tokens meets (and so reads from
    memory) when routing spreads them evenly: 1 - (1 - k / E) ^ tokens. A decode step of G samples meets far fewer
    than E at 128 experts; a prefill meets all of them. 1.0 for a dense model."""
    if not shape.sparse_layers:
        return 1.0
    return 1.0 - (1.0 - shape.experts_per_token / shape.experts) ** max(tokens, 0.0)


def unread_expert_params(shape, tokens: float) -> float:
    """Routed-expert parameters (all sparse layers) a step over ``tokens`` tokens does not read (``experts_read``)."""
    if not shape.sparse_layers:
        return 0.0
    per_layer = shape.experts * 3 * shape.hidden * shape.moe_intermediate
    return shape.sparse_layers * per_layer * (1.0 - experts_read(shape, tokens))


def routing_bytes_per_token(shape) -> int:
    """rollout.routing_replay=r3: the record of one token, an expert id (``experts.record.RECORD_DTYPE``) per sparse
    layer and top-k slot (0 for a dense model): 768 bytes at Qwen3-VL-30B-A3B (48 sparse layers, top-8)."""
    from app.grouping.experts.record import RECORD_DTYPE

    size = torch.empty((), dtype=RECORD_DTYPE).element_size()
    return size * shape.sparse_layers * shape.experts_per_token if shape.experts else 0


def routing_record(shape, prompts: float, prefix: float, samples: float, completion: float) -> float:
    """A rollout's routing record on one rank: each prompt's tokens once, each sample's completion tokens."""
    return routing_bytes_per_token(shape) * (prompts * prefix + samples * completion)


def layer_expert_params(shape) -> int:
    """One sparse layer's routed-expert parameters: E x (gate, up, down) of hidden x moe_intermediate (0 if dense)."""
    return shape.experts * 3 * shape.hidden * shape.moe_intermediate if shape.sparse_layers else 0


def expert_params(shape) -> int:
    """The routed experts' parameters over all sparse layers."""
    return shape.sparse_layers * layer_expert_params(shape)


def expert_gather_bytes(shape, dtype_bytes: int, ranks: int, ep: int = 1) -> float:
    """Bytes one ZeRO-3 gather of every sparse layer's routed experts brings to a rank (a forward's, a backward's; a
    gradient reduce-scatter moves as many): all E experts partitioned over the world, what the other ranks hold
    (1 - 1 / world); under expert parallelism the rank's E / EP partitioned over its world / EP expert-data-parallel
    ranks (1 - EP / world of them). 0 for a dense model or one rank of the group."""
    return dtype_bytes * expert_params(shape) / ep * max(0.0, 1 - ep / ranks)


def exchange_bytes(shape, tokens: float, dtype_bytes: int, ep: int) -> float:
    """Bytes one rank sends in one pass (a forward; a backward sends as many) of expert parallelism's all-to-all
    over ``tokens`` of its tokens, all sparse layers: each token's k routed copies (its hidden state) to the ranks
    holding their experts and the k outputs back (dispatch and combine), the (EP - 1) / EP of them whose expert is
    on another rank when routing spreads evenly. 0 at EP = 1."""
    if ep <= 1 or not shape.sparse_layers:
        return 0.0
    return 2.0 * shape.sparse_layers * tokens * shape.experts_per_token * shape.hidden * dtype_bytes * (ep - 1) / ep


EXCHANGE_COLLECTIVES = 3  # per sparse layer and pass under EP: the counts' all-to-all, dispatch, combine (AutoEP)


def exchange_buffer(shape, tokens: float, dtype_bytes: int, ep: int) -> float:
    """Bytes expert parallelism's dispatch holds beside a sparse layer's computation: the k routed copies of the
    layer's tokens sent and as many received (a GUESS from AutoEP's code: not measured)."""
    return 2.0 * tokens * shape.experts_per_token * shape.hidden * dtype_bytes if ep > 1 and shape.sparse_layers \
        else 0.0


def bounded_keys(first: int, count: int, budget: int) -> float:
    """Keys attended to by ``count`` queries that see ``first`` + 1 .. ``first`` + ``count`` keys each, a query at most
    ``budget`` of them (QSA: its chosen blocks and the tail)."""
    full = max(0, min(first + count, budget) - first)  # queries below the budget see all they see
    return full * first + full * (full + 1) / 2 + (count - full) * budget


def qsa_work(shape, work, repeated: bool) -> tuple[float, float]:
    """(query-key pairs a QSA model's attention layers compute, with a kernel that reads only the chosen keys; the
    indexer's score FLOPs) of one forward over ``work``: a query attends to at most ``index_budget`` keys and scores
    every complete block it sees (index heads x index dim per block). The grouped row runs each prompt once, the
    repeated rows G times. Families of questions counted as their own prompts (the sharing of V aside)."""
    p, c, g, n = work.prefix, work.completion, work.group_size, work.groups
    budget, compress = shape.index_budget, shape.index_compress
    prompt, response = bounded_keys(0, p, budget), bounded_keys(p, c, budget)
    copies = g if repeated else 1
    pairs = n * (copies * prompt + g * response)
    scored = n * (copies * p * (p + 1) / 2 / compress + g * (c * p + c * (c + 1) / 2) / compress)
    return pairs, 2 * shape.index_heads * shape.index_dim * scored
