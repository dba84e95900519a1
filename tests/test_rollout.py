"""Shared-prefill rollouts: greedy equals HF generate, sampling log-probs equal the grouped forward, seeding."""

from __future__ import annotations

import pytest
import torch

from app.grouping import completion_logprobs
from app.rollout.generate import SamplingConfig, generate_groups
from tests.helpers import load, prompt_batch, tokenizer_of

KINDS = {"qwen2": ["text", "text"], "qwen2_vl": ["video", "text"], "qwen2_5_vl": ["text", "video"],
         "qwen3_vl": ["video", "text"], "qwen3_5": ["image", "video"]}


def setup(family, checkpoints, videos):
    model, processor = load(family, checkpoints)
    prompts = prompt_batch(family, processor, videos, KINDS[family])
    assert prompts["attention_mask"].sum(1).unique().numel() == 2  # prompts of different lengths
    return model, prompts, tokenizer_of(processor)


@pytest.mark.parametrize("family", list(KINDS))
def test_greedy_equals_hf_generate(family, tiny_checkpoints, videos):
    model, prompts, tok = setup(family, tiny_checkpoints, videos)
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    ours = generate_groups(model, prompts, 1, greedy, tokenizer=tok, eos_ids=[])
    hf = generate_groups(model, prompts, 1, greedy, tokenizer=tok, eos_ids=[], engine="hf")
    assert ours.completion_ids.shape == (2, 12)
    assert torch.equal(ours.completion_ids, hf.completion_ids)
    torch.testing.assert_close(ours.logprobs, hf.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", list(KINDS))
def test_sampling_logprobs_equal_grouped_forward(family, tiny_checkpoints, videos):
    model, prompts, tok = setup(family, tiny_checkpoints, videos)
    rollout = generate_groups(model, prompts, [3, 2], SamplingConfig(temperature=1.0, max_new_tokens=10, seed=1),
                              tokenizer=tok)
    with torch.no_grad():
        forward = completion_logprobs(model, prompts, rollout.completion_ids, rollout.completion_mask, [3, 2])
    assert rollout.completion_ids.shape[0] == 5
    torch.testing.assert_close(rollout.logprobs, forward.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2"])
def test_hf_engine_samples_the_same_tokens_as_the_grouped_engine(family, tiny_checkpoints, videos):
    """rollout.engine=hf (the A/B baseline) uses the grouped engine's sampler on HF's logits: same seed, same
    tokens, so grouped-vs-repeated runs differ by the layout alone."""
    model, prompts, tok = setup(family, tiny_checkpoints, videos)
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, max_new_tokens=10, seed=3)
    ours = generate_groups(model, prompts, [3, 2], sampling, tokenizer=tok, eos_ids=[])
    hf = generate_groups(model, prompts, [3, 2], sampling, tokenizer=tok, eos_ids=[], engine="hf")
    assert len({tuple(r) for r in ours.completion_ids.tolist()}) > 1  # sampled, not greedy
    assert torch.equal(ours.completion_ids, hf.completion_ids)
    torch.testing.assert_close(ours.logprobs, hf.logprobs, rtol=0, atol=1e-5)


def test_same_seed_same_samples_different_seed_different(tiny_checkpoints, videos):
    model, prompts, tok = setup("qwen2_5_vl", tiny_checkpoints, videos)
    def run(seed):
        return generate_groups(model, prompts, 4, SamplingConfig(max_new_tokens=8, seed=seed), tokenizer=tok)
    a, b, c = run(7), run(7), run(8)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # the G samples of one group differ from each other: each continues the shared prefix independently
    assert len({tuple(row.tolist()) for row in a.completion_ids[:4]}) > 1


def test_eos_and_stop_strings_cut_completions(tiny_checkpoints, videos):
    model, prompts, tok = setup("qwen2_5_vl", tiny_checkpoints, videos)
    greedy = SamplingConfig(temperature=0, max_new_tokens=10)
    free = generate_groups(model, prompts, 1, greedy, tokenizer=tok, eos_ids=[])
    eos = int(free.completion_ids[0, 3])
    first = int((free.completion_ids[0] == eos).nonzero()[0])
    cut = generate_groups(model, prompts, 1, greedy, tokenizer=tok, eos_ids=[eos])
    assert cut.completion_mask[0].tolist() == [1] * (first + 1) + [0] * (cut.completion_ids.shape[1] - first - 1)
    assert cut.stop_reasons[0] == "eos"
    assert torch.equal(cut.completion_ids[0, : first + 1], free.completion_ids[0, : first + 1])
    assert (cut.completion_ids[0, first + 1 :] == tok.pad_token_id).all()
    assert (cut.logprobs[0, first + 1 :] == 0).all()

    text = tok.decode(free.completion_ids[1, 2:4])
    stop = generate_groups(model, prompts, 1, SamplingConfig(temperature=0, max_new_tokens=10, stop_strings=(text,)),
                           tokenizer=tok, eos_ids=[])
    assert stop.stop_reasons[1] == "stop_string"
    assert int(stop.completion_mask[1].sum()) <= 4


def test_vision_tower_and_prefill_run_once_per_prompt(tiny_checkpoints, videos):
    model, prompts, tok = setup("qwen2_5_vl", tiny_checkpoints, videos)
    patches = []
    hook = model.model.visual.register_forward_hook(lambda m, args, out: patches.append(args[0].shape[0]))
    sampling = SamplingConfig(max_new_tokens=4, seed=0)
    ours = generate_groups(model, prompts, 4, sampling, tokenizer=tok)
    ours_patches = sum(patches)
    patches.clear()
    hf = generate_groups(model, prompts, 4, sampling, tokenizer=tok, engine="hf")
    hook.remove()
    assert ours_patches == int(prompts["video_grid_thw"].prod(-1).sum())
    assert sum(patches) == 4 * ours_patches
    assert ours.prefill_tokens * 4 == hf.prefill_tokens == 4 * int(prompts["attention_mask"].sum())


def test_bad_sampling_settings():
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        SamplingConfig(max_new_tokens=0)


def test_a_prompts_samples_depend_on_its_seed_not_on_its_batch(tiny_checkpoints, videos):
    """Per-prompt random streams: the same prompt with the same seed draws the same samples alone or second in a
    batch; other seeds draw others (training: every step, draw, rank and prompt its own seed)."""
    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    tok = tokenizer_of(processor)
    batch = prompt_batch("qwen2_5_vl", processor, videos, ["video", "text"])  # the video prompt is the longer one
    alone = prompt_batch("qwen2_5_vl", processor, videos, ["video"])
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    both = generate_groups(model, batch, 3, sampling, tokenizer=tok, eos_ids=[], prompt_seeds=[22, 11])
    single = generate_groups(model, alone, 3, sampling, tokenizer=tok, eos_ids=[], prompt_seeds=[22])
    assert torch.equal(both.completion_ids[:3], single.completion_ids)
    other = generate_groups(model, alone, 3, sampling, tokenizer=tok, eos_ids=[], prompt_seeds=[23])
    assert not torch.equal(other.completion_ids, single.completion_ids)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0),
                                                               (1.3, 0, 0.8), (0.9, 4, 0.9)])
