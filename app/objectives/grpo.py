"""GRPO advantages and loss: pure tensor functions, no model code.

The options follow the papers and peers that introduced them (README "GRPO options" lists sources):

- ``loss_type``: how per-token losses become one number per micro-batch (``aggregate``).
- ``scale_rewards``: what the centred rewards are divided by (``group_advantages``).
- ``kl_estimator``: the per-token KL penalty (``kl_penalty``).
- ``delta``: two-sided clipping of the ratio for negative advantages.
- importance weights: truncated importance sampling against the rollout's own log-probs.
- ``policy_loss``: the per-token objective (``policy_objective``): PPO/GRPO's clipped token ratio, GSPO's
  sequence ratio (and its token variant), CISPO's clipped detached weight, SAPO's soft gate. docs/grpo.md writes
  each equation with its source.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from app.common.groups import group_slices
from app.common.options import OptionError

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")  # how per-token losses are normalised (``aggregate``)
POLICY_LOSSES = ("clip", "gspo", "gspo_token", "cispo", "sapo")  # the per-token objective (``policy_objective``)
SEQUENCE_LEVEL = ("gspo", "gspo_token")  # ratios of whole sequences: normalised per sequence (loss_type grpo)
SCALE_REWARDS = ("group", "batch", "none")
SCALE_REWARDS_SETTINGS = ("auto", *SCALE_REWARDS)  # auto: none under dr_grpo, group otherwise
LOSS_TYPE_SETTINGS = ("auto", *LOSS_TYPES)  # auto: the selected objective's source (OBJECTIVE_DEFAULTS)
KL_ESTIMATORS = ("k3", "low_var_kl", "k1")
AUTO = -1.0  # epsilon_low / epsilon_high: the selected objective's own value (OBJECTIVE_DEFAULTS)
# Each objective as its source sets it: (epsilon_low, epsilon_high, loss_type), used for settings left on auto.
OBJECTIVE_DEFAULTS = {
    "clip": (0.2, 0.2, "grpo"),  # DeepSeekMath's GRPO: eps 0.2, mean over each completion's tokens
    "gspo": (3e-4, 4e-4, "grpo"),  # GSPO (arXiv 2507.18071): left and right clipping ranges 3e-4 and 4e-4
    "gspo_token": (3e-4, 4e-4, "grpo"),  # the same paper's token variant
    # CISPO (MiniMax-M1, arXiv 2506.13585): no lower bound on the weight (1 - 1.0 = 0), its upper bound as TRL
    # recommends (5 = 1 + 4.0), normalised over all tokens of the batch
    "cispo": (1.0, 4.0, "dapo"),
    "sapo": (0.2, 0.2, "grpo"),  # SAPO (arXiv 2511.20347) has no clip: eps only sets the clip-fraction metrics
}
SEQUENCE_STATISTICS = SEQUENCE_LEVEL  # objectives whose ratios and clip fractions are counted per sequence
DYNAMIC_SAMPLING_METRICS = ("accuracy", "reward")
Reduce = Callable[[list[float]], list[float]]  # a sum over ranks (identity on one process)


def group_advantages(rewards: torch.Tensor, group_sizes: Sequence[int], scale: str = "group", eps: float = 1e-4,
                     batch_std: float | None = None) -> torch.Tensor:
    """(r - mean of its group) / (std + eps) per completion.

    ``scale``: ``group`` divides by the group's reward std (GRPO, DeepSeekMath); ``batch`` by the std of the whole
    step's rewards (``batch_std`` when given: the trainer passes the std over all ranks; otherwise these rewards');
    ``none`` only centres (Dr. GRPO). Stds are unbiased (n - 1), as in TRL and Video-R1.
    """
    if scale not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale!r}; expected one of {SCALE_REWARDS}")
    out = torch.empty_like(rewards)
    for rows in group_slices(group_sizes):
        group = rewards[rows]
        out[rows] = group - group.mean()
        if scale == "group":
            std = group.std() if group.numel() > 1 else group.new_zeros(())
            out[rows] /= std + eps
    if scale == "batch":
        std = batch_std if batch_std is not None else (float(rewards.std()) if rewards.numel() > 1 else 0.0)
        out = out / (std + eps)
    return out


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL penalty between the policy (which sampled the tokens) and the reference.

    With d = log ref - log pi at each sampled token:

    - ``k3`` = exp(d) - d - 1 (Schulman's unbiased, always >= 0 estimate of the value KL(pi || ref), as in GRPO,
      TRL and Video-R1). Its GRADIENT, differentiated through log pi as a loss term, is (1 - ref/pi) grad log pi,
      whose expectation under pi is grad KL(ref || pi): as a penalty it pulls toward the reference along the
      reverse KL, not along KL(pi || ref).
    - ``low_var_kl``: k3 with d clamped to [-20, 20] and the result to [-10, 10] (verl): the same gradient where
      the policy stays near the reference, bounded where it does not.
    - ``k1`` = -d = log pi - log ref: an unbiased estimate of the value KL(pi || ref), but its gradient
      grad log pi has expectation zero under pi, so as a loss term it regularises only through sampling noise;
      offered for comparison with peers that use it.
    """
    delta = ref_logprobs - logprobs
    if estimator == "k3":
        return torch.exp(delta) - delta - 1
    if estimator == "low_var_kl":
        delta = delta.clamp(-20, 20)
        return (torch.exp(delta) - delta - 1).clamp(-10, 10)
    if estimator == "k1":
        return -delta
    raise ValueError(f"unknown kl_estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def resolve_scale(scale_rewards: str, loss_type: str) -> str:
    """``scale_rewards`` with ``auto`` resolved: none under Dr. GRPO, group otherwise."""
    if scale_rewards not in SCALE_REWARDS_SETTINGS:
        raise OptionError("scale_rewards", f"must be one of {list(SCALE_REWARDS_SETTINGS)}, got {scale_rewards!r}")
    if scale_rewards != "auto":
        return scale_rewards
    return "none" if loss_type == "dr_grpo" else "group"


def advantages(total_reward: torch.Tensor, group_sizes: Sequence[int], scale_rewards: str, loss_type: str,
               reduce_sum: Reduce | None = None) -> torch.Tensor:
    """Group-normalised advantages as configured: ``scale_rewards`` resolved here (``resolve_scale``); for
    ``batch`` the std is of every reward of the step over all ranks (``reduce_sum``, one call; unbiased)."""
    scale = resolve_scale(scale_rewards, loss_type)
    batch_std = None
    if scale == "batch":
        r = total_reward.double()
        local = [float(r.numel()), float(r.sum()), float((r * r).sum())]
        n, total, squares = reduce_sum(local) if reduce_sum is not None else local
        batch_std = math.sqrt(max(squares - total * total / n, 0.0) / max(n - 1, 1))
    return group_advantages(total_reward, group_sizes, scale=scale, batch_std=batch_std)


def groups_with_signal(values: Sequence[float], group_sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """Dynamic sampling (DAPO): the groups whose ``values`` vary (a learning signal) and those that do not."""
    kept, dropped = [], []
    for g, flat in enumerate(zero_variance_groups(values, group_sizes)):
        (dropped if flat else kept).append(g)
    return kept, dropped


def choose_groups(kept: Sequence, dropped: Sequence, need: int) -> tuple[list, int]:
    """The step's groups: the first ``need`` with signal, topped up with groups without (counted) when short."""
    filled = max(0, need - len(kept))
    return list(kept[:need]) + list(dropped[:filled]), filled


def objective_settings(policy_loss: str, epsilon_low: float, epsilon_high: float, loss_type: str):
    """(epsilon_low, epsilon_high, loss_type) with each setting left on auto (``AUTO`` for the epsilons, "auto" for
    the loss type) taken from the objective's source (``OBJECTIVE_DEFAULTS``)."""
    if policy_loss not in OBJECTIVE_DEFAULTS:
        raise OptionError("policy_loss", f"must be one of {list(POLICY_LOSSES)}, got {policy_loss!r}")
    low, high, kind = OBJECTIVE_DEFAULTS[policy_loss]
    return (low if epsilon_low == AUTO else epsilon_low, high if epsilon_high == AUTO else epsilon_high,
            kind if loss_type == "auto" else loss_type)


@dataclass(frozen=True)
class LossOptions:
    """Everything the loss needs, validated here once (the config builds it: ``GRPOConfig.to_options``)."""

    loss_type: str = "grpo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float = 0.0  # 0: off; else the unclipped ratio is capped at delta (two-sided clipping)
    kl_estimator: str = "k3"
    max_completion_length: int = 0  # dr_grpo's constant denominator
    importance_sampling_cap: float = 0.0  # 0: off; else truncated importance sampling against the rollout
    mask_truncated_completions: bool = False  # DAPO's overlong filtering
    policy_loss: str = "clip"
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature for positive advantages
    sapo_tau_neg: float = 1.05  # ... and for negative ones

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise OptionError("loss_type", f"must be one of {list(LOSS_TYPES)}, got {self.loss_type!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise OptionError("kl_estimator", f"must be one of {list(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        if self.loss_type == "dr_grpo" and self.max_completion_length < 1:
            raise OptionError("max_completion_length", "must be >= 1 for loss_type 'dr_grpo'")
        if self.beta < 0:
            raise OptionError("beta", "must be >= 0")
        if self.epsilon_low < 0 or self.epsilon_high < 0:
            raise OptionError("epsilon_low", "and epsilon_high must be >= 0")
        if not (self.delta == 0 or self.delta > 1 + self.epsilon_high):
            raise OptionError("delta", f"must be 0 (off) or > 1 + epsilon_high ({1 + self.epsilon_high}), "
                                       f"got {self.delta}")
        if not (self.importance_sampling_cap == 0 or self.importance_sampling_cap >= 1):
            raise OptionError("importance_sampling_cap", f"must be 0 (off) or >= 1, got "
                                                         f"{self.importance_sampling_cap}")
        if self.policy_loss not in POLICY_LOSSES:
            raise OptionError("policy_loss", f"must be one of {list(POLICY_LOSSES)}, got {self.policy_loss!r}")
        if self.policy_loss in SEQUENCE_LEVEL and self.loss_type != "grpo":
            raise OptionError("policy_loss", f"={self.policy_loss} is a sequence-level objective (one ratio per "
                                             f"completion, GSPO's mean over sequences): it needs loss_type=grpo; "
                                             f"{self.loss_type} would weight each sequence by its token count")
        if self.delta > 0 and self.policy_loss != "clip":
            raise OptionError("delta", f"(two-sided clipping) caps the token ratio of policy_loss=clip; "
                                       f"policy_loss={self.policy_loss} has no such ratio term")
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            if getattr(self, name) <= 0:
                raise OptionError(name, f"must be > 0, got {getattr(self, name)}")

    def settings(self) -> dict:
        """The objective's own settings as they will run (auto values resolved): SAPO's gate temperatures, or the
        others' epsilons; with the loss type. SAPO's epsilons only set its clip-fraction metrics, so are left out."""
        if self.policy_loss == "sapo":
            return {"sapo_tau_pos": self.sapo_tau_pos, "sapo_tau_neg": self.sapo_tau_neg, "loss_type": self.loss_type}
        return {"epsilon_low": self.epsilon_low, "epsilon_high": self.epsilon_high, "loss_type": self.loss_type}


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int = 0,
              tokens_per_micro_batch: float | None = None) -> torch.Tensor:
    """One micro-batch's loss from per-token losses [N, L] and a 0/1 ``mask``.

    The optimiser sees the MEAN of these values over the step's micro-batches and ranks (DeepSpeed divides each
    backward by the accumulation steps and averages gradients over ranks), so:

    - ``grpo``: mean over each completion's tokens, then over completions (DeepSeekMath's GRPO).
    - ``bnpo``: mean over the micro-batch's tokens (TRL's "bnpo"; the step's result depends on how the tokens
      fall into micro-batches).
    - ``dapo``: sum over tokens / ``tokens_per_micro_batch``, the step's total loss tokens (all micro-batches,
      all ranks) divided by the number of micro-batch losses averaged: so the step optimises the mean over ALL
      its tokens (DAPO), whatever the micro-batch split.
    - ``dr_grpo``: sum over each completion's tokens / ``max_completion_length``, mean over completions
      (Dr. GRPO: no length normalisation per completion).
    """
    mask = mask.to(per_token.dtype)
    if loss_type == "grpo":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp_min(1)
    if loss_type == "dapo":
        if tokens_per_micro_batch is None:
            raise ValueError("loss_type 'dapo' needs tokens_per_micro_batch (the step's tokens / micro-batches)")
        return (per_token * mask).sum() / max(tokens_per_micro_batch, 1e-8)
    if loss_type == "dr_grpo":
        return ((per_token * mask).sum(1) / max_completion_length).mean()
    raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")


def truncated_importance_weights(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                                 cap: float) -> torch.Tensor:
    """min(pi_train / pi_rollout, cap) per token, without gradient: corrects for the rollout having sampled
    from slightly different numbers than the training forward computes (different kernels, precision)."""
    return torch.exp(train_logprobs.detach() - rollout_logprobs).clamp(max=cap)


def mismatch_metrics(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """How far the training forward's log-probs are from the rollout's sampling log-probs."""
    with torch.no_grad():
        keep = mask.bool()
        diff = (train_logprobs.detach() - rollout_logprobs)[keep]
        if diff.numel() == 0:
            return {"mismatch/mean_abs_logprob_diff": 0.0, "mismatch/max_ratio": 1.0}
        return {"mismatch/mean_abs_logprob_diff": float(diff.abs().mean()),
                "mismatch/max_ratio": float(torch.exp(diff.abs().max()))}


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised log of the sequence importance ratio: mean over each completion's loss tokens of
    log pi/pi_old, i.e. log of the geometric mean of its token ratios ([N, L] -> [N]; 0 for an empty mask)."""
    keep = mask.bool()
    return torch.where(keep, log_ratio, torch.zeros_like(log_ratio)).sum(1) / keep.sum(1).clamp_min(1)


def policy_objective(logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                     o: LossOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token policy loss [N, L] of ``o.policy_loss`` (to be aggregated by ``o.loss_type``) and the ratio it
    uses [N, L] (no gradient; sequence-level objectives repeat the sequence ratio on each token). ``adv`` [N, 1].

    - ``clip`` (PPO, GRPO): r = pi/pi_old per token; -min(r A, clip(r, 1-eps_low, 1+eps_high) A), the ratio capped
      at ``delta`` for negative advantages when set.
    - ``gspo`` (Zheng et al. 2025, arXiv 2507.18071): s = exp(mean_t log r_t) per sequence;
      -min(s A, clip(s, 1-eps_low, 1+eps_high) A), the same for each of its tokens.
    - ``gspo_token`` (same paper): s_t = sg(s) * pi_t / sg(pi_t): the value of s on every token, the gradient of each
      token's own log-prob times s (per-token advantages would weigh tokens apart; with GRPO's sequence advantages
      it equals ``gspo`` in value and gradient).
    - ``cispo`` (MiniMax-M1, arXiv 2506.13585): -sg(clip(r, 1-eps_low, 1+eps_high)) A log pi: the clipped weight is
      detached, so every token keeps a gradient (PPO's clip drops the tokens outside the band).
    - ``sapo`` (Gao et al. 2025, arXiv 2511.20347): -(4/tau) sigmoid(tau (r - 1)) A with tau = sapo_tau_pos for
      A > 0 and sapo_tau_neg otherwise: a soft trust region, gradient A grad log pi at r = 1.
    """
    # Masked positions (padding, filtered tokens) may hold anything, even log-probs whose ratio overflows: they
    # enter as log-ratio 0 and log-prob 0 through a select, so neither the loss nor its gradient sees them (a
    # multiplication by the mask would turn inf * 0 into NaN).
    keep = mask.bool()
    logprobs = torch.where(keep, logprobs, torch.zeros_like(logprobs))
    log_ratio = torch.where(keep, logprobs - old_logprobs, torch.zeros_like(logprobs))
    if o.policy_loss in SEQUENCE_LEVEL:
        seq = sequence_log_ratio(log_ratio, mask)[:, None]
        log_r = seq.expand_as(logprobs) if o.policy_loss == "gspo" else logprobs - logprobs.detach() + seq.detach()
        ratio = torch.exp(log_r)
        return -torch.min(ratio * adv, torch.clamp(ratio, 1 - o.epsilon_low, 1 + o.epsilon_high) * adv), \
            ratio.detach()
    ratio = torch.exp(log_ratio)
    if o.policy_loss == "cispo":
        weight = torch.clamp(ratio, 1 - o.epsilon_low, 1 + o.epsilon_high).detach()
        return -weight * adv * logprobs, ratio.detach()
    if o.policy_loss == "sapo":
        tau = torch.where(adv > 0, torch.full_like(adv, o.sapo_tau_pos), torch.full_like(adv, o.sapo_tau_neg))
        return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1)) * adv, ratio.detach()
    clipped = torch.clamp(ratio, 1 - o.epsilon_low, 1 + o.epsilon_high)
    unclipped = torch.clamp(ratio, max=o.delta) if o.delta > 0 else ratio
    return -torch.min(unclipped * adv, clipped * adv), ratio.detach()


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    options: LossOptions = LossOptions(),
    *,
    importance_weights: torch.Tensor | None = None,
    tokens_per_micro_batch: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss (``options.policy_loss``, ``policy_objective``) plus beta * KL for one micro-batch.

    All per-token tensors are [N, L]; ``advantages`` is [N]; ``mask`` marks the tokens that carry loss.
    ``importance_weights`` (no gradient) multiply the per-token policy loss (truncated importance sampling; for the
    sequence-level objectives one weight per sequence, ``GRPOLoss``).
    """
    o = options
    mask = mask.to(logprobs.dtype)
    adv = advantages[:, None]
    per_token, ratio = policy_objective(logprobs, old_logprobs, adv, mask, o)
    if importance_weights is not None:
        per_token = per_token * importance_weights
    kl = None
    if ref_logprobs is not None and o.beta > 0:
        keep = mask.bool()  # masked positions: policy = reference there, so no penalty and no gradient
        kl = kl_penalty(torch.where(keep, logprobs, torch.zeros_like(logprobs)),
                        torch.where(keep, ref_logprobs, torch.zeros_like(ref_logprobs)), o.kl_estimator)
        per_token = per_token + o.beta * kl
    loss = aggregate(per_token, mask, o.loss_type, o.max_completion_length, tokens_per_micro_batch)
    with torch.no_grad():
        metrics = ratio_metrics(ratio, adv, mask, o)
        tokens = mask.sum().clamp_min(1)
        metrics["kl"] = float((kl * mask).sum() / tokens) if kl is not None else 0.0
    return loss, metrics


def ratio_metrics(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, o: LossOptions) -> dict[str, float]:
    """The ratio's mean, min and max and the clipped fractions (low: below 1 - eps_low with A < 0; high: above
    1 + eps_high with A > 0), over the loss tokens; for the sequence-level objectives (GSPO) over the sequences
    with a loss token, one ratio each, as TRL reports them."""
    if o.policy_loss in SEQUENCE_STATISTICS:
        has_tokens = mask.sum(1) > 0
        ratio, adv, weight = ratio[:, :1][has_tokens], adv[has_tokens], torch.ones(int(has_tokens.sum()), 1)
    else:
        weight = mask
    weight = weight.to(ratio.device, ratio.dtype)
    count = weight.sum().clamp_min(1)
    low = ((ratio < 1 - o.epsilon_low) & (adv < 0)).to(weight.dtype) * weight
    high = ((ratio > 1 + o.epsilon_high) & (adv > 0)).to(weight.dtype) * weight
    out = {"clip_fraction": float((low + high).sum() / count), "clip_fraction_low": float(low.sum() / count),
           "clip_fraction_high": float(high.sum() / count)}
    if o.delta > 0:
        out["clip_fraction_delta"] = float((((ratio > o.delta) & (adv < 0)).to(weight.dtype) * weight).sum() / count)
    kept = ratio[weight.bool()]
    out.update({"ratio/mean": float(kept.mean()) if kept.numel() else 1.0,
                "ratio/min": float(kept.min()) if kept.numel() else 1.0,
                "ratio/max": float(kept.max()) if kept.numel() else 1.0})
    return out


class GRPOLoss:
    """The loss of a step, built once from ``LossOptions``. ``start_step`` sees the step's loss weights (the DAPO
    denominator is the loss tokens of the whole step over all ranks: one ``reduce_sum``); each call scores one
    micro-batch, with truncated importance weights against the rollout's log-probs when the cap is set."""

    def __init__(self, options: LossOptions):
        self.options = options
        self.tokens_per_micro_batch: float | None = None

    def weights(self, completion_mask: torch.Tensor, stop_reasons: Sequence[str]) -> torch.Tensor:
        return loss_mask(completion_mask, stop_reasons, self.options.mask_truncated_completions)

    def start_step(self, loss_weights: torch.Tensor, micro_batches: int, world_size: int = 1,
                   reduce_sum: Reduce | None = None) -> None:
        """DAPO's denominator (see ``aggregate``): the step's loss tokens summed over ranks, divided by the number
        of micro-batch losses DeepSpeed averages (micro-batches per rank x ranks). Nothing for the other types."""
        self.tokens_per_micro_batch = None
        if self.options.loss_type == "dapo":
            local = [float(loss_weights.sum())]
            total = (reduce_sum(local) if reduce_sum is not None else local)[0]
            self.tokens_per_micro_batch = total / (micro_batches * world_size)

    def __call__(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                 loss_weights: torch.Tensor, ref_logprobs: torch.Tensor | None,
                 sampled_logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        cap, o = self.options.importance_sampling_cap, self.options
        weights = None
        if cap > 0 and o.policy_loss in SEQUENCE_LEVEL:  # one weight per sequence, length-normalised like s
            log_w = sequence_log_ratio(old_logprobs.detach() - sampled_logprobs, loss_weights.to(old_logprobs.dtype))
            weights = torch.exp(log_w).clamp(max=cap)[:, None]
        elif cap > 0:
            weights = truncated_importance_weights(old_logprobs, sampled_logprobs, cap)
        return grpo_loss(logprobs, old_logprobs, advantages, loss_weights, ref_logprobs, self.options,
                         importance_weights=weights, tokens_per_micro_batch=self.tokens_per_micro_batch)


def loss_mask(completion_mask: torch.Tensor, stop_reasons: Sequence[str], mask_truncated: bool) -> torch.Tensor:
    """The tokens that carry loss: the completion mask, with completions cut by the length limit (stop reason
    ``length``) removed when ``mask_truncated`` (DAPO's overlong filtering)."""
    mask = completion_mask.float()
    if mask_truncated:
        keep = torch.tensor([reason != "length" for reason in stop_reasons], dtype=mask.dtype)
        mask = mask * keep[:, None]
    return mask


def zero_variance_groups(values: Sequence[float], group_sizes: Sequence[int]) -> list[bool]:
    """Per group: True when all its values are equal (no learning signal from advantages)."""
    return [max(values[rows]) - min(values[rows]) == 0 for rows in group_slices(group_sizes)]
