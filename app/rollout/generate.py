"""Rollouts: G sampled responses per prompt from ONE prefill of that prompt.

HF ``generate(num_return_sequences=G)`` copies the prompt and its video G times, so the vision tower and the
prefill run G times. Here each prompt is prefilled once (vision tower once), then its G samples decode together
with grouped attention: the prompt's K/V is held once and each sample appends only its own
(``app.grouping.GroupedDecoder``). M-RoPE decode positions continue from the last prefix position + 1.

``engine="hf"`` keeps plain HF generate on the repeated batch for A/B comparisons.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from app.grouping import (
    GroupedDecoder,
    aligned_vision_calls,
    normalize_group_sizes,
    repeated_inputs,
    set_text_attention,
    text_config,
    unwrap,
    use_qwen_positions,
)
from app.grouping.decoding.clock import PartClock
from app.grouping.decoding.static import dynamo_frames
from app.rollout.sampling import (
    SamplingConfig,
    derive_seed,
    penalised_sample,
    repetition_penalised,
    sample_generators,
    sample_tokens,
    seen_tokens,
)

DEFAULT_SAMPLING = SamplingConfig()  # frozen: one shared default
ENGINES = ("grouped", "hf")  # generate_groups' decoders (DECODERS, below; rollout.engine lists every engine:
#                               app.rollout.registry.ENGINE_NAMES)
CHECK_EVERY = 8  # decode steps between looks at which samples finished (one host sync; compaction; ZeRO-3 agreement)


@dataclass
class Rollout:
    completion_ids: torch.Tensor  # [N, L] right-padded with the pad id
    completion_mask: torch.Tensor  # [N, L] 1 up to and including EOS / the token completing a stop string
    logprobs: torch.Tensor  # [N, L] log softmax(logits / T) of each sampled token (T=1 when greedy), 0 at pads
    group_sizes: list[int]
    stop_reasons: list[str]  # per completion: "eos", "stop_string" or "length"
    prefill_tokens: int  # prompt tokens the decoder processed in prefill
    prompt_tokens: int = 0  # the prompts' real tokens, each prompt once (prefill_tokens below it: a prefix reused)
    # where the time went (``app.grouping.decoding.clock.PARTS``: seconds), the decode steps, the bytes one step
    # reads, and what the kept static step did (captures, compiles, replays, recaptures): summed over draws
    parts: dict = field(default_factory=dict)
    routing: object = None  # rollout.routing_replay=r3: each token's experts (app.grouping.experts.record.Routing)


STOP_REASONS = ("eos", "length", "stop_string")


def _all_done(done_here: bool, device) -> bool:
    """True when every rank is done; ranks keep stepping together (ZeRO-3 gathers parameters collectively)."""
    import torch.distributed as dist

    done = torch.tensor([1.0 if done_here else 0.0], device=device)
    dist.all_reduce(done, op=dist.ReduceOp.MIN)
    return bool(done.item() == 1.0)


def _default_synced() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def vision_token_ids(model) -> list[int]:
    config = unwrap(model).config
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [int(getattr(config, n)) for n in names if getattr(config, n, None) is not None]


def eos_token_ids(model, tokenizer=None) -> list[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(text_config(model), "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    return [] if ids is None else [int(i) for i in ([ids] if isinstance(ids, int) else ids)]


@torch.no_grad()
def generate_groups(
    model,
    prompts: Mapping[str, torch.Tensor],
    group_sizes: int | Sequence[int],
    sampling: SamplingConfig = DEFAULT_SAMPLING,
    *,
    tokenizer=None,
    eos_ids: Sequence[int] | None = None,
    pad_id: int | None = None,
    engine: str = "grouped",
    synced: bool | None = None,
    vision_calls: Sequence[str] | None = None,
    prompt_seeds: Sequence[int] | None = None,
    prefill_chunk_size: int = 0,
    decode: str = "auto",
    families: Sequence[int] | None = None,
    static_steps=None,
    clock=None,
    spread=None,
    record_routing: bool = False,
) -> Rollout:
    """Sample ``group_sizes[b]`` completions for each prompt b of a processor batch (left-padded).

    ``synced``: ranks step together (forwards that all-gather under ZeRO-3); ``vision_calls``: the vision-tower
    calls the prefill must make whatever this rank's prompts hold (``app.grouping.aligned_vision_calls``).
    ``prompt_seeds``: one seed per prompt (e.g. ``derive_seed(seed, question key)``): each sample draws from its own
    stream (``sample_generators``), so it does not depend on the batch, the rank, the batch size or when the other
    samples finish; default ``derive_seed(sampling.seed, b)`` when ``sampling.seed`` is set, else torch's global
    generator. ``prefill_chunk_size`` > 0: the grouped engine's prefill runs its decoder that many prompt positions
    at a time (``app.grouping.decoding.decode.chunked_prefill``: activations bounded by the chunk, not the prompt).
    ``decode``: the grouped engine's decode step (``app.grouping.decoding.decode.decode_mode``): ``auto`` replays a CUDA
    graph of a static-shape step on CUDA (unless ranks step in lock step under ZeRO-3), eager steps elsewhere.
    ``families``: runs of consecutive prompts that share a video (``app.grouping.families``): the grouped engine
    prefills it once for them and its decode steps read it once (``app.grouping.decoding.shared``); hf ignores it.
    ``static_steps``: a run's ``app.grouping.StaticSteps`` (the static step captured or compiled once per shape bucket);
    ``clock``: a ``PartClock`` the rollout's parts are timed on (``Rollout.parts``). ``spread``: a sequence-parallel
    group (``SequenceParallel``) whose every rank calls this with the same prompts and seeds: each rank does 1/S of
    the tower, the prefills and the K/V reads, and every rank returns the same rollout (grouped engine only).
    """
    if engine not in DECODERS:
        raise ValueError(f"unknown generation engine {engine!r}; expected one of {ENGINES}")
    if record_routing and engine != "grouped":  # routing replay: the experts each token used, as it was sampled
        raise ValueError(f"rollout.routing_replay=r3 records routing in rollout.engine=grouped only, not {engine!r}")
    if spread is not None and engine != "grouped":
        raise ValueError(f"a rollout spread over a sequence-parallel group runs on the grouped engine, not {engine!r}")
    num_prompts = prompts["input_ids"].shape[0]
    sizes = [group_sizes] * num_prompts if isinstance(group_sizes, int) else list(group_sizes)
    sizes = list(normalize_group_sizes(sizes, num_prompts, sum(sizes)))
    eos_ids = list(eos_ids) if eos_ids is not None else eos_token_ids(model, tokenizer)
    if pad_id is None:
        pad_id = getattr(tokenizer, "pad_token_id", None)
        pad_id = pad_id if pad_id is not None else (eos_ids[0] if eos_ids else 0)
    synced = _default_synced() if synced is None else synced
    if prompt_seeds is None and sampling.seed is not None:
        prompt_seeds = [derive_seed(sampling.seed, b) for b in range(num_prompts)]
    if prompt_seeds is not None and len(prompt_seeds) != num_prompts:
        raise ValueError(f"{len(prompt_seeds)} prompt seeds for {num_prompts} prompts")
    generators = sample_generators(prompt_seeds, sizes, prompts["input_ids"].device)
    with aligned_vision_calls(model, prompts, vision_calls):  # acts on the first forward only: the prefill
        extra = {"spread": spread} if spread is not None else {}
        extra.update({"record_routing": True} if record_routing else {})
        return DECODERS[engine](model, prompts, sizes, sampling, tokenizer=tokenizer, eos_ids=eos_ids, pad_id=pad_id,
                                synced=synced, generators=generators, prefill_chunk_size=prefill_chunk_size,
                                decode=decode, families=families, static_steps=static_steps, clock=clock, **extra)


class _Finish:
    """Which samples have finished (EOS, or a stop string completed), after how many tokens, and why; shared by
    both engines. Stop strings need the decoded text of each sample's last tokens (host work every step)."""

    def __init__(self, count: int, eos_ids: Sequence[int], strings: Sequence[str], tokenizer, limit: int, device):
        if strings and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer")
        self.eos = torch.tensor(sorted(set(eos_ids)), device=device, dtype=torch.long)
        self.strings, self.tokenizer = tuple(strings), tokenizer
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self.finished = torch.zeros(count, dtype=torch.bool, device=device)
        self.by_stop = torch.zeros(count, dtype=torch.bool, device=device)
        self.end = torch.full((count,), limit, dtype=torch.long, device=device)  # tokens kept, the last included

    def record(self, rows: torch.Tensor, tokens: torch.Tensor, step: int) -> None:
        """Token ``step`` (0-based) of the samples ``rows``; those still alive may finish with it."""
        alive = ~self.finished[rows]
        hit = (torch.isin(tokens, self.eos) if self.eos.numel() else torch.zeros_like(alive)) & alive
        if self.strings:
            stopped = torch.zeros_like(alive)
            for i in (alive & ~hit).nonzero().flatten().tolist():
                sample = self.tokens[int(rows[i])]
                sample.append(int(tokens[i]))
                tail = self.tokenizer.decode(sample[-16:], skip_special_tokens=False)
                stopped[i] = any(s in tail for s in self.strings)
            self.by_stop[rows] |= stopped
            hit |= stopped
        self.finished[rows] |= hit
        self.end[rows] = torch.where(hit, step + 1, self.end[rows])  # no host sync (rows are distinct)

    def mask(self) -> torch.Tensor:
        width = int(self.end.max()) if self.end.numel() else 0
        return (torch.arange(width, device=self.end.device)[None, :] < self.end[:, None]).long()

    def reasons(self) -> list[str]:
        return ["stop_string" if s else ("eos" if f else "length")
                for f, s in zip(self.finished.tolist(), self.by_stop.tolist())]


