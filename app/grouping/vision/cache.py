"""A frozen vision tower's work done once per media item, however many forwards of a step see that item.

Within a GRPO step the same video goes through the tower for the rollout's prefill, the reference forward, the
old-policy forward (mu > 1) and the policy forward (and G times over in the repeated layout). When nothing in the
tower trains, every one of those passes computes the same numbers. ``VisionCache`` keeps them, one entry per media
item (image or video), keyed by the item's processed pixels (a BLAKE2 digest of their bytes), its grid and the
dtypes. What an entry holds depends on what trains (``plan_for``):

- ``outputs`` (tower and projector frozen, the usual LoRA set-up): the tower's output for the item (merged
  embeddings, and Qwen3-VL's deepstack features). A forward whose items are all cached never calls the tower.
- ``blocks`` (tower frozen, projector trains): the outputs of the vision blocks the projector reads (the last block,
  and Qwen3-VL's deepstack layers). The tower's forward still runs once, but its blocks hand back the stored values
  (the others pass their input through) and the projector computes on them with gradient.
- ``count`` (the tower trains): the model's own batched call; the items are only counted.

Exactness by construction: with a frozen tower, every item is encoded in a tower pass of its own, with the cache on
or off (``store``: whether the items are kept for later calls), so an item's numbers never depend on what else is in
the batch. (They would otherwise: a GEMM's rows are not batch-invariant, e.g. fewer than 12 rows take another CPU
kernel, and cuBLAS picks tiles by shape.) Cached or not, the language model receives the same bits, so log-probs and
gradients are bitwise equal with ``forward.vision_cache`` on and off. Qwen's towers attend within an item (frames,
windows), so one pass per item computes exactly what the model's own batched call means.

Long videos: with ``chunk_frames`` = F an item pass is cut into passes of F temporal patches (the outputs, or the
recorded blocks, concatenated in order): the tower's activations are one chunk's. Exact for the same reason (no
temporal patch attends to another); ``passes`` counts the cut passes, so ZeRO-3 ranks still agree. How an item goes
through the tower (chunked passes, recorded and served blocks, the dummy item) is ``app.grouping.vision.passes``;
this module decides what is kept, for how long, and counts it.

The cache is installed by replacing the tower module's ``forward`` on the instance (``attach``): it works on
transformers versions with and without ``mm_encoder_outputs`` and needs no change to the model's own forward.
``calls_needed`` says how many tower passes a forward will make per modality, so that ZeRO-3 ranks agree on them
(``aligned_vision_calls`` pads with dummy passes, which bypass the cache).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import weakref
from collections.abc import Mapping

import torch

from app.grouping.media import distinct, local_share, share_of
from app.grouping.modules import patch_instance, unpatch_instance, unwrap
from app.grouping.vision.passes import (
    blocks_serving,
    cached_blocks,
    concat,
    dummy_vision_input,
    encode_item,
    item_passes,
)

ATTRIBUTE = "_prefix_grpo_vision_cache"  # set on the tower module by ``attach``
VISION_CACHE_SETTINGS = ("step", "run", "off")  # forward.vision_cache
PROJECTORS = ("merger", "deepstack_merger_list")  # the modules after the blocks (Qwen2/2.5/3-VL)
PLANS = ("outputs", "blocks", "count")  # what is cached; "count": nothing, the tower's work is only counted
_INPUTS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}


def tower_of(model):
    """The vision tower of a (wrapped) Qwen-VL model, or None for a text model."""
    inner = getattr(unwrap(model), "model", None)
    return getattr(inner, "visual", None)


def plan_for(visual) -> str:
    """What can be cached for this tower as it trains: ``outputs`` when nothing in it trains, ``blocks`` when only
    the projector (merger, deepstack mergers) trains, ``count`` when anything before the blocks' outputs trains."""
    trainable = [name for name, p in visual.named_parameters() if p.requires_grad]
    if not trainable:
        return "outputs"
    if all(name.split(".")[0] in PROJECTORS for name in trainable):
        return "blocks"
    return "count"


