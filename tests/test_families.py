"""Questions that share a video: one packed row [V; Q1; R1*; Q2; R2*; ...] per family, exact against the
per-question grouped forward and the repeated layout, on the real transformers classes."""

from __future__ import annotations

import random
import sys
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.data.prompts import encode_prompts
from app.data.video import video_element
from app.grouping import GroupedAttentionPlan, GroupLayout, LayoutError, completion_logprobs, grouped_attention
from app.grouping.families import (
    dense_family_mask,
    family_sizes,
    family_vision,
    flash_sequences,
    shared_prefix_lengths,
)
from app.runtime.models import MOE_FAMILIES, QSA_FAMILIES, VL_FAMILIES
from tests.helpers import load, max_rel_diff, patch_size, random_completions, tokenizer_of
from tests.test_attention import check_backends, qkv, sdpa_varlen

# qwen4_exp's families are tests/test_qsa.py's (its gradients held norm-relative; the grouped engine does not decode it)
FAMILY_KINDS = [f for f in VL_FAMILIES if f not in QSA_FAMILIES]

LOGPROB_RTOL = 1e-5
GRAD_RTOL = 1e-4
SHARING_CPU_BACKENDS = ("split", "masked", "flash")
QUESTIONS = ["Which colour appears first? Answer with a letter.", "How many shapes move?",
             "Does the red circle move left or right?", "What is in the last frame?"]


