"""Sampling: what a rollout draws with (``SamplingConfig``), one random stream per sample (``derive_seed``,
``sample_generators``), temperature / top-k / top-p / min-p and the repetition penalty on a step's logits, and the
draw itself (``sample_tokens``). Shared by every local decoder; the vLLM engine checks its own against these.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.common.options import OptionError

TOP_P_CANDIDATES = (64, 1024)  # top-p looks at the largest probabilities first and sorts the vocabulary only if needed
SAMPLE_BLOCK = 1024  # tokens per block of the two-level inverse-CDF draw (``draw_from_weights``)


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter
    max_new_tokens: int = 256
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None  # prompt b draws from derive_seed(seed, b) unless generate_groups gets prompt_seeds
    # Never sampled (vision placeholders by default); their log-probs are still reported unfiltered.
    suppress_token_ids: tuple[int, ...] | None = None
    # > 1 makes every token already in the prompt or the completion less likely (HF's and vLLM's rule:
    # ``repetition_penalised``); the reported log-probs stay those of the model's own distribution. Evaluation only.
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise OptionError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise OptionError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise OptionError("top_k", f"must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise OptionError("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.repetition_penalty <= 0:
            raise OptionError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")


def derive_seed(*parts) -> int:
    """A 63-bit seed from any parts (seed, step, rank, question key...): independent streams for different parts."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sample_generators(prompt_seeds: Sequence[int] | None, group_sizes: Sequence[int],
                      device) -> list[torch.Generator] | None:
    """One random stream per sample (sample j of prompt b: ``derive_seed(prompt_seeds[b], j)``): a sample's draws
    depend on its prompt's seed and its index only, never on the batch, the rank, or when other samples finish
    (finished samples leave the batch)."""
    if prompt_seeds is None:
        return None
    return [torch.Generator(device=device).manual_seed(derive_seed(seed, j))
            for seed, size in zip(prompt_seeds, group_sizes) for j in range(size)]


