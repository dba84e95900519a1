"""GRPO loss variants against independent hand-written references (plain Python loops over tokens).

What the optimiser follows is the MEAN of the micro-batch losses over the step's micro-batches and ranks (DeepSpeed
divides each backward by the accumulation steps and averages gradients over ranks). The references compute the
step's objective from all tokens at once, as each paper defines it; the tests check values and gradients on
micro-batches of unequal token counts spread over 2 ranks, and a real 2-process DeepSpeed run (tests/workers).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.objectives.grpo import (
    LOSS_TYPES,
    POLICY_LOSSES,
    SEQUENCE_LEVEL,
    GRPOLoss,
    LossOptions,
    grpo_loss,
    kl_penalty,
    loss_mask,
    mismatch_metrics,
    truncated_importance_weights,
    zero_variance_groups,
)

ROOT = Path(__file__).resolve().parents[1]
L_MAX = 7


def step_data(seed: int = 0):
    """2 ranks x 2 micro-batches x 3 completions, lengths chosen so token counts differ per micro-batch."""
    g = torch.Generator().manual_seed(seed)
    lengths = [[[5, 1, 3], [7, 6, 2]], [[2, 2, 1], [4, 7, 7]]]  # [rank][micro-batch][completion]
    data = []
    for rank in lengths:
        for mb in rank:
            n = len(mb)
            mask = torch.tensor([[1.0 if t < length else 0.0 for t in range(L_MAX)] for length in mb])
            data.append({
                "logp": (-torch.rand(n, L_MAX, generator=g, dtype=torch.float64) * 2).requires_grad_(),
                "old": -torch.rand(n, L_MAX, generator=g, dtype=torch.float64) * 2,
                "ref": -torch.rand(n, L_MAX, generator=g, dtype=torch.float64) * 2,
                "adv": torch.randn(n, generator=g, dtype=torch.float64),
                "sampled": -torch.rand(n, L_MAX, generator=g, dtype=torch.float64) * 2,
                "mask": mask,
            })
    return data


def reference_token_loss(lp, old, ref, adv, beta, eps_low, eps_high, delta, estimator, weight):
    """One token's loss, written from the definitions (tensors of one element, so autograd gives the gradient)."""
    ratio = torch.exp(lp - old)
    clipped = min(max(ratio, torch.tensor(1 - eps_low, dtype=ratio.dtype)), torch.tensor(1 + eps_high,
                                                                                         dtype=ratio.dtype))
    unclipped = min(ratio, torch.tensor(delta, dtype=ratio.dtype)) if delta > 0 else ratio
    policy = -min(unclipped * adv, clipped * adv) * weight
    d = ref - lp
    if estimator == "k3":
        kl = torch.exp(d) - d - 1
    elif estimator == "low_var_kl":
        d = max(min(d, torch.tensor(20.0, dtype=d.dtype)), torch.tensor(-20.0, dtype=d.dtype))
        kl = torch.exp(d) - d - 1
        kl = max(min(kl, torch.tensor(10.0, dtype=d.dtype)), torch.tensor(-10.0, dtype=d.dtype))
    else:
        kl = lp - ref
    return policy + beta * kl


def reference_objective(data, loss_type, beta=0.04, eps_low=0.2, eps_high=0.28, delta=0.0, estimator="k3",
                        cap=0.0):
    """The step's objective over ALL completions of all micro-batches and ranks, from each method's definition."""
    per_sequence, micro_batch_means, total, tokens, sequences = [], [], 0.0, 0.0, 0
    for mb in data:
        mb_sum, mb_tokens = 0.0, 0.0
        for i in range(mb["mask"].shape[0]):
            seq_sum, seq_tokens = 0.0, 0.0
            for t in range(L_MAX):
                if mb["mask"][i, t] == 0:
                    continue
                weight = 1.0
                if cap > 0:
                    weight = min(math.exp(float(mb["old"][i, t]) - float(mb["sampled"][i, t])), cap)
                loss = reference_token_loss(mb["logp"][i, t], mb["old"][i, t], mb["ref"][i, t], mb["adv"][i], beta,
                                            eps_low, eps_high, delta, estimator, weight)
                seq_sum, seq_tokens = seq_sum + loss, seq_tokens + 1
            per_sequence.append((seq_sum, seq_tokens))
            mb_sum, mb_tokens = mb_sum + seq_sum, mb_tokens + seq_tokens
            sequences += 1
        micro_batch_means.append(mb_sum / mb_tokens)
        total, tokens = total + mb_sum, tokens + mb_tokens
    if loss_type == "grpo":  # DeepSeekMath: 1/G sum_i 1/|o_i| sum_t
        return sum(s / n for s, n in per_sequence) / sequences
    if loss_type == "bnpo":  # each micro-batch's token mean, averaged
        return sum(micro_batch_means) / len(micro_batch_means)
    if loss_type == "dapo":  # DAPO: 1/sum_i |o_i| sum_i sum_t
        return total / tokens
    return sum(s for s, _ in per_sequence) / (sequences * L_MAX)  # Dr. GRPO: constant denominator


