"""GPU acceptance in one command, within a time budget: each part in its own process under its own time limit, one
line of progress per part, and the report (report.json + report.md) written after every part, whatever happened.

    scripts/gpu_check.sh [--quick] [--budget SECONDS] [--parts a,b] [--report DIR] [--raw DIR]

Parts, in order (limits in seconds; a part never runs past what is left of ``--budget``, default 540); without
``--parts`` it runs ``qwen3_5``, ``varlen``, ``decode``, ``full_depth`` and ``hf_compiled``:

| part | what | limit |
|---|---|---|
| qwen3_5 | app.bench.gpu.hybrid: Qwen3.5 at the 9B width, 4 layers (3 GDN + 1 attention): which GDN kernels ran and fla's initial-state gradient against the torch path's, grouped vs repeated forward+backward at 8k / 16k (G = 8), the decode step against the bandwidth limit with every sample's GDN states | 120 |
| varlen | app.bench.gpu.varlen: torch's varlen flash kernel against the paths it replaces at 7B width: the decode step at 28 layers (8k / 16k / 64k, a k = 6 family on a 64k video) against the bandwidth limit, the 64k chunked prefill, the tower over 64 and 640 frames (one call per block against the per-chunk loop), one policy forward+backward with flash on the kernel against flex; the points calibrate --merge takes | 150 |
| full_depth | app.bench.gpu.full_depth: the 7B LoRA config at 28 layers through train.sh (6 steps, the rollout's parts per step), plan.sh and eval.sh; the TRL-style run (repeated + HF generate, 2 steps); k = 4 against k = 1; the planner beside each | 420 |
| tests | tests/test_gpu.py (GPU-only tests, wandb not needed) | 150 |
| train | app.bench.gpu.real_shape: Qwen2.5-VL-7B / Qwen3-VL-8B width, 4 layers, 8k/16k prefixes | 75 |
| decode | app.bench.gpu.decode: 7B width, 28 layers: the decode step (graph, compiled, eager) vs the bandwidth limit, rollouts vs HF | 75 |
| rehearsal | app.bench.gpu.rehearsal: train.sh 3 GRPO steps + plan.sh + eval.sh at 7B width, 4 layers | 150 |
| hf_compiled | app.bench.gpu.decode --hf-compiled-only --layers 4: HF generate, static cache + torch.compile, its compile time apart | 45 |
| moe | app.bench.gpu.moe: Qwen3-VL-30B-A3B at full width, 4 sparse layers (128 experts, top-8): grouped_mm against eager experts, the bf16 self-check (tokens routed elsewhere, replayed or not), grouped vs repeated forward+backward at 8k / 16k (G = 8), routing replay (graph-decode recording against eager, the bf16 mismatch off / r3); by --parts only (the default parts fill the budget): run it as its own call, `--parts moe` | 210 |
| qsa | app.bench.gpu.qsa: Qwen3.8-Flash-Next at its released width, 2 layers (GDN + PLE, QSA; 512 experts top-10): the bf16 self-check (QSA keys and PLE n-grams exact, ties counted), grouped vs repeated forward+backward at 8k / 16k (G = 8); the PLE table cut to a 100k base; by --parts only | 240 |
| ep | app.bench.gpu.expert_parallel: on a host with 2 or more GPUs, Qwen3-VL-30B-A3B at full width (2 sparse layers), ZeRO-3 alone against expert parallelism over all its GPUs: a training step, a rollout, the bytes of each collective, the peak; a row saying so on one GPU; by --parts only | 300 |
| host_decode | app.bench.video.host_decode (no GPU): the data path per rank on the device machine's cores, S = 1, 2, 4 x 1 and 2 decoding threads; the 2-thread wall-time goal, which 2 cores cannot show | 480 |

A part that fails or runs out of time is a row saying so, with its last error line; its own report (JSON + table)
holds every point it measured before that. ``--quick`` runs every part on this machine at toy sizes (each module's
``--quick``) with short limits, into outputs/gpu_quick, so the script can be tried without a GPU. Without CUDA and
without ``--quick`` nothing runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from app.bench.common import ROOT, child_env


@dataclass(frozen=True)
class Part:
    name: str
    limit: int  # seconds
    args: tuple[str, ...]  # after ``python -m``; {raw} is the raw output folder
    quick_limit: int = 240


PARTS = (
    Part("qwen3_5", 120, ("app.bench.gpu.hybrid", "--out", "{raw}/gpu_hybrid")),
    Part("varlen", 150, ("app.bench.gpu.varlen", "--out", "{raw}/gpu_varlen")),
    Part("full_depth", 420, ("app.bench.gpu.full_depth", "--out", "{raw}/full_depth"), quick_limit=900),
    Part("tests", 150, ("pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py", "-rA",
                       "--junitxml", "{raw}/tests.xml")),
    Part("train", 75, ("app.bench.gpu.real_shape", "--out", "{raw}/gpu_real_shape")),
    Part("decode", 75, ("app.bench.gpu.decode", "--out", "{raw}/gpu_decode")),
    Part("rehearsal", 150, ("app.bench.gpu.rehearsal", "--out", "{raw}/rehearsal")),
    Part("hf_compiled", 45, ("app.bench.gpu.decode", "--hf-compiled-only", "--layers", "4", "--out",
                             "{raw}/gpu_decode_hf_compiled")),
    Part("moe", 210, ("app.bench.gpu.moe", "--out", "{raw}/gpu_moe")),  # by --parts (issues 88's and 89's figures)
    Part("qsa", 240, ("app.bench.gpu.qsa", "--out", "{raw}/gpu_qsa")),  # by --parts: Qwen3.8-Flash-Next (issue 99)
    # expert parallelism over every GPU of a host with 2 or more (issue 90's figures): by --parts only
    Part("ep", 300, ("app.bench.gpu.expert_parallel", "--out", "{raw}/gpu_ep")),
    # the host's decoding on the device machine's 16 cores (issue 76's 2-thread goal; no GPU used): by --parts only
    Part("host_decode", 480, ("app.bench.video.host_decode", "--out", "{raw}/host_decode")),
)
DEFAULT_BUDGET = 540  # 9 minutes: qwen3_5, varlen, decode, full_depth (what is left), hf_compiled (others by --parts)
DEFAULT_PARTS = ("qwen3_5", "varlen", "decode", "full_depth", "hf_compiled")


def last_error_line(log: Path) -> str:
    """The last line that names an error (else the last line) of a part's output."""
    if not log.is_file():
        return ""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error:" in line or "FAILED" in line or "Traceback" in line:
            return line[-400:]
    return lines[-1][-400:] if lines else ""


