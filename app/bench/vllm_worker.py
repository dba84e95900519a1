"""vLLM's side of the rollout benchmark: a worker that ``app.bench.rollout`` keeps alive for the whole run and
asks for one trial at a time (``app.bench.rollout.Engine``), so vLLM and the other engines take turns.

    PYTHON -m app.bench.vllm_worker CHECKPOINT ROOT MAX_MODEL_LEN

Each point: the prompt of ``app.bench.rollout.prompt_inputs`` (the same random ids; for a video point the same
decoded frames, given to vLLM's own processor and vision tower with their real fps, and the prompt with one
video placeholder, which vLLM expands), n = G samples of exactly new_tokens tokens (EOS ignored), temperature 1,
prefix caching on (as peers run it) and reset before every trial, so every trial prefills its prompt once. Replies
{"seconds", "prompt_tokens"} (vLLM's own count of the prompt, to compare with ours).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def video_item(prompts: dict, frames, metadata: dict):
    """vLLM's (frames [T, H, W, 3] uint8, metadata) for one decoded video: the frames the trainer encodes."""
    array = frames.permute(0, 2, 3, 1).round().clamp(0, 255).to(dtype=__import__("torch").uint8).numpy()
    meta = {"fps": float(metadata["fps"]), "total_num_frames": int(array.shape[0]),
            "frames_indices": list(range(array.shape[0])), "duration": array.shape[0] / float(metadata["fps"]),
            "video_backend": "decord", "do_sample_frames": False}
    return array, meta


def main(checkpoint: str, root: str, max_model_len: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import torch
    from vllm import LLM, SamplingParams

    import app.compat  # noqa: F401  (torchvision on a CPU-only torch)
    from app.bench.rollout import VIDEOS, name_of, prompt_inputs, serve
    from app.data.prompts import media_elements
    from app.data.video import decode_video
    from app.engines.vllm import collapse_placeholders
    from app.models import load_processor

    processor = load_processor(checkpoint)
    llm = LLM(model=checkpoint, dtype="float32", enable_prefix_caching=True, max_model_len=int(max_model_len),
              seed=0, limit_mm_per_prompt={"image": 0, "video": 1})
    placeholders = {processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|video_pad|>", "<|image_pad|>")}
    prompt_of: dict[str, dict] = {}

    def prompt(point: dict) -> dict:
        key = name_of(point)
        if key not in prompt_of:
            ours = prompt_inputs(processor, Path(root), point)
            request = {"prompt_token_ids": collapse_placeholders(ours["input_ids"][0].tolist(), placeholders)}
            if point["kind"] == "video":
                from app.bench.rollout import video_conversation

                element = media_elements(video_conversation(Path(root), VIDEOS[point["prompt"]]))[0]
                frames, metadata = decode_video(element)
                request["multi_modal_data"] = {"video": video_item(ours, frames, metadata)}
            prompt_of[key] = request
        return prompt_of[key]

    def trial(point: dict) -> dict:
        params = SamplingParams(n=point["group"], temperature=1.0, max_tokens=point["new_tokens"], ignore_eos=True)
        request = prompt(point)
        if point.get("warmup"):
            llm.generate([request], params, use_tqdm=False)  # shapes, kernels
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
