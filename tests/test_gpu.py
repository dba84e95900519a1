"""GPU-only checks (CUDA): run by scripts/gpu_check.sh; skipped cleanly everywhere else.

FlexAttention forward + backward (fp32 and bf16) on many packed lengths against the masked reference, flash-attn
varlen when it imports, the full model in bf16 on CUDA against a float32 forward (the low-precision criterion),
grouped decoding against HF generate, one GRPO step in bf16 through the real trainer, and the flex prefix-tree
attention (no [T, T] mask) against the dense tree mask, forward and backward.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh)")]


def _layouts(count, seed=0):
    from tests.test_attention import random_layout

    rng = random.Random(seed)
    return [random_layout(rng, max_prefix=900, max_response=300) for _ in range(count)]


def _flex_equals_masked(attend, length: int, dtype) -> None:
    """``attend(backend, q, k, v)``: the flex backend's output and q/k/v gradients equal the masked backend's (fp32
    1e-4, bf16 3e-2) on random q [1, 8, T, 64] and k, v [1, 2, T, 64]."""
    q = torch.randn(1, 8, length, 64, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 2, length, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    results = {}
    for backend in ("flex", "masked"):
        out = attend(backend, q, k, v)
        weight = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).float()
        grads = torch.autograd.grad((out.float() * weight).sum(), (q, k, v))
        results[backend] = (out.float(), [g.float() for g in grads])
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(results["flex"][0], results["masked"][0], rtol=tolerance, atol=tolerance)
    for got, want in zip(results["flex"][1], results["masked"][1]):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_forward_backward_matches_masked_on_many_lengths(dtype):
    from torch._dynamo.utils import counters

    from app.grouping import GroupedAttentionPlan, grouped_attention

    before = counters["stats"]["unique_graphs"]
    for layout in _layouts(16):
        _flex_equals_masked(lambda backend, q, k, v, layout=layout: grouped_attention(GroupedAttentionPlan(layout, backend),
                                                                                       q, k, v),
                            layout.total_len, dtype)
    assert counters["stats"]["unique_graphs"] - before <= 4  # forward and backward graphs, not one per length


def test_flash_varlen_matches_masked():
    pytest.importorskip("flash_attn")
    from app.grouping import GroupedAttentionPlan, grouped_attention

    for layout in _layouts(4, seed=1):
        q, k, v = (torch.randn(1, 8, layout.total_len, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        out = grouped_attention(GroupedAttentionPlan(layout, "flash"), q, k, v)
        ref = grouped_attention(GroupedAttentionPlan(layout, "masked"), q, k, v)
        torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2)
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
        ref_grads = torch.autograd.grad(ref.float().sum(), (q, k, v))
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)


def bf16_case_on_cuda(family, tiny_checkpoints, videos):
    """A family's float32 model and its bf16 copy on the GPU, with a grouped case (prompts, ids, mask, sizes)."""
    from tests.test_bf16 import bf16_rounded, case

    model32, model16, processor = bf16_rounded(family, tiny_checkpoints)
    prompts, ids, mask, sizes = case(family, processor, videos)
    prompts = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in prompts.items()}
    return model32.cuda(), model16.cuda(), prompts, ids.cuda(), mask.cuda(), sizes


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen2", "qwen3_5"])
def test_bf16_model_on_cuda_no_worse_than_repeated(family, tiny_checkpoints, videos):
    """Qwen3.5 here runs the GDN kernels users get on CUDA (flash-linear-attention's varlen ones where installed,
    else transformers' torch fallback), not the CPU tests' exact rule."""
    from app.grouping import compare_to_reference, completion_logprobs, default_backend, verify_grouping

    model32, model16, prompts, ids, mask, sizes = bf16_case_on_cuda(family, tiny_checkpoints, videos)
    with torch.no_grad():
        reference = completion_logprobs(model32, prompts, ids, mask, sizes, mode="repeated").logprobs
        repeated = completion_logprobs(model16, prompts, ids, mask, sizes, mode="repeated").logprobs
        grouped = completion_logprobs(model16, prompts, ids, mask, sizes, backend=default_backend("cuda")).logprobs
    comparison = compare_to_reference(grouped, repeated, reference, mask)
    print(f"\n{family} {default_backend('cuda')}: {comparison.describe()}")
    assert comparison.passes(), comparison.describe()
    verify_grouping(copy.deepcopy(model16), prompts, ids, mask, sizes)


