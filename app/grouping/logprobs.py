"""Target log-probs without vocabulary-sized logits: the output head computed chunk by chunk, recomputed in backward.

At Qwen's vocabulary (151,936) the float32 logits of 8 x 768 completion tokens take 3.7 GB, and autograd keeps a
log-softmax of the same size for the backward. ``head_returns_logprobs`` makes the model's own output head return,
for each position, ``[log p(target), entropy]`` instead of the logits: the head's matrix product, the softmax and the
gather run ``chunk_size`` rows at a time, only the rows' log-normalisers are kept, and backward recomputes each
chunk's logits. The numbers are those of ``log_softmax(head(h).float() / T).gather(target)``.

The head is still the model's own module, called inside the model's forward: hooks on it (DeepSpeed ZeRO-3's
parameter gathering, the engine's backward hooks on the model output) see an ordinary call, so this works under
every ZeRO stage and with activation checkpointing.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from app.grouping.modules import patched


@dataclass
class CompletionScores:
    """What a forward over completions returns (``completion_logprobs``, the sequence-parallel forward)."""

    logprobs: torch.Tensor  # [N, Lc] log p(token) of each completion token, 0 at padding
    mask: torch.Tensor  # [N, Lc] completion mask (bool)
    logits: torch.Tensor | None = None  # [N, Lc, V] when requested, 0 at padding
    layout: Any = None  # the GroupLayout
    entropy: torch.Tensor | None = None  # [N, Lc] entropy of each token's (tempered) distribution, no gradient
    router: Any = None  # a MoE model's experts.statistics.RouterStatistics, when asked
    routing: Any = None  # a MoE model's experts.record.Routing (the experts each token went to), when asked
    tie_gap: float | None = None  # a replayed routing: experts.plan.tie_gap over the forward's sparse layers
    replay_differs: torch.Tensor | None = None  # a replay: [tokens routed otherwise by this forward, tokens replayed]


def _scaled_logits(hidden, weight, bias, temperature: float) -> torch.Tensor:
    """float32 head(hidden) / T as a fresh tensor (divided in place: no second [chunk, vocab] buffer)."""
    logits = F.linear(hidden, weight, bias)
    logits = logits.float() if logits.dtype != torch.float32 else logits
    return logits.div_(temperature) if temperature != 1.0 else logits


class _ChunkedTargetLogprobs(torch.autograd.Function):
    """log softmax(h W^T + b) / T at ``targets``, chunk by chunk; entropy rides along without gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, settings):
        temperature, chunk_size, want_entropy = settings  # not tensors
        chosen = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        entropy = hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
        normaliser = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = _scaled_logits(hidden[rows], weight, bias, temperature)
            lse = torch.logsumexp(logits, dim=-1)
            normaliser[rows] = lse
            chosen[rows] = logits.gather(-1, targets[rows, None]).squeeze(-1) - lse
            if want_entropy:
                logp = logits - lse[:, None]
                entropy[rows] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, bias if bias is not None else hidden.new_empty(0), targets, normaliser)
        ctx.has_bias, ctx.temperature, ctx.chunk_size = bias is not None, temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(ctx, grad_chosen, _grad_entropy):
        hidden, weight, bias, targets, normaliser = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None  # float32 [vocab, hidden]: the first chunk's product, then accumulated in place (no
        # second vocabulary-sized buffer per chunk: at Qwen2.5-VL-7B's head that is 2.2 GB)
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if bias is not None and ctx.needs_input_grad[2] else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            logits = _scaled_logits(hidden[rows], weight, bias, ctx.temperature)
            # d log_softmax(z)_t / dz = onehot(t) - softmax(z); then through the division by T. In place: one
            # [chunk, vocab] buffer at a time.
            grad_logits = logits.sub_(normaliser[rows, None]).exp_().mul_(-grad_chosen[rows, None])
            grad_logits.scatter_add_(-1, targets[rows, None], grad_chosen[rows, None].float())
            grad_logits = grad_logits.div_(ctx.temperature)
            if grad_hidden is not None:
                grad_hidden[rows] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if ctx.needs_input_grad[1]:
                if grad_weight is None:
                    grad_weight = grad_logits.T @ hidden[rows].float()
                else:
                    grad_weight.addmm_(grad_logits.T, hidden[rows].float())
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        if ctx.needs_input_grad[1] and grad_weight is None:  # no rows here (a sequence-parallel rank may score none)
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None


def chunked_target_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor,
                            temperature: float = 1.0, chunk_size: int = 1024,
                            entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[K] log-probs of ``targets`` under softmax(head(hidden) / T) for hidden [K, H], and [K] entropies (zeros
    unless ``entropy``; never differentiable). Peak extra memory: one [chunk_size, V] float32 block."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _ChunkedTargetLogprobs.apply(hidden, head.weight, head.bias, targets, (float(temperature), int(chunk_size),
                                        bool(entropy)))


@contextmanager
def head_returns_logprobs(model, targets: torch.Tensor, select: torch.Tensor | None, temperature: float,
                          chunk_size: int, entropy: bool):
    """Inside the block, the model's output head returns ``[..., 2]`` = (log-prob of the target, entropy) in
    place of logits.

    The head receives the hidden states the model would turn into logits (shape [..., H]); ``select`` (a bool mask
    of the leading shape, or None for all) picks the rows that have targets, in row-major order, one per entry of
    ``targets``. Unselected rows come back as 0.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"chunked log-probs need a Linear output head, got {type(head).__name__}")

    def forward(hidden):
        rows = hidden.reshape(-1, hidden.shape[-1]) if select is None else hidden[select]
        chosen, ent = chunked_target_logprobs(rows, head, targets, temperature, chunk_size, entropy)
        packed = torch.stack([chosen, ent], dim=-1)
        if select is None:
            return packed.reshape(*hidden.shape[:-1], 2)
        return packed.new_zeros(*hidden.shape[:-1], 2).index_put((select,), packed)

    with patched(head, "forward", forward):  # module hooks (ZeRO-3 gathering) still run around it
        yield
