"""Gated DeltaNet layers (Qwen3.5) in a packed row (app/grouping/recurrent/): each segment continues its parent's
recurrent state and conv inputs, never a sibling's. The layer alone on random segment trees against every path run
on its own through transformers' own layer (outputs and every gradient); the segments each layout yields; the
varlen (flash-linear-attention) wiring through stand-ins of fla's signatures; the whole model grouped against
repeated (video, image and text prompts, checkpointing, families, trees, chunked log-probs); the self-check naming
the layer kind that differed; sequence parallelism's head split; the refused variants."""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch

from app.grouping import GroupLayout, completion_logprobs, verify_grouping
from app.grouping.recurrent import kernels as recurrent_kernels
from app.grouping.recurrent.layer import grouped_linear_attention, head_slices, linear_attention_layers
from app.grouping.recurrent.segments import Segments, layout_segments, tree_segments
from app.runtime.models import TinySizes, build_tokenizer, tiny_config
from tests.helpers import (
    exact_delta_rule,
    fla_conv_stand_in,
    fla_rule_stand_in,
    load,
    max_rel_diff,
    norm_rel,
    prompt_batch,
    random_completions,
    run_and_grad,
    tokenizer_of,
)

LOGPROB_RTOL = 1e-5
GRAD_RTOL = 1e-4


def gdn_layer(dtype=torch.float32, scale: float | None = None, seed: int = 0):
    """One Qwen3.5 GDN layer of the tiny config (4 key heads, 8 value heads, head dim 16, conv width 4)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(seed)
    config = tiny_config("qwen3_5", build_tokenizer()).text_config
    layer = Qwen3_5GatedDeltaNet(config, 0).to(dtype)
    if scale:
        with torch.no_grad():
            for p in layer.parameters():
                if p.ndim >= 2:
                    p.normal_(0.0, scale)
    return layer


def random_tree_segments(rng: random.Random, roots: int = 2) -> Segments:
    """Several trees one after another: each a root and 1-5 nodes, each node continuing a random earlier node of
    its tree (or the root); lengths 1-7, so 1- and 2-token nodes make the conv reach past their parent."""
    starts, lengths, parents = [], [], []
    cursor = 0
    for _ in range(roots):
        root = len(starts)
        members = [root]
        starts.append(cursor)
        lengths.append(rng.randint(3, 9))
        parents.append(-1)
        cursor += lengths[-1]
        chosen = [(1, root), (2, root + 1)] if root == 0 else []  # a 1-token node and its 2-token child: the conv
        for i in range(rng.randint(2, 5)):                        # of the child reaches two segments back
            length, parent = chosen[i] if i < len(chosen) else (rng.choice([1, 1, 2, 3, 5, 7]), rng.choice(members))
            starts.append(cursor)
            lengths.append(length)
            parents.append(parent)
            members.append(len(starts) - 1)
            cursor += length
    return Segments(tuple(starts), tuple(lengths), tuple(parents), cursor)


def paths_of(segments: Segments) -> list[list[int]]:
    parents = set(segments.parents)
    out = []
    for leaf in (s for s in range(len(segments.parents)) if s not in parents):
        path, s = [], leaf
        while s >= 0:
            path.append(s)
            s = segments.parents[s]
        out.append(path[::-1])
    return out


def layer_against_paths(layer, segments: Segments, dtype):
    """(grouped output, its gradients) and (per-path outputs through transformers' own layer, their gradients):
    each segment's loss term counted once (on the first path through it), so both gradients are the same sum."""
    hidden = layer.hidden_size
    x = torch.randn(1, segments.total, hidden, dtype=dtype, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(1, segments.total, hidden, dtype=dtype, generator=torch.Generator().manual_seed(2))

    def span(s):
        return slice(segments.starts[s], segments.starts[s] + segments.lengths[s])

    mine = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    out = grouped_linear_attention(layer, mine, segments)
    (out * weights).sum().backward()
    grouped = (out.detach(), mine.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()})

    theirs = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    counted, outputs = set(), {}
    for path in paths_of(segments):
        row = torch.cat([theirs[:, span(s)] for s in path], dim=1)
        result = type(layer).forward(layer, row)  # transformers' own layer on [path] alone
        cursor, loss = 0, 0
        for s in path:
            piece = result[:, cursor:cursor + segments.lengths[s]]
            outputs.setdefault(s, piece.detach())
            # paths agree on a segment, to the dtype's rounding: rows of different lengths may take different GEMM
            # kernels (float32 on an AVX-512 CPU's MKL: 2.9e-7 of the largest output, 2.5 eps; float64: 0)
            ulps = 16 * torch.finfo(dtype).eps * float(piece.detach().abs().max())
            assert torch.allclose(outputs[s], piece.detach(), rtol=0, atol=ulps), s
            if s not in counted:
                counted.add(s)
                loss = loss + (piece * weights[:, span(s)]).sum()
            cursor += segments.lengths[s]
        loss.backward()
    reference = torch.cat([outputs[s] for s in sorted(outputs, key=lambda s: segments.starts[s])], dim=1)
    return grouped, (reference, theirs.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()})


