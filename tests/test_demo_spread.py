"""The demo's spread report: one row per run, the floor's verdict, JSON and plot (the runs themselves take minutes
each: `python -m app.demos.spread`, docs/quickstart.md)."""

from __future__ import annotations

import json

from app.demos.spread import report


def runs(*after):
    return [{"seed": i // 2, "threads": 1 + i % 2, "heldout_warm_start": 0.3, "heldout_after_grpo": a,
             "train_accuracy_last_50": 0.7, "minutes": 3.0} for i, a in enumerate(after)]


def test_the_report_states_the_spread_and_whether_every_run_reaches_the_floor(tmp_path):
    summary = report(runs(1.0, 0.95, 0.79), tmp_path, 0.8)
    assert (summary["min"], summary["median"], summary["max"]) == (0.79, 0.95, 1.0)
    assert summary["all_at_or_above_floor"] is False and "NOT every run" in (tmp_path / "spread.md").read_text()
    written = json.loads((tmp_path / "spread.json").read_text())
    assert written["environment"]["commit"] and len(written["runs"]) == 3 and (tmp_path / "spread.png").is_file()
    assert report(runs(0.8, 0.9), tmp_path, 0.8)["all_at_or_above_floor"] is True
    report(runs(0.9), tmp_path, 0.8, ["train.min_lr_ratio=0.5"])  # the settings the runs were made with
    assert json.loads((tmp_path / "spread.json").read_text())["overrides"] == ["train.min_lr_ratio=0.5"]
    assert "`configs/demo_cpu.yaml` train.min_lr_ratio=0.5" in (tmp_path / "spread.md").read_text()
