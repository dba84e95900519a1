"""torch's own varlen flash kernel, wired in where a GPU without the flash-attn package needs it: the vision tower
(one call per block), the decode step's prefix, own and shared-video parts (key chunks merged by lse; one query per
sequence with ``seqused_k``), the chunked prefill (one causal call per prompt and chunk) and the ``flash`` grouping
backend. torch's kernel runs on CUDA only: here a stand-in of the same signature (``tests.helpers.varlen_reference``,
one SDPA call per sequence) drives the same code, and every path is compared with the one it replaces, in float32.
tests/test_gpu.py compares the real kernel in bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch

from app.grouping import completion_logprobs
from app.grouping.kernels import Varlen, chunk_merge, varlen_kernel, varlen_unusable
from app.grouping.vision.attention import TOWER_ATTENTION, vision_attention_for
from app.rollout.generate import SamplingConfig, generate_groups
from tests.helpers import counting_varlen, load, prompt_batch, random_completions, tokenizer_of, varlen_reference

VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def _tower_output(result):
    return result.pooler_output if hasattr(result, "pooler_output") else result[0]


@pytest.mark.parametrize("family", VL)
def test_the_tower_makes_one_call_per_block_and_equals_the_per_chunk_loop(family, tiny_checkpoints):
    from app.runtime.models import load_model

    base = load_model(tiny_checkpoints[family], attn_implementation="sdpa")
    ours = load_model(tiny_checkpoints[family], attn_implementation=TOWER_ATTENTION)
    assert ours.config.vision_config._attn_implementation == TOWER_ATTENTION
    patch = 16 if family == "qwen3_vl" else 14
    grid = torch.tensor([[4, 4, 6], [2, 4, 4]])  # two videos: 6 frames (temporal patches) in all
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * patch * patch)
    expected = _tower_output(base.model.visual(pixels, grid_thw=grid))
    with counting_varlen() as calls:
        got = _tower_output(ours.model.visual(pixels, grid_thw=grid))
    assert len(calls) == len(ours.model.visual.blocks)  # one call per block, each over all its frames / windows
    assert min(calls) >= 6
    assert torch.equal(got, expected)
    # without a kernel (CPU, no stand-in) the same function computes the per-chunk loop's numbers
    assert torch.equal(_tower_output(ours.model.visual(pixels, grid_thw=grid)), expected)


def test_auto_picks_torchs_kernel_only_where_it_runs():
    assert vision_attention_for("auto", torch.bfloat16, 80, device="cpu")[0] == "sdpa"
    assert vision_attention_for("sdpa", torch.bfloat16, 80)[0] == "sdpa"
    assert varlen_unusable("cpu", torch.bfloat16, 80) == "not on CUDA"
    if not torch.cuda.is_available():
        assert varlen_kernel("cpu", torch.bfloat16, 128) is None
    with pytest.raises(ValueError, match="unknown vision attention"):
        vision_attention_for("flash", torch.bfloat16, 80)


def test_kernel_adapter_takes_what_each_torch_has():
    """torch 2.13's varlen_attn (window_size, enable_gqa, return_aux) and an older signature (is_causal only):
    causal and GQA are passed the way each takes them; a missing lse is named."""
    seen = {}

    def old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None):
        seen.update(heads=key.shape[1], causal=is_causal)
        return query

    kernel = Varlen(old, "torch 2.11's varlen_attn")
    q, k = torch.zeros(3, 4, 8), torch.zeros(3, 2, 8)
    seqs = (torch.tensor([0, 3], dtype=torch.int32),) * 2 + (3, 3)
    kernel(q, k, k, seqs, causal=True)
    assert seen == {"heads": 4, "causal": True}  # K/V heads repeated for a kernel without enable_gqa
    assert kernel.missing(lse=True) == "torch 2.11's varlen_attn takes no return_aux"
    assert Varlen(varlen_reference).missing(lse=True, seqused_k=True) == ""


def test_key_chunks_merged_by_lse_equal_one_softmax():
    """out and lse of M queries over keys cut into chunks, an empty chunk included (-inf from a stand-in, +inf
    as flash kernels write it), equal the whole softmax's."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 5, 8), torch.randn(2, 40, 8), torch.randn(2, 40, 8)
    scores = torch.einsum("hmd,hkd->hmk", q, k) * 8**-0.5
    whole, lse = torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)
    parts, lses = [], []
    for a, b in ((0, 17), (17, 17), (17, 40)):
        s = scores[:, :, a:b]
        parts.append((torch.softmax(s, -1) @ v[:, a:b] if b > a else torch.zeros(2, 5, 8)).transpose(0, 1))
        lses.append(torch.logsumexp(s, -1) if b > a else torch.full((2, 5), float("inf")))
    out, total = chunk_merge(torch.cat(parts), torch.cat(lses, dim=1), 3)
    torch.testing.assert_close(out, whole.transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(total, lse.t(), rtol=0, atol=1e-6)


KINDS = {"qwen2_vl": ["video", "text"], "qwen2_5_vl": ["text", "video"], "qwen3_vl": ["video", "text"]}


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("family", VL)
def test_decode_through_the_kernel_draws_what_the_bmm_path_draws(family, decode, tiny_checkpoints, videos):
    """Prompts of unequal lengths (left padding skipped by where the keys begin), groups of 3 and 2, samples that
    stop early (eager: they leave the batch, the own buffers keep the kernel's layout), a chunked prefill, and
    prompt K/V longer than one key chunk: the same tokens, log-probs equal to float rounding."""
    import app.grouping.kernels as kernels

    model, processor = load(family, tiny_checkpoints)
    prompts = prompt_batch(family, processor, videos, KINDS[family])
    tok = tokenizer_of(processor)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=24, seed=3)
    free = generate_groups(model, prompts, [3, 2], sampling, tokenizer=tok, eos_ids=[], decode="eager")
    eos = sorted({int(free.completion_ids[0, 4]), int(free.completion_ids[3, 9])})
    plain = generate_groups(model, prompts, [3, 2], sampling, tokenizer=tok, eos_ids=eos, decode=decode,
                            prefill_chunk_size=16)
    chunk = kernels.KEY_CHUNK
    kernels.KEY_CHUNK = 32  # several key chunks per prompt at these sizes
    try:
        with counting_varlen() as calls:
            ours = generate_groups(model, prompts, [3, 2], sampling, tokenizer=tok, eos_ids=eos, decode=decode,
                                   prefill_chunk_size=16)
    finally:
        kernels.KEY_CHUNK = chunk
    assert calls and max(calls) > 2  # the prefix's key chunks are sequences of one call
    assert "eos" in plain.stop_reasons
    assert torch.equal(ours.completion_ids, plain.completion_ids)
    assert ours.stop_reasons == plain.stop_reasons
    torch.testing.assert_close(ours.logprobs, plain.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("family", VL)
def test_questions_sharing_a_video_through_the_kernel(family, decode, tiny_checkpoints, videos):
    """A family of 3 questions on one video, another video's prompt and a text prompt: the video's K/V (the shared
    root) read by the kernel in the question prefill (each question's tokens, all query heads) and in every
    decode step; samples that stop early leave the batch (eager)."""
    from tests.test_families import family_case

    model, prompts, _, _, _ = family_case(family, tiny_checkpoints, videos, [0, 0, 0, 1, -1], seed=6)
    families, seeds = [3, 1, 1], [11, 12, 13, 14, 15]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12, seed=3)
    free = generate_groups(model, prompts, 3, sampling, eos_ids=[], prompt_seeds=seeds, decode=decode,
                           families=families)
    eos = [int(free.completion_ids[0, 2]), int(free.completion_ids[7, 1])]
    plain = generate_groups(model, prompts, 3, sampling, eos_ids=eos, prompt_seeds=seeds, decode=decode,
                            families=families)
    with counting_varlen() as calls:
        ours = generate_groups(model, prompts, 3, sampling, eos_ids=eos, prompt_seeds=seeds, decode=decode,
                               families=families)
    assert calls and "eos" in plain.stop_reasons
    assert torch.equal(ours.completion_ids, plain.completion_ids) and ours.stop_reasons == plain.stop_reasons
    torch.testing.assert_close(ours.logprobs, plain.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", VL)
def test_flash_backend_runs_on_the_kernel_without_the_package(family, tiny_checkpoints, videos):
    """forward.attention_backend=flash with torch's kernel (here its stand-in): grouped equals repeated, the
    gradients too, with no lse merge in the backward (the two calls write disjoint rows); a family sharing a
    video too."""
    from tests.test_families import assert_same, family_case, scores_and_grads

    model, prompts, ids, mask, sizes = family_case(family, tiny_checkpoints, videos, [0, 0, 1, -1], seed=2)
    reference = scores_and_grads(model, prompts, ids, mask, sizes, mode="repeated")
    with counting_varlen() as calls:
        grouped = scores_and_grads(model, prompts, ids, mask, sizes, backend="flash")
        shared = scores_and_grads(model, prompts, ids, mask, sizes, backend="flash", families=[2, 1, 1])
    assert len(calls) >= 2 * len(model.model.language_model.layers)  # its two calls per layer, for each row
    assert_same(*grouped, *reference)
    assert_same(*shared, *reference)


def test_flash_backend_without_any_kernel_says_so(tiny_checkpoints, videos):
    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    prompts = prompt_batch("qwen2_5_vl", processor, videos, ["text"])
    ids, mask = random_completions([3, 2], 300, tokenizer_of(processor).pad_token_id)
    with pytest.raises(RuntimeError, match="needs the flash-attn package or torch's varlen flash kernel"):
        completion_logprobs(model, prompts, ids, mask, 2, mode="grouped", backend="flash")
