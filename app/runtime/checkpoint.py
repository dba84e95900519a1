"""Checkpoints that a crash mid-save cannot destroy, resume state, and the final Hugging Face export.

Layout under ``output_dir/checkpoints``: ``step-0000010/`` (DeepSpeed's engine checkpoint + one trainer-state JSON
per rank) and ``latest`` (a text file naming the newest complete one). A save is written to ``.incoming/`` and
renamed into place only after every rank has finished; ``latest`` is replaced atomically after that. A crash at
any point leaves the previous checkpoint and ``latest`` untouched.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from app.runtime import distributed, zero

CRASH_POINT_ENV = "PREFIX_GRPO_CRASH_IN_SAVE"  # tests: "POINT@STEP" exits (code 19) at that point of that save
CRASH_POINTS = ("written", "moved_aside", "renamed", "pointed")


def _crash_point(point: str, step: int) -> None:
    """Die like a crash at a named moment of a save (tests only; off unless the variable is set)."""
    if os.environ.get(CRASH_POINT_ENV) == f"{point}@{step}":
        os._exit(19)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    numpy = state["numpy"]
    np.random.set_state((numpy[0], np.array(numpy[1], dtype=np.uint32), *numpy[2:]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _jsonable(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def save_checkpoint(engine, output_dir: str | Path, step: int, trainer_state: dict, keep: int = 2) -> Path:
    root = Path(output_dir) / "checkpoints"
    tag = f"step-{step:07d}"
    incoming = root / ".incoming"
    rank = distributed.rank()
    if rank == 0:
        shutil.rmtree(incoming / tag, ignore_errors=True)  # leftovers of a save that crashed
        incoming.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    engine.save_checkpoint(str(incoming), tag=tag, save_latest=False)
    state = _jsonable({**trainer_state, "rng": rng_state()})
    _atomic_write(incoming / tag / f"trainer_state_rank{rank}.json", json.dumps(state))
    distributed.barrier()
    _crash_point("written", step)
    final = root / tag
    if rank == 0:
        # Never remove a live checkpoint before its replacement is in place: move it aside, rename the new one in,
        # point `latest` at it, then delete the old copy. A crash at any point leaves a complete step-* directory.
        aside = root / ".replaced" / tag
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
            aside.parent.mkdir(parents=True, exist_ok=True)
            os.replace(final, aside)
            _crash_point("moved_aside", step)
        os.replace(incoming / tag, final)
        _crash_point("renamed", step)
        _atomic_write(root / "latest", tag)
        _crash_point("pointed", step)
        shutil.rmtree(aside, ignore_errors=True)
        for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
    return final


class CheckpointError(RuntimeError):
    """Checkpoints exist but none can be resumed from."""


def _step_of(path: Path) -> int:
    try:
        return int(path.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def checkpoint_problem(path: Path, world_size: int) -> str | None:
    """Why ``path`` cannot be resumed from by ``world_size`` ranks, or None when it looks complete and readable.

    Checks every rank's trainer state (present, valid JSON) and every DeepSpeed file (present, its zip directory
    readable: a truncated torch file has none), without loading any tensor.
    """
    import zipfile

    if not path.is_dir():
        return f"{path} does not exist"
    states = []
    for rank in range(world_size):
        state = path / f"trainer_state_rank{rank}.json"
        if not state.is_file():
            return f"{state} is missing (written by a different number of ranks?)"
        try:
            states.append(json.loads(state.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            return f"{state} is not valid JSON ({error})"
    weights = sorted(path.rglob("*.pt"))
    if not any(p.name.endswith("model_states.pt") for p in weights):
        return f"{path} has no DeepSpeed model_states file"
    stage = states[0].get("zero_stage")
    names = {p.name for p in weights}
    for rank in range(world_size) if stage else ():  # ZeRO: one optimizer shard per rank (+ model shards in stage 3)
        wanted = [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]
        if stage == 3:
            wanted.append(f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        for name in wanted:
            if not any(n.endswith(name) for n in names):
                return f"{path} lacks rank {rank}'s {name}"
    for file in weights:
        try:
            with zipfile.ZipFile(file) as archive:
                archive.namelist()
        except (zipfile.BadZipFile, OSError) as error:
            return f"{file} is unreadable ({error})"
    return None


def catalogue(output_dir: str | Path) -> list[Path]:
    """Checkpoint directories, newest step first (``latest`` is a hint, not the truth)."""
    root = Path(output_dir) / "checkpoints"
    return sorted((p for p in root.glob("step-*") if p.is_dir() and _step_of(p) >= 0), key=_step_of, reverse=True)


def latest_checkpoint(output_dir: str | Path, world_size: int = 1) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint and the reasons newer candidates were passed over.

    Raises CheckpointError when checkpoints (or a ``latest`` pointer) exist but none is usable: a run never
    restarts from step 0 behind the user's back.
    """
    root = Path(output_dir) / "checkpoints"
    pointer = root / "latest"
    passed_over = []
    named = pointer.read_text().strip() if pointer.is_file() else None
    if pointer.is_file() and not named:
        passed_over.append(f"{pointer} is empty")
    elif named and not (root / named).is_dir():
        passed_over.append(f"{pointer} names {named}, which does not exist")
    for path in catalogue(output_dir):
        problem = checkpoint_problem(path, world_size)
        if problem is None:
            return path, passed_over
        passed_over.append(problem)
    if passed_over or pointer.exists():
        raise CheckpointError(
            f"train.resume=true but no checkpoint in {root} can be resumed from: " + "; ".join(passed_over)
            + ". To start over on purpose, use a new train.output_dir (or move the checkpoints away).")
    return None, passed_over


