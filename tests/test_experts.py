"""Mixture-of-experts models in the grouped layout (app.grouping.experts): every token routed to the same experts as
in the repeated layout, the router's statistics and load-balancing loss counted per logical token (equal in both
layouts, exactly), replayed routing, the experts implementations, on the real Qwen3-VL-MoE and Qwen3.5-MoE classes.
Grouped == repeated of the whole model (log-probs, every gradient) runs in tests/test_equivalence.py,
test_families.py, test_tree.py and test_logprobs.py, which take both MoE families."""

from __future__ import annotations

import pytest
import torch

from app.grouping import completion_logprobs
from app.grouping.checks.routing import disagreements
from app.grouping.experts.blocks import choose_experts_implementation, expert_shape, sparse_layers
from app.grouping.experts.record import Routing
from app.grouping.experts.routers import RoutingError
from app.objectives.router import load_balancing_loss, router_metrics
from app.runtime.models import MOE_FAMILIES, enable_activation_checkpointing
from tests.helpers import max_rel_diff
from tests.test_equivalence import make_case


def scored(model, case, mode, **kwargs):
    _, prompts, ids, mask, sizes = case
    model.zero_grad(set_to_none=True)
    scores = completion_logprobs(model, prompts, ids, mask, sizes, mode, router_statistics="loss",
                                 record_routing=True, **kwargs)
    aux = load_balancing_loss(scores.router)
    (scores.logprobs.sum() + 10.0 * aux).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return scores, aux.detach(), grads


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_token_meets_the_same_experts_and_the_router_counts_logical_tokens(family, checkpointing,
                                                                                 tiny_checkpoints, videos):
    """Top-k ids per token and sparse layer equal in both layouts; the router's sums (each prompt token weighted
    by the responses that share it) and the load-balancing loss equal, and so its gradient, the router's and every
    expert's included; an expert no token chose has no gradient in either layout."""
    case = make_case(family, tiny_checkpoints, videos, seed=13)
    model, prompts, _, mask, sizes = case
    if checkpointing:
        enable_activation_checkpointing(model)
        model.train()
    shape = expert_shape(model)
    assert shape is not None and len(shape.layers) >= 2
    if family == "qwen3_vl_moe":  # mlp_only_layers: dense and sparse layers mixed
        assert len(shape.layers) < model.config.text_config.num_hidden_layers
    repeated, repeated_aux, repeated_grads = scored(model, case, "repeated")
    grouped, grouped_aux, grouped_grads = scored(model, case, "grouped")
    assert disagreements(grouped.routing, repeated.routing, prompts["attention_mask"], mask)["tokens"] == 0
    real = int(prompts["attention_mask"].sum()) + int(mask.sum())
    assert grouped.layout.packed_tokens < real + sum((g - 1) * int(m.sum()) for g, m in
                                                      zip(sizes, prompts["attention_mask"]))
    # the weight is the repeated layout's real-token count, exactly
    expected = sum(g * int(m.sum()) for g, m in zip(sizes, prompts["attention_mask"])) + int(mask.sum())
    assert float(grouped.router.tokens) == float(repeated.router.tokens) == expected
    assert torch.equal(grouped.router.load, repeated.router.load)
    assert max_rel_diff(grouped.router.probability, repeated.router.probability) <= 1e-6
    assert abs(float(grouped_aux) - float(repeated_aux)) <= 1e-6 * float(repeated_aux)
    assert set(grouped_grads) == set(repeated_grads)
    worst = max(grouped_grads, key=lambda n: max_rel_diff(grouped_grads[n], repeated_grads[n]))
    assert max_rel_diff(grouped_grads[worst], repeated_grads[worst]) <= 1e-4, worst
    routers = [n for n in grouped_grads if n.endswith("mlp.gate.weight")]
    assert len(routers) == len(shape.layers) and all(grouped_grads[n].abs().sum() > 0 for n in routers)
    for sparse in sparse_layers(model):  # experts no token chose: zero rows in both layouts
        name = next(n for n, p in model.named_parameters() if p is sparse.block.experts.gate_up_proj)
        chosen = set(grouped.routing.prompt[..., shape.layers.index(sparse.index), :].flatten().tolist()) | \
            set(grouped.routing.completion[..., shape.layers.index(sparse.index), :].flatten().tolist())
        for expert in range(shape.experts):
            used = expert in chosen
            assert bool(grouped_grads[name][expert].abs().sum() > 0) == used
            assert bool(repeated_grads[name][expert].abs().sum() > 0) == used
    metrics = router_metrics(grouped.router)
    assert metrics == router_metrics(repeated.router) or all(
        abs(metrics[k] - v) <= 1e-5 * max(1.0, abs(v)) for k, v in router_metrics(repeated.router).items())
    assert metrics["router/load_max_over_mean"] >= 1.0 and metrics["router/entropy"] > 0