@pytest.mark.parametrize("seed", range(4))
def test_the_layer_on_random_segment_trees_equals_every_path_on_its_own(seed):
    """float64 and the delta rule of its own definition on both sides: exact but for rounding (RMSNorm computes in
    float32) in the output, the input's gradient (every segment's, so every handed-on state and conv input) and
    every parameter's: the projections, the conv, A_log, dt_bias, the norm."""
    segments = random_tree_segments(random.Random(seed))
    layer = gdn_layer(torch.float64, scale=0.1, seed=seed)
    with exact_delta_rule():
        (out, x_grad, grads), (ref, ref_x_grad, ref_grads) = layer_against_paths(layer, segments, torch.float64)
    assert max_rel_diff(out, ref) <= 1e-6
    assert max_rel_diff(x_grad, ref_x_grad) <= 1e-6
    assert set(grads) == {"dt_bias", "A_log", "conv1d.weight", "norm.weight", "out_proj.weight", "in_proj_qkv.weight",
                          "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"}
    for name in grads:
        assert max_rel_diff(grads[name], ref_grads[name]) <= 1e-6, name
    assert min(segments.lengths) == 1 and max(segments.depths) >= 2  # 1-token nodes, grandchildren: the conv's tail


def test_the_layer_through_transformers_chunked_kernel_is_within_its_rounding():
    """float32, transformers' own chunked torch kernel on both sides (what runs on CPU): within 1e-5 / 1e-4 at the
    model's initial scale (the chunks fall elsewhere in the two layouts, so only rounding separates them)."""
    segments = random_tree_segments(random.Random(7))
    layer = gdn_layer(torch.float32, seed=7)
    (out, x_grad, grads), (ref, ref_x_grad, ref_grads) = layer_against_paths(layer, segments, torch.float32)
    assert max_rel_diff(out, ref) <= LOGPROB_RTOL
    assert max_rel_diff(x_grad, ref_x_grad) <= GRAD_RTOL
    worst = max(grads, key=lambda n: max_rel_diff(grads[n], ref_grads[n]))
    assert max_rel_diff(grads[worst], ref_grads[worst]) <= 5 * GRAD_RTOL, worst  # A_log / dt_bias: sums of many terms


