"""Per-token completion log-probs from ONE packed row per batch (grouped) or from [P;Ri] rows (repeated).

Both modes take the same inputs, so every caller can A/B them:
- prompts: a processor's output for B prompts (``input_ids``, ``attention_mask`` left-padded, and for VL models
  ``mm_token_type_ids`` plus the vision tensors, given once per prompt);
- completions: ``completion_ids`` / ``completion_mask`` [N, Lc], right-padded, N = sum(group_sizes), groups in
  prompt order.

``grouped`` runs the vision tower once per prompt and every prefix token once; ``repeated`` is the ordinary
batch: each completion gets its own row [P;Ri] with its own copy of the prompt and of its video.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from app.grouping import attention
from app.grouping.experts.patch import install as install_routing
from app.grouping.experts.plan import ROUTER_STATISTICS, Routed
from app.grouping.experts.record import Routing, check_routing
from app.grouping.experts.statistics import token_repeats
from app.grouping.families import check_shared_positions, family_layout
from app.grouping.layout import GroupLayout, LayoutError, normalize_group_sizes
from app.grouping.logprobs import CompletionScores, head_returns_logprobs
from app.grouping.modules import keeps_attention_unless_grad, set_text_attention, text_config, unwrap
from app.grouping.positions import (
    VISION_KEYS,
    check_max_positions,
    packed_positions,
    prompt_positions,
    rope_index_owner,
)
from app.grouping.vision.calls import aligned_vision_calls

MODES = ("grouped", "repeated")
DEFAULT_CHUNK_SIZE = 1024  # completion tokens per output-head chunk: never [tokens, vocab] logits by default


def split_vision_inputs(model, prompts: Mapping) -> list[dict]:
    """Cut the batch's vision tensors into per-prompt pieces, checking tokens against features."""
    from app.grouping.media import expanded

    prompts = expanded(prompts)
    ids = prompts["input_ids"]
    per_prompt = [dict() for _ in range(ids.shape[0])]
    config = unwrap(model).config
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", 2)
    for kind, token_key, pixel_key, grid_key in (
        ("image", "image_token_id", "pixel_values", "image_grid_thw"),
        ("video", "video_token_id", "pixel_values_videos", "video_grid_thw"),
    ):
        grid = prompts.get(grid_key)
        if grid is None:
            continue
        pixels = prompts[pixel_key]
        tokens_per_item = (grid.prod(-1) // (merge * merge)).tolist()
        patches_per_item = grid.prod(-1).tolist()
        token_id = getattr(config, token_key)
        item, patch = 0, 0
        for b in range(ids.shape[0]):
            need = int((ids[b][prompts["attention_mask"][b].bool()] == token_id).sum())
            first_item, first_patch = item, patch
            have = 0
            while have < need and item < len(tokens_per_item):
                have += tokens_per_item[item]
                patch += patches_per_item[item]
                item += 1
            if have != need:
                raise LayoutError(
                    f"prompt {b} has {need} {kind} tokens but its {kind} features give {have}; the {grid_key} rows "
                    "do not match the prompts' placeholder tokens"
                )
            if item > first_item:
                per_prompt[b][pixel_key] = pixels[first_patch:patch]
                per_prompt[b][grid_key] = grid[first_item:item]
                if kind == "video" and prompts.get("second_per_grid_ts") is not None:
                    per_prompt[b]["second_per_grid_ts"] = prompts["second_per_grid_ts"][first_item:item]
        if item != len(tokens_per_item):
            raise LayoutError(f"{len(tokens_per_item) - item} {kind}(s) in {grid_key} have no placeholder tokens")
    return per_prompt


def _vision_kwargs(prompts: Mapping) -> dict:
    """The batch's vision tensors as the model's own forward takes them (a copy per occurrence)."""
    from app.grouping.media import expanded

    prompts = expanded(prompts)
    return {k: prompts[k] for k in VISION_KEYS if prompts.get(k) is not None}


def _logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                          entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` under softmax(logits / temperature), and optionally each row's entropy."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, targets[..., None]).squeeze(-1)
    if not entropy:
        return chosen, None
    with torch.no_grad():
        return chosen, -(logp.exp() * logp).sum(-1)


def _head_logprobs(model, forward, targets, select, *, temperature, chunk_size, return_entropy):
    """Run ``forward()`` with the output head returning (log-prob, entropy) chunk by chunk: [..., 2]."""
    with head_returns_logprobs(unwrap(model), targets, select, temperature, chunk_size, return_entropy):
        return forward().logits


def _grouped(model, prompts, completion_ids, layout: GroupLayout, *, backend, temperature, return_logits,
             return_entropy, extra_forward_kwargs, chunk_size=0, vision=None, routed: Routed | None = None):
    device = completion_ids.device
    set_text_attention(model, attention.ATTENTION_NAME)
    plan = attention.GroupedAttentionPlan(layout, backend or attention.default_backend(device))
    input_ids = layout.pack(prompts["input_ids"], completion_ids)[None]
    prompt_pos = prompt_positions(unwrap(model), prompts["input_ids"], prompts["attention_mask"], prompts)
    if layout.shares:
        check_shared_positions(layout, prompt_pos)
    position_ids = packed_positions(layout, prompt_pos)
    check_max_positions(position_ids, getattr(text_config(model), "max_position_embeddings", None), layout)
    if position_ids.shape[0] == 1:
        position_ids = position_ids[0]
    kwargs = dict(vision) if vision is not None else _vision_kwargs(prompts)
    if prompts.get("mm_token_type_ids") is not None:
        kwargs["mm_token_type_ids"] = layout.pack(
            prompts["mm_token_type_ids"], torch.zeros_like(completion_ids))[None]
    predict = layout.predict_index.to(device)
    targets = completion_ids.flatten().index_select(0, layout.target_index.to(device))
    if routed is not None and routed.shape is not None:
        kwargs.update(routed.plan_for(routed.replay.for_packed(layout) if routed.replay is not None else None,
                                      token_repeats(layout).to(device)))

    def forward():
        return model(input_ids=input_ids, attention_mask=None, position_ids=position_ids, use_cache=False,
                     logits_to_keep=predict, **{attention.PLAN_KWARG: plan}, **kwargs, **extra_forward_kwargs)

    if chunk_size and not return_logits:
        both = _head_logprobs(model, forward, targets, None, temperature=temperature, chunk_size=chunk_size,
                              return_entropy=return_entropy)[0]
        chosen, entropy = both[:, 0], both[:, 1].detach()
        return (layout.unpack_completion_tokens(chosen), None,
                layout.unpack_completion_tokens(entropy) if return_entropy else None)
    logits = forward().logits[0]  # [K, V]
    chosen, entropy = _logprobs_from_logits(logits, targets, temperature, return_entropy)
    logprobs = layout.unpack_completion_tokens(chosen)
    full_logits = layout.unpack_completion_tokens(logits) if return_logits else None
    return logprobs, full_logits, layout.unpack_completion_tokens(entropy) if return_entropy else None


def repeated_inputs(model, prompts: Mapping, completion_ids, completion_mask, group_sizes: Sequence[int]) -> dict:
    """The ordinary batch: row n = [prompt of n's group ; completion n], vision inputs copied per row."""
    group = torch.repeat_interleave(torch.arange(len(group_sizes)), torch.tensor(group_sizes)).to(completion_ids.device)
    batch = {
        "input_ids": torch.cat([prompts["input_ids"][group], completion_ids], dim=1),
        "attention_mask": torch.cat([prompts["attention_mask"][group], completion_mask.to(prompts["attention_mask"].dtype)], dim=1),
    }
    if prompts.get("mm_token_type_ids") is not None:
        batch["mm_token_type_ids"] = torch.cat(
            [prompts["mm_token_type_ids"][group], torch.zeros_like(completion_ids)], dim=1)
    if _vision_kwargs(prompts):
        pieces = split_vision_inputs(model, prompts)
        for key in VISION_KEYS:
            parts = [pieces[g][key] for g in group.tolist() if key in pieces[g]]
            if parts:
                batch[key] = torch.cat(parts)
    return batch


def _repeated(model, prompts, completion_ids, completion_mask, layout: GroupLayout, *, temperature, return_logits,
              return_entropy, extra_forward_kwargs, chunk_size=0, routed: Routed | None = None):
    set_text_attention(model, "sdpa")
    batch = repeated_inputs(model, prompts, completion_ids, completion_mask, layout.group_sizes)
    if routed is not None and routed.shape is not None:
        extra_forward_kwargs = {**extra_forward_kwargs, **routed.plan_for(
            routed.replay.for_repeated(layout.group_sizes) if routed.replay is not None else None,
            batch["attention_mask"].flatten().float())}
    if rope_index_owner(unwrap(model)) is None:
        batch["position_ids"] = (batch["attention_mask"].long().cumsum(-1) - 1).clamp_min(0)
    else:  # the ids of [P;Ri] placed as Qwen places them (positions.continue_after_media), not as transformers 5.x does
        batch["position_ids"] = prompt_positions(unwrap(model), batch["input_ids"], batch["attention_mask"], batch)
    width = completion_ids.shape[1]
    mask = completion_mask.bool()

    def forward():
        return model(**batch, use_cache=False, logits_to_keep=width + 1, **extra_forward_kwargs)

    if chunk_size and not return_logits:
        select = torch.cat([mask, mask.new_zeros(mask.shape[0], 1)], dim=1)  # the last kept position predicts nothing
        both = _head_logprobs(model, forward, completion_ids[mask], select, temperature=temperature,
                              chunk_size=chunk_size, return_entropy=return_entropy)[:, :-1]
        return both[..., 0], None, both[..., 1].detach() if return_entropy else None
    logits = forward().logits[:, :-1]  # [N, Lc, V]: position Lp-1+j predicts completion token j
    chosen, entropy = _logprobs_from_logits(logits, completion_ids, temperature, return_entropy)
    logprobs = chosen.masked_fill(~mask, 0.0)
    full_logits = logits.masked_fill(~mask[..., None], 0.0) if return_logits else None
    return logprobs, full_logits, entropy.masked_fill(~mask, 0.0) if return_entropy else None


def _refuse_placeholders_in_completions(model, completion_ids, completion_mask) -> None:
    config = unwrap(model).config
    for name in ("image_token_id", "video_token_id"):
        token = getattr(config, name, None)
        if token is None:
            continue
        hits = ((completion_ids == token) & completion_mask.bool()).nonzero()
        if len(hits):
            raise LayoutError(
                f"completion {int(hits[0, 0])} contains the {name.split('_')[0]} placeholder token {token} at "
                f"position {int(hits[0, 1])}; the model would take it for vision input (sample with it suppressed)"
            )


@keeps_attention_unless_grad
def completion_logprobs(
    model,
    prompts: Mapping[str, torch.Tensor],
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    group_sizes: int | Sequence[int],
    mode: str = "grouped",
    *,
    backend: str | None = None,
    temperature: float = 1.0,
    return_logits: bool = False,
    vision_calls: Sequence[str] | None = None,
    return_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    sequence_parallel=None,
    families: Sequence[int] | None = None,
    routing: Routing | None = None,
    router_statistics: str = "off",
    record_routing: bool = False,
    **forward_kwargs,
) -> CompletionScores:
    """Log-probs of each completion token given its prompt, through the grouped or the repeated layout.

    Differentiable: call ``.backward()`` on any function of the result. Keep the model's attention setting
    unchanged until that backward has finished (activation checkpointing recomputes through it), then restore it
    (``modules.attention_restored`` around forward and backward). Without gradients the setting is restored
    before returning.
    ``vision_calls``: the vision-tower calls this forward must make even if its prompts lack that modality (the
    union over ranks under ZeRO-3; see ``vision_calls.aligned_vision_calls``); None makes only the calls needed.
    ``chunk_size`` > 0 (the default, 1024): the output head computes the target log-probs ``chunk_size`` tokens at a
    time and never holds [tokens, vocab] logits (``logprobs.head_returns_logprobs``); same numbers; ignored when
    ``return_logits``. 0 computes full logits as transformers does ([tokens, 151,936] float32 at Qwen's vocabulary).
    ``sequence_parallel``: a ``sequence_parallel.SequenceParallel`` of size > 1 spreads the packed row over its
    ranks (grouped mode only; every rank of it passes the same inputs and gets the same scores); None or size 1:
    this rank alone.
    ``families``: runs of consecutive prompts that may share their first tokens (questions on one video,
    ``families.family_sizes``): grouped mode packs each run as [V; Q1; R1*; Q2; R2*; ...] with V (what they really
    share: ``families.shared_prefix_lengths``) and its media once; the same numbers as without, sequence-parallel
    too (the family's row is sharded like any other). None: none share.
    Repeated mode ignores it (its rows are [P;Ri] either way).
    Mixture-of-experts models (``experts``; ignored by a dense model): ``routing`` (a ``Routing``) routes every
    token to its recorded experts (the gate weights recomputed over them from the current router); checked first
    (``experts.record.check_routing``: a token without a record stops it, naming the prompt).
    ``router_statistics``: ``metrics`` or ``loss`` (differentiable probabilities) returns the router's sums per
    sparse layer over the repeated layout's tokens (``scores.router``: a shared prompt token counts once per
    response, the same numbers in both modes). ``record_routing`` returns the experts each token went to
    (``scores.routing``: a ``Routing``).
    """
    if mode not in MODES:
        raise ValueError(f"unknown grouping mode {mode!r}; expected one of {MODES}")
    for key in ("input_ids", "attention_mask"):
        if key not in prompts:
            raise LayoutError(f"prompts lack {key!r}")
    if prompts["input_ids"].shape != prompts["attention_mask"].shape:
        raise LayoutError(
            f"prompt input_ids {tuple(prompts['input_ids'].shape)} and attention_mask "
            f"{tuple(prompts['attention_mask'].shape)} differ in shape"
        )
    if completion_ids.shape != completion_mask.shape:
        raise LayoutError(
            f"completion_ids {tuple(completion_ids.shape)} and completion_mask {tuple(completion_mask.shape)} "
            "differ in shape"
        )
    _refuse_placeholders_in_completions(model, completion_ids, completion_mask)
    if router_statistics not in ROUTER_STATISTICS:
        raise ValueError(f"unknown router_statistics {router_statistics!r}; expected one of {ROUTER_STATISTICS}")
    routed = Routed(routing, router_statistics, record_routing)
    if routed.wanted:
        routed.shape = install_routing(model)
        if routed.shape is None and routing is not None:
            raise LayoutError(f"a routing record was given, but {type(unwrap(model)).__name__} has no sparse layers")
        if routing is not None:
            sizes = normalize_group_sizes(group_sizes, prompts["input_ids"].shape[0], completion_ids.shape[0])
            check_routing(routing, routed.shape, prompts["attention_mask"], completion_mask, group_sizes=sizes)
    sharing = mode == "grouped" and families is not None and any(size > 1 for size in families)
    if sequence_parallel is not None and sequence_parallel.size > 1:
        if mode != "grouped" or return_logits or forward_kwargs:
            raise ValueError("the sequence-parallel forward is grouped only and returns log-probs (and entropy), "
                             f"not mode={mode!r}, return_logits={return_logits}, or {sorted(forward_kwargs)}")
        from app.grouping.sequence_parallel import sequence_parallel_scores

        return sequence_parallel_scores(model, prompts, completion_ids, completion_mask, group_sizes,
                                        sequence_parallel, backend=backend, temperature=temperature,
                                        return_entropy=return_entropy, vision_calls=vision_calls,
                                        chunk_size=chunk_size, families=families, routed=routed)
    layout, vision = family_layout(model, prompts, completion_mask, group_sizes, families if sharing else None)
    with aligned_vision_calls(model, prompts if vision is None else vision, vision_calls):
        settings = dict(temperature=temperature, return_logits=return_logits, return_entropy=return_entropy,
                        extra_forward_kwargs=forward_kwargs, chunk_size=chunk_size)
        if mode == "grouped":
            logprobs, logits, entropy = _grouped(model, prompts, completion_ids, layout, backend=backend,
                                                 vision=vision, routed=routed, **settings)
            to_record = lambda ids: Routing.from_packed(layout, ids, routed.shape.layers)  # noqa: E731
        else:
            logprobs, logits, entropy = _repeated(model, prompts, completion_ids, completion_mask, layout,
                                                  routed=routed, **settings)
            to_record = lambda ids: Routing.from_repeated(  # noqa: E731
                ids, prompts["input_ids"].shape[1], layout.group_sizes, routed.shape.layers,
                prompts["attention_mask"], completion_mask)
    router, recorded, gap = routed.results(to_record)
    return CompletionScores(logprobs=logprobs, mask=completion_mask.bool(), logits=logits, layout=layout,
                            entropy=entropy, router=router, routing=recorded, tie_gap=gap,
                            replay_differs=routed.replay_differs())