def _grouped_generate(model, prompts, sizes, sampling, *, tokenizer, eos_ids, pad_id, synced, generators,
                      prefill_chunk_size=0, decode="auto", families=None, static_steps=None, clock=None,
                      spread=None, record_routing=False) -> Rollout:
    """Decode all samples together, each prompt prefilled once. The host looks at which samples finished only
    every ``CHECK_EVERY`` steps: finished samples then leave the batch (``GroupedDecoder.keep``) and, under ZeRO-3,
    the ranks agree whether all are done (every rank steps, idly once done, until all are).
    Between looks a finished sample steps on with pad tokens that are masked out, and each sample draws from its
    own generator, so every output equals a step-by-step run. Stop strings need the decoded text: with them the
    host looks at every step. A static-shape decoder (``decoder.compacts`` False) keeps finished samples stepping
    on pad tokens to the end."""
    device = prompts["input_ids"].device
    count, limit = sum(sizes), sampling.max_new_tokens
    suppress_ids = vision_token_ids(model) if sampling.suppress_token_ids is None else list(sampling.suppress_token_ids)
    suppress = torch.tensor(suppress_ids, device=device, dtype=torch.long) if suppress_ids else None
    finish = _Finish(count, eos_ids, sampling.stop_strings, tokenizer, limit, device)
    ids = torch.full((count, limit), pad_id, dtype=torch.long, device=device)
    logprobs_out = torch.zeros(count, limit, device=device)
    rows = torch.arange(count, device=device)  # the decoder's batch -> sample index
    clock = clock if clock is not None else PartClock(device)
    frames = dynamo_frames()
    decoder = GroupedDecoder(model, prompts, sizes, limit, prefill_chunk_size=prefill_chunk_size, synced=synced,
                             decode=decode, families=families, keep=static_steps, clock=clock,
                             spread=spread, record_routing=record_routing)  # each prompt once
    logits, step, tick, done_here = decoder.logits, 0, 0, False
    seen = None  # the tokens of each sample's prompt and completion so far, for the repetition penalty
    if sampling.repetition_penalty != 1.0:
        group = torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))
        seen = seen_tokens(prompts["input_ids"][group], prompts["attention_mask"][group], logits.shape[-1])
    try:
        while True:
            if not done_here:
                tokens, logprobs = penalised_sample(logits, sampling, generators, suppress,
                                                    None if seen is None else seen[rows])
                alive = ~finish.finished[rows]
                tokens = torch.where(alive, tokens, torch.full_like(tokens, pad_id))
                if seen is not None:
                    seen[rows[alive], tokens[alive]] = True
                ids[rows, step] = tokens
                logprobs_out[rows, step] = torch.where(alive, logprobs, torch.zeros_like(logprobs))
                finish.record(rows, tokens, step)
                clock.lap("sampling")
                step += 1
                done_here = step == limit  # a local decision: this rank's limit
            # Every rank steps once per tick (really, or idly once done), so a schedule of looks by tick lines up
            # across ranks even when their limits differ.
            tick += 1
            look = tick % CHECK_EVERY == 0 or bool(finish.strings)
            if look and not done_here:
                alive = ~finish.finished[rows]
                if not bool(alive.any()):
                    done_here = True
                elif decoder.compacts and not bool(alive.all()):  # finished samples cost nothing from here on
                    keep = alive.nonzero().flatten()
                    rows, tokens = rows[keep], tokens[keep]
                    generators = [generators[i] for i in keep.tolist()] if generators is not None else None
                    decoder.keep(keep)
            if (synced and look and _all_done(done_here, device)) or (not synced and done_here):
                break
            if done_here:
                decoder.idle_step()  # this rank is done; the others still gather parameters (ZeRO-3)
            else:
                logits = decoder.step(tokens)
                clock.count("decode_steps")
            clock.lap("decode")
    finally:
        decoder.close()
    mask = finish.mask()
    width = mask.shape[1]
    parts = {**clock.seconds(), "decode_steps": float(clock.counts["decode_steps"]),
             "decode_bytes_per_step": decoder.bytes_per_step, "graph_replayed": float(decoder.replayed),
             # this rank's own work (a spread rollout's 1/S): the tower's patch rows, the prompt positions it ran
             # through the layers, the prompts' K/V it held after the prefill
             "work/tower_patches": float(clock.counts["tower_patches"]), "work/prefill_tokens": float(
                 decoder.prefill_tokens), "work/kv_bytes": float(decoder.kv_bytes),
             "compiled_frames": float(dynamo_frames() - frames),  # a new step's frames, or recompiles of a kept one
             "recompiles": float(dynamo_frames() - frames) if decoder.mode == "compiled" and not decoder.made else 0.0,
             **({f"kept/{k}": float(v) for k, v in static_steps.take().items()} if static_steps is not None else {})}
    return Rollout(
        completion_ids=ids[:, :width],
        completion_mask=mask,
        logprobs=logprobs_out[:, :width],
        group_sizes=sizes,
        stop_reasons=finish.reasons(),
        prefill_tokens=decoder.prefill_tokens,
        prompt_tokens=int(prompts["attention_mask"].sum()),
        parts=parts,
        routing=decoder.routing.record(mask) if decoder.routing is not None else None,
    )


