"""Test helpers: prompt batches through the real processor and qwen-vl-utils, random completions, comparisons."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from PIL import Image

from app.data.prompts import encode_prompts
from app.data.video import video_element
from app.runtime.models import VL_FAMILIES, load_model, load_processor

QUESTIONS = [
    "Which colour appears first in the video? Answer with a letter.",
    "How many shapes move?",
    "Describe it",
    "the red circle moves left or right",
]


def patch_size(family: str) -> int:
    return 16 if family in ("qwen3_vl", "qwen3_vl_moe") else 14


# Qwen3.5's GDN layers turn std-0.2 weights into a recurrence that amplifies float32 rounding past the 1e-4 the
# layouts are held to (a gradient of a 16-element norm weight 1.03e-4 apart with one kernel on both sides); 0.1 keeps
# its attention layer's positions and its states far from uniform.
SHARPEN = {"qwen3_5": 0.1, "qwen3_5_moe": 0.1, "qwen4_exp": 0.1}


def load(family: str, checkpoints, sharpen: float | None | str = "family"):
    """Model + processor; ``sharpen`` re-draws weights with a large std so attention and positions matter
    ("family": 0.2, or a hybrid family's own std, ``SHARPEN``)."""
    model = load_model(checkpoints[family])
    processor = load_processor(checkpoints[family])
    if sharpen == "family":
        sharpen = SHARPEN.get(family, 0.2)
    if sharpen:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in model.parameters():
                if param.ndim >= 2:
                    param.normal_(0.0, sharpen, generator=generator)
    return model, processor


def tokenizer_of(processor):
    return getattr(processor, "tokenizer", processor)


def prompt_batch(family: str, processor, videos, kinds: list[str], fps: float = 2.0) -> dict:
    """Prompts of the given kinds ('video', 'image', 'text'), encoded with the chat template and the processor."""
    return encode_prompts(processor, conversations_of(family, videos, kinds, fps))


def conversations_of(family: str, videos, kinds: list[str], fps: float = 2.0) -> list[list[dict]]:
    """One user turn per kind: 'video', 'image', 'text', or several media in one prompt joined by '+'
    ('video+video', 'image+video')."""
    factor = 2 * patch_size(family)
    conversations = []
    for i, kind in enumerate(kinds):
        content = [{"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}]
        for j, part in enumerate(reversed(kind.split("+"))):
            if part == "video" and family in VL_FAMILIES:
                content.insert(0, video_element(videos[(i + j) % len(videos)], fps=fps,
                                                min_pixels=factor * factor * 2, max_pixels=factor * factor * 6))
            elif part == "image" and family in VL_FAMILIES:
                pixels = np.random.default_rng(i + 10 * j).integers(0, 255, (factor * 2, factor * 3, 3),
                                                                     dtype=np.uint8)
                content.insert(0, {"type": "image", "image": Image.fromarray(pixels),
                                   "min_pixels": factor * factor * 2, "max_pixels": factor * factor * 6})
        conversations.append([{"role": "user", "content": content}])
    return conversations


def random_completions(lengths: list[int], vocab: int, pad_id: int, width: int | None = None, seed: int = 0):
    """Right-padded completion ids and masks with the given real lengths (the pad token fills the rest)."""
    generator = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    ids = torch.randint(10, vocab, (len(lengths), width), generator=generator)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids * mask + pad_id * (1 - mask), mask


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (elementwise rtol would be meaningless for near-zero entries)."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: the gradient measure of the hybrid families (a decay parameter's gradient, one number per
    head summed over every token with cancellation, carries float32's rounding of each token's term: transformers
    computes g in float32 even in a float64 model)."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_and_grad(model, prompts, ids, mask, group_sizes, mode, backend=None):
    from app.grouping import completion_logprobs

    model.zero_grad(set_to_none=True)
    scores = completion_logprobs(model, prompts, ids, mask, group_sizes, mode=mode, backend=backend,
                                 return_logits=True)
    # A loss that weights tokens differently, so every position's gradient path matters.
    weights = torch.linspace(0.5, 1.5, ids.shape[1])[None, :]
    ((scores.logprobs * weights).sum() + 1e-3 * (scores.logits ** 2).sum()).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return scores.logprobs.detach(), scores.logits.detach(), grads


def text_layers(model):
    inner = model.model
    return getattr(inner, "language_model", inner).layers


def cut_back_copy(run_dir, to, step: int):
    """A copy of a finished run as a crash right after step ``step``'s checkpoint leaves it: the later checkpoints and
    the exports gone, ``latest`` naming step ``step``. For tests whose property is the resume (a bitwise end, a
    refusal), not the dying, which tests/test_crash.py and the float32 crash tests assert."""
    import shutil
    from pathlib import Path

    from app.runtime.checkpoint import catalogue, checkpoint_tag

    to, tag = Path(to), checkpoint_tag(step)
    shutil.copytree(run_dir, to, symlinks=True)
    for export in to.glob("final*"):
        shutil.rmtree(export)
    kept = catalogue(to)  # newest first: the later ones go
    assert tag in [p.name for p in kept], f"{run_dir} kept no {tag}: {[p.name for p in kept]}"
    for later in kept[:[p.name for p in kept].index(tag)]:
        shutil.rmtree(later)
    (to / "checkpoints" / "latest").write_text(tag)
    return to


def killed_at_random(command: list[str], out, env: dict, took: float, rng, share: tuple[float, float]) -> float:
    """``command`` (a launcher writing to ``out``) started in its own session and killed (SIGKILL to its process
    group) after ``rng.uniform(*share) * took`` seconds, ``took`` being an uninterrupted run's time; the delay used.
    A run that ends well before the kill is started again once, into an emptied ``out``, with the delay drawn from
    that run's own time: the uninterrupted run's may hold one-off work the next run skips (a JIT build of DeepSpeed's
    communication op where the environment lacked it)."""
    import os
    import shutil
    import signal
    import subprocess
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for _ in range(2):
        delay, began = rng.uniform(*share) * took, time.perf_counter()
        process = subprocess.Popen(command, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   env={**os.environ, **env}, start_new_session=True)
        try:
            process.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return delay
        if process.returncode != 0:
            raise AssertionError(f"the run failed before the kill at {delay:.1f} s (exit {process.returncode})")
        took = time.perf_counter() - began
        shutil.rmtree(out, ignore_errors=True)
    raise AssertionError(f"the run ended before the kill at {delay:.1f} s twice (exit {process.returncode})")


@contextlib.contextmanager
def world_of_one(monkeypatch):
    """A DeepSpeed world of one in this process (for in-process recipe tests); torn down afterwards, and the
    variables go away with the test (subprocesses must not inherit them)."""
    import torch.distributed as dist

    from app.runtime.distributed import _free_port

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(_free_port()))):
        monkeypatch.setenv(key, value)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        from transformers.integrations import deepspeed as hf_deepspeed

        # A ZeRO-3 recipe's HfDeepSpeedConfig (a weak reference, alive while the recipe is) would make every later
        # from_pretrained in this process partition its model.
        hf_deepspeed.unset_hf_deepspeed_config()
        # Loading a model under ZeRO-3 replaces torch.nn.functional.linear with DeepSpeed's for the rest of the
        # process (its "memory-efficient linear"); later tests must see torch's (it changes what a checkpointed
        # layer recomputes).
        torch.nn.functional.linear = torch._C._nn.linear
        import deepspeed.comm.comm as ds_comm
        import deepspeed.utils.groups as ds_groups

        # DeepSpeed keeps its backend and its groups (of the dead world) in module globals: forget them.
        ds_comm.cdb = None
        for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "mpu", "mesh_device",
                     "_TENSOR_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP"):
            setattr(ds_groups, name, None)
        for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                     "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
            getattr(ds_groups, name).clear()


