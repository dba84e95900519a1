"""LoRA on a mixture-of-experts model (app.runtime.lora): adapters on the routed experts' fused weights through
peft's target_parameters (``lora.target_parameters``), grouped == repeated, the merged export equal to the adapted
model, the adapters-off reference equal to the base model; the routers frozen by default; a LoRA config that
reaches no routed expert says so by name, one whose expert name matches nothing stops."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from app.config.sections import LoRAConfig, ModelConfig
from app.grouping import completion_logprobs
from app.grouping.experts.blocks import sparse_layers
from app.runtime import lora
from app.runtime.models import MOE_FAMILIES
from tests.helpers import max_rel_diff
from tests.test_equivalence import make_case

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def lora_scores(model, case, mode):
    _, prompts, ids, mask, sizes = case
    model.zero_grad(set_to_none=True)
    scores = completion_logprobs(model, prompts, ids, mask, sizes, mode)
    (scores.logprobs * torch.linspace(0.5, 1.5, ids.shape[1])).sum().backward()
    return scores.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_lora_on_the_routed_experts_is_exact_grouped_merged_and_adapters_off(family, tiny_checkpoints, videos,
                                                                            tmp_path):
    """Adapters on attention (and GDN, shared expert: lora.target_modules) and on every routed expert: grouped ==
    repeated (log-probs 1e-5, every adapter's gradient 1e-4; an expert no token chose gets no adapter gradient in
    either layout); the merged weights (lora.merged_state_dict) and the adapter alone in peft's format
    (lora.save_adapter, loaded by peft.PeftModel.from_pretrained) give the adapted model's log-probs; adapters off
    gives the base model's bit for bit; the routers stay frozen."""
    from peft import PeftModel

    case = make_case(family, tiny_checkpoints, videos, seed=21)
    model, prompts, ids, mask, sizes = case
    base = copy.deepcopy(model)
    cfg = LoRAConfig(rank=2, alpha=4.0, target_parameters=EXPERTS)
    lora.prepare(model, cfg, ModelConfig(path="x"))
    with torch.no_grad():  # non-zero adapters, so the merge and the gradients are not trivially equal
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    layers = sparse_layers(model)
    assert layers and all(not p.requires_grad for s in layers for p in s.block.gate.parameters())
    expert_adapters = [n for n, p in model.named_parameters() if ".experts." in n and p.requires_grad]
    assert len(expert_adapters) == 4 * len(layers) and all("lora_" in n for n in expert_adapters)
    grouped, grads = lora_scores(model, case, "grouped")
    repeated, ref_grads = lora_scores(model, case, "repeated")
    assert max_rel_diff(grouped, repeated) <= 1e-5
    assert set(grads) == set(ref_grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    worst = max(grads, key=lambda n: max_rel_diff(grads[n], ref_grads[n]))
    assert max_rel_diff(grads[worst], ref_grads[worst]) <= 1e-4, worst
    assert all(grads[n].abs().sum() > 0 for n in expert_adapters if "lora_B" in n)

    merged = copy.deepcopy(base)
    merged.load_state_dict(lora.merged_state_dict(model.state_dict(), lora.scaling(cfg)), strict=True)
    with torch.no_grad():
        as_merged = completion_logprobs(merged, prompts, ids, mask, sizes).logprobs
        with lora.adapters_disabled(model):
            off = completion_logprobs(model, prompts, ids, mask, sizes).logprobs
        plain = completion_logprobs(base, prompts, ids, mask, sizes).logprobs
    assert max_rel_diff(as_merged, grouped) <= 1e-5 and max_rel_diff(as_merged, plain) > 1e-3
    assert torch.equal(off, plain)
    saved = lora.save_adapter(model.state_dict(), cfg, tmp_path / "adapter", "base")
    reloaded = PeftModel.from_pretrained(copy.deepcopy(base), str(saved)).get_base_model()  # adapters in place
    with torch.no_grad():
        as_saved = completion_logprobs(reloaded, prompts, ids, mask, sizes).logprobs
    assert max_rel_diff(as_saved, grouped) <= 1e-5


def test_lora_that_reaches_no_routed_expert_says_so_and_a_wrong_name_stops(tiny_checkpoints, caplog):
    """The default lora.target_modules on an MoE model: a warning naming the fused expert weights and the key that
    adapts them; a lora.target_parameters entry that matches nothing: a ValueError naming it and the real names."""
    from app.runtime.models import load_model

    model = load_model(tiny_checkpoints["qwen3_5_moe"])
    with caplog.at_level(logging.WARNING, logger="app.runtime.lora"):
        lora.prepare(copy.deepcopy(model), LoRAConfig(rank=2, alpha=4.0), ModelConfig(path="x"))
    assert "LoRA adapts none of the 4 sparse layers' routed experts (down_proj, gate_up_proj" in caplog.text
    assert "the shared expert is adapted" in caplog.text and "lora.target_parameters=" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="app.runtime.lora"):
        lora.prepare(copy.deepcopy(model), LoRAConfig(rank=2, alpha=4.0, target_parameters=EXPERTS),
                     ModelConfig(path="x"))
    assert "routed experts" not in caplog.text
    with pytest.raises(ValueError, match="'mlp.experts.up_proj' matches no parameter of Qwen3_5MoeForConditional"
                                         ".*mlp.experts.gate_up_proj"):
        lora.prepare(copy.deepcopy(model), LoRAConfig(rank=2, alpha=4.0, target_parameters=["mlp.experts.up_proj"]),
                     ModelConfig(path="x"))


def test_full_weight_training_freezes_the_routers_unless_asked(tiny_checkpoints):
    from app.runtime.models import load_model

    model = load_model(tiny_checkpoints["qwen3_vl_moe"])
    frozen = lora.prepare(copy.deepcopy(model), LoRAConfig(rank=0), ModelConfig(path="x"))
    trained = lora.prepare(copy.deepcopy(model), LoRAConfig(rank=0), ModelConfig(path="x", train_router=True))
    routers = lambda m: [p.requires_grad for s in sparse_layers(m) for p in s.block.gate.parameters()]  # noqa: E731
    assert routers(frozen) and not any(routers(frozen)) and all(routers(trained))
    assert all(p.requires_grad for s in sparse_layers(frozen) for p in s.block.experts.parameters())