def test_sampler_draws_the_tempered_filtered_distribution(temperature, top_k, top_p):
    """Frequencies of 40,000 draws against the exact distribution: softmax(logits / T), restricted to the top k and
    to the smallest set of tokens whose mass reaches top_p (the crossing token kept), renormalised."""
    from app.rollout.generate import sample_tokens

    logits = torch.tensor([2.0, 1.5, 1.0, 0.3, -0.5, -1.0, 0.9, -3.0])
    probs = torch.softmax(logits / temperature, -1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k:
        keep &= probs >= probs.topk(top_k).values[-1]
    order = torch.argsort(torch.where(keep, probs, torch.zeros_like(probs)), descending=True)
    kept = torch.where(keep, probs, torch.zeros_like(probs))[order]
    kept = kept / kept.sum()
    mass_before = kept.cumsum(0) - kept
    keep_sorted = mass_before < top_p
    expected = torch.zeros_like(probs)
    expected[order[keep_sorted]] = probs[order[keep_sorted]]
    expected = expected / expected.sum()
    n = 40_000
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, logprobs = sample_tokens(logits.expand(n, -1), sampling, None)  # torch's generator, seeded per test
    frequencies = torch.bincount(tokens, minlength=len(logits)).double() / n
    assert (frequencies - expected.double()).abs().max() < 0.01
    assert (frequencies[expected == 0] == 0).all()  # filtered tokens are never drawn
    torch.testing.assert_close(logprobs, torch.log_softmax(logits / temperature, -1)[tokens])  # unfiltered log-probs


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 0.9)])
def test_a_suppressed_token_far_above_the_rest_leaves_the_draw_intact(temperature, top_k, top_p):
    """A suppressed token (a vision placeholder) whose logit is 140 above the rest: it is never drawn, the others
    come with softmax(logits / T) restricted to them (their exp(x - max) would all underflow to 0 against the
    suppressed max: every draw was token 0 before), and the log-probs stay those of the whole distribution."""
    from app.rollout.generate import sample_tokens

    logits = torch.tensor([0.2, 1.5, 1.0, 140.0, -0.5, 0.9, 140.5, 0.3])
    suppress = torch.tensor([3, 6])
    allowed = torch.ones(8, dtype=torch.bool)
    allowed[suppress] = False
    probs = torch.where(allowed, torch.softmax(logits.masked_fill(~allowed, float("-inf")) / temperature, -1), 0.0)
    if top_k:
        probs = torch.where(probs >= probs.topk(top_k).values[-1], probs, 0.0)
        order = probs.argsort(descending=True)
        sorted_probs = probs[order] / probs.sum()
        drop = order[(sorted_probs.cumsum(0) - sorted_probs) >= top_p]
        probs[drop] = 0.0
    expected = probs / probs.sum()
    n = 40_000
    tokens, logprobs = sample_tokens(logits.expand(n, -1), SamplingConfig(temperature=temperature, top_k=top_k,
                                                                          top_p=top_p), None, suppress)
    frequencies = torch.bincount(tokens, minlength=8).double() / n
    assert not bool(torch.isin(tokens, suppress).any())
    assert (frequencies - expected.double()).abs().max() < 0.01
    torch.testing.assert_close(logprobs, torch.log_softmax(logits / temperature, -1)[tokens])


