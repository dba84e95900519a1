"""Grouped rollouts under ZeRO-3 with 2 CPU processes (gloo): uneven decode lengths and uneven prefill chunk counts
per rank still finish, and the partitioned model generates exactly what the unpartitioned one does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from app.data.prompts import encode_prompts
from app.data.video import video_element, write_mp4
from app.rollout.generate import SamplingConfig, generate_groups
from app.runtime.models import build_tiny_checkpoint, load_model, load_processor

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.distributed


@pytest.mark.slow  # about 50 s (2 processes under ZeRO-3): make test keeps the in-process rollout tests
def test_zero3_rollouts_with_uneven_lengths(tmp_path):
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", "qwen2_5_vl", seed=0)
    frames = np.random.default_rng(0).integers(0, 255, (8, 56, 56, 3), dtype=np.uint8)
    video = write_mp4(tmp_path / "clip.mp4", frames, fps=4)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "tests.workers.zero3_rollout", str(checkpoint), str(video), str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 and r["partitioned"] for r in ranks)
    assert ranks[0]["cut_steps"] == 3 and ranks[1]["cut_steps"] == 12  # rank 0 finished early and waited
    assert ranks[0]["sampled_shape"] == [2, 6] and ranks[1]["sampled_shape"][0] == 6
    for info in ranks:  # rollout.zero3_gather=full: same tokens, whole weights inside, partitioned after, trains
        assert info["gathered_equal"] and info["whole_inside"] and not info["collective"]
        assert info["repartitioned"] and info["stepped_after"]
    for info in ranks:  # layerwise: collective, one layer whole at a time, the same tokens with uneven lengths
        assert info["layerwise_equal"] and info["layerwise_cut_equal"] and info["layerwise_collective"]
        assert info["layer_whole_when_run"] and info["other_layers_partitioned"]
    # chunked prefill (rollout.prefill_chunk_size), the ranks' prompts taking different numbers of chunks: the same
    # greedy tokens with DeepSpeed's hooks on (per_step) and layer by layer
    assert ranks[0]["prefill_chunks"] < ranks[1]["prefill_chunks"]
    assert all(info["chunked_equal"] and info["layerwise_chunked_equal"] for info in ranks)

    # The same prompts, unpartitioned, in this process: identical greedy tokens.
    model, processor = load_model(checkpoint), load_processor(checkpoint)
    for rank, info in enumerate(ranks):
        conversations = [[{"role": "user", "content": [video_element(video, fps=2, min_pixels=3136, max_pixels=3136),
                                                       {"type": "text", "text": q}]}] for q in info["prompts"]]
        prompts = encode_prompts(processor, conversations)
        local = generate_groups(model, prompts, 2 + rank, SamplingConfig(temperature=0, max_new_tokens=12),
                                tokenizer=processor.tokenizer, eos_ids=[])
        assert torch.equal(local.completion_ids, torch.tensor(info["free"]))
