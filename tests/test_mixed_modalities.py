"""Mixed image / video / text batches under ZeRO-3 with 2 processes (issue: gloo 'collective mismatch').

Video-R1's data mixes images and videos. Under ZeRO-3 every module call all-gathers its parameters collectively,
so a rank whose micro-batch holds an image and a video (two vision-tower calls) and a rank with videos only (one
call) or text only (none) must still issue the same collectives. The data below puts exactly those mixes on the two
ranks in the same step (data.shuffle=false: rank r takes records r, r+2, ...).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.test_trainer import assets, overrides, run, weights  # noqa: F401  (assets is a fixture)

pytestmark = pytest.mark.distributed


def mixed_file(assets, tmp_path: Path, rank1_kind: str) -> Path:  # noqa: F811
    """Step 1: rank 0 gets [image, video], rank 1 gets [video, video] or [text, text]; step 2 likewise."""
    source = Path(assets["train"])
    videos = [json.loads(line) for line in source.read_text().splitlines()]
    image = tmp_path / "frame.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 84, 3), dtype=np.uint8)).save(image)
    image_record = {**videos[0], "problem_id": "img", "data_type": "image", "path": str(image),
                    "problem": "What colour is the square in the picture?"}
    text_record = {**videos[0], "problem_id": "txt", "data_type": "text", "problem": "What colour is a lemon?"}
    text_record.pop("path")
    other = videos[1] if rank1_kind == "video" else text_record
    rows = []
    for step in range(2):
        rank0 = [image_record, videos[2 + 2 * step]]
        rank1 = [other, videos[3 + 2 * step] if rank1_kind == "video" else text_record]
        for a, b in zip(rank0, rank1):
            rows += [a, b]
    for row in rows:
        if row.get("path") and not Path(row["path"]).is_absolute():
            row["path"] = str(source.parent / row["path"])
    out = tmp_path / f"mixed_{rank1_kind}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


@pytest.mark.slow  # about a minute (ZeRO-2 and ZeRO-3 runs of 2 processes); a text-only rank under ZeRO-3: the
# T-GRPO test below and tests/test_vision_cache.py's two-rank runs
@pytest.mark.parametrize("rank1_kind", ["video"])
def test_zero3_mixed_modalities_equal_zero2(rank1_kind, assets, tmp_path):  # noqa: F811
    data = mixed_file(assets, tmp_path, rank1_kind)
    finals = {}
    for zero in ("zero3", "zero2"):
        out = tmp_path / zero
        run(["bash", "scripts/train.sh", "configs/demo_cpu.yaml", *overrides(assets, out, **{
            "data.train_file": data, "data.data_root": "/", "data.shuffle": False,
            "train.prompts_per_rank": 2, "train.groups_per_micro_batch": 2,
            "train.deepspeed_config": f"deepspeed_configs/{zero}.json"})], env={"NPROC_PER_NODE": "2"})
        finals[zero] = weights(out / "final")
    initial = weights(assets["checkpoint"])
    z3, z2 = finals["zero3"], finals["zero2"]
    assert sum(not torch.equal(z2[n], initial[n]) for n in z2) > len(z2) // 2
    for name in z2:
        if initial[name].abs().max() > 0:
            assert (z3[name] - z2[name]).norm() / z2[name].norm() <= 1e-4, name
        else:  # zero-initialised biases: compare with the update itself, as the grouped-vs-repeated test does
            assert (z3[name] - z2[name]).norm() / (z2[name] - initial[name]).norm().clamp_min(1e-12) <= 1e-3, name


def test_temporal_grpo_under_zero3_with_a_text_only_rank(assets, tmp_path):  # noqa: F811
    """rewards.temporal=true under ZeRO-3 when rank 1's prompts have no video: rank 0's shuffled-frame rollout
    gathers parameters collectively, so rank 1 joins with a throwaway rollout instead of leaving it hanging."""
    data = mixed_file(assets, tmp_path, "text")
    out = tmp_path / "temporal"
    run(["bash", "scripts/train.sh", "configs/demo_cpu.yaml", *overrides(assets, out, **{
        "data.train_file": data, "data.data_root": "/", "data.shuffle": False, "train.max_steps": 1,
        "train.prompts_per_rank": 2, "train.groups_per_micro_batch": 2, "rewards.temporal": True,
        "train.export_hf": False, "train.deepspeed_config": "deepspeed_configs/zero3.json"})],
        env={"NPROC_PER_NODE": "2"}, timeout=300)
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["step"] == 1 and "reward/temporal" in metrics


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("kinds", [["video", "text"], ["image", "text"], ["text", "text"]])
def test_dummy_vision_calls_are_exact_and_in_model_order(family, kinds, tiny_checkpoints, videos):
    """Forcing both tower calls on a batch that needs fewer changes no value and no gradient (bitwise), runs the
    tower for image then video, and gives the tower a (zero) gradient even when the batch is text only."""
    from app.grouping import completion_logprobs
    from tests.helpers import load, prompt_batch, random_completions, tokenizer_of

    model, processor = load(family, tiny_checkpoints)
    prompts = prompt_batch(family, processor, videos, kinds)
    tok = tokenizer_of(processor)
    ids, mask = random_completions([3, 5, 2], len(tok), tok.pad_token_id)
    runs = {}
    for name, calls in (("plain", None), ("aligned", ("image", "video"))):
        seen = []
        handle = model.model.visual.register_forward_pre_hook(
            lambda m, args, seen=seen: seen.append(int(args[0].shape[0])))
        model.zero_grad(set_to_none=True)
        scores = completion_logprobs(model, prompts, ids, mask, [2, 1], vision_calls=calls)
        scores.logprobs.sum().backward()
        handle.remove()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        runs[name] = (scores.logprobs.detach(), grads, seen)
    (lp, grads, _), (lp_aligned, grads_aligned, seen) = runs["plain"], runs["aligned"]
    assert torch.equal(lp, lp_aligned)
    assert len(seen) == 2
    merge = model.config.vision_config.spatial_merge_size
    dummy = merge * merge
    if "image" not in kinds:
        assert seen[0] == dummy  # the missing image call comes first, as in the model's own order
    if "video" not in kinds:
        assert seen[1] == dummy
    visual = {n for n, p in model.named_parameters() if ".visual." in n or n.startswith("model.visual")}
    assert visual <= set(grads_aligned)  # every tower parameter has a gradient, zero where the batch had no media
    for name, grad in grads_aligned.items():
        expected = grads.get(name)
        assert torch.equal(grad, expected) if expected is not None else not grad.any(), name


def test_two_rank_evaluation_on_mixed_data(assets, tmp_path):  # noqa: F811
    from tests.test_evaluate import run_eval

    data = mixed_file(assets, tmp_path, "text")
    out = tmp_path / "eval"
    run_eval({"model": assets["checkpoint"], "data": data}, out, nproc=2, extra=["data.data_root=/"])
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == len({r["key"] for r in rows}) >= 3  # image, video and text records all answered


@pytest.mark.slow
def test_the_judge_under_zero3_with_an_image_rank_and_a_text_rank(assets, tmp_path):  # noqa: F811
    """rewards.functions with judge under ZeRO-3, 2 processes: the judge is partitioned like the reference, and a
    rank judging an image + video question and a rank judging text ones still issue the same collectives (every
    judge forward makes both tower calls), so the run neither hangs nor dies."""
    data = mixed_file(assets, tmp_path, "text")
    out = tmp_path / "judged"
    run(["bash", "scripts/train.sh", "configs/demo_cpu.yaml", *overrides(assets, out, **{
        "data.train_file": data, "data.data_root": "/", "data.shuffle": False, "train.max_steps": 2,
        "train.prompts_per_rank": 2, "train.groups_per_micro_batch": 2, "train.export_hf": False,
        "rewards.functions": "[format, judge]", "rewards.judge_path": assets["checkpoint"],
        "train.deepspeed_config": "deepspeed_configs/zero3.json"})], env={"NPROC_PER_NODE": "2"}, timeout=300)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and all(0 < m["reward/judge"] < 1 for m in lines)