def test_top_p_looks_at_the_largest_probabilities_first_and_falls_back_to_a_full_sort(monkeypatch):
    """Looking at the largest 64, then 1024, probabilities first keeps exactly what sorting the whole vocabulary
    keeps, for mass concentrated in a few tokens, spread over hundreds, and flat over all (the full sort)."""
    import app.rollout.sampling as sampling_module

    torch.manual_seed(3)
    vocab = 5000
    rows = [torch.randn(vocab) * 8, torch.randn(vocab) * 1.5, torch.zeros(vocab) + torch.rand(vocab) * 1e-3]
    logits = torch.log_softmax(torch.stack(rows), -1)
    for top_p in (0.5, 0.9, 0.999):
        got = sampling_module._top_p(logits, top_p)
        monkeypatch.setattr(sampling_module, "TOP_P_CANDIDATES", ())  # every row through the full sort
        want = sampling_module._top_p(logits, top_p)
        monkeypatch.undo()
        assert torch.equal(got, want), top_p
        kept = (~torch.isinf(got)).sum(-1)
        assert kept[0] < 64 and 64 < kept[1] < vocab and kept[2] > 1024  # all three paths were taken


def test_outputs_do_not_depend_on_when_finished_samples_leave_the_batch(tiny_checkpoints, videos, monkeypatch):
    """Finished samples leave the decode batch every CHECK_EVERY steps; with a look at every step (no compaction
    lag) or only at the end (no compaction), every completion, mask and stop reason is the same, and the log-probs
    agree to float rounding (a smaller batch rounds its matmuls differently: up to ~4e-6 here)."""
    import app.rollout.generate as rollout

    model, prompts, tok = setup("qwen2_5_vl", tiny_checkpoints, videos)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=24, seed=5)
    free = generate_groups(model, prompts, [3, 2], sampling, tokenizer=tok, eos_ids=[])
    eos = sorted({int(free.completion_ids[0, 2]), int(free.completion_ids[3, 5])})  # tokens some samples draw
    runs = []
    for every in (1, 8, 1000):
        monkeypatch.setattr(rollout, "CHECK_EVERY", every)
        runs.append(generate_groups(model, prompts, [3, 2], sampling, tokenizer=tok, eos_ids=eos))
    first = runs[0]
    assert "eos" in first.stop_reasons and first.completion_mask.sum() < first.completion_mask.numel()
    for other in runs[1:]:
        assert torch.equal(other.completion_ids, first.completion_ids)
        assert torch.equal(other.completion_mask, first.completion_mask)
        torch.testing.assert_close(other.logprobs, first.logprobs, rtol=0, atol=1e-5)
        assert other.stop_reasons == first.stop_reasons