def step_objective(data, options: LossOptions, cap=0.0):
    """What DeepSpeed optimises: the mean of the micro-batch losses over micro-batches and ranks."""
    total_tokens = sum(float(mb["mask"].sum()) for mb in data)
    per_mb = total_tokens / len(data) if options.loss_type == "dapo" else None
    losses = []
    for mb in data:
        weights = truncated_importance_weights(mb["old"], mb["sampled"], cap) if cap > 0 else None
        loss, _ = grpo_loss(mb["logp"], mb["old"], mb["adv"], mb["mask"], mb["ref"], options,
                            importance_weights=weights, tokens_per_micro_batch=per_mb)
        losses.append(loss)
    return sum(losses) / len(losses)


def gradients(objective, data):
    for mb in data:
        mb["logp"].grad = None
    objective.backward()
    return torch.cat([mb["logp"].grad.flatten() for mb in data])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(("estimator", "delta", "cap"), [("k3", 0.0, 0.0), ("low_var_kl", 1.5, 0.0),
                                                          ("k1", 0.0, 2.0)])
def test_loss_types_equal_hand_written_references(loss_type, estimator, delta, cap):
    data = step_data(seed=1)
    options = LossOptions(loss_type=loss_type, beta=0.04, epsilon_low=0.2, epsilon_high=0.28, delta=delta,
                          kl_estimator=estimator, max_completion_length=L_MAX)
    ours = step_objective(data, options, cap)
    grad_ours = gradients(ours, data)
    reference = reference_objective(data, loss_type, delta=delta, estimator=estimator, cap=cap)
    grad_reference = gradients(reference, data)
    assert float(ours) == pytest.approx(float(reference), rel=1e-12, abs=1e-14)
    assert torch.allclose(grad_ours, grad_reference, rtol=1e-10, atol=1e-14)
    assert grad_ours.abs().sum() > 0


# ---- the other policy objectives (GSPO, GSPO-token, CISPO, SAPO), each written out from its paper ---------------
def combinations():
    """Every policy objective with every loss type it accepts (GSPO's two: loss_type grpo only)."""
    return [(policy, loss_type) for policy in POLICY_LOSSES for loss_type in LOSS_TYPES
            if policy not in SEQUENCE_LEVEL or loss_type == "grpo"]


def kl_term(lp, ref):
    d = ref - lp
    return torch.exp(d) - d - 1


def objective_tokens(mb, i, policy, eps_low, eps_high, tau_pos, tau_neg, cap):
    """Completion i's per-token losses [(loss, 1)] written from each paper's definition, tokens one by one."""
    adv, tokens = mb["adv"][i], [t for t in range(L_MAX) if mb["mask"][i, t] != 0]
    clip = lambda x: min(max(x, torch.tensor(1 - eps_low, dtype=x.dtype)), torch.tensor(1 + eps_high, dtype=x.dtype))  # noqa: E731
    out = []
    if policy in ("gspo", "gspo_token"):
        log_s = sum(mb["logp"][i, t] - mb["old"][i, t] for t in tokens) / len(tokens)  # geometric mean of ratios
        weight = 1.0
        if cap > 0:  # one truncated importance weight per sequence, length-normalised like s
            weight = min(math.exp(sum(float(mb["old"][i, t] - mb["sampled"][i, t]) for t in tokens) / len(tokens)),
                         cap)
        for t in tokens:
            s = torch.exp(log_s)
            if policy == "gspo_token":  # sg[s] * pi_t / sg[pi_t]
                s = torch.exp(log_s.detach()) * torch.exp(mb["logp"][i, t] - mb["logp"][i, t].detach())
            out.append(-min(s * adv, clip(s) * adv) * weight)
        return out
    for t in tokens:
        ratio = torch.exp(mb["logp"][i, t] - mb["old"][i, t])
        weight = min(math.exp(float(mb["old"][i, t] - mb["sampled"][i, t])), cap) if cap > 0 else 1.0
        if policy == "cispo":  # sg(clip(r)) * A * log pi
            loss = -clip(ratio).detach() * adv * mb["logp"][i, t]
        elif policy == "sapo":  # (4 / tau) sigmoid(tau (r - 1)) A
            tau = tau_pos if adv > 0 else tau_neg
            loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1)) * adv
        else:
            loss = -min(ratio * adv, clip(ratio) * adv)
        out.append(loss * weight)
    return out


