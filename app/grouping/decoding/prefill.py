"""The prefill in chunks: a long prompt's decoder runs ``chunk_size`` positions at a time against the cache of the
earlier ones, so activations are bounded by the chunk, not the prompt (``chunked_prefill``). On CPU each chunk's
attention is ``prefill_chunk_attention``: its own causal block and the cached past, merged exactly by log-sum-exp
(``attention_with_lse``), with no [chunk, width] mask.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + mask) v and its log-sum-exp, for q [B, H, M, D], k/v [B, H, L, D] (same H), mask
    additive, broadcastable to [B, 1, M, L], or None. Output in q's dtype with float32 accumulation, lse float32
    [B, H, M]. On CPU the fused flash kernel (one pass, K/V read in place); elsewhere ``attention_with_lse_matmul``."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                             scale=scale)
        return out, lse.float()
    return attention_with_lse_matmul(q, k, v, mask, scale)


def attention_with_lse_matmul(q, k, v, mask, scale):
    """``attention_with_lse`` as two batched products, for decoding (few queries against many keys: a product
    spreads over the keys, where a fused kernel without split-KV runs one block per head). The scores come out of
    the first product in float32 (``bmm(..., out_dtype=float32)`` for bf16/fp16 inputs: K is read once, in place,
    never copied to float32), the softmax runs in float32, and its probabilities meet V in V's dtype with float32
    accumulation, as flash kernels do. Contiguous k/v are read in place."""
    batch, heads, rows, dim = q.shape
    length = k.shape[2]
    flat = batch * heads
    scores = _product_f32(q.reshape(flat, rows, dim), k.reshape(flat, length, dim).transpose(1, 2))
    scores = scores.view(batch, heads, rows, length).mul_(scale)
    if mask is not None:
        scores.add_(mask)
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(lse[..., None]).exp_()
    probs = probs if v.dtype == torch.float32 else probs.to(v.dtype)
    out = _product_f32(probs.view(flat, rows, length), v.reshape(flat, length, dim))
    return out.view(batch, heads, rows, dim).to(q.dtype), lse


def _product_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (batched) with a float32 result: low-precision inputs accumulate and come out in float32 (``bmm``'s
    ``out_dtype`` where the device has it, else through float32 copies)."""
    if a.dtype == torch.float32:
        return torch.bmm(a, b.float())
    if _has_bmm_out_dtype(a.device.type, a.dtype):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


