"""Routing replay (R3, arXiv 2510.11370) on the mixture-of-experts families: the grouped engine samples them as HF
does and records which experts every token went to (each prompt once, each completion token at the step that fed
it); the training forwards replay that record in either layout, exactly."""

from __future__ import annotations

import pytest
import torch

from app.grouping import completion_logprobs
from app.grouping.experts.routing import Routing
from app.rollout.generate import SamplingConfig, generate_groups, select_groups
from app.runtime.models import MOE_FAMILIES
from tests.helpers import load, prompt_batch, tokenizer_of

KINDS = {"qwen3_vl_moe": ["video", "text"], "qwen3_5_moe": ["text", "video"]}
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=9, seed=4)


def setup(family, checkpoints, videos):
    model, processor = load(family, checkpoints)
    prompts = prompt_batch(family, processor, videos, KINDS[family])
    return model, prompts, tokenizer_of(processor)


def fed(mask: torch.Tensor) -> torch.Tensor:
    """The completion tokens a rollout fed back (all but each completion's last)."""
    lengths = mask.sum(1)
    return mask.bool() & (torch.arange(mask.shape[1])[None, :] < (lengths - 1)[:, None])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_grouped_engine_samples_moe_models_as_hf_and_every_decode_setting_does(family, tiny_checkpoints,
                                                                                   videos):
    model, prompts, tok = setup(family, tiny_checkpoints, videos)
    ours = generate_groups(model, prompts, [3, 2], SAMPLING, tokenizer=tok, eos_ids=[])
    assert len({tuple(r) for r in ours.completion_ids.tolist()}) > 1  # sampled, not greedy
    hf = generate_groups(model, prompts, [3, 2], SAMPLING, tokenizer=tok, eos_ids=[], engine="hf")
    assert torch.equal(ours.completion_ids, hf.completion_ids)
    torch.testing.assert_close(ours.logprobs, hf.logprobs, rtol=0, atol=1e-5)
    for settings in ({"prefill_chunk_size": 5}, {"decode": "static"}):
        other = generate_groups(model, prompts, [3, 2], SAMPLING, tokenizer=tok, eos_ids=[], **settings)
        assert torch.equal(ours.completion_ids, other.completion_ids), settings
    with torch.no_grad():
        forward = completion_logprobs(model, prompts, ours.completion_ids, ours.completion_mask, [3, 2])
    torch.testing.assert_close(ours.logprobs, forward.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_rollout_records_the_experts_the_forward_routes_each_prompt_once(family, tiny_checkpoints, videos):
    """float32: the record of the prefill and of every decode step equals the experts a full forward of [P;Ri]
    routes (no near-tie on these weights); the prompt's is held once per group; chunked prefill and a static decode
    setting (run eagerly to record) record the same; sampling is unchanged by recording."""
    model, prompts, tok = setup(family, tiny_checkpoints, videos)
    plain = generate_groups(model, prompts, [3, 2], SAMPLING, tokenizer=tok)
    rollout = generate_groups(model, prompts, [3, 2], SAMPLING, tokenizer=tok, record_routing=True)
    assert torch.equal(plain.completion_ids, rollout.completion_ids) and plain.routing is None
    record = rollout.routing
    layers, k = len(record.layers), record.top_k
    assert record.prompt.dtype == torch.int16 and record.prompt.shape == (*prompts["input_ids"].shape, layers, k)
    assert record.completion.shape == (*rollout.completion_ids.shape, layers, k)
    with torch.no_grad():
        free = completion_logprobs(model, prompts, rollout.completion_ids, rollout.completion_mask, [3, 2],
                                   mode="repeated", record_routing=True).routing
    real = prompts["attention_mask"].bool()
    assert torch.equal(record.prompt[real].sort(-1).values, free.prompt[real].sort(-1).values)
    assert bool((record.prompt[~real] == -1).all())
    used = fed(rollout.completion_mask)
    assert used.any() and torch.equal(record.completion[used].sort(-1).values, free.completion[used].sort(-1).values)
    assert bool((record.completion[~rollout.completion_mask.bool()] == -1).all())  # past each completion: nothing
    for settings in ({"prefill_chunk_size": 4}, {"decode": "static"}):
        again = generate_groups(model, prompts, [3, 2], SAMPLING, tokenizer=tok, record_routing=True, **settings)
        assert torch.equal(again.completion_ids, rollout.completion_ids), settings
        assert torch.equal(again.routing.prompt[real].sort(-1).values, record.prompt[real].sort(-1).values)
        assert torch.equal(again.routing.completion[used].sort(-1).values,
                           record.completion[used].sort(-1).values), settings
    picked = select_groups([rollout, rollout], [(1, 1), (0, 0)], tok.pad_token_id)  # dynamic sampling's re-draws
    assert torch.equal(picked.routing.prompt[0], record.prompt[1]) and torch.equal(picked.routing.prompt[1],
                                                                                   record.prompt[0])
    assert torch.equal(picked.routing.completion[:2], record.completion[3:, :picked.routing.completion.shape[1]])
    with pytest.raises(ValueError, match="routing_replay=r3 records routing in rollout.engine=grouped only"):
        generate_groups(model, prompts, [3, 2], SAMPLING, tokenizer=tok, engine="hf", record_routing=True)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_update_replays_the_rollouts_experts_in_both_layouts(family, tiny_checkpoints, videos):
    """The rollout's record replayed: grouped == repeated (log-probs 1e-5, gradients 1e-4, routers included); on the
    same weights no token's router would choose otherwise; a record sending tokens elsewhere changes the
    log-probs and is counted (``replay_differs``)."""
    from app.grouping.experts.blocks import expert_shape
    from tests.helpers import max_rel_diff

    model, prompts, tok = setup(family, tiny_checkpoints, videos)
    rollout = generate_groups(model, prompts, [3, 2], SAMPLING, tokenizer=tok, record_routing=True)
    ids, mask = rollout.completion_ids, rollout.completion_mask

    def run(mode, routing):
        model.zero_grad(set_to_none=True)
        scores = completion_logprobs(model, prompts, ids, mask, [3, 2], mode=mode, routing=routing)
        (scores.logprobs * torch.linspace(0.5, 1.5, ids.shape[1])[None]).sum().backward()
        return scores, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    grouped, grads = run("grouped", rollout.routing)
    repeated, ref = run("repeated", rollout.routing)
    assert max_rel_diff(grouped.logprobs, repeated.logprobs) <= 1e-5
    assert set(grads) == set(ref) and any("gate" in n for n in grads)  # the router learns through the gate weights
    assert max(max_rel_diff(grads[n], ref[n]) for n in grads) <= 1e-4
    differs, replayed = grouped.replay_differs.tolist()
    recorded = int((rollout.routing.completion >= 0).all(-1).all(-1).sum())  # fed tokens (a last one may be too)
    assert recorded >= int(fed(mask).sum())
    assert differs == 0 and replayed == int(prompts["attention_mask"].sum()) + recorded  # each prompt token once
    free, _ = run("grouped", None)
    torch.testing.assert_close(grouped.logprobs, free.logprobs, rtol=0, atol=1e-6)

    record = rollout.routing
    moved = record.completion.clone()
    experts = expert_shape(model).experts
    moved[fed(mask)] = (moved[fed(mask)] + 1) % experts  # every fed completion token to a neighbouring expert
    wrong = Routing(record.prompt, moved, record.layers)
    shifted, _ = run("grouped", wrong)
    assert shifted.replay_differs[0] > 0 and not torch.allclose(shifted.logprobs, grouped.logprobs, atol=1e-4)
