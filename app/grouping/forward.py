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
from dataclasses import dataclass

import torch

from app.grouping import attention
from app.grouping.families import check_shared_positions, family_layout
from app.grouping.layout import GroupLayout, LayoutError
from app.grouping.logprobs import CompletionScores, head_returns_logprobs
from app.grouping.modules import keeps_attention_unless_grad, set_text_attention, text_config, unwrap
from app.grouping.positions import (
    VISION_KEYS,
    check_max_positions,
    packed_positions,
    prompt_positions,
    rope_index_owner,
)
from app.grouping.precision import PrecisionComparison, compare_to_reference, float32_forward, parameter_dtype
from app.grouping.vision.calls import aligned_vision_calls

MODES = ("grouped", "repeated")
DEFAULT_CHUNK_SIZE = 1024  # completion tokens per output-head chunk: never [tokens, vocab] logits by default


class GroupingMismatchError(RuntimeError):
    """The grouped forward disagreed with the repeated forward beyond tolerance."""


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
             return_entropy, extra_forward_kwargs, chunk_size=0, vision=None):
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
              return_entropy, extra_forward_kwargs, chunk_size=0):
    set_text_attention(model, "sdpa")
    batch = repeated_inputs(model, prompts, completion_ids, completion_mask, layout.group_sizes)
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
    sharing = mode == "grouped" and families is not None and any(size > 1 for size in families)
    if sequence_parallel is not None and sequence_parallel.size > 1:
        if mode != "grouped" or return_logits or forward_kwargs:
            raise ValueError("the sequence-parallel forward is grouped only and returns log-probs (and entropy), "
                             f"not mode={mode!r}, return_logits={return_logits}, or {sorted(forward_kwargs)}")
        from app.grouping.sequence_parallel import sequence_parallel_scores

        return sequence_parallel_scores(model, prompts, completion_ids, completion_mask, group_sizes,
                                        sequence_parallel, backend=backend, temperature=temperature,
                                        return_entropy=return_entropy, vision_calls=vision_calls,
                                        chunk_size=chunk_size, families=families)
    layout, vision = family_layout(model, prompts, completion_mask, group_sizes, families if sharing else None)
    with aligned_vision_calls(model, prompts if vision is None else vision, vision_calls):
        settings = dict(temperature=temperature, return_logits=return_logits, return_entropy=return_entropy,
                        extra_forward_kwargs=forward_kwargs, chunk_size=chunk_size)
        if mode == "grouped":
            logprobs, logits, entropy = _grouped(model, prompts, completion_ids, layout, backend=backend,
                                                 vision=vision, **settings)
        else:
            logprobs, logits, entropy = _repeated(model, prompts, completion_ids, completion_mask, layout, **settings)
    return CompletionScores(logprobs=logprobs, mask=completion_mask.bool(), logits=logits, layout=layout,
                            entropy=entropy)


@dataclass
class SelfCheck:
    """Outcome of ``verify_grouping``: what was compared and by how much."""

    dtype: torch.dtype
    max_diff: float  # max |grouped - repeated| log-prob
    comparison: PrecisionComparison | None = None  # low precision: both layouts against float32

    def describe(self) -> str:
        text = f"{self.dtype}: max |grouped - repeated| log-prob {self.max_diff:.3g}"
        return f"{text}; {self.comparison.describe()}" if self.comparison is not None else text


SELF_CHECK_COMPLETION_TOKENS = 32


def text_before_media(model, prompts, completion_ids, completion_mask,
                      completion_tokens: int = SELF_CHECK_COMPLETION_TOKENS):
    """A short batch cut from a micro-batch for a self-check that must fit on one rank (sequence parallelism: the
    whole row needs S ranks): each prompt up to its first image or video (the chat preamble and any text before the
    media), each completion's first ``completion_tokens`` tokens. Checks the grouped layout, positions, attention
    backend and dtype on this model; not the vision tower. Returns (prompts, completion_ids, completion_mask)."""
    config = unwrap(model).config
    start = getattr(config, "vision_start_token_id", None)
    rows = []
    for ids, mask in zip(prompts["input_ids"], prompts["attention_mask"]):
        real = ids[mask.bool()]
        cut = (real == start).nonzero() if start is not None else real.new_zeros(0, 1)
        rows.append(real[: int(cut[0, 0])] if len(cut) else real)
    width = max(len(r) for r in rows)
    padded = prompts["input_ids"][prompts["attention_mask"] == 0]
    pad = int(padded[0]) if padded.numel() else 0  # the batch's own pad id
    input_ids = prompts["input_ids"].new_full((len(rows), width), pad)
    attention = prompts["attention_mask"].new_zeros((len(rows), width))
    for b, row in enumerate(rows):  # left-padded, as the processor pads
        input_ids[b, width - len(row):] = row
        attention[b, width - len(row):] = 1
    cut_prompts = {"input_ids": input_ids, "attention_mask": attention}
    if "mm_token_type_ids" in prompts:
        cut_prompts["mm_token_type_ids"] = torch.zeros_like(input_ids)
    keep = min(completion_tokens, completion_ids.shape[1])
    return cut_prompts, completion_ids[:, :keep], completion_mask[:, :keep]


