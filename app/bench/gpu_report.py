"""Merge what scripts/gpu_check.sh produced into one report: report.json + report.md.

    python -m app.bench.gpu_report RAW_DIR REPORT_DIR
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from app.bench.common import environment


def test_results(junit: Path) -> list[dict]:
    if not junit.is_file():
        return []
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
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


def main(raw: str, report: str) -> None:
    raw_dir, out = Path(raw), Path(report)
    out.mkdir(parents=True, exist_ok=True)
    tests = test_results(raw_dir / "tests.xml")
    benches = {}
    for name in ("flex_shapes", "attention", "rollout", "gpu_real_shape"):
        path = raw_dir / name / f"{name}.json"
        if path.is_file():
            benches[name] = json.loads(path.read_text())
    env = environment()
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    try:
        import flash_attn

        env["flash_attn"] = flash_attn.__version__
    except ImportError:
        env["flash_attn"] = None
    payload = {"environment": env, "tests": tests, "benchmarks": benches}
    (out / "report.json").write_text(json.dumps(payload, indent=2))
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    lines = [f"# GPU acceptance report: {env['device']}", "",
             f"torch {env['torch']}, transformers {env['transformers']}, CUDA {env.get('cuda')}, "
             f"flash-attn {env['flash_attn']}, commit {env['commit']}, {env['date']}", "",
             "## Tests (tests/test_gpu.py)", "",
             ", ".join(f"{v} {k}" for k, v in counts.items()), "", "| test | outcome | s | detail |", "|---|---|---|---|"]
    lines += [f"| {t['test']} | {t['outcome']} | {t['seconds']:.1f} | {t['detail'].splitlines()[0] if t['detail'] else ''} |"
              for t in tests]
    for name, bench in benches.items():
        lines += ["", f"## Benchmark: {name}", ""]
        md = Path(raw) / name / f"{name}.md"
        lines.append(md.read_text() if md.is_file() else json.dumps(bench.get("summary", {})))
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:3])