def family_conversations(family: str, videos, plan: list[int], *, text_first: bool = False, system: bool = True):
    """``plan``: per prompt, which video it asks about (-1: a text prompt); consecutive equal entries share it."""
    factor = 2 * patch_size(family)
    out = []
    for i, which in enumerate(plan):
        content = [{"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}]
        if which >= 0:
            media = video_element(videos[which], fps=2.0, min_pixels=factor * factor * 2, max_pixels=factor * factor * 6)
            content = content + [media] if text_first else [media] + content
        messages = [{"role": "system", "content": "You answer questions about videos."}] if system else []
        out.append(messages + [{"role": "user", "content": content}])
    return out


def family_case(family, checkpoints, videos, plan, seed=0, **kwargs):
    model, processor = load(family, checkpoints)
    prompts = encode_prompts(processor, family_conversations(family, videos, plan, **kwargs))
    rng = random.Random(seed)
    sizes = [rng.randint(1, 3) for _ in plan]
    lengths = [rng.randint(1, 12) for _ in range(sum(sizes))]
    tok = tokenizer_of(processor)
    ids, mask = random_completions(lengths, min(len(tok), tok.vocab_size), tok.pad_token_id, width=max(lengths) + 1,
                                   seed=seed)
    return model, prompts, ids, mask, sizes


def scores_and_grads(model, prompts, ids, mask, sizes, mode="grouped", backend=None, families=None, **routing):
    model.zero_grad(set_to_none=True)
    scores = completion_logprobs(model, prompts, ids, mask, sizes, mode=mode, backend=backend, families=families,
                                 return_entropy=True, **routing)
    weights = torch.linspace(0.5, 1.5, ids.shape[1])[None, :]
    (scores.logprobs * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return scores, grads


def assert_same(scores, grads, ref_scores, ref_grads):
    assert max_rel_diff(scores.logprobs, ref_scores.logprobs) <= LOGPROB_RTOL
    assert max_rel_diff(scores.entropy, ref_scores.entropy) <= LOGPROB_RTOL
    assert set(grads) == set(ref_grads)
    worst = max(grads, key=lambda n: max_rel_diff(grads[n], ref_grads[n]))
    assert max_rel_diff(grads[worst], ref_grads[worst]) <= GRAD_RTOL, worst


@pytest.mark.parametrize("backend", SHARING_CPU_BACKENDS)
@pytest.mark.parametrize("family", FAMILY_KINDS)
def test_a_family_equals_its_questions_one_by_one_and_repeated(family, backend, tiny_checkpoints, videos,
                                                               monkeypatch):
    """Three questions on one video, one on another, a text prompt: families [3, 1, 1]. Log-probs, entropies and
    every gradient equal the per-question grouped forward and the repeated layout (fp32)."""
    if backend == "flash":  # flash-attn's varlen call, played by SDPA per sequence (CPU)
        monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=sdpa_varlen))
    model, prompts, ids, mask, sizes = family_case(family, tiny_checkpoints, videos, [0, 0, 0, 1, -1], seed=3)
    families = [3, 1, 1]
    shared = shared_prefix_lengths(model, prompts, families)
    lengths = prompts["attention_mask"].sum(1).tolist()
    assert 0 < shared[0] < min(lengths[:3]) and shared[1:] == [0, 0]
    video_tokens = int((prompts["input_ids"][0] == model.config.video_token_id).sum())
    assert shared[0] > video_tokens  # the system prompt and the whole video are shared

    plain_scores, plain_grads = scores_and_grads(model, prompts, ids, mask, sizes, backend=backend)
    scores, grads = scores_and_grads(model, prompts, ids, mask, sizes, backend=backend, families=families)
    ref_scores, ref_grads = scores_and_grads(model, prompts, ids, mask, sizes, mode="repeated")
    assert scores.layout.shares and scores.layout.shared_tokens == 2 * shared[0]
    assert scores.layout.total_len == plain_scores.layout.total_len - 2 * shared[0]
    assert_same(scores, grads, plain_scores, plain_grads)
    assert_same(scores, grads, ref_scores, ref_grads)


@pytest.mark.parametrize("family", FAMILY_KINDS)
def test_the_shared_video_goes_through_the_tower_once(family, tiny_checkpoints, videos):
    model, prompts, ids, mask, sizes = family_case(family, tiny_checkpoints, videos, [1, 1, 1, 1], seed=1)
    seen = []
    handle = model.model.visual.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    with torch.no_grad():
        completion_logprobs(model, prompts, ids, mask, sizes, families=[4])
    handle.remove()
    assert sum(seen) == int(prompts["video_grid_thw"][0].prod())  # one video's patches, not four


def test_text_before_the_video_shares_less_and_stays_exact(tiny_checkpoints, videos):
    """A template that writes the question first (TimeZero's): V is the system prompt and the start of the user
    turn; each question carries its own copy of the video, still exact."""
    model, prompts, ids, mask, sizes = family_case("qwen2_5_vl", tiny_checkpoints, videos, [0, 0, 0], seed=2,
                                                   text_first=True)
    shared = shared_prefix_lengths(model, prompts, [3])[0]
    first_video = int((prompts["input_ids"][0][prompts["attention_mask"][0].bool()]
                       == model.config.vision_start_token_id).nonzero()[0, 0])
    assert 0 < shared < first_video
    vision = family_vision(model, prompts, GroupLayout.from_masks(prompts["attention_mask"], mask, sizes, [3],
                                                                  [shared]))
    assert vision["video_grid_thw"].shape[0] == 3  # every question's own copy
    scores, grads = scores_and_grads(model, prompts, ids, mask, sizes, families=[3])
    ref_scores, ref_grads = scores_and_grads(model, prompts, ids, mask, sizes, mode="repeated")
    assert_same(scores, grads, ref_scores, ref_grads)


def test_different_pixels_under_equal_tokens_are_not_shared(tiny_checkpoints, videos):
    """Two prompts whose placeholder tokens agree but whose pixels do not: V stops before the video."""
    model, prompts, ids, mask, sizes = family_case("qwen2_vl", tiny_checkpoints, videos, [0, 0], seed=4)
    half = prompts["pixel_values_videos"].shape[0] // 2
    prompts["pixel_values_videos"][half:] += 1.0  # the second prompt's video, changed in place
    shared = shared_prefix_lengths(model, prompts, [2])[0]
    start = int((prompts["input_ids"][0][prompts["attention_mask"][0].bool()] == model.config.video_token_id)
                .nonzero()[0, 0])
    assert shared == start
    scores, grads = scores_and_grads(model, prompts, ids, mask, sizes, families=[2])
    ref_scores, ref_grads = scores_and_grads(model, prompts, ids, mask, sizes, mode="repeated")
    assert_same(scores, grads, ref_scores, ref_grads)


def test_packed_and_paper_refuse_a_shared_video_by_name(tiny_checkpoints, videos):
    model, prompts, ids, mask, sizes = family_case("qwen2_vl", tiny_checkpoints, videos, [0, 0], seed=5)
    for backend in ("packed", "paper"):
        with pytest.raises(LayoutError, match=f"{backend}.*does not share a video"):
            completion_logprobs(model, prompts, ids, mask, sizes, backend=backend, families=[2])


def test_family_sizes_are_runs_of_equal_keys():
    assert family_sizes(["a", "a", "b", None, None, "b", "b"]) == [2, 1, 1, 1, 2]
    assert family_sizes([]) == []


# ---- the attention kernels against a naive reference -----------------------------------------------------------
def naive_family_attention(layout: GroupLayout, q, k, v):
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    seg, grp = layout.segment_ids.tolist(), layout.group_ids.tolist()
    fam, shared = layout.family_ids.tolist(), layout.shared_ids.tolist()
    rows = []
    for i in range(layout.total_len):
        allowed = [j for j in range(i + 1) if fam[j] == fam[i]
                   and (shared[j] > 0 or (grp[j] == grp[i] and (seg[j] == 0 or seg[j] == seg[i])))]
        scores = q[0, :, i : i + 1] @ k[0, :, allowed].transpose(-1, -2) / q.shape[-1] ** 0.5
        rows.append(torch.softmax(scores, dim=-1) @ v[0, :, allowed])
    return torch.cat(rows, dim=1)[None]


@st.composite
def family_layouts(draw):
    families = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3)))]
    groups = sum(families)
    sizes = tuple(draw(st.integers(1, 3)) for _ in range(groups))
    prefixes, shared, g = [], [], 0
    for size in families:
        common = draw(st.integers(0, 6)) if size > 1 else 0
        shared.append(common)
        prefixes += [common + draw(st.integers(1, 5)) for _ in range(size)]
        g += size
    completions = tuple(draw(st.integers(1, 6)) for _ in range(sum(sizes)))
    return GroupLayout(sizes, tuple(prefixes), completions, max(prefixes), max(completions), tuple(families),
                       tuple(shared))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=family_layouts(), heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]), seed=st.integers(0, 2**16))
