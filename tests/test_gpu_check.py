"""The GPU acceptance's runner (app/bench/gpu/check.py) without a GPU: every part under its own time limit, a part
that fails or hangs becomes a row with its last error line (its child processes killed with it), the budget skips
what it cannot hold, and the report is written whatever happened."""

from __future__ import annotations

import json
import subprocess

import pytest

from app.bench.gpu import check as gpu_check
from app.bench.gpu.check import Part

ROOT = gpu_check.ROOT


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits for whoever adopts it to reap it)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_parts_run_under_limits_and_the_report_is_always_written(tmp_path, monkeypatch):
    worker = "tests.workers.gpu_check_part"
    monkeypatch.setattr(gpu_check, "PARTS", (
        Part("ok", 30, (worker, "ok"), quick_limit=30),
        Part("fail", 30, (worker, "fail"), quick_limit=30),
        Part("hang", 3, (worker, "hang"), quick_limit=3),
        Part("late", 30, (worker, "ok"), quick_limit=30),
    ))
    raw, report = tmp_path / "raw", tmp_path / "report"
    code = gpu_check.main(["--quick", "--budget", "12", "--raw", str(raw), "--report", str(report)])
    assert code == 1
    rows = {r["part"]: r for r in json.loads((report / "report.json").read_text())["parts"]}
    assert rows["ok"]["status"] == "ok" and "last_line" not in rows["ok"]
    assert rows["fail"]["status"] == "failed" and "ValueError: the part's own error" in rows["fail"]["last_line"]
    assert rows["hang"]["status"] == "timed out" and rows["hang"]["seconds"] < 20
    child = int((raw / "hang.log").read_text().split("child ")[1].split()[0])
    assert not running(child)  # the part's own children went with it
    assert rows["late"]["status"] in ("ok", "skipped")  # whatever the budget left
    md = (report / "report.md").read_text()
    assert "| hang | timed out |" in md and "| fail | failed |" in md


def test_without_cuda_nothing_runs_unless_quick(tmp_path):
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--raw", str(tmp_path / "raw")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "no CUDA device" in result.stdout
    assert not (tmp_path / "raw").exists()


@pytest.mark.slow  # every part at toy sizes on this CPU (about 2.5 minutes): make test-all (CI) runs it
def test_the_whole_acceptance_runs_quick_here(tmp_path):
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--quick", "--raw", str(tmp_path / "raw"), "--report",
                             str(tmp_path / "report")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    payload = json.loads((tmp_path / "report" / "report.json").read_text())
    assert [r["status"] for r in payload["parts"]] == ["ok"] * 5
    assert {"train", "decode", "rehearsal", "hf_compiled"} <= set(payload["results"])
    compiled = payload["results"]["hf_compiled"]["hf_static_compiled"]
    assert compiled["grouped_s"] > 0 and ("hf_static_s" in compiled or compiled["error"])  # a time, or why not
    assert "static cache and torch.compile" in (tmp_path / "report" / "report.md").read_text()
    rehearsal = payload["results"]["rehearsal"]
    assert all(stage["exit"] == 0 for stage in rehearsal["stages"].values())
    assert len({r["step"] for r in rehearsal["phases"]}) == 2  # two GRPO steps through scripts/train.sh
    assert rehearsal["eval_summary"]["overall"]["count"] == 2
    assert result.stdout.count("[gpu_check") == 10  # one line when each part starts, one when it ends