def bias_head_towards_placeholder(checkpoint, token_key: str = "image_token_id", strength: float = 20.0) -> int:
    """Rewrite a Qwen2.5-VL checkpoint so its head prefers a vision placeholder at every text position: the last
    hidden dimension carries a constant 1 from the embeddings (no layer writes to it), and the placeholder's head row
    reads only that dimension, scaled. Returns the placeholder id (what an engine without suppression would sample
    nearly always)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    checkpoint = Path(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    token = int(config[token_key])
    weights = load_file(str(checkpoint / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith("embed_tokens.weight"):
            tensor[:, -1] = 1.0
        elif name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")) and "visual" not in name:
            tensor[-1, :] = 0.0
        elif name.endswith("merger.mlp.2.weight"):
            tensor[-1, :] = 0.0
        elif name.endswith("merger.mlp.2.bias"):
            tensor[-1] = 1.0
        elif name.endswith("language_model.norm.weight"):
            tensor[-1] = 1.0
    head = weights["lm_head.weight"]
    head[token] = 0.0
    head[token, -1] = strength
    save_file(weights, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    return token


def varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """A stand-in for ``torch.nn.attention.varlen.varlen_attn`` (torch 2.13's signature) on any device: one SDPA
    call per sequence. q (Tq, H, D), k/v (Tk, Hkv, D); causal when ``window_size`` is (-1, 0), aligned
    bottom-right; ``seqused_k``: the first keys of each sequence only; the lse as (H, Tq) float32 (-inf where a
    query sees no key, whose output is 0). What the CPU tests drive the grouping core's varlen wiring with."""
    assert block_table is None
    heads, dim = query.shape[1], query.shape[2]
    if key.shape[1] != heads:
        assert enable_gqa, "GQA inputs need enable_gqa=True, as torch's kernel does"
        key, value = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (key, value))
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    outs, lses = [], []
    for i in range(len(bounds_q) - 1):
        q = query[bounds_q[i]:bounds_q[i + 1]].transpose(0, 1)[None]
        end_k = bounds_k[i + 1] if seqused_k is None else bounds_k[i] + int(seqused_k[i])
        k = key[bounds_k[i]:end_k].transpose(0, 1)[None]
        v = value[bounds_k[i]:end_k].transpose(0, 1)[None]
        lq, lk = q.shape[2], k.shape[2]
        mask = None
        if tuple(window_size) == (-1, 0):
            seen = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
            mask = torch.zeros(lq, lk, dtype=q.dtype).masked_fill(~seen, float("-inf"))
        if lk == 0 or lq == 0:
            outs.append(q.new_zeros(lq, heads, dim))
            lses.append(torch.full((heads, lq), float("-inf")))
            continue
        if return_aux is None:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            lse = torch.zeros(1, heads, lq)
        else:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.contiguous(), k.contiguous(), v.contiguous(), 0.0, False, attn_mask=mask, scale=scale)[:2]
        if mask is not None:  # a query with no key at all: 0 out, lse -inf
            none = ~torch.isfinite(mask).any(-1)
            out = out.masked_fill(none[None, None, :, None], 0.0)
            lse = lse.masked_fill(none[None, None, :], float("-inf"))
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0].float())
    out = torch.cat(outs)
    if return_aux is not None and return_aux.lse:
        return out, torch.cat(lses, dim=1)
    return out


