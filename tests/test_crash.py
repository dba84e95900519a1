"""Runs that crash: kills at random moments (inside the save window too) resume to the uninterrupted result, a
killed launcher leaves no worker behind, and the launch scripts pass paths and overrides through untouched."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from app.runtime.checkpoint import CRASH_POINT_ENV, CRASH_POINTS
from tests.test_trainer import ROOT, assets, overrides, run, trainer, weights  # noqa: F401

pytestmark = pytest.mark.distributed


def metrics_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_kills_at_random_moments_resume_to_the_uninterrupted_result(assets, tmp_path):  # noqa: F811
    """Killed again and again at seeded random moments: at named points inside the save of a step not yet done
    (after DeepSpeed's write, after the old copy moved aside, after the rename, after `latest`) and by SIGKILL after
    a random delay. Every restart uses train.resume=true; the final weights equal an uninterrupted run's bitwise
    and metrics.jsonl holds each step once."""
    steps = 6
    settings = {"train.max_steps": steps, "train.save_every": 1, "train.keep_checkpoints": 2}
    run(trainer(assets, tmp_path / "straight", **settings))
    straight = weights(tmp_path / "straight" / "final")

    rng = random.Random(1234)
    out = tmp_path / "killed"
    args = trainer(assets, out, **settings, **{"train.resume": True})
    kills = []
    for attempt in range(6):
        done = max(metrics_steps(out), default=0)
        if done >= steps - 1:
            break
        if attempt % 2 == 0:  # a named point inside the save of a step this run will reach
            point, step = rng.choice(CRASH_POINTS), rng.randint(done + 1, steps - 1)
            result = run(args, env={CRASH_POINT_ENV: f"{point}@{step}"}, check=False)
            kills.append(f"{point}@{step}: exit {result.returncode}")
        else:  # SIGKILL after a random delay, wherever the run is (start-up, a step, a save)
            delay = rng.uniform(3.0, 7.0)
            process = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
            try:
                process.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            kills.append(f"SIGKILL after {delay:.1f}s: exit {process.returncode}")
        rows = metrics_steps(out)
        assert rows == sorted(set(rows)), (rows, kills)
    run(args)  # the last resume runs to the end
    assert metrics_steps(out) == list(range(1, steps + 1)), kills
    final = weights(out / "final")
    for name in straight:
        assert torch.equal(final[name], straight[name]), (name, kills)
    assert sum("exit 19" in k for k in kills) >= 2 and any("exit -9" in k for k in kills), kills

    # Resuming the finished run only exports again (nothing to train, nothing re-saved). With its newest checkpoint
    # damaged, a resume falls back to step 5 and saves step 6 again, moving the damaged copy aside first: killed
    # right after that move, `latest` dangles; the next resume falls back to step 5 and ends the same.
    again = run(args)
    assert "resumed from" in again.stderr and f"step-{steps:07d}" in again.stderr
    assert metrics_steps(out) == list(range(1, steps + 1))
    state = out / "checkpoints" / f"step-{steps:07d}" / "trainer_state_rank0.json"
    state.write_text(state.read_text()[:10])
    killed = run(args, env={CRASH_POINT_ENV: f"moved_aside@{steps}"}, check=False)
    assert killed.returncode == 19, killed.stderr[-2000:]
    again = run(args)
    assert "passing over" in again.stderr and f"step-{steps - 1:07d}" in again.stderr
    assert metrics_steps(out) == list(range(1, steps + 1))
    final = weights(out / "final")
    for name in straight:
        assert torch.equal(final[name], straight[name]), name


def _workers_of(marker: str) -> list[int]:
    """Live processes whose command line mentions ``marker`` (the run's output directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next((line for line in (entry / "status").read_text().splitlines()
                          if line.startswith("State:")), "")
        except OSError:
            continue
        if marker in cmdline and "app.training.train" in cmdline and "zombie" not in state:
            pids.append(int(entry.name))
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_killing_the_launcher_leaves_no_worker(assets, tmp_path):  # noqa: F811
    """kill -9 of scripts/train.sh's process group (torchrun starts its workers in their own sessions): the
    workers die with it instead of writing on into the output directory."""
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        ["bash", "scripts/train.sh", "configs/demo_cpu.yaml",
         *overrides(assets, out, **{"train.max_steps": 1000, "train.save_every": 0})],
        cwd=ROOT, env={**os.environ, "NPROC_PER_NODE": "2"}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and not metrics_steps(out):  # both workers are training
        time.sleep(0.5)
    assert metrics_steps(out), "training never logged a step"
    workers = _workers_of(str(out))
    assert len(workers) >= 2, workers
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 30
    while time.time() < deadline and _workers_of(str(out)):
        time.sleep(0.5)
    survivors = _workers_of(str(out))
    for pid in survivors:  # do not leave them running after a failure either
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"workers outlived their launcher: {survivors}"


def _fake_tools(tmp_path: Path) -> tuple[Path, Path]:
    """A bin/ with srun, scontrol and a python that records its argv, so the launchers run without SLURM/torch."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.json"
    # Many node names: a launcher that reads only the first line through `head` under pipefail dies of SIGPIPE.
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nfor i in $(seq 1 50000); do echo node-$i; done\n")
    (bin_dir / "srun").write_text("#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n"
                                  "SLURM_NODEID=0 exec \"$@\"\n")
    (bin_dir / "python").write_text(f"#!{sys.executable}\nimport json, sys\n"
                                    f"json.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir, record


@pytest.mark.parametrize("script", ["slurm_example.sbatch", "train.sh", "train_multinode.sh", "eval.sh"])
def test_launch_scripts_pass_arguments_through_untouched(script, tmp_path):
    bin_dir, record = _fake_tools(tmp_path)
    canary = tmp_path / "PWNED"
    config = tmp_path / "my configs" / "run $HOME & co.yaml"
    args = [str(config), "rewards.functions=[format, accuracy]", f"train.output_dir={tmp_path}/out dir; touch {canary}",
            "data.system_prompt=it's \"quoted\" `date` $(touch " + str(canary) + ")"]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
           "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2", "NNODES": "2", "NODE_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "NPROC_PER_NODE": "2"}
    result = subprocess.run(["bash", f"scripts/{script}", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    received = json.loads(record.read_text())
    assert received[-len(args):] == args, received
    assert not canary.exists()


def test_a_run_that_ends_before_its_kill_is_killed_on_a_second_start_drawn_from_its_own_time(tmp_path):
    """``killed_at_random``: the uninterrupted run's time held one-off work (here: the first start only marks the
    folder), so the first start ends before the kill; the second, drawn from that start's time, is killed."""
    from tests.helpers import killed_at_random

    out, marker = tmp_path / "out", tmp_path / "built"
    script = f"mkdir -p {out}; if [ -e {marker} ]; then sleep 30; else touch {marker}; fi"
    delay = killed_at_random(["bash", "-c", script], out, {}, 20.0, random.Random(0), (0.3, 0.8))
    assert marker.exists() and delay < 1.0  # the first draw was 6-16 s: the second start's own time was used
    with pytest.raises(AssertionError, match="failed before the kill"):
        killed_at_random(["bash", "-c", "exit 3"], out, {}, 20.0, random.Random(0), (0.3, 0.8))
