"""Grouped attention for decoding: each prompt's prefix K/V is held once, each sample appends its own K/V.

After one prefill of B prompts (the ordinary batched forward with a cache), the N = sum(G_b) samples decode
together. At every step a sample's query attends to its prompt's prefix keys (shared by the whole group, never
copied) and to the keys it generated itself. Memory for the prefix does not grow with G.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class GroupedKVCache:
    """Stands in for a transformers Cache during grouped decoding (``update`` and ``get_seq_length``)."""

    is_compileable = False

    def __init__(self, prefix_cache, prompt_mask: torch.Tensor, group_sizes: Sequence[int], max_new_tokens: int):
        layers = getattr(prefix_cache, "layers", None)
        if layers is None:
            raise TypeError("the prefill cache must be a transformers DynamicCache (with .layers)")
        self.prefix = [(layer.keys, layer.values) for layer in layers]
        self.prompt_mask = prompt_mask.bool()  # [B, Lp], left-padded
        self.group_sizes = list(group_sizes)
        self.max_new_tokens = max_new_tokens
        self.own: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.prefix)
        self.steps = 0
        device = prompt_mask.device
        sizes = torch.tensor(self.group_sizes, device=device)
        self.group_of_sample = torch.repeat_interleave(torch.arange(len(self.group_sizes), device=device), sizes)
        # [B, Gmax] -> sample index (pads point at sample 0 and are dropped by `slot_valid`)
        gmax = max(self.group_sizes)
        starts = torch.cumsum(sizes, 0) - sizes
        slots = starts[:, None] + torch.arange(gmax, device=device)[None, :]
        self.slot_valid = torch.arange(gmax, device=device)[None, :] < sizes[:, None]
        self.slot_sample = torch.where(self.slot_valid, slots, torch.zeros_like(slots))

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        """Append this step's K/V [N, Hkv, 1, D] for ``layer_idx``; return the sample's own K/V so far."""
        if self.own[layer_idx] is None:
            shape = (*key_states.shape[:2], self.max_new_tokens, key_states.shape[-1])
            self.own[layer_idx] = (key_states.new_zeros(shape), value_states.new_zeros(shape))
        keys, values = self.own[layer_idx]
        length = key_states.shape[2]
        keys[:, :, self.steps : self.steps + length] = key_states
        values[:, :, self.steps : self.steps + length] = value_states
        if layer_idx == len(self.prefix) - 1:
            self.steps += length
            end = self.steps
        else:
            end = self.steps + length
        return keys[:, :, :end], values[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prompt_mask.shape[1] + self.steps

    def __len__(self) -> int:
        return len(self.prefix)


def decode_attention(cache: GroupedKVCache, layer_idx: int, query, own_keys, own_values, scale: float | None):
    """q [N, H, 1, D]; own K/V [N, Hkv, t, D]; prefix K/V from the cache -> out [N, 1, H, D].

    Exact softmax over [prefix of the sample's prompt ; the sample's own tokens], computed in float32.
    """
    prefix_k, prefix_v = cache.prefix[layer_idx]  # [B, Hkv, Lp, D]
    samples, heads, q_len, dim = query.shape
    if q_len != 1:
        raise RuntimeError("grouped decoding feeds one token per sample per step")
    kv_heads = prefix_k.shape[1]
    rep = heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    q = query.float().view(samples, kv_heads, rep, dim) * scale
    # Prefix scores per prompt: queries of a group arranged [B, Gmax, ...]; the prefix K is read, never copied.
    q_slots = q[cache.slot_sample]  # [B, Gmax, Hkv, rep, D]
    prefix_scores = torch.einsum("bgkrd,bkld->bgkrl", q_slots, prefix_k.float())
    prefix_scores = prefix_scores.masked_fill(~cache.prompt_mask[:, None, None, None, :], float("-inf"))
    own_scores = torch.einsum("nkrd,nktd->nkrt", q, own_keys.float())  # [N, Hkv, rep, t]
    own_slots = own_scores[cache.slot_sample]  # [B, Gmax, Hkv, rep, t]
    probs = torch.softmax(torch.cat([prefix_scores, own_slots], dim=-1), dim=-1)
    prefix_len = prefix_k.shape[2]
    out = torch.einsum("bgkrl,bkld->bgkrd", probs[..., :prefix_len], prefix_v.float())
    out = out[cache.slot_valid]  # [N, Hkv, rep, D], samples in order
    out = out + torch.einsum("nkrt,nktd->nkrd", probs[..., prefix_len:][cache.slot_valid], own_values.float())
    return out.reshape(samples, 1, heads, dim).to(query.dtype)


class GroupedDecoder:
    """Grouped decoding as the rollout uses it: one prefill per prompt, then all samples of all groups step
    together against their prompt's K/V held once. Knows nothing of sampling or stopping.

        decoder = GroupedDecoder(model, prompts, group_sizes, max_new_tokens)   # the prefill
        logits = decoder.logits                      # [N, V]: each sample starts from its prompt's last position
        while ...: logits = decoder.step(tokens)     # one token per sample
        decoder.close()                              # the model's attention setting as it was

    M-RoPE decode positions continue from the prompt's last position + 1 on every axis, passed explicitly.
    ``idle_step`` runs the same modules without a real step (a rank that finished while others still decode under
    ZeRO-3 joins their parameter gathers).
    """

    def __init__(self, model, prompts: dict, group_sizes: Sequence[int], max_new_tokens: int):
        from app.grouping import attention
        from app.grouping.modules import set_text_attention, text_config
        from app.grouping.positions import VISION_KEYS, prompt_positions

        self.model = model
        self._previous = text_config(model)._attn_implementation
        self._set_attention = set_text_attention
        device = prompts["input_ids"].device
        sizes = torch.tensor(list(group_sizes), device=device)
        group_of_sample = torch.repeat_interleave(torch.arange(len(group_sizes), device=device), sizes)
        set_text_attention(model, "sdpa")
        try:
            positions = prompt_positions(model, prompts["input_ids"], prompts["attention_mask"], prompts)
            vision = {k: prompts[k] for k in VISION_KEYS if prompts.get(k) is not None}
            out = model(input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"],
                        position_ids=positions if positions.shape[0] > 1 else positions[0], use_cache=True,
                        logits_to_keep=1, **vision)
        except BaseException:
            self.close()
            raise
        self.cache = GroupedKVCache(out.past_key_values, prompts["attention_mask"], group_sizes, max_new_tokens)
        self.logits = out.logits[:, -1][group_of_sample]  # [N, V]: a group's samples start from one distribution
        self._last_position = positions[:, :, -1][:, group_of_sample]  # [axes, N]
        self._plan_kwarg = attention.PLAN_KWARG
        self.steps = 0
        set_text_attention(model, attention.ATTENTION_NAME)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per sample [N]; return the next logits [N, V]."""
        positions = (self._last_position + 1 + self.steps)[:, :, None]  # [axes, N, 1]
        out = self.model(input_ids=tokens[:, None], attention_mask=None,
                         position_ids=positions if positions.shape[0] > 1 else positions[0],
                         past_key_values=self.cache, use_cache=True, **{self._plan_kwarg: self.cache})
        self.steps += 1
        return out.logits[:, -1]

    def idle_step(self) -> None:
        idle_forward(self.model)

    def close(self) -> None:
        self._set_attention(self.model, self._previous)


def idle_forward(model) -> None:
    """A two-token grouped forward through the same modules as a decode step, for a rank that has finished while
    the others still decode (under ZeRO-3 every module call all-gathers, so every rank must make it)."""
    from app.grouping import attention
    from app.grouping.layout import GroupLayout
    from app.grouping.modules import unwrap
    from app.grouping.positions import rope_index_owner

    device = next(unwrap(model).parameters()).device
    layout = GroupLayout((1,), (1,), (1,), 1, 1)
    is_vl = rope_index_owner(unwrap(model)) is not None
    positions = torch.arange(2, device=device).view(1, 1, 2).expand(3 if is_vl else 1, 1, 2)
    model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), attention_mask=None,
          position_ids=positions if is_vl else positions[0], use_cache=False,
          **{attention.PLAN_KWARG: attention.GroupedAttentionPlan(layout, "masked")})
