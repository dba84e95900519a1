"""Video-R1 records: reading, validation, prompts, and a resumable per-rank stream of encoded prompts.

Fields: ``problem_id``, ``problem``, ``data_type`` (image | video), ``problem_type``, ``options``, ``solution``
(``<answer>X</answer>``), ``path`` (relative to the data root), ``data_source``. Bad records are skipped with a
warning that names the file, the line and the reason; the run fails only when more than ``max_skip_fraction`` of
the records are unusable. A video is never substituted.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from app.data.prompts import PROMPT_TEMPLATES, encode_prompts, question_text, system_message
from app.data.video import FRAME_FOLDER_SAMPLING, SettingError, VideoDecodeError, frame_files, video_element
from app.answers.problems import PROBLEM_TYPES
from app.answers.grounding import check_grounding_record

log = logging.getLogger(__name__)
SKIP_EXAMPLES = 5  # skipped records named on the console (per rank at run time, rank 0 at load); the rest in files

REQUIRED_FIELDS = ("problem", "problem_type", "solution")

class DataError(ValueError):
    """Unusable data: too many bad records, or a file that cannot be read at all."""


@dataclass
class Skipped:
    where: str  # "file:line (problem_id)"
    reason: str


def read_records(path: str | Path) -> tuple[list[dict], list[Skipped]]:
    """Read JSON (a list) or JSONL. Malformed lines are reported, not fatal."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    text = path.read_text(encoding="utf-8")
    records, skipped = [], []
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}: not valid JSON ({error})") from error
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json data file must hold a list of records")
        for i, record in enumerate(data):
            if isinstance(record, dict):
                records.append({**record, "_where": f"{path}[{i}]"})
            else:
                skipped.append(Skipped(f"{path}[{i}]", "record is not a JSON object"))
        return records, skipped
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            skipped.append(Skipped(f"{path}:{number}", f"malformed JSON line ({error.msg})"))
            continue
        if not isinstance(record, dict):
            skipped.append(Skipped(f"{path}:{number}", "line is not a JSON object"))
            continue
        records.append({**record, "_where": f"{path}:{number}"})
    return records, skipped


def outside_root(data_root: Path, relative: str) -> bool:
    """True when ``relative`` (absolute, or with ``..``) names a file outside ``data_root``. Lexical: symbolic links
    placed inside the root are followed (whoever put them there chose to)."""
    root = os.path.normpath(os.path.abspath(data_root))
    target = os.path.normpath(os.path.join(root, relative))
    return os.path.commonpath([root, target]) != root


VIDEO_SUFFIXES = {".mp4", ".avi", ".mov", ".mkv", ".webm", ".flv", ".m4v", ".mpg", ".mpeg", ".wmv", ".3gp"}
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def media_paths(record: dict, data_root: Path) -> list[Path]:
    """The record's media files in order: ``path`` is one string or a list of them (multi-video / multi-image
    records). A path with a leading "/" that does not exist as given but does under the data root is read as
    root-relative (re-hosted benchmark files write "/MMVU/videos/..." meaning under the root)."""
    raw = record["path"]
    out = []
    for item in raw if isinstance(raw, list) else [raw]:
        path = data_root / item
        if item.startswith("/") and not path.exists() and (data_root / item.lstrip("/")).exists():
            path = data_root / item.lstrip("/")
        out.append(path)
    return out


def infer_data_type(paths: list[Path]) -> str | None:
    """video or image from the files' suffixes (all alike; a folder is a frame-folder video), else None."""
    kinds = {"video" if p.is_dir() or p.suffix.lower() in VIDEO_SUFFIXES
             else "image" if p.suffix.lower() in IMAGE_SUFFIXES else None for p in paths}
    return kinds.pop() if len(kinds) == 1 else None