@pytest.mark.parametrize("block", [1, 7, 64, 1000, 4096])
def test_two_level_draw_picks_what_one_cumulative_sum_picks(block):
    """``draw_from_weights`` (block sums, then one block's cumulative sum) returns the token a single float64
    cumulative sum over the whole row returns, for uniforms anywhere in [0, 1) including both ends, on rows with
    runs of zero weight at the start, the end and inside, and never a token of zero weight."""
    from app.rollout.sampling import draw_from_weights

    torch.manual_seed(0)
    vocab = 4000
    weights = torch.rand(6, vocab) ** 4
    weights[:, :37] = 0
    weights[:, -300:] = 0
    weights[1, 100:2500] = 0
    weights[2, :] = 0
    weights[2, 1234] = 0.5  # one token carries all the mass
    uniforms = [torch.rand(6, 1, dtype=torch.float64) for _ in range(50)]
    uniforms += [torch.zeros(6, 1, dtype=torch.float64), torch.full((6, 1), 1 - 2**-53, dtype=torch.float64)]
    cdf = weights.double().cumsum(-1)
    for uniform in uniforms:
        got = draw_from_weights(weights, uniform, block)
        want = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(-1).clamp_max(vocab - 1)
        want = torch.where(weights.gather(-1, want[:, None]).squeeze(-1) > 0, want, got)  # the old clamp's edge
        assert torch.equal(got, want)
        assert (weights.gather(-1, got[:, None]) > 0).all()


def test_packed_output_head_computes_the_same_logits():
    """The decoder's output head (oneDNN with the weight packed once, else weight @ hidden^T in chunks) gives
    linear's logits to float rounding, for any number of rows (finished samples leave the batch), and is taken
    off the module afterwards; the packed weight is made once, when the head is not partitioned."""
    from app.grouping.decoding.head import DecodingHead

    torch.manual_seed(0)
    model = torch.nn.Module()
    head = torch.nn.Linear(96, 20000, bias=False)
    model.get_output_embeddings = lambda: head
    hidden = torch.randn(5, 1, 96)
    want = torch.nn.functional.linear(hidden, head.weight)
    for packed in (True, False):
        decoding = DecodingHead(model)
        if not packed:
            decoding.packed = None
        with decoding.installed():
            got = head(hidden)
            fewer = head(hidden[[0, 2, 3]])
        assert "forward" not in head.__dict__
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fewer, got[[0, 2, 3]], rtol=1e-6, atol=1e-6)
        assert (decoding.packed is not None) == packed
    head.weight.ds_id = 7  # as DeepSpeed marks a ZeRO-3 parameter: gathered around each call, never packed
    assert DecodingHead(model).packed is None


def test_engines_per_step_sampling_logprobs_agree_on_the_real_vocabulary(real_checkpoints, videos):
    """The grouped engine (shared prefill, grouped decode attention, packed head) and the HF engine (plain generate
    on the repeated batch, the same sampler) on Qwen's real vocabulary, a video and a text prompt, G=8, 12 seeds of
    24 tokens. Where their tokens agree, the per-step sampling log-probs differ by float rounding only (< 1e-5;
    ~5e-6 measured, on logits that differ by ~5e-6). Rounding still flips a draw that lands within it of a
    cumulative-probability boundary: on this random model's flat distributions (~1e-6 per token) 5 of 192 samples
    part, each at a token next to the other engine's (the boundary between two neighbours moved: a real logits
    difference would jump anywhere). Before the sampler's block sums went to float64, such draws were decided by
    float32 summation noise (~1e-7 of the total) as well: the demo's A/B parted at step 1 (sample 51, token 7:
    98 against 97, on a peaked distribution)."""
    model, processor = load("qwen2_5_vl", real_checkpoints)  # sharpened weights
    tok = tokenizer_of(processor)
    prompts = prompt_batch("qwen2_5_vl", processor, videos, ["video", "text"])
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=24)
    worst, parted, total = 0.0, 0, 0
    for seed in range(12):
        ours = generate_groups(model, prompts, 8, sampling, tokenizer=tok, eos_ids=[], prompt_seeds=[seed, seed + 100])
        hf = generate_groups(model, prompts, 8, sampling, tokenizer=tok, eos_ids=[], prompt_seeds=[seed, seed + 100],
                             engine="hf")
        agree = (ours.completion_ids == hf.completion_ids).long().cumprod(dim=1).bool()  # up to the first flip
        worst = max(worst, float((ours.logprobs - hf.logprobs).abs()[agree].max()))
        for row in (~agree.all(dim=1)).nonzero().flatten().tolist():
            step = int((~agree[row]).nonzero()[0])
            assert abs(int(ours.completion_ids[row, step]) - int(hf.completion_ids[row, step])) == 1, (seed, row)
            parted += 1
        total += agree.shape[0]
    assert worst < 1e-5, worst
    assert parted <= 0.05 * total, f"{parted} of {total} samples parted"