@contextlib.contextmanager
def counting_varlen():
    """``varlen_reference`` in force as the varlen kernel (``app.grouping.kernels.varlen_stand_in``); yields the
    list of its calls (one entry per call: the number of sequences)."""
    import functools

    from app.grouping.kernels import varlen_stand_in

    calls = []

    @functools.wraps(varlen_reference)  # the signature the kernel is inspected for
    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs):
        calls.append(len(cu_seq_q) - 1)
        return varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)

    with varlen_stand_in(kernel):
        yield calls


# ---- Gated DeltaNet (Qwen3.5's linear-attention layers) ------------------------------------------------------------
def delta_rule_reference(q, k, v, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule token by token, in the inputs' precision (float64 stays float64; anything else float32):
    per head S <- S * exp(g_t); S <- S + k_t ((v_t - S^T k_t) beta_t)^T; o_t = S^T q_t / sqrt(K), q and k
    L2-normalised when asked. transformers' ``torch_chunk_gated_delta_rule`` signature and shapes (q, k [B, L, H, K],
    v [B, L, H, V], g and beta [B, L, H], state [B, H, K, V]). What the exactness tests run BOTH layouts on: the
    chunked float32 form rounds differently wherever its chunks fall (transformers' own repeated forward, its prompts
    shifted by a few pad tokens, moves log-probs by up to 7e-5 and some gradients by 1e-2 relative on the tiny
    model), so only one kernel of the definition's precision can show the layouts equal to 1e-5 / 1e-4."""
    dtype = q.dtype
    work = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.transpose(1, 2).to(work) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    state = (q.new_zeros(*k.shape[:2], k.shape[-1], v.shape[-1]) if initial_state is None
             else initial_state.to(work))
    outs = []
    for t in range(k.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, 2).transpose(1, 2).to(dtype), (state if output_final_state else None)


