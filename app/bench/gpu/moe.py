"""Qwen3-VL-30B-A3B on one GPU at its full width, 4 decoder layers (every one sparse: 128 experts, 8 per token):

    python -m app.bench.gpu.moe --out outputs/gpu/gpu_moe [--quick]      (scripts/gpu_check.sh part moe)

- **experts**: one grouped forward+backward (a 2k text prompt, G = 8 completions of 128, bfloat16) with
  ``grouped_mm`` (what ``model.experts_implementation=auto`` picks) and with ``eager``: time and the largest
  log-prob difference between the two;
- **train**: the grouped forward+backward against the repeated one at G = 8 on text prompts of 8k and 16k tokens
  (``app.bench.gpu.hybrid.train_rows``): time, the allocator's peak, the largest log-prob difference;
- **self_check**: the bf16 self-check on a 2k prompt with G = 8 completions of 64 (``verify_grouping``): whether it
  passed, how many tokens met other experts in the two layouts, and whether it had to replay the routing; the
  planner's constants for MoE (docs/scaling.md) wait for these figures;
- **replay**: routing replay (rollout.routing_replay=r3) on a 2k prompt, G = 8 samples of 128: the grouped rollout
  with CUDA-graph decode steps, plain and recording (each layer's ids copied into a fixed buffer inside the captured
  step), and recording with eager steps: times, whether the tokens and the records agree, then the trainer's
  forward routing afresh (off) and replaying the record (r3): the bf16 mismatch and the tokens routed apart (issue
  89's goal: r3's mean at most half of off's).

``--quick`` runs the same code on this CPU at the reduced width of ``scripts/bench.sh moe`` (float32).
"""

from __future__ import annotations

from pathlib import Path

import torch

from app.bench.common import device, markdown_table, write_report
from app.bench.gpu import hybrid
from app.bench.gpu.hybrid import timed, train_rows

PRESET, LAYERS, PREFIXES, GROUP, COMPLETION = "qwen3_vl_30b_a3b", 4, (8192, 16384), 8, 256


def model_at(quick: bool, dev, dtype):
    return hybrid.model_at(quick, dev, dtype, preset=PRESET, tiny="qwen3_vl_moe")


def text_batch(dev, prefix: int, group: int, completion: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 30000, (1, prefix), generator=generator).to(dev)
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
    completions = torch.randint(10, 30000, (group, completion), generator=generator).to(dev)
    return prompts, completions, torch.ones_like(completions)


def experts_rows(model, dev, prefix: int, group: int, completion: int) -> list[dict]:
    from app.grouping import attention_restored, completion_logprobs
    from app.grouping.experts.blocks import choose_experts_implementation, set_experts_implementation

    batch = text_batch(dev, prefix, group, completion, seed=2)
    rows, kept = [], {}
    for name in (choose_experts_implementation("auto"), "eager"):
        set_experts_implementation(model, name)

        def one(name=name):
            with attention_restored(model):
                scores = completion_logprobs(model, *batch, group)
                scores.logprobs.sum().backward()
            kept[name] = scores.logprobs.detach().float()
        try:
            timed(one, dev)  # warm-up
            model.zero_grad(set_to_none=True)
            rows.append({"implementation": name, "prefix": prefix, "G": group, "seconds": timed(one, dev)})
        except Exception as error:  # noqa: BLE001 - a row that says why
            rows.append({"implementation": name, "error": f"{type(error).__name__}: {str(error)[:200]}"})
        model.zero_grad(set_to_none=True)
    set_experts_implementation(model, choose_experts_implementation("auto"))
    if len(kept) == 2:
        first, second = kept.values()
        rows[-1]["max_logprob_diff_vs_first"] = float((first - second).abs().max())
    return rows


