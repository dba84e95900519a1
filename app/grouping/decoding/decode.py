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

import functools
import logging
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from app.grouping.decoding.clock import PartClock
from app.grouping.decoding.head import DecodingHead
from app.grouping.decoding.prefill import attention_with_lse, chunked_prefill
from app.grouping.decoding.static import (
    StaticSteps,
    capturable,
    capture_graph,
    decode_mode,
    static_step,
    step_bytes,
    weight_pointers,
)

log = logging.getLogger("app.grouping.decoding.decode")
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
        # [B, Hkv, Lp, D], contiguous: the decode products read them in place every step
        self.prefix = [(layer.keys.contiguous(), layer.values.contiguous()) for layer in layers]
        self.prompt_mask = prompt_mask.bool()  # [B, Lp], left-padded
        self.prompt_width = prompt_mask.shape[1]
        self.max_new_tokens = max_new_tokens
        self.own: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.prefix)
        self.steps = 0
        self.static = static
        self.roots = roots  # questions sharing a video: the videos' K/V, read once per root (``shared.SharedRoots``)
        device = prompt_mask.device
        sizes = torch.tensor(list(group_sizes), device=device)
        self._arrange(torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes))
        if static:
            capacity = -(-max_new_tokens // STATIC_BUCKET) * STATIC_BUCKET
            count = int(sizes.sum())
            self.own = [(k.new_zeros(count, k.shape[1], capacity, k.shape[3]),
                         v.new_zeros(count, v.shape[1], capacity, v.shape[3])) for k, v in self.prefix]
            self.written = torch.zeros((), dtype=torch.long, device=device)  # own tokens written: the step
            self._slots = torch.arange(capacity, device=device)
            self.own_bias = torch.zeros(1, 1, 1, capacity, dtype=torch.float32, device=device)

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
            self.prefix = [(k[groups], v[groups]) for k, v in self.prefix]
            self.prompt_mask = self.prompt_mask[groups]
        self.own = [None if own is None else (own[0][rows], own[1][rows]) for own in self.own]
        self._arrange(group_of_sample)

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
        """The prompt's width plus the steps taken (static: the prompt's width; positions are explicit)."""
        return self.prompt_width + (0 if self.static else self.steps)

    def __len__(self) -> int:
        return len(self.prefix)


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
    # Prefix: a group's queries side by side, [B, Hkv, Gmax * rep, D], one call against its prompt's K/V.
    slots = q[cache.slot_sample]  # [B, Gmax, Hkv, rep, D] (queries only: small)
    gmax = slots.shape[1]
    q_prefix = slots.permute(0, 2, 1, 3, 4).reshape(groups, kv_heads, gmax * rep, dim)
    out_a, lse_a = attention_with_lse(q_prefix, prefix_k, prefix_v, cache.prefix_bias, scale)
    out_a = out_a.reshape(groups, kv_heads, gmax, rep, dim).permute(0, 2, 1, 3, 4).reshape(groups * gmax, kv_heads,
                                                                                         rep, dim)
    out_a = out_a.index_select(0, cache.slot_index)  # [N, Hkv, rep, D]
    lse_a = lse_a.reshape(groups, kv_heads, gmax, rep).permute(0, 2, 1, 3).reshape(groups * gmax, kv_heads, rep)
    lse_a = lse_a.index_select(0, cache.slot_index)  # [N, Hkv, rep]
    # Own tokens: each sample's queries against the keys it generated.
    own_bias = cache.own_bias if cache.static else None  # static: the slots not written yet are hidden
    out_b, lse_b = attention_with_lse(q, own_keys, own_values, own_bias, scale)  # [N, Hkv, rep, D], [N, Hkv, rep]
    if cache.roots is not None:  # the video the sample's question follows: a third part, merged the same way
        out_r, lse_r = cache.roots.attend(layer_idx, q, scale)
        lse = torch.logaddexp(torch.logaddexp(lse_a, lse_b), lse_r)
        out = (torch.exp(lse_a - lse)[..., None] * out_a.float() + torch.exp(lse_b - lse)[..., None] * out_b.float()
               + torch.exp(lse_r - lse)[..., None] * out_r.float())
        return out.reshape(samples, 1, heads, dim).to(query.dtype)
    lse = torch.logaddexp(lse_a, lse_b)
    out = (torch.exp(lse_a - lse)[..., None] * out_a.float() + torch.exp(lse_b - lse)[..., None] * out_b.float())
    return out.reshape(samples, 1, heads, dim).to(query.dtype)


class GroupedDecoder:
    """Grouped decoding as the rollout uses it: one prefill per prompt, then all samples of all groups step
    together against their prompt's K/V held once. Knows nothing of sampling or stopping.

        decoder = GroupedDecoder(model, prompts, group_sizes, max_new_tokens)   # the prefill
        logits = decoder.logits                      # [N, V]: each sample starts from its prompt's last position
        while ...: logits = decoder.step(tokens)     # one token per sample
        decoder.close()                              # the model's attention setting as it was

    M-RoPE decode positions continue from the prompt's last position + 1 on every axis, passed explicitly.
    ``prefill_chunk_size`` > 0: the prefill's decoder runs that many prompt positions at a time (``chunked_prefill``);
    ``synced``: the ranks' forwards are collective (ZeRO-3 hooks on), so they agree on the number of chunks.
    ``idle_step`` runs the same modules without a real step (a rank that finished while others still decode under
    ZeRO-3 joins their parameter gathers). ``decode`` (``decode_mode``): ``eager`` steps whose batch shrinks as
    samples finish (``keep``); ``static`` fixed shapes, every sample kept; ``graph`` / ``compiled`` the static step
    captured (compiled first) and replayed, with ``keep`` (a run's ``StaticSteps``) once per shape bucket of the run.
    ``clock``: where the prefill (the tower apart), capture and steps' time goes. A static step's logits are a buffer
    the next step overwrites."""

    def __init__(self, model, prompts: dict, group_sizes: Sequence[int], max_new_tokens: int, *,
                 prefill_chunk_size: int = 0, synced: bool = False, decode: str = "eager",
                 families: Sequence[int] | None = None, keep: StaticSteps | None = None,
                 clock: PartClock | None = None):
        from app.grouping import attention
        from app.grouping.modules import set_text_attention, text_config
        from app.grouping.positions import prompt_positions

        self.model = model
        self._previous = text_config(model)._attn_implementation
        self._set_attention = set_text_attention
        device = prompts["input_ids"].device
        self.mode = decode_mode(decode, device, synced)
        self.graph, self.graph_error = None, None
        self.clock = clock if clock is not None else PartClock(device)
        self.kept_steps, self.kept, self.replayed, self.compiled_now, self.made = keep, None, False, False, False
        sizes = torch.tensor(list(group_sizes), device=device)
        group_of_sample = torch.repeat_interleave(torch.arange(len(group_sizes), device=device), sizes)
        set_text_attention(model, "sdpa")
        # questions sharing a video (``shared``): V prefilled once; not with ranks in lock step (every rank must
        # make as many forwards as the others: under ZeRO-3 hooks each layer call gathers collectively)
        self.shares = bool(families) and any(size > 1 for size in families) and not synced
        self.prefill_tokens = int(prompts["attention_mask"].sum())
        try:
            positions = prompt_positions(model, prompts["input_ids"], prompts["attention_mask"], prompts)
            self.head = DecodingHead(model, rows_hint=max(32, len(group_of_sample)))
            self.clock.lap("prefill")  # what came before (positions, the head's packing) counts as the prefill
            with self.clock.tower_hooks(model):
                past, mask, roots, logits = self._prefill(model, prompts, families, positions, prefill_chunk_size,
                                                          synced)
            self.clock.lap("prefill")
        except BaseException:
            self.close()
            raise
        last_position = positions[:, :, -1][:, group_of_sample]  # [axes, N]
        if self.mode != "eager" and keep is not None:  # the bucket's kept buffers (and its step made once)
            self.kept, _ = keep.claim(past.layers, mask, group_sizes, max_new_tokens, roots, last_position,
                                      make_cache=GroupedKVCache)
            self.cache, self._last_position, self._tokens = self.kept.cache, self.kept.last_position, self.kept.tokens
        else:
            self.cache = GroupedKVCache(past, mask, group_sizes, max_new_tokens, static=self.mode != "eager",
                                        roots=roots)
            self._last_position = last_position
            self._tokens = torch.zeros(len(group_of_sample), dtype=torch.long, device=device)  # the static input
        self.logits = logits[group_of_sample]  # [N, V]: a group's samples start from one distribution
        self._plan_kwarg = attention.PLAN_KWARG
        self.steps = 0
        self.bytes_per_step = step_bytes(model, self.cache)
        set_text_attention(model, attention.ATTENTION_NAME)

    def _prefill(self, model, prompts, families, positions, chunk_size: int, synced: bool):
        """The prompts' K/V (or the shared roots' and the questions'), their mask, and each group's first logits."""
        from app.grouping.positions import VISION_KEYS

        if self.shares:
            from app.grouping.decoding.shared import shared_prefill

            past, mask, roots, logits, root_tokens = shared_prefill(
                model, prompts, families, positions, head=self.head, chunk_size=chunk_size, synced=synced)
            self.prefill_tokens = root_tokens + int(mask.sum())
            return past, mask, roots, logits
        vision = {k: prompts[k] for k in VISION_KEYS if prompts.get(k) is not None}
        with self.head.installed(), chunked_prefill(model, chunk_size, synced):
            out = model(input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"],
                        position_ids=positions if positions.shape[0] > 1 else positions[0], use_cache=True,
                        logits_to_keep=1, **vision)
        return out.past_key_values, prompts["attention_mask"], None, out.logits[:, -1]

    @property
    def compacts(self) -> bool:
        """Whether ``keep`` may drop finished samples (eager steps only; static shapes keep every sample)."""
        return self.mode == "eager"

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per sample [N]; return the next logits [N, V]."""
        if self.mode == "eager":
            positions = (self._last_position + 1 + self.steps)[:, :, None]  # [axes, N, 1]
            with self.head.installed():
                out = self.model(input_ids=tokens[:, None], attention_mask=None,
                                 position_ids=positions if positions.shape[0] > 1 else positions[0],
                                 past_key_values=self.cache, use_cache=True, **{self._plan_kwarg: self.cache})
            logits = out.logits[:, -1]
        else:
            self._tokens.copy_(tokens)
            logits = self._static_logits()
        self.steps += 1
        return logits

    def _static_logits(self) -> torch.Tensor:
        """One static-shape step: the kept graph replayed (its weights where they were at capture), else the step
        run (compiled in ``compiled`` mode) and, on CUDA in ``graph`` / ``compiled`` mode, captured after its first
        run for the rest of the rollout and, with ``keep``, for every later rollout of the bucket."""
        kept, steps = self.kept, self.kept_steps
        if kept is not None and kept.graph is not None:
            if kept.pointers == weight_pointers(self.model):
                kept.graph.replay()
                self.replayed = True
                return kept.logits
            kept.graph, kept.logits = None, None
            steps.stats["recaptures"] += 1
            steps.eager_because("the weights moved since the step was captured (a ZeRO-3 gather put them "
                                "elsewhere): it is captured again for this rollout")
        if self.graph is not None:
            self.graph.replay()
            return self._graph_logits
        run = self._runner()
        logits = run()
        if self.compiled_now:  # the first call of a new compiled step: its compile time is the capture part
            self.clock.lap("capture")
            self.compiled_now = False
        if self.mode in ("graph", "compiled") and capturable(self.cache) and self.graph_error is None:
            self._capture(run)
        return logits

    def _runner(self):
        """The static step as a callable: plain (the CPU head packed around it) or compiled (once per kept bucket:
        its tensors are the same objects every rollout: dynamo's guards hold, nothing recompiles)."""
        if self.mode != "compiled":
            def plain():
                with self.head.installed():
                    return static_step(self.model, self.cache, self._last_position, self._tokens, self._plan_kwarg)
            return plain
        holder = self.kept if self.kept is not None else self
        if getattr(holder, "compiled", None) is None:
            step = functools.partial(static_step, self.model, self.cache, self._last_position, self._tokens,
                                     self._plan_kwarg)
            compiled = torch.compile(step, dynamic=False)

            def guarded():
                try:
                    return compiled()
                except Exception as error:  # noqa: BLE001 - a step that cannot compile falls back, said once
                    reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error) else ''}"
                    self._eagerly(f"the decode step could not be compiled ({reason})")
                    holder.compiled = step
                    return step()

            holder.compiled = guarded
            self.compiled_now = self.made = True
            self.clock.lap("decode")
            if self.kept_steps is not None:
                self.kept_steps.stats["compiles"] += 1
        return holder.compiled

    def _capture(self, run) -> None:
        """Record the static step as a CUDA graph (after one run of it, the warm-up); nothing runs while it records,
        so the cache's step is untouched. It records inside the kept steps' ``guard`` (the trainer pauses its data
        prefetch threads: no other thread works on the device meanwhile). If capture fails the steps stay eager
        (``graph_error``, warned once)."""
        self.clock.lap("decode")
        guard = self.kept_steps.guard if self.kept_steps is not None else nullcontext
        try:
            graph, logits = capture_graph(run, guard)
        except Exception as error:  # noqa: BLE001 - any capture failure leaves the eager static step
            self.graph_error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            self._eagerly(f"the decode step could not be captured as a CUDA graph ({self.graph_error})")
            self.clock.lap("capture")
            return
        if self.kept is not None:
            self.kept.graph, self.kept.logits = graph, logits
            self.kept.pointers = weight_pointers(self.model)
            self.kept_steps.stats["captures"] += 1
        else:
            self.graph, self._graph_logits = graph, logits
        self.clock.lap("capture")

    def _eagerly(self, reason: str) -> None:
        """Say why the steps run eagerly: once per run through the kept steps, else each time."""
        if self.kept_steps is not None:
            self.kept_steps.eager_because(reason)
        else:
            log.warning("decode steps run eagerly: %s", reason)

    def keep(self, rows: torch.Tensor) -> None:
        """Continue with these samples only (indices into the current batch, ascending): finished samples leave,
        and a group with none left drops its prefix from the step."""
        self.cache.keep(rows)
        self._last_position = self._last_position[:, rows]

    def idle_step(self) -> None:
        idle_forward(self.model)

    def close(self) -> None:
        self.graph = None  # the graph's memory pool goes with it
        if getattr(self, "head", None) is not None:
            self.head.close()  # the packed copy of the output head
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