class VisionCache:
    """Per-item tower results shared by every forward that sees the item, until ``clear``. See the module doc."""

    def __init__(self, plan: str = "outputs", store: bool = True, chunk_frames: int = 0, keep_bytes: int = 0,
                 share: tuple[int, int] | None = None):
        if plan not in PLANS:
            raise ValueError(f"unknown vision cache plan {plan!r}; expected one of {PLANS}")
        if chunk_frames < 0:
            raise ValueError(f"chunk_frames must be >= 0, got {chunk_frames}")
        self.plan = plan
        self.store = store  # keep items for later calls (forward.vision_cache=step); else each call encodes its own
        self.chunk_frames = chunk_frames  # temporal patches per item pass; 0: an item in one pass
        # > 0: entries outlive ``clear`` (forward.vision_cache=run), the least recently used dropped past this size
        self.keep_bytes = keep_bytes
        # (rank, S) under sequence parallelism: the tower's calls are this rank's share of each item
        # (``passes.local_share``, what ``vision.frames`` encodes): counted, kept and served as such
        self.share = share
        self.entries: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self.encoded = 0  # items the tower computed
        self.chunks = 0  # tower passes those took (more than items with ``chunk_frames``)
        self.served = 0  # items served from the cache
        self.seen: set[tuple] = set()  # distinct items since ``clear``
        self.paused = False
        self._bypass = False
        self._dummy = False
        self.expect: collections.deque | None = None  # item passes agreed for this rank's coming tower calls
        self._keys: dict[int, tuple] = {}  # id(pixels) -> (weak reference, version, item keys)

    # ---- the step's bookkeeping --------------------------------------------------------------------------------
    def clear(self) -> dict[str, float]:
        """Forget every entry (with ``keep_bytes``: the least recently used past that size); returns the counts
        since the last clear."""
        counts = self.counts()
        if self.keep_bytes:
            held = {key: _nbytes(entry) for key, entry in self.entries.items()}
            total = sum(held.values())
            while self.entries and total > self.keep_bytes:
                key, _ = self.entries.popitem(last=False)
                total -= held[key]
        else:
            self.entries.clear()
        self.seen.clear()
        self._keys.clear()
        self.encoded = self.served = self.chunks = 0
        return counts

    def counts(self) -> dict[str, float]:
        return {"tower_items": float(self.encoded), "tower_passes": float(self.chunks), "cache_hits": float(self.served),
                "items": float(len(self.seen))}

    @contextlib.contextmanager
    def _setting(self, name: str, value):
        was = getattr(self, name)
        setattr(self, name, value)
        try:
            yield
        finally:
            setattr(self, name, was)

    def pause(self):
        """Within the block nothing is stored, served or counted: each call encodes its own items (item by item,
        frame-chunked, as with ``forward.vision_cache=off``)."""
        return self._setting("paused", True)

    def bypass(self):
        """Within the block a tower call runs the tower itself (an item pass, a dummy pass)."""
        return self._setting("_bypass", True)

    # ---- keys ----------------------------------------------------------------------------------------------------
    def item_keys(self, pixels: torch.Tensor, grid: torch.Tensor, dtype: torch.dtype) -> tuple:
        """One key per item of a tower call: a digest of the item's pixel rows, its grid, the dtypes. Remembered
        per pixel tensor (by weak reference, so a new tensor at a freed address is hashed anew)."""
        memo = self._keys.get(id(pixels))
        if memo is not None and memo[0]() is pixels and memo[1] == (pixels._version, str(dtype)):
            return memo[2]
        rows = pixels.detach().contiguous()
        if rows.device.type != "cpu":
            rows = rows.cpu()
        data = rows.view(torch.uint8).reshape(rows.shape[0], -1)
        keys, start = [], 0
        for t, h, w in grid.tolist():
            count = t * h * w
            digest = hashlib.blake2b(data[start : start + count].numpy(), digest_size=16).hexdigest()
            keys.append((digest, (t, h, w), str(pixels.dtype), str(dtype)))
            start += count
        if start != pixels.shape[0]:
            raise ValueError(f"vision input of {pixels.shape[0]} patch rows, but its grid {grid.tolist()} makes "
                             f"{start}")
        keys = tuple(keys)
        self._keys[id(pixels)] = (weakref.ref(pixels), (pixels._version, str(dtype)), keys)
        return keys

    def calls_needed(self, visual, prompts: Mapping) -> tuple[str, ...]:
        """What a forward of ``prompts`` asks of the tower, per modality in the model's order: the modality once
        for the model's own call of the tower, then once more per item pass that call makes (``passes``)."""
        out: list[str] = []
        for modality, (pixel_key, _) in _INPUTS.items():
            if prompts.get(pixel_key) is not None:
                pixels, grid = distinct(prompts, pixel_key)  # each item once (a family's video is held once)
                if self.share is not None:  # what this rank's frame-split call will ask for
                    local = local_share(pixels, grid, *self.share, split_time=modality == "video",
                                        merge=visual.spatial_merge_size, held=share_of(prompts, pixel_key) is not None)
                    pixels, grid = local[:2] if local is not None else dummy_vision_input(visual)
                    pixels = pixels.to(_dtype(visual))
                out += [modality] * (1 + self.passes(visual, pixels, grid))
        return tuple(out)

    @property
    def item_by_item(self) -> bool:
        """Whether the tower's calls encode item by item (a frozen tower) or run as the model's own (it trains)."""
        return self.plan != "count"

    def _serves(self) -> bool:
        return self.store and not self.paused

    def item_passes(self, frames: int) -> int:
        """Tower passes one item of ``frames`` temporal patches takes (``chunk_frames`` at a time)."""
        return item_passes(frames, self.chunk_frames)

    # ---- the tower's forward, through the cache ------------------------------------------------------------------
    def passes(self, visual, pixels: torch.Tensor, grid: torch.Tensor) -> int:
        """Item passes a tower call with these items makes inside itself: per distinct item not cached yet, one,
        or one per ``chunk_frames`` temporal patches (0 when the call is the model's own batched pass: ``count``)."""
        if not self.item_by_item:
            return 0
        keys = self.item_keys(pixels, grid, _dtype(visual))
        return sum(self.item_passes(k[1][0]) for k in set(keys) if not (self._serves() and k in self.entries))

    def aligned(self, passes: list[int] | None):
        """Within the block, the k-th tower call of this rank makes ``passes[k]`` item passes, padding with passes
        on a dummy item (ZeRO-3: every rank then calls the same modules in the same order)."""
        return self._setting("expect", collections.deque(passes) if passes is not None else None)

    def dummy_call(self):
        """A tower call of a rank that has no item of this modality (``aligned_vision_calls``)."""
        return self._setting("_dummy", True)

    def forward(self, visual, original, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs):
        if self._bypass or not self.item_by_item:
            if not (self._bypass or self._dummy or self.paused):  # the model's own call: counted
                keys = self.item_keys(hidden_states, grid_thw, _dtype(visual))
                self.encoded += len(keys)
                self.chunks += len(keys)
                self.seen.update(keys)
            return original(hidden_states, grid_thw=grid_thw, **kwargs)
        pad = self.expect.popleft() if self.expect else None
        if self._dummy:
            return self._dummy_call(visual, original, pad or 0, kwargs)
        keys = self.item_keys(hidden_states, grid_thw, _dtype(visual))
        counting = not self.paused
        if counting:
            self.seen.update(keys)
        entries = self.entries if self._serves() else {}
        starts = [0, *torch.tensor([t * h * w for t, h, w in grid_thw.tolist()]).cumsum(0).tolist()]
        made = 0
        for i, key in enumerate(keys):
            if key in entries:
                self.served += counting
                if entries is self.entries:
                    self.entries.move_to_end(key)  # recently used: dropped last (forward.vision_cache=run)
                continue
            rows = hidden_states[starts[i] : starts[i + 1]]
            entries[key] = self._encode(visual, rows, grid_thw[i : i + 1], kwargs)
            self.encoded += counting
            made += self.item_passes(key[1][0])
        if counting:
            self.chunks += made
        if pad is not None:
            if made > pad:
                raise RuntimeError(f"this rank's vision call made {made} item passes, more than the {pad} agreed "
                                   "over ranks")
            self._dummy_passes(visual, pad - made, kwargs)
        stored = [entries[k] for k in keys]
        if self.plan == "outputs":
            return concat(stored)
        served = {b: torch.cat([entry[b] for entry in stored]) for b in cached_blocks(visual)}
        with blocks_serving(visual, served):
            return original(hidden_states, grid_thw=grid_thw, **kwargs)

    def _encode(self, visual, rows: torch.Tensor, grid: torch.Tensor, kwargs: dict):
        with self.bypass():
            return encode_item(visual, rows, grid, kwargs, plan=self.plan, chunk_frames=self.chunk_frames)

    def _dummy_passes(self, visual, count: int, kwargs: dict):
        output = None
        pixels, grid = dummy_vision_input(visual)
        for _ in range(count):
            with torch.no_grad(), self.bypass():
                output = visual(pixels, grid_thw=grid, **kwargs)
        return output

    def _dummy_call(self, visual, original, passes: int, kwargs: dict):
        """The tower call of a rank without this modality: the agreed item passes on a dummy item, and for
        ``blocks`` the live pass (zeros served for the blocks, so the projector runs and gets a zero gradient)."""
        output = self._dummy_passes(visual, passes, kwargs)
        if self.plan == "outputs":
            return output
        pixels, grid = dummy_vision_input(visual)
        width = getattr(visual.config, "embed_dim", None) or visual.config.hidden_size  # Qwen2-VL: embed_dim
        zeros = torch.zeros(pixels.shape[0], width, device=pixels.device, dtype=_dtype(visual))
        with blocks_serving(visual, {b: zeros for b in cached_blocks(visual)}):
            return original(pixels, grid_thw=grid, **kwargs)


