"""The self-check: grouped against repeated on one batch of the run's own data, before training on it.

- ``verify_grouping``: both layouts on one batch; float32 must agree per token, lower precision is judged against a
  float32 forward of the same weights (``precision``); a failure names the layer kind that differed first.
- ``text_before_media``: the batch a self-check can take on one rank under sequence parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.grouping import attention
from app.grouping.checks.positions import position_mismatch, recorded_positions
from app.grouping.checks.sparse import choices_mismatch, recorded_choices
from app.grouping.checks.visibility import recorded_mixers, sources_mismatch
from app.grouping.families import family_layout
from app.grouping.forward import completion_logprobs
from app.grouping.modules import set_text_attention, text_config, unwrap
from app.grouping.precision import PrecisionComparison, compare_to_reference, float32_forward, parameter_dtype


class GroupingMismatchError(RuntimeError):
    """The grouped forward disagreed with the repeated forward beyond tolerance."""


@dataclass
class SelfCheck:
    """Outcome of ``verify_grouping``: what was compared and by how much."""

    dtype: torch.dtype
    max_diff: float  # max |grouped - repeated| log-prob
    comparison: PrecisionComparison | None = None  # low precision: both layouts against float32
    flips: dict | None = None  # mixture of experts: ``routing.disagreements`` of the two layouts' free routing
    replayed: bool = False  # compared again with the repeated layout routed as the grouped one was
    choice_ties: int = 0  # QSA: completion tokens that chose other keys in the two layouts within a tie (bf16)

    def describe(self) -> str:
        text = f"{self.dtype}: max |grouped - repeated| log-prob {self.max_diff:.3g}"
        text = f"{text}; {self.comparison.describe()}" if self.comparison is not None else text
        text = f"{text}; {self.choice_ties} QSA choices differed within a tie" if self.choice_ties else text
        if self.flips is None:
            return text
        return f"{text}; {self.routing()}" + (" (rounding near router ties)" if self.replayed else "")

    def routing(self) -> str:
        return (f"routing: {self.flips['tokens']} of {self.flips['real_tokens']} tokens met other experts in the two "
                "layouts" + (", compared again with the repeated layout routed as the grouped one was"
                             if self.replayed else ""))


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
    Mixture of experts: both layouts record their routing. Where the comparison fails and tokens met other experts
    in the two (a router near a tie, rounded differently), it runs again with the repeated layout (and the float32
    reference) routed as the grouped one was; it passes then only if every overruled choice was a near-tie
    (``routing.tie_gap`` within ``routing.TIE_GAP``). ``SelfCheck.flips`` says how many tokens flipped.
    ``families``: the grouped side packs them as ``completion_logprobs`` does (questions sharing a video).
    """
    from app.grouping.checks.routing import disagreements, first_difference
    from app.grouping.experts.blocks import expert_shape
    from app.grouping.experts.plan import TIE_GAP

    previous = text_config(model)._attn_implementation
    dtype = parameter_dtype(model)
    chosen = backend or attention.default_backend(completion_ids.device)
    moe = expert_shape(model) is not None
    record = {"record_routing": True} if moe else {}
    try:
        with torch.no_grad(), recorded_positions(model) as positions, recorded_mixers(model) as mixers:
            with recorded_choices(model) as choices:
                grouped = completion_logprobs(model, prompts, completion_ids, completion_mask, group_sizes, "grouped",
                                              backend=backend, families=families, **record)
            batch = (prompts, completion_ids, completion_mask, group_sizes)
            with recorded_choices(model) as repeated_choices:
                outcome = _against_repeated(model, batch, grouped, dtype=dtype, rtol=rtol, atol=atol, routing=record)
        shifted = position_mismatch(positions[0], positions[1], grouped.layout, prompts["input_ids"].shape[1]) \
            if len(positions) >= 2 else None
        if shifted is not None:  # integers: exact at every dtype, before any numeric comparison
            raise GroupingMismatchError(f"grouped and repeated positions differ: {shifted} (model="
                                        f"{type(unwrap(model)).__name__}); the grouped row's positions are wrong "
                                        "(app.grouping.positions). Train with forward.grouping=repeated until it is "
                                        "fixed.")
        with torch.no_grad():
            reached = sources_mismatch(mixers, positions, prompts, completion_ids, completion_mask, group_sizes,
                                       layout=grouped.layout)
        if reached is not None:  # sets of tokens: exact at every dtype, before any numeric comparison
            text, kind = reached
            raise GroupingMismatchError(f"grouped and repeated layouts differ in who sees whom: {text} (model="
                                        f"{type(unwrap(model)).__name__}, backend={chosen}, dtype={dtype})."
                                        + _advice(kind))
        chose, ties = choices_mismatch(choices, repeated_choices, grouped.layout, prompts["input_ids"].shape[1],
                                       completion_mask, exact=dtype == torch.float32)
        if chose is not None:  # QSA's keys and PLE's n-grams: exact (ties aside below float32)
            raise GroupingMismatchError(f"grouped and repeated layouts differ in what a sparse layer reads: {chose} "
                                        f"(model={type(unwrap(model)).__name__}, dtype={dtype})."
                                        + _advice("indexed_attention"))
        with torch.no_grad():
            flips = disagreements(grouped.routing, outcome[3].routing, prompts["attention_mask"],
                                  completion_mask) if moe else None
            replayed = bool(flips and flips["tokens"]) and outcome[2] is not None
            outcome_free = outcome[3]  # the repeated layout's own routing, before any replay
            if replayed:  # a router near a tie in one layout only: route repeated (and float32) as grouped did
                outcome = _against_repeated(model, batch, grouped, dtype=dtype, rtol=rtol, atol=atol,
                                            routing={"routing": grouped.routing})
    finally:
        set_text_attention(model, previous)
    diff, comparison, failure, repeated = outcome
    if failure is None and replayed and repeated.tie_gap > TIE_GAP:  # not near-ties: the grouped routing is wrong
        where = first_difference(grouped.routing, outcome_free.routing, prompts["attention_mask"], completion_mask)
        failure = (f"the grouped layout routed tokens to experts the repeated layout's routers rank well below their "
                   f"own top-k (a gap of {repeated.tie_gap:.3g} logit standard deviations; rounding near a tie stays "
                   f"within {TIE_GAP}; the first token routed apart: {where}, grouped and repeated; a mixture-of-"
                   "experts router layer)")
    result = SelfCheck(dtype, float(diff.max()), comparison, flips, replayed, ties)
    if failure is None:
        return result
    where = f"backend={chosen}, model={type(unwrap(model)).__name__}, dtype={dtype}"
    routed = f" The {result.routing()}." if flips is not None else ""
    raise GroupingMismatchError(f"{failure} ({where}).{routed}" + _diagnosis(
        model, prompts, completion_ids, completion_mask, group_sizes, backend=backend, families=families, dtype=dtype))


