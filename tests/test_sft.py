"""The SFT recipe: loss on the target tokens only, the same data/DeepSpeed/checkpoint/export rooms as GRPO, exact
resume, and a GRPO run from its export."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from app.training.sft import target_text
from tests.helpers import world_of_one
from tests.test_trainer import assert_trained_and_equal, assets, overrides, run  # noqa: F401  (assets: fixture)

pytestmark = pytest.mark.distributed


def cot_file(assets, root: Path) -> Path:  # noqa: F811
    """The trainer's records in Video-R1-COT's shape: a `process` with the reasoning, then the solution."""
    lines = []
    for i, line in enumerate(Path(assets["train"]).read_text().splitlines()):
        record = json.loads(line)
        record["process"] = f"<think>Frame by frame, the square is what matters here ({i}).</think>"
        lines.append(json.dumps(record))
    (root / "cot.jsonl").write_text("\n".join(lines) + "\n")
    return root / "cot.jsonl"


def test_target_text():
    assert target_text({"process": "<think>a</think>", "solution": "<answer>B</answer>"}) == \
        "<think>a</think>\n<answer>B</answer>"
    assert target_text({"process": "  ", "solution": "<answer>B</answer>"}) == "<answer>B</answer>"


def test_loss_is_the_nll_of_the_target_tokens_only(assets, tmp_path, monkeypatch):  # noqa: F811
    from app.config.loading import load_config
    from app.grouping.forward import repeated_inputs
    from app.runtime.models import load_model
    from app.training.sft import SFTTrainer

    data = Path(assets["train"]).parent
    cfg = load_config("configs/demo_cpu.yaml", overrides(assets, tmp_path / "run", **{
        "data.train_file": cot_file(assets, tmp_path), "data.data_root": data, "train.learning_rate": 0.0,
        "train.prompts_per_rank": 2, "train.groups_per_micro_batch": 2, "logging.wandb_mode": "disabled",
        "forward.logprob_chunk_size": 5, "sft.max_target_length": 64}))
    with world_of_one(monkeypatch):  # a DeepSpeed world of one in this process, fully torn down after
        trainer = SFTTrainer(cfg)
        start = trainer.stream.position
        metrics = trainer.train_step(0)
    # By hand: the same two records through the plain model, [prompt; target] rows, NLL over target tokens only.
    trainer.stream.position = start
    prompts = trainer.stream.next_prompts(2)
    tokenizer = trainer.tokenizer
    targets = [tokenizer(target_text(p.record), add_special_tokens=False)["input_ids"] + [trainer.end_of_turn]
               for p in prompts]
    width = max(map(len, targets))
    ids = torch.tensor([t + [tokenizer.pad_token_id] * (width - len(t)) for t in targets])
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in targets])
    from app.data.prompts import collate_prompts

    model = load_model(assets["checkpoint"])
    batch = repeated_inputs(model, collate_prompts([p.inputs for p in prompts], tokenizer.pad_token_id), ids, mask,
                            [1, 1])
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits[:, -width - 1:-1].float()
    nll = -(torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1) * mask).sum() / mask.sum()
    assert metrics["loss"] == pytest.approx(float(nll), rel=1e-5)
    assert metrics["tokens/target"] == int(mask.sum())


@pytest.mark.slow  # about 40-55 s on 2 cores: two scripts/sft.sh runs, a kill and a GRPO start
def test_sft_sh_resumes_exactly_and_grpo_starts_from_its_export(assets, tmp_path):  # noqa: F811
    data = Path(assets["train"]).parent
    settings = {"data.train_file": cot_file(assets, tmp_path), "data.data_root": data, "train.max_steps": 4,
                "train.save_every": 2, "train.learning_rate": 2e-3, "train.prompts_per_rank": 2,
                "train.groups_per_micro_batch": 1, "sft.max_target_length": 64}

    def sft(out, **extra):
        return ["bash", "scripts/sft.sh", "configs/demo_cpu.yaml", *overrides(assets, out, **settings, **extra)]

    run(sft(tmp_path / "straight"))
    crashed = run(sft(tmp_path / "resumed"), env={"PREFIX_GRPO_CRASH_AFTER_STEP": "3"}, check=False)
    assert crashed.returncode == 17
    run(sft(tmp_path / "resumed", **{"train.resume": True}))
    assert_trained_and_equal(tmp_path / "resumed" / "final", tmp_path / "straight" / "final", assets["checkpoint"])
    losses = [json.loads(line)["loss"] for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and losses[-1] < losses[0]  # it learns the targets
    # GRPO from the SFT export, through the normal launcher.
    run([sys.executable, "-m", "app.training.trainer", "configs/demo_cpu.yaml",
         *overrides(assets, tmp_path / "grpo", **{"model.path": tmp_path / "straight" / "final",
                                                  "train.max_steps": 1})])
    assert (tmp_path / "grpo" / "final" / "model.safetensors").is_file()