@contextlib.contextmanager
def exact_delta_rule():
    """``delta_rule_reference`` as THE chunked delta rule for the block: transformers' (what the repeated layout and
    ``generate`` run) and the grouped forward's torch kernel alike."""
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe  # Qwen3.5-MoE's GDN calls its own copy

    import app.grouping.recurrent.kernels as kernels

    previous = (modeling_qwen3_5.torch_chunk_gated_delta_rule, modeling_qwen3_5_moe.torch_chunk_gated_delta_rule,
                kernels.torch_chunk_rule)
    modeling_qwen3_5.torch_chunk_gated_delta_rule = delta_rule_reference
    modeling_qwen3_5_moe.torch_chunk_gated_delta_rule = delta_rule_reference
    kernels.torch_chunk_rule = lambda: delta_rule_reference
    try:
        yield
    finally:
        (modeling_qwen3_5.torch_chunk_gated_delta_rule, modeling_qwen3_5_moe.torch_chunk_gated_delta_rule,
         kernels.torch_chunk_rule) = previous


def fla_conv_stand_in(x, weight=None, bias=None, activation=None, initial_state=None, cu_seqlens=None, **kwargs):
    """flash-linear-attention's varlen ``causal_conv1d`` signature on any device: x [1, T, C], weight [C, W],
    initial_state [N, C, W] (its last W - 1 columns the inputs before each sequence), one F.conv1d per sequence."""
    bounds = cu_seqlens.tolist()
    width = weight.shape[1]
    outs = []
    for n in range(len(bounds) - 1):
        seq = x[0, bounds[n]:bounds[n + 1]].transpose(0, 1)  # [C, L]
        before = initial_state[n, :, 1:] if initial_state is not None else seq.new_zeros(seq.shape[0], width - 1)
        y = torch.nn.functional.conv1d(torch.cat([before, seq], dim=1)[None], weight[:, None], bias,
                                       groups=weight.shape[0])[0]
        outs.append(torch.nn.functional.silu(y) if activation in ("silu", "swish") else y)
    return torch.cat(outs, dim=1).transpose(0, 1)[None], None


def fla_rule_stand_in(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """flash-linear-attention's varlen ``chunk_gated_delta_rule`` signature on any device: [1, T, ...] inputs,
    ``initial_state`` [N, HV, K, V] per sequence of ``cu_seqlens``; transformers' torch kernel per sequence."""
    from app.grouping.recurrent.kernels import torch_chunk_rule

    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for n in range(len(bounds) - 1):
        part = slice(bounds[n], bounds[n + 1])
        out, final = torch_chunk_rule()(q[:, part], k[:, part], v[:, part], g=g[:, part], beta=beta[:, part],
                                        initial_state=None if initial_state is None else initial_state[n:n + 1],
                                        output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outs.append(out)
        finals.append(final)
    return torch.cat(outs, dim=1), torch.cat(finals)