class _SampleLikeGrouped:
    """A logits processor for HF generate (run greedy) that picks each row's token with ``sample_tokens``: the
    tempered, top-k/top-p distribution and the random draws of the grouped engine."""

    def __init__(self, sampling: SamplingConfig, generators, suppress):
        self.sampling, self.generators, self.suppress = sampling, generators, suppress

    def __call__(self, input_ids, scores):
        tokens, _ = sample_tokens(scores, self.sampling, self.generators, self.suppress)
        return torch.full_like(scores, float("-inf")).scatter(-1, tokens[:, None], 0.0)


class _PenaliseRepeats:
    """A logits processor for HF generate: ``repetition_penalised`` over the prompt's real tokens (not its left
    padding, which HF's own processor would count) and the tokens generated so far."""

    def __init__(self, prompt_mask: torch.Tensor, penalty: float):
        self.prompt_mask, self.penalty = prompt_mask, penalty

    def __call__(self, input_ids, scores):
        mask = torch.nn.functional.pad(self.prompt_mask, (0, input_ids.shape[1] - self.prompt_mask.shape[1]), value=1)
        return repetition_penalised(scores, seen_tokens(input_ids, mask, scores.shape[-1]), self.penalty)


def _hf_generate(model, prompts, sizes, sampling, *, tokenizer, eos_ids, pad_id, generators, clock=None,
                 synced=False, **_) -> Rollout:
    """Plain HF generate on the repeated batch (prompt and video copied per sample): the A/B baseline. The grouped
    decoder's settings (chunked prefill, decode step) do not apply; ``synced``: generate's ``synced_gpus``."""
    device = prompts["input_ids"].device
    previous = text_config(model)._attn_implementation
    set_text_attention(model, "sdpa")
    use_qwen_positions(unwrap(model))  # HF's own M-RoPE ids after a video, placed as the grouped engine places them
    empty = prompts["input_ids"].new_zeros(sum(sizes), 0)
    batch = repeated_inputs(model, prompts, empty, empty, sizes)
    kwargs = dict(max_new_tokens=sampling.max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                  output_logits=True, return_dict_in_generate=True, pad_token_id=pad_id, eos_token_id=eos_ids or None)
    suppress_ids = vision_token_ids(model) if sampling.suppress_token_ids is None else list(sampling.suppress_token_ids)
    from transformers import LogitsProcessorList

    processors = LogitsProcessorList()
    if sampling.repetition_penalty != 1.0:
        processors.append(_PenaliseRepeats(batch["attention_mask"], sampling.repetition_penalty))
    if sampling.temperature > 0:
        # The grouped engine's own sampler, fed HF's logits: with the same seed both engines draw the same tokens
        # (their logits agree up to float rounding), so A/B runs differ only by the layout, not by the dice.
        suppress = torch.tensor(suppress_ids, device=device, dtype=torch.long) if suppress_ids else None
        processors.append(_SampleLikeGrouped(sampling, generators, suppress))
    elif suppress_ids:
        kwargs.update(suppress_tokens=suppress_ids)
    if processors:
        kwargs["logits_processor"] = processors
    if sampling.stop_strings:
        kwargs.update(stop_strings=list(sampling.stop_strings), tokenizer=tokenizer)
    kwargs["synced_gpus"] = bool(synced)  # forwards that are collectives: every rank steps until all are done
    clock = clock if clock is not None else PartClock(device)
    try:
        out = model.generate(**batch, **kwargs)  # prefill and decode in one call: timed as the decode
    finally:
        set_text_attention(model, previous)
    clock.lap("decode")
    prompt_width = batch["input_ids"].shape[1]
    ids = out.sequences[:, prompt_width:]
    raw = torch.stack(out.logits, dim=1).float()
    scaled = raw / sampling.temperature if sampling.temperature > 0 else raw
    logprobs = torch.log_softmax(scaled, dim=-1).gather(-1, ids[..., None]).squeeze(-1)
    finish = _Finish(ids.shape[0], eos_ids, sampling.stop_strings, tokenizer, ids.shape[1], device)
    rows = torch.arange(ids.shape[0], device=device)
    for step in range(ids.shape[1]):
        finish.record(rows, ids[:, step], step)
    mask = torch.nn.functional.pad(finish.mask(), (0, ids.shape[1] - int(finish.end.max())))
    return Rollout(
        completion_ids=torch.where(mask.bool(), ids, torch.full_like(ids, pad_id)),
        completion_mask=mask,
        logprobs=logprobs * mask,
        group_sizes=sizes,
        stop_reasons=finish.reasons(),
        prefill_tokens=int(batch["attention_mask"].sum()),
        prompt_tokens=int(prompts["attention_mask"].sum()),
        parts={**clock.seconds(), "decode_steps": float(ids.shape[1])},
    )


DECODERS = {"grouped": _grouped_generate, "hf": _hf_generate}  # generate_groups(engine=...)


def summed_parts(rollouts: Sequence[Rollout]) -> dict:
    """Several rollouts' parts (a step's draws) added up; a decode step's bytes and whether a graph replayed are
    the largest."""
    out: dict = {}
    for r in rollouts:
        for key, value in r.parts.items():
            out[key] = max(out.get(key, 0.0), value) if key in ("decode_bytes_per_step", "graph_replayed",
                                                                "engine_above_gib") else \
                out.get(key, 0.0) + value
    return out