@functools.cache
def _has_bmm_out_dtype(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.bmm(..., out_dtype=torch.float32)`` runs for ``dtype`` inputs on this device (asked once)."""
    try:
        probe = torch.ones(1, 1, 1, dtype=dtype, device=device_type)
        return torch.bmm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _language_model(model):
    """The decoder stack a causal LM (or a VL model's ``model``) runs its embeddings through."""
    from app.grouping.modules import unwrap

    inner = unwrap(model)
    body = getattr(inner, "model", inner)
    return getattr(body, "language_model", None) or body


def _chunk_count(width: int, chunk: int, synced: bool, device) -> int:
    """Chunks of ``chunk`` positions a prefill of ``width`` takes; with ``synced`` the most over the ranks."""
    count = -(-width // chunk)
    if synced:
        import torch.distributed as dist

        most = torch.tensor([count], dtype=torch.long, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        count = int(most.item())
    return count


@dataclass(frozen=True)
class PrefillChunk:
    """The attention plan of one chunk of a chunked prefill (CPU): the prompt's padding as an additive key bias
    [B, 1, 1, width] (0 for a real position, -inf for a pad), None without padding."""

    key_bias: torch.Tensor | None

    def attend(self, module, query, key, value, *, scale=None, dropout=0.0) -> torch.Tensor:
        """The attention-plan protocol (``attention.GroupedAttentionPlan.attend``): -> [B, c, H, D]."""
        return prefill_chunk_attention(self, query, key, value, scale).transpose(1, 2).contiguous()

    def linear_attention(self, module, hidden_states, *, cache_params, original):
        """A Gated DeltaNet layer on the chunk: transformers' own cached forward, its state carried from the chunk
        before through the cache, the chunk's padding (from the key bias) zeroed."""
        count = hidden_states.shape[1]
        mask = None if self.key_bias is None else (self.key_bias[:, 0, 0, -count:] == 0)
        return original(hidden_states, cache_params=cache_params, attention_mask=mask)


def prefill_chunk_attention(plan: PrefillChunk, query, key, value, scale: float | None) -> torch.Tensor:
    """q [B, H, c, D] of a chunk; k/v [B, Hkv, past + c, D] (the cache so far, the chunk's own last) -> [B, H, c, D].

    Exact softmax over [the positions before the chunk ; the chunk's own up to the query], as two fused calls
    merged by log-sum-exp (``decode_attention``'s way): the queries against the keys before the chunk (all
    visible; a [B, 1, 1, past] padding bias at most, each KV head's query heads side by side, the cache read in
    place), and against the chunk's own keys under a causal [c, c] mask. No [c, past] mask is ever made (SDPA's
    would be a boolean [B, 1, c, past + c] plus its float copy: 80 MB at c = 1,024, past = 16k). A pad query sees
    no key at all: its output is 0 (finite, so the pads' K/V never turn a real query's output into NaN); which
    query sees no key in either part is read off the padding, not off the kernel's lse (CPU's flash kernel gives
    lse 0 for a row with every key masked)."""
    batch, heads, count, dim = query.shape
    kv_heads = key.shape[1]
    rep, past = heads // kv_heads, key.shape[2] - count
    scale = dim**-0.5 if scale is None else scale
    bias = plan.key_bias
    out_b, lse_b = own_causal_attention(query, key[:, :, past:], value[:, :, past:],
                                        None if bias is None else bias[..., past : past + count], scale)
    if past == 0:
        return torch.where(torch.isfinite(lse_b)[..., None], out_b, torch.zeros_like(out_b))
    grouped = query.reshape(batch, kv_heads, rep * count, dim)
    past_bias = None if bias is None else bias[..., :past].to(query.dtype)
    out_a, lse_a = attention_with_lse(grouped, key[:, :, :past], value[:, :, :past], past_bias, scale)
    out_a, lse_a = out_a.reshape(batch, heads, count, dim), lse_a.reshape(batch, heads, count)
    if bias is not None:  # [B]: some real key before the chunk
        seen_past = (bias[:, 0, 0, :past] == 0).any(-1)
        lse_a = torch.where(seen_past[:, None, None], lse_a, torch.tensor(float("-inf"), device=query.device))
    return merge_parts(out_a, lse_a, out_b, lse_b, query.dtype)


def own_causal_attention(query, key, value, bias: torch.Tensor | None, scale: float):
    """q [B, H, c, D] against its own keys k/v [B, Hkv, c, D] causally, under an additive key ``bias`` [B, 1, 1, c]
    (left padding) or None -> (out [B, H, c, D], lse [B, H, c]); a query that sees no key (a pad before the first
    real position) gets lse -inf (the CPU kernel returns 0 with lse 0 for it: read off the padding instead)."""
    batch, heads, count, _ = query.shape
    rep = heads // key.shape[1]
    if bias is None and query.device.type == "cpu":  # nothing padded: the fused kernel's own causal mask, no [c, c]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1), 0.0, True, scale=scale)
        return out, lse.float()
    causal = torch.full((count, count), float("-inf"), device=query.device, dtype=query.dtype).triu(1)
    own_mask = causal[None, None] if bias is None else causal + bias.to(query.dtype)
    own_k, own_v = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    out, lse = attention_with_lse(query, own_k, own_v, own_mask.expand(batch, 1, count, count), scale)
    if bias is not None:  # [B, c]: some real key at or before the query
        seen = (bias[:, 0, 0, :] == 0).cumsum(-1) > 0
        lse = torch.where(seen[:, None, :], lse, torch.tensor(float("-inf"), device=query.device))
    return out, lse


def merge_parts(out_a, lse_a, out_b, lse_b, dtype) -> torch.Tensor:
    """Two attention parts over disjoint keys merged exactly by their log-sum-exps (either may be -inf: no key);
    a query that saw no key at all gets 0."""
    lse = torch.logaddexp(lse_a, lse_b)
    seen = torch.isfinite(lse)
    lse = torch.where(seen, lse, torch.zeros_like(lse))
    weight_a = torch.where(torch.isfinite(lse_a), torch.exp(lse_a - lse), torch.zeros_like(lse))
    weight_b = torch.where(torch.isfinite(lse_b), torch.exp(lse_b - lse), torch.zeros_like(lse))
    out_a = torch.where(torch.isfinite(lse_a)[..., None], out_a.float(), torch.zeros((), device=out_a.device))
    out_b = torch.where(torch.isfinite(lse_b)[..., None], out_b.float(), torch.zeros((), device=out_b.device))
    return (weight_a[..., None] * out_a + weight_b[..., None] * out_b).to(dtype)


@dataclass(frozen=True)
class PrefillVarlen:
    """The attention plan of one chunk of a chunked prefill through torch's varlen flash kernel (CUDA, float16 /
    bfloat16): per prompt one call, its chunk's queries against the keys cached so far and its own causally
    (bottom-right), from where the prompt's keys begin (``start``: its left padding). No lse, no mask, no
    [chunk, width] scores: the kernel does both parts in one pass. A pad query sees no key: its output is 0."""

    kernel: object  # app.grouping.kernels.Varlen
    start: torch.Tensor  # [B] left padding
    end: int | None = None  # the chunk's end in the prompt (None: an idle chunk)

    def linear_attention(self, module, hidden_states, *, cache_params, original):
        """A Gated DeltaNet layer on the chunk: transformers' own cached forward, the chunk's padding zeroed."""
        count = hidden_states.shape[1]
        if self.end is None:
            return original(hidden_states, cache_params=cache_params, attention_mask=None)
        positions = torch.arange(self.end - count, self.end, device=hidden_states.device)
        return original(hidden_states, cache_params=cache_params,
                        attention_mask=positions[None, :] >= self.start[:, None])

    def attend(self, module, query, key, value, *, scale=None, dropout=0.0) -> torch.Tensor:
        """q [B, H, c, D], k/v [B, Hkv, past + c, D] -> [B, c, H, D]."""
        batch, _, count, _ = query.shape
        length = key.shape[2]
        device = query.device
        outs = []
        for b in range(batch):
            cu_q = torch.tensor([0, count], device=device, dtype=torch.int32)
            cu_k = torch.stack([self.start[b], torch.full_like(self.start[b], length)]).to(torch.int32)
            outs.append(self.kernel(query[b].transpose(0, 1), key[b].transpose(0, 1), value[b].transpose(0, 1),
                                    (cu_q, cu_k, count, length), causal=True, scale=scale))
        return torch.stack(outs)


def _chunk_plans(model, inputs_embeds: torch.Tensor, attention_mask):
    """end -> the attention plan of the chunk ending there (None: an idle chunk): ``PrefillVarlen`` where torch's
    varlen kernel runs (CUDA, float16/bfloat16), else ``PrefillChunk`` on CPU (the padding as a key bias up to
    ``end``); None where neither applies (SDPA with transformers' mask)."""
    from app.grouping.kernels import varlen_kernel
    from app.grouping.modules import text_config

    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    config = text_config(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kernel = varlen_kernel(inputs_embeds.device, inputs_embeds.dtype, head_dim, use="the chunked prefill")
    if kernel is not None:
        batch = inputs_embeds.shape[0]
        start = ((~attention_mask.bool()).sum(1) if padded else
                 torch.zeros(batch, dtype=torch.long, device=inputs_embeds.device))
        return lambda end: PrefillVarlen(kernel, start if end is not None else start[:1] * 0, end)
    if inputs_embeds.device.type != "cpu":
        return None
    bias = None
    if padded:
        bias = torch.zeros(attention_mask.shape, dtype=torch.float32, device=attention_mask.device)
        bias = bias.masked_fill(~attention_mask.bool(), float("-inf"))[:, None, None, :]
    return lambda end: PrefillChunk(None if bias is None or end is None else bias[..., :end])


def _prefill_cache(config, width: int):
    """A transformers DynamicCache whose full-attention layers hold their K/V in one buffer of the prompt's width,
    written chunk by chunk: ``DynamicLayer`` concatenates at every call, so a chunked prefill would copy the cache
    once per chunk (measured at 16k positions: resident memory grew by 3.7x the cache over 16 chunks)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                shape = (*key_states.shape[:2], width, key_states.shape[-1])
                self._buffers = (key_states.new_empty(shape), value_states.new_empty(shape))
                self._end = 0
            start, self._end = self._end, self._end + key_states.shape[-2]
            self._buffers[0][..., start : self._end, :] = key_states
            self._buffers[1][..., start : self._end, :] = value_states
            self.keys, self.values = self._buffers[0][..., : self._end, :], self._buffers[1][..., : self._end, :]
            return self.keys, self.values

    cache = DynamicCache(config=config)
    layers = getattr(cache, "layers", None)
    if layers and all(type(layer) is DynamicLayer for layer in layers):
        cache.layers = [PreallocatedLayer() for _ in layers]
    return cache


@contextlib.contextmanager
def chunked_prefill(model, chunk_size: int, synced: bool = False):
    """Within the block, a forward of ``model`` runs its decoder ``chunk_size`` positions at a time against the
    K/V cache of the positions before (chunked prefill): the activations of a layer hold [B, chunk, .] rows, and
    attention [B, heads, chunk, width] scores at most, whatever the prompt's length. The K/V cache holds the whole
    prompt, as it must. The model's own forward runs unchanged around the decoder (token embeddings, the vision
    tower, placing the media embeddings, M-RoPE ids for the whole prompt); only its call of the decoder is cut,
    slicing what that call receives per position (embeddings, position ids, the attention mask up to the chunk's
    end, Qwen3-VL's deepstack rows), and returns the last chunk's hidden states (what ``logits_to_keep=1`` reads).
    The same numbers as one call up to float summation order (each position's attention sees the same keys).

    On CPU each chunk's attention is ``prefill_chunk_attention`` (no [chunk, width] mask; the text attention is
    switched to the grouped implementation for the chunks and back); elsewhere SDPA with transformers' mask.

    ``synced``: every rank makes as many decoder calls as the rank with the most chunks (a rank with fewer adds
    one-position idle calls), since under ZeRO-3 each layer call gathers its parameters collectively."""
    if chunk_size <= 0:
        yield
        return
    from transformers.modeling_outputs import BaseModelOutputWithPast

    from app.grouping import attention
    from app.grouping.modules import set_text_attention, text_config

    language = _language_model(model)
    original = language.forward  # the class's bound method: hooks run once, around the whole call

    def call(plan: PrefillChunk | None, **kwargs):
        """The decoder on one chunk: SDPA with transformers' mask, or (a plan, on CPU) ``prefill_chunk_attention``."""
        if plan is None:
            return original(**kwargs)
        kwargs["attention_mask"] = None
        return original(**kwargs, **{attention.PLAN_KWARG: plan})

    def forward(*, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                use_cache=None, visual_pos_masks=None, deepstack_visual_embeds=None, **kwargs):  # VL models call by keyword
        if inputs_embeds is None:
            inputs_embeds = language.get_input_embeddings()(input_ids)
        batch, width = inputs_embeds.shape[:2]
        count = _chunk_count(width, chunk_size, synced, inputs_embeds.device)
        if past_key_values is None and use_cache is not False:
            past_key_values = _prefill_cache(language.config, width)
        visual_rows = None
        if visual_pos_masks is not None:  # deepstack rows are in (row, position) order over the visual positions
            visual_rows = torch.full(visual_pos_masks.shape, -1, dtype=torch.long, device=visual_pos_masks.device)
            visual_rows[visual_pos_masks] = torch.arange(int(visual_pos_masks.sum()), device=visual_rows.device)
        plans = _chunk_plans(model, inputs_embeds, attention_mask)
        previous = text_config(model)._attn_implementation
        if plans is not None:
            set_text_attention(model, attention.ATTENTION_NAME)
        try:
            return run_chunks(count, width, inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, visual_rows=visual_rows,
                              deepstack_visual_embeds=deepstack_visual_embeds, plans=plans, kwargs=kwargs)
        finally:
            set_text_attention(model, previous)

    def run_chunks(count, width, inputs_embeds, *, attention_mask, position_ids, past_key_values, visual_rows,
                   deepstack_visual_embeds, plans, kwargs):
        hidden, kind = None, BaseModelOutputWithPast
        for k in range(count):
            start, end = k * chunk_size, min((k + 1) * chunk_size, width)
            if start >= width:  # idle: the layers' calls (and gathers) of a chunk, on one throwaway position
                call(None if plans is None else plans(None), inputs_embeds=inputs_embeds[:1, :1],
                     attention_mask=None, use_cache=False,
                     position_ids=None if position_ids is None else position_ids[..., :1, :1])
                continue
            extra = dict(kwargs)
            if visual_rows is not None:
                rows = visual_rows[:, start:end]
                if bool((rows >= 0).any()):
                    index = rows[rows >= 0]
                    extra.update(visual_pos_masks=rows >= 0,
                                 deepstack_visual_embeds=[d.index_select(0, index) for d in deepstack_visual_embeds])
            if extra.get("cache_position") is not None:
                extra["cache_position"] = extra["cache_position"][start:end]
            out = call(None if plans is None else plans(end),
                       inputs_embeds=inputs_embeds[:, start:end],
                       attention_mask=None if attention_mask is None else attention_mask[:, :end],
                       position_ids=None if position_ids is None else position_ids[..., start:end],
                       past_key_values=past_key_values, use_cache=True, **extra)
            hidden, kind = out.last_hidden_state, type(out)  # a MoE model's output type (its router_logits: None)
        return kind(last_hidden_state=hidden, past_key_values=past_key_values)

    from app.grouping.modules import patched

    with patched(language, "forward", forward):  # the class's forward shadowed until the block ends
        yield
