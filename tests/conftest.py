"""Shared fixtures: tiny checkpoints of every family (built once per session) and real mp4 videos."""

from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import app  # noqa: E402,F401
from app.runtime.models import FAMILIES, build_tiny_checkpoint  # noqa: E402


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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
