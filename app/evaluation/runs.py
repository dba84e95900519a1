"""What made an evaluation's predictions, and where they go: the model, the data files (by content digest, cached by
path, size and time) and the settings that change a prediction (``run_identity``). A resume continues only the
same identity; ``eval.if_different`` says what happens when the output folder holds another (``choose_output_dir``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

RUN_FILE = "run.json"
DIGEST_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "prefix-grpo" / "sha256.json"
# Settings that do not change a prediction (where it is written, how many questions share a generate call, how a
# mismatch is handled, training-only data keys).
NOT_PREDICTION_SETTINGS = {"eval": {"output_dir", "resume", "batch_size", "if_different", "share_video"},
                           "data": {"train_file", "prefetch", "prefetch_workers", "shuffle", "questions_per_video"}}


class EvaluationMismatch(RuntimeError):
    """eval.output_dir holds predictions made by another model, other data files or other settings."""


def _file_key(path: Path, stat) -> str:
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}|{stat.st_ino}"


def file_identity(path: Path, cache: dict | None = None) -> dict:
    """Size and sha256 of a file's whole content. ``cache`` maps (path, size, mtime, inode) to a digest already
    computed, so a multi-GB checkpoint is read once, not at every resume; a rewritten file has a new change time
    (which no tool can set back) and is hashed again."""
    stat = path.stat()
    key = _file_key(path, stat)
    if cache is not None and key in cache:
        return {"size": stat.st_size, "sha256": cache[key]}
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    if cache is not None:
        cache[key] = digest.hexdigest()
    return {"size": stat.st_size, "sha256": digest.hexdigest()}


def _load_digests() -> dict:
    try:
        return json.loads(DIGEST_CACHE.read_text())
    except (OSError, ValueError):
        return {}


def _save_digests(cache: dict) -> None:
    try:  # a cache: a failure to write it costs time at the next resume, nothing else
        DIGEST_CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = DIGEST_CACHE.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dict(list(cache.items())[-4096:])))  # the newest entries, bounded
        os.replace(tmp, DIGEST_CACHE)
    except OSError:
        pass


def run_identity(cfg, model_dir: Path, data_files: list[Path]) -> dict:
    """Everything that decides a prediction: the model's files (weights, config, processor), the data files'
    contents, and the evaluation and data settings (NOT_PREDICTION_SETTINGS excluded)."""
    model_files = sorted(p for p in Path(model_dir).iterdir() if p.is_file())
    cache = _load_digests()
    known = dict(cache)
    values = cfg.to_dict()
    settings = {section: {k: v for k, v in values[section].items() if k not in NOT_PREDICTION_SETTINGS.get(section, ())}
                for section in ("eval", "data")}
    settings["model"] = {k: values["model"][k] for k in ("dtype", "vision_attention", "trust_remote_code")}
    identity = {"model": {"path": str(Path(model_dir).resolve()),
                          "files": {p.name: file_identity(p, cache) for p in model_files}},
                "data": {str(f.resolve()): file_identity(f, cache) for f in data_files},
                "settings": settings}
    if cache != known:
        _save_digests(cache)
    return identity


def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The keys whose values differ between two identities, e.g. 'settings.eval.samples: 4 -> 8'."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "(absent)"), new.get(key, "(absent)")
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            shown = ["..." if isinstance(v, dict) else (v[:12] if key == "sha256" else v) for v in (a, b)]
            out.append(f"{prefix}{key}: {shown[0]} -> {shown[1]}")
    return out


def _has_predictions(out: Path) -> bool:
    return any(out.glob("predictions*.jsonl")) or any(out.glob("skipped.rank*.jsonl"))


def choose_output_dir(out: Path, identity: dict, if_different: str) -> Path:
    """``out`` when it is empty or holds this very evaluation (same identity); otherwise stop with what differs
    (``stop``) or take the first of out-2, out-3, ... that is empty or holds this evaluation (``new_dir``)."""
    candidate, n = out, 1
    while True:
        run_file = candidate / RUN_FILE
        if not _has_predictions(candidate):
            return candidate
        if run_file.is_file():
            found = differences(json.loads(run_file.read_text()), identity)
            if not found:
                return candidate
            what = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
        else:
            what = f"it holds predictions but no {RUN_FILE}, so what made them is unknown"
        if if_different == "stop":
            raise EvaluationMismatch(
                f"{candidate} holds predictions of a different evaluation ({what}). Evaluate into another "
                "eval.output_dir, set eval.if_different=new_dir to have one chosen, or eval.resume=false to replace "
                "them")
        n += 1
        candidate = out.with_name(f"{out.name}-{n}")