def reference_policy_objective(data, policy, loss_type, beta=0.04, eps_low=0.2, eps_high=0.28, tau_pos=1.0,
                               tau_neg=1.05, cap=0.0):
    per_sequence, micro_batch_means, total, tokens, sequences = [], [], 0.0, 0.0, 0
    for mb in data:
        mb_sum, mb_tokens = 0.0, 0.0
        for i in range(mb["mask"].shape[0]):
            losses = objective_tokens(mb, i, policy, eps_low, eps_high, tau_pos, tau_neg, cap)
            kept = [t for t in range(L_MAX) if mb["mask"][i, t] != 0]
            seq_sum = sum(loss + beta * kl_term(mb["logp"][i, t], mb["ref"][i, t]) for loss, t in zip(losses, kept))
            per_sequence.append((seq_sum, len(kept)))
            mb_sum, mb_tokens, sequences = mb_sum + seq_sum, mb_tokens + len(kept), sequences + 1
        micro_batch_means.append(mb_sum / mb_tokens)
        total, tokens = total + mb_sum, tokens + mb_tokens
    if loss_type == "grpo":
        return sum(s / n for s, n in per_sequence) / sequences
    if loss_type == "bnpo":
        return sum(micro_batch_means) / len(micro_batch_means)
    if loss_type == "dapo":
        return total / tokens
    return sum(s for s, _ in per_sequence) / (sequences * L_MAX)


def trainer_step_objective(data, options: LossOptions):
    """What DeepSpeed optimises, through the trainer's loss object (GRPOLoss: its importance weights included)."""
    loss_fn = GRPOLoss(options)
    loss_fn.start_step(torch.cat([mb["mask"] for mb in data]), len(data))
    losses = [loss_fn(mb["logp"], mb["old"], mb["adv"], mb["mask"], mb["ref"], mb["sampled"])[0] for mb in data]
    return sum(losses) / len(losses)


@pytest.mark.parametrize(("policy", "loss_type"), combinations())
@pytest.mark.parametrize("cap", [0.0, 2.0])
def test_policy_objectives_equal_hand_written_references(policy, loss_type, cap):
    data = step_data(seed=5)
    for mb in data:  # ratios far from 1 as well, so clips and gates act
        mb["old"] = mb["old"] + 0.3 * torch.randn(mb["old"].shape, dtype=torch.float64,
                                                  generator=torch.Generator().manual_seed(9))
    options = LossOptions(loss_type=loss_type, beta=0.04, epsilon_low=0.2, epsilon_high=0.28, kl_estimator="k3",
                          max_completion_length=L_MAX, policy_loss=policy, importance_sampling_cap=cap)
    ours = trainer_step_objective(data, options)
    grad_ours = gradients(ours, data)
    reference = reference_policy_objective(data, policy, loss_type, cap=cap)
    grad_reference = gradients(reference, data)
    assert float(ours) == pytest.approx(float(reference), rel=1e-12, abs=1e-14)
    assert torch.allclose(grad_ours, grad_reference, rtol=1e-10, atol=1e-14)
    assert grad_ours.abs().sum() > 0


def test_the_objectives_really_differ_and_gspo_token_equals_gspo_with_sequence_advantages():
    data = step_data(seed=6)
    for mb in data:
        mb["old"] = mb["old"] + 0.3
    values, grads = {}, {}
    for policy in POLICY_LOSSES:
        objective = reference_policy_objective(data, policy, "grpo")
        values[policy], grads[policy] = float(objective), gradients(objective, data)
    assert len({round(v, 9) for v in values.values()}) == len(POLICY_LOSSES) - 1, values  # gspo == gspo_token
    assert values["gspo"] == pytest.approx(values["gspo_token"], rel=1e-12)
    assert torch.allclose(grads["gspo"], grads["gspo_token"], rtol=1e-10, atol=1e-14)
    assert not torch.allclose(grads["gspo"], grads["clip"])