def _nbytes(entry) -> int:
    """Bytes of the tensors an entry holds (a tensor, or tuples / lists / dicts of them)."""
    if isinstance(entry, torch.Tensor):
        return entry.numel() * entry.element_size()
    if isinstance(entry, Mapping):
        return sum(_nbytes(v) for v in entry.values())
    if isinstance(entry, (list, tuple)):
        return sum(_nbytes(v) for v in entry)
    return 0


def _dtype(visual) -> torch.dtype:
    for param in visual.parameters():
        return param.dtype
    return torch.float32


def attach(model, cache: VisionCache) -> bool:
    """Route the tower of ``model`` through ``cache`` (until ``detach``); False for a model without a tower."""
    visual = tower_of(model)
    if visual is None:
        return False
    detach(model)
    original = visual.forward  # the bound method of the class
    setattr(visual, ATTRIBUTE, cache)

    def forward(hidden_states, grid_thw=None, **kwargs):
        return cache.forward(visual, original, hidden_states, grid_thw, **kwargs)

    patch_instance(visual, "forward", forward)
    return True


def detach(model) -> None:
    visual = tower_of(model)
    if visual is not None and hasattr(visual, ATTRIBUTE):
        delattr(visual, ATTRIBUTE)
        unpatch_instance(visual, "forward")


