"""The static-shape decode step (what a CUDA graph captures) and the shared-prefix decode attention.

- static vs eager decoding: the same tokens, masks and stop reasons, log-probs equal to float rounding, on every VL
  family, with groups of unequal sizes, prompts of unequal lengths (left padding), samples that stop early, and
  through the multi-turn tree engine;
- the decode attention (prefix K/V read once for the group, own K/V apart, merged by log-sum-exp) equals a dense
  softmax over [prefix ; own tokens] per sample, for the CPU kernel and for the batched-product form used on CUDA,
  with stopped samples leaving the batch and with the static form's unwritten slots hidden;
- the choice of decode mode.
"""

from __future__ import annotations

import pytest
import torch

from app.grouping.decoding.decode import GroupedKVCache, decode_attention
from app.grouping.decoding.prefill import attention_with_lse, attention_with_lse_matmul
from app.grouping.decoding.static import decode_mode
from app.rollout.generate import SamplingConfig, generate_groups
from tests.helpers import load, prompt_batch, tokenizer_of

KINDS = {"qwen2_vl": ["video", "text"], "qwen2_5_vl": ["text", "video"], "qwen3_vl": ["video", "text"],
         "qwen2": ["text", "text"], "qwen3_5": ["text", "video"],
         "qwen3_vl_moe": ["video", "text"], "qwen3_5_moe": ["text", "video"]}  # the MoE families: grouped_mm experts