def test_the_load_balancing_loss_is_transformers_own(tiny_checkpoints, videos):
    """On the repeated rows, transformers' ``load_balancing_loss_func`` over the model's own router logits (with
    the attention mask) is our loss of the same forward."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    from app.grouping import repeated_inputs

    model, prompts, ids, mask, sizes = make_case("qwen3_vl_moe", tiny_checkpoints, videos, seed=2)
    with torch.no_grad():
        ours = load_balancing_loss(completion_logprobs(model, prompts, ids, mask, sizes, "repeated",
                                                       router_statistics="metrics").router)
        batch = repeated_inputs(model, prompts, ids, mask, sizes)
        from app.grouping.positions import prompt_positions

        batch["position_ids"] = prompt_positions(model, batch["input_ids"], batch["attention_mask"], batch)
        out = model(**batch, output_router_logits=True, use_cache=False)
    text = model.config.text_config
    theirs = load_balancing_loss_func(out.router_logits, text.num_experts, text.num_experts_per_tok,
                                      batch["attention_mask"])
    assert abs(float(ours) - float(theirs)) <= 1e-5 * float(theirs)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_statistics_do_not_depend_on_how_groups_are_packed(family, tiny_checkpoints, videos):
    """The same completions scored as one packed row and as one row per group: the sums add up to the same."""
    model, prompts, ids, mask, sizes = make_case(family, tiny_checkpoints, videos, seed=4)
    with torch.no_grad():
        whole = completion_logprobs(model, prompts, ids, mask, sizes, router_statistics="metrics").router
        parts, start = [], 0
        for g, size in enumerate(sizes):
            one = {k: v[g:g + 1] for k, v in prompts.items() if k in ("input_ids", "attention_mask",
                                                                       "mm_token_type_ids")}
            from app.grouping.forward import split_vision_inputs

            one.update(split_vision_inputs(model, prompts)[g])
            parts.append(completion_logprobs(model, one, ids[start:start + size], mask[start:start + size], [size],
                                             router_statistics="metrics").router)
            start += size
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    assert float(total.tokens) == float(whole.tokens)
    assert torch.equal(total.load, whole.load)
    assert max_rel_diff(total.probability, whole.probability) <= 1e-6
    assert abs(float(load_balancing_loss(total)) - float(load_balancing_loss(whole))) <= 1e-6


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_replayed_routing_is_followed_in_both_layouts_and_the_router_still_learns(family, tiny_checkpoints,
                                                                                    videos):
    """Routing recorded in one forward and replayed (R3): both layouts route every token as recorded, agree
    (log-probs 1e-5, gradients 1e-4), and the router gets a gradient through the recomputed gate weights. A
    record that routes otherwise changes the log-probs (the replay is real)."""
    model, prompts, ids, mask, sizes = make_case(family, tiny_checkpoints, videos, seed=8)
    with torch.no_grad():
        recorded = completion_logprobs(model, prompts, ids, mask, sizes, record_routing=True).routing
    shape = expert_shape(model)
    other = Routing((recorded.prompt + 1) % shape.experts, (recorded.completion + 1) % shape.experts,
                    recorded.layers)  # every token to other experts (still distinct within a token)
    other.prompt[recorded.prompt < 0] = -1
    other.completion[recorded.completion < 0] = -1
    runs = {}
    for mode in ("repeated", "grouped"):
        model.zero_grad(set_to_none=True)
        scores = completion_logprobs(model, prompts, ids, mask, sizes, mode, routing=other, record_routing=True)
        scores.logprobs.sum().backward()
        runs[mode] = scores, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert disagreements(scores.routing, other, prompts["attention_mask"], mask)["tokens"] == 0
    (g, g_grads), (r, r_grads) = runs["grouped"], runs["repeated"]
    assert max_rel_diff(g.logprobs, r.logprobs) <= 1e-5
    worst = max(g_grads, key=lambda n: max_rel_diff(g_grads[n], r_grads[n]))
    assert max_rel_diff(g_grads[worst], r_grads[worst]) <= 1e-4, worst
    assert all(g_grads[n].abs().sum() > 0 for n in g_grads if n.endswith("mlp.gate.weight"))
    with torch.no_grad():
        fresh = completion_logprobs(model, prompts, ids, mask, sizes).logprobs
    assert max_rel_diff(g.logprobs, fresh) > 1e-3


def test_a_routing_record_that_does_not_cover_the_tokens_names_the_prompt(tiny_checkpoints, videos):
    model, prompts, ids, mask, sizes = make_case("qwen3_vl_moe", tiny_checkpoints, videos, seed=9)
    with torch.no_grad():
        recorded = completion_logprobs(model, prompts, ids, mask, sizes, record_routing=True).routing
        holed = Routing(recorded.prompt.clone(), recorded.completion.clone(), recorded.layers)
        last = int(prompts["attention_mask"][2].nonzero()[-1])
        holed.prompt[2, last, 0, 0] = -1
        with pytest.raises(RoutingError, match="prompt 2: the routing record of its prompt token"):
            completion_logprobs(model, prompts, ids, mask, sizes, routing=holed)
        wrong = Routing(recorded.prompt.clone(), recorded.completion.clone(), recorded.layers)
        wrong.completion[1, 0, 0, 1] = 99
        with pytest.raises(RoutingError, match="prompt 1: .*completion 1.* names expert ids"):
            completion_logprobs(model, prompts, ids, mask, sizes, routing=wrong)
        with pytest.raises(RoutingError, match="sparse layers"):
            completion_logprobs(model, prompts, ids, mask, sizes,
                                routing=Routing(recorded.prompt, recorded.completion, (5, 7)))
        # each completion's last token needs no record (the rollout never fed it back)
        lengths = mask.sum(1)
        tail = Routing(recorded.prompt, recorded.completion.clone(), recorded.layers)
        tail.completion[torch.arange(len(lengths)), lengths - 1] = -1
        again = completion_logprobs(model, prompts, ids, mask, sizes, routing=tail).logprobs
        plain = completion_logprobs(model, prompts, ids, mask, sizes).logprobs
        assert max_rel_diff(again, plain) <= 1e-6


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_grouped_mm_experts_equal_eager_ones(family, tiny_checkpoints, videos):
    """``grouped_mm`` (what ``model.experts_implementation=auto`` picks where torch has it) and ``batched_mm``
    against ``eager``: the same log-probs and gradients, grouped and repeated."""
    model, prompts, ids, mask, sizes = make_case(family, tiny_checkpoints, videos, seed=6)
    assert choose_experts_implementation("auto") == "grouped_mm"
    assert model.config.get_text_config()._experts_implementation == "grouped_mm"  # load_model's choice
    runs = {}
    for impl in ("grouped_mm", "eager", "batched_mm"):
        model.set_experts_implementation(impl)
        assert model.config.get_text_config()._experts_implementation == impl
        for mode in ("grouped", "repeated"):
            model.zero_grad(set_to_none=True)
            scores = completion_logprobs(model, prompts, ids, mask, sizes, mode)
            scores.logprobs.sum().backward()
            runs[impl, mode] = scores.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    for mode in ("grouped", "repeated"):
        for impl in ("grouped_mm", "batched_mm"):
            (a, a_grads), (b, b_grads) = runs[impl, mode], runs["eager", mode]
            assert max_rel_diff(a, b) <= 1e-6, impl
            assert all(max_rel_diff(a_grads[n], b_grads[n]) <= 1e-5 for n in a_grads if a_grads[n] is not None), impl


def _grouped_only(monkeypatch, change):
    """Apply ``change`` (a context manager factory) around every grouped forward the self-check runs."""
    from app.grouping.checks import selfcheck

    real = selfcheck.completion_logprobs

    def patched(model, prompts, ids, mask, sizes, mode="grouped", **kwargs):
        if mode != "grouped":
            return real(model, prompts, ids, mask, sizes, mode, **kwargs)
        with change():
            return real(model, prompts, ids, mask, sizes, mode, **kwargs)

    monkeypatch.setattr(selfcheck, "completion_logprobs", patched)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_bf16_self_check_tells_a_router_tie_from_a_routing_defect_and_names_the_part(family, tiny_checkpoints,
                                                                                         videos, monkeypatch):
    """bf16 self-check on both families: it passes and reports how many tokens met other experts in the two layouts.
    Router noise at bf16's rounding, in the grouped layout only, flips near-ties: the check routes the repeated
    layout (and its float32 reference) as the grouped one was and passes, saying so. 5% of the grouped layout's
    tokens sent to a neighbouring expert is not a tie: it stops, with the gap, naming the part. The experts' output off by 2% in the
    grouped layout (float32): it stops and names a routed-experts layer as the first part that differed."""
    import contextlib

    from app.grouping import GroupingMismatchError, verify_grouping
    from app.grouping.experts import plan as routing_module
    from tests.test_bf16 import bf16_rounded
    from tests.test_bf16 import case as bf16_case

    model32, model16, processor = bf16_rounded(family, tiny_checkpoints)
    prompts, ids, mask, sizes = bf16_case(family, processor, videos, seed=2)
    result = verify_grouping(model16, prompts, ids, mask, sizes)
    assert result.flips is not None and "tokens met other experts in the two layouts" in result.describe()
    real_route = routing_module.RoutePlan.route

    def patched_router(choose):
        """The grouped layout's routers choose through ``choose(logits, indices, layer) -> (scores, indices)``."""
        @contextlib.contextmanager
        def change():
            def route(self, router, hidden_states, layer):
                fresh = router.fresh  # the router as this call routes it (a new one per call: changed for it alone)

                def chosen(hidden):
                    logits, _, indices = fresh(hidden)
                    return (logits, *choose(logits, indices, layer))
                router.fresh = chosen
                return real_route(self, router, hidden_states, layer)
            with monkeypatch.context() as patch:
                patch.setattr(routing_module.RoutePlan, "route", route)
                yield
        return change

    def renormalised(logits, picked):
        top = torch.softmax(logits.float(), -1).gather(-1, picked)
        return (top / top.sum(-1, keepdim=True)).to(logits.dtype), picked

    def near_tie(logits, indices, layer):  # near-ties decided the other way, as rounding does
        noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(layer)) * 0.02
        x = logits.float()
        return renormalised(logits, torch.topk(x + noise * x.std(-1, keepdim=True), indices.shape[-1]).indices)

    with monkeypatch.context() as patch:
        _grouped_only(patch, patched_router(near_tie))
        tied = verify_grouping(model32, prompts, ids, mask, sizes)  # float32: a flip is far outside 1e-4 unreplayed
    assert tied.flips["tokens"] > 0 and tied.replayed, tied.describe()
    assert "rounding near router ties" in tied.describe()

    experts = expert_shape(model16).experts

    def misrouted(logits, indices, layer):
        moved = torch.rand(indices.shape[0], generator=torch.Generator().manual_seed(layer)) < 0.05
        return renormalised(logits, torch.where(moved[:, None], (indices + 1) % experts, indices))

    with monkeypatch.context() as patch:
        _grouped_only(patch, patched_router(misrouted))
        with pytest.raises(GroupingMismatchError, match=r"routers rank well below their own top-k.*the first token "
                           r"routed apart: (prompt|completion) \d+'s token \d+ at sparse layer \d+ \(decoder layer "
                           r"\d+\): experts \[") as failure:
            verify_grouping(model16, prompts, ids, mask, sizes)
    assert "tokens met other experts" in str(failure.value)

    block = sparse_layers(model32)[0].block
    experts_type = type(block.experts)

    @contextlib.contextmanager
    def off_by_two_percent():
        real_forward = experts_type.forward
        with monkeypatch.context() as patch:
            patch.setattr(experts_type, "forward", lambda self, *a, **k: real_forward(self, *a, **k) * 1.02)
            yield

    with monkeypatch.context() as patch:
        _grouped_only(patch, off_by_two_percent)
        with pytest.raises(GroupingMismatchError, match=r"first layer whose output differs is layer \d+, a routed "
                                                        r"experts layer \(experts\)") as failure:
            verify_grouping(model32, prompts, ids, mask, sizes)
    assert "cannot change a router or its experts" in str(failure.value)


