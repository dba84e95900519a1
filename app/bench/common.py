"""Shared benchmark plumbing: environment record, isolated child runs (peak memory per point), reports."""

from __future__ import annotations

import importlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def flush_denormals() -> bool:
    """Flush-to-zero on CPU: denormal floats made elementwise ops ~20x slower and distorted CPU timings."""
    return bool(torch.set_flush_denormal(True))


FLUSH_DENORMAL = flush_denormals()  # every benchmark imports this module, and so do its child processes


def environment() -> dict:
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except OSError:
        commit = ""
    env = {"machine": platform.platform(), "processor": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
           "transformers": transformers.__version__, "commit": commit,
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "flush_denormal": FLUSH_DENORMAL}
    return env


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def peak_memory_mb() -> float:
    """Peak memory of this process: CUDA max allocated on GPU, peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a benchmark's child process: this one's, with the repository put in front of any
    PYTHONPATH already set (packages installed with ``pip --target`` stay importable in the child)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


# glibc keeps freed blocks under its dynamic mmap threshold (up to 32 MB) in the heap, so a process's resident peak
# also counts memory no tensor holds any more, more so for the smaller tensors of a split workload (measured: the
# long_video benchmark's S = 2 rank at 16k tokens peaked 1.25/S above S = 1 by default, 1.01/S with this). The
# long_video benchmark runs its points with blocks above 64 KiB mmapped and returned on free: its resident figure
# then follows the live tensors, as a GPU's max_memory_allocated does.
LIVE_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def isolated(target: str, here: bool = False, **kwargs) -> dict:
    """Run ``module:function(**kwargs)`` in a fresh interpreter; return its dict plus that process's peak memory.
    ``here`` (a benchmark's ``--quick`` smoke run: every code path, no figure read): in this process instead, without
    a child's imports; its peak memory is then this process's, everything before the point included."""
    if here:
        return _called(target, kwargs)
    result = subprocess.run([sys.executable, "-m", "app.bench.common", target, json.dumps(kwargs)], cwd=ROOT,
                            capture_output=True, text=True, timeout=3600, env=child_env())
    if result.returncode != 0:
        how = f"was killed by signal {-result.returncode}" if result.returncode < 0 else \
            f"exited {result.returncode}"
        if result.returncode == -9:
            how += " (SIGKILL: most often the kernel's out-of-memory killer; see dmesg)"
        raise RuntimeError(f"{target}({kwargs}) {how}:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def attempt(target: str, **kwargs) -> dict:
    """``isolated``, but a point whose process fails (killed for memory, an error, over an hour) comes back as
    ``{"error": why}``: the first line (what ran, how it ended) and the child's last line. A benchmark of many points
    then keeps the ones before and after it and says which point failed, instead of losing the whole run."""
    try:
        return isolated(target, **kwargs)
    except subprocess.TimeoutExpired:
        return {"error": f"{target} ran past its time limit (3600 s)"}
    except RuntimeError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return {"error": lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"}


def point(target: str, quick: bool, **kwargs) -> dict:
    """One benchmark point: in its own process (``attempt``: its memory apart, a failure kept to the point), or under
    ``--quick`` (the suite's smoke run: every code path, no figure read) in this one, without a child's imports. A
    point that fails comes back as ``{"error": why}`` either way."""
    if not quick:
        return attempt(target, **kwargs)
    try:
        return _called(target, kwargs)
    except Exception as error:  # noqa: BLE001 - the point's failure is its row, as attempt reports a child's
        return {"error": f"{target}: {type(error).__name__}: {error}"}


def failed_points(lines: list[str]) -> str:
    """The end of a report whose points ``attempt`` ran: the ones that failed, one line each, or nothing."""
    return "\n\nPoints that failed (blank cells above):\n" + "\n".join(lines) if lines else ""


def exit_if_failed(failed: int, total: int, out: Path) -> None:
    """Exit non-zero after the report is written when a point failed: the run is kept, but not called a success."""
    if failed:
        raise SystemExit(f"{failed} of {total} points failed (their rows say why); the report in {out} keeps the others")


def timed(fn, repeats: int = 3, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` after warm-up runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def markdown_table(rows: list[dict], columns: list[str], formats: dict | None = None) -> str:
    formats = formats or {}
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for c in columns:
            value = row.get(c, "")
            cells.append(format(value, formats[c]) if c in formats and isinstance(value, (int, float)) else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_metrics(run_dir: Path) -> list[dict]:
    """A training run's logged steps (its ``metrics.jsonl``, one dict a line); [] before its first step."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def write_report(out: Path, name: str, payload: dict, table: str, *, quiet: bool = False) -> Path:
    """``name``.json (the environment and ``payload``) and ``name``.md (``table``) under ``out``; the table printed
    unless ``quiet`` (a part that rewrites its report after every point, so a run cut short still has one)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"environment": environment(), **payload}, indent=2))
    (out / f"{name}.md").write_text(table + "\n")
    if not quiet:
        print(table, flush=True)
    return out / f"{name}.json"


def cli(run, doc: str, default_out: str, argv: list[str] | None = None) -> None:
    """The command line every benchmark shares: --out DIR, --quick."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (for tests)")
    args = parser.parse_args(argv)
    run(Path(args.out), args.quick)


def plan_here(args: list[str], log: Path) -> dict:
    """``scripts/plan.sh ARGS`` as its command line in this process (``app.planning.plan.main``), its output to
    ``log``: what a ``--quick`` run does (an interpreter start saved a plan); -> seconds, exit code and, on an
    error, the log's last line."""
    import contextlib

    from app.planning.plan import main

    start, code = time.perf_counter(), 0
    with log.open("w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        try:
            main(args)
        except SystemExit as error:
            code = error.code if isinstance(error.code, int) else 1
    print(f"plan: exit {code} in {time.perf_counter() - start:.1f} s (in this process)", flush=True)
    last = (log.read_text(errors="replace").strip().splitlines() or [""])[-1]
    return {"seconds": time.perf_counter() - start, "exit": code, **({"last_error": last[-400:]} if code else {})}


def _called(target: str, kwargs: dict) -> dict:
    """``module:function(**kwargs)`` in this process, with this process's peak memory."""
    module, function = target.split(":")
    result = getattr(importlib.import_module(module), function)(**kwargs)
    result["peak_memory_mb"] = peak_memory_mb()
    return result


def _child() -> None:
    print(json.dumps(_called(sys.argv[1], json.loads(sys.argv[2]))))


if __name__ == "__main__":
    _child()
