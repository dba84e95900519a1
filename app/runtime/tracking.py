"""Metrics to wandb (online, offline or disabled), always to a local JSONL file, plus a progress bar."""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

import torch
from tqdm import tqdm


class StepMetrics:
    """A step's metrics, each declared once with how ranks combine it, reduced in one collective.

        m = StepMetrics()
        m.mean("accuracy", 0.5)              # averaged over ranks
        m.sum("tokens/policy_forward", 900)  # added up over ranks
        m.max("mismatch/max_ratio", 1.02)    # the largest over ranks
        m.min("ratio/min", 0.97)             # the smallest over ranks
        m.fraction("groups/all_correct", 3, 8)  # sum of counts / sum of totals
        m.local("learning_rate", 1e-6)       # the same on every rank (rank 0's is kept)
        m.each("memory/x", 0.4)              # every rank's own: "memory/x/rank0", "memory/x/rank1", ...
        values = m.reduce(gather)            # gather: list[float] -> one list per rank
    """

    REDUCTIONS = ("mean", "sum", "max", "min", "fraction", "local", "each")
    VECTORS = ("sum", "local")  # reductions that also take a 1-D tensor (one key for a table: router sums)

    def __init__(self):
        self._declared: dict[str, tuple] = {}

    def _add(self, how: str, key: str, value, total: float = 0.0) -> None:
        if key in self._declared:
            raise KeyError(f"metric {key!r} declared twice")
        if isinstance(value, torch.Tensor) and how in self.VECTORS:
            self._declared[key] = (how, value.detach().reshape(-1), None)  # copied with the others in ``reduce``
        else:
            self._declared[key] = (how, float(value), float(total))

    def mean(self, key: str, value: float) -> None:
        self._add("mean", key, value)

    def sum(self, key: str, value) -> None:
        """A float, or a 1-D tensor summed element by element (its value a list)."""
        self._add("sum", key, value)

    def max(self, key: str, value: float) -> None:
        self._add("max", key, value)

    def min(self, key: str, value: float) -> None:
        self._add("min", key, value)

    def fraction(self, key: str, count: float, total: float) -> None:
        self._add("fraction", key, count, total)

    def local(self, key: str, value) -> None:
        """A float, or a 1-D tensor (its value a list), the same on every rank."""
        self._add("local", key, value)

    def each(self, key: str, value: float) -> None:
        self._add("each", f"{key}/rank", value)  # its own name: a key may also be declared with another reduction

    def reduce(self, gather=None, copies: int = 1) -> dict:
        """Combine over ranks: ``gather(values) -> [values of rank 0, of rank 1, ...]`` is called once (None: one
        process). ``copies``: ranks in a row that hold one replica's values (the S ranks of a sequence-parallel
        group): means, sums, fractions and ``local`` count each replica once (its first rank); ``max``, ``min`` and
        ``each`` see every rank (memory differs within a group). Tensor values (``sum``, ``local``) reach the host
        in one copy, whatever their number and size."""
        keys = sorted(self._declared)
        tensors = [self._declared[k][1] for k in keys if self._declared[k][2] is None]
        host = iter(torch.cat([t.to(torch.float64) for t in tensors]).tolist() if tensors else [])
        flat, spans = [], {}
        for key in keys:
            _, value, total = self._declared[key]
            start = len(flat)
            flat += [value, total] if total is not None else [next(host) for _ in range(value.numel())]
            spans[key] = (start, len(flat))
        every = gather(flat) if gather is not None else [flat]
        replicas = every[::copies]
        out = {}
        for key in keys:
            how, _, total = self._declared[key]
            a, b = spans[key]
            ranks = every if how in ("max", "min", "each") else replicas
            if total is None:  # a tensor: its elements, summed or rank 0's
                rows = [r[a:b] for r in ranks]
                out[key] = [sum(column) for column in zip(*rows)] if how == "sum" else list(rows[0])
                continue
            values = [r[a] for r in ranks]
            totals = [r[a + 1] for r in ranks]
            if how == "mean":
                out[key] = sum(values) / len(values)
            elif how == "sum":
                out[key] = sum(values)
            elif how == "max":
                out[key] = max(values)
            elif how == "min":
                out[key] = min(values)
            elif how == "fraction":
                out[key] = sum(values) / max(sum(totals), 1e-12)
            elif how == "each":
                out.update({f"{key}{rank}": value for rank, value in enumerate(values)})
            else:
                out[key] = values[0]
        return out