def test_a_sequence_parallel_group_spreads_whole_families_and_gets_the_rollout_in_prompt_order():
    """``SharedInGroup`` over S ranks, played in one process: each rank samples whole families (balanced by
    tokens), what the ranks gather is put back in prompt order, tokens, mask, log-probs, stop reasons, group sizes
    and counts equal to the rollout of all prompts at once, widths padded with the pad id."""
    from types import SimpleNamespace

    from app.rollout.base import SharedInGroup, spread_families
    from app.rollout.generate import Rollout

    class PerPrompt:  # each prompt's samples depend on it alone (its seed), as the real engines' do
        name = "fake"

        def generate(self, prompts, group_size, seeds, sampling=None):
            rows = [(p.length, s) for p, s in zip(prompts, seeds) for _ in range(group_size)]
            width = max(n % 5 + 1 for n, _ in rows)
            ids = torch.full((len(rows), width), 99)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, (n, s) in enumerate(rows):
                ids[r, : n % 5 + 1] = torch.arange(n % 5 + 1) + s
                mask[r, : n % 5 + 1] = 1
            return Rollout(ids, mask, -mask.float() * 0.5, [group_size] * len(prompts),
                           ["eos" if n % 2 else "length" for n, _ in rows], 10 * len(prompts), 7 * len(prompts))

    prompts = [SimpleNamespace(length=n, share=key) for n, key in
               [(40, "a"), (41, "a"), (42, "a"), (30, "b"), (9, None), (33, "c"), (34, "c")]]
    seeds = list(range(100, 107))
    assert spread_families(prompts, 2) == [0, 0, 0, 1, 1, 1, 1]  # a (123 tokens); then b, the text prompt, c: 106
    whole = PerPrompt().generate(prompts, 2, seeds)
    for size in (2, 3):
        owners = spread_families(prompts, size)
        share = {r: PerPrompt().generate([p for p, o in zip(prompts, owners) if o == r], 2,
                                         [s for s, o in zip(seeds, owners) if o == r]) for r in range(size)}
        from app.rollout.rows import sent

        def gathered(tensors, share=share, size=size):  # each rank's rollout as it sends it
            return [sent(share[r], 99) for r in range(size)]

        group = SimpleNamespace(sp=SimpleNamespace(size=size, rank=0), gather_in_group=gathered)
        got = SharedInGroup(PerPrompt(), group, pad_id=99).generate(prompts, 2, seeds)
        assert torch.equal(got.completion_ids, whole.completion_ids), size
        assert torch.equal(got.completion_mask, whole.completion_mask) and torch.equal(got.logprobs, whole.logprobs)
        assert got.stop_reasons == whole.stop_reasons and got.group_sizes == whole.group_sizes
        assert (got.prefill_tokens, got.prompt_tokens) == (whole.prefill_tokens, whole.prompt_tokens)


@pytest.mark.parametrize("loads, size, split", [
    ([90], 2, "spread"),  # one long video: fewer families than ranks
    ([1, 1, 1], 2, "spread"),  # whole families would leave the busiest rank 1.33 even shares
    ([1] * 7, 4, "spread"),  # 1.14
    ([1] * 9, 4, "spread"),  # 3 of 2.25: 1.33
    ([1, 1, 1, 1], 2, "families"),  # they divide evenly
    ([5, 5, 1, 1], 2, "families"),  # evenly by tokens (5 + 1 each), not by count
    ([1] * 41, 4, "families"),  # 11 of 10.25: 1.07, within SPREAD_ABOVE
    ([10, 1, 1], 2, "spread"),  # one family outweighs the rest: 10 of 6
])
def test_a_group_spreads_its_families_when_whole_ones_would_leave_ranks_idle(loads, size, split):
    """``split_of``: the rule the engine follows and the planner models (``timing.rank_work``); an engine that
    cannot spread keeps whole families."""
    from app.rollout.base import SPREAD_ABOVE, busiest_share, split_of

    expected = split if len(loads) < size else ("spread" if busiest_share(loads, size) > SPREAD_ABOVE else "families")
    assert split_of(loads, size, True) == split == expected
    assert split_of(loads, size, False) == "families"
    assert busiest_share([1] * 7, 4) == pytest.approx(8 / 7) and busiest_share([3, 3], 2) == 1.0