def test_fla_varlen_delta_rule_and_its_initial_state_gradient_equal_the_torch_paths():
    """flash-linear-attention's chunk_gated_delta_rule with cu_seqlens and a per-sequence initial state (the adapter
    in app/grouping/recurrent/kernels.py, FlashQLA off) on one level of segments, against transformers' torch path
    run on each sequence alone with autograd, float32: the outputs, the initial states' gradient (dh0) and every
    input's gradient, as relative differences (app.bench.gpu.hybrid.kernels_check, the gpu_check part's own
    numbers). The bound (2e-3) is set before any measurement: fla's kernels may accumulate in tf32."""
    pytest.importorskip("fla")
    from app.bench.gpu.hybrid import kernels_check

    row = kernels_check(torch.device("cuda"))
    print(f"\nfla against the torch path: {row}")
    assert row["kernels"] == "fla", row
    assert row["out"] < 2e-3 and row["dh0"] < 2e-3 and row["grads"] < 2e-3, row


def test_grouped_decode_equals_hf_generate_on_cuda(tiny_checkpoints, videos):
    from app.rollout.generate import SamplingConfig, generate_groups
    from tests.helpers import load, prompt_batch, tokenizer_of

    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    model = model.cuda()
    prompts = {k: v.cuda() if isinstance(v, torch.Tensor) else v
               for k, v in prompt_batch("qwen2_5_vl", processor, videos, ["video", "text"]).items()}
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    ours = generate_groups(model, prompts, 1, greedy, tokenizer=tokenizer_of(processor), eos_ids=[])
    hf = generate_groups(model, prompts, 1, greedy, tokenizer=tokenizer_of(processor), eos_ids=[], engine="hf")
    assert torch.equal(ours.completion_ids.cpu(), hf.completion_ids.cpu())


def test_one_grpo_step_in_bf16_on_cuda(tmp_path):
    from app.data.synthetic import generate
    from app.runtime.models import build_tiny_checkpoint
    from tests.test_trainer import run, trainer

    assets = {"checkpoint": build_tiny_checkpoint(tmp_path / "tiny", "qwen2_5_vl", seed=0),
              "train": generate(tmp_path / "data", train=8, heldout=2, seed=0)["train"]}
    plugin = tmp_path / "varied.py"
    plugin.write_text("def varied(completions, records):\n    return [len(c) % 5 / 4 for c in completions]\n")
    assets["plugin"] = f"{plugin}:varied"
    out = tmp_path / "run"
    result = run(trainer(assets, out, **{"model.dtype": "bfloat16", "train.max_steps": 2}))
    assert "self-check passed: torch.bfloat16" in result.stderr
    assert (out / "final" / "model.safetensors").is_file()


def _random_trees(rng, count):
    """Prefix trees of random shape and lengths (parents before children), tokens irrelevant: attention only."""
    from app.grouping.tree.layout import PrefixTree, TreeNode

    trees = []
    for _ in range(count):
        nodes = []
        for n in range(rng.randint(1, 9)):
            length = rng.randint(1, 200)
            nodes.append(TreeNode(rng.randint(-1, n - 1), torch.zeros(length, dtype=torch.long),
                                  torch.ones(length, dtype=torch.bool)))
        trees.append(PrefixTree({"input_ids": torch.zeros(1, rng.randint(1, 900), dtype=torch.long)}, nodes))
    return trees


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_tree_attention_forward_backward_matches_the_dense_tree_mask(dtype):
    """The flex prefix-tree backend (no [T, T] mask) against the dense tree mask, forward and backward, on random
    forests (1-3 trees of 1-9 nodes in a row)."""
    from app.grouping.tree.layout import TreeAttentionPlan

    rng = random.Random(3)
    for _ in range(8):
        trees = _random_trees(rng, rng.randint(1, 3))
        _flex_equals_masked(lambda backend, q, k, v, trees=trees: TreeAttentionPlan(trees, backend).attend(None, q, k, v),
                            sum(t.total_len for t in trees), dtype)