def keep_steps_up_to(path: Path, step: int) -> None:
    """Drop the rows of steps after ``step`` (written before a crash, to be logged again after the resume), so
    every step appears once; a fresh run (step 0) starts an empty file. Atomic: a crash here loses nothing."""
    if not path.exists():
        return
    rows = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                rows.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by the crash
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(row + "\n" for row in rows))
    os.replace(tmp, path)


# What the bar / the progress line shows, and under which name.
SHOWN = {"loss": "loss", "reward/mean": "reward", "accuracy": "accuracy", "kl": "kl", "grad_norm": "grad_norm",
         "time/step": "step"}


class Tracker:
    def __init__(self, logging_cfg, output_dir: str | Path, config: dict, is_main: bool, total_steps: int, *,
                 start_step: int = 0, label: str = "train"):
        self.cfg = logging_cfg
        self.is_main = is_main
        self.output_dir = Path(output_dir)
        self.jsonl = self.output_dir / "metrics.jsonl"
        self.run = None
        self.bar = None
        self.total_steps, self.label = total_steps, label
        if not is_main:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "samples.jsonl"):
            if is_main:
                keep_steps_up_to(self.output_dir / name, start_step)
        if logging_cfg.wandb_mode != "disabled":
            import wandb

            id_file = self.output_dir / "wandb_run_id"
            run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
            id_file.write_text(run_id)
            os.environ.setdefault("WANDB_DIR", str(self.output_dir))
            self.run = wandb.init(project=logging_cfg.project, name=logging_cfg.run_name or None,
                                  tags=list(logging_cfg.tags) or None, mode=logging_cfg.wandb_mode, config=config,
                                  dir=str(self.output_dir), id=run_id, resume="allow")
        if logging_cfg.progress_bar:
            self.bar = tqdm(total=total_steps, initial=start_step, desc=label, unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict) -> None:
        if not self.is_main:
            return
        with self.jsonl.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.run is not None:
            self.run.log(metrics, step=step)
        shown = {name: metrics[key] for key, name in SHOWN.items() if key in metrics}
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix({k: f"{v:.3f}" for k, v in shown.items() if k != "step"})
        else:  # no bar (SLURM logs): one line per logged step
            logging.getLogger("app.progress").info(
                "%s step %d/%d | %s", self.label, step, self.total_steps,
                " | ".join(f"{k} {v:.4g}" if k != "step" else f"{v:.2f} s/step" for k, v in shown.items()))

    def log_samples(self, step: int, rows: list[dict]) -> None:
        if not self.is_main or not rows:
            return
        with (self.output_dir / "samples.jsonl").open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")
        if self.run is not None:
            import wandb

            columns = list(rows[0])
            self.run.log({"samples": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])},
                         step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.run is not None:
            self.run.finish()


# Third-party loggers that write one INFO line per decoded item (which breaks the progress bar into hundreds of
# lines): on the console they show warnings only; their INFO lines go to the run's log file when there is one.
CHATTY_LOGGERS = ("qwen_vl_utils", "qwen_vl_utils.vision_process")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _not_chatty(record) -> bool:
    return record.levelno >= logging.WARNING or not record.name.startswith(CHATTY_LOGGERS)


def _console_worthy(record) -> bool:
    """Detail lines (``extra={"detail": True}``: every skipped record past the first few) go to the log file only."""
    return not getattr(record, "detail", False)


def configure_logging(log_file: Path | None = None, rank: int = 0) -> None:
    """Console logging at INFO on rank 0 and WARNING on the other ranks (each INFO line once, not once per rank);
    per-item third-party INFO and detail lines to ``log_file`` (or dropped)."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler:
            handler.setLevel(logging.INFO if rank == 0 else logging.WARNING)
            for check in (_not_chatty, _console_worthy):
                if check not in handler.filters:
                    handler.addFilter(check)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file)
        file_handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logging.getLogger().addHandler(file_handler)