def self_check_row(model, dev, prefix: int, group: int, completion: int) -> dict:
    from app.grouping import GroupingMismatchError, verify_grouping

    prompts, ids, _ = text_batch(dev, prefix, group, completion, seed=3)
    lengths = torch.randint(completion // 2, completion + 1, (group,), generator=torch.Generator().manual_seed(4))
    mask = (torch.arange(completion)[None] < lengths[:, None]).long().to(dev)
    row = {"prefix": prefix, "G": group, "completion": completion, "dtype": str(next(model.parameters()).dtype)}
    try:
        with torch.no_grad():
            result = verify_grouping(model, prompts, ids * mask, mask, group)
        row.update(passed=True, describe=result.describe(), replayed=result.replayed,
                   flipped_tokens=result.flips["tokens"] if result.flips else None,
                   real_tokens=result.flips["real_tokens"] if result.flips else None)
    except GroupingMismatchError as error:
        row.update(passed=False, describe=str(error)[:600])
    return row


def replay_rows(model, dev, prefix: int, group: int, completion: int, decode: str) -> list[dict]:
    """Routing replay's rollout and mismatch rows (see the module doc); ``decode``: the recording rollout's steps."""
    from app.grouping import completion_logprobs
    from app.grouping.checks.routing import disagreements
    from app.objectives.grpo import mismatch_metrics
    from app.rollout.generate import SamplingConfig, generate_groups

    prompts, _, _ = text_batch(dev, prefix, 1, 1, seed=5)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=completion, suppress_token_ids=())
    runs, row = {}, {"prefix": prefix, "G": group, "completion": completion, "decode": decode}
    for name, record, mode in (("plain", False, decode), ("recording", True, decode), ("eager", True, "eager")):
        def one(name=name, record=record, mode=mode):
            runs[name] = generate_groups(model, prompts, group, sampling, eos_ids=[], pad_id=0, prompt_seeds=[0],
                                         record_routing=record, decode=mode)
        try:
            with torch.no_grad():
                timed(one, dev)  # warm-up (the graph's capture)
                row[f"{name}_s"] = timed(one, dev)
        except Exception as error:  # noqa: BLE001 - a row that says why
            row[f"{name}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
    if "recording" not in runs:
        return [row]
    rollout, mask = runs["recording"], runs["recording"].completion_mask
    record = rollout.routing
    fed = mask.bool() & (torch.arange(mask.shape[1], device=mask.device)[None] < (mask.sum(1) - 1)[:, None])
    real = prompts["attention_mask"]
    row["tokens_equal"] = bool(torch.equal(rollout.completion_ids, runs["plain"].completion_ids))
    if "eager" in runs:
        row["records_apart"] = disagreements(record, runs["eager"].routing, real, fed)["tokens"]
    with torch.no_grad():
        free = completion_logprobs(model, prompts, rollout.completion_ids, mask, group, record_routing=True)
        replayed = completion_logprobs(model, prompts, rollout.completion_ids, mask, group, routing=record)
    for name, scores in (("off", free), ("r3", replayed)):
        metrics = mismatch_metrics(scores.logprobs.float(), rollout.logprobs.float(), mask)
        row[f"mean_{name}"], row[f"max_ratio_{name}"] = (metrics["mismatch/mean_abs_logprob_diff"],
                                                         metrics["mismatch/max_ratio"])
    apart = disagreements(record, free.routing, real, fed)
    row["routed_apart_off"] = apart["tokens"] / max(apart["real_tokens"], 1)
    row["mean_r3_over_off"] = row["mean_r3"] / row["mean_off"] if row["mean_off"] else None
    return [row]


def run(out: Path, quick: bool = False) -> dict:
    dev = device()
    dtype = torch.float32 if quick else torch.bfloat16
    payload: dict = {"preset": "tiny" if quick else PRESET, "layers": LAYERS}
    model = model_at(quick, dev, dtype)
    payload["experts"] = experts_rows(model, dev, 256 if quick else 2048, 4 if quick else GROUP,
                                      16 if quick else 128)
    write_report(out, "gpu_moe", payload, table(payload), quiet=True)
    payload["self_check"] = [self_check_row(model, dev, 256 if quick else 2048, 4 if quick else GROUP,
                                            16 if quick else 64)]
    write_report(out, "gpu_moe", payload, table(payload), quiet=True)
    payload["replay"] = replay_rows(model, dev, 128 if quick else 2048, 4 if quick else GROUP, 8 if quick else 128,
                                    "static" if quick else "graph")  # static: the captured step's code, on a CPU
    write_report(out, "gpu_moe", payload, table(payload), quiet=True)
    payload["train"] = train_rows(model, dev, (256,) if quick else PREFIXES, 4 if quick else GROUP,
                                  16 if quick else COMPLETION)
    write_report(out, "gpu_moe", payload, table(payload))
    return payload


def table(payload: dict) -> str:
    parts = [f"## Qwen3-VL-MoE at {payload['preset']} width, {payload['layers']} sparse layers\n"]
    if payload.get("experts"):
        parts.append("### experts implementation, one grouped forward+backward\n\n" + markdown_table(
            payload["experts"], ["implementation", "prefix", "G", "seconds", "max_logprob_diff_vs_first", "error"],
            {"seconds": ".3f", "max_logprob_diff_vs_first": ".3e"}))
    if payload.get("self_check"):
        parts.append("\n### bf16 self-check\n\n" + markdown_table(
            payload["self_check"], ["prefix", "G", "completion", "dtype", "passed", "replayed", "flipped_tokens",
                                    "real_tokens"], {}) + "\n\n(each check's full sentence: gpu_moe.json)")
    if payload.get("replay"):
        columns = ["prefix", "G", "completion", "decode", "plain_s", "recording_s", "eager_s", "tokens_equal",
                   "records_apart", "mean_off", "mean_r3", "mean_r3_over_off", "max_ratio_off", "max_ratio_r3",
                   "routed_apart_off"]
        parts.append("\n### routing replay: recording in the rollout, the mismatch off / r3\n\n" + markdown_table(
            payload["replay"], columns, {"plain_s": ".3f", "recording_s": ".3f", "eager_s": ".3f", "mean_off": ".2e",
                                         "mean_r3": ".2e", "mean_r3_over_off": ".2f", "max_ratio_off": ".4f",
                                         "max_ratio_r3": ".4f", "routed_apart_off": ".3f"}))
    if payload.get("train"):
        columns = ["prefix", "G", "completion", "seconds_grouped", "seconds_repeated", "time_ratio",
                   "peak_gib_grouped", "peak_gib_repeated", "max_logprob_diff"]
        parts.append("\n### grouped vs repeated forward+backward\n\n" + markdown_table(
            payload["train"], columns, {c: ".3f" for c in columns[3:]}))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    from app.bench.common import cli

    cli(run, __doc__, "outputs/gpu/gpu_moe", argv)


if __name__ == "__main__":
    main()
