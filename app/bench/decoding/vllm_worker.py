"""vLLM's side of the rollout benchmark: a worker that ``app.bench.decoding.rollout`` keeps alive for the whole run and
asks for one trial at a time (``app.bench.decoding.rollout.Engine``), so vLLM and the other engines take turns.

    PYTHON -m app.bench.decoding.vllm_worker CHECKPOINT ROOT MAX_MODEL_LEN

Each point: the prompt of ``app.bench.decoding.rollout.prompt_inputs`` (the same random ids; for a video point the same
decoded frames and their metadata, given to vLLM's own processor and vision tower, and the unexpanded prompt,
which vLLM expands: ``app.rollout.vllm.vllm_request``), n = G samples of exactly new_tokens tokens (EOS ignored), temperature 1,
prefix caching on (as peers run it) and reset before every trial, so every trial prefills its prompt once; off for
Qwen3.5 (vLLM caches a hybrid's states only at block boundaries; its n samples still share one prefill). Replies
{"seconds", "prompt_tokens"} (vLLM's own count of the prompt, to compare with ours).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main(checkpoint: str, root: str, max_model_len: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import torch
    from vllm import LLM, SamplingParams

    import app.compat  # noqa: F401  (torchvision on a CPU-only torch)
    from app.bench.decoding.rollout import family_of, name_of, prompt_inputs, serve, video_conversation
    from app.data.prompts import encode_prompts
    from app.rollout.vllm import vllm_request
    from app.runtime.models import load_processor

    processor = load_processor(checkpoint)
    family = family_of(checkpoint)
    hybrid = family["dtype"] == "bfloat16"  # Qwen3.5: its GDN states cached only at block boundaries ("align")
    # max_num_batched_tokens = the longest prompt: the encoder cache must hold a whole video (8,192 tokens at the
    # largest point; vLLM's default budget refused it), and every point prefills in one chunk as ours does
    from transformers import AutoConfig

    from app.rollout.vllm_moe import engine_settings

    llm = LLM(model=checkpoint, dtype=family["dtype"], enable_prefix_caching=not hybrid, max_model_len=int(max_model_len),
              max_num_batched_tokens=int(max_model_len), seed=0, limit_mm_per_prompt={"image": 0, "video": 1},
              **engine_settings(AutoConfig.from_pretrained(checkpoint)))  # a mixture of experts: norm_topk_prob
    prompt_of: dict[str, dict] = {}

    def prompt(point: dict) -> dict:
        key = name_of(point)
        if key not in prompt_of:
            if point["kind"] == "video":  # the unexpanded prompt and the very frames (and fps) we encode
                _, (view,) = encode_prompts(processor, [video_conversation(Path(root), family["videos"][
                    point["prompt"]])], with_media=True)
                prompt_of[key] = vllm_request(view)
            else:
                prompt_of[key] = {"prompt_token_ids": prompt_inputs(processor, Path(root), point, family["videos"])[
                    "input_ids"][0].tolist()}
        return prompt_of[key]

    def trial(point: dict) -> dict:
        params = SamplingParams(n=point["group"], temperature=1.0, max_tokens=point["new_tokens"], ignore_eos=True)
        request = prompt(point)
        if point.get("warmup"):
            llm.generate([request], params, use_tqdm=False)  # shapes, kernels
        if not hybrid:
            llm.reset_prefix_cache()
        start = time.perf_counter()
        out = llm.generate([request], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        assert all(len(c.token_ids) == point["new_tokens"] for c in out[0].outputs)
        return {"seconds": seconds, "prompt_tokens": len(out[0].prompt_token_ids)}

    import vllm

    serve(trial, {"vllm": vllm.__version__, "torch_threads": torch.get_num_threads()})


if __name__ == "__main__":
    main(*sys.argv[1:4])
