"""What a run is made of, as comparable dicts: a file's content digest (cached by path, size, times and inode), a
cheap fingerprint of a checkpoint folder, and the keys in which two such dicts differ. Evaluation's resume identity
(``app/evaluation/runs.py``) and training's resume fingerprint (``app/training/fingerprint.py``) both use it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

DIGEST_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "prefix-grpo" / "sha256.json"
SMALL_FILE = 4 << 20  # files up to this size are hashed whole by ``folder_fingerprint``
SAMPLES, SAMPLE_BYTES = 64, 64 << 10  # a larger file: 64 blocks of 64 KiB spread evenly over it (4 MiB read)


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


def sampled_identity(path: Path) -> dict:
    """Size and a sha256 of ``SAMPLES`` blocks spread evenly over the file (the first and the last included): 4 MiB
    read whatever the size, so a 16 GB checkpoint costs milliseconds. Any retrained or re-exported model differs
    in it (its changed tensors span the file); a file changed in a few bytes between samples would not."""
    size = path.stat().st_size
    if size <= SMALL_FILE:
        return {"size": size, "sha256": file_identity(path)["sha256"]}
    digest = hashlib.sha256()
    step = (size - SAMPLE_BYTES) / (SAMPLES - 1)
    with path.open("rb") as f:
        for i in range(SAMPLES):
            f.seek(int(i * step))
            digest.update(f.read(SAMPLE_BYTES))
    return {"size": size, "sampled_sha256": digest.hexdigest()}


def folder_fingerprint(folder: str | Path) -> dict:
    """A checkpoint folder's files (top level), each by ``sampled_identity``: what model a run trains, cheaply."""
    folder = Path(folder)
    if not folder.is_dir():
        return {"missing": str(folder)}
    return {p.name: sampled_identity(p) for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")}


def load_digests() -> dict:
    try:
        return json.loads(DIGEST_CACHE.read_text())
    except (OSError, ValueError):
        return {}


def save_digests(cache: dict) -> None:
    try:  # a cache: a failure to write it costs time at the next resume, nothing else
        DIGEST_CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = DIGEST_CACHE.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dict(list(cache.items())[-4096:])))  # the newest entries, bounded
        os.replace(tmp, DIGEST_CACHE)
    except OSError:
        pass


def digests_of(paths: list[Path]) -> dict:
    """``file_identity`` of each path, through the on-disk digest cache."""
    cache = load_digests()
    known = dict(cache)
    out = {str(p.resolve()): file_identity(p, cache) for p in paths}
    if cache != known:
        save_digests(cache)
    return out


def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The keys whose values differ between two identities, e.g. 'settings.eval.samples: 4 -> 8'."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "(absent)"), new.get(key, "(absent)")
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            shown = ["..." if isinstance(v, dict) else (v[:12] if "sha256" in key and isinstance(v, str) else v)
                     for v in (a, b)]
            out.append(f"{prefix}{key}: {shown[0]} -> {shown[1]}")
    return out