def test_cispo_keeps_a_gradient_where_the_clip_drops_it():
    """A token whose ratio is far outside the band: PPO's clip gives it no gradient, CISPO's detached weight does."""
    lp = torch.tensor([[-0.1]], dtype=torch.float64, requires_grad=True)
    old, adv, mask = torch.tensor([[-1.0]], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64), \
        torch.ones(1, 1)
    grads = {}
    for policy in ("clip", "cispo"):
        lp.grad = None
        grpo_loss(lp, old, adv, mask, None, LossOptions(policy_loss=policy))[0].backward()
        grads[policy] = float(lp.grad)
    assert grads["clip"] == 0 and grads["cispo"] == pytest.approx(-1.2)  # -clip(e^0.9) * A


@pytest.mark.parametrize(("settings", "message"), [
    ({"policy_loss": "gspo", "loss_type": "dapo"}, "'grpo.policy_loss' =gspo is a sequence-level objective"),
    ({"policy_loss": "gspo_token", "loss_type": "bnpo"}, "'grpo.policy_loss' .* needs grpo.loss_type=grpo"),
    ({"policy_loss": "cispo", "delta": 6.0}, "'grpo.delta' \\(two-sided clipping\\)"),
    ({"policy_loss": "sapo", "sapo_tau_neg": 0.0}, "'grpo.sapo_tau_neg' must be > 0"),
    ({"policy_loss": "ppo"}, "'grpo.policy_loss' must be one of"),
])
def test_combinations_that_make_no_sense_are_refused_by_name(settings, message):
    from app.config.loading import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config("configs/demo_cpu.yaml", ["model.path=m", *(f"grpo.{k}={v}" for k, v in settings.items())])


def test_loss_types_really_differ_on_unequal_micro_batches():
    """The references are not all the same function: on this data each pair of loss types disagrees."""
    data = step_data(seed=2)
    values = {t: float(reference_objective(data, t)) for t in LOSS_TYPES}
    assert len({round(v, 9) for v in values.values()}) == len(LOSS_TYPES), values


def test_dapo_does_not_depend_on_the_micro_batch_split():
    data = step_data(seed=3)
    options = LossOptions(loss_type="dapo", beta=0.04, epsilon_high=0.28)
    split = float(step_objective(data, options))
    whole = {k: torch.cat([mb[k] for mb in data]) if k != "adv" else torch.cat([mb["adv"] for mb in data])
             for k in data[0]}
    single = float(step_objective([whole], options))
    assert split == pytest.approx(single, rel=1e-12)
    bnpo = LossOptions(loss_type="bnpo", beta=0.04, epsilon_high=0.28)
    assert float(step_objective(data, bnpo)) != pytest.approx(float(step_objective([whole], bnpo)), rel=1e-6)


def test_kl_estimators_and_what_their_gradient_follows():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    d = ref - logp
    assert torch.allclose(kl_penalty(logp, ref, "k3"), torch.exp(d) - d - 1)
    assert torch.allclose(kl_penalty(logp, ref, "k1"), logp - ref)
    assert torch.allclose(kl_penalty(logp, ref, "low_var_kl"), kl_penalty(logp, ref, "k3"))
    far = kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl")
    assert float(far) == 10.0  # clamped, where k3 would be e^30
    # Expected gradient of k3 under pi equals grad KL(ref || pi), not grad KL(pi || ref): exact expectation over a
    # 4-token softmax policy.
    theta = torch.tensor([0.3, -0.2, 1.0, 0.1], dtype=torch.float64, requires_grad=True)
    ref_logp = torch.log_softmax(torch.tensor([0.0, 0.5, -0.3, 0.2], dtype=torch.float64), 0)
    logp_all = torch.log_softmax(theta, 0)
    probs = logp_all.exp().detach()
    expected_k3 = sum(probs[a] * torch.autograd.grad(kl_penalty(logp_all[a], ref_logp[a], "k3"), theta,
                                                     retain_graph=True)[0] for a in range(4))
    reverse = torch.autograd.grad((ref_logp.exp() * (ref_logp - logp_all)).sum(), theta, retain_graph=True)[0]
    forward = torch.autograd.grad((logp_all.exp() * (logp_all - ref_logp)).sum(), theta, retain_graph=True)[0]
    assert torch.allclose(expected_k3, reverse, atol=1e-12)
    assert not torch.allclose(expected_k3, forward, atol=1e-3)
    expected_k1 = sum(probs[a] * torch.autograd.grad(kl_penalty(logp_all[a], ref_logp[a], "k1"), theta,
                                                     retain_graph=True)[0] for a in range(4))
    assert torch.allclose(expected_k1, torch.zeros(4, dtype=torch.float64), atol=1e-12)