def _top_p(filtered: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches ``top_p`` (the crossing token kept) per row. The
    largest 64, then 1024, probabilities are looked at first; the whole vocabulary is sorted only for rows whose
    mass is spread wider than that."""
    probs = torch.softmax(filtered, dim=-1)
    out = torch.full_like(filtered, float("-inf"))
    todo = torch.arange(filtered.shape[0], device=filtered.device)
    for k in (*TOP_P_CANDIDATES, filtered.shape[-1]):
        k = min(k, filtered.shape[-1])
        if k == filtered.shape[-1]:
            top, index = torch.sort(probs[todo], descending=True, dim=-1)
        else:
            top, index = torch.topk(probs[todo], k, dim=-1)  # sorted, largest first
        mass_before = top.cumsum(dim=-1) - top
        enough = (mass_before[:, -1] + top[:, -1] >= top_p) | (k == filtered.shape[-1])
        rows = todo[enough]
        keep = mass_before[enough] < top_p
        chosen = torch.gather(filtered[rows], -1, index[enough]).masked_fill(~keep, float("-inf"))
        out[rows] = out[rows].scatter(-1, index[enough], chosen)
        todo = todo[~enough]
        if todo.numel() == 0:
            break
    return out


def sample_tokens(logits: torch.Tensor, sampling: SamplingConfig, generators: Sequence[torch.Generator] | None,
                  suppress: torch.Tensor | None = None):
    """Pick tokens from [N, V] logits; return (tokens, log-probs of the tempered, unfiltered distribution).

    The vocabulary is paid for a few times per step, not a dozen: a max, one exponential in place
    (w = exp((x - max) / T)), one sum (the log-prob of the drawn token is (x - max) / T - log sum w), top-k and
    top-p masks only when set (top-k by a threshold, top-p from the largest probabilities first), then an
    inverse-CDF draw (``draw_from_weights``): one uniform per sample from its own generator, which picks token i
    with probability w_i / sum(w) exactly.
    """
    logits = logits.float()
    if sampling.temperature == 0:
        allowed = logits if suppress is None else logits.index_fill(-1, suppress, float("-inf"))
        tokens = allowed.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    inverse_t = 1.0 / sampling.temperature
    # The max and the weights are of the tokens that may be drawn: a suppressed token far above the rest (a head
    # biased towards a placeholder) would otherwise underflow every other weight to 0 and the draw degenerate.
    weights = logits.index_fill(-1, suppress, float("-inf")) if suppress is not None else logits
    top = weights.amax(dim=-1, keepdim=True)
    weights = weights.sub_(top) if suppress is not None else torch.sub(weights, top)  # one vocabulary-sized copy
    if sampling.temperature != 1.0:
        weights.mul_(inverse_t)
    log_total = weights.exp_().sum(dim=-1).log()  # the drawable tokens' normaliser
    if suppress is not None:  # plus the suppressed tokens' mass: the reported log-probs stay unfiltered
        log_total = torch.logaddexp(log_total, ((logits.index_select(-1, suppress) - top) * inverse_t).logsumexp(-1))
    if (sampling.top_k and sampling.top_k < logits.shape[-1]) or sampling.top_p < 1.0:
        scaled = logits if sampling.temperature == 1.0 else logits * inverse_t
        filtered = scaled if suppress is None else scaled.index_fill(-1, suppress, float("-inf"))
        if sampling.top_k and sampling.top_k < logits.shape[-1]:
            kth = torch.topk(filtered, sampling.top_k, dim=-1).values[:, -1:]
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if sampling.top_p < 1.0:
            filtered = _top_p(filtered, sampling.top_p)
        weights = weights.masked_fill_(torch.isinf(filtered), 0.0)
    if generators is None:
        uniform = torch.rand(len(weights), 1, dtype=torch.float64, device=weights.device)
    else:
        uniform = torch.stack([torch.rand(1, dtype=torch.float64, device=weights.device, generator=g)
                               for g in generators])
    tokens = draw_from_weights(weights, uniform)
    logprobs = (logits.gather(-1, tokens[:, None]) - top).squeeze(-1) * inverse_t - log_total
    return tokens, logprobs


def seen_tokens(ids: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, V] bool: which tokens row n holds where ``mask`` is set (padding does not count)."""
    seen = torch.zeros(ids.shape[0], vocab, dtype=torch.bool, device=ids.device)
    return seen.scatter_(1, ids.clamp(0, vocab - 1), mask.bool()) if ids.numel() else seen


def repetition_penalised(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty of HF's ``RepetitionPenaltyLogitsProcessor`` and vLLM's ``repetition_penalty``
    (Keskar et al. 2019, CTRL): a token already seen has its logit divided by ``penalty`` when positive,
    multiplied when negative. A copy; ``penalty`` 1 returns ``logits``."""
    if penalty == 1.0:
        return logits
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


def penalised_sample(logits, sampling: SamplingConfig, generators, suppress, seen: torch.Tensor | None):
    """``sample_tokens`` on the penalised logits, reporting the model's own (unpenalised) log-probs."""
    if seen is None or sampling.repetition_penalty == 1.0:
        return sample_tokens(logits, sampling, generators, suppress)
    tokens, _ = sample_tokens(repetition_penalised(logits.float(), seen, sampling.repetition_penalty), sampling,
                              generators, suppress)
    scale = sampling.temperature if sampling.temperature > 0 else 1.0
    return tokens, torch.log_softmax(logits.float() / scale, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def draw_from_weights(weights: torch.Tensor, uniform: torch.Tensor, block: int = SAMPLE_BLOCK) -> torch.Tensor:
    """Inverse CDF: row r's token is the first i whose cumulative weight exceeds uniform[r] * total, so token i
    comes with probability w_i / sum(w) (w >= 0, float32 [N, V]; uniform float64 [N, 1] in [0, 1)). Two levels,
    so the vocabulary is read once, not cumulated: the sums of blocks of ``block`` tokens locate the block, then
    the block's own cumulative sum the token, all accumulated in float64, so both levels agree to float64
    rounding. (Block sums once accumulated in float32 put the target up to ~1e-7 off the block's float64
    cumulative sum: a draw that close to a boundary was decided by float32 summation noise, and the grouped and
    HF engines, whose logits differ by float rounding, parted on such draws.) A token of zero weight is never
    returned (rounding at a block's top end falls back to its last token of positive weight)."""
    rows, vocab = weights.shape
    full = vocab // block * block
    sums = weights[:, :full].reshape(rows, full // block, block).double().sum(dim=-1)  # faster than sum(dtype=)
    if full < vocab:
        sums = torch.cat([sums, weights[:, full:].double().sum(dim=-1, keepdim=True)], dim=-1)
    cdf = sums.cumsum(dim=-1)
    target = uniform * cdf[:, -1:]
    last_block = (cdf < cdf[:, -1:]).sum(dim=-1, keepdim=True)  # the last block of positive weight
    chosen = torch.minimum(torch.searchsorted(cdf, target, right=True), last_block)
    target = (target - (cdf.gather(-1, chosen) - sums.gather(-1, chosen))).clamp_min_(0.0)
    columns = chosen * block + torch.arange(block, device=weights.device)
    inside = columns < vocab
    inner = weights.gather(-1, columns.clamp_max(vocab - 1)).double().masked_fill_(~inside, 0.0).cumsum_(dim=-1)
    last = (inner < inner[:, -1:]).sum(dim=-1, keepdim=True)  # the block's last token of positive weight
    offset = torch.minimum(torch.searchsorted(inner, target, right=True), last)
    return (chosen * block + offset).squeeze(-1)


