"""Shared fixtures: tiny checkpoints of every family (built once per session) and real mp4 videos."""

from __future__ import annotations

import os
import time

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import app  # noqa: E402,F401

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n 2: two workers share the 2 cores, one torch thread each,
    # and so do the processes a test launches (unless it sets its own): measured beside a busy core, a launch on
    # torch's default 2 threads took 105 CPU-s and 92 s, on one thread 53 CPU-s and 54 s (docs/testing.md)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
from app.runtime.models import FAMILIES, build_tiny_checkpoint  # noqa: E402

# The modules that take longest (measured in make test-all: docs/testing.md), run first. Under pytest -n 2 --dist
# loadfile (the Makefile's) each module goes whole to one worker, in collection order; starting with the longest keeps
# one worker from finishing a long module alone at the end. A stale order costs balance only, never a result.
LONGEST_FIRST = ("test_vllm.py", "test_trainer.py", "test_experts_train.py", "test_bench.py", "test_plan.py",
                 "test_gpu_check.py", "test_shared_video_train.py", "test_recurrent.py", "test_expert_parallel.py",
                 "test_planner_accuracy.py", "test_sequence_parallel.py", "test_experts_loading.py",
                 "test_qwen4_train.py", "test_evaluate.py", "test_mixed_modalities.py", "test_vision_cache.py",
                 "test_crash.py", "test_no_mixing.py", "test_lora.py", "test_real_tokenizer.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module keeps its own order


# ---- CPU seconds per test: what it costs the machine, not the wall time it waited beside the other worker ----------
def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item._cpu_start = _cpu_seconds()  # from setup: a module fixture's launches count for the test that builds them
    # where and when it ran (junit XML): the two workers' timelines, to see where a core stood idle
    item.user_properties += [("worker", os.environ.get("PYTEST_XDIST_WORKER", "main")),
                             ("started", round(time.time(), 1))]
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield
    start = getattr(item, "_cpu_start", None)
    if start is not None:  # this process and the children it waited for (subprocess.run, torchrun's workers)
        item.user_properties.append(("cpu_s", round(_cpu_seconds() - start, 2)))


_CPU_ROWS: list[tuple[float, str]] = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        cpu = dict(report.user_properties).get("cpu_s")
        if cpu is not None:
            _CPU_ROWS.append((cpu, report.nodeid))


def pytest_terminal_summary(terminalreporter, config):
    """With --durations=N, also the N tests that cost the most CPU (junit XML: the cpu_s property of every test)."""
    count = getattr(config.option, "durations", None)
    if not count or not _CPU_ROWS:
        return
    rows = sorted(_CPU_ROWS, reverse=True)[:count]
    terminalreporter.write_sep("=", f"{len(rows)} tests that cost the most CPU (own + waited children; "
                                     f"all {len(_CPU_ROWS)}: {sum(c for c, _ in _CPU_ROWS):.0f} s)")
    for cpu, nodeid in rows:
        terminalreporter.write_line(f"{cpu:8.1f}s cpu  {nodeid}")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {family: build_tiny_checkpoint(root / family, family, seed=0) for family in FAMILIES}


@pytest.fixture(scope="session")
def real_checkpoints(tmp_path_factory):
    """Tiny checkpoints that carry Qwen's real tokenizer, special-token ids and vocabulary size (151,936)."""
    root = tmp_path_factory.mktemp("tiny-real")
    return {family: build_tiny_checkpoint(root / family, family, seed=0, real_tokenizer=True)
            for family in ("qwen2_5_vl", "qwen3_vl", "qwen2")}


@pytest.fixture(scope="session")
def videos(tmp_path_factory):
    """Three short mp4 files of different lengths and sizes, written with PyAV."""
    from app.data.video import write_mp4

    root = tmp_path_factory.mktemp("videos")
    rng = np.random.default_rng(0)
    paths = []
    for i, (frames, height, width) in enumerate([(8, 56, 84), (12, 64, 64), (10, 84, 56)]):
        clip = rng.integers(0, 255, (frames, height, width, 3), dtype=np.uint8)
        paths.append(write_mp4(root / f"clip{i}.mp4", clip, fps=4))
    return paths


@pytest.fixture(scope="session")
def clips(tmp_path_factory):
    """Real H.264 files with keyframes inside (``write_mp4``): 61 frames at 29.97 fps (not an integer rate), a
    keyframe every 7; 45 frames at 12 fps, every 10."""
    from app.data.video import write_mp4

    root = tmp_path_factory.mktemp("clips")
    rng = np.random.default_rng(0)
    return {
        "ntsc": write_mp4(root / "ntsc.mp4", rng.integers(0, 255, (61, 96, 128, 3), dtype=np.uint8), fps=29.97,
                          keyframe_interval=7),
        "twelve": write_mp4(root / "twelve.mp4", rng.integers(0, 255, (45, 64, 112, 3), dtype=np.uint8), fps=12,
                            keyframe_interval=10),
    }


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
