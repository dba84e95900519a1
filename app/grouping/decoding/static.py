"""What a run keeps across rollouts for its static-shape decode step (``StaticSteps``), so the step is captured as a
CUDA graph (``graph``) or compiled (``compiled``) once per shape bucket and replayed in every later rollout, not
made anew each rollout.

A bucket (``bucket_key``) is what fixes every tensor the step reads: the samples and their groups, the prompts'
K/V capacity (the widest prompt rounded up to ``PREFIX_BUCKET`` positions: shorter prompts are left-padded into it,
the padding hidden by the key bias), the shared roots' layout and capacity, the own-K/V capacity, dtype and device.
Its ``KeptStep`` holds the grouped KV cache, the positions and the input tokens; each rollout copies its prefill into
them (``KeptStep.load``) and the captured graph (or compiled step) reads the same addresses again. The weights must
stay where they were: their addresses are recorded at capture and checked before every replay (a move, e.g. a ZeRO-3
gather that put them elsewhere, captures again and says so). A capture runs inside ``guard`` (the trainer pauses
its data-prefetch threads: no other thread works on the device while the graph records).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

log = logging.getLogger("app.grouping.decoding.static")
PREFIX_BUCKET = 512  # prompt K/V capacity is the widest prompt rounded up to this (one graph per bucket)
KEPT_BUCKETS = 4  # shape buckets kept at once (the least recently used goes, with its graph's memory)
DECODE_MODES = ("auto", "eager", "static", "graph", "compiled")


def decode_mode(requested: str, device, synced: bool) -> str:
    """The decode step's form: ``auto`` is ``graph`` on CUDA unless the ranks step in lock step under ZeRO-3
    (``synced``: DeepSpeed's hooks gather parameters in every forward, which a graph cannot replay), else
    ``eager``. ``static`` is the graph's static-shape step run eagerly (any device; what tests compare);
    ``compiled`` the static step through torch.compile (norms, rotary, activations and adds fused), then on CUDA
    captured as a graph too."""
    if requested not in DECODE_MODES:
        raise ValueError(f"unknown decode mode {requested!r}; expected one of {DECODE_MODES}")
    on_cuda = torch.device(device).type == "cuda"
    if requested == "auto":
        return "graph" if on_cuda and not synced else "eager"
    if requested in ("static", "graph", "compiled") and synced:
        raise ValueError(f"decode mode {requested!r} cannot run with ranks in lock step under ZeRO-3 hooks "
                         "(rollout.zero3_gather=per_step); use rollout.decode=eager or zero3_gather=full")
    if requested == "graph" and not on_cuda:
        raise ValueError("decode mode 'graph' captures CUDA graphs and needs a CUDA device; use static or eager")
    return requested


def capacity(width: int) -> int:
    return max(PREFIX_BUCKET, -(-width // PREFIX_BUCKET) * PREFIX_BUCKET)


def padded_left(tensor: torch.Tensor, width: int, dim: int, fill=0) -> torch.Tensor:
    """``tensor`` left-padded along ``dim`` to ``width`` with ``fill``."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_full(shape, fill), tensor], dim=dim)


def bucket_key(past_layers, mask: torch.Tensor, group_sizes, max_new_tokens: int, roots) -> tuple:
    """What fixes every tensor of the static step (see the module doc)."""
    from app.grouping.decoding.cache import is_recurrent_layer

    keys = next(layer.keys for layer in past_layers if not is_recurrent_layer(layer))
    roots_key = None
    if roots is not None:
        roots_key = (tuple(roots.group_root.tolist()), capacity(roots.mask.shape[1]))
    return (tuple(int(g) for g in group_sizes), capacity(mask.shape[1]), len(past_layers), tuple(keys.shape[1:2]),
            keys.shape[-1], keys.dtype, str(keys.device), max_new_tokens, roots_key)


def weight_pointers(model) -> tuple:
    return tuple(p.data_ptr() for p in model.parameters())


@dataclass
class KeptStep:
    """One bucket's static decode state: the cache, the last prompt positions and the step's input tokens, and the
    step made once: a CUDA graph (``graph``, its output ``logits``) or a compiled function (``compiled``)."""

    key: tuple
    cache: object  # GroupedKVCache(static=True) over buffers at the bucket's capacity
    last_position: torch.Tensor  # [axes, N]
    tokens: torch.Tensor  # [N]
    graph: object = None
    logits: torch.Tensor | None = None
    compiled: object = None
    pointers: tuple = ()
    uses: int = 0
    notes: dict = field(default_factory=dict)

    def load(self, past, mask: torch.Tensor, roots, last_position: torch.Tensor) -> None:
        """This rollout's prefill into the kept buffers (same shapes: left-padded to the bucket's capacity)."""
        from app.grouping.decoding.cache import prompt_states_of

        cache = self.cache
        width = cache.first_keys.shape[2]
        for pair, layer in zip(cache.prefix, past.layers):
            if pair is not None:
                pair[0].copy_(padded_left(layer.keys, width, 2))
                pair[1].copy_(padded_left(layer.values, width, 2))
        if cache.recurrent:  # each sample's slot gets its prompt's GDN states again
            cache.recurrent.load(prompt_states_of(past, past.layers), cache.group_of_sample)
        bias = torch.zeros(mask.shape[0], width, dtype=torch.float32, device=mask.device)
        bias = bias.masked_fill(~padded_left(mask.bool(), width, 1, False), float("-inf"))
        cache.prefix_bias.copy_(bias[:, None, None, :])
        cache.prefix_start.copy_(width - mask.sum(1))  # where each prompt's keys begin (the varlen kernel's)
        if roots is not None:
            kept = cache.roots
            rwidth = kept.keys[0].shape[2]
            for target, source in zip(kept.keys + kept.values, roots.keys + roots.values):
                if target is not None:
                    target.copy_(padded_left(source, rwidth, 2))
            rbias = torch.zeros(roots.mask.shape[0], rwidth, dtype=torch.float32, device=mask.device)
            kept.bias.copy_(rbias.masked_fill(~padded_left(roots.mask.bool(), rwidth, 1, False),
                                              float("-inf"))[:, None, None, :])
            kept.start.copy_(rwidth - roots.mask.sum(1))
        cache.written.zero_()
        self.last_position.copy_(last_position)
        self.uses += 1


def _padded_cache(past, mask: torch.Tensor, roots):
    """The prefill's K/V (and roots) left-padded to the bucket's capacity, as new tensors the kept step owns (a
    GDN layer's states as they are: the cache copies them per sample)."""
    from app.grouping.decoding.cache import is_recurrent_layer, prompt_states_of
    from app.grouping.decoding.shared import SharedRoots

    width = capacity(mask.shape[1])
    layers = [layer if is_recurrent_layer(layer) else
              SimpleNamespace(keys=padded_left(layer.keys, width, 2).contiguous(),
                              values=padded_left(layer.values, width, 2).contiguous()) for layer in past.layers]
    padded_mask = padded_left(mask, width, 1, 0)
    kept_roots = None
    if roots is not None:
        rwidth = capacity(roots.mask.shape[1])
        rmask = padded_left(roots.mask, rwidth, 1, 0)
        kept_roots = SharedRoots([None if k is None else padded_left(k, rwidth, 2).contiguous() for k in roots.keys],
                                 [None if v is None else padded_left(v, rwidth, 2).contiguous() for v in roots.values],
                                 rmask, roots.group_root.clone(), states=roots.states)
    return SimpleNamespace(layers=layers, recurrent=prompt_states_of(past, past.layers)), padded_mask, kept_roots


class StaticSteps:
    """Per shape bucket a ``KeptStep`` (the ``KEPT_BUCKETS`` most recent), and what the run's rollouts did with
    them: captures and compilations, replays of a kept step, recompiles, and each reason a step ran eagerly (logged
    once). ``guard``: a context-manager factory the capture runs inside (the trainer's: prefetch paused)."""

    def __init__(self, guard=None):
        self.guard = guard or nullcontext
        self.kept: OrderedDict[tuple, KeptStep] = OrderedDict()
        self.stats = {"captures": 0, "compiles": 0, "replays": 0, "recaptures": 0}
        self.reasons: set[str] = set()

    def claim(self, past, mask, group_sizes, max_new_tokens, roots, last_position, *, make_cache):
        """The bucket's kept step with this rollout's prefill loaded, and whether it was made now. ``past``: the
        prefill's cache (its ``layers``); ``make_cache``: the grouped KV cache's class (``decode.GroupedKVCache``),
        built over the bucket's buffers."""
        key = bucket_key(past.layers, mask, group_sizes, max_new_tokens, roots)
        kept = self.kept.pop(key, None)
        fresh = kept is None
        if fresh:
            padded, padded_mask, kept_roots = _padded_cache(past, mask, roots)
            cache = make_cache(padded, padded_mask, group_sizes, max_new_tokens, static=True, roots=kept_roots)
            cache.prompt_width = mask.shape[1]
            if cache.prefix_bias is None:  # nothing padded at all: a bias anyway (later prompts may be shorter)
                cache.prefix_bias = torch.zeros(padded_mask.shape[0], 1, 1, padded_mask.shape[1],
                                                device=padded_mask.device)
            if kept_roots is not None and kept_roots.bias is None:
                kept_roots.bias = torch.zeros(kept_roots.mask.shape[0], 1, 1, kept_roots.mask.shape[1],
                                              device=padded_mask.device)
            kept = KeptStep(key, cache, last_position.clone(), torch.zeros(last_position.shape[1], dtype=torch.long,
                                                                           device=last_position.device))
            kept.uses = 1
        else:
            kept.cache.prompt_width = mask.shape[1]
            kept.load(past, mask, roots, last_position)
        self.kept[key] = kept
        while len(self.kept) > KEPT_BUCKETS:
            self.kept.popitem(last=False)
        return kept, fresh

    def eager_because(self, reason: str) -> None:
        """A rollout steps eagerly: the reason logged the first time it is seen."""
        if reason not in self.reasons:
            self.reasons.add(reason)
            log.warning("decode steps run eagerly: %s", reason)

    def take(self) -> dict:
        out = dict(self.stats)
        for key in self.stats:
            self.stats[key] = 0
        return out


def static_step(model, cache, last_position: torch.Tensor, tokens: torch.Tensor, plan_kwarg: str,
                routed: dict | None = None) -> torch.Tensor:
    """One static-shape decode step on ``tokens``: only device tensors change between steps (the step number lives
    in ``cache.written``), so a CUDA graph of it replays every later step and a compiled one never re-traces.
    ``routed``: the routing record's keyword argument (``routing.DecodeRouting.static_plan``: a fixed buffer)."""
    cache.begin_step()
    positions = (last_position + 1 + cache.written)[:, :, None]  # [axes, N, 1]
    out = model(input_ids=tokens[:, None], attention_mask=None,
                position_ids=positions if positions.shape[0] > 1 else positions[0],
                past_key_values=cache, use_cache=True, **{plan_kwarg: cache}, **(routed or {}))
    cache.end_step()
    return out.logits[:, -1]


def step_bytes(model, cache) -> float:
    """Bytes one decode step reads: the weights, the prompts' (and shared roots') K/V, and the samples' own K/V (at
    half the completion length on average: what a whole rollout's steps read, per step)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    prefix = sum(pair[0].numel() * pair[0].element_size() * 2 for pair in cache.prefix if pair is not None)
    roots = 0 if cache.roots is None else sum(k.numel() * k.element_size() * 2 for k in cache.roots.keys
                                              if k is not None)
    keys = cache.first_keys
    samples, heads = len(cache.group_of_sample), keys.shape[1]
    own = samples * heads * keys.shape[3] * keys.element_size() * 2 * len(cache.attention_layers)
    # a GDN layer's state per sample, read and written each step
    states = 2 * cache.recurrent.nbytes()
    return float(weights + prefix + roots + own * cache.max_new_tokens / 2 + states)


def capturable(cache) -> bool:
    """Whether the step can be captured as a CUDA graph (its tensors on a CUDA device)."""
    return cache.first_keys.is_cuda


def capture_graph(run, guard):
    """``run`` recorded as a CUDA graph inside ``guard()``: (graph, its output). thread_local mode: only this thread's
    CUDA calls are held to capture's rules; the guard keeps the trainer's other threads off the device meanwhile."""
    graph = torch.cuda.CUDAGraph()
    with guard(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
        logits = run()
    return graph, logits


def dynamo_frames() -> int:
    """Frames torch.compile has compiled in this process so far (recompiles included)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["frames"]["ok"])
    except (ImportError, KeyError):
        return 0


def compiler_cache_dir() -> str:
    """Where inductor keeps compiled kernels between launches (TORCHINDUCTOR_CACHE_DIR, else its default)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return str(cache_dir())
    except ImportError:
        import os
        import tempfile

        return os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "torchinductor"))
