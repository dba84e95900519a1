"""Video-R1 records: reading, validation and encoding (one record, or a run of records on the same media: decoded
once); the stream that orders them per rank is ``app.data.stream``.

Fields: ``problem_id``, ``problem``, ``data_type`` (image | video), ``problem_type``, ``options``, ``solution``
(``<answer>X</answer>``), ``path`` (relative to the data root), ``data_source``. Bad records are skipped with a
warning that names the file, the line and the reason; the run fails only when more than ``max_skip_fraction`` of
the records are unusable. A video is never substituted.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from app.answers.grounding import check_grounding_record
from app.answers.problems import PROBLEM_TYPES
from app.data.prompts import (
    PROMPT_TEMPLATES,
    encode_prompts,
    media_decodes,
    question_text,
    spliced_prompt,
    system_message,
)
from app.data.video import FRAME_FOLDER_SAMPLING, SettingError, VideoDecodeError, frame_files, video_element

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


def decode_threads(data_cfg) -> int:
    """``data.decode_threads``, its 0 resolved for this process (``video.default_decode_threads``: the node's ranks
    from torchrun's LOCAL_WORLD_SIZE)."""
    from app.data.video import default_decode_threads

    set_to = getattr(data_cfg, "decode_threads", 1)
    if set_to:
        return set_to
    workers = getattr(data_cfg, "prefetch_workers", 2) if getattr(data_cfg, "prefetch", 0) else 1
    return default_decode_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), workers)


def build_conversation(record: dict, data_root: Path, data_cfg) -> list[dict]:
    content: list[dict] = []
    if record.get("data_type") == "video":
        for path in media_paths(record, data_root):
            element = video_element(path, fps=data_cfg.fps, max_frames=data_cfg.max_frames,
                                    min_pixels=data_cfg.min_pixels, max_pixels=data_cfg.max_pixels,
                                    total_pixels=getattr(data_cfg, "video_total_pixels", 0))
            threads = decode_threads(data_cfg)
            if threads > 1 and not path.is_dir():
                element["decode_threads"] = threads
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
    # questions that share a video (data.questions_per_video > 1): prompts with the same key were encoded from the
    # same decoded media, so the forward and the rollout may hold it once (``media_key``); None: shares nothing
    share: tuple | None = None
    # the epoch of the data stream this prompt was drawn in: with its identity (``app.rollout.base.prompt_identity``)
    # it names one draw of one record, whatever the order (a replayed run finds its recorded completions by both)
    epoch: int = 0

    @property
    def length(self) -> int:
        return int(self.inputs["attention_mask"].sum())


def media_key(record: dict, data_root: Path) -> tuple | None:
    """What makes two records' media encode the same: their files (resolved paths, in order), the data type and
    the record's own settings that change the frames (a frame folder's fps and sampling); the config's settings are
    the same for the whole run. None for a record without media."""
    if record.get("data_type") not in ("image", "video") or not record.get("path"):
        return None
    paths = tuple(str(p.resolve()) for p in media_paths(record, data_root))
    return (record["data_type"], paths, record.get("fps"), record.get("frame_sampling"))


