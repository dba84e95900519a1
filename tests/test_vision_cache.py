"""The frozen vision tower's cache (``forward.vision_cache``): one tower pass per media item per step, and the same
bits as without it.

Each test runs what a step runs on the same prompts (a rollout-like forward of the whole batch, then reference,
old-policy and policy forwards of micro-batches) once with the cache kept for the step and once with every call
encoding its own items, and compares log-probs and every trainable gradient bitwise. The counts show that the cache
was used (so equality is not that of two uncached runs) and that each item went through the tower once.
"""

from __future__ import annotations

import json

import pytest
import torch

from app.config.sections import LoRAConfig
from app.data.prompts import collate_prompts
from app.grouping import completion_logprobs
from app.grouping.forward import split_vision_inputs
from app.grouping.vision import cache as vision_cache
from app.runtime.lora import apply as apply_lora
from tests.helpers import load, prompt_batch, random_completions, tokenizer_of, world_of_one
from tests.test_trainer import assets, overrides, run, weights  # noqa: F401  (assets: fixture)

KINDS = {"video": ["video", "video", "video"], "image": ["image", "image", "text"],
         "mixed": ["video", "image", "text"]}
SETUPS = {  # what trains in the tower -> the plan the cache takes
    "frozen": "outputs",  # model.freeze_vision_tower + freeze_projector
    "projector_trains": "blocks",  # model.freeze_vision_tower only
    "lora": "outputs",  # adapters on the language model: the whole tower frozen
    "lora_projector": "blocks",  # lora.projector: adapters on the merger(s)
}


def one_prompt_inputs(model, prompts: dict) -> list[dict]:
    """The batch cut back into single-prompt processor outputs (for micro-batches of any composition)."""
    pieces = split_vision_inputs(model, prompts)
    out = []
    for b, piece in enumerate(pieces):
        keep = prompts["attention_mask"][b].bool()
        item = {"input_ids": prompts["input_ids"][b][keep][None], "attention_mask": prompts["attention_mask"][b][keep][None]}
        if prompts.get("mm_token_type_ids") is not None:
            item["mm_token_type_ids"] = prompts["mm_token_type_ids"][b][keep][None]
        out.append({**item, **piece})
    return out


def prepared(family: str, setup: str, checkpoints):
    model, processor = load(family, checkpoints)
    if setup.startswith("lora"):
        apply_lora(model, LoRAConfig(rank=4, alpha=8, projector=setup == "lora_projector"))
        with torch.no_grad():  # non-zero adapters, so their gradients and outputs are not trivially equal
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    else:
        for name, p in model.named_parameters():
            if "visual" in name.split("."):
                p.requires_grad_(setup == "projector_trains" and any(k in name for k in vision_cache.PROJECTORS))
    return model, processor


def a_step(model, processor, prompts: dict, setting: str) -> tuple[list, dict, dict]:
    """Rollout-like forward of all prompts, then per micro-batch ([0, 1] and [2]) a reference and an old-policy
    forward without gradient and a policy forward with; log-probs of each, gradients summed, the cache's counts."""
    tok = tokenizer_of(processor)
    cache = vision_cache.install(model, setting)
    try:
        singles = one_prompt_inputs(model, prompts)
        ids, mask = random_completions([4, 6, 3, 5, 2, 6], len(tok), tok.pad_token_id)
        outs = []
        with torch.no_grad():
            outs.append(completion_logprobs(model, prompts, ids, mask, [2, 2, 2]).logprobs)
        model.zero_grad(set_to_none=True)
        for rows in ([0, 1], [2]):
            batch = collate_prompts([singles[r] for r in rows], tok.pad_token_id)
            sub = torch.cat([torch.arange(2 * r, 2 * r + 2) for r in rows])
            for mode in ("grouped", "repeated"):
                with torch.no_grad():
                    outs.append(completion_logprobs(model, batch, ids[sub], mask[sub], 2, mode=mode).logprobs)
            scores = completion_logprobs(model, batch, ids[sub], mask[sub], 2)
            (scores.logprobs * torch.linspace(0.5, 1.5, ids.shape[1])).sum().backward()
            outs.append(scores.logprobs.detach())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return outs, grads, cache.counts()
    finally:
        vision_cache.detach(model)


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("kinds", list(KINDS))
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_cache_on_equals_off_bitwise(family, kinds, setup, tiny_checkpoints, videos):
    model, processor = prepared(family, setup, tiny_checkpoints)
    assert vision_cache.plan_for(model.model.visual) == SETUPS[setup]
    prompts = prompt_batch(family, processor, videos, KINDS[kinds])
    on_logprobs, on_grads, on = a_step(model, processor, prompts, "step")
    off_logprobs, off_grads, off = a_step(model, processor, prompts, "off")
    for got, want in zip(on_logprobs, off_logprobs, strict=True):
        assert torch.equal(got, want)
    assert set(on_grads) == set(off_grads) and on_grads
    if SETUPS[setup] == "blocks":
        assert any("merger" in n for n in on_grads)  # the projector still trains through the cached blocks
    for name in off_grads:
        assert torch.equal(on_grads[name], off_grads[name]), name
    items = on["items"]
    assert items == sum(k != "text" for k in KINDS[kinds])  # distinct images/videos in the batch
    assert on["tower_items"] == items  # one tower pass per item for the whole step
    assert on["cache_hits"] > 0 and off["tower_items"] > on["tower_items"]