def run_part(part: Part, limit: float, raw: Path, quick: bool) -> dict:
    """Run one part in its own process group; kill the group at ``limit`` seconds."""
    args = [a.format(raw=raw) for a in part.args] + (["--quick"] if quick and part.name != "tests" else [])
    log = raw / f"{part.name}.log"
    start = time.perf_counter()
    with log.open("w") as f:
        process = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                   env=child_env(PYTHONUNBUFFERED="1", WANDB_MODE="disabled"), start_new_session=True)
        try:
            code = process.wait(timeout=limit)
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            stop(process)
            code, status = None, "timed out"
    seconds = time.perf_counter() - start
    row = {"part": part.name, "status": status, "exit": code, "seconds": round(seconds, 1), "limit": round(limit),
           "log": log.name}
    if status != "ok":
        row["last_line"] = last_error_line(log)
    return row


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the part's whole process group (it may have children: launchers, engines), SIGKILL 10 s later."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="toy sizes on this machine, into outputs/gpu_quick")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds for all parts together")
    parser.add_argument("--parts", default="", help="comma-separated subset of: " + ", ".join(p.name for p in PARTS))
    parser.add_argument("--report", default="", help="where report.json/report.md go (default docs/gpu/latest)")
    parser.add_argument("--raw", default="", help="where each part's log and results go (default outputs/gpu)")
    args = parser.parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine; nothing was run (--quick tries the script here).")
        return 0
    raw = Path(args.raw or ("outputs/gpu_quick" if args.quick else "outputs/gpu")).resolve()
    report = Path(args.report or ("outputs/gpu_quick/report" if args.quick else "docs/gpu/latest")).resolve()
    raw.mkdir(parents=True, exist_ok=True)
    names = args.parts.split(",") if args.parts else DEFAULT_PARTS
    chosen = sorted((p for p in PARTS if p.name in names), key=lambda p: list(names).index(p.name))
    unknown = set(filter(None, args.parts.split(","))) - {p.name for p in PARTS}
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}; known: {[p.name for p in PARTS]}")
    from app.bench.gpu.report import write

    rows: list[dict] = []
    started = time.perf_counter()
    for number, part in enumerate(chosen, 1):
        left = args.budget - (time.perf_counter() - started)
        limit = min(part.quick_limit if args.quick else part.limit, left)
        if left < 5:
            rows.append({"part": part.name, "status": "skipped", "limit": 0,
                         "last_line": f"the budget of {args.budget:.0f} s was spent"})
            print(f"[gpu_check {number}/{len(chosen)}] {part.name}: skipped (budget spent)", flush=True)
            continue
        print(f"[gpu_check {number}/{len(chosen)}] {part.name}: running (limit {limit:.0f} s)", flush=True)
        row = run_part(part, limit, raw, args.quick)
        rows.append(row)
        print(f"[gpu_check {number}/{len(chosen)}] {part.name}: {row['status']} in {row['seconds']:.0f} s"
              + (f" - {row['last_line']}" if row.get("last_line") else ""), flush=True)
        write(raw, report, rows, quiet=True)
    (raw / "parts.json").write_text(json.dumps(rows, indent=2))
    write(raw, report, rows, quiet=True)
    print(f"gpu_check: {sum(r['status'] == 'ok' for r in rows)} of {len(rows)} parts ok in "
          f"{time.perf_counter() - started:.0f} s; report in {report}", flush=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