def load_checkpoint(engine, path: Path) -> dict:
    """Restore engine (weights, optimizer, scheduler) and return this rank's trainer state."""
    loaded, _ = engine.load_checkpoint(str(path.parent), tag=path.name)
    if loaded is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint at {path}")
    state_file = path / f"trainer_state_rank{distributed.rank()}.json"
    if not state_file.is_file():
        raise RuntimeError(f"{state_file} is missing: was the checkpoint written with a different number of ranks?")
    try:
        state = json.loads(state_file.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{state_file} is not valid JSON ({error})") from error
    set_rng_state(state.pop("rng"))
    return state


def export_hf(engine, processor, out_dir: str | Path, source_path: str | Path, dtype: torch.dtype,
              lora_cfg=None) -> Path:
    """Write model + processor in Hugging Face format (loadable by from_pretrained); rank 0 writes.

    With ``lora_cfg`` (a LoRA policy) the adapters are merged into the base weights, so ``out_dir`` loads without
    peft; with ``lora_cfg.save_adapter`` the adapter alone also goes to ``<out_dir>-adapter`` in peft's format.

    The trained weights go into an unsharded copy loaded from the source checkpoint, so the file keeps the source's
    key naming whatever the ZeRO stage (a ZeRO-3 module records no load-time key conversions to revert).
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    from app.runtime.models import load_model

    out = Path(out_dir)
    state = zero.gathered_state_dict(engine)
    if distributed.rank() == 0:
        if lora_cfg is not None:
            from app.runtime import lora

            if lora_cfg.save_adapter:
                lora.save_adapter(state, lora_cfg, out.with_name(f"{out.name}-adapter"), str(source_path))
            state = lora.merged_state_dict(state, lora.scaling(lora_cfg))
        tmp = out.with_name(f".{out.name}.incoming")
        shutil.rmtree(tmp, ignore_errors=True)
        saved_ref = hf_deepspeed._hf_deepspeed_config_weak_ref
        hf_deepspeed.unset_hf_deepspeed_config()
        try:
            plain = load_model(source_path, dtype=dtype)
        finally:
            hf_deepspeed._hf_deepspeed_config_weak_ref = saved_ref
        plain.load_state_dict(state, strict=True)
        plain.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    distributed.barrier()
    return out