def test_a_cached_forward_skips_the_tower_and_a_changed_item_misses(tiny_checkpoints, videos):
    model, processor = prepared("qwen2_5_vl", "frozen", tiny_checkpoints)
    prompts = prompt_batch("qwen2_5_vl", processor, videos, ["video", "image"])
    tok = tokenizer_of(processor)
    ids, mask = random_completions([3, 4], len(tok), tok.pad_token_id)
    blocks = []
    handle = model.model.visual.blocks[0].register_forward_pre_hook(lambda m, a: blocks.append(a[0].shape[0]))
    cache = vision_cache.install(model, "step")
    with torch.no_grad():
        first = completion_logprobs(model, prompts, ids, mask, 1).logprobs
        calls = len(blocks)
        again = completion_logprobs(model, prompts, ids, mask, 1).logprobs
        assert len(blocks) == calls == 2 and torch.equal(first, again)  # one pass per item, then none
        # the model's own call of each modality, and no item pass in it
        assert vision_cache.cache_of(model).calls_needed(model.model.visual, prompts) == ("image", "video")
        changed = dict(prompts, pixel_values_videos=prompts["pixel_values_videos"] + 0.5)  # same shapes
        assert vision_cache.cache_of(model).calls_needed(model.model.visual, changed) == ("image", "video", "video")
        completion_logprobs(model, changed, ids, mask, 1)
        assert len(blocks) == 3  # only the changed video was encoded
        assert cache.clear()["tower_items"] == 3 and not cache.entries
    handle.remove()
    vision_cache.detach(model)
    assert "forward" not in model.model.visual.__dict__


def test_the_run_cache_outlives_a_step_bounded_and_keyed_by_pixels(tiny_checkpoints, videos):
    """forward.vision_cache=run: a video seen at one step is served at the next (no tower pass, the same bits); a
    changed video (other pixels under the same tokens) is encoded anew; past the size bound the least recently
    used item is dropped."""
    model, processor = prepared("qwen2_5_vl", "frozen", tiny_checkpoints)
    prompts = prompt_batch("qwen2_5_vl", processor, videos, ["video", "image"])
    tok = tokenizer_of(processor)
    ids, mask = random_completions([3, 4], len(tok), tok.pad_token_id)
    blocks = []
    handle = model.model.visual.blocks[0].register_forward_pre_hook(lambda m, a: blocks.append(a[0].shape[0]))
    cache = vision_cache.install(model, "run", keep_gib=1.0)
    with torch.no_grad():
        first = completion_logprobs(model, prompts, ids, mask, 1).logprobs
        assert cache.clear()["tower_items"] == 2 and len(cache.entries) == 2  # the step ends; the items stay
        again = completion_logprobs(model, prompts, ids, mask, 1).logprobs
        assert len(blocks) == 2 and torch.equal(first, again) and cache.counts()["cache_hits"] == 2
        changed = dict(prompts, pixel_values_videos=prompts["pixel_values_videos"] + 0.5)
        completion_logprobs(model, changed, ids, mask, 1)
        assert len(blocks) == 3  # a changed file is never served from the cache
        video = [k for k in cache.entries if k[1][0] > 1]  # the newest video entry is the last used
        cache.keep_bytes = max(vision_cache._nbytes(e) for e in cache.entries.values())  # room for one item
        cache.clear()
        assert list(cache.entries) == [video[-1]]  # the least recently used went first
    handle.remove()
    vision_cache.detach(model)


def test_tower_that_trains_is_never_cached(tiny_checkpoints):
    model, _ = load("qwen3_vl", tiny_checkpoints)
    assert vision_cache.plan_for(model.model.visual) == "count"
    model.model.visual.blocks[0].mlp.requires_grad_(False)
    assert vision_cache.plan_for(model.model.visual) == "count"  # other blocks still train
    assert vision_cache.cached_blocks(model.model.visual) == sorted(
        {len(model.model.visual.blocks) - 1, *model.model.visual.deepstack_visual_indexes})


# ---- through the recipe -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("setup", [{"lora.rank": 4, "grpo.beta": 0.04},
                                   {"model.freeze_vision_tower": True, "grpo.beta": 0.04}],
                         ids=["lora", "projector_trains"])
