"""Rollouts of long prompts: the prefill's decoder run a chunk of positions at a time against the cache
(``rollout.prefill_chunk_size``) and the frozen vision tower run a few temporal patches at a time
(``forward.vision_chunk_frames``) give what the whole-prompt prefill gives, on the real model classes."""

from __future__ import annotations

import pytest
import torch

from app.grouping import GroupedDecoder
from app.rollout.generate import SamplingConfig, generate_groups
from tests.helpers import load, prompt_batch, tokenizer_of

KINDS = {"qwen2": ["text", "text"], "qwen2_vl": ["video", "text"], "qwen2_5_vl": ["text", "video+image"],
         "qwen3_vl": ["video", "image+video"], "qwen3_5": ["video", "image+video"]}


def prefill(model, prompts, sizes, chunk):
    """The first logits, the attention layers' K/V and (Qwen3.5) each sample's GDN conv tail and state."""
    decoder = GroupedDecoder(model, prompts, sizes, 4, prefill_chunk_size=chunk)
    try:
        states = [(c.clone(), s.clone()) for c, s in decoder.cache.recurrent.layers.values()]
        return decoder.logits, [(k.clone(), v.clone()) for k, v in filter(None, decoder.cache.prefix)], states
    finally:
        decoder.close()


@pytest.mark.parametrize("family", list(KINDS))
def test_chunked_prefill_gives_the_whole_prefills_cache_and_logits(family, tiny_checkpoints, videos):
    model, processor = load(family, tiny_checkpoints)
    prompts = prompt_batch(family, processor, videos, KINDS[family])
    width = prompts["attention_mask"].shape[1]
    assert prompts["attention_mask"].sum(1).unique().numel() == 2  # left padding in the batch
    with torch.no_grad():
        logits, cache, states = prefill(model, prompts, [2, 3], 0)
        assert bool(states) == (family == "qwen3_5")
        for chunk in (7, width // 2 + 1, width):  # chunk edges inside the video, the image, the padding
            chunked_logits, chunked_cache, chunked_states = prefill(model, prompts, [2, 3], chunk)
            torch.testing.assert_close(chunked_logits, logits, rtol=0, atol=1e-5)
            for (c, st), (cc, cst) in zip(states, chunked_states):  # the state carried over from chunk to chunk
                torch.testing.assert_close(cc, c, rtol=0, atol=1e-5)
                torch.testing.assert_close(cst, st, rtol=1e-4, atol=1e-5)
            mask = prompts["attention_mask"].bool()
            for (k, v), (ck, cv) in zip(cache, chunked_cache):  # relative 1e-5: Qwen3.5's K/V reach ~10
                torch.testing.assert_close(ck.transpose(1, 2)[mask], k.transpose(1, 2)[mask], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(cv.transpose(1, 2)[mask], v.transpose(1, 2)[mask], rtol=1e-5, atol=1e-5)
    if states:  # in float64 the GDN state carried from chunk to chunk is the whole prefill's, to 1e-12
        model64 = model.to(torch.float64)
        wide = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in prompts.items()}
        with torch.no_grad():
            _, cache, states = prefill(model64, wide, [2, 3], 0)
            _, chunked_cache, chunked_states = prefill(model64, wide, [2, 3], 7)
        real = prompts["attention_mask"].bool()
        worst = max(float((a.transpose(1, 2)[real] - b.transpose(1, 2)[real]).abs().max())
                    for pair, other in zip(cache, chunked_cache) for a, b in zip(pair, other))
        assert worst <= 1e-12, worst
        assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for pair, other in zip(states, chunked_states)
                   for a, b in zip(pair, other))
        model.float()
    greedy = SamplingConfig(temperature=0, max_new_tokens=8)
    tok = tokenizer_of(processor)
    whole = generate_groups(model, prompts, [2, 3], greedy, tokenizer=tok, eos_ids=[])
    chunked = generate_groups(model, prompts, [2, 3], greedy, tokenizer=tok, eos_ids=[], prefill_chunk_size=7)
    assert torch.equal(chunked.completion_ids, whole.completion_ids)
    torch.testing.assert_close(chunked.logprobs, whole.logprobs, rtol=0, atol=1e-5)


