"""MoE checkpoints load in both expert layouts (as released, and fused as the model holds them; save_pretrained
writes the fused one for Qwen3-VL-MoE and the released one for Qwen3.5-MoE), without ZeRO and under ZeRO-3, to the
same weights; transformers' own ZeRO-3 load of Qwen3-VL-MoE's fused layout fails (the reason
``app.runtime.expert_layouts`` exists: when this stops failing, the workaround can go)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.runtime.models import MOE_FAMILIES, build_tiny_checkpoint, load_model, write_expert_layout

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Per MoE family: the same weights in the fused and in the released expert layout."""
    root = tmp_path_factory.mktemp("moe-layouts")
    out = {}
    for family in MOE_FAMILIES:
        saved = build_tiny_checkpoint(root / f"{family}-fused", family, seed=3)
        released = root / f"{family}-released"
        shutil.copytree(saved, released)
        out[family] = write_expert_layout(saved, "fused"), write_expert_layout(released, "released")
    return out


def expert_keys(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if ".mlp.experts." in k}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_both_expert_layouts_load_to_the_same_weights(family, layouts):
    fused, released = layouts[family]
    ours, theirs = expert_keys(fused), expert_keys(released)
    assert ours != theirs  # really another layout on disk
    assert all(len(shape) == 3 for shape in ours.values())
    if family == "qwen3_vl_moe":  # fused, transposed: [E, H, 2I] and [E, I, H]
        assert set(ours) == set(theirs)
        assert all(theirs[k] == (v[0], v[2], v[1]) for k, v in ours.items())
    else:  # one tensor per expert and projection
        assert any(k.endswith("experts.0.gate_proj.weight") for k in theirs)
    saved = build_tiny_checkpoint(fused.parent / f"{family}-as-saved", family, seed=3)  # what save_pretrained writes
    assert expert_keys(saved) == (ours if family == "qwen3_vl_moe" else theirs)
    a, b = load_model(fused).state_dict(), load_model(released).state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_both_layouts_load_under_zero3(layouts):
    paths = [str(p) for pair in layouts.values() for p in pair]
    run = subprocess.run([sys.executable, "-m", "tests.workers.zero3_load", *paths], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    for path in paths:
        assert found[path]["partitioned"] and found[path]["equal"], (path, found[path])
        assert found[path]["pushed_equal"] and found[path]["pushed_tensors"] > 0, (path, found[path])
    saved_vl = str(layouts["qwen3_vl_moe"][0])
    # transformers 5.19 alone: the save_pretrained layout is transposed under ZeRO-3
    assert "size mismatch for model.language_model.layers.0.mlp.experts" in found[saved_vl]["transformers_alone"]


def test_a_released_layout_that_would_load_ambiguously_is_refused(tmp_path):
    """Qwen3-VL-MoE experts as wide as the hidden size: transformers transposes a released down_proj only where its
    shape tells, so a square one would load untransposed (vLLM transposes it: the rollout benchmark's engines ran
    other weights, 0.16 apart per log-prob, until its experts were made narrower). Writing that layout stops."""
    from app.runtime.models import TinySizes

    square = build_tiny_checkpoint(tmp_path / "square", "qwen3_vl_moe", seed=0,
                                   sizes=TinySizes(hidden=64, moe_intermediate=64))
    with pytest.raises(ValueError, match="as wide as the hidden size \\(64\\) make the released layout ambiguous"):
        write_expert_layout(square, "released")
