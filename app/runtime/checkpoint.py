"""Checkpoints that a crash mid-save cannot destroy, resume state, and the final Hugging Face export.

Layout under ``output_dir/checkpoints``: ``step-0000010/`` (DeepSpeed's engine checkpoint + one trainer-state JSON
per rank) and ``latest`` (a text file naming the newest complete one). A save is written to ``.incoming/`` and
renamed into place only after every rank has finished; ``latest`` is replaced atomically after that. A crash at
any point leaves the previous checkpoint and ``latest`` untouched.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from app.runtime import distributed, zero

log = logging.getLogger("app.runtime.checkpoint")

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


class SaveError(RuntimeError):
    """A checkpoint or the export could not be written (no space, a file-size limit, an unwritable folder)."""


FILE_LIMIT_ENV = "PREFIX_GRPO_FILE_LIMIT_AT_SAVE"  # tests: "BYTES@STEP" caps this process's file size at that save


def save_bytes(parameters: int, trainable: int, dtype_bytes: int, zero_stage: int, *, adapter: int = 0,
               save_adapter: bool = False) -> dict:
    """Bytes on disk of one checkpoint and of the final export, over all ranks (measured on DeepSpeed 0.19's files):
    a checkpoint holds the weights in their dtype (under ZeRO-3 only the frozen ones: the trained ones live in the
    optimizer's float32 copy) and 12 bytes per trained parameter (float32 copy and two Adam moments); the export
    holds the model's weights in their dtype (``parameters``, the adapters merged into them) and, with
    ``save_adapter``, the ``adapter`` parameters alone."""
    held = parameters + adapter - (trainable if zero_stage == 3 else 0)
    return {"checkpoint": held * dtype_bytes + 12 * trainable,
            "export": (parameters + (adapter if save_adapter else 0)) * dtype_bytes}


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (its nearest existing parent)."""
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _file_limit() -> int | None:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        return None if soft == resource.RLIM_INFINITY else soft
    except (ImportError, OSError, ValueError):
        return None


def _test_file_limit(moment: int | str) -> None:
    """Tests: cap the file size from this save (a step, or "export") on (``FILE_LIMIT_ENV``), as a full disk would
    stop the writes."""
    spec = os.environ.get(FILE_LIMIT_ENV, "")
    if spec.endswith(f"@{moment}"):
        import resource

        limit = int(spec.split("@")[0])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def space_report(what: str, path: Path, need: int, error: BaseException | None) -> str:
    """One line: what failed where, the bytes it needs and the bytes free (and a file-size limit, if any)."""
    reason = f" ({type(error).__name__}: {str(error).strip().splitlines()[0][:160] if str(error).strip() else ''})" \
        if error is not None else ""
    limit = _file_limit()
    capped = f"; this process may not write files over {limit} bytes (ulimit -f)" if limit is not None else ""
    return (f"{what} {path} failed{reason}: it needs about {need} bytes ({need / 2**30:.2f} GiB) and "
            f"{free_bytes(path)} bytes ({free_bytes(path) / 2**30:.2f} GiB) are free there{capped}")


def space_like(error: BaseException | None) -> bool:
    """Whether a failed write looks like the disk's doing (no space, a file-size limit, a short write), or no error
    of this rank's own (another rank failed); else the save itself refused, and space is not the advice to give."""
    if error is None or isinstance(error, OSError):
        return True
    return re.search(r"unexpected pos|no space|too ?large|quota|short write|ioerror|errno (27|28)", str(error),
                     re.IGNORECASE) is not None


def _agree_failed(failed: bool) -> bool:
    """Whether any rank failed (every rank learns it, so none waits for another at a barrier)."""
    from app.runtime.parallel import all_reduce_max

    return all_reduce_max([float(failed)])[0] > 0


def checkpoint_tag(step: int) -> str:
    """The folder name of step ``step``'s checkpoint under ``output_dir/checkpoints``."""
    return f"step-{step:07d}"


def save_checkpoint(engine, output_dir: str | Path, step: int, trainer_state: dict, keep: int = 2,
                    need_bytes: int = 0) -> Path:
    root = Path(output_dir) / "checkpoints"
    tag = checkpoint_tag(step)
    incoming = root / ".incoming"
    rank = distributed.rank()
    if rank == 0:
        shutil.rmtree(incoming / tag, ignore_errors=True)  # leftovers of a save that crashed
        incoming.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    _test_file_limit(step)
    failure = None
    try:
        engine.save_checkpoint(str(incoming), tag=tag, save_latest=False)
        state = _jsonable({**trainer_state, "rng": rng_state()})
        _atomic_write(incoming / tag / f"trainer_state_rank{rank}.json", json.dumps(state))
    except Exception as error:  # noqa: BLE001 - torch reports a short write as RuntimeError ("unexpected pos")
        failure = error
    if _agree_failed(failure is not None):
        if rank == 0:
            shutil.rmtree(incoming / tag, ignore_errors=True)  # its partial files: the space back
        latest = root / "latest"
        kept = f"{latest} still names {latest.read_text().strip()}" if latest.is_file() else "no earlier checkpoint"
        if not space_like(failure):  # the save itself refused (DeepSpeed's own checks), not the disk
            raise SaveError(f"rank {rank}: saving checkpoint {root / tag} failed ({type(failure).__name__}: "
                            f"{str(failure).strip()[:800]}). Nothing older was touched ({kept}); this is not a lack "
                            "of space")
        report = space_report(f"rank {rank}: saving checkpoint", root / tag, need_bytes, failure)
        raise SaveError(f"{report}. Nothing older was touched ({kept}): free space (or point train.output_dir "
                        "elsewhere, copying checkpoints/), then resume with train.resume=true")
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


def trainer_state_of(path: Path, rank: int | None = None) -> dict:
    """A checkpoint's trainer state as this rank (or ``rank``) wrote it, without loading any tensor."""
    state_file = path / f"trainer_state_rank{distributed.rank() if rank is None else rank}.json"
    try:
        return json.loads(state_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{state_file} cannot be read ({error})") from error


def check_layout(path: Path, state: dict, world: int, sequence_parallel: int, expert_parallel: int) -> None:
    """A checkpoint's ranks and their layout (its trainer state) against this run's, before any model is loaded:
    ``CheckpointError`` naming the setting that differs."""
    if state["world_size"] != world:
        raise CheckpointError(f"{path} was written by {state['world_size']} ranks, this run has {world}")
    if state.get("sequence_parallel_size", 1) != sequence_parallel:
        raise CheckpointError(f"{path} was written with train.sequence_parallel_size="
                              f"{state.get('sequence_parallel_size', 1)}, this run has {sequence_parallel} (the data "
                              "order per replica would differ)")
    if state.get("expert_parallel_size", 1) != expert_parallel:
        raise CheckpointError(
            f"{path} was written with train.expert_parallel_size={state.get('expert_parallel_size', 1)}, this run has "
            f"{expert_parallel}: its weights and optimizer states hold each rank's share of the experts as that run "
            "split them, and a resume does not reshard them; resume with the size it was written with (or start a new "
            "run from its export, output_dir/final, as model.path)")


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
              lora_cfg=None, *, need_bytes: int = 0) -> Path:
    """Write model + processor in Hugging Face format (loadable by from_pretrained); rank 0 writes.

    With ``lora_cfg`` (a LoRA policy) the adapters are merged into the base weights, so ``out_dir`` loads without
    peft; with ``lora_cfg.save_adapter`` the adapter alone also goes to ``<out_dir>-adapter`` in peft's format.

    The trained weights go into an unsharded copy loaded from the source checkpoint, so the file keeps the source's
    key naming whatever the ZeRO stage (a ZeRO-3 module records no load-time key conversions to revert).
    A write that fails (no space, a file-size limit) ends with ``SaveError`` naming the path and the bytes.
    """
    out = Path(out_dir)
    state = zero.gathered_state_dict(engine)
    _test_file_limit("export")
    failure = None
    try:
        if distributed.rank() == 0:
            _export(state, out, processor, source_path, dtype, lora_cfg)
    except Exception as error:  # noqa: BLE001 - safetensors raises its own SafetensorError on a short write
        failure = error
        shutil.rmtree(out.with_name(f".{out.name}.incoming"), ignore_errors=True)
    if _agree_failed(failure is not None):
        raise SaveError(f"{space_report('exporting to', out, need_bytes, failure)}. The final checkpoint is saved: "
                        "free space, then redo the export with the same command and train.resume=true (no step "
                        "runs again)")
    distributed.barrier()
    return out


def _export(state: dict, out: Path, processor, source_path, dtype, lora_cfg) -> None:
    """Rank 0's half of ``export_hf``: the merged (LoRA) state loaded into a plain copy of the source model, written
    to a hidden folder and renamed into place."""
    from app.runtime.expert_layouts import write_source_layout
    from app.runtime.models import load_model

    if lora_cfg is not None:
        from app.runtime import lora

        if lora_cfg.save_adapter:
            lora.save_adapter(state, lora_cfg, out.with_name(f"{out.name}-adapter"), str(source_path))
        state = lora.merged_state_dict(state, lora.scaling(lora_cfg))
    tmp = out.with_name(f".{out.name}.incoming")
    shutil.rmtree(tmp, ignore_errors=True)
    with zero.without_hf_zero3():
        plain = load_model(source_path, dtype=dtype)
    plain.load_state_dict(state, strict=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    copied = write_source_layout(tmp, plain, source_path)  # experts as the source stores them, its MTP head kept
    if copied:
        log.info("export: %d tensor(s) of %s the model does not hold copied as they were (%s)", len(copied),
                 source_path, ", ".join(sorted({k.split(".")[0] + ".*" for k in copied})))
    processor.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
