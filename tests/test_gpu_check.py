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
    code = gpu_check.main(["--quick", "--budget", "12", "--parts", "ok,fail,hang,late", "--raw", str(raw), "--report",
                           str(report)])
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


@pytest.mark.slow  # the default parts at toy sizes on this CPU (about 3 minutes): make test-all (CI) runs it
def test_the_whole_acceptance_runs_quick_here(tmp_path):
    """scripts/gpu_check.sh --quick: the qwen3_5 part (the GDN kernels chosen, grouped vs repeated, the decode step
    with its states), the varlen part (the kernel against the paths it replaces; the training pass
    says why it does not run off CUDA), the full-depth part (the rehearsal through the launchers with the rollout's
    parts per step, the TRL-style run, k = 4 against k = 1, the planner beside each), the decode part (graph or
    static, compiled, eager) and HF generate compiled, their report written."""
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--quick", "--raw", str(tmp_path / "raw"), "--report",
                             str(tmp_path / "report")], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    payload = json.loads((tmp_path / "report" / "report.json").read_text())
    assert [r["part"] for r in payload["parts"]] == ["qwen3_5", "varlen", "decode", "full_depth", "hf_compiled"]
    assert [r["status"] for r in payload["parts"]] == ["ok"] * 5
    hybrid = payload["results"]["qwen3_5"]
    assert hybrid["kernels"]["kernels"] == "torch" and "does not run here" in hybrid["kernels"]["note"]
    assert [r["prefix"] for r in hybrid["train"]] == [256] and hybrid["train"][0]["max_logprob_diff"] < 1e-4
    assert hybrid["decode"][0]["step_ms"] > 0 and hybrid["decode"][0]["state_bytes"] > 0
    varlen = payload["results"]["varlen"]
    assert {(r["prefix"], r["kernel"]) for r in varlen["decode"]} >= {(64, True), (64, False)}
    assert {r["attention"] for r in varlen["tower"]} == {"torch_flash_varlen", "sdpa"}
    assert varlen["points"]["decode_steps"] and varlen["points"]["tower_passes"]
    assert [r["backend"] for r in varlen["train"]] == ["flash"] and "does not run here" in varlen["train"][0]["error"]
    full = payload["results"]["full_depth"]
    assert full["stages"]["eval"]["exit"] == 0
    for name in ("rehearsal", "trl_style", "k1", "k4"):
        assert full[name]["launch"]["exit"] == 0 and len(full[name]["rollouts"]) == 2, name
        assert all(r["decode"] > 0 and r["other_share"] < 0.25 for r in full[name]["rollouts"]), name
        assert {row["what"] for row in full[name]["beside_planner"]} >= {"rollout", "update", "step"}, name
    assert "step_vs_grouped" in full["trl_style"] and "k4_vs_k1" in full
    modes = {row["decode"] for row in payload["results"]["decode"]["steps"]}
    assert modes == {"static", "compiled", "eager"}
    assert not (tmp_path / "raw" / "full_depth" / "rehearsal" / "checkpoints").exists()  # the disk given back
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Full depth" in md and "beside the planner" in md
    compiled = payload["results"]["hf_compiled"]["hf_static_compiled"]
    assert compiled["grouped_s"] > 0 and ("hf_static_s" in compiled or compiled["error"])  # a time, or why not
    # one line when each part starts, one when it ends
    assert result.stdout.count("[gpu_check") == 2 * len(payload["parts"])


@pytest.mark.slow  # one part at toy sizes in its own process (about 20 s)
def test_the_moe_part_runs_quick_here(tmp_path):
    """scripts/gpu_check.sh --quick --parts moe: grouped_mm against eager experts (equal log-probs), the self-check on
    the MoE model (passed, the tokens routed elsewhere counted), grouped vs repeated, routing replay's recording
    rollout and mismatch; its report in report.md."""
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--quick", "--parts", "moe", "--raw", str(tmp_path / "raw"),
                             "--report", str(tmp_path / "report")], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    payload = json.loads((tmp_path / "report" / "report.json").read_text())
    assert [(r["part"], r["status"]) for r in payload["parts"]] == [("moe", "ok")]
    moe = payload["results"]["moe"]
    assert [r["implementation"] for r in moe["experts"]] == ["grouped_mm", "eager"]
    assert moe["experts"][1]["max_logprob_diff_vs_first"] < 1e-4
    check = moe["self_check"][0]
    assert check["passed"] and check["real_tokens"] > 0 and check["flipped_tokens"] is not None
    assert moe["train"][0]["max_logprob_diff"] < 1e-4 and moe["train"][0]["time_ratio"] > 0
    replay = moe["replay"][0]  # routing replay: static steps record as eager ones do; fp32: no token routed apart
    assert replay["tokens_equal"] and replay["records_apart"] == 0 and replay["routed_apart_off"] == 0, replay
    assert replay["recording_s"] > 0 and replay["mean_r3"] < 1e-4
    assert "Qwen3-VL-MoE at tiny width" in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.slow  # in process at toy sizes (about 10 s)
def test_the_qsa_part_runs_quick_here(tmp_path):
    """scripts/gpu_check.sh --parts qsa (Qwen3.8-Flash-Next) at toy sizes: the self-check passes with no token routed
    apart, grouped vs repeated agree, and grouped holds less than repeated; its table names the layer kinds."""
    from app.bench.gpu.qsa import run

    payload = run(tmp_path, quick=True)
    check = payload["self_check"][0]
    assert check["passed"] and check["real_tokens"] > 0 and check["flipped_tokens"] == 0, check
    train = payload["train"][0]
    assert train["max_logprob_diff"] < 1e-4 and train["peak_gib_grouped"] < train["peak_gib_repeated"], train
    assert "(GDN + PLE, QSA)" in (tmp_path / "gpu_qsa.md").read_text()


def test_the_expert_parallel_part_says_so_on_a_host_without_two_gpus(tmp_path):
    """app.bench.gpu.expert_parallel (scripts/gpu_check.sh --parts ep) off --quick on a host with fewer than 2 GPUs
    (this CPU: none) runs nothing and writes a report saying why; its --quick is scripts/bench.sh ep --quick
    (tests/test_bench.py)."""
    from app.bench.gpu.expert_parallel import run

    payload = run(tmp_path, quick=False)
    assert payload["skipped"].startswith("expert parallelism needs 2 or more GPUs; this host has")
    assert "nothing was run" in (tmp_path / "gpu_ep.md").read_text()

