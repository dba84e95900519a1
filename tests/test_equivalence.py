"""Grouped vs repeated on the real transformers model classes: completion log-probs, logits, every gradient."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch

from app.grouping import GroupLayout, completion_logprobs, repeated_inputs, usable_backends
from app.grouping.positions import continue_after_media, packed_positions, prompt_positions, use_qwen_positions
from app.runtime.models import FAMILIES, QSA_FAMILIES, VL_FAMILIES, enable_activation_checkpointing
from tests.helpers import (
    load,
    max_rel_diff,
    prompt_batch,
    random_completions,
    run_and_grad,
    text_layers,
    tokenizer_of,
)

# qwen4_exp's exactness is tests/test_qsa.py's: its QSA layers choose their keys (the selections compared token by
# token) and its GDN decay gradients are held norm-relative, as that family's issue defines them
ATTENTION_FAMILIES = [f for f in FAMILIES if f not in QSA_FAMILIES]

LOGPROB_RTOL = 1e-5
GRAD_RTOL = 1e-4

PROMPT_KINDS = {
    "qwen2_vl": ["video", "text", "video"],
    "qwen2_5_vl": ["video", "image", "text"],
    "qwen3_vl": ["video", "video", "text"],
    "qwen3_5": ["video", "image", "text"],
    "qwen2": ["text", "text", "text"],
    "qwen3": ["text", "text", "text"],
    "qwen3_vl_moe": ["video", "image", "text"],
    "qwen3_5_moe": ["image", "video", "text"],
    "qwen4_exp": ["video", "image", "text"],
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
@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_grouped_equals_repeated(family, backend, checkpointing, tiny_checkpoints, videos):
    model, prompts, ids, mask, group_sizes = make_case(family, tiny_checkpoints, videos, seed=zlib.crc32(f"{family}{backend}".encode()) % 97)
    if checkpointing:
        enable_activation_checkpointing(model)
        model.train()
    layer_calls = []
    # The layer's own hooks sit outside the checkpoint; its token mixer's run again in the recompute.
    first = text_layers(model)[0]
    (first.linear_attn if hasattr(first, "linear_attn") else first.self_attn).register_forward_hook(
        lambda *args: layer_calls.append(1))
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
    """M-RoPE ids of each packed response are exactly get_rope_index's ids for the row [P;Ri] (each run of
    text or media placed past the largest id before it, as Qwen's code does: see the next test)."""
    model, prompts, ids, mask, group_sizes = make_case(family, tiny_checkpoints, videos, seed=3)
    layout = GroupLayout.from_masks(prompts["attention_mask"], mask, group_sizes)
    packed = packed_positions(layout, prompt_positions(model, prompts["input_ids"], prompts["attention_mask"], prompts))
    rows = repeated_inputs(model, prompts, ids, mask, group_sizes)
    owner = model.model
    kwargs = {k: rows[k] for k in ("video_grid_thw", "image_grid_thw", "second_per_grid_ts") if k in rows}
    full, _ = owner.get_rope_index(rows["input_ids"], mm_token_type_ids=rows["mm_token_type_ids"],
                                   attention_mask=rows["attention_mask"], **kwargs)
    full = continue_after_media(full, rows["mm_token_type_ids"], rows["attention_mask"])
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


def qwen_reference_positions(ids: list[int], config, grids: list[list[int]], seconds_per_grid: list[float]):
    """Qwen2.5-VL's M-RoPE ids of one unpadded video prompt, written from Qwen's released ``get_rope_index``
    (every text run starts at 1 + the largest id so far; a video's temporal ids are
    ``int(t * second_per_grid * tokens_per_second)``), independently of transformers."""
    merge, per_second = config.vision_config.spatial_merge_size, config.vision_config.tokens_per_second
    out, i, video = [], 0, 0
    while i < len(ids):
        start = max((max(p) for p in out), default=-1) + 1
        if ids[i] == config.video_token_id:
            t, h, w = grids[video]
            h, w = h // merge, w // merge
            for ti in range(t):
                for hi in range(h):
                    for wi in range(w):
                        out.append((start + int(ti * seconds_per_grid[video] * per_second), start + hi, start + wi))
            i, video = i + t * h * w, video + 1
        else:
            out.append((start, start, start))
            i += 1
    return torch.tensor(out).T  # [3, L]