# ---- real width: the default backend on the VL classes ------------------------------------------------------------
@pytest.mark.parametrize("preset", ["qwen2_5_vl_7b", "qwen3_vl_8b"])
def test_the_default_backend_trains_at_real_width(preset):
    """The CUDA default grouped backend (flash-attn, else FlexAttention, compiled) runs forward and backward on the
    real VL class at full width (2 decoder layers, random weights, bf16) for an 8k prefix, G = 8 completions of 64,
    with finite gradients; on the first two completions its log-probs are no worse than the repeated layout's
    against a float32 forward (the float32 repeated reference runs torch's math attention kernel under GQA: 65 GiB
    of scores for 8 rows of 8k at Qwen3-VL-8B's 32 heads, measured on an H200; 2 rows need a quarter)."""
    from app.bench.gpu.real_shape import build, inputs
    from app.grouping import compare_to_reference, completion_logprobs, default_backend

    model, _ = build(preset, 2, torch.bfloat16, torch.device("cuda"))
    prompts, completions, mask = inputs(8192, 8, 64, "cuda")
    backend = default_backend("cuda")
    scores = completion_logprobs(model, prompts, completions, mask, 8, backend=backend, return_entropy=True)
    scores.logprobs.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    del scores, grads
    model.zero_grad(set_to_none=True)
    completions, mask = completions[:2], mask[:2]
    with torch.no_grad():
        grouped = completion_logprobs(model, prompts, completions, mask, 2, backend=backend).logprobs
        repeated = completion_logprobs(model, prompts, completions, mask, 2, mode="repeated").logprobs
        reference = completion_logprobs(model.float(), prompts, completions, mask, 2, mode="repeated").logprobs
    comparison = compare_to_reference(grouped, repeated, reference, mask)
    print(f"\n{preset} {backend}: {comparison.describe()}")
    assert comparison.passes(), comparison.describe()


# ---- decoding: the captured step and the batched-product attention ------------------------------------------------
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_decode_attention_on_cuda_equals_a_dense_softmax(static):
    from tests.test_static_decode import check_decode_attention

    check_decode_attention(static, "cuda")


def test_a_kept_and_a_compiled_step_draw_what_eager_steps_draw_in_bf16(tiny_checkpoints, videos):
    """On CUDA in bf16, seeded: the graph kept across rollouts (one capture over three rollouts of prompts of other
    lengths, replayed from the first step of the later ones) and the compiled step (compiled once, no recompile, then
    captured) draw the eager steps' tokens, log-probs within bf16 rounding."""
    from app.grouping import StaticSteps
    from app.rollout.generate import SamplingConfig, generate_groups
    from tests.helpers import load, prompt_batch, tokenizer_of

    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    model = model.cuda().to(torch.bfloat16)
    tok = tokenizer_of(processor)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=24, seed=5)
    kept = {"graph": StaticSteps(), "compiled": StaticSteps()}
    for i, kinds in enumerate((["video", "text"], ["text", "video"], ["video", "video"])):
        prompts = {k: v.cuda() if isinstance(v, torch.Tensor) else v
                   for k, v in prompt_batch("qwen2_5_vl", processor, videos, kinds).items()}
        eager = generate_groups(model, prompts, [3, 2], sampling, tokenizer=tok, eos_ids=[], decode="eager")
        for mode, keep in kept.items():
            got = generate_groups(model, prompts, [3, 2], sampling, tokenizer=tok, eos_ids=[], decode=mode,
                                  static_steps=keep)
            assert torch.equal(got.completion_ids, eager.completion_ids), (mode, i)
            torch.testing.assert_close(got.logprobs, eager.logprobs, rtol=0, atol=0.05)  # bf16 rounding
            assert got.parts["graph_replayed"] == 1.0 and got.parts["kept/captures"] == float(i == 0), (mode, i)
            assert got.parts["recompiles"] == 0, (mode, i)