def check_record(record: dict, data_root: Path, confine_to_root: bool = True) -> str | None:
    """The reason a record is unusable, or None. A record with a ``path`` but no ``data_type`` gets the type its
    files' suffixes say (written into the record), or is refused: never trained as text by accident."""
    for name in REQUIRED_FIELDS:
        if not isinstance(record.get(name), str) or not record[name].strip():
            return f"missing or empty field '{name}'"
    if record["problem_type"] not in PROBLEM_TYPES:
        return f"unknown problem_type {record['problem_type']!r} (known: {', '.join(PROBLEM_TYPES)})"
    reason = check_grounding_record(record)
    if reason:
        return reason
    data_type = record.get("data_type")
    if data_type not in (None, "", "image", "video", "text"):
        return f"unknown data_type {data_type!r} (image, video or text)"
    raw = record.get("path")
    if raw not in (None, "", []) and not (isinstance(raw, str) or (isinstance(raw, list) and raw
                                                                     and all(isinstance(p, str) and p for p in raw))):
        return f"field 'path' must be a string or a list of strings, got {raw!r}"
    paths = media_paths(record, data_root) if raw else []
    if not data_type and raw:
        data_type = infer_data_type(paths)
        if data_type is None:
            return f"no data_type and its path {raw!r} does not say video or image (set data_type)"
        record["data_type"] = data_type
    if data_type in ("image", "video"):
        if not raw:
            return f"data_type {data_type} but no 'path'"
        for path in paths:
            if confine_to_root and outside_root(data_root, str(path)):
                return (f"path outside the data root: {str(path)!r} leaves {data_root} (data.confine_to_root=false "
                        "allows it)")
            if path.is_dir():
                if data_type == "image":
                    return f"image path is a directory: {path}"
                if len(frame_files(path)) < 2:
                    return (f"frame folder with {len(frame_files(path))} image file(s) (a video needs at least 2): "
                            f"{path}")
                continue
            if not path.is_file():
                return f"{data_type} file not found: {path}"
    sampling = record.get("frame_sampling")
    if sampling is not None and sampling not in FRAME_FOLDER_SAMPLING:
        return f"unknown frame_sampling {sampling!r} (known: {', '.join(FRAME_FOLDER_SAMPLING)})"
    if sampling is not None and not (data_type == "video" and paths and all(p.is_dir() for p in paths)):
        return f"frame_sampling {sampling!r} applies to frame folders only; this record's path is {raw!r}"
    options = record.get("options")
    if options is not None and not isinstance(options, list):
        return "field 'options' must be a list"
    return None


def where(record: dict) -> str:
    pid = record.get("problem_id")
    return f"{record.get('_where', '?')}" + (f" (problem_id {pid})" if pid is not None else "")


def build_conversation(record: dict, data_root: Path, data_cfg) -> list[dict]:
    content: list[dict] = []
    if record.get("data_type") == "video":
        for path in media_paths(record, data_root):
            element = video_element(path, fps=data_cfg.fps, max_frames=data_cfg.max_frames,
                                    min_pixels=data_cfg.min_pixels, max_pixels=data_cfg.max_pixels,
                                    total_pixels=getattr(data_cfg, "video_total_pixels", 0))
            if path.is_dir():  # a frame folder: its frame rate from the record, else the config
                element["folder_fps"] = float(record.get("fps") or data_cfg.frame_folder_fps)
                # the record's own frame_sampling first: its answers may belong to particular frames
                element["folder_sampling"] = record.get("frame_sampling") or data_cfg.frame_folder_sampling
            content.append(element)
    elif record.get("data_type") == "image":
        for path in media_paths(record, data_root):
            content.append({"type": "image", "image": str(path), "min_pixels": data_cfg.image_min_pixels,
                            "max_pixels": data_cfg.image_max_pixels})
    text = {"type": "text", "text": question_text(record, data_cfg.prompt_template)}
    content = [text, *content] if PROMPT_TEMPLATES[data_cfg.prompt_template].text_first else [*content, text]
    system = system_message(data_cfg)
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": content}]


@dataclass
class EncodedPrompt:
    record: dict
    inputs: dict  # processor output for this one prompt (batch dimension 1)
    # for an engine with its own processor (rollout.engine=vllm): the unexpanded prompt ids and the very frames and
    # images encoded into ``inputs`` (``encode_prompts(..., with_media=True)``); None unless the stream keeps them
    engine_view: dict | None = None

    @property
    def length(self) -> int:
        return int(self.inputs["attention_mask"].sum())


