"""bfloat16 on CPU: grouped is judged against a float32 forward of the same weights, never against repeated alone.

Criterion (``app.grouping.precision``): over the completion tokens, grouped-bf16's mean and max log-prob error
against float32 are at most MEAN_RATIO / MAX_RATIO times repeated-bf16's; per parameter, grouped's gradient error
(norm of the difference over norm of the float32 gradient) is at most GRAD_RATIO times repeated's plus GRAD_FLOOR,
bfloat16's unit roundoff (``grad_excess``).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from app.grouping import (
    GroupingMismatchError,
    compare_to_reference,
    completion_logprobs,
    float32_forward,
    usable_backends,
    verify_grouping,
)
from app.grouping.precision import MAX_RATIO, MEAN_RATIO
from app.rollout.generate import SamplingConfig, generate_groups
from app.runtime.models import FAMILIES, HYBRID_FAMILIES, QSA_FAMILIES
from tests.helpers import load, prompt_batch, random_completions, tokenizer_of
from tests.test_equivalence import PROMPT_KINDS

# the bf16 self-check's probes on QSA layers (selections, n-gram windows) are not built: qwen4_exp is checked in
# float32 (tests/test_qsa.py)
ATTENTION_FAMILIES = [f for f in FAMILIES if f not in QSA_FAMILIES]

GRAD_RATIO = 1.5
# bfloat16's unit roundoff (8 significant bits): the error that storing a gradient in bf16 alone can carry, apart
# from either layout's arithmetic. Without it the bound was a ratio of two errors of a few roundoffs each, and the
# worst of ~60 tensors moved across it with the CPU's matmul kernels alone: Qwen3-VL's k_norm.weight at 1.29x with
# oneDNN capped at AVX512-BF16 (the worst tensor 1.49x), 1.66x on AMX (repeated's own error: 0.0149, 0.0119).
GRAD_FLOOR = 2.0 ** -8


def bf16_rounded(family, checkpoints):
    """(float32 model, bfloat16 model) holding the same values: the bf16 weights upcast exactly."""
    model, processor = load(family, checkpoints)
    model32 = model.to(torch.bfloat16).float()
    return model32, copy.deepcopy(model32).to(torch.bfloat16), processor


def case(family, processor, videos, seed=1):
    rng = random.Random(seed)
    prompts = prompt_batch(family, processor, videos, PROMPT_KINDS[family])
    for key in ("pixel_values", "pixel_values_videos"):  # the bf16 model rounds its pixels; give both the same
        if key in prompts:
            prompts[key] = prompts[key].to(torch.bfloat16).float()
    group_sizes = [1, 3, 4]
    lengths = [rng.randint(1, 20) for _ in range(sum(group_sizes))]
    tok = tokenizer_of(processor)
    ids, mask = random_completions(lengths, len(tok), tok.pad_token_id, seed=seed)
    return prompts, ids, mask, group_sizes


def forward_backward(model, prompts, ids, mask, group_sizes, mode, backend=None):
    model.zero_grad(set_to_none=True)
    scores = completion_logprobs(model, prompts, ids, mask, group_sizes, mode=mode, backend=backend)
    weights = torch.linspace(0.5, 1.5, ids.shape[1])[None, :]
    (scores.logprobs.float() * weights).sum().backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return scores.logprobs.detach().float(), grads


@pytest.fixture(scope="module", params=FAMILIES)
def family_runs(request, tiny_checkpoints, videos):
    family = request.param
    model32, model16, processor = bf16_rounded(family, tiny_checkpoints)
    prompts, ids, mask, sizes = case(family, processor, videos)
    reference = forward_backward(model32, prompts, ids, mask, sizes, "repeated")
    repeated = forward_backward(model16, prompts, ids, mask, sizes, "repeated")
    return family, model16, (prompts, ids, mask, sizes), reference, repeated


def grad_error(grads, reference):
    return {n: float((grads[n] - reference[n]).norm() / reference[n].norm().clamp_min(1e-30)) for n in reference}


def grad_excess(grads, other, reference) -> tuple[str, float, float, float]:
    """The parameter whose gradient error against ``reference`` (float32) most exceeds the bound that ``other``'s
    (a bf16 layout's own) sets: GRAD_RATIO x its error + GRAD_FLOOR. (name, excess: > 0 fails, error, other's)."""
    ours, theirs = grad_error(grads, reference), grad_error(other, reference)
    excess = {n: ours[n] - GRAD_RATIO * theirs[n] - GRAD_FLOOR for n in reference}
    worst = max(excess, key=excess.get)
    return worst, excess[worst], ours[worst], theirs[worst]


@pytest.mark.parametrize("backend", usable_backends("cpu"))
def test_bf16_grouped_no_worse_than_repeated(family_runs, backend):
    family, model16, (prompts, ids, mask, sizes), (ref_lp, ref_grads), (rep_lp, rep_grads) = family_runs
    lp, grads = forward_backward(model16, prompts, ids, mask, sizes, "grouped", backend)
    comparison = compare_to_reference(lp, rep_lp, ref_lp, mask)
    print(f"\n{family} {backend}: {comparison.describe()}")
    assert comparison.repeated_mean > 1e-4  # bf16 really rounds: the reference is not trivially equal
    assert comparison.passes(), comparison.describe()
    assert set(grads) == set(ref_grads) == {n for n, p in model16.named_parameters() if p.requires_grad}
    worst, excess, ours, theirs = grad_excess(grads, rep_grads, ref_grads)
    print(f"   gradients: nearest the bound {worst}: {ours:.2e} against repeated's {theirs:.2e}")
    assert excess <= 0, (worst, ours, theirs)


def test_float32_forward_equals_a_float32_model(tiny_checkpoints, videos):
    model32, model16, processor = bf16_rounded("qwen2_5_vl", tiny_checkpoints)
    prompts, ids, mask, sizes = case("qwen2_5_vl", processor, videos)
    before = {n: p.clone() for n, p in model16.named_parameters()}
    with torch.no_grad():
        expected = completion_logprobs(model32, prompts, ids, mask, sizes, mode="repeated").logprobs
        with float32_forward(model16):
            got = completion_logprobs(model16, prompts, ids, mask, sizes, mode="repeated").logprobs
        after = completion_logprobs(model16, prompts, ids, mask, sizes, mode="repeated").logprobs
    assert torch.equal(got, expected)
    assert all(torch.equal(p, before[n]) and p.dtype == torch.bfloat16 for n, p in model16.named_parameters())
    assert after.dtype == torch.float32 and not torch.equal(after, expected)  # hooks are gone: bf16 again


@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_bf16_self_check_passes_correct_code_and_stops_bugs(family, tiny_checkpoints, videos, monkeypatch):
    import app.grouping.attention as attention_module
    import app.grouping.forward as forward_module

    _, model16, processor = bf16_rounded(family, tiny_checkpoints)
    prompts, ids, mask, sizes = case(family, processor, videos, seed=2)
    result = verify_grouping(model16, prompts, ids, mask, sizes)  # the CPU default backend
    assert result.dtype == torch.bfloat16 and result.comparison is not None
    assert result.max_diff > 1e-3  # the old per-token bound (1e-4 relative) would have stopped this run

    # a position off by one, on every family: caught exactly by the positions check (a quarter of Qwen3.5's head
    # dims rotate, slowly: within bf16's noise for the numeric check there), naming the completion and token
    real_positions = forward_module.packed_positions
    monkeypatch.setattr(forward_module, "packed_positions",
                        lambda layout, pos: real_positions(layout, pos) + (layout.segment_ids > 0))
    with pytest.raises(GroupingMismatchError, match=r"positions differ: completion 0, token 0 has position ids"):
        verify_grouping(model16, prompts, ids, mask, sizes)
    monkeypatch.setattr(forward_module, "packed_positions", real_positions)

    # what only numbers show (every token sees the right tokens at the right positions; the values are 1.5x
    # at the responses): the numeric bf16 criterion
    def scaled(plan, q, k, v, scale, dropout):
        out = attention_module._masked(plan, q, k, v, scale, dropout)
        return torch.where(plan.layout.segment_ids.to(out.device)[None, :, None] > 0, out * 1.5, out)

    monkeypatch.setitem(attention_module._BACKEND_FNS, "masked", scaled)
    with pytest.raises(GroupingMismatchError, match=r"ratios mean(.|\n)*The first layer whose output differs is layer "
                       r"\d+, an? (full )?attention layer \(full_attention\)"):
        verify_grouping(model16, prompts, ids, mask, sizes, backend="masked")


@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_bf16_self_check_stops_wrong_visibility_and_wrong_states_exactly(family, tiny_checkpoints, videos,
                                                                          monkeypatch):
    """Who sees whom is a set: a response that sees a sibling, a GDN segment that starts from a sibling's state or
    from zero conv inputs, and GDN layers left to transformers are each stopped in bf16 by the exact probe,
    naming the completion, the token and the layer kind, on every family."""
    import app.grouping.attention as attention_module
    import app.grouping.recurrent.layer as recurrent_layer
    import app.grouping.recurrent.segments as segments_module

    _, model16, processor = bf16_rounded(family, tiny_checkpoints)
    prompts, ids, mask, sizes = case(family, processor, videos, seed=2)
    with monkeypatch.context() as patch:  # every response query sees the whole row causally: its siblings too
        patch.setitem(attention_module._BACKEND_FNS, "masked", lambda plan, q, k, v, scale, dropout:
                      attention_module._sdpa(q, k, v, is_causal=True, scale=scale))
        with pytest.raises(GroupingMismatchError, match=r"who sees whom: attention layer \d+ \(a full_attention "
                           r"layer\): completion 1, token 0 is reached by \d+ tokens where its repeated row "
                           r"\[P;R1\] gives \d+; it is reached by completion\(s\) \[0\]"):
            verify_grouping(model16, prompts, ids, mask, sizes, backend="masked")
    if family not in HYBRID_FAMILIES:
        return
    real = segments_module.layout_segments

    def chained(layout):  # each response continues its elder sibling's state instead of the prompt's
        rows = real(layout)
        parents = list(rows.parents)
        for s in range(1, len(parents)):
            if parents[s] >= 0 and parents[s - 1] == parents[s]:
                parents[s] = s - 1
        return segments_module.Segments(rows.starts, rows.lengths, tuple(parents), rows.total)

    with monkeypatch.context() as patch:
        patch.setattr(segments_module, "layout_segments", chained)
        with pytest.raises(GroupingMismatchError, match=r"Gated DeltaNet layer \d+'s recurrent state \(a "
                           r"linear_attention layer\): completion 2, token 0 .*completion\(s\) \[1\]"):
            verify_grouping(model16, prompts, ids, mask, sizes)
    with monkeypatch.context() as patch:  # the conv of every segment starts from zeros, not its parent's inputs
        patch.setattr(segments_module.LevelIndex, "before", property(
            lambda self: torch.full((len(self.level), self.kernel - 1), self.segments.total, dtype=torch.long)))
        with pytest.raises(GroupingMismatchError, match=r"Gated DeltaNet layer \d+'s conv inputs \(3 tokens "
                           r"back\) \(a linear_attention layer\): completion 0, token 0"):
            verify_grouping(model16, prompts, ids, mask, sizes)
    model16 = bf16_rounded(family, tiny_checkpoints)[1]
    with monkeypatch.context() as patch:  # its GDN layers left to transformers: one recurrence across the row
        patch.setattr(recurrent_layer, "install", lambda model, kwarg: 0)
        with pytest.raises(GroupingMismatchError, match="runs transformers' own recurrence across the packed row"):
            verify_grouping(model16, prompts, ids, mask, sizes)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3"])
def test_bf16_rollout_logprobs_within_the_bf16_criterion(family, tiny_checkpoints, videos):
    """Sampling log-probs (incremental decode in bf16) are as close to float32 as a bf16 repeated forward."""
    model32, model16, processor = bf16_rounded(family, tiny_checkpoints)
    prompts = prompt_batch(family, processor, videos, ["video", "text"])
    for key in ("pixel_values", "pixel_values_videos"):
        if key in prompts:
            prompts[key] = prompts[key].to(torch.bfloat16).float()
    rollout = generate_groups(model16, prompts, [3, 2], SamplingConfig(temperature=1.0, max_new_tokens=12, seed=1),
                              tokenizer=tokenizer_of(processor))
    ids, mask = rollout.completion_ids, rollout.completion_mask
    with torch.no_grad():
        reference = completion_logprobs(model32, prompts, ids, mask, [3, 2], mode="repeated").logprobs
        repeated = completion_logprobs(model16, prompts, ids, mask, [3, 2], mode="repeated").logprobs
    comparison = compare_to_reference(rollout.logprobs, repeated, reference, mask)
    assert comparison.passes(), comparison.describe()
    assert MEAN_RATIO <= MAX_RATIO