def encode_record(processor, record: dict, data_root: Path, data_cfg, shuffle_frames_seed: int | None = None,
                  engine_view: bool = False, *, decoded: dict | None = None, template: dict | None = None,
                  sp_share: tuple[int, int] | None = None) -> tuple[EncodedPrompt | None, str]:
    """One record's prompt, or (None, the reason it cannot be used): undecodable video, an image PIL cannot open, a
    processor error, a prompt over ``data.max_prompt_length``. Training and evaluation both skip on the reason.
    ``engine_view``: keep what an engine with its own processor needs (``EncodedPrompt.engine_view``).
    ``decoded`` / ``template``: shared by the records of one run on the same media (``encode_run``): the media are
    decoded once, and a question after the media reuses the first prompt's processor output (``spliced_prompt``).
    ``sp_share`` = (rank, S): its videos' pixels only that sequence-parallel rank's share (``app.data.shares``)."""
    view = None
    try:
        conversation = build_conversation(record, data_root, data_cfg)
        inputs = None
        if template is not None and "inputs" in template and shuffle_frames_seed is None:
            text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            inputs = spliced_prompt(processor, template, text)
            if inputs is not None and engine_view:
                tokenizer = getattr(processor, "tokenizer", processor)
                view = {"prompt_ids": tokenizer([text], add_special_tokens=False)["input_ids"][0],
                        "media": template["view"]["media"]}
        if inputs is None:
            inputs = encode_prompts(processor, [conversation], shuffle_frames_seed=shuffle_frames_seed,
                                    with_media=engine_view, decoded=decoded, sp_share=sp_share)
            if engine_view:
                inputs, (view,) = inputs
            if template is not None and "inputs" not in template:
                template.update(inputs=inputs, view=view, text=processor.apply_chat_template(
                    conversation, add_generation_prompt=True, tokenize=False))
    except SettingError:
        raise  # the settings are wrong, not the record: the run stops and names them
    except VideoDecodeError as error:
        return None, f"undecodable video: {error}"
    except Exception as error:  # the processor and PIL reject odd media in many ways (UnidentifiedImageError...)
        return None, f"could not build the prompt: {type(error).__name__}: {error}"
    prompt = EncodedPrompt(record, inputs, view)
    say_video_tokens(record, inputs, processor)
    if prompt.length > data_cfg.max_prompt_length:
        return None, (f"prompt too long: {prompt.length} tokens > data.max_prompt_length="
                      f"{data_cfg.max_prompt_length} (never truncated)")
    return prompt, ""


_SAID_VIDEO_SHAPES: set = set()  # (frames, tokens a temporal patch) the log has stated


def say_video_tokens(record: dict, inputs: dict, processor) -> None:
    """The log states each video shape's visual tokens once: frames x tokens per frame pair (a temporal patch),
    the first time a video of that shape is encoded (the processor's grid, what the model will see)."""
    grid = inputs.get("video_grid_thw")
    if grid is None:
        return
    video = getattr(processor, "video_processor", None)
    merge = getattr(video, "merge_size", None) or 2
    temporal = getattr(video, "temporal_patch_size", None) or 2
    patch = getattr(video, "patch_size", None) or 14
    for t, h, w in grid.tolist():
        shape = (t * temporal, h * w // merge**2)
        if shape not in _SAID_VIDEO_SHAPES:
            _SAID_VIDEO_SHAPES.add(shape)
            log.info("video %s: %d frames -> %d frame pairs x %d tokens (%dx%d pixels a frame) = %d visual tokens",
                     where(record), shape[0], t, shape[1], w * patch, h * patch, t * shape[1])


def encode_run(processor, records: list[dict], data_root: Path, data_cfg, engine_view: bool = False, *,
               sp_share: tuple[int, int] | None = None) -> tuple[list[tuple[EncodedPrompt | None, str]], int]:
    """The prompts of records on the same media (a run of ``data.questions_per_video``), each (prompt, "") or
    (None, reason), and how many media files were decoded for them: the media once for the run, the processor once
    when the questions follow the media. The prompts carry the media's key (``EncodedPrompt.share``)."""
    decoded: dict = {}
    template: dict = {}
    out = []
    for record in records:
        prompt, reason = encode_record(processor, record, data_root, data_cfg, None, engine_view, decoded=decoded,
                                       template=template, sp_share=sp_share)
        if prompt is not None:
            prompt.share = media_key(record, data_root)
        elif reason.startswith("undecodable"):  # the same file for the rest: skip them for the same reason
            return out + [(None, reason)] * (len(records) - len(out)), media_decodes(decoded) or 1
        out.append((prompt, reason))
    return out, media_decodes(decoded)