def test_sharing_backends_match_the_naive_reference(layout, heads, seed):
    check_backends(layout, heads, seed, SHARING_CPU_BACKENDS, naive_family_attention)


def test_flex_forward_on_a_family_row_on_cpu():
    layout = GroupLayout((2, 1, 3), (9, 7, 5), (2, 1, 4, 3, 1, 6), 9, 6, (2, 1), (4, 0))
    q, k, v = (t.detach() for t in qkv(layout, 4, 2, dim=16, dtype=torch.float32))
    out = grouped_attention(GroupedAttentionPlan(layout, "flex"), q, k, v)
    torch.testing.assert_close(out, naive_family_attention(layout, q, k, v), rtol=1e-5, atol=1e-5)


def test_the_plain_layout_is_the_family_of_one():
    """families all 1 (nothing shared): the same row, masks and flash sequences as a layout without families."""
    plain = GroupLayout((2, 1, 3), (5, 7, 3), (2, 1, 4, 3, 1, 6), 7, 6)
    ones = GroupLayout((2, 1, 3), (5, 7, 3), (2, 1, 4, 3, 1, 6), 7, 6, (1, 1, 1), (0, 0, 0))
    assert not ones.shares and ones.group_spans == plain.group_spans
    for name in ("pack_index", "predict_index", "segment_ids", "group_ids"):
        assert torch.equal(getattr(ones, name), getattr(plain, name)), name
    from app.grouping.attention import dense_group_mask

    assert torch.equal(dense_family_mask(plain, "cpu"), dense_group_mask(plain, "cpu"))
    first, second = flash_sequences(plain)
    assert [len(r) for r in first] == [5, 7, 3] and len(second) == 6