def test_truncated_completions_carry_no_loss_and_mismatch_metrics():
    mask = torch.ones(3, 4)
    kept = loss_mask(mask, ["eos", "length", "stop_string"], mask_truncated=True)
    assert kept.sum(1).tolist() == [4.0, 0.0, 4.0]
    assert loss_mask(mask, ["eos", "length", "eos"], mask_truncated=False).sum() == 12
    logp = torch.zeros(1, 3)
    sampled = torch.tensor([[0.0, -0.5, 0.2]])
    weights = truncated_importance_weights(logp, sampled, cap=1.5)
    assert torch.allclose(weights, torch.tensor([[1.0, 1.5, math.exp(-0.2)]]))
    metrics = mismatch_metrics(logp, sampled, torch.tensor([[1, 1, 0]]))
    assert metrics["mismatch/mean_abs_logprob_diff"] == pytest.approx(0.25)
    assert metrics["mismatch/max_ratio"] == pytest.approx(math.exp(0.5))


def test_zero_variance_groups():
    assert zero_variance_groups([1, 1, 1, 0, 1, 0.5, 0, 0], [3, 3, 2]) == [True, False, True]


@pytest.mark.distributed
def test_two_ranks_under_deepspeed_follow_the_reference_gradient(tmp_path):
    """A real 2-process DeepSpeed step (gradient accumulation 2, SGD lr 1) moves the parameters by exactly the
    reference gradient of the whole step, for every policy objective and loss type it accepts: DAPO's
    normalisation spans micro-batches and ranks, GSPO's sequence ratio stays within its micro-batch."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "tests.workers.loss_ranks", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    moved = json.loads((tmp_path / "rank0.json").read_text())
    assert set(moved) == {f"{policy}/{loss_type}" for policy, loss_type in combinations()}
    for policy, loss_type in combinations():
        data = step_data(seed=4)
        for mb in data:  # the worker's float32 values, exactly
            for key in ("logp", "old", "ref", "adv"):
                mb[key] = mb[key].detach().float().double()
            mb["logp"].requires_grad_()
        reference = reference_objective(data, loss_type) if policy == "clip" else \
            reference_policy_objective(data, policy, loss_type)
        grad = gradients(reference, data).view(len(data), -1)
        step = -torch.tensor(moved[f"{policy}/{loss_type}"], dtype=torch.float64).view(len(data), -1)
        assert torch.allclose(step, grad, rtol=2e-4, atol=1e-6), (policy, loss_type, (step - grad).abs().max())


# ---- masked positions, sequence-level statistics, each objective's source settings ---------------------------------
@pytest.mark.parametrize(("policy", "loss_type"), combinations())
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_masked_positions_never_reach_the_loss_or_its_gradient(policy, loss_type, beta):
    """Anything at a masked position, even a log-ratio that overflows float32 (95 against -5: e^100), leaves the
    loss, its gradient and its metrics what they are with harmless values there (SAPO's and the clip's gradient
    were NaN)."""
    logp = torch.tensor([[-1.0, -2.0, 95.0], [-0.5, -1.5, -3.0]])
    old = torch.tensor([[-1.1, -1.9, -5.0], [-0.4, -1.2, 80.0]])
    ref = torch.tensor([[-1.2, -2.1, -90.0], [-0.6, -1.4, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -0.5])
    options = LossOptions(policy_loss=policy, loss_type=loss_type, beta=beta, max_completion_length=3)
    harmless = torch.where(mask.bool(), logp, old)

    def run(values, reference):
        values = values.clone().requires_grad_()
        loss, metrics = grpo_loss(values, old, adv, mask, reference, options, tokens_per_micro_batch=4.0)
        loss.backward()
        return loss, values.grad, metrics

    loss, grad, metrics = run(logp, ref if beta else None)
    want_loss, want_grad, want_metrics = run(harmless, torch.where(mask.bool(), ref, harmless) if beta else None)
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), (loss, grad)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    torch.testing.assert_close(grad, want_grad)
    assert grad[~mask.bool()].eq(0).all()
    assert metrics == pytest.approx(want_metrics)


def test_sequence_level_objectives_count_sequences_in_their_statistics():
    """GSPO clips whole sequences: its clip fractions and ratio statistics count each sequence once (TRL's
    importance_sampling_level="sequence"), not its tokens. Three sequences of 6, 1 and 1 tokens, the long one
    clipped high: 1 of 3 sequences (a token count would say 6 of 8)."""
    logp = torch.zeros(3, 6)
    old = torch.zeros(3, 6)
    old[0] = -0.5  # sequence 0: ratio e^0.5, far above 1 + 4e-4
    mask = torch.zeros(3, 6)
    mask[0], mask[1, 0], mask[2, 0] = 1.0, 1.0, 1.0
    adv = torch.tensor([1.0, 1.0, -1.0])
    for policy in SEQUENCE_LEVEL:
        _, metrics = grpo_loss(logp, old, adv, mask, None, LossOptions(policy_loss=policy, epsilon_low=3e-4,
                                                                       epsilon_high=4e-4))
        assert metrics["clip_fraction_high"] == pytest.approx(1 / 3) and metrics["clip_fraction_low"] == 0
        assert metrics["ratio/max"] == pytest.approx(math.exp(0.5)) and metrics["ratio/min"] == pytest.approx(1.0)
        assert metrics["ratio/mean"] == pytest.approx((math.exp(0.5) + 2) / 3)
    _, token = grpo_loss(logp, old, adv, mask, None, LossOptions(epsilon_low=3e-4, epsilon_high=4e-4))
    assert token["clip_fraction_high"] == pytest.approx(6 / 8)  # the token objective still counts tokens


@pytest.mark.parametrize(("policy", "expected"), [
    ("clip", (0.2, 0.2, "grpo")), ("gspo", (3e-4, 4e-4, "grpo")), ("gspo_token", (3e-4, 4e-4, "grpo")),
    ("cispo", (1.0, 4.0, "dapo")), ("sapo", (0.2, 0.2, "grpo"))])
def test_selecting_an_objective_gives_it_its_sources_settings_unless_they_are_set(policy, expected):
    from app.config.loading import load_config

    def options(*extra):
        cfg = load_config("configs/demo_cpu.yaml", ["model.path=m", f"grpo.policy_loss={policy}", *extra])
        o = cfg.grpo.to_options(cfg.rollout.max_completion_length)
        return o.epsilon_low, o.epsilon_high, o.loss_type

    assert options() == pytest.approx(expected) if policy != "cispo" else options() == expected
    low, high, kind = options("grpo.epsilon_low=0.1", "grpo.epsilon_high=0.3",
                              f"grpo.loss_type={'bnpo' if policy not in SEQUENCE_LEVEL else 'grpo'}")
    assert (low, high) == (0.1, 0.3) and kind == ("bnpo" if policy not in SEQUENCE_LEVEL else "grpo")


def test_an_objectives_settings_as_they_run_name_what_it_uses():
    """What the trainer logs and the objectives demo writes: SAPO's temperatures (its epsilons only feed metrics),
    the others' epsilons; each with its loss type."""
    assert LossOptions(policy_loss="sapo", sapo_tau_neg=2.0).settings() == {
        "sapo_tau_pos": 1.0, "sapo_tau_neg": 2.0, "loss_type": "grpo"}
    assert LossOptions(policy_loss="cispo", epsilon_low=1.0, epsilon_high=4.0, loss_type="dapo").settings() == {
        "epsilon_low": 1.0, "epsilon_high": 4.0, "loss_type": "dapo"}