def encode_record(processor, record: dict, data_root: Path, data_cfg, shuffle_frames_seed: int | None = None,
                  engine_view: bool = False) -> tuple[EncodedPrompt | None, str]:
    """One record's prompt, or (None, the reason it cannot be used): undecodable video, an image PIL cannot open, a
    processor error, a prompt over ``data.max_prompt_length``. Training and evaluation both skip on the reason.
    ``engine_view``: keep what an engine with its own processor needs (``EncodedPrompt.engine_view``)."""
    view = None
    try:
        conversation = build_conversation(record, data_root, data_cfg)
        inputs = encode_prompts(processor, [conversation], shuffle_frames_seed=shuffle_frames_seed,
                                with_media=engine_view)
        if engine_view:
            inputs, (view,) = inputs
    except SettingError:
        raise  # the settings are wrong, not the record: the run stops and names them
    except VideoDecodeError as error:
        return None, f"undecodable video: {error}"
    except Exception as error:  # the processor and PIL reject odd media in many ways (UnidentifiedImageError...)
        return None, f"could not build the prompt: {type(error).__name__}: {error}"
    prompt = EncodedPrompt(record, inputs, view)
    if prompt.length > data_cfg.max_prompt_length:
        return None, (f"prompt too long: {prompt.length} tokens > data.max_prompt_length="
                      f"{data_cfg.max_prompt_length} (never truncated)")
    return prompt, ""


