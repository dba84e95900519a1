"""What a checkpoint must share with the run that resumes it: the settings that define the order or the meaning of
the data and the objective, the data file's content and the model's identity (``run_fingerprint``, written into
every checkpoint's trainer state). A resume whose fingerprint differs stops with one line naming each difference
(``resume_problems``), unless ``train.resume_if_different=continue``; settings that change neither are free, and a
changed schedule continues with a line saying how (``schedule_notes``). The parallel layout (world size, S) is
checked on its own (``Recipe._resume``).
"""

from __future__ import annotations

import math
from pathlib import Path

from app.common.identity import differences, digests_of, folder_fingerprint

# Per section: the keys that define the data order or meaning, or the objective ("*": every key but those in FREE).
# Paths are compared by what they hold (the data file's digest, the model folder's fingerprint), not by name.
FINGERPRINTED = {
    "data": "*",
    "train": ("seed", "prompts_per_rank"),
    "rollout": ("group_size", "temperature", "top_p", "top_k", "max_completion_length", "stop_strings", "tools",
                "max_turns", "max_total_tokens", "branching", "tool_max_frames", "tool_max_pixels",
                "tool_zoom_max_pixels"),
    "grpo": "*",
    "rewards": "*",
    "sft": "*",
    "model": ("dtype", "freeze_vision_tower", "freeze_projector"),
    "lora": "*",
}
FREE = {"data": {"train_file", "data_root", "prefetch", "prefetch_workers", "decode_threads", "decode_shares",
                  "max_skip_fraction"},
        "lora": {"save_adapter"}}
SCHEDULE = ("max_steps", "warmup_steps", "learning_rate", "min_lr_ratio")  # train.*: continue, said in one line


def run_fingerprint(cfg) -> dict:
    """The fingerprint of a run: its settings (``FINGERPRINTED``), the data file's size and sha256 (cached by path,
    size and times: hashed once), the model folders' cheap fingerprints and the schedule."""
    values = cfg.to_dict()
    settings = {}
    for section, keys in FINGERPRINTED.items():
        names = values[section] if keys == "*" else keys
        settings[section] = {k: values[section][k] for k in names if k not in FREE.get(section, ())}
    files = {}
    train_file = Path(cfg.data.train_file)
    if train_file.is_file():
        files["data.train_file"] = next(iter(digests_of([train_file]).values()))
    files["model.path"] = folder_fingerprint(cfg.model.path)
    if cfg.model.reference_path:
        files["model.reference_path"] = folder_fingerprint(cfg.model.reference_path)
    schedule = {k: values["train"][k] for k in SCHEDULE}
    return {"settings": settings, "files": files, "schedule": schedule}


def resume_problems(old: dict, new: dict) -> list[str]:
    """Each difference between a checkpoint's fingerprint and this run's that would change what the resumed steps
    train on, as 'key: old -> new' (files by their digests)."""
    found = differences(old.get("settings", {}), new["settings"])
    for key in sorted(set(old.get("files", {})) | set(new["files"])):
        a, b = old.get("files", {}).get(key), new["files"].get(key)
        if a != b:
            what = "another model" if key.startswith("model.") else "other contents"
            detail = "; ".join(differences(a or {}, b or {})[:3])
            found.append(f"{key}: {what} ({detail})" if detail else f"{key}: {what}")
    return found


def schedule_notes(old: dict, new: dict, step: int, lr_at) -> list[str]:
    """One line per schedule setting that changed, saying how the run goes on: ``lr_at(step, schedule)`` is the
    rate the next update takes under a schedule (``old`` and ``new`` fingerprints' ``schedule``)."""
    before, after = old.get("schedule", {}), new["schedule"]
    changed = [k for k in SCHEDULE if k in before and before[k] != after[k]]
    if not changed:
        return []
    what = ", ".join(f"train.{k} {before[k]} -> {after[k]}" for k in changed)
    was, now = lr_at(step, before), lr_at(step, after)
    tail = "" if math.isclose(was, now, rel_tol=1e-9) else f" (it would have been {was:.4g})"
    return [f"resume at step {step} with {what}: the warmup and cosine schedule now spans train.max_steps="
            f"{after['max_steps']} steps; the next step's learning rate is {now:.4g}{tail}"]