def cache_of(model) -> VisionCache | None:
    visual = tower_of(model)
    return getattr(visual, ATTRIBUTE, None) if visual is not None else None


def install(model, setting: str, chunk_frames: int = 0, keep_gib: float = 0.0,
            share: tuple[int, int] | None = None) -> VisionCache | None:
    """The cache for this policy as ``forward.vision_cache`` says (``step``: items kept for the step; ``run``: kept
    across steps too, at most ``keep_gib`` GiB between them; ``off``: each call encodes its own items, the same
    way), attached to its tower; None for a text model. ``chunk_frames``: temporal patches per tower pass
    (``forward.vision_chunk_frames``). ``share``: (rank, S) under sequence parallelism (each rank keeps the
    output of its share of the frames)."""
    visual = tower_of(model)
    if visual is None:
        return None
    if setting not in VISION_CACHE_SETTINGS:
        raise ValueError(f"unknown vision cache setting {setting!r}; expected one of {VISION_CACHE_SETTINGS}")
    keep = max(1, int(keep_gib * (1 << 30))) if setting == "run" else 0
    cache = VisionCache(plan_for(visual), store=setting in ("step", "run"), chunk_frames=chunk_frames,
                        keep_bytes=keep, share=share if share and share[1] > 1 else None)
    attach(model, cache)
    return cache