def test_grpo_steps_equal_with_the_cache_on_and_off(setup, assets, tmp_path, monkeypatch):  # noqa: F811
    """Two GRPO steps in this process (temporal GRPO on, mu=2, a reference forward, two micro-batches): the same
    weights bit for bit with the cache on and off, and the logged counter says one tower pass per item."""
    from app.config.loading import load_config
    from app.training.trainer import GRPOTrainer

    results = {}
    for setting in ("step", "off"):
        cfg = load_config("configs/demo_cpu.yaml", overrides(assets, tmp_path / setting, **{
            **setup, "forward.vision_cache": setting, "rewards.temporal": True, "grpo.num_iterations": 2,
            "train.prompts_per_rank": 2, "train.groups_per_micro_batch": 1, "rollout.group_size": 2,
            "rollout.max_completion_length": 4}))
        with world_of_one(monkeypatch):
            trainer = GRPOTrainer(cfg)
            metrics = [trainer.train_step(step) for step in range(2)]
            trainer.vision_cache.clear()
            state = {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters()}
        results[setting] = metrics, state
    (on_metrics, on_state), (off_metrics, off_state) = results["step"], results["off"]
    for name in off_state:
        assert torch.equal(on_state[name], off_state[name]), name
    for on, off in zip(on_metrics, off_metrics):
        assert on["vision/tower_passes_per_item"] == 1.0
        assert off["vision/tower_passes_per_item"] >= 3.0  # rollout, reference, old policy, policy (+ repeats)
        assert on["vision/cache_hits"] > 0 and on["reward/mean"] == off["reward/mean"]


# (the projector-training plan is compared bitwise in process above; here: the plan that skips the tower, and a
# tower that trains, which runs the model's own call)
ZERO3_SETUPS = {"frozen": {"model.freeze_vision_tower": True, "model.freeze_projector": True},
                "tower_trains": {}}


@pytest.mark.distributed
@pytest.mark.slow  # 38-61 s (2 processes, 3 runs): make test-all and CI run it
@pytest.mark.parametrize("setup", ["frozen", "tower_trains"])
def test_zero3_two_ranks_with_a_text_only_rank_equal_with_the_cache_on_and_off(setup, assets, tmp_path):  # noqa: F811
    """Two ranks under ZeRO-3 with DeepSpeed's hooks on in the rollout too (per_step), rank 0 with an image and a
    video, rank 1 text only: every rank must call the same modules in the same order (DeepSpeed checks its module
    trace), whatever is cached, so rank 1 makes dummy calls with as many item passes as rank 0 makes. The same
    weights bit for bit with the cache on and off; a tower that trains runs as the model's own call. With the
    long-video settings (frame-chunked tower, chunked prefill) the passes and calls still line up."""
    from tests.test_mixed_modalities import mixed_file

    data = mixed_file(assets, tmp_path, "text")
    finals, logged = {}, {}
    # chunked: long-video settings (the tower one temporal patch per pass, the prefill 16 positions per call): more
    # tower passes and decoder calls on rank 0 than on its text-only peer, which pads with dummy passes and idle calls
    chunked = {"forward.vision_cache": "step", "forward.vision_chunk_frames": 1, "rollout.prefill_chunk_size": 16}
    runs = {"step": {"forward.vision_cache": "step"}, "off": {"forward.vision_cache": "off"}, "chunked": chunked}
    for setting in ("step", "off", "chunked") if setup != "tower_trains" else ("step",):
        out = tmp_path / setting
        run(["bash", "scripts/train.sh", "configs/demo_cpu.yaml", *overrides(assets, out, **{
            "data.train_file": data, "data.data_root": "/", "data.shuffle": False, "train.prompts_per_rank": 2,
            "train.groups_per_micro_batch": 1, "grpo.num_iterations": 2, **ZERO3_SETUPS[setup],
            **runs[setting], "rollout.zero3_gather": "per_step",
            "train.deepspeed_config": "deepspeed_configs/zero3.json"})], env={"NPROC_PER_NODE": "2"}, timeout=400)
        finals[setting] = weights(out / "final")
        logged[setting] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if setup == "tower_trains":
        assert all(row["vision/tower_passes_per_item"] >= 3.0 for row in logged["step"])
        return
    initial = weights(assets["checkpoint"])
    assert sum(not torch.equal(finals["off"][n], initial[n]) for n in initial) > len(initial) // 3
    for name in finals["off"]:
        assert torch.equal(finals["step"][name], finals["off"][name]), name
    assert all(row["vision/tower_passes_per_item"] == 1.0 for row in logged["step"])
    assert all(row["vision/tower_passes_per_item"] > 1.0 for row in logged["off"])
    # chunked: the same rollouts and rewards; weights within float summation order of the whole-pass run
    for row, whole in zip(logged["chunked"], logged["step"]):
        assert row["reward/mean"] == whole["reward/mean"] and row["completion_length"] == whole["completion_length"]
        assert whole["vision/tower_passes"] == whole["vision/tower_items"] < row["vision/tower_passes"]
    drift = max(float((finals["chunked"][n] - finals["step"][n]).abs().max()) for n in initial)
    moved = max(float((finals["step"][n] - initial[n]).abs().max()) for n in initial)
    assert drift < 1e-4 < moved, (drift, moved)