def _against_repeated(model, batch, grouped, *, dtype, rtol, atol, routing: dict):
    """The repeated layout (and, below float32, a float32 forward) against the grouped log-probs: (|difference|,
    the precision comparison or None, what failed or None, the repeated scores). ``batch``: (prompts, completion
    ids, completion mask, group sizes); ``routing``: record or replay."""
    prompts, completion_ids, completion_mask, group_sizes = batch
    mine = grouped.logprobs.float()
    repeated = completion_logprobs(model, prompts, completion_ids, completion_mask, group_sizes, "repeated",
                                   **routing)
    theirs = repeated.logprobs.float()
    diff = (mine - theirs).abs()
    if dtype != torch.float32:
        replay = {"routing": routing["routing"]} if "routing" in routing else {}
        with float32_forward(model):
            reference = completion_logprobs(model, prompts, completion_ids, completion_mask, group_sizes,
                                            "repeated", **replay).logprobs
        comparison = compare_to_reference(mine, theirs, reference, completion_mask)
        failure = None if comparison.passes() else (
            "grouped log-probs are further from a float32 forward of the same weights than repeated ones: "
            f"{comparison.describe()}")
        return diff, comparison, failure, repeated
    bound = atol + rtol * theirs.abs()
    if not bool((diff > bound).any()):
        return diff, None, None, repeated
    n, j = divmod(int((diff - bound).argmax()), diff.shape[1])
    return diff, None, (f"grouped and repeated log-probs differ by {float(diff.max()):.3g} (completion {n}, token "
                        f"{j}; rtol={rtol}, atol={atol}"), repeated


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
    return sentence + text + _advice(kind)


def _advice(kind: str) -> str:
    """What to do after a failure that a layer of ``kind`` caused."""
    if kind == "linear_attention":
        return (" The attention backend cannot change a Gated DeltaNet layer: its segments' recurrent states or "
                "conv inputs were handed on wrongly (app.grouping.recurrent). Train with forward.grouping=repeated "
                "until it is fixed, or skip this check only if you accept training on log-probs that may be wrong.")
    if kind == "indexed_attention":
        return (" The attention backend does not run a QSA or PLE layer: a query's visible keys, blocks or n-gram "
                "context came from the wrong path (app.grouping.sparse, app.grouping.recurrent.ngrams). Train with "
                "forward.grouping=repeated until it is fixed, or skip this check only if you accept training on "
                "log-probs that may be wrong.")
    if kind in ("router", "experts"):
        return (" The attention backend cannot change a router or its experts, which see one token at a time: that "
                "part computed differently in the grouped row (app.grouping.experts). Train with "
                "forward.grouping=repeated until it is fixed, or skip this check only if you accept training on "
                "log-probs that may be wrong.")
    return (" Try backend 'masked' (the plain reference backend) to tell a backend fault from a layout fault; "
            "skip this check only if you accept training on log-probs that may be wrong.")
