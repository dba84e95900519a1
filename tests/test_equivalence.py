"""Grouped vs repeated on the real transformers model classes: completion log-probs, logits, every gradient."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from app.grouping import GroupLayout, completion_logprobs, repeated_inputs, usable_backends
from app.grouping.positions import packed_positions, prompt_positions
from app.models import FAMILIES, VL_FAMILIES, enable_activation_checkpointing
from tests.helpers import load, max_rel_diff, prompt_batch, random_completions, run_and_grad, text_layers, tokenizer_of

LOGPROB_RTOL = 1e-5
GRAD_RTOL = 1e-4

PROMPT_KINDS = {
    "qwen2_vl": ["video", "text", "video"],
    "qwen2_5_vl": ["video", "image", "text"],
    "qwen3_vl": ["video", "video", "text"],
    "qwen2": ["text", "text", "text"],
    "qwen3": ["text", "text", "text"],
}


def make_case(family, checkpoints, videos, seed):
    model, processor = load(family, checkpoints)
    rng = random.Random(seed)
    prompts = prompt_batch(family, processor, videos, PROMPT_KINDS[family])
    group_sizes = [1, 3, rng.randint(2, 4)]
    lengths = [rng.randint(1, 20) for _ in range(sum(group_sizes))]
    lengths[rng.randrange(len(lengths))] = 1  # always one single-token completion
    tok = tokenizer_of(processor)
    # Ordinary tokens only (a real tokenizer's added tokens include the vision placeholders, refused in completions).
    ids, mask = random_completions(lengths, min(len(tok), tok.vocab_size), tok.pad_token_id, width=max(lengths) + 2,
                                   seed=seed)
    return model, prompts, ids, mask, group_sizes


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("backend", usable_backends("cpu"))
@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_equals_repeated(family, backend, checkpointing, tiny_checkpoints, videos):
    model, prompts, ids, mask, group_sizes = make_case(family, tiny_checkpoints, videos, seed=zlib.crc32(f"{family}{backend}".encode()) % 97)
    if checkpointing:
        enable_activation_checkpointing(model)
        model.train()
    layer_calls = []
    # The layer's own hooks sit outside the checkpoint; its attention module's run again in the recompute.
    text_layers(model)[0].self_attn.register_forward_hook(lambda *args: layer_calls.append(1))
    ref_lp, ref_logits, ref_grads = run_and_grad(model, prompts, ids, mask, group_sizes, "repeated")
    lp, logits, grads = run_and_grad(model, prompts, ids, mask, group_sizes, "grouped", backend)
    assert len(layer_calls) == (4 if checkpointing else 2)  # checkpointing recomputes each layer in backward

    assert max_rel_diff(lp, ref_lp) <= LOGPROB_RTOL
    assert max_rel_diff(logits, ref_logits) <= LOGPROB_RTOL
    assert set(grads) == set(ref_grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    worst = max(grads, key=lambda n: max_rel_diff(grads[n], ref_grads[n]))
    assert max_rel_diff(grads[worst], ref_grads[worst]) <= GRAD_RTOL, worst
    if family in VL_FAMILIES:
        vision = [n for n in grads if ".visual." in n or n.startswith("model.visual")]
        assert vision and all(ref_grads[n].abs().sum() > 0 for n in vision)


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_response_positions_equal_those_in_prefix_plus_response(family, tiny_checkpoints, videos):
    """M-RoPE ids of each packed response are exactly get_rope_index's ids for the row [P;Ri]."""
    model, prompts, ids, mask, group_sizes = make_case(family, tiny_checkpoints, videos, seed=3)
    layout = GroupLayout.from_masks(prompts["attention_mask"], mask, group_sizes)
    packed = packed_positions(layout, prompt_positions(model, prompts["input_ids"], prompts["attention_mask"], prompts))
    rows = repeated_inputs(model, prompts, ids, mask, group_sizes)
    owner = model.model
    kwargs = {k: rows[k] for k in ("video_grid_thw", "image_grid_thw", "second_per_grid_ts") if k in rows}
    full, _ = owner.get_rope_index(rows["input_ids"], mm_token_type_ids=rows["mm_token_type_ids"],
                                   attention_mask=rows["attention_mask"], **kwargs)
    width = prompts["input_ids"].shape[1]
    for n, start in enumerate(layout.response_starts):
        length = layout.completion_lens[n]
        expected = full[:, n, width : width + length]
        assert torch.equal(packed[:, 0, start : start + length], expected)
    assert int(prompts["video_grid_thw"][:, 0].max()) > 1  # several temporal patches: the video case is exercised


def test_wrong_positions_and_leaky_attention_are_detected(tiny_checkpoints, videos, monkeypatch):
    """The comparison has teeth: an off-by-three position or responses seeing each other fail it by far."""
    import app.grouping.attention as attention_module
    import app.grouping.forward as forward_module

    model, prompts, ids, mask, group_sizes = make_case("qwen2_5_vl", tiny_checkpoints, videos, seed=5)
    with torch.no_grad():
        ref = completion_logprobs(model, prompts, ids, mask, group_sizes, mode="repeated").logprobs
        good = completion_logprobs(model, prompts, ids, mask, group_sizes, backend="packed").logprobs
        assert max_rel_diff(good, ref) <= LOGPROB_RTOL

        real_positions = forward_module.packed_positions
        monkeypatch.setattr(forward_module, "packed_positions",
                            lambda layout, pos: real_positions(layout, pos) + 3 * (layout.segment_ids > 0))
        shifted = completion_logprobs(model, prompts, ids, mask, group_sizes, backend="packed").logprobs
        assert max_rel_diff(shifted, ref) > 100 * LOGPROB_RTOL
        monkeypatch.setattr(forward_module, "packed_positions", real_positions)

        monkeypatch.setitem(attention_module._BACKEND_FNS, "masked",
                            lambda plan, q, k, v, scale, dropout: attention_module._sdpa(q, k, v, is_causal=True))
        leaky = completion_logprobs(model, prompts, ids, mask, group_sizes, backend="masked").logprobs
        assert max_rel_diff(leaky, ref) > 100 * LOGPROB_RTOL


def test_vision_tower_runs_once_per_prompt_when_grouped(tiny_checkpoints, videos):
    model, prompts, ids, mask, group_sizes = make_case("qwen2_5_vl", tiny_checkpoints, videos, seed=7)
    seen = []
    handle = model.model.visual.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    with torch.no_grad():
        completion_logprobs(model, prompts, ids, mask, group_sizes, mode="grouped")
        grouped_patches = sum(seen)
        seen.clear()
        completion_logprobs(model, prompts, ids, mask, group_sizes, mode="repeated")
    handle.remove()
    per_prompt = [int(grid.prod()) for grid in prompts["video_grid_thw"]] + [int(g.prod()) for g in prompts["image_grid_thw"]]
    assert grouped_patches == sum(per_prompt)
    assert sum(seen) == sum(p * g for p, g in zip(per_prompt, group_sizes))
