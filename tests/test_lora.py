"""LoRA (peft, injected in place) and frozen towers: grouped == repeated, the adapters-off reference == the base
model, merged export without peft, and a 2-process ZeRO-3 LoRA run that resumes exactly."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from types import SimpleNamespace

import pytest
import torch

from app.config.sections import LoRAConfig
from app.grouping import completion_logprobs
from app.runtime import lora
from tests.helpers import cut_back_copy, load, max_rel_diff, run_and_grad
from tests.test_equivalence import make_case
from tests.test_trainer import ROOT, assets, run, trainer, weights  # noqa: F401  (assets is a fixture)


def lora_cfg(**changes) -> LoRAConfig:
    cfg = LoRAConfig(rank=4, alpha=8.0)
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


def with_adapters(model, cfg, seed=0):
    """Inject adapters, then give lora_B non-zero values (peft starts it at 0, which would hide every bug)."""
    lora.apply(model, cfg)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3, generator=generator)
    return model


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen2"])
def test_grouped_equals_repeated_with_lora(family, tiny_checkpoints, videos):
    model, prompts, ids, mask, sizes = make_case(family, tiny_checkpoints, videos, seed=zlib.crc32(family.encode()) % 89)
    with_adapters(model, lora_cfg(vision_tower=True, projector=True))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    if family != "qwen2":
        assert any("visual" in n and "merger" not in n for n in trainable)  # vision tower adapters
        assert any("merger" in n for n in trainable)  # projector adapters
    ref_lp, _, ref_grads = run_and_grad(model, prompts, ids, mask, sizes, "repeated")
    lp, _, grads = run_and_grad(model, prompts, ids, mask, sizes, "grouped")
    assert max_rel_diff(lp, ref_lp) <= 1e-5
    assert set(grads) == set(ref_grads) == trainable
    worst = max(grads, key=lambda n: max_rel_diff(grads[n], ref_grads[n]))
    assert max_rel_diff(grads[worst], ref_grads[worst]) <= 1e-4, worst
    assert all(float(g.abs().max()) > 0 for g in grads.values())


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2"])
def test_adapters_off_equals_the_base_model_exactly(family, tiny_checkpoints, videos):
    _, prompts, ids, mask, sizes = make_case(family, tiny_checkpoints, videos, seed=11)
    base, _ = load(family, tiny_checkpoints)
    policy, _ = load(family, tiny_checkpoints)  # the same sharpened weights
    with_adapters(policy, lora_cfg(vision_tower=family != "qwen2"))
    with torch.no_grad():
        want = completion_logprobs(base, prompts, ids, mask, sizes).logprobs
        with lora.adapters_disabled(policy):
            got = completion_logprobs(policy, prompts, ids, mask, sizes).logprobs
        on = completion_logprobs(policy, prompts, ids, mask, sizes).logprobs
    assert torch.equal(got, want)
    assert not torch.allclose(on, want)  # the adapters do change the policy
    assert all(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)  # untouched by disabling


def test_freezing_towers_without_lora(tiny_checkpoints):
    model, _ = load("qwen2_5_vl", tiny_checkpoints, sharpen=None)
    frozen = lora.freeze(model, vision_tower=True, projector=False)
    parts = {n: lora.part_of(n) for n, _ in model.named_parameters()}
    assert {"language", "vision", "projector"} <= set(parts.values())
    assert frozen == sum(p.numel() for n, p in model.named_parameters() if parts[n] == "vision")
    for name, param in model.named_parameters():
        assert param.requires_grad == (parts[name] != "vision"), name
    cfg = SimpleNamespace(freeze_vision_tower=True, freeze_projector=True)
    lora.prepare(model, lora_cfg(rank=0), cfg)
    assert not any(p.requires_grad for n, p in model.named_parameters() if parts[n] != "language")
    with pytest.raises(ValueError, match="matches no Linear"):
        lora.apply(load("qwen2", tiny_checkpoints, sharpen=None)[0], lora_cfg(target_modules=["nothing"]))


def test_merged_state_dict_equals_the_adapted_model_and_loads_without_peft(tiny_checkpoints, videos, tmp_path):
    from app.runtime.models import load_model

    _, prompts, ids, mask, sizes = make_case("qwen2_5_vl", tiny_checkpoints, videos, seed=2)
    policy, processor = load("qwen2_5_vl", tiny_checkpoints)
    cfg = lora_cfg(projector=True)
    with_adapters(policy, cfg)
    plain = load_model(tiny_checkpoints["qwen2_5_vl"])
    merged = lora.merged_state_dict(policy.state_dict(), lora.scaling(cfg))
    plain.load_state_dict(merged, strict=True)
    with torch.no_grad():
        want = completion_logprobs(policy, prompts, ids, mask, sizes).logprobs
        got = completion_logprobs(plain, prompts, ids, mask, sizes).logprobs
    assert max_rel_diff(got, want) <= 1e-5
    plain.save_pretrained(tmp_path / "merged")
    processor.save_pretrained(tmp_path / "merged")
    check = ("import sys; sys.modules['peft'] = None\n"  # peft cannot be imported in this process
             "from app.runtime.models import load_model; m = load_model(sys.argv[1]); print(type(m).__name__)")
    result = subprocess.run([sys.executable, "-c", check, str(tmp_path / "merged")], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "Qwen2_5_VL" in result.stdout, result.stderr[-2000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_lora_training_resumes_exactly_and_exports(assets, tmp_path):  # noqa: F811
    from peft import PeftModel

    from app.runtime.models import load_model, load_processor

    settings = {"train.max_steps": 4, "train.save_every": 2, "lora.rank": 4, "lora.alpha": 16,
                "lora.projector": True, "train.learning_rate": 2e-2,
                "train.deepspeed_config": "deepspeed_configs/zero3.json", "model.gradient_checkpointing": True}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

    def command(out, **extra):
        return launch + trainer(assets, out, **settings, **extra)[1:]

    run(command(tmp_path / "straight"))
    # resumed from the step-2 checkpoint of a copy cut back to it, as a crash after step 3 leaves it (dying:
    # tests/test_crash.py); here the adapters' and their optimizer's states come back under ZeRO-3
    cut_back_copy(tmp_path / "straight", tmp_path / "resumed", 2)
    run(command(tmp_path / "resumed", **{"train.resume": True}))
    assert [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2, 3, 4]
    straight, resumed = weights(tmp_path / "straight" / "final"), weights(tmp_path / "resumed" / "final")
    initial = weights(assets["checkpoint"])
    assert straight.keys() == initial.keys()  # merged: the base model's own keys, no adapter keys
    changed = [n for n in straight if not torch.equal(straight[n], initial[n])]
    assert changed and all(n.endswith("_proj.weight") or "merger" in n for n in changed)  # only adapted layers
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=0, msg=name)
    metrics = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["kl"] > 0  # the adapters-off reference differs from the trained policy

    # The merged export generates; the adapter alone loads with peft onto the base and gives the same weights.
    model, processor = load_model(tmp_path / "straight" / "final"), load_processor(tmp_path / "straight" / "final")
    ids = processor.tokenizer("Hello", return_tensors="pt")["input_ids"]
    assert model.generate(input_ids=ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3
    adapted = PeftModel.from_pretrained(load_model(assets["checkpoint"]), tmp_path / "straight" / "final-adapter")
    merged, final = adapted.merge_and_unload().state_dict(), model.state_dict()  # both in the module's naming
    base = load_model(assets["checkpoint"]).state_dict()
    moved = [n for n in final if not torch.equal(final[n], base[n])]
    assert len(moved) == len(changed)
    for name in final:
        torch.testing.assert_close(merged[name], final[name], rtol=1e-5, atol=1e-6, msg=name)
