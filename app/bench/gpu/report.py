"""Merge what the GPU acceptance (``app.bench.gpu.check``) produced into one report: report.json + report.md.

    python -m app.bench.gpu.report RAW_DIR REPORT_DIR

The parts' status (ok, failed, timed out, skipped) with their last error line, the GPU tests' outcomes, and each
part's own table, as far as it got.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from app.bench.common import environment, markdown_table

RESULTS = (("qwen3_5", "gpu_hybrid"), ("varlen", "gpu_varlen"), ("full_depth", "full_depth"),
           ("train", "gpu_real_shape"), ("decode", "gpu_decode"), ("rehearsal", "rehearsal"),
           ("hf_compiled", "gpu_decode_hf_compiled"), ("host_decode", "host_decode"), ("moe", "gpu_moe"),
           ("ep", "gpu_ep"))


def test_results(junit: Path) -> list[dict]:
    """Each test's outcome from pytest's JUnit XML; without it (pytest killed at its time limit), from the verbose
    log beside it (tests.log: ``path::name PASSED``), the unfinished test named as such."""
    if not junit.is_file():
        return results_from_log(junit.with_name("tests.log"))
    rows = []
    try:
        cases = list(ET.parse(junit).getroot().iter("testcase"))
    except ET.ParseError:  # a run killed while writing it
        return []
    for case in cases:
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                detail = (node.get("message") or "")[:300]
                break
        else:
            detail = ""
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                     "seconds": float(case.get("time") or 0), "detail": detail})
    return rows


def results_from_log(log: Path) -> list[dict]:
    if not log.is_file():
        return []
    import re

    rows, running = [], None
    for line in log.read_text(errors="replace").splitlines():
        found = re.match(r"^(tests/\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR)", line)
        if found:
            rows.append({"test": found[1], "outcome": found[2].lower().replace("error", "error"), "seconds": 0.0,
                         "detail": ""})
            running = None
        elif re.match(r"^tests/\S+::\S+", line):
            running = line.split()[0]
    if running:
        rows.append({"test": running, "outcome": "unfinished", "seconds": 0.0, "detail": "the part's time ran out"})
    return rows


def write(raw: Path, out: Path, parts: list[dict], quiet: bool = False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    tests = test_results(raw / "tests.xml")
    results = {}
    for part, name in RESULTS:
        path = raw / name / f"{name}.json"
        if path.is_file():
            results[part] = json.loads(path.read_text())
    env = environment()
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    try:
        import flash_attn

        env["flash_attn"] = flash_attn.__version__
    except ImportError:
        env["flash_attn"] = None
    payload = {"environment": env, "parts": parts, "tests": tests, "results": results}
    (out / "report.json").write_text(json.dumps(payload, indent=2))
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped", "unfinished")}
    lines = [f"# GPU acceptance report: {env['device']}", "",
             f"torch {env['torch']}, transformers {env['transformers']}, CUDA {env.get('cuda')}, "
             f"flash-attn {env['flash_attn']}, commit {env['commit']}, {env['date']}", "",
             "## Parts (scripts/gpu_check.sh)", "",
             markdown_table(parts, ["part", "status", "seconds", "limit", "last_line"], {"seconds": ".0f"}), "",
             "## Tests (tests/test_gpu.py)", "", ", ".join(f"{v} {k}" for k, v in counts.items()), "",
             "| test | outcome | s | detail |", "|---|---|---|---|"]
    lines += [f"| {t['test']} | {t['outcome']} | {t['seconds']:.1f} | "
              f"{t['detail'].splitlines()[0] if t['detail'] else ''} |" for t in tests]
    for part, name in RESULTS:
        md = raw / name / f"{name}.md"
        if md.is_file():
            lines += ["", f"## {part} ({name})", "", md.read_text()]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    if not quiet:
        print("\n".join(lines))
    return payload


def main(raw: str, report: str) -> None:
    parts_file = Path(raw) / "parts.json"
    parts = json.loads(parts_file.read_text()) if parts_file.is_file() else []
    write(Path(raw), Path(report), parts)


if __name__ == "__main__":
    main(*sys.argv[1:3])
