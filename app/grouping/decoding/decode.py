"""Grouped decoding as the rollout uses it (``GroupedDecoder``): one prefill per prompt (chunked, or the shared
video's prefill), then every sample steps together against its prompt's K/V held once (``cache.GroupedKVCache``,
``cache.decode_attention``), eagerly or as a static step kept, captured or compiled once per shape bucket
(``static.StaticSteps``). Where the time goes is ``clock.PartClock``'s.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from app.grouping.decoding.cache import GroupedKVCache, decode_attention  # noqa: F401 - decode_attention: re-exported
from app.grouping.decoding.clock import PartClock
from app.grouping.decoding.head import DecodingHead
from app.grouping.decoding.prefill import chunked_prefill
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
    the next step overwrites. ``spread``: a ``SequenceParallel`` group whose ranks all run this rollout of the same
    prompts, each with 1/S of the work that grows with the video (``spread.py``); every rank draws the same tokens."""

    def __init__(self, model, prompts: dict, group_sizes: Sequence[int], max_new_tokens: int, *,
                 prefill_chunk_size: int = 0, synced: bool = False, decode: str = "eager",
                 families: Sequence[int] | None = None, keep: StaticSteps | None = None,
                 clock: PartClock | None = None, spread=None, record_routing: bool = False):
        from app.grouping import attention
        from app.grouping.modules import set_text_attention, text_config
        from app.grouping.positions import prompt_positions

        self.model = model
        self._previous = text_config(model)._attn_implementation
        self._set_attention = set_text_attention
        device = prompts["input_ids"].device
        self.mode = decode_mode(decode, device, synced)
        self.routing = None  # ``routing.DecodeRouting``: the experts every token went to (rollout.routing_replay)
        if record_routing:  # a static step records into a fixed buffer: captured or compiled, it records too
            from app.grouping.decoding.routing import DecodeRouting

            self.routing = DecodeRouting(model, sum(group_sizes), max_new_tokens, device)
        self.graph, self.graph_error = None, None
        self.clock = clock if clock is not None else PartClock(device)
        self.kept_steps, self.kept, self.replayed, self.compiled_now, self.made = keep, None, False, False, False
        sizes = torch.tensor(list(group_sizes), device=device)
        group_of_sample = torch.repeat_interleave(torch.arange(len(group_sizes), device=device), sizes)
        set_text_attention(model, "sdpa")
        # questions sharing a video (``shared``): V prefilled once; not with ranks in lock step (every rank must
        # make as many forwards as the others: under ZeRO-3 hooks each layer call gathers collectively)
        self.shares = bool(families) and any(size > 1 for size in families) and not synced
        self.spread = spread
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
        make_cache = GroupedKVCache
        if spread is not None:
            from app.grouping.decoding.spread import SpreadKVCache

            config = text_config(model)
            make_cache = functools.partial(SpreadKVCache, sp=spread, heads=config.num_attention_heads,
                                           kv_heads=config.num_key_value_heads)
        if self.mode != "eager" and keep is not None:  # the bucket's kept buffers (and its step made once)
            self.kept, _ = keep.claim(past, mask, group_sizes, max_new_tokens, roots, last_position,
                                      make_cache=make_cache)
            self.cache, self._last_position, self._tokens = self.kept.cache, self.kept.last_position, self.kept.tokens
        else:
            self.cache = make_cache(past, mask, group_sizes, max_new_tokens, static=self.mode != "eager",
                                    roots=roots)
            self._last_position = last_position
            self._tokens = torch.zeros(len(group_of_sample), dtype=torch.long, device=device)  # the static input
        self.logits = logits[group_of_sample]  # [N, V]: a group's samples start from one distribution
        self._plan_kwarg = attention.PLAN_KWARG
        self.steps = 0
        self.bytes_per_step = step_bytes(model, self.cache)
        roots = self.cache.roots
        self.kv_bytes = sum(x.numel() * x.element_size() for pair in self.cache.prefix if pair is not None
                            for x in pair) + (
            0 if roots is None else sum(x.numel() * x.element_size() for x in roots.keys + roots.values
                                        if x is not None))
        self.state_bytes = self.cache.recurrent.nbytes()  # a hybrid model's GDN states, one copy per sample
        set_text_attention(model, attention.ATTENTION_NAME)

    def _prefill(self, model, prompts, families, positions, chunk_size: int, synced: bool):
        """The prompts' K/V (or the shared roots' and the questions'), their mask, and each group's first logits."""
        from app.grouping.positions import VISION_KEYS

        if self.spread is not None:
            from app.grouping.decoding.spread import spread_prefill

            past, mask, roots, logits, self.prefill_tokens = spread_prefill(
                model, prompts, families or [1] * prompts["input_ids"].shape[0], positions, head=self.head,
                chunk_size=chunk_size, sp=self.spread, routing=self.routing)
            return past, mask, roots, logits
        if self.shares:
            from app.grouping.decoding.shared import shared_prefill

            past, mask, roots, logits, root_tokens = shared_prefill(
                model, prompts, families, positions, head=self.head, chunk_size=chunk_size, synced=synced,
                routing=self.routing)
            self.prefill_tokens = root_tokens + int(mask.sum())
            return past, mask, roots, logits
        from app.grouping.media import expanded

        whole = expanded(prompts)  # the model's own forward: a pixel copy per occurrence
        vision = {k: whole[k] for k in VISION_KEYS if whole.get(k) is not None}
        routed = self.routing.kwargs() if self.routing is not None else {}
        with self.head.installed(), chunked_prefill(model, chunk_size, synced):
            out = model(input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"],
                        position_ids=positions if positions.shape[0] > 1 else positions[0], use_cache=True,
                        logits_to_keep=1, **vision, **routed)
        if self.routing is not None:
            self.routing.prompt = self.routing.taken(prompts["attention_mask"])  # the left-padded prompts' record
        return out.past_key_values, prompts["attention_mask"], None, out.logits[:, -1]

    @property
    def compacts(self) -> bool:
        """Whether ``keep`` may drop finished samples (eager steps only; static shapes keep every sample)."""
        return self.mode == "eager"

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per sample [N]; return the next logits [N, V]."""
        if self.mode == "eager":
            positions = (self._last_position + 1 + self.steps)[:, :, None]  # [axes, N, 1]
            routed = self.routing.kwargs() if self.routing is not None else {}
            with self.head.installed():
                out = self.model(input_ids=tokens[:, None], attention_mask=None,
                                 position_ids=positions if positions.shape[0] > 1 else positions[0],
                                 past_key_values=self.cache, use_cache=True, **{self._plan_kwarg: self.cache},
                                 **routed)
            if self.routing is not None:
                self.routing.stepped(self.steps)
            logits = out.logits[:, -1]
        else:
            self._tokens.copy_(tokens)
            logits = self._static_logits()
            if self.routing is not None:
                self.routing.static_stepped(self._holder, self.steps)
        self.steps += 1
        return logits

    @property
    def _holder(self):
        """What keeps the static step's state: the bucket kept across rollouts, else this decoder."""
        return self.kept if self.kept is not None else self

    def _static_logits(self) -> torch.Tensor:
        """One static-shape step: the kept graph replayed (its weights where they were at capture), else the step
        run (compiled in ``compiled`` mode) and, on CUDA in ``graph`` / ``compiled`` mode, captured after its first
        run for the rest of the rollout and, with ``keep``, for every later rollout of the bucket."""
        kept, steps = self.kept, self.kept_steps
        if kept is not None and self.routing is not None and getattr(kept, "route_plan", None) is None:
            kept.graph, kept.logits, kept.compiled = None, None, None  # made without recording: made again with it
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
        holder = self._holder
        routed = self.routing.static_plan(holder) if self.routing is not None else None
        if self.mode != "compiled":
            def plain():
                with self.head.installed():
                    return static_step(self.model, self.cache, self._last_position, self._tokens, self._plan_kwarg,
                                       routed)
            return plain
        if getattr(holder, "compiled", None) is None:
            step = functools.partial(static_step, self.model, self.cache, self._last_position, self._tokens,
                                     self._plan_kwarg, routed)
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
            graph, self.graph_error = None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if self.spread is not None and not _all_captured(graph is not None, self.spread, logits_device(self.cache)):
            graph = None  # a spread step's collectives: every rank of the group replays, or none does
            self.graph_error = self.graph_error or "another rank of the sequence-parallel group could not capture it"
        if graph is None:
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
        if self.routing is not None:
            self.routing.keep(rows)

    def idle_step(self) -> None:
        idle_forward(self.model)

    def close(self) -> None:
        self.graph = None  # the graph's memory pool goes with it
        if getattr(self, "head", None) is not None:
            self.head.close()  # the packed copy of the output head
        self._set_attention(self.model, self._previous)


def logits_device(cache) -> torch.device:
    return cache.first_keys.device


def _all_captured(captured: bool, sp, device) -> bool:
    """Whether every rank of the spread group captured its step (one all-reduce)."""
    import torch.distributed as dist

    flag = torch.tensor([1.0 if captured else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=sp.group)
    return bool(flag.item() == 1.0)


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
