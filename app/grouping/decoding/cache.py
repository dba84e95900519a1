"""Grouped attention for decoding: each prompt's prefix K/V is held once, each sample appends its own K/V.

After one prefill of B prompts (the ordinary batched forward with a cache), the N = sum(G_b) samples decode
together. At every step a sample's query attends to its prompt's prefix keys (shared by the whole group, never
copied) and to the keys it generated itself, as two attention calls merged exactly by their log-sum-exp (the
``split`` backend's idea; Hydragen's for inference):

- prefix: the group's G x (heads per KV head) queries as ONE batch against the prompt's K/V, one fused call, no
  copy of the prefix (a mask only when prompts of different lengths are left-padded);
- own: each sample's queries against its own keys so far (at most max_new_tokens of them);
- merge: out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b, lse = logaddexp(lse_a, lse_b), in float32.

Memory for the prefix does not grow with G. Finished samples leave the batch (``GroupedKVCache.keep``).

Static shapes (``decode="static"``/``"graph"``/``"compiled"``): the own K/V live in buffers of a fixed capacity,
written at the step held in a device tensor, attended under a key bias that hides the slots not written yet; no
sample leaves the batch. Every tensor of a step keeps its shape and address, so on CUDA the step is captured as a
CUDA graph and replayed (one launch per step), or compiled first; with ``keep`` (``static.StaticSteps``) once per
shape bucket for the whole run. Where the time goes is ``clock.PartClock``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.grouping.decoding.prefill import attention_with_lse
from app.grouping.decoding.varlen import varlen_decode_parts
from app.grouping.kernels import varlen_kernel

STATIC_BUCKET = 64  # own-K/V capacity is max_new_tokens rounded up to this (fewer distinct shapes)


class GroupedKVCache:
    """Stands in for a transformers Cache during grouped decoding (``update`` and ``get_seq_length``).

    Rows are the samples still decoding, in order; ``keep`` drops the others (and the prefix of a group none of
    whose samples is left). ``static``: fixed-capacity own K/V written at a device-held step (``begin_step`` /
    ``end_step`` around each step), every sample kept."""

    is_compileable = False

    def attend(self, module, query, key, value, *, scale=None, dropout=0.0) -> torch.Tensor:
        """The attention-plan protocol (``attention.GroupedAttentionPlan.attend``): one decode step's attention."""
        return decode_attention(self, module.layer_idx, query, key, value, scale)

    def __init__(self, prefix_cache, prompt_mask: torch.Tensor, group_sizes: Sequence[int], max_new_tokens: int, *,
                 static: bool = False, roots=None):
        layers = getattr(prefix_cache, "layers", None)
        if layers is None:
            raise TypeError("the prefill cache must be a transformers DynamicCache (with .layers)")
        # [B, Hkv, Lp, D], contiguous: the decode products read them in place every step; None for a hybrid
        # model's Gated DeltaNet layers, whose state per sample is ``recurrent``'s
        self.prefix = [None if is_recurrent_layer(layer) else (layer.keys.contiguous(), layer.values.contiguous())
                       for layer in layers]
        self.attention_layers = [i for i, pair in enumerate(self.prefix) if pair is not None]
        self.prompt_mask = prompt_mask.bool()  # [B, Lp], left-padded
        self.prompt_width = prompt_mask.shape[1]
        self.max_new_tokens = max_new_tokens
        self.own: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.prefix)
        self.steps = 0
        self.static = static
        self.roots = roots  # questions sharing a video: the videos' K/V, read once per root (``shared.SharedRoots``)
        device = prompt_mask.device
        keys = self.first_keys
        # on CUDA in float16/bfloat16: torch's varlen flash kernel reads the K/V (``varlen_decode_attention``)
        self.varlen = varlen_kernel(device, keys.dtype, keys.shape[-1], lse=True, seqused_k=True,
                                    use="decode attention")
        sizes = torch.tensor(list(group_sizes), device=device)
        self._arrange(torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes))
        # each sample's own copy of its prompt's GDN states (conv tail, recurrent state), written in place
        self.prompt_states = prompt_states_of(prefix_cache, layers)
        self.recurrent = self.prompt_states.expanded(self.group_of_sample)
        if static:
            capacity = -(-max_new_tokens // STATIC_BUCKET) * STATIC_BUCKET
            count = int(sizes.sum())
            self.own = [None if pair is None else (self._own_buffer(pair[0], count, capacity),
                                                   self._own_buffer(pair[1], count, capacity))
                        for pair in self.prefix]
            self.written = torch.zeros((), dtype=torch.long, device=device)  # own tokens written: the step
            self._slots = torch.arange(capacity, device=device)
            self.own_bias = torch.zeros(1, 1, 1, capacity, dtype=torch.float32, device=device)

    def _own_buffer(self, like: torch.Tensor, count: int, capacity: int) -> torch.Tensor:
        """A sample's own K/V buffer [N, Hkv, capacity, D]; for the varlen kernel a view of (N, capacity, Hkv, D)
        storage, so the kernel reads all samples' keys as one (N * capacity, Hkv, D) tensor in place."""
        heads, dim = like.shape[1], like.shape[3]
        if self.varlen is None:
            return like.new_zeros(count, heads, capacity, dim)
        return like.new_zeros(count, capacity, heads, dim).transpose(1, 2)

    def _arrange(self, group_of_sample: torch.Tensor) -> None:
        """Slots [B, Gmax] -> row for the prefix call (pads point at row 0 and are dropped by ``slot_valid``), and
        the additive prefix mask (None when no prompt is padded)."""
        self.group_of_sample = group_of_sample
        if self.roots is not None:
            self.roots.arrange(group_of_sample)
        counts = torch.bincount(group_of_sample, minlength=self.prompt_mask.shape[0])
        gmax = int(counts.max()) if counts.numel() else 0
        starts = torch.cumsum(counts, 0) - counts
        slots = starts[:, None] + torch.arange(gmax, device=counts.device)[None, :]
        self.slot_valid = torch.arange(gmax, device=counts.device)[None, :] < counts[:, None]
        self.slot_sample = torch.where(self.slot_valid, slots, torch.zeros_like(slots))
        # the valid slots' positions in the flattened [B * Gmax] slots, in sample order: an index made here, so a
        # step selects with it (a boolean mask would make every step wait for the device to count its entries)
        self.slot_index = self.slot_valid.flatten().nonzero().flatten()
        self.prefix_start = (~self.prompt_mask).sum(1)  # [B] left padding: where each prompt's keys begin
        if bool(self.prompt_mask.all()):
            self.prefix_bias = None
        else:
            bias = torch.zeros(self.prompt_mask.shape, dtype=torch.float32, device=self.prompt_mask.device)
            self.prefix_bias = bias.masked_fill(~self.prompt_mask, float("-inf"))[:, None, None, :]

    def keep(self, rows: torch.Tensor) -> None:
        """Continue with these rows only (indices into the current rows, ascending); groups left without a sample
        drop out of the prefix call."""
        if self.static:
            raise RuntimeError("a static-shape cache keeps every sample (finished ones step on, masked out)")
        group_of_sample = self.group_of_sample[rows]
        groups, group_of_sample = torch.unique(group_of_sample, return_inverse=True)
        if self.roots is not None:
            self.roots.keep(groups, group_of_sample)
        if len(groups) < self.prompt_mask.shape[0]:
            self.prefix = [None if pair is None else (pair[0][groups], pair[1][groups]) for pair in self.prefix]
            self.prompt_mask = self.prompt_mask[groups]
        self.own = [None if own is None else tuple(self._rows_of(x, rows) for x in own) for own in self.own]
        self.recurrent.keep(rows)
        self._arrange(group_of_sample)

    def _rows_of(self, buffer: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Some samples' rows of an own K/V buffer, in the buffer's layout (the varlen kernel's stays)."""
        if self.varlen is None:
            return buffer[rows]
        return buffer.transpose(1, 2)[rows].transpose(1, 2)

    def begin_step(self) -> None:
        """Static: the own-key bias of this step (slots up to the one written now are seen), on the device."""
        self.own_bias.copy_(torch.where(self._slots <= self.written, 0.0, float("-inf")).view(1, 1, 1, -1))

    def end_step(self) -> None:
        self.written.add_(1)

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        """Append this step's K/V [N, Hkv, 1, D] for ``layer_idx``; return the sample's own K/V so far (static: the
        whole buffers, their unwritten slots hidden by ``own_bias``)."""
        if self.static:
            keys, values = self.own[layer_idx]
            slot = self.written.view(1)
            keys.index_copy_(2, slot, key_states)
            values.index_copy_(2, slot, value_states)
            return keys, values
        if self.own[layer_idx] is None:
            count = key_states.shape[0]
            self.own[layer_idx] = (self._own_buffer(key_states, count, self.max_new_tokens),
                                   self._own_buffer(value_states, count, self.max_new_tokens))
        keys, values = self.own[layer_idx]
        length = key_states.shape[2]
        keys[:, :, self.steps : self.steps + length] = key_states
        values[:, :, self.steps : self.steps + length] = value_states
        if layer_idx == self.attention_layers[-1]:
            self.steps += length
            end = self.steps
        else:
            end = self.steps + length
        return keys[:, :, :end], values[:, :, :end]

    @property
    def first_keys(self) -> torch.Tensor:
        """The first attention layer's prompt keys [B, Hkv, Lp, D] (shapes, dtype and device of the K/V)."""
        return self.prefix[self.attention_layers[0]][0]

    def linear_attention(self, module, hidden_states, *, cache_params=None, original=None):
        """A Gated DeltaNet layer's decode step: each sample's conv tail and recurrent state advance in place."""
        return self.recurrent.finish(module, self.recurrent.step(module, hidden_states), hidden_states)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int = 0) -> bool:
        return True

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The prompt's width plus the steps taken (static: the prompt's width; positions are explicit)."""
        return self.prompt_width + (0 if self.static else self.steps)

    def __len__(self) -> int:
        return len(self.prefix)


def is_recurrent_layer(layer) -> bool:
    """A prefill cache layer without K/V: a Gated DeltaNet layer's (transformers' ``LinearAttentionLayer``, or a
    spread prefill's placeholder); its states travel beside (``prompt_states_of``)."""
    return getattr(layer, "keys", None) is None


def prompt_states_of(prefix_cache, layers):
    """The prefill's GDN states per prompt (``recurrent.state.prompt_states``): handed over with the prefill, or
    read off transformers' cache layers; empty for a model without GDN layers."""
    from app.grouping.recurrent.state import RecurrentStates

    handed = getattr(prefix_cache, "recurrent", None)
    if handed is not None:
        return handed
    found = {}
    for i, layer in enumerate(layers):
        if is_recurrent_layer(layer):
            found[i] = (layer.conv_states[0][..., 1:].contiguous(), layer.recurrent_states[0].float().contiguous())
    return RecurrentStates(found)


def decode_attention(cache: GroupedKVCache, layer_idx: int, query, own_keys, own_values, scale: float | None):
    """q [N, H, 1, D]; own K/V [N, Hkv, t, D]; prefix K/V from the cache -> out [N, 1, H, D].

    Exact softmax over [prefix of the sample's prompt ; the sample's own tokens]: two attention calls in the
    model's dtype with float32 accumulation, merged by log-sum-exp in float32. The prefix K/V is read in place."""
    prefix_k, prefix_v = cache.prefix[layer_idx]  # [B, Hkv, Lp, D]
    samples, heads, q_len, dim = query.shape
    if q_len != 1:
        raise RuntimeError("grouped decoding feeds one token per sample per step")
    groups, kv_heads = prefix_k.shape[0], prefix_k.shape[1]
    rep = heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    q = query.reshape(samples, kv_heads, rep, dim)
    slots = q[cache.slot_sample]  # [B, Gmax, Hkv, rep, D] (queries only: small)
    gmax = slots.shape[1]
    if cache.varlen is not None:
        out_a, lse_a, out_b, lse_b = varlen_decode_parts(cache, layer_idx, slots, q, (own_keys, own_values),
                                                         scale=scale)
    else:
        # Prefix: a group's queries side by side, [B, Hkv, Gmax * rep, D], one call against its prompt's K/V.
        q_prefix = slots.permute(0, 2, 1, 3, 4).reshape(groups, kv_heads, gmax * rep, dim)
        out_a, lse_a = attention_with_lse(q_prefix, prefix_k, prefix_v, cache.prefix_bias, scale)
        out_a = out_a.reshape(groups, kv_heads, gmax, rep, dim).permute(0, 2, 1, 3, 4).reshape(
            groups * gmax, kv_heads, rep, dim)
        lse_a = lse_a.reshape(groups, kv_heads, gmax, rep).permute(0, 2, 1, 3).reshape(groups * gmax, kv_heads, rep)
        # Own tokens: each sample's queries against the keys it generated.
        own_bias = cache.own_bias if cache.static else None  # static: the slots not written yet are hidden
        out_b, lse_b = attention_with_lse(q, own_keys, own_values, own_bias, scale)  # [N, Hkv, rep, D], [N, Hkv, rep]
    out_a = out_a.index_select(0, cache.slot_index)  # [N, Hkv, rep, D]
    lse_a = lse_a.index_select(0, cache.slot_index)  # [N, Hkv, rep]
    if cache.roots is not None:  # the video the sample's question follows: a third part, merged the same way
        out_r, lse_r = cache.roots.attend(layer_idx, q, scale)
        lse = torch.logaddexp(torch.logaddexp(lse_a, lse_b), lse_r)
        out = (torch.exp(lse_a - lse)[..., None] * out_a.float() + torch.exp(lse_b - lse)[..., None] * out_b.float()
               + torch.exp(lse_r - lse)[..., None] * out_r.float())
        return out.reshape(samples, 1, heads, dim).to(query.dtype)
    lse = torch.logaddexp(lse_a, lse_b)
    out = (torch.exp(lse_a - lse)[..., None] * out_a.float() + torch.exp(lse_b - lse)[..., None] * out_b.float())
    return out.reshape(samples, 1, heads, dim).to(query.dtype)