def test_a_family_must_leave_each_question_a_token():
    with pytest.raises(LayoutError, match="at least one of its own"):
        GroupLayout((1, 1), (4, 6), (2, 2), 6, 2, (2,), (4,))


# ---- rollouts: the video prefilled once, decode steps reading it once --------------------------------------------
def some_rows_only(completions: torch.Tensor) -> int:
    """A token some completions hold and others do not (as an EOS id: some stop early, some run to the end)."""
    rows = [set(r) for r in completions.tolist()]
    for token in completions.flatten().tolist():
        holding = sum(token in r for r in rows)
        if 0 < holding < len(rows):
            return token
    raise AssertionError("every completion holds the same tokens")


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("family", FAMILY_KINDS)
def test_a_shared_rollout_draws_the_tokens_of_per_question_prompts(family, decode, tiny_checkpoints, videos):
    """Greedy and seeded sampling: the same tokens as the plain rollout (each question prefilled with its own
    copy of the video); log-probs within float rounding; the prefill processed the video once."""
    from app.rollout.generate import SamplingConfig, generate_groups

    model, prompts, _, _, _ = family_case(family, tiny_checkpoints, videos, [0, 0, 0, 1, -1], seed=6)
    tok = None  # no stop strings: the tokenizer is not needed
    families = [3, 1, 1]
    for sampling in (SamplingConfig(temperature=0, max_new_tokens=10),
                     SamplingConfig(temperature=1.0, max_new_tokens=10, seed=3)):
        seeds = [11, 12, 13, 14, 15]
        plain = generate_groups(model, prompts, 3, sampling, tokenizer=tok, eos_ids=[], prompt_seeds=seeds,
                                decode=decode)
        shared = generate_groups(model, prompts, 3, sampling, tokenizer=tok, eos_ids=[], prompt_seeds=seeds,
                                 decode=decode, families=families)
        assert torch.equal(shared.completion_ids, plain.completion_ids)
        assert torch.equal(shared.completion_mask, plain.completion_mask)
        torch.testing.assert_close(shared.logprobs, plain.logprobs, rtol=1e-4, atol=1e-4)
        video = shared_prefix_lengths(model, prompts, families)[0]
        assert shared.prefill_tokens < plain.prefill_tokens - video  # V once instead of three times
        # samples that finish early leave the batch (eager: their question and, once all are gone, the root too)
        eos = [some_rows_only(plain.completion_ids)]
        plain = generate_groups(model, prompts, 3, sampling, eos_ids=eos, prompt_seeds=seeds, decode=decode)
        shared = generate_groups(model, prompts, 3, sampling, eos_ids=eos, prompt_seeds=seeds, decode=decode,
                                 families=families)
        assert torch.equal(shared.completion_ids, plain.completion_ids) and shared.stop_reasons == plain.stop_reasons
        assert "eos" in plain.stop_reasons and "length" in plain.stop_reasons