def test_a_shared_state_receives_the_gradient_of_every_continuation(monkeypatch):
    """The prompt's final state, handed to its three responses, gets the sum of the gradients that each response's
    recurrence, run alone from a copy of that state, gives it (the loss on the responses only: the prompt's own
    last output reads its final state too)."""
    segments = Segments((0, 6, 9, 13), (6, 3, 4, 2), (-1, 0, 0, 0), 15)
    layer = gdn_layer(torch.float64, scale=0.1)
    seen = []
    real = recurrent_kernels.TorchKernels.rule

    def spy(self, q, k, v, *, g, beta, initial_state, index):
        initial = initial_state
        out, final = real(self, q, k, v, g=g, beta=beta, initial_state=initial, index=index)
        (final if initial is None else out).retain_grad()
        seen.append(((q, k, v, g, beta), initial, out, final))
        return out, final

    monkeypatch.setattr(recurrent_kernels.TorchKernels, "rule", spy)
    x = torch.randn(1, 15, layer.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with exact_delta_rule():
        (grouped_linear_attention(layer, x, segments)[:, 6:] ** 2).sum().backward()
        (_, _, _, prompt_final), ((q, k, v, g, beta), initial, out, _) = seen
        assert initial.shape[0] == 3  # one call for the three responses, each from the prompt's state
        expected = torch.zeros_like(prompt_final[0])
        for row in range(3):
            state = prompt_final[0].detach().clone().requires_grad_()
            piece, _ = recurrent_kernels.torch_chunk_rule()(
                q[row:row + 1].detach(), k[row:row + 1].detach(), v[row:row + 1].detach(), g=g[row:row + 1].detach(),
                beta=beta[row:row + 1].detach(), initial_state=state[None], output_final_state=True,
                use_qk_l2norm_in_kernel=True)
            piece.backward(out.grad[row:row + 1])
            expected += state.grad
    assert prompt_final.grad is not None and expected.abs().max() > 0
    assert torch.allclose(prompt_final.grad[0], expected, rtol=1e-9, atol=1e-12)


def test_each_layout_says_whose_state_each_segment_continues():
    """A group: P from nothing, each response from P. A family sharing a video: V, then each question from V and
    its responses from the question. A prefix tree: each node from its parent node. The conv's inputs in front of a
    segment walk up its path past short parents, zeros past the root."""
    plain = GroupLayout((2, 1), (5, 4), (3, 1, 2), 6, 3)
    assert layout_segments(plain) == Segments((0, 5, 8, 9, 13), (5, 3, 1, 4, 2), (-1, 0, 0, -1, 3), 15)
    family = GroupLayout((1, 2), (7, 9), (2, 3, 1), 9, 3, families=(2,), shared_lens=(4,))
    seg = layout_segments(family)  # [V:4; Q1:3; R:2; Q2:5; R:3; R:1]
    assert seg.parents == (-1, 0, 1, 0, 3, 3) and seg.lengths == (4, 3, 2, 5, 3, 1)
    assert seg.levels == ((0,), (1, 3), (2, 4, 5))
    tiny = Segments((0, 4, 5, 7), (4, 1, 2, 3), (-1, 0, 1, 2), 10)  # root 4, a 1-token node, 2 tokens, 3 tokens
    assert tiny.path_before(2, 3) == [2, 3, 4]  # node 1's one token, then past it into the root
    assert tiny.path_before(3, 3) == [4, 5, 6] and tiny.path_before(1, 3) == [1, 2, 3]
    assert Segments((0, 2), (2, 3), (-1, 0), 5).path_before(1, 3) == [-1, 0, 1]  # zeros before the root

    class Node:
        def __init__(self, parent):
            self.parent = parent

    class Tree:
        prompt_len, nodes, starts, lengths, total_len = 3, [Node(-1), Node(0), Node(-1)], [3, 5, 6], [2, 1, 4], 10

    assert tree_segments([Tree(), Tree()]).parents == (-1, 0, 1, 0, -1, 4, 5, 4)
    with pytest.raises(ValueError, match="tile the row"):
        Segments((0, 3), (2, 3), (-1, 0), 6)


def test_the_varlen_kernels_wiring_equals_the_padded_torch_path(monkeypatch):
    """flash-linear-attention's varlen calls (played by stand-ins of their signatures: ``initial_state`` [N, C, W]
    for the conv, [N, HV, K, V] for the delta rule, ``cu_seqlens``) give the padded torch path's outputs and
    gradients; the conv's initial state holds each segment's path inputs in its last W - 1 columns."""
    segments = random_tree_segments(random.Random(3))
    layer = gdn_layer(torch.float64, scale=0.1)
    x = torch.randn(1, segments.total, layer.hidden_size, dtype=torch.float64)
    calls = []

    def conv(x, **kwargs):
        calls.append(("conv", kwargs["initial_state"].shape, kwargs["cu_seqlens"].tolist()))
        return fla_conv_stand_in(x, **kwargs)

    results = []
    with exact_delta_rule():
        for kernels in (recurrent_kernels.TorchKernels(), recurrent_kernels.FlaKernels(conv=conv,
                                                                                        rule=fla_rule_stand_in)):
            monkeypatch.setattr(recurrent_kernels, "level_kernels", lambda device, k=kernels: k)
            import app.grouping.recurrent.layer as layer_module

            monkeypatch.setattr(layer_module, "level_kernels", lambda device, k=kernels: k)
            mine = x.clone().requires_grad_()
            layer.zero_grad(set_to_none=True)
            out = grouped_linear_attention(layer, mine, segments)
            (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
            results.append((out.detach(), mine.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (a, ax, ag), (b, bx, bg) = results
    assert max_rel_diff(b, a) <= 1e-10 and max_rel_diff(bx, ax) <= 1e-10
    assert all(max_rel_diff(bg[n], ag[n]) <= 1e-10 for n in ag)
    width, channels = layer.conv_kernel_size, layer.conv_dim
    assert [c[1] for c in calls] == [(len(level), channels, width) for level in segments.levels]
    assert calls[0][2][-1] == sum(segments.lengths[s] for s in segments.levels[0])


def test_sequence_parallel_ranks_hold_blocks_of_key_and_value_heads():
    """Rank r of S holds key heads r*Hk/S.. and value heads r*Hv/S.. (value head j reads key head j / (Hv/Hk)):
    its conv channels are those heads' q, k and v channels; S must divide both head counts (named)."""
    layer = gdn_layer()
    channels, heads = head_slices(layer, 1, 2)  # 4 key heads, 8 value heads, head dim 16
    assert heads == slice(4, 8)
    assert channels.tolist() == [*range(32, 64), *range(64 + 32, 64 + 64), *range(128 + 64, 128 + 128)]
    with pytest.raises(ValueError, match="4 linear key heads and 8 value heads.*3"):
        head_slices(layer, 0, 3)
    from app.grouping.sequence_parallel import check_heads

    config = tiny_config("qwen3_5", build_tokenizer(), TinySizes(linear_heads=(2, 4, 16)))
    check_heads(config, 2)
    with pytest.raises(ValueError, match="Gated DeltaNet.*2 key heads and 4 value heads.*sequence_parallel_size=4"):
        check_heads(config, 4)


def qwen3_5_case(checkpoints, videos, kinds=("video", "image", "text"), sharpen="family", seed=5):
    model, processor = load("qwen3_5", checkpoints, sharpen=sharpen)
    prompts = prompt_batch("qwen3_5", processor, videos, list(kinds))
    rng = random.Random(seed)
    sizes = [rng.randint(1, 3) for _ in kinds]
    lengths = [rng.randint(1, 14) for _ in range(sum(sizes))]
    tok = tokenizer_of(processor)
    ids, mask = random_completions(lengths, min(len(tok), tok.vocab_size), tok.pad_token_id, seed=seed)
    return model, prompts, ids, mask, sizes


def shifted(prompts, pad_id: int, by: int = 17) -> dict:
    """The same prompts with ``by`` more pad tokens on the left: the same rows, their chunks elsewhere."""
    out = dict(prompts)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        if key in prompts:
            fill = pad_id if key == "input_ids" else 0
            out[key] = torch.cat([torch.full((prompts[key].shape[0], by), fill, dtype=prompts[key].dtype),
                                  prompts[key]], dim=1)
    return out


def test_the_model_as_users_run_it_on_cpu_is_within_transformers_own_rounding(tiny_checkpoints, videos):
    """transformers' own chunked kernel in both layouts (nothing patched): grouped differs from repeated by no more
    than repeated differs from itself when its prompts move by 17 pad tokens (the kernel's chunks fall elsewhere:
    7e-5 in log-probs and 4e-4 in gradients at std-0.2 weights), log-probs and every gradient."""
    model, prompts, ids, mask, sizes = qwen3_5_case(tiny_checkpoints, videos, sharpen=0.2)
    pad = tokenizer_of(load("qwen3_5", tiny_checkpoints, sharpen=None)[1]).pad_token_id
    lp, _, grads = run_and_grad(model, prompts, ids, mask, sizes, "grouped")
    ref_lp, _, ref_grads = run_and_grad(model, prompts, ids, mask, sizes, "repeated")
    moved_lp, _, moved_grads = run_and_grad(model, shifted(prompts, pad), ids, mask, sizes, "repeated")
    spread = max_rel_diff(moved_lp, ref_lp)
    assert 0 < spread < 1e-3 and max_rel_diff(lp, ref_lp) <= max(LOGPROB_RTOL, 2 * spread)
    for name in ref_grads:
        own = max_rel_diff(moved_grads[name], ref_grads[name])
        assert max_rel_diff(grads[name], ref_grads[name]) <= max(GRAD_RTOL, 2 * own), name
    assert any("linear_attn.A_log" in n for n in grads) and any(".visual." in n for n in grads)


def test_the_self_check_passes_on_qwen3_5_and_names_the_gdn_layer_when_broken(tiny_checkpoints, videos, monkeypatch):
    """float32 and bfloat16 self-checks pass; with the GDN layers left to transformers (one recurrence across the
    packed row: the bug this package fixes) the check stops the run, exactly, before any numeric comparison, and
    names layer 0, a Gated DeltaNet layer, and says the attention backend cannot help."""
    from app.grouping import GroupingMismatchError
    from app.grouping.recurrent import layer as layer_module

    for dtype in (torch.float32, torch.bfloat16):
        model, prompts, ids, mask, sizes = qwen3_5_case(tiny_checkpoints, videos, ("video", "text"), sharpen=None)
        model = model.to(dtype)
        for key in ("pixel_values", "pixel_values_videos"):
            if key in prompts:
                prompts[key] = prompts[key].to(dtype)
        assert verify_grouping(model, prompts, ids, mask, sizes).dtype == dtype
    model, prompts, ids, mask, sizes = qwen3_5_case(tiny_checkpoints, videos, ("video", "text"), sharpen=None)
    monkeypatch.setattr(layer_module, "install", lambda model, kwarg: 0)
    with pytest.raises(GroupingMismatchError) as failure:
        verify_grouping(model, prompts, ids, mask, sizes)
    text = str(failure.value)
    assert "who sees whom: Gated DeltaNet layer 0 runs transformers' own recurrence across the packed row" in text
    assert "cannot change a Gated DeltaNet layer" in text and "Try backend 'masked'" not in text


def test_the_grouped_forward_runs_each_prompts_gdn_once(tiny_checkpoints, videos, monkeypatch):
    """Each GDN layer's recurrence sees every prompt token once (the level of prompts), then every response token
    once; the repeated layout runs the prompt once per response."""
    model, prompts, ids, mask, sizes = qwen3_5_case(tiny_checkpoints, videos, ("video", "text"), sharpen=None)
    tokens = []
    real = recurrent_kernels.TorchKernels.rule

    def count(self, q, k, v, *, g, beta, initial_state, index):
        tokens.append(int(index.valid.sum()))
        return real(self, q, k, v, g=g, beta=beta, initial_state=initial_state, index=index)

    monkeypatch.setattr(recurrent_kernels.TorchKernels, "rule", count)
    with torch.no_grad():
        completion_logprobs(model, prompts, ids, mask, sizes)
    layers = len(linear_attention_layers(model))
    assert layers == 3 and len(tokens) == 2 * layers
    assert tokens[:2] == [int(prompts["attention_mask"].sum()), int(mask.sum())]


def test_an_uncovered_moe_variant_is_refused_at_start_up_by_name(tmp_path):
    """Qwen3-Next and the text-only Qwen3.5-MoE backbone stop train, SFT, evaluation and the judge before anything
    loads; the released Qwen3.5-MoE (qwen3_5_moe, with its tower) and Qwen3-VL-MoE pass the check."""
    import json

    from app.runtime.models import CheckpointPathError, check_checkpoint

    for model_type in ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_vl_moe"):
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        (folder / "model.safetensors").write_bytes(b"")
        if model_type.endswith("_moe"):
            assert check_checkpoint(folder) == folder
            continue
        with pytest.raises(CheckpointPathError, match=f"is a {model_type} checkpoint, which this trainer refuses"):
            check_checkpoint(folder)


GDN_PROJECTIONS = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]


@pytest.mark.parametrize("setup", ["lora", "frozen tower"])
def test_lora_on_the_gdn_projections_and_a_frozen_tower_with_the_vision_cache(setup, tiny_checkpoints, videos):
    """LoRA with the GDN projections among ``lora.target_modules`` (their adapters train), or a frozen tower with
    the step's vision cache on: grouped equals repeated (log-probs 1e-5, every trainable gradient 1e-4), the cache
    changes no bit, and the grouped engine's greedy tokens are HF generate's."""
    from app.config.sections import LoRAConfig
    from app.grouping.vision import cache as vision_cache
    from app.rollout.generate import SamplingConfig, generate_groups
    from app.runtime.lora import apply as apply_lora

    with exact_delta_rule():
        model, prompts, ids, mask, sizes = qwen3_5_case(tiny_checkpoints, videos, ("video", "image", "text"))
        tok = tokenizer_of(load("qwen3_5", tiny_checkpoints, sharpen=None)[1])
        if setup == "lora":
            apply_lora(model, LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", *GDN_PROJECTIONS]))
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        else:
            model.model.visual.requires_grad_(False)
        cache = vision_cache.install(model, "step") if setup == "frozen tower" else None
        lp, _, grads = run_and_grad(model, prompts, ids, mask, sizes, "grouped")
        ref_lp, _, ref_grads = run_and_grad(model, prompts, ids, mask, sizes, "repeated")
        assert max_rel_diff(lp, ref_lp) <= LOGPROB_RTOL
        assert set(grads) == set(ref_grads) == {n for n, p in model.named_parameters() if p.requires_grad}
        for name in grads:
            assert max_rel_diff(grads[name], ref_grads[name]) <= GRAD_RTOL, name
        if setup == "lora":
            assert {p for p in GDN_PROJECTIONS if any(f"linear_attn.{p}.lora_A" in n for n in grads)} == set(
                GDN_PROJECTIONS)
        else:
            assert cache.counts()["cache_hits"] > 0
            vision_cache.detach(model)
            uncached_lp, _, uncached = run_and_grad(model, prompts, ids, mask, sizes, "grouped")
            assert torch.equal(uncached_lp, lp) and all(torch.equal(uncached[n], grads[n]) for n in grads)
        greedy = SamplingConfig(temperature=0, max_new_tokens=10)
        ours = generate_groups(model, prompts, 1, greedy, tokenizer=tok, eos_ids=[])
        hf = generate_groups(model, prompts, 1, greedy, tokenizer=tok, eos_ids=[], engine="hf")
        assert torch.equal(ours.completion_ids, hf.completion_ids)
        torch.testing.assert_close(ours.logprobs, hf.logprobs, rtol=0, atol=1e-5)


@pytest.mark.slow  # compiling the step on this CPU: about 40-60 s
def test_the_compiled_step_on_qwen3_5_draws_the_eager_tokens(tiny_checkpoints, videos):
    """rollout.decode=compiled with each sample's GDN states updated in place inside the compiled step: the eager
    greedy tokens, compiled once for the bucket and not again for the next rollout's prompts."""
    from app.grouping import StaticSteps
    from app.rollout.generate import SamplingConfig, generate_groups

    model, processor = load("qwen3_5", tiny_checkpoints)
    tok = tokenizer_of(processor)
    keep, greedy = StaticSteps(), SamplingConfig(temperature=0, max_new_tokens=10)
    for i, kinds in enumerate((["video", "text"], ["text", "image"])):
        prompts = prompt_batch("qwen3_5", processor, videos, kinds)
        with torch.no_grad():
            eager = generate_groups(model, prompts, 2, greedy, tokenizer=tok, eos_ids=[], decode="eager")
            compiled = generate_groups(model, prompts, 2, greedy, tokenizer=tok, eos_ids=[], decode="compiled",
                                       static_steps=keep)
        assert torch.equal(eager.completion_ids, compiled.completion_ids), kinds
        assert compiled.parts["kept/compiles"] == float(i == 0) and compiled.parts["recompiles"] == 0, i


@pytest.mark.slow  # three 2-process runs through scripts/train.sh and one evaluation (about 2-3 minutes)
@pytest.mark.distributed
def test_qwen3_5_through_the_launchers_killed_and_resumed_then_evaluated(tmp_path):
    """scripts/train.sh on a tiny Qwen3.5 and generated videos: 2 processes as one replica of S = 2 (the GDN layers
    Ulysses over their heads), ZeRO-3, data.questions_per_video=2, the grouped engine spreading each family's
    rollout over the pair (each rank its heads' GDN states), 2 steps. Killed (SIGKILL) at a
    seeded random moment and resumed, it ends bit for bit at the uninterrupted run's weights, which training moved;
    scripts/eval.sh scores the final model on held-out videos."""
    import json
    import subprocess
    import time

    from safetensors.torch import load_file

    from app.data.synthetic import generate
    from app.runtime.models import build_tiny_checkpoint
    from tests.helpers import killed_at_random
    from tests.test_trainer import ROOT, run

    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", "qwen3_5", seed=0)
    files = generate(tmp_path / "data", train=8, heldout=3, seed=0, questions_per_video=2)
    plugin = tmp_path / "varied_reward.py"  # rewards that differ within every group: the weights really move
    plugin.write_text("def varied(completions, records):\n    return [len(c) % 5 / 4 for c in completions]\n")
    pixels = ["data.min_pixels=4096", "data.max_pixels=4096"]  # 64 x 64: Qwen3.5's patch 16, merge 2

    def launch(out, *extra):
        settings = {"model.path": checkpoint, "data.train_file": files["train"], "train.output_dir": out,
                    "data.shuffle": False, "data.max_frames": 4, "data.questions_per_video": 2,
                    "train.sequence_parallel_size": 2, "train.deepspeed_config": "deepspeed_configs/zero3.json",
                    "train.max_steps": 2, "train.save_every": 1, "train.prompts_per_rank": 2,
                    "train.groups_per_micro_batch": 2, "train.learning_rate": 1e-3, "rollout.group_size": 2,
                    "rollout.sp_split": "spread",  # the GDN states' heads shared out (auto keeps this length whole)
                    "rollout.max_completion_length": 6, "logging.progress_bar": False,
                    "logging.wandb_mode": "disabled", "rewards.functions": f"[format, accuracy, '{plugin}:varied']"}
        return ["bash", "scripts/train.sh", "configs/demo_cpu.yaml", *[f"{k}={v}" for k, v in settings.items()],
                *pixels, *extra]

    env = {"NPROC_PER_NODE": "2"}
    start = time.perf_counter()
    run(launch(tmp_path / "straight"), env=env, timeout=900)
    took = time.perf_counter() - start
    rows = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["tokens/shared_video"] > 0 for r in rows)
    killed_at_random(launch(tmp_path / "resumed"), tmp_path / "resumed", env, took, random.Random(73), (0.4, 0.8))
    run(launch(tmp_path / "resumed", "train.resume=true"), env=env, timeout=900)
    straight, resumed = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("straight", "resumed"))
    initial = load_file(str(checkpoint / "model.safetensors"))
    assert sum(not torch.equal(straight[n], initial[n]) for n in straight) > len(straight) // 2
    assert any("linear_attn" in n and not torch.equal(straight[n], initial[n]) for n in straight)
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    evaluated = subprocess.run(["bash", "scripts/eval.sh", str(tmp_path / "straight" / "final"), str(files["heldout"]),
                                f"eval.output_dir={tmp_path / 'eval'}", *pixels, "eval.max_new_tokens=8"],
                               cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["overall"]["count"] == 3 and summary["skipped_total"] == 0


def test_a_sequence_parallel_size_the_gdn_heads_refuse_stops_before_the_load_in_one_line(tiny_checkpoints, tmp_path):
    """A Qwen3.5 whose GDN layers have 3 key / 6 value heads and S = 2 (its 4 query / 2 KV heads allow 2):
    ``NPROC_PER_NODE=2 scripts/train.sh`` stops before torchrun starts, exit 1, one line naming the key, the GDN heads
    and the checkpoint; its weights file is garbage, so a load would have failed otherwise. The planner gives the
    same reason (one check for both)."""
    import json
    import shutil
    import subprocess

    from app.planning.planner import PlanError, check_sequence_parallel
    from app.training.preflight import text_config
    from tests.test_trainer import ROOT

    checkpoint = tmp_path / "qwen3_5_odd_heads"
    shutil.copytree(tiny_checkpoints["qwen3_5"], checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["text_config"].update(linear_num_key_heads=3, linear_num_value_heads=6)
    (checkpoint / "config.json").write_text(json.dumps(config))
    (checkpoint / "model.safetensors").write_bytes(b"not a safetensors file")
    result = subprocess.run(["bash", "scripts/train.sh", "configs/demo_cpu.yaml", f"model.path={checkpoint}",
                             f"train.output_dir={tmp_path / 'out'}", "train.sequence_parallel_size=2"], cwd=ROOT,
                            env={**os.environ, "NPROC_PER_NODE": "2"}, capture_output=True, text=True, timeout=120)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("config error: 'train.sequence_parallel_size'=2 does not fit")
    assert "their 3 key heads and 6 value heads must each divide by 2" in lines[0] and str(checkpoint) in lines[0]
    assert not (tmp_path / "out").exists()
    with pytest.raises(PlanError, match="their 3 key heads and 6 value heads must each divide by 2"):
        check_sequence_parallel(text_config(checkpoint), 2, 2)


def test_the_torch_kernel_keeps_strong_decays_to_float32_rounding_where_transformers_loses_them():
    """The delta rule the grouped row runs off CUDA (and, through ``kernels.use_accurate_fallback``, transformers'
    GDN layers in ordinary batches): many decays between neighbours near 1 (log-decays of -U(0, 0.05)) among strong ones (-U(0, 60)), against
    the rule token by token in float64: outputs and the gradient of g within 2e-6 of it, where transformers' chunked
    form (exp of differences of float32 running sums) is 1e-5 and more away (2.6e-5 / 3.5e-5 measured)."""
    from app.grouping.recurrent.kernels import chunk_gated_delta_rule, transformers_chunk_rule
    from tests.helpers import delta_rule_reference

    generator = torch.Generator().manual_seed(0)
    b, length, heads, dim = 1, 192, 2, 16
    q, k, v = (torch.randn(b, length, heads, dim, generator=generator) for _ in range(3))
    strong, weak = -torch.rand(b, length, heads, generator=generator) * 60, -torch.rand(b, length, heads,
                                                                                       generator=generator) * 0.05
    g = torch.where(torch.rand(b, length, heads, generator=generator) < 0.6, weak, strong)  # running sums in the
    beta = torch.rand(b, length, heads, generator=generator)  # hundreds, many decays between neighbours near 1

    def run(rule, dtype):
        leaf = g.detach().to(dtype).clone().requires_grad_()
        out, _ = rule(q.to(dtype), k.to(dtype), v.to(dtype), g=leaf, beta=beta.to(dtype), use_qk_l2norm_in_kernel=True)
        (out * torch.linspace(-1, 1, dim, dtype=dtype)).sum().backward()
        return out.double(), leaf.grad.double()

    want = run(delta_rule_reference, torch.float64)
    ours = run(chunk_gated_delta_rule, torch.float32)
    theirs = run(transformers_chunk_rule(), torch.float32)
    for got, ref in zip(ours, want):
        assert max_rel_diff(got, ref) <= 2e-6
    assert max(max_rel_diff(got, ref) for got, ref in zip(theirs, want)) >= 1e-5  # why the workaround exists
    in64 = run(chunk_gated_delta_rule, torch.float64)
    assert all(max_rel_diff(got, ref) <= 1e-12 for got, ref in zip(in64, want))  # float64 stays float64


def precision_case(family, videos, root, sharpen):
    """The issue's shapes: 5 decoder layers (GDN, attention, GDN, GDN, attention), MoE: 5 experts top-2 and the shared
    expert, routers x4; weights redrawn at ``sharpen``; video, image and text prompts of about 2k tokens; groups of
    1, 3 and 2 completions of 1 to 40 tokens."""
    from app.data.prompts import encode_prompts
    from app.runtime.models import load_model, load_processor
    from app.runtime.tiny import build_processor, model_class
    from tests.helpers import conversations_of

    out = root / family
    if not (out / "config.json").exists():
        tokenizer = build_tokenizer()
        config = tiny_config(family, tokenizer, TinySizes(hybrid_layers=5, experts=5, experts_per_token=2))
        config.text_config.layer_types = ["linear_attention", "full_attention", "linear_attention", "linear_attention",
                                          "full_attention"]
        torch.manual_seed(0)
        model_class(config).from_config(config, dtype=torch.float32).save_pretrained(out)
        build_processor(family, tokenizer, template=tokenizer.chat_template).save_pretrained(out)
    model, processor = load_model(out), load_processor(out)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.normal_(0.0, sharpen, generator=generator)
            if name.endswith("mlp.gate.weight"):
                param.mul_(4.0)
    conversations = conversations_of(family, videos, ["video", "image", "text"])
    tok = tokenizer_of(processor)
    filler = "the red circle moves left then the blue square moves right and the green triangle appears first "
    repeats = 2048 // len(tok(filler)["input_ids"])
    while len(tok(filler * repeats)["input_ids"]) < 2048:  # at least 2,048 tokens of text alone in every prompt
        repeats += 1
    for i, conversation in enumerate(conversations):
        conversation[0]["content"][-1]["text"] = filler * (repeats + i) + conversation[0]["content"][-1]["text"]
    prompts = encode_prompts(processor, conversations)
    assert int(prompts["attention_mask"].sum(1).min()) >= 2048
    rng = random.Random(5)
    lengths = [1] + [rng.randint(1, 40) for _ in range(5)]
    ids, mask = random_completions(lengths, min(len(tok), tok.vocab_size), tok.pad_token_id, width=42, seed=5)
    return model, prompts, ids, mask, [1, 3, 2], tok.pad_token_id


@pytest.mark.slow  # a float64 reference and three float32 passes at 2k-token prompts, per family (about 30 s)
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_grouped_is_as_close_to_a_float64_reference_as_repeated_at_2k_token_prompts(family, videos, tmp_path):
    """The float32 distance of the grouped layout to a float64 run (its delta rule in float64 too) is at most 1.5x
    the repeated layout's, in log-probs and in every gradient. The repeated layout's float32 error is taken as the
    larger of two samples of it (its rows as given, and shifted by 17 pads: where its chunks fall moves each
    tensor's error by 2-4x at these sizes, and the grouped row runs every prompt token once where the repeated rows
    average G roundings of it). Before the span-sum delta rule, the grouped layout stood 3x further than repeated
    on Qwen3.5-MoE (2.3e-5 against 7.8e-6 in log-probs). And grouped against repeated directly, the float32
    promise at these sizes: log-probs within 1e-5 (max-relative), every gradient within 1e-4 (norm-relative). With
    transformers' chunked rule in place of the span-sum one both layouts stand 3-5x further from float64 and this
    fails (measured: Qwen3.5-MoE log-probs 2.0e-5 apart, gradients up to 5.2e-4; Qwen3.5 gradients 1.9e-4)."""
    import sys

    from app.grouping.recurrent import kernels

    model, prompts, ids, mask, sizes, pad = precision_case(family, videos, tmp_path, sharpen=0.2)
    reference = copy.deepcopy(model).double()
    if family == "qwen3_5_moe":
        reference.set_experts_implementation("eager")  # grouped_mm has no float64 kernel on CPU
    ref_lp, _, ref_grads = run_and_grad(reference, {k: v.double() if v.is_floating_point() else v
                                                    for k, v in prompts.items()}, ids, mask, sizes, "repeated")
    gdn = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    assert getattr(sys.modules[type(gdn).__module__].torch_chunk_gated_delta_rule, "_prefix_grouping_accurate", False)
    assert kernels.torch_chunk_rule() is kernels.chunk_gated_delta_rule  # every layout runs what users run
    runs = {"grouped": run_and_grad(model, prompts, ids, mask, sizes, "grouped"),
            "repeated": run_and_grad(model, prompts, ids, mask, sizes, "repeated"),
            "shifted": run_and_grad(model, shifted(prompts, pad), ids, mask, sizes, "repeated")}
    distance = {name: (max_rel_diff(lp.double(), ref_lp), {n: max_rel_diff(g.double(), ref_grads[n])
                                                           for n, g in grads.items()})
                for name, (lp, _, grads) in runs.items()}
    floor = lambda key: max(distance["repeated"][1][key], distance["shifted"][1][key])  # noqa: E731
    assert distance["grouped"][0] <= 1.5 * max(distance["repeated"][0], distance["shifted"][0])
    over = {n: distance["grouped"][1][n] / floor(n) for n in ref_grads if distance["grouped"][1][n] > 1.5 * floor(n)}
    assert not over, over
    assert any("linear_attn.A_log" in n for n in ref_grads) and any(".visual." in n for n in ref_grads)
    (grouped_lp, _, grouped), (repeated_lp, _, repeated) = runs["grouped"], runs["repeated"]
    assert max_rel_diff(grouped_lp, repeated_lp) <= LOGPROB_RTOL
    apart = {n: norm_rel(grouped[n], repeated[n]) for n in repeated}
    assert max(apart.values()) <= GRAD_RTOL, max(apart, key=apart.get)