def test_a_captured_decode_step_draws_what_eager_steps_draw(tiny_checkpoints, videos):
    """decode="graph" (the CUDA default: the static step captured as a CUDA graph and replayed) against eager steps:
    the same tokens, masks and stop reasons, log-probs to float rounding, with groups of unequal sizes, prompts of
    unequal lengths and samples that stop; and the graph was really captured and replayed."""
    from app.grouping import GroupedDecoder
    from app.rollout.generate import SamplingConfig, generate_groups
    from tests.helpers import load, prompt_batch, tokenizer_of

    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    model = model.cuda()
    prompts = {k: v.cuda() if isinstance(v, torch.Tensor) else v
               for k, v in prompt_batch("qwen2_5_vl", processor, videos, ["video", "text"]).items()}
    tok = tokenizer_of(processor)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=40, seed=3)
    free = generate_groups(model, prompts, [3, 2], sampling, tokenizer=tok, eos_ids=[], decode="eager")
    eos = sorted({int(free.completion_ids[0, 5]), int(free.completion_ids[4, 9])})
    runs = {mode: generate_groups(model, prompts, [3, 2], sampling, tokenizer=tok, eos_ids=eos, decode=mode)
            for mode in ("eager", "static", "graph")}
    assert "eos" in runs["eager"].stop_reasons
    for mode in ("static", "graph"):
        assert torch.equal(runs[mode].completion_ids, runs["eager"].completion_ids), mode
        assert torch.equal(runs[mode].completion_mask, runs["eager"].completion_mask), mode
        assert runs[mode].stop_reasons == runs["eager"].stop_reasons
        torch.testing.assert_close(runs[mode].logprobs, runs["eager"].logprobs, rtol=0, atol=1e-5)
    assert torch.equal(runs["graph"].logprobs, runs["static"].logprobs)  # the replay runs the same kernels
    with torch.no_grad():
        decoder = GroupedDecoder(model, prompts, [3, 2], 8, decode="graph")
        tokens = torch.zeros(5, dtype=torch.long, device="cuda")
        first = decoder.step(tokens).clone()
        second = decoder.step(tokens)
        assert decoder.graph is not None, decoder.graph_error
        assert not torch.equal(first, second)  # a new position, new logits: the replay advanced
        decoder.close()


# ---- torch's own varlen flash kernel (no flash-attn package): the tower, decode, the chunked prefill, flash ----
def _varlen_runs() -> bool:
    from app.grouping.kernels import varlen_unusable

    return not varlen_unusable("cuda", torch.bfloat16, 128)


needs_varlen = pytest.mark.skipif(not torch.cuda.is_available() or not _varlen_runs(),
                                  reason="torch's varlen flash kernel does not run here (torch < 2.10 or sm < 80)")


@needs_varlen
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_tower_in_one_varlen_call_per_block_in_bf16(family, tiny_checkpoints):
    """The tower on torch's kernel (one call per block) against its per-chunk SDPA loop, both bf16, each against a
    float32 tower: no further from it than the loop (within bf16 rounding)."""
    from app.grouping.vision.attention import TOWER_ATTENTION
    from app.runtime.models import load_model

    patch = 16 if family == "qwen3_vl" else 14
    grid = torch.tensor([[8, 8, 12], [4, 8, 8]], device="cuda")
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * patch * patch, device="cuda")
    outs = {}
    for name, dtype in (("sdpa", torch.float32), ("sdpa", torch.bfloat16), (TOWER_ATTENTION, torch.bfloat16)):
        model = load_model(tiny_checkpoints[family], dtype=dtype, attn_implementation=name).cuda()
        with torch.no_grad():
            result = model.model.visual(pixels.to(dtype), grid_thw=grid)
        outs[(name, dtype)] = (result.pooler_output if hasattr(result, "pooler_output") else result[0]).float()
    reference = outs[("sdpa", torch.float32)]
    loop = (outs[("sdpa", torch.bfloat16)] - reference).abs().max()
    varlen = (outs[(TOWER_ATTENTION, torch.bfloat16)] - reference).abs().max()
    assert varlen <= 2 * loop + 1e-3, (float(varlen), float(loop))


