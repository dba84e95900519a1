"""What made an evaluation's predictions, and where they go: the model, the data files (by content digest, cached by
path, size and time) and the settings that change a prediction (``run_identity``). A resume continues only the
same identity; ``eval.if_different`` says what happens when the output folder holds another (``choose_output_dir``).
"""

from __future__ import annotations

import json
from pathlib import Path

from app.common.identity import differences, file_identity, load_digests, save_digests

RUN_FILE = "run.json"
# Settings that do not change a prediction (where it is written, how many questions share a generate call, how a
# mismatch is handled, training-only data keys).
NOT_PREDICTION_SETTINGS = {"eval": {"output_dir", "resume", "batch_size", "if_different", "share_video"},
                           "data": {"train_file", "prefetch", "prefetch_workers", "decode_threads", "shuffle",
                                    "questions_per_video", "decode_shares"}}


class EvaluationMismatch(RuntimeError):
    """eval.output_dir holds predictions made by another model, other data files or other settings."""


def run_identity(cfg, model_dir: Path, data_files: list[Path]) -> dict:
    """Everything that decides a prediction: the model's files (weights, config, processor), the data files'
    contents, and the evaluation and data settings (NOT_PREDICTION_SETTINGS excluded)."""
    model_files = sorted(p for p in Path(model_dir).iterdir() if p.is_file())
    cache = load_digests()
    known = dict(cache)
    values = cfg.to_dict()
    settings = {section: {k: v for k, v in values[section].items() if k not in NOT_PREDICTION_SETTINGS.get(section, ())}
                for section in ("eval", "data")}
    settings["model"] = {k: values["model"][k] for k in ("dtype", "vision_attention", "trust_remote_code")}
    found = {"model": {"path": str(Path(model_dir).resolve()),
                       "files": {p.name: file_identity(p, cache) for p in model_files}},
             "data": {str(f.resolve()): file_identity(f, cache) for f in data_files},
             "settings": settings}
    if cache != known:
        save_digests(cache)
    return found


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