def test_a_deep_copy_of_a_patched_model_runs_its_own_layers(tiny_checkpoints, videos):
    """The grouping core patches GDN layers, decoder layers and routers per instance; a deep copy made after those
    patches (a float64 reference, a frozen copy) must run ITS weights, not the original's, in every layout: the copy
    with its GDN projections and routers zeroed scores otherwise than the original, and a plain copy the same."""
    import copy

    model, prompts, ids, mask, sizes = make_case("qwen3_5_moe", tiny_checkpoints, videos, seed=4)
    with torch.no_grad():
        completion_logprobs(model, prompts, ids, mask, sizes, record_routing=True)  # every patch installed
        same, changed = copy.deepcopy(model), copy.deepcopy(model)
        for name, p in changed.named_parameters():
            if "linear_attn.in_proj" in name or ".mlp.gate." in name:
                p.zero_()
        for mode in ("grouped", "repeated"):
            before = completion_logprobs(model, prompts, ids, mask, sizes, mode, record_routing=True).logprobs
            # a copy's tensors are laid out afresh: its kernels round the same numbers by up to 5e-7 here
            copied = completion_logprobs(same, prompts, ids, mask, sizes, mode, record_routing=True).logprobs
            assert max_rel_diff(copied, before) <= 1e-6, mode
            other = completion_logprobs(changed, prompts, ids, mask, sizes, mode, record_routing=True).logprobs
            assert max_rel_diff(other, before) > 1e-2, mode


