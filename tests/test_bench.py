"""The benchmark code paths on tiny shapes, so they don't rot. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from app.bench.grid import analytic, bench_model, count_flops

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("prefix", "suffix", "group"), [(64, 16, 2), (128, 256, 4)])
def test_counted_flops_equal_the_analytic_formula(prefix, suffix, group):
    config = bench_model(meta=True).config
    for variant in ("repeated", "paper", "packed"):
        counted = count_flops(prefix, suffix, group, variant)
        assert counted == pytest.approx(analytic(prefix, suffix, group, config, variant), rel=0.02)
    assert count_flops(prefix, suffix, group, "paper") < count_flops(prefix, suffix, group, "repeated")


@pytest.mark.slow  # smoke runs of the benchmark scripts: make test-all (CI) runs them. Not here: gpu_real_shape (its
# quick run is part of tests/test_gpu_check.py's acceptance run), planner_accuracy and real_width (their points are
# tests/test_planner_accuracy.py's and tests/test_plan.py's checks; their reports, the failed-point test below)
@pytest.mark.parametrize("name", ["attention", "rollout", "grid", "e2e", "flex_shapes", "scale", "lora",
                                  "vision_cache", "long_video", "long_prefill", "judge", "tree", "shared_video",
                                  "long_rehearsal", "hybrid", "moe", "qsa", "qsa_grouping", "mismatch", "replay",
                                  "rollout --family qwen3_5 --no-hf",
                                  "host_decode", "ep"])
def test_benchmark_runs_quick(name, tmp_path):
    name, *extra = name.split()
    out = tmp_path / name
    result = subprocess.run(["bash", "scripts/bench.sh", name, "--out", str(out), "--quick", *extra], cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / f"{name}.json").read_text())
    assert report["environment"]["torch"] and "commit" in report["environment"]
    assert (out / f"{name}.md").read_text().count("|") > 10
    if extra:  # Qwen3.5 in bfloat16, the grouped engine (vLLM is left out of --quick)
        assert report["family"] == "qwen3_5" and report["dtype"] == "bfloat16"
        assert all(row["grouped_s"] > 0 for row in report["rows"])
    if name == "grid":
        assert report["worst_flop_ratio_error"] <= 0.02
        assert (out / "grid_flops.png").is_file() and (out / "grid_memory.png").is_file()
    if name == "attention":
        assert report["max_abs_difference_vs_package"] < 1e-4
    if name == "qsa":  # transformers' indexer loop, the vectorised one, the grouped layer: every point ran
        assert {row["kind"] for row in report["rows"]} == {"reference", "ours", "grouped"}
        assert all(row["seconds"] > 0 and row["peak_memory_mb"] > 0 for row in report["rows"])
        shown = [line.split("|")[4].strip() for line in (out / "qsa.md").read_text().splitlines()
                 if line.startswith(("| reference", "| ours", "| grouped"))]  # the table shows every point's peak
        assert len(shown) == len(report["rows"]) and all(shown)
    if name == "long_rehearsal":  # 2 processes at S = 1 and 2, k = 2: 2 steps each, every rank's peaks
        rows = {(row["S"], row["k"]): row for row in report["rows"]}
        assert set(rows) == {(1, 2), (2, 2)} and all(row["exit"] == 0 and row["steps"] == 2 for row in rows.values())
        assert all(len(row[f"{stage}_above_gib_ranks"]) == 2 for row in rows.values() for stage in ("rollout", "policy"))
        assert all(row["shared_video_tokens"] > 0 for row in rows.values())
        spread = rows[(2, 2)]  # one family over S = 2: each rank did about half of S = 1's rank, both together all
        assert spread["prefill_tokens_group_vs_s1"] == pytest.approx(1.0, abs=0.02)
        assert spread["tower_patches_vs_s1"] <= 0.6 and spread["kv_bytes_vs_s1"] <= 0.55
    if name == "host_decode":  # every rank's share of one clip: S = 1, 2, 4 x 1 and 2 threads, 4 ranks each
        rows = {(row["S"], row["threads"]): row for row in report["rows"]}
        assert set(rows) == {(s, t) for s in (1, 2, 4) for t in (1, 2)} and (out / "host_decode.png").is_file()
        for (size, _), row in rows.items():
            assert len(row["ranks"]) == 4 and {r["grid"] == report["grid"] for r in row["ranks"]} == {True}
            held = sum(r["rows"] for r in row["ranks"][:size])  # one group's shares make the whole video
            assert held == rows[(1, 1)]["ranks"][0]["rows"] and row["plan_cpu_s"] > 0
            # the host's floor: the run's own CPU seconds over the cores, against one thread's wall time
            assert row["host_floor_vs_1_thread"] == pytest.approx(
                row["alone_cpu_s"] / report["cores"] / rows[(size, 1)]["alone_wall_s"])
    if name == "flex_shapes":
        assert report["summary"]["compiles_after_call_3"] == 0
        assert report["environment"]["flush_denormal"] is True
    if name == "scale":
        assert [r["variant"] for r in report["rollout"]][1:] == [f"ZeRO-3 zero3_gather={m}"
                                                                 for m in ("full", "layerwise", "per_step")]
        assert all(r["same_tokens"] for r in report["rollout"]) and report["rollout"][3]["all_gathers"] > 0
        assert all(r["loss_rel_diff"] < 1e-6 for r in report["logprob_memory"])
        assert report["prefetch"][1]["variant"] == "data.prefetch=1" and (out / "scale.png").is_file()
    if name == "long_video":
        assert {(r["S"], r["prefix"]) for r in report["rows"]} == {(s, p) for s in (1, 2) for p in (256, 512)}
        assert all(r["loss_rel_diff"] < 1e-5 for r in report["rows"]) and (out / "long_video.png").is_file()
    if name == "long_prefill":
        assert [r["setting"] for r in report["rows"]][:3] == ["whole", "prefill", "prefill+tower"]
        assert all(r["logits_diff"] < 1e-4 for r in report["rows"]) and (out / "long_prefill.png").is_file()
    if name == "tree":
        rows = {r["layout"]: r for r in report["rows"]}
        assert rows["tree"]["tokens_computed"] < rows["flat"]["tokens_computed"] < rows["paths"]["tokens_computed"]
        assert all(r["max_logprob_diff_vs_paths"] < 1e-4 for r in rows.values())
    if name == "shared_video":
        points = {r["k"]: r for r in report["points"]}
        assert set(points) == {1, 2} and (out / "shared_video.png").is_file()
        for phase in ("decode", "tower", "prefill", "reference", "policy"):
            assert points[2][f"{phase}_family_s"] > 0 and points[2][f"{phase}_apart_s"] > 0, phase
        assert points[2]["visual_tokens"] == 512 and points[2]["planned_tower"] == 0.5
    if name == "hybrid":  # Qwen3.5 beside Qwen2.5-VL, grouped against repeated, each point in its own process
        assert [(r["family"], r["prefix"]) for r in report["rows"]] == [("qwen3_5", 256), ("qwen2_5_vl", 256)]
        assert all(r["flop_ratio"] < 1 and r["seconds_grouped"] > 0 for r in report["rows"])
        assert (out / "hybrid.png").is_file()
    if name == "moe":  # each MoE family beside its dense model of the same active width, FLOPs through eager experts
        rows = {r["family"]: r for r in report["rows"]}
        assert list(rows) == ["qwen3_vl_moe", "qwen3_vl", "qwen3_5_moe", "qwen3_5"] and (out / "moe.png").is_file()
        for moe, dense in (("qwen3_vl_moe", "qwen3_vl"), ("qwen3_5_moe", "qwen3_5")):
            assert rows[moe]["flops_repeated"] == pytest.approx(rows[dense]["flops_repeated"], rel=0.02)
            assert rows[moe]["flop_ratio"] < 1 and rows[moe]["seconds_grouped"] > 0
    if name == "mismatch":  # the rollout's log-probs against the trainer's, both families, both dtypes
        rows = report["rows"]
        assert {(r["family"], r["dtype"]) for r in rows} == {(f, d) for f in ("qwen3_5", "qwen2_5_vl")
                                                            for d in ("float32", "bfloat16")}
        for r in rows:
            bound = 1e-4 if r["dtype"] == "float32" else 0.05  # fp32: the same numbers two ways; bf16: its rounding
            assert r["tokens"] == 4 * 16 and 0 <= r["mean_abs"] < bound and 1 <= r["max_ratio"], r
    if name == "replay":  # routing replay off / r3 on both MoE families and dtypes: every recorded token replayed
        rows = report["rows"]
        assert {(r["family"], r["dtype"]) for r in rows} == {(f, d) for f in ("qwen3_vl_moe:sharp", "qwen3_5_moe:wide")
                                                            for d in ("float32", "bfloat16")}  # wide: 128 experts; sharp: experts drawn wider
        for r in rows:
            top_k = 8 if r["family"].endswith(":wide") else 4  # 4 sparse layers either way; int16 ids
            assert r["record_bytes"] == (128 + 4 * 16) * 4 * top_k * 2, r
            assert r["routed_apart_r3"] == 0 and 0 <= r["routed_apart_off"] <= 1 and r["record_bytes"] > 0, r
            assert r["tokens"] == 4 * 16 and (r["dtype"] == "bfloat16" or r["mean_off"] < 1e-4), r
    if name == "ep":  # ZeRO-3 alone against EP = 2 (--quick; AutoEP at EP = 1 beside them in a full run): 2
        # processes each, the collectives' bytes counted
        rows = {r["variant"]: r for r in report["rows"]}
        assert list(rows) == ["zero3", "ep2"] and [r["ep"] for r in rows.values()] == [1, 2]
        assert rows["zero3"]["step_all_to_all_mb"] == 0
        assert rows["ep2"]["step_all_to_all_mb"] > 0 and rows["ep2"]["rollout_all_to_all_mb"] > 0
        # EP = 2 on 2 ranks: a rank's experts are partitioned over a group of one, never gathered
        assert rows["ep2"]["step_gather_mb"] < rows["zero3"]["step_gather_mb"] and (out / "ep.png").is_file()
    if name == "lora":
        full, adapters = report["rows"]
        assert full["separate_reference"] and not adapters["separate_reference"]
        assert adapters["trainable_m"] < full["trainable_m"]


def test_a_benchmark_point_killed_by_the_kernel_says_so(monkeypatch):
    """A point's child process killed by SIGKILL (the out-of-memory killer, with nothing on stderr) is named as such,
    not reported as an empty failure."""
    import types

    from app.bench import common

    monkeypatch.setattr(common.subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=-9, stderr="",
                                                                                        stdout=""))
    with pytest.raises(RuntimeError, match="killed by signal 9 .*out-of-memory"):
        common.isolated("app.bench.real_width:measure", layers=2)


def test_a_failed_point_becomes_a_row_and_the_others_are_kept(tmp_path, monkeypatch):
    """A benchmark of many points whose one point dies (here: killed for memory) keeps every other point in its
    report, lists the failed one with why, and exits non-zero; the report is on disk after each point."""
    from app.bench import common, real_width
    from app.bench.planning import accuracy

    def fake(target, **kwargs):
        if kwargs.get("layers") == 2 and kwargs.get("mode") == "repeated" or target.endswith(":tower_point"):
            raise RuntimeError(f"{target}({kwargs}) was killed by signal 9 (SIGKILL: most often the kernel's "
                               "out-of-memory killer; see dmesg):\n")
        value = 1000.0 * (1 + kwargs.get("layers", 1))
        result = {"seconds": value / 100, "peak_mb": value, "saved_mb": value / 2, "planned_peak_mb": value * 1.01,
                "planned_saved_mb": value / 2, "planned_flops": value * 1e9, "measured_flops": value * 1e9, "causal_flops": value * 5e8,
                "peak_memory_mb": value * 3, "planned": value * 2**20, "measured": value * 2**20 * 0.99}
        if target.endswith(":video_point"):
            result |= {"planned_old": value * 2**21, "budget": value * 1.5 * 2**20}
        return result

    monkeypatch.setattr(common, "isolated", fake)
    monkeypatch.setattr(real_width, "POINTS", ((1, 128), (2, 128), (3, 128)))
    with pytest.raises(SystemExit, match="1 of 3 points failed"):
        real_width.run(tmp_path / "rw")
    rows = json.loads((tmp_path / "rw" / "real_width.json").read_text())["rows"]
    assert [r["layers"] for r in rows] == [1, 2, 3]
    assert "time_ratio" in rows[0] and "time_ratio" in rows[2] and "time_ratio" not in rows[1]
    assert "seconds_grouped" in rows[1] and "out-of-memory" in rows[1]["error_repeated"]
    assert "layers 2, prefix 128, repeated: app.bench.real_width:measure" in (tmp_path / "rw" / "real_width.md").read_text()

    with pytest.raises(SystemExit, match="1 of .* points failed"):
        accuracy.run(tmp_path / "acc", quick=True)
    report = json.loads((tmp_path / "acc" / "planner_accuracy.json").read_text())
    assert report["summary"]["failed"] == 1 and report["summary"]["points"] == len(report["rows"]) - 1
    assert [r["part"] for r in report["rows"] if "error" in r] == ["tower trained"]