@dataclass
class PromptStream:
    """Deterministic, resumable stream of encoded prompts for one rank (records i = rank mod world per epoch).

    ``lookahead`` > 0: the next ``lookahead`` positions are decoded and encoded in ``workers`` background threads
    while the caller works (decord and the processor release the GIL for most of it). What a position holds is a
    function of the position alone, so the order, the skips (counted when their position is consumed, once) and a
    resume from ``position`` are those of the plain stream; at most ``lookahead`` prompts wait in memory.
    """

    records: list[dict]
    data_root: Path
    data_cfg: object
    processor: object
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    position: int = 0  # prompts of this rank's stream consumed so far (encoded or skipped)
    skipped: Counter = field(default_factory=Counter)  # reason -> count, from loading and from encoding
    total_records: int = 0
    lookahead: int = 0
    workers: int = 2
    engine_views: bool = False  # keep each prompt's media for an engine with its own processor (rollout.engine=vllm)
    wait_seconds: float = 0.0  # time next_prompts spent decoding / waiting for prompts (reset by the caller)
    recent_skips: Counter = field(default_factory=Counter)  # skips since the caller last took them (take_skips)
    _warned: set = field(default_factory=set, repr=False)
    _pending: dict = field(default_factory=dict, repr=False)  # position -> Future[(prompt | None, reason)]
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)
    _epoch_order: tuple = field(default=(None, []), repr=False)

    def _order(self, epoch: int) -> list[int]:
        """This rank's record indices for ``epoch``; the last epoch's is kept (a shuffle of Video-R1-260k takes
        ~70 ms, and every prompt, prefetched or not, looks its record up)."""
        if self._epoch_order[0] != epoch:
            order = list(range(len(self.records)))
            if self.data_cfg.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            usable = len(order) - len(order) % self.world_size if len(order) >= self.world_size else len(order)
            self._epoch_order = (epoch, order[:usable][self.rank :: self.world_size])
        return self._epoch_order[1]

    def _record_at(self, position: int) -> dict:
        cached = self._epoch_order[0]  # every epoch has the same length: measure the one at hand
        per_epoch = len(self._order(0 if cached is None else cached))
        if per_epoch == 0:
            raise DataError("no usable records for this rank")
        epoch, index = divmod(position, per_epoch)
        return self.records[self._order(epoch)[index]]

    def skip(self, record: dict, reason: str) -> None:
        """Count a skip; warn the first time a record is skipped (later epochs only count it): the first
        ``SKIP_EXAMPLES`` on the console, every one in the rank's log file."""
        key = where(record)
        if key not in self._warned:
            self._warned.add(key)
            detail = len(self._warned) > SKIP_EXAMPLES
            log.warning("skipping %s: %s%s", key, reason, "" if len(self._warned) != SKIP_EXAMPLES else
                        " (further skipped records are named in this rank's log file only)",
                        extra={"detail": detail})
        kind = skip_kind(reason)
        self.skipped[kind] += 1
        self.recent_skips[kind] += 1
        limit = self.data_cfg.max_skip_fraction * max(self.total_records, 1)
        if sum(self.skipped.values()) > limit:
            raise DataError(
                f"{sum(self.skipped.values())} of {self.total_records} records are unusable, "
                f"more than data.max_skip_fraction={self.data_cfg.max_skip_fraction}; last: {where(record)}: {reason}"
            )

    def encode(self, record: dict, shuffle_frames_seed: int | None = None) -> EncodedPrompt | None:
        prompt, reason = encode_record(self.processor, record, self.data_root, self.data_cfg, shuffle_frames_seed,
                                       self.engine_views)
        if prompt is None:
            self.skip(record, reason)
        return prompt

    def next_prompts(self, count: int) -> list[EncodedPrompt]:
        start = time.perf_counter()
        out: list[EncodedPrompt] = []
        while len(out) < count:
            record = self._record_at(self.position)
            ahead: Future | None = self._pending.pop(self.position, None)
            self.position += 1
            if ahead is None:
                prompt = self.encode(record)
            else:
                prompt, reason = ahead.result()
                if prompt is None:
                    self.skip(record, reason)
            if prompt is not None:
                out.append(prompt)
        self.prefetch()
        self.wait_seconds += time.perf_counter() - start
        return out

    def take_skips(self) -> Counter:
        """The skips since the last call, by reason (for a one-line summary per step)."""
        taken, self.recent_skips = self.recent_skips, Counter()
        return taken

    def prefetch(self) -> None:
        """Start encoding the next ``lookahead`` positions (drop any a resume moved behind ``position``)."""
        if self.lookahead <= 0:
            return
        for stale in [p for p in self._pending if p < self.position]:
            self._pending.pop(stale).cancel()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, self.workers), thread_name_prefix="prefetch")
        for position in range(self.position, self.position + self.lookahead):
            if position not in self._pending:
                self._pending[position] = self._pool.submit(
                    encode_record, self.processor, self._record_at(position), self.data_root, self.data_cfg, None,
                    self.engine_views)

    def close(self) -> None:
        """Stop the background workers (waiting for the encodes under way)."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def skip_kind(reason: str) -> str:
    return reason.split(":")[0].split(" (")[0]


def report_skips(skipped: list[Skipped], total: int, source: str, skip_log: Path | None) -> None:
    """One summary of the records refused at load, by reason, with the first few examples; the full list (one JSON
    line per record) goes to ``skip_log``. Called on one rank only."""
    if not skipped:
        return
    counts = Counter(skip_kind(s.reason) for s in skipped)
    examples = "; ".join(f"{s.where}: {s.reason}" for s in skipped[:SKIP_EXAMPLES])
    where_all = ""
    if skip_log is not None:
        skip_log.parent.mkdir(parents=True, exist_ok=True)
        skip_log.write_text("".join(json.dumps({"where": s.where, "reason": s.reason}) + "\n" for s in skipped))
        where_all = f"; every one is listed in {skip_log}"
    log.warning("%d of %d records in %s cannot be used and are skipped (%s). First %d: %s%s", len(skipped), total,
                source, ", ".join(f"{kind}: {n}" for kind, n in counts.most_common()), min(len(skipped),
                SKIP_EXAMPLES), examples, where_all)


def load_stream(data_cfg, processor, seed: int, rank: int, world_size: int, *, lookahead: int = 0,
                skip_log: Path | None = None, engine_views: bool = False) -> PromptStream:
    """This rank's stream of ``data_cfg.train_file``. Records that cannot be used are counted on every rank and
    reported once, by rank 0 (``report_skips``)."""
    records, skipped = read_records(data_cfg.train_file)
    data_root = Path(data_cfg.data_root) if data_cfg.data_root else Path(data_cfg.train_file).parent
    usable = []
    for record in records:
        reason = check_record(record, data_root, data_cfg.confine_to_root)
        if reason:
            skipped.append(Skipped(where(record), reason))
        else:
            usable.append(record)
    total = len(records) + sum(1 for s in skipped if "malformed" in s.reason or "not a JSON" in s.reason)
    if rank == 0:
        report_skips(skipped, total, str(data_cfg.train_file), skip_log)
    if total and len(skipped) > data_cfg.max_skip_fraction * total:
        raise DataError(f"{len(skipped)} of {total} records in {data_cfg.train_file} are unusable (more than "
                        f"data.max_skip_fraction={data_cfg.max_skip_fraction}); first: {skipped[0].where}: "
                        f"{skipped[0].reason}")
    if not usable:
        raise DataError(f"{data_cfg.train_file}: no usable records")
    reasons = Counter(skip_kind(s.reason) for s in skipped)
    return PromptStream(usable, data_root, data_cfg, processor, seed=seed, rank=rank, world_size=world_size,
                        skipped=reasons, total_records=total, lookahead=lookahead,
                        workers=getattr(data_cfg, "prefetch_workers", 2), engine_views=engine_views)