def frozen(family, checkpoints, plan):
    """A model whose tower is frozen (``outputs``) or whose projector alone trains (``blocks``)."""
    from app.grouping.vision.cache import PROJECTORS, tower_of

    model, processor = load(family, checkpoints)
    for name, param in tower_of(model).named_parameters():
        param.requires_grad_(plan == "blocks" and name.split(".")[0] in PROJECTORS)
    return model, processor


@pytest.mark.parametrize("plan", ["outputs", "blocks"])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_frame_chunked_tower_gives_the_whole_towers_output(family, plan, tiny_checkpoints, videos):
    from app.grouping.vision.cache import VisionCache, attach, detach, plan_for, tower_of

    model, processor = frozen(family, tiny_checkpoints, plan)
    visual = tower_of(model)
    assert plan_for(visual) == plan
    prompts = prompt_batch(family, processor, videos, ["video+video", "image+video"], fps=4.0)
    pixels, grid = prompts["pixel_values_videos"], prompts["video_grid_thw"]
    frames = grid[:, 0].tolist()
    assert max(frames) >= 3  # temporal patches to cut
    calls = []
    hook = visual.patch_embed.register_forward_hook(lambda *_: calls.append(1))
    outputs = {}
    for chunk in (0, 1, 2):
        cache = VisionCache(plan, store=False, chunk_frames=chunk)
        attach(model, cache)
        items = set(cache.item_keys(pixels, grid, next(visual.parameters()).dtype))  # distinct videos
        expected = sum(-(-key[1][0] // chunk) if chunk else 1 for key in items)
        assert cache.passes(visual, pixels, grid) == expected  # what ZeRO-3 ranks agree on
        calls.clear()
        out = visual(pixels, grid_thw=grid)
        assert len(calls) - (plan == "blocks") == expected  # blocks: then the live pass through the projector
        outputs[chunk] = out
        detach(model)
    hook.remove()
    assert len(calls) > len(frames)  # chunk 2 still cut the longest video
    whole = outputs[0]
    for chunk in (1, 2):
        torch.testing.assert_close(outputs[chunk].pooler_output, whole.pooler_output, rtol=0, atol=1e-5)
        for a, b in zip(getattr(outputs[chunk], "deepstack_features", None) or [],
                        getattr(whole, "deepstack_features", None) or []):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_long_prompt_rollout_with_both_chunkings_samples_what_the_whole_one_does(family, tiny_checkpoints, videos):
    from app.grouping.vision.cache import VisionCache, attach

    model, processor = frozen(family, tiny_checkpoints, "outputs")
    prompts = prompt_batch(family, processor, videos, ["video", "text", "image+video"], fps=4.0)
    tok = tokenizer_of(processor)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=5)
    runs = []
    for chunk_frames, prefill_chunk in ((0, 0), (1, 11)):
        attach(model, VisionCache("outputs", store=False, chunk_frames=chunk_frames))
        runs.append(generate_groups(model, prompts, [2, 1, 3], sampling, tokenizer=tok, eos_ids=[],
                                    prefill_chunk_size=prefill_chunk))
    assert torch.equal(runs[1].completion_ids, runs[0].completion_ids)
    torch.testing.assert_close(runs[1].logprobs, runs[0].logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("pads", [0, 3, 9])  # no padding; padding inside the past; past and the chunk's start
@pytest.mark.parametrize("past", [0, 7])
def test_chunk_attention_is_the_softmax_over_the_keys_each_query_sees(pads, past):
    """``prefill_chunk_attention`` (two fused calls merged by log-sum-exp, GQA, the padding as a key bias) against
    the softmax written out; a query that sees no key gets 0, never NaN."""
    from app.grouping.decoding.prefill import PrefillChunk, prefill_chunk_attention

    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, count, dim = 2, 4, 2, 5, 16
    q = torch.randn(batch, heads, count, dim, generator=generator)
    k, v = (torch.randn(batch, kv_heads, past + count, dim, generator=generator) for _ in range(2))
    real = torch.ones(batch, past + count, dtype=torch.bool)
    real[1, :pads] = False
    bias = torch.zeros(real.shape).masked_fill(~real, float("-inf"))[:, None, None, :] if pads else None
    out = prefill_chunk_attention(PrefillChunk(bias), q, k, v, None)
    visible = torch.ones(count, past + count, dtype=torch.bool).tril(past)[None, None] & real[:, None, None, :]
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) * dim**-0.5).masked_fill(~visible, float("-inf"))
    expected = torch.nan_to_num(torch.softmax(scores, -1)) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
