"""Chunked target log-probs (the output head run a chunk at a time, recomputed in backward) against full logits."""

from __future__ import annotations

import pytest
import torch

from app.grouping import MODES, completion_logprobs
from app.grouping.logprobs import chunked_target_logprobs
from app.runtime.models import FAMILIES
from tests.helpers import max_rel_diff
from tests.test_equivalence import make_case


def _run(model, prompts, ids, mask, sizes, mode, chunk_size, temperature):
    model.zero_grad(set_to_none=True)
    scores = completion_logprobs(model, prompts, ids, mask, sizes, mode=mode, temperature=temperature,
                                 return_entropy=True, chunk_size=chunk_size)
    weights = torch.linspace(-1.0, 2.0, ids.shape[1])[None, :]  # signs differ, so no gradient cancels by symmetry
    (scores.logprobs * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return scores.logprobs.detach(), scores.entropy, grads


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen2", "qwen3_vl_moe", "qwen3_5_moe"])
def test_chunked_equals_full_logits(family, mode, tiny_checkpoints, videos):
    model, prompts, ids, mask, sizes = make_case(family, tiny_checkpoints, videos, seed=5)
    full_lp, full_entropy, full_grads = _run(model, prompts, ids, mask, sizes, mode, 0, 0.7)
    # 7 does not divide the token count, so the last chunk is short.
    lp, entropy, grads = _run(model, prompts, ids, mask, sizes, mode, 7, 0.7)
    assert int(mask.sum()) % 7 != 0
    assert max_rel_diff(lp, full_lp) <= 1e-6
    assert max_rel_diff(entropy, full_entropy) <= 1e-6
    assert bool((lp[mask == 0] == 0).all()) and bool((entropy[mask == 0] == 0).all())
    assert set(grads) == set(full_grads)
    worst = max(grads, key=lambda n: max_rel_diff(grads[n], full_grads[n]))
    assert max_rel_diff(grads[worst], full_grads[worst]) <= 1e-5, worst


def test_grouped_equals_repeated_chunked(tiny_checkpoints, videos):
    model, prompts, ids, mask, sizes = make_case("qwen2_5_vl", tiny_checkpoints, videos, seed=3)
    grouped = _run(model, prompts, ids, mask, sizes, "grouped", 16, 1.0)
    repeated = _run(model, prompts, ids, mask, sizes, "repeated", 16, 1.0)
    assert max_rel_diff(grouped[0], repeated[0]) <= 1e-5
    worst = max(grouped[2], key=lambda n: max_rel_diff(grouped[2][n], repeated[2][n]))
    assert max_rel_diff(grouped[2][worst], repeated[2][worst]) <= 1e-4, worst


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_function_gradients(bias):
    """Every input's gradient against autograd through full logits (float64, with a bias, T != 1)."""
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(6, 11, bias=bias).double()
    hidden = torch.randn(9, 6, dtype=torch.float64, generator=generator, requires_grad=True)
    targets = torch.randint(0, 11, (9,), generator=generator)
    upstream = torch.randn(9, dtype=torch.float64, generator=generator)

    chosen, _ = chunked_target_logprobs(hidden, head, targets, temperature=0.6, chunk_size=4)
    assert chosen.dtype == torch.float32  # like logits.float(): the log-probs are float32 whatever the weights
    (chosen.double() * upstream).sum().backward()
    got = [hidden.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if bias else [])
    hidden.grad = None
    head.zero_grad(set_to_none=True)
    full = torch.log_softmax(head(hidden).float() / 0.6, -1).gather(-1, targets[:, None]).squeeze(-1)
    assert max_rel_diff(chosen, full) <= 1e-6
    (full.double() * upstream).sum().backward()
    want = [hidden.grad, head.weight.grad] + ([head.bias.grad] if bias else [])
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and max_rel_diff(a, b) <= 1e-6


def test_chunked_function_with_no_rows_gives_the_head_a_zero_gradient():
    """A sequence-parallel rank can score no completion token: the head still gets a (zero) gradient, as every rank
    must for DeepSpeed's reduction, never None."""
    head = torch.nn.Linear(6, 11)
    hidden = torch.zeros(0, 6, requires_grad=True)
    chosen, _ = chunked_target_logprobs(hidden, head, torch.zeros(0, dtype=torch.long), chunk_size=4)
    chosen.sum().backward()
    assert head.weight.grad is not None and not head.weight.grad.any()
    assert head.bias.grad is not None and not head.bias.grad.any()


def test_head_restored_and_families_have_linear_heads(tiny_checkpoints):
    from app.grouping.logprobs import head_returns_logprobs
    from app.runtime.models import load_model

    for family in FAMILIES:
        model = load_model(tiny_checkpoints[family])
        head = model.get_output_embeddings()
        with head_returns_logprobs(model, torch.zeros(1, dtype=torch.long), None, 1.0, 4, False):
            assert "forward" in vars(head)
        assert "forward" not in vars(head)