def _modules_called(model, run) -> list[str]:
    """The modules holding parameters of their own, in the order a forward calls them: the order ZeRO-3's hooks
    gather parameters in (a rank whose order differs from another's waits on a gather the other never makes)."""
    order: list[str] = []
    handles = [module.register_forward_pre_hook(lambda m, args, name=name: order.append(name))
               for name, module in model.named_modules() if next(module.parameters(recurse=False), None) is not None]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return order


class _PerExpertBlock(torch.nn.Module):
    """A sparse block as older MoE code held it (DeepSpeed #4966/#5008's case): one module per expert, called only
    for the experts its tokens chose."""

    def __init__(self, hidden=8, experts=4):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, x):
        chosen = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            out[chosen == e] = self.experts[e](x[chosen == e])
        return out


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_which_modules_a_forward_calls_does_not_depend_on_the_routing(family, implementation, tiny_checkpoints,
                                                                      videos):
    """Why these classes cannot hang ZeRO-3 the way per-expert blocks did: two batches routed to different experts
    call the same parameter-holding modules in the same order (transformers 5's fused experts are one module whatever
    the tokens chose, under grouped_mm and eager alike); a per-expert block fed two such batches calls different
    modules. The leaf-module setting (``zero.mark_leaf_modules``) gathers each block whole on top of this."""
    first = make_case(family, tiny_checkpoints, videos, seed=1)
    second = make_case(family, tiny_checkpoints, videos, seed=2)
    model = first[0]
    model.set_experts_implementation(implementation)
    routed, orders = [], []
    for _, *batch in (first, second):
        orders.append(_modules_called(model, lambda batch=batch: routed.append(
            completion_logprobs(model, *batch, record_routing=True))))
    experts = expert_shape(model).experts
    load = [torch.bincount(r.routing.completion[r.routing.completion >= 0].long(), minlength=experts) for r in routed]
    assert not torch.equal(load[0], load[1])  # the two batches are routed differently
    assert orders[0] == orders[1] and any(".mlp.experts" in name for name in orders[0])
    stand_in = _PerExpertBlock()
    with torch.no_grad():
        stand_in.gate.weight.copy_(torch.eye(4, 8))  # token t goes to the expert of its largest first 4 features
    batch_a, batch_b = torch.zeros(2, 8), torch.zeros(2, 8)
    batch_a[:, 0], batch_b[:, 3] = 1.0, 1.0  # all to expert 0, all to expert 3
    assert _modules_called(stand_in, lambda: stand_in(batch_a)) != _modules_called(stand_in, lambda: stand_in(batch_b))