def verify_grouping(model, prompts, completion_ids, completion_mask, group_sizes, *, backend: str | None = None,
                    rtol: float = 1e-4, atol: float = 1e-5, families: Sequence[int] | None = None) -> SelfCheck:
    """Run both layouts on one batch; raise GroupingMismatchError when grouped is wrong. Returns a ``SelfCheck``.

    float32 parameters: grouped and repeated must agree per token within ``atol + rtol * |log-prob|``.
    Lower precision (bf16, fp16): both are roundings of one function, so both are compared with a float32 forward
    of the same weights (``precision.float32_forward``) and grouped must be no worse than repeated
    (``precision.MEAN_RATIO`` / ``MAX_RATIO``). Costs one repeated forward (two in low precision), once.
    ``families``: the grouped side packs them as ``completion_logprobs`` does (questions sharing a video).
    """
    previous = text_config(model)._attn_implementation
    dtype = parameter_dtype(model)
    chosen = backend or attention.default_backend(completion_ids.device)
    try:
        with torch.no_grad():
            grouped = completion_logprobs(model, prompts, completion_ids, completion_mask, group_sizes, "grouped",
                                          backend=backend, families=families).logprobs.float()
            repeated = completion_logprobs(model, prompts, completion_ids, completion_mask, group_sizes,
                                           "repeated").logprobs.float()
            comparison = None
            if dtype != torch.float32:
                with float32_forward(model):
                    reference = completion_logprobs(model, prompts, completion_ids, completion_mask, group_sizes,
                                                    "repeated").logprobs
                comparison = compare_to_reference(grouped, repeated, reference, completion_mask)
    finally:
        set_text_attention(model, previous)
    diff = (grouped - repeated).abs()
    result = SelfCheck(dtype, float(diff.max()), comparison)
    where = f"backend={chosen}, model={type(unwrap(model)).__name__}, dtype={dtype}"
    if comparison is not None:
        if not comparison.passes():
            raise GroupingMismatchError(
                f"grouped log-probs are further from a float32 forward of the same weights than repeated ones: "
                f"{comparison.describe()} ({where})." + _diagnosis(model, prompts, completion_ids, completion_mask,
                                                                 group_sizes, backend=backend, families=families,
                                                                 dtype=dtype))
        return result
    bound = atol + rtol * repeated.abs()
    if bool((diff > bound).any()):
        n, j = divmod(int((diff - bound).argmax()), diff.shape[1])
        raise GroupingMismatchError(
            f"grouped and repeated log-probs differ by {float(diff.max()):.3g} (completion {n}, token {j}; "
            f"rtol={rtol}, atol={atol}; {where})." + _diagnosis(model, prompts, completion_ids, completion_mask,
                                                              group_sizes, backend=backend, families=families,
                                                              dtype=dtype))
    return result


def _diagnosis(model, prompts, completion_ids, completion_mask, group_sizes, *, backend, families, dtype) -> str:
    """After a failed check: which layer kind differed (each decoder layer's token mixer compared at the completion
    tokens, ``precision.differing_layers``) and the advice that fits it."""
    from app.grouping.precision import describe_layers, differing_layers

    previous = text_config(model)._attn_implementation
    sharing = families is not None and any(size > 1 for size in families)
    layout = family_layout(model, prompts, completion_mask, group_sizes, families if sharing else None)[0]
    try:
        with torch.no_grad():
            found = differing_layers(
                model,
                lambda: completion_logprobs(model, prompts, completion_ids, completion_mask, group_sizes, "grouped",
                                            backend=backend, families=families),
                lambda: completion_logprobs(model, prompts, completion_ids, completion_mask, group_sizes, "repeated"),
                layout, prompts["input_ids"].shape[1])
    except Exception as error:  # the diagnosis must never hide the mismatch itself
        found, text = [], f" (the layer-by-layer diagnosis failed: {error})"
    else:
        text = ""
    finally:
        set_text_attention(model, previous)
    sentence, kind = describe_layers(found, dtype)
    if kind == "linear_attention":
        advice = (" The attention backend cannot change a Gated DeltaNet layer: its segments' recurrent states or "
                  "conv inputs were handed on wrongly (app.grouping.recurrent). Train with forward.grouping=repeated "
                  "until it is fixed, or skip this check only if you accept training on log-probs that may be wrong.")
    else:
        advice = (" Try backend 'masked' (the plain reference backend) to tell a backend fault from a layout fault; "
                  "skip this check only if you accept training on log-probs that may be wrong.")
    return sentence + text + advice