@needs_varlen
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_decode_on_the_varlen_kernel_draws_the_bmm_paths_greedy_tokens_in_bf16(family, tiny_checkpoints, videos):
    """64 greedy steps on torch's kernel (prefix in key chunks, own part with seqused_k, the chunked prefill) and on
    the bmm path it replaces, eager and captured: the same tokens, log-probs within bf16 rounding; the shared video
    (3 questions) too."""
    from app.grouping.kernels import varlen_off
    from app.rollout.generate import SamplingConfig, generate_groups
    from tests.test_families import family_case

    model, prompts, _, _, _ = family_case(family, tiny_checkpoints, videos, [0, 0, 0, 1, -1], seed=6)
    model = model.cuda().to(torch.bfloat16)
    prompts = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in prompts.items()}
    greedy = SamplingConfig(temperature=0, max_new_tokens=64)
    for decode in ("eager", "graph", "compiled"):
        for families in (None, [3, 1, 1]):
            new = generate_groups(model, prompts, 2, greedy, eos_ids=[], decode=decode, families=families,
                                  prefill_chunk_size=32)
            with varlen_off():
                old = generate_groups(model, prompts, 2, greedy, eos_ids=[], decode=decode, families=families,
                                      prefill_chunk_size=32)
            assert torch.equal(new.completion_ids, old.completion_ids), (decode, families)
            torch.testing.assert_close(new.logprobs, old.logprobs, rtol=0, atol=0.05)


@needs_varlen
def test_the_chunked_prefill_on_the_varlen_kernel_equals_sdpa_in_bf16(tiny_checkpoints, videos):
    """Left-padded prompts prefilled in chunks: torch's kernel (one causal call per prompt and chunk) against SDPA
    with transformers' mask: the cache and the last logits within bf16 rounding."""
    from app.grouping.decoding.prefill import chunked_prefill
    from app.grouping.kernels import varlen_off
    from app.grouping.positions import VISION_KEYS, prompt_positions
    from tests.helpers import load, prompt_batch

    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    model = model.cuda().to(torch.bfloat16)
    prompts = {k: v.cuda() if isinstance(v, torch.Tensor) else v
               for k, v in prompt_batch("qwen2_5_vl", processor, videos, ["video", "text"]).items()}
    positions = prompt_positions(model, prompts["input_ids"], prompts["attention_mask"], prompts)
    vision = {k: prompts[k] for k in VISION_KEYS if prompts.get(k) is not None}
    runs = {}
    for name, switch in (("varlen", None), ("sdpa", varlen_off)):
        with torch.no_grad(), (switch() if switch else torch.no_grad()), chunked_prefill(model, 32):
            out = model(input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"],
                        position_ids=positions, use_cache=True, logits_to_keep=1, **vision)
        runs[name] = out
    real = prompts["attention_mask"].bool()
    for a, b in zip(runs["varlen"].past_key_values.layers, runs["sdpa"].past_key_values.layers):
        torch.testing.assert_close(a.keys.transpose(1, 2)[real].float(), b.keys.transpose(1, 2)[real].float(),
                                   rtol=0.05, atol=0.05)
    torch.testing.assert_close(runs["varlen"].logits.float(), runs["sdpa"].logits.float(), rtol=0.05, atol=0.1)


@needs_varlen
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_flash_backend_on_torchs_kernel_in_bf16(family, tiny_checkpoints, videos):
    """forward.attention_backend=flash without the flash-attn package: grouped in bf16 no further from the float32
    repeated reference than repeated in bf16 (log-probs), and its gradients flow."""
    from app.grouping import compare_to_reference, completion_logprobs

    model32, model16, prompts, ids, mask, sizes = bf16_case_on_cuda(family, tiny_checkpoints, videos)
    with torch.no_grad():
        reference = completion_logprobs(model32, prompts, ids, mask, sizes, mode="repeated").logprobs
        repeated = completion_logprobs(model16, prompts, ids, mask, sizes, mode="repeated").logprobs
    grouped = completion_logprobs(model16, prompts, ids, mask, sizes, backend="flash").logprobs
    comparison = compare_to_reference(grouped, repeated, reference, mask)
    assert comparison.passes(), comparison.describe()
    grouped.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model16.parameters() if p.requires_grad)