def test_cispo_with_its_source_settings_is_trls_cispo_with_a_cap_of_five():
    """TRL's CISPO: -min(r, 5).detach() * A * log pi, summed over the batch's tokens / their count. Ours, with the
    settings selecting cispo gives it (epsilon_low 1.0, epsilon_high 4.0, loss_type dapo), equals it exactly."""
    g = torch.Generator().manual_seed(3)
    logp = (-torch.rand(4, 6, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + torch.randn(4, 6, generator=g, dtype=torch.float64)  # ratios from e^-3 to e^3
    mask = (torch.rand(4, 6, generator=g) > 0.3).double()
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    ours, _ = grpo_loss(logp, old, adv, mask, None, LossOptions(policy_loss="cispo", epsilon_low=1.0,
                                                                epsilon_high=4.0, loss_type="dapo"),
                        tokens_per_micro_batch=float(mask.sum()))
    ratio = torch.exp(logp - old).detach()
    trl = (-(torch.clamp(ratio, max=5.0) * adv[:, None] * logp) * mask).sum() / mask.sum()
    assert float((ratio > 5).sum()) > 0 and float((ratio < 0.8).sum()) > 0  # both of the old band's ends crossed
    assert float(ours) == pytest.approx(float(trl), rel=1e-12)
    assert torch.allclose(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(trl, logp)[0], rtol=1e-12)