@pytest.mark.parametrize("family", FAMILY_KINDS)
def test_a_family_in_bf16_is_as_close_to_float32_as_the_repeated_layout(family, tiny_checkpoints, videos):
    """bfloat16: the family's log-probs and gradients are judged against a float32 forward of the same weights,
    as every grouped forward is (``precision.compare_to_reference``; gradients within 1.5x of repeated's error plus
    bf16's roundoff: ``tests.test_bf16.grad_excess``). On an MoE family a router near a tie may pick other experts
    in bf16 than in float32, in either layout (rounding, not grouping): both bf16 layouts are routed as the float32
    reference was (``routing=``), and the tokens that flipped without the replay are counted."""
    import copy

    from app.grouping import compare_to_reference
    from app.grouping.checks.routing import disagreements
    from tests.test_bf16 import grad_excess

    model, prompts, ids, mask, sizes = family_case(family, tiny_checkpoints, videos, [0, 0, 0, 1], seed=7)
    model32 = model.to(torch.bfloat16).float()
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    for key in ("pixel_values", "pixel_values_videos"):
        if key in prompts:
            prompts[key] = prompts[key].to(torch.bfloat16).float()
    moe = family in MOE_FAMILIES
    reference, ref_grads = scores_and_grads(model32, prompts, ids, mask, sizes, mode="repeated", record_routing=moe)
    replay = {"routing": reference.routing} if moe else {}
    repeated, rep_grads = scores_and_grads(model16, prompts, ids, mask, sizes, mode="repeated", **replay)
    shared, grads = scores_and_grads(model16, prompts, ids, mask, sizes, families=[3, 1], **replay)
    comparison = compare_to_reference(shared.logprobs.float(), repeated.logprobs.float(), reference.logprobs, mask)
    assert comparison.repeated_mean > 1e-4 and comparison.passes(), comparison.describe()
    worst, excess, ours, theirs = grad_excess({n: g.float() for n, g in grads.items()},
                                              {n: g.float() for n, g in rep_grads.items()}, ref_grads)
    assert excess <= 0, (worst, ours, theirs)
    if moe:  # the replay changes nothing but the flipped tokens' experts: where none flipped, it changes no bit
        with torch.no_grad():
            free = completion_logprobs(model16, prompts, ids, mask, sizes, families=[3, 1], record_routing=True)
        flips = disagreements(free.routing, reference.routing, prompts["attention_mask"], mask)
        print(f"{family}: bf16 routed {flips['tokens']} of {flips['real_tokens']} tokens elsewhere than float32")
        if flips["tokens"] == 0:
            assert torch.equal(free.logprobs, shared.logprobs.detach())


