"""The rollout's sampling log-probs against the trainer's recomputation of the same tokens (the ``mismatch/*``
metrics every step logs), on Qwen3.5 beside Qwen2.5-VL, in float32 and bfloat16:

    python -m app.bench.decoding.mismatch --out docs/bench/mismatch [--quick]      (scripts/bench.sh mismatch)

The grouped engine samples G = 8 completions of 512 tokens (temperature 1, no stop) for a text prompt of 2k or 8k
tokens; the grouped forward the trainer runs (``completion_logprobs``, the same dtype) recomputes their log-probs.
Per point: the mean and largest |difference| per token (``mismatch/mean_abs_logprob_diff``, and the largest ratio
``mismatch/max_ratio`` = exp of the largest), the rollout's seconds. Qwen3.5's decode advances each sample's Gated
DeltaNet state with the recurrent form of the delta rule (the state in float32), the trainer recomputes with the
chunked form, so their difference compounds through the state; Qwen2.5-VL has no such state. The goal (issue 74):
Qwen3.5 in bf16 no worse than Qwen2.5-VL at the same lengths.

At reduced width on this CPU (``app.bench.hybrid.tiny_model``: hidden 256, 4 decoder layers, random weights);
each point in its own process (``--quick``: all in this one).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from app.bench.common import cli, exit_if_failed, failed_points, markdown_table, point, write_report

FAMILIES = ("qwen3_5", "qwen2_5_vl")
PREFIXES = (2048, 8192)
DTYPES = ("float32", "bfloat16")
GROUP, COMPLETION = 8, 512


def measure(family: str, prefix: int, group: int, completion: int, dtype: str) -> dict:
    """One point, in a child process."""
    from app.bench.hybrid import tiny_model
    from app.grouping import completion_logprobs
    from app.objectives.grpo import mismatch_metrics
    from app.rollout.generate import SamplingConfig, generate_groups

    model = tiny_model(family).to(getattr(torch, dtype)).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 30000, (1, prefix), generator=generator)
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=completion, suppress_token_ids=())
    start = time.perf_counter()
    rollout = generate_groups(model, prompts, group, sampling, eos_ids=[], pad_id=0, prompt_seeds=[0])
    seconds = time.perf_counter() - start
    with torch.no_grad():
        trained = completion_logprobs(model, prompts, rollout.completion_ids, rollout.completion_mask, group).logprobs
    metrics = mismatch_metrics(trained.float(), rollout.logprobs.float(), rollout.completion_mask)
    return {"mean_abs": metrics["mismatch/mean_abs_logprob_diff"], "max_ratio": metrics["mismatch/max_ratio"],
            "tokens": int(rollout.completion_mask.sum()), "rollout_s": seconds}


def run(out: Path, quick: bool = False) -> dict:
    prefixes = (128,) if quick else PREFIXES
    group, completion = (4, 16) if quick else (GROUP, COMPLETION)
    rows: list[dict] = []
    payload = {"prefixes": list(prefixes), "group": group, "completion": completion, "rows": rows}
    failed = 0
    for prefix in prefixes:
        for dtype in DTYPES:
            for family in FAMILIES:
                row = {"family": family, "prefix": prefix, "dtype": dtype, "G": group, "completion": completion}
                result = point("app.bench.decoding.mismatch:measure", quick, family=family, prefix=prefix,
                               group=group, completion=completion, dtype=dtype)
                if "error" in result:
                    failed += 1
                    print(f"{family} P={prefix} {dtype}: FAILED: {result['error']}", flush=True)
                row.update(result)
                if "mean_abs" in result:
                    print(f"{family} P={prefix} {dtype}: mean {result['mean_abs']:.2e}, largest ratio "
                          f"{result['max_ratio']:.4f} over {result['tokens']} tokens ({result['rollout_s']:.1f} s)",
                          flush=True)
                rows.append(row)
                write_report(out, "mismatch", payload, table(rows), quiet=True)
    for row in rows:  # Qwen3.5 against Qwen2.5-VL at the same length and dtype
        other = next((r for r in rows if r["family"] == "qwen2_5_vl" and r["prefix"] == row["prefix"]
                      and r["dtype"] == row["dtype"]), None)
        if row["family"] == "qwen3_5" and other and "mean_abs" in row and "mean_abs" in other:
            row["mean_vs_qwen2_5_vl"] = row["mean_abs"] / other["mean_abs"] if other["mean_abs"] else None
    write_report(out, "mismatch", payload, table(rows))
    exit_if_failed(failed, len(rows), out)
    return payload


def table(rows: list[dict]) -> str:
    columns = ["family", "prefix", "dtype", "G", "completion", "tokens", "mean_abs", "max_ratio",
               "mean_vs_qwen2_5_vl", "rollout_s"]
    formats = {"mean_abs": ".2e", "max_ratio": ".4f", "mean_vs_qwen2_5_vl": ".2f", "rollout_s": ".1f"}
    errors = [f"- {r['family']} P={r['prefix']} {r['dtype']}: {r['error']}" for r in rows if "error" in r]
    return ("## The rollout's log-probs against the trainer's recomputation (mismatch/*), grouped engine, "
            "hidden 256, 4 layers, CPU\n\n" + markdown_table(rows, columns, formats)
            + "\n\nmean_abs: mismatch/mean_abs_logprob_diff over every sampled token; max_ratio: mismatch/max_ratio "
            "(exp of the largest difference); mean_vs_qwen2_5_vl: Qwen3.5's mean over Qwen2.5-VL's at the same "
            "prompt length and dtype." + failed_points(errors))


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/bench/mismatch", argv)


if __name__ == "__main__":
    main()