def test_positions_after_a_long_video_follow_qwens_code(tiny_checkpoints, tmp_path):
    """A video longer than it is wide (its temporal ids run past max(h, w) / merge): the question after it and
    every response token get the ids of Qwen's own code (and vLLM's), not transformers 5.x's, in the prompt, the
    packed row, the repeated rows and HF generate (``use_qwen_positions``); grouped still equals repeated."""
    from app.data.video import write_mp4
    from app.rollout.generate import SamplingConfig, generate_groups
    from tests.helpers import load, prompt_batch, tokenizer_of

    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    clip = np.random.default_rng(0).integers(0, 255, (24, 56, 56, 3), dtype=np.uint8)
    video = write_mp4(tmp_path / "long.mp4", clip, fps=4)
    prompts = prompt_batch("qwen2_5_vl", processor, [video], ["video", "text"])
    t, h, w = prompts["video_grid_thw"][0].tolist()
    merge = model.config.vision_config.spatial_merge_size
    assert (t - 1) * float(prompts["second_per_grid_ts"][0]) * 2 > max(h, w) // merge  # the case in question
    mask = prompts["attention_mask"][0].bool()
    ours = prompt_positions(model, prompts["input_ids"], prompts["attention_mask"], prompts)[:, 0, mask]
    want = qwen_reference_positions(prompts["input_ids"][0][mask].tolist(), model.config, [[t, h, w]],
                                    prompts["second_per_grid_ts"].tolist())
    assert torch.equal(ours, want)
    assert int(ours[:, -1].min()) == int(ours.max())  # the prompt ends on its largest id: responses go on from it

    ids, cmask = random_completions([5, 3, 4], model.config.text_config.vocab_size, 0, seed=1)
    sizes = [2, 1]
    grouped = completion_logprobs(model, prompts, ids, cmask, sizes).logprobs
    repeated = completion_logprobs(model, prompts, ids, cmask, sizes, mode="repeated").logprobs
    assert max_rel_diff(grouped, repeated) <= LOGPROB_RTOL
    layout = GroupLayout.from_masks(prompts["attention_mask"], cmask, sizes)
    packed = packed_positions(layout, prompt_positions(model, prompts["input_ids"], prompts["attention_mask"], prompts))
    first = layout.response_starts[0]
    assert int(packed[0, 0, first]) == int(ours.max()) + 1

    greedy = SamplingConfig(temperature=0, max_new_tokens=6)
    mine = generate_groups(model, prompts, 1, greedy, tokenizer=tokenizer_of(processor), eos_ids=[])
    hf = generate_groups(model, prompts, 1, greedy, tokenizer=tokenizer_of(processor), eos_ids=[], engine="hf")
    assert torch.equal(mine.completion_ids, hf.completion_ids)


def test_continue_after_media_moves_only_what_follows_a_long_video():
    """Unit: runs start past the largest id so far; images / already-placed ids / padding are left alone, and
    ``use_qwen_positions`` applies it to the model's own ``get_rope_index`` once (rope_deltas follow)."""
    # text(0,1) video(t ids 2,6 ; h,w 2..3) text -> HF-5.x-style text after the video at 2 + 2 = 4
    video = [[2, 2, 2], [2, 2, 3], [6, 2, 2], [6, 2, 3]]
    rows = [[0, 0, 0], [1, 1, 1], *video, [4, 4, 4], [5, 5, 5]]
    positions = torch.tensor(rows).T[:, None, :]
    kinds = torch.tensor([[0, 0, 2, 2, 2, 2, 0, 0]])
    fixed = continue_after_media(positions, kinds)
    assert fixed[0, 0].tolist() == [0, 1, 2, 2, 6, 6, 7, 8] and fixed[1, 0, 6:].tolist() == [7, 8]
    assert torch.equal(continue_after_media(fixed, kinds), fixed)  # idempotent
    image = torch.tensor([[0, 0, 0], [1, 1, 1], [2, 2, 2], [2, 2, 3], [2, 3, 2], [2, 3, 3], [4, 4, 4]]).T[:, None]
    assert torch.equal(continue_after_media(image, torch.tensor([[0, 0, 1, 1, 1, 1, 0]])), image)
    padded = torch.cat([torch.ones(3, 1, 2, dtype=torch.long), positions], dim=2)
    fixed_padded = continue_after_media(padded, torch.cat([torch.zeros(1, 2, dtype=torch.long), kinds], 1),
                                        torch.tensor([[0, 0] + [1] * 8]))
    assert torch.equal(fixed_padded[:, :, 2:], fixed) and fixed_padded[:, :, :2].eq(1).all()

    class Owner(torch.nn.Module):
        def get_rope_index(self, input_ids, mm_token_type_ids=None, attention_mask=None):
            return positions.clone(), torch.tensor([[positions.max() + 1 - 8]])

    owner = Owner()
    use_qwen_positions(owner)
    use_qwen_positions(owner)  # once only
    got, delta = owner.get_rope_index(torch.zeros(1, 8, dtype=torch.long), mm_token_type_ids=kinds)
    assert torch.equal(got, fixed) and int(delta) == 8 + 1 - 8