@pytest.mark.parametrize("setup", ["lora", "frozen_tower"])
@pytest.mark.parametrize("family", FAMILY_KINDS)
def test_a_family_with_lora_or_a_frozen_tower_equals_repeated(family, setup, tiny_checkpoints, videos):
    """LoRA adapters on the language model (the tower frozen, as the LoRA config trains), or a frozen tower with
    everything else training: the family's log-probs and every trainable gradient equal repeated's."""
    from app.config.sections import LoRAConfig
    from app.runtime.lora import apply as apply_lora

    model, prompts, ids, mask, sizes = family_case(family, tiny_checkpoints, videos, [1, 1, 1], seed=8)
    if setup == "lora":
        apply_lora(model, LoRAConfig(rank=4, alpha=8))
        with torch.no_grad():  # non-zero adapters, so their gradients are not trivially equal
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    else:
        model.model.visual.requires_grad_(False)
    scores, grads = scores_and_grads(model, prompts, ids, mask, sizes, families=[3])
    ref_scores, ref_grads = scores_and_grads(model, prompts, ids, mask, sizes, mode="repeated")
    assert set(grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(".visual." in n for n in grads) and (setup != "lora" or all("lora_" in n for n in grads))
    assert_same(scores, grads, ref_scores, ref_grads)


@pytest.mark.parametrize("family", FAMILY_KINDS)
def test_a_familys_pixels_are_held_once_in_the_batch_and_everything_reads_them_alike(family, tiny_checkpoints, videos):
    """Questions whose prompts hold the very same pixel tensors (what the stream's spliced prompts do) collate
    into a batch with the video's pixels once and each occurrence's rows beside its grid: the bytes are one copy,
    and the family's log-probs and gradients, the repeated layout's, the shared rollout's and the plain rollout's
    tokens equal those of the batch with a copy per question."""
    from app.data.prompts import collate_prompts, encode_prompts
    from app.grouping.media import ROWS, expanded
    from app.rollout.generate import SamplingConfig, generate_groups

    model, processor = load(family, tiny_checkpoints)
    single = [encode_prompts(processor, [c]) for c in family_conversations(family, videos, [0, 0, 0, 1])]
    for member in single[1:3]:  # the family's questions share the first one's tensors, as spliced prompts do
        for key in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
            if key in single[0]:
                assert torch.equal(member[key], single[0][key])
                member[key] = single[0][key]
    once = collate_prompts(single, tokenizer_of(processor).pad_token_id)
    copies = expanded(once)
    assert ROWS["pixel_values_videos"] in once and ROWS["pixel_values_videos"] not in copies
    video = single[0]["pixel_values_videos"]
    assert once["pixel_values_videos"].numel() == video.numel() + single[3]["pixel_values_videos"].numel()
    assert copies["pixel_values_videos"].numel() == 3 * video.numel() + single[3]["pixel_values_videos"].numel()
    sizes, families = [2, 1, 3, 2], [3, 1]
    tok = tokenizer_of(processor)
    ids, mask = random_completions([3, 5, 2, 4, 6, 1, 2, 3], min(len(tok), tok.vocab_size), tok.pad_token_id)
    for mode, fams in (("grouped", families), ("repeated", None)):
        got = scores_and_grads(model, once, ids, mask, sizes, mode=mode, families=fams)
        want = scores_and_grads(model, copies, ids, mask, sizes, mode=mode, families=fams)
        assert torch.equal(got[0].logprobs, want[0].logprobs), mode
        assert all(torch.equal(got[1][n], want[1][n]) for n in want[1]), mode
    sampling = SamplingConfig(temperature=0, max_new_tokens=8)
    for fams in (families, None):
        a = generate_groups(model, once, 2, sampling, eos_ids=[], families=fams)
        b = generate_groups(model, copies, 2, sampling, eos_ids=[], families=fams)
        assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_the_self_check_probes_a_familys_visibility_and_states_exactly(family, tiny_checkpoints, videos,
                                                                       monkeypatch):
    """Questions sharing a video: the self-check's exact probe passes the family row [V; Q1; R1*; Q2; R2*] and
    stops a response that sees the question before its own, and (Qwen3.5) a question whose GDN state continues
    the question before it instead of the video, naming the completion and the layer kind."""
    from app.grouping import GroupingMismatchError, verify_grouping
    from app.grouping import families as families_module
    from app.grouping.recurrent import segments as segments_module

    model, prompts, ids, mask, sizes = family_case(family, tiny_checkpoints, videos, [0, 0, 1], seed=5)
    verify_grouping(model, prompts, ids, mask, sizes, families=[2, 1], backend="masked")
    first_of_second = sizes[0]  # the first completion of the family's second question
    def leaky(plan, q, k, v, scale, dropout):  # a response also sees every earlier question of its family
        from app.grouping.kernels import _sdpa

        layout = plan.layout
        mask = families_module.dense_family_mask(layout, q.device)
        fam, seg = layout.family_ids.to(q.device), layout.segment_ids.to(q.device)
        idx = torch.arange(layout.total_len, device=q.device)
        mask = mask | ((idx[None, :] <= idx[:, None]) & (fam[:, None] == fam[None, :]) & (seg[None, :] == 0))
        return _sdpa(q, k, v, mask=mask, scale=scale, dropout=dropout)

    with monkeypatch.context() as patch:
        patch.setitem(families_module.FAMILY_BACKEND_FNS, "masked", leaky)
        with pytest.raises(GroupingMismatchError, match=rf"who sees whom: attention layer \d+ \(a full_attention "
                           rf"layer\): completion {first_of_second}, token 0 is reached by \d+ tokens where its "
                           rf"repeated row \[P;R{first_of_second}\] gives \d+; its source \d+ is the packed row's"):
            verify_grouping(model, prompts, ids, mask, sizes, families=[2, 1], backend="masked")
    if family != "qwen3_5":
        return
    real = segments_module.layout_segments

    def chained(layout):  # the second question continues the first question's state, not the video's
        rows = real(layout)
        parents = list(rows.parents)
        questions = [s for s, p in enumerate(parents) if p == 0]
        parents[questions[1]] = questions[0]
        return segments_module.Segments(rows.starts, rows.lengths, tuple(parents), rows.total)

    with monkeypatch.context() as patch:
        patch.setattr(segments_module, "layout_segments", chained)
        with pytest.raises(GroupingMismatchError, match=rf"Gated DeltaNet layer \d+'s recurrent state \(a "
                           rf"linear_attention layer\): completion {first_of_second}, token 0 is reached by \d+ "
                           rf"tokens where its repeated row \[P;R{first_of_second}\] gives \d+"):
            verify_grouping(model, prompts, ids, mask, sizes, families=[2, 1], backend="masked")