@pytest.mark.parametrize("family", list(KINDS))
def test_static_steps_draw_what_eager_steps_draw(family, tiny_checkpoints, videos):
    """Groups of 3 and 2 on prompts of different lengths; EOS ids that some samples draw, so samples stop at
    different steps (eager drops them from the batch, static keeps them stepping on pad tokens)."""
    model, processor = load(family, tiny_checkpoints)
    prompts = prompt_batch(family, processor, videos, KINDS[family])
    assert prompts["attention_mask"].sum(1).unique().numel() == 2
    tok = tokenizer_of(processor)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=20, seed=7)
    free = generate_groups(model, prompts, [3, 2], sampling, tokenizer=tok, eos_ids=[], decode="eager")
    eos = sorted({int(free.completion_ids[0, 3]), int(free.completion_ids[4, 6])})
    eager = generate_groups(model, prompts, [3, 2], sampling, tokenizer=tok, eos_ids=eos, decode="eager")
    static = generate_groups(model, prompts, [3, 2], sampling, tokenizer=tok, eos_ids=eos, decode="static")
    assert "eos" in eager.stop_reasons and "length" in eager.stop_reasons  # some stopped, some ran to the end
    assert torch.equal(static.completion_ids, eager.completion_ids)
    assert torch.equal(static.completion_mask, eager.completion_mask)
    assert static.stop_reasons == eager.stop_reasons
    torch.testing.assert_close(static.logprobs, eager.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_static_greedy_equals_hf_generate(family, tiny_checkpoints, videos):
    """Past one STATIC_BUCKET of own slots; Qwen3.5: each sample's GDN states advanced in place at every step."""
    model, processor = load(family, tiny_checkpoints)
    prompts = prompt_batch(family, processor, videos, ["video", "text"])
    tok = tokenizer_of(processor)
    greedy = SamplingConfig(temperature=0, max_new_tokens=70)  # past one STATIC_BUCKET of own slots
    ours = generate_groups(model, prompts, 1, greedy, tokenizer=tok, eos_ids=[], decode="static")
    hf = generate_groups(model, prompts, 1, greedy, tokenizer=tok, eos_ids=[], engine="hf")
    assert torch.equal(ours.completion_ids, hf.completion_ids)
    torch.testing.assert_close(ours.logprobs, hf.logprobs, rtol=0, atol=1e-5)


def test_static_steps_in_the_multi_turn_tree_engine(tiny_checkpoints, videos):
    """A tool-calling tree rollout: turn 1 a fixed call (the scripted sampler of tests/test_multiturn.py), turn 2
    sampled by the grouped engine, 3 samples per open node, from [P; turn 1; the clip it asked for]. Static decode
    steps give the same trees, tokens and sampled log-probs as eager ones."""
    from app.data.prompts import collate_prompts
    from app.data.records import EncodedPrompt
    from app.rollout.multiturn import TurnLimits, observation_encoder, tree_rollout
    from app.rollout.tools import ToolContext, ToolLimits, build_tools
    from tests.test_multiturn import Scripted, call

    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    tok = tokenizer_of(processor)
    prompt = EncodedPrompt({"problem_id": "0"}, prompt_batch("qwen2_5_vl", processor, videos, ["video"]))
    context = ToolContext({}, videos[1], 3.0, ToolLimits(max_frames=4, min_pixels=3136, max_pixels=6272))

    def rollout_with(decode):
        scripted = Scripted(tok, [[call("get_frames", start=0.0, end=2.0), "<answer>1</answer>"]])

        def generate(asked, group_size, seeds, max_new_tokens):
            if scripted.turns:
                return scripted(asked, group_size, seeds, max_new_tokens)
            batch = collate_prompts([p.inputs for p in asked], tok.pad_token_id)
            sampling = SamplingConfig(temperature=1.0, max_new_tokens=min(max_new_tokens, 12))
            return generate_groups(model, batch, group_size, sampling, tokenizer=tok, eos_ids=[], prompt_seeds=seeds,
                                   decode=decode)

        return tree_rollout(generate, [prompt], [context], tools=build_tools(["get_frames"]),
                            encode=observation_encoder(processor), limits=TurnLimits(max_turns=2, branching=(2, 3)),
                            tokenizer=tok, seeds=[11])

    eager, static = rollout_with("eager"), rollout_with("static")
    tree = eager.trees[0]
    assert len(tree.nodes) == 5 and len(tree.nodes[0].vision["video_grid_thw"]) == 1  # a clip inside the path
    assert len({tuple(tree.nodes[n].input_ids.tolist()) for n in tree.leaves}) > 1  # really sampled
    for na, nb in zip(tree.nodes, static.trees[0].nodes):
        assert na.parent == nb.parent and torch.equal(na.input_ids, nb.input_ids)
    for la, lb in zip(eager.sampled[0], static.sampled[0]):
        torch.testing.assert_close(la, lb, rtol=0, atol=1e-5)
    assert eager.leaf_reasons == static.leaf_reasons


def test_decode_modes():
    assert decode_mode("auto", "cpu", False) == "eager"
    assert decode_mode("auto", "cuda", False) == "graph"
    assert decode_mode("auto", "cuda", True) == "eager"  # ZeRO-3 hooks gather in every forward
    assert decode_mode("static", "cpu", False) == "static"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        decode_mode("graph", "cpu", False)
    with pytest.raises(ValueError, match="zero3_gather"):
        decode_mode("graph", "cuda", True)
    with pytest.raises(ValueError, match="unknown decode mode"):
        decode_mode("fast", "cpu", False)


# ---- the attention itself ------------------------------------------------------------------------------------
class _Prefill:
    """A stand-in for the prefill's DynamicCache: one layer's prefix K/V."""

    def __init__(self, keys, values):
        self.layers = [type("Layer", (), {"keys": keys, "values": values})()]


def _dense(q, prefix_k, prefix_v, prompt_mask, own_k, own_v, group_of_sample, scale):
    """Per sample: softmax over [its prompt's real prefix keys ; its own keys] in float64."""
    out = []
    rep = q.shape[1] // prefix_k.shape[1]
    for n in range(q.shape[0]):
        g = int(group_of_sample[n])
        keep = prompt_mask[g].bool()
        keys = torch.cat([prefix_k[g][:, keep], own_k[n]], dim=1).repeat_interleave(rep, 0).double()
        values = torch.cat([prefix_v[g][:, keep], own_v[n]], dim=1).repeat_interleave(rep, 0).double()
        weights = torch.softmax(q[n].double() @ keys.transpose(-1, -2) * scale, dim=-1)
        out.append((weights @ values).transpose(0, 1))  # [1, H, D]
    return torch.stack(out)  # [N, 1, H, D]


def _case(seed, sizes=(3, 1, 2), prompt_lens=(7, 11, 4), heads=4, kv_heads=2, dim=16, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    width = max(prompt_lens)
    prefix_k, prefix_v = (torch.randn(len(sizes), kv_heads, width, dim, generator=generator, dtype=dtype)
                          for _ in range(2))
    mask = torch.zeros(len(sizes), width, dtype=torch.long)
    for b, length in enumerate(prompt_lens):
        mask[b, width - length:] = 1  # left padding
    return prefix_k, prefix_v, mask, generator


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_decode_attention_equals_a_dense_softmax_over_prefix_and_own_tokens(static):
    check_decode_attention(static, "cpu")


def check_decode_attention(static: bool, device: str) -> None:
    """Groups of unequal sizes on prompts of unequal lengths, five steps; after step 2 the eager cache drops two
    stopped samples (one of them the only sample of its group, whose prefix then leaves the call). On ``device``
    (CPU: the fused kernel; CUDA: the batched products), against a float64 softmax per sample."""
    sizes, heads, kv_heads, dim, scale = (3, 1, 2), 4, 2, 16, 0.25
    prefix_k, prefix_v, mask, generator = _case(0, sizes, heads=heads, kv_heads=kv_heads, dim=dim)
    cache = GroupedKVCache(_Prefill(prefix_k.to(device), prefix_v.to(device)), mask.to(device), sizes, 8,
                           static=static)
    rows = torch.arange(sum(sizes))
    group = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    own_k = torch.zeros(sum(sizes), kv_heads, 0, dim)
    own_v = torch.zeros_like(own_k)
    layer = type("Layer", (), {"layer_idx": 0})()
    for step in range(5):
        if step == 2 and not static:
            keep = torch.tensor([0, 2, 5])  # samples 1 (group 0) and 3 (group 1, its only one) stopped
            cache.keep(keep.to(device))
            rows, own_k, own_v = rows[keep], own_k[keep], own_v[keep]
        n = len(rows)
        q = torch.randn(n, heads, 1, dim, generator=generator)
        k_new, v_new = (torch.randn(n, kv_heads, 1, dim, generator=generator) for _ in range(2))
        own_k, own_v = torch.cat([own_k, k_new], 2), torch.cat([own_v, v_new], 2)
        if static:
            cache.begin_step()
        keys, values = cache.update(k_new.to(device), v_new.to(device), 0)
        got = decode_attention(cache, layer.layer_idx, q.to(device), keys, values, scale)
        if static:
            cache.end_step()
        want = _dense(q, prefix_k, prefix_v, mask, own_k, own_v, group[rows], scale)
        torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batched_product_form_equals_the_fused_kernel(dtype):
    """What CUDA runs (``attention_with_lse_matmul``: float32 scores and softmax, probabilities in V's dtype) against
    the fused CPU kernel, with a padding bias; both against a float64 reference."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(3, 2, 6, 32, generator=generator).to(dtype)
    k, v = (torch.randn(3, 2, 50, 32, generator=generator).to(dtype) for _ in range(2))
    bias = torch.zeros(3, 1, 1, 50)
    bias[0, ..., :9] = float("-inf")
    fused, fused_lse = attention_with_lse(q, k, v, bias, 0.2)
    product, product_lse = attention_with_lse_matmul(q, k, v, bias, 0.2)
    scores = q.double() @ k.double().transpose(-1, -2) * 0.2 + bias.double()
    reference = torch.softmax(scores, -1) @ v.double()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for out in (fused, product):
        torch.testing.assert_close(out.double(), reference, rtol=0, atol=tolerance)
    for lse in (fused_lse, product_lse):
        torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), rtol=0, atol=1e-4)


class _HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the operators that make a CUDA host wait for the device (a value read back, or an output whose size
    depends on the data): inside a CUDA graph capture each one is an error."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "masked_scatter", "unique", "_unique", "bincount",
               "equal", "is_nonzero", "repeat_interleave")

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        boolean_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else []) or [])
        if name.startswith(self.SYNCING) or boolean_index:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen2", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"])
def test_a_static_step_never_waits_for_the_device(family, tiny_checkpoints, videos):
    """What CUDA graph capture needs from the step it records: no operator that reads a value back to the host or
    sizes its output by the data (checked on CPU, operator by operator), with prompts of unequal lengths. A mixture
    of experts recording its routing (rollout.routing_replay=r3) too: the step and the copy of its record."""
    from app.grouping import GroupedDecoder

    model, processor = load(family, tiny_checkpoints)
    prompts = prompt_batch(family, processor, videos, KINDS[family])
    for record in (False, True) if family.endswith("_moe") else (False,):
        with torch.no_grad():
            decoder = GroupedDecoder(model, prompts, [3, 2], 8, decode="static", record_routing=record)
            tokens = torch.full((5,), 7, dtype=torch.long)
            decoder.step(tokens)
            spy = _HostSyncs()
            with spy:
                decoder._runner()()
                if record:
                    decoder.step(tokens)
            decoder.close()
        assert spy.calls == [], f"the static step syncs with the host (recording: {record}): {spy.calls}"
        assert not record or bool((decoder.routing.completion[:, :2] >= 0).all())