def test_auto_keeps_a_short_video_whole_and_spreads_a_long_one_as_the_planner_prices_them(tiny_checkpoints):
    """rollout.sp_split=auto: ``choose_split`` asks ``app.planning.split.rollout_pricer`` (the planner's rollout
    phases, on this machine's CPU numbers) for the busiest rank's seconds both ways. One family of 6 questions on
    S = 2 or 4: a short video's prompts (300 tokens, as the suite's) stay whole, where a spread would give every
    rank each decode step's linear layers and exchanges; a 640-frame one's (20,480) spread, near 1/S. A forced
    setting wins; an engine that cannot spread keeps whole families; without a price, ``split_of``'s rule."""
    from transformers import AutoConfig

    from app.config.loading import load_config
    from app.planning.split import rollout_pricer
    from app.rollout.base import choose_split, split_of

    cfg = load_config("configs/demo_cpu.yaml", ["rollout.group_size=2", "rollout.max_completion_length=8"])
    priced = rollout_pricer(cfg, AutoConfig.from_pretrained(tiny_checkpoints["qwen2_5_vl"]), device="cpu", ranks=4)
    for size in (2, 4):
        short, why = choose_split([6 * 300], size, True, "auto", priced, [6])
        assert short == "families" and "the planner prices the busiest rank's rollout at" in why, why
        assert choose_split([6 * 20480], size, True, "auto", priced, [6])[0] == "spread"
        spread_s, whole_s = priced([6 * 20480], [6], size)
        assert 1 / size < spread_s / whole_s < 1.3 / size  # the prefill and K/V split, the linear layers not
        ratios = [priced([6 * n], [6], size) for n in (300, 2000, 8000, 20480)]
        assert sorted((a / b for a, b in ratios), reverse=True) == [a / b for a, b in ratios]  # longer, better
    assert choose_split([6 * 300], 2, True, "spread", priced, [6]) == ("spread", "rollout.sp_split=spread")
    assert choose_split([6 * 20480], 2, True, "families", priced, [6])[0] == "families"
    assert choose_split([6 * 20480], 2, False, "auto", priced, [6])[0] == "families"
    assert choose_split([90], 2, True)[0] == split_of([90], 2, True) == "spread"
    with pytest.raises(ValueError, match="rollout.sp_split must be one of"):
        choose_split([1], 2, True, "whole")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_repetition_penalty_is_the_same_in_both_engines_and_changes_the_output(temperature, tiny_checkpoints,
                                                                                 videos):
    """eval.repetition_penalty (HF's and vLLM's rule over the prompt's real tokens and the output so far): the
    grouped engine and HF generate pick the same tokens, prompts of different lengths included (HF's own
    processor would also count the left padding), and the penalty changes what is picked."""
    model, prompts, tok = setup("qwen2_5_vl", tiny_checkpoints, videos)
    runs = {}
    for penalty in (1.0, 3.0):
        sampling = SamplingConfig(temperature=temperature, max_new_tokens=16, seed=2, repetition_penalty=penalty)
        ours = generate_groups(model, prompts, 2, sampling, tokenizer=tok, eos_ids=[])
        hf = generate_groups(model, prompts, 2, sampling, tokenizer=tok, eos_ids=[], engine="hf")
        assert torch.equal(ours.completion_ids, hf.completion_ids), penalty
        torch.testing.assert_close(ours.logprobs, hf.logprobs, rtol=0, atol=1e-5)  # the model's own log-probs
        runs[penalty] = ours
    assert not torch.equal(runs[1.0].completion_ids, runs[3.0].completion_ids)
    with torch.no_grad():  # reported log-probs are the unpenalised model's, as the grouped forward scores them
        forward = completion_logprobs(model, prompts, runs[3.0].completion_ids, runs[3.0].completion_mask, [2, 2])
    scale = temperature or 1.0
    if scale == 1.0:
        torch.testing.assert_close(runs[3.0].logprobs, forward.logprobs, rtol=0, atol=1e-5)
    if temperature == 0:  # greedy decoding of a random model repeats itself; the penalty makes it repeat less

        def repeats(rollout):
            return sum(len(row) - len(set(row)) for row in rollout.completion_ids.tolist())

        assert repeats(runs[3.0]) < repeats(runs[1.0])
