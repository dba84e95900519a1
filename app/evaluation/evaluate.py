"""Held-out evaluation of any checkpoint on any file in Video-R1's schema.

    python -m app.evaluation.evaluate MODEL_DIR DATA.json[l] [DATA2 ...] [--protocol NAME] [section.key=value ...]
    scripts/eval.sh MODEL_DIR DATA.json[l] [DATA2 ...] [--protocol NAME] [section.key=value ...]   (NPROC_PER_NODE ranks)

``--protocol NAME`` applies a preset of configs/eval/ (Video-R1's evaluation: frames, pixels, prompt, sampling,
answer extraction) before the overrides; the settings used are written to OUTPUT_DIR/eval_config.yaml.

Several files (e.g. Video-R1's benchmark JSONs) are evaluated together: predictions are keyed by file and position
(benchmarks number their problem_ids from 1 alike), and the summary has a table per benchmark (file stem).

Greedy (eval.samples=1, eval.temperature=0) or k sampled completions per question drawn from one shared prefill
(pass@k and mean accuracy). Scoring is the trainer's reward code (``app.rewards.rules.accuracy_of``), so training and
evaluation cannot disagree. Writes ``predictions.jsonl``, ``summary.json`` and ``summary.md`` to
``eval.output_dir``; a killed run resumes from the predictions already written.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from app.answers.grounding import GROUNDING_TYPES, grounding_metrics
from app.config.loading import ConfigError, load_config
from app.data.prompts import image_patch_size
from app.data.records import check_record, media_paths, read_records, where
from app.evaluation.batches import encoded, question_batches, question_runs
from app.evaluation.runs import RUN_FILE, EvaluationMismatch, choose_output_dir, run_identity
from app.grouping.vision import cache as vision_cache
from app.rewards.protocols import ANSWER_EXTRACTION, IOU_SCORING
from app.rollout.generate import SamplingConfig, derive_seed, eos_token_ids
from app.rollout.multiturn import answer_sampler
from app.rollout.registry import needs_engine_views
from app.runtime.distributed import local_device
from app.runtime.models import DTYPES, CheckpointPathError, check_checkpoint, load_model, load_processor
from app.runtime.tracking import configure_logging

log = logging.getLogger("app.evaluation.evaluate")
OVERRIDE = re.compile(r"^[a-z_]+\.[a-z_0-9]+=")  # section.key=value; anything else after MODEL_DIR is a data file
CRASH_ENV = "PREFIX_GRPO_EVAL_CRASH_AFTER"  # tests: die after this many questions, as a crash would


def record_key(record: dict) -> str:
    """File and position: unique across merged benchmark files, whose problem_ids collide."""
    return record["_where"]


def _dist():
    import torch.distributed as dist

    from app.runtime import distributed

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        distributed.init_distributed(use_deepspeed=False)
    if dist.is_initialized():
        return dist, dist.get_rank(), dist.get_world_size()
    return None, 0, 1


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash mid-write: that question is scored again
    return rows


def _append(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def write_settings(path: Path, cfg, model_dir, data_files, protocol: str | None, overrides) -> None:
    """Every setting this evaluation ran with, beside its numbers, and the command that reruns it: a result can be
    reproduced from its own output folder (``--protocol`` OUTPUT/eval_config.yaml takes it back)."""
    import yaml

    settings = {k: v for k, v in cfg.to_dict().items() if k in ("model", "data", "eval", "rollout", "forward")}
    settings["model"] = {k: v for k, v in settings["model"].items() if k != "path"}
    command = ["scripts/eval.sh", str(model_dir), *map(str, data_files), "--protocol", str(path)]
    header = (f"# The settings of this evaluation (protocol: {protocol or 'none'}; overrides: {list(overrides)}).\n"
              f"# Rerun it: {' '.join(command)}\n")
    path.write_text(header + yaml.safe_dump(settings, sort_keys=True))


def summarize(predictions: list[dict], skipped: list[dict], samples: int) -> dict:
    def block(rows):
        return {"count": len(rows), "accuracy": sum(r["accuracy"] for r in rows) / len(rows) if rows else 0.0,
                f"pass@{samples}": sum(r["pass"] for r in rows) / len(rows) if rows else 0.0}

    by_type, by_source, by_benchmark, by_original = (defaultdict(list) for _ in range(4))
    for row in predictions:
        by_type[row["problem_type"]].append(row)
        by_source[row["data_source"]].append(row)
        by_benchmark[row.get("benchmark", "")].append(row)
        if row.get("original_question_type"):
            by_original[row["original_question_type"]].append(row)
    summary = {"overall": block(predictions), "samples_per_question": samples,
               "by_benchmark": {k: block(v) for k, v in sorted(by_benchmark.items())},
               "by_problem_type": {k: block(v) for k, v in sorted(by_type.items())},
               "by_data_source": {k: block(v) for k, v in sorted(by_source.items())},
               "by_original_question_type": {k: block(v) for k, v in sorted(by_original.items())},
               "skipped": dict(Counter(s["reason_kind"] for s in skipped)), "skipped_total": len(skipped)}
    if "regression" in by_type:
        summary["regression_mean_relative_accuracy"] = block(by_type["regression"])["accuracy"]
    # mIoU, R@0.3/0.5/0.7 of a grounding type's accuracy (its IoU), or of the IoU a protocol gives beside it
    grounding = {kind: grounding_metrics([iou for row in by_type[kind] for iou in row.get("ious", row["accuracies"])])
                 for kind in GROUNDING_TYPES if kind in by_type}
    evidence = [iou for row in predictions if row["problem_type"] not in GROUNDING_TYPES
                for iou in row.get("ious", ())]
    if evidence:  # grounded QA: the answers' accuracy above, the IoU of the spans they cite here
        grounding["evidence"] = grounding_metrics(evidence)
    if grounding:
        summary["grounding"] = grounding
    return summary


def markdown(summary: dict, title: str) -> str:
    k = summary["samples_per_question"]
    lines = [f"# {title}", "", f"| group | questions | accuracy | pass@{k} |", "|---|---|---|---|"]
    o = summary["overall"]
    lines.append(f"| **overall** | {o['count']} | {o['accuracy']:.3f} | {o[f'pass@{k}']:.3f} |")
    for label, section in (("benchmark", "by_benchmark"), ("type", "by_problem_type"), ("source", "by_data_source"),
                           ("question type", "by_original_question_type")):
        for name, b in summary[section].items():
            lines.append(f"| {label}: {name} | {b['count']} | {b['accuracy']:.3f} | {b[f'pass@{k}']:.3f} |")
    for kind, metrics in summary.get("grounding", {}).items():
        lines.append(f"\n{kind}: " + ", ".join(f"{name} {value:.3f}" for name, value in metrics.items()))
    if summary.get("regression_mean_relative_accuracy") is not None:
        lines.append(f"\nRegression mean relative accuracy: {summary['regression_mean_relative_accuracy']:.3f}")
    lines.append(f"\nSkipped records: {summary['skipped_total']}")
    for reason, count in summary["skipped"].items():
        lines.append(f"- {reason}: {count}")
    return "\n".join(lines) + "\n"


def evaluation_engine(cfg, model_dir, tokenizer, sampling, world: int):
    """``eval.engine`` through the same registry as training (``app.rollout.registry``): the checkpoint in ``model.dtype``
    with the vision attention training uses, on the rank's device (its GPU when there is one), or vLLM there."""
    from app.rollout.registry import EngineSetup, build_rollout_engine
    from app.rollout.vllm import checkpoint_eos_ids

    device, ev = local_device(), cfg.eval
    model = None
    if not needs_engine_views(ev.engine):  # an engine with its own processor (vLLM) loads the checkpoint itself
        model = load_model(model_dir, dtype=DTYPES[cfg.model.dtype], attn_implementation=cfg.model.vision_attention,
                           trust_remote_code=cfg.model.trust_remote_code).to(device).eval()
        if cfg.forward.vision_chunk_frames:  # nothing trains here: the tower runs item by item, frame-chunked
            model.requires_grad_(False)
            vision_cache.install(model, "off", cfg.forward.vision_chunk_frames)
        log.info("evaluating %s in %s on %s", model_dir, cfg.model.dtype, device)
    eos_ids = checkpoint_eos_ids(model_dir, tokenizer) if model is None else eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    setup = EngineSetup(policy=model, tokenizer=tokenizer, sampling=sampling, device=device, eos_ids=eos_ids,
                        pad_id=pad_id, rollout=cfg.rollout, model_path=str(model_dir), dtype=cfg.model.dtype,
                        world=world, seed=ev.seed, max_model_len=cfg.data.max_prompt_length + ev.max_new_tokens)
    return build_rollout_engine(ev.engine, setup)


PROTOCOLS = Path(__file__).resolve().parents[2] / "configs" / "eval"
SETTINGS_FILE = "eval_config.yaml"


def protocol_file(name: str) -> Path:
    """``--protocol NAME``: configs/eval/NAME.yaml, or a YAML file's path; else an error listing the presets."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    preset = PROTOCOLS / f"{name}.yaml"
    if not preset.is_file():
        known = sorted(p.stem for p in PROTOCOLS.glob("*.yaml"))
        raise ConfigError(f"unknown evaluation protocol {name!r}: presets are {known} (configs/eval/), or pass a "
                          "YAML file")
    return preset


def evaluate(model_dir: str | Path, data_files, overrides: list[str] = (), protocol: str | None = None) -> dict | None:
    """Evaluate on one data file or a list of them (one table per file: a benchmark). ``protocol``: a preset of
    configs/eval/ (frames, pixels, prompt template, sampling, answer extraction), under the overrides.

    The stages: the run's settings and identity -> the output folder (resumed or new) -> the usable records ->
    this rank's unscored questions -> scored through the engine, one prediction line each -> merged and summarised
    by rank 0."""
    protocol_path = protocol_file(protocol) if protocol else None
    cfg = load_config(protocol_path, [f"model.path={model_dir}", *overrides], training=False)
    check_checkpoint(model_dir, "MODEL_DIR")
    from app.rollout.base import family_problems

    for problem in family_problems(json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", "?"),
                                   engine=cfg.eval.engine, setting="eval.engine"):
        raise ConfigError(problem)
    dist, rank, world = _dist()
    data_files = [Path(f) for f in ([data_files] if isinstance(data_files, (str, Path)) else data_files)]
    for data_file in data_files:
        if not data_file.is_file():
            raise ConfigError(f"data file not found: {data_file}")
    identity = run_identity(cfg, Path(model_dir), data_files)
    out = output_folder(cfg.eval, identity, dist)
    usable, skipped = usable_records(data_files, cfg.data)
    if not cfg.eval.resume and rank == 0:
        for path in [out / "predictions.jsonl", *out.glob("predictions.rank*.jsonl"), *out.glob("skipped.rank*.jsonl")]:
            path.unlink(missing_ok=True)
    if rank == 0:
        (out / RUN_FILE).write_text(json.dumps(identity, indent=2))
        write_settings(out / SETTINGS_FILE, cfg, model_dir, data_files, protocol, overrides)
    if dist:
        dist.barrier()
    done = {row["key"] for path in [out / "predictions.jsonl", *out.glob("predictions.rank*.jsonl")]
            for row in _read_jsonl(path)}
    assigned = [r for i, run in enumerate(question_runs(usable, cfg.eval)) if i % world == rank for r in run]
    mine = [r for r in assigned if record_key(r) not in done]
    resumed = len(assigned) - len(mine)
    scored = score_questions(mine, cfg, model_dir, out, rank, world)
    counts = torch.tensor([scored, resumed], dtype=torch.long)
    if dist:
        dist.all_reduce(counts)
        dist.barrier()
    if rank != 0:
        return None
    summary = merge_and_summarize(out, usable, skipped, cfg.eval.samples)
    data_names = ", ".join(str(f) for f in data_files)
    summary.update(model=str(model_dir), data=data_names, scored_this_run=int(counts[0]),
                   resumed_from_file=int(counts[1]), world_size=world, output_dir=str(out))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(markdown(summary, f"Evaluation of {model_dir} on {data_names}"))
    return summary


def output_folder(ev, identity: dict, dist) -> Path:
    """``eval.output_dir``, or with a resume the folder that holds this very evaluation (``choose_output_dir``):
    every rank decides alike (same files, nothing written yet)."""
    out = Path(ev.output_dir)
    if ev.resume:
        chosen = choose_output_dir(out, identity, ev.if_different)
        if chosen != out:
            log.warning("%s holds a different evaluation; evaluating into %s (eval.if_different=new_dir)", out, chosen)
        out = chosen
    if dist:
        dist.barrier()
    out.mkdir(parents=True, exist_ok=True)
    return out


def usable_records(data_files: list[Path], data_cfg) -> tuple[list[dict], list[dict]]:
    """Every record of the files, each tagged with its benchmark (file stem) and data root, and the skipped ones
    with their reasons (malformed lines, records training could not use either)."""
    records, skipped = [], []
    for data_file in data_files:
        found, bad_lines = read_records(data_file)
        root = Path(data_cfg.data_root) if data_cfg.data_root else data_file.parent
        records += [{**r, "_benchmark": data_file.stem, "_root": root} for r in found]
        skipped += [{"where": s.where, "reason": s.reason, "reason_kind": "malformed line"} for s in bad_lines]
    usable = []
    for record in records:
        reason = check_record(record, record["_root"], data_cfg.confine_to_root)
        if reason:
            skipped.append({"where": where(record), "reason": reason, "reason_kind": reason.split(" (")[0]
                            .split(":")[0]})
        else:
            usable.append(record)
    return usable, skipped


def score_questions(mine: list[dict], cfg, model_dir, out: Path, rank: int, world: int) -> int:
    """This rank's questions through ``eval.engine``, ``eval.batch_size`` at a time (a video's questions together,
    ``question_batches``): one prediction line each in predictions.rank{r}.jsonl (a record that cannot be encoded
    goes to skipped.rank{r}.jsonl with its reason). Returns how many were scored."""
    ev, data_cfg = cfg.eval, cfg.data
    processor = load_processor(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    tokenizer = getattr(processor, "tokenizer", processor)
    sampling = SamplingConfig(temperature=ev.temperature, top_p=ev.top_p, max_new_tokens=ev.max_new_tokens,
                              repetition_penalty=ev.repetition_penalty)
    engine = evaluation_engine(cfg, model_dir, tokenizer, sampling, world)
    sample = answer_sampler(engine, cfg, processor, sampling)  # one turn, or multi-turn with rollout.tools
    score, answer_of = ANSWER_EXTRACTION[ev.answer_extraction]
    iou_of = IOU_SCORING.get(ev.answer_extraction)  # the IoU beside an accuracy that is not one
    patch = image_patch_size(processor)
    rank_file = out / f"predictions.rank{rank}.jsonl"
    crash_after = int(os.environ.get(CRASH_ENV, "-1"))
    scored = 0
    bar = tqdm(total=len(mine), desc=f"eval rank {rank}", disable=rank != 0, dynamic_ncols=True)
    for runs in question_batches(mine, ev):
        batch, prompts = [], []
        for record, prompt, reason in encoded(processor, runs, data_cfg, needs_engine_views(ev.engine),
                                              ev.share_video):
            if prompt is None:  # skipped with its reason, exactly as training does; a resumed run skips it again
                _append(out / f"skipped.rank{rank}.jsonl", {"where": where(record), "reason": reason,
                                                             "reason_kind": reason.split(":")[0]})
                log.warning("skipping %s: %s", where(record), reason)
                continue
            if getattr(score, "needs_image_sizes", False):  # boxes in the model's input pixels (vlm_r1_rec)
                record = {**record, "_image_sizes": image_sizes(record, prompt, patch)}
            batch.append(record)
            prompts.append(prompt)
        if batch:
            # Each question draws from its own stream (seed, question key): its samples do not depend on the
            # batch it falls in, eval.batch_size or the number of ranks.
            seeds = [derive_seed(ev.seed, record_key(r)) for r in batch]
            with torch.no_grad():
                answers, calls = sample(prompts, ev.samples, seeds)
            for i, record in enumerate(batch):
                texts = answers[i]
                accuracies = [score(t, record) for t in texts]  # eval.answer_extraction
                _append(rank_file, {
                    "key": record_key(record), "problem_id": record.get("problem_id"),
                    "benchmark": record["_benchmark"], "original_question_type": record.get("original_question_type"),
                    "problem_type": record["problem_type"], "data_source": record.get("data_source", "unknown"),
                    "solution": record["solution"], "answers": [answer_of(t) for t in texts],
                    "completions": texts, "accuracies": accuracies,
                    "accuracy": sum(accuracies) / len(accuracies), "pass": float(max(accuracies) >= 0.5),
                    **({"tool_calls": [len(c) for c in calls[i]], "tool_results": calls[i]} if cfg.rollout.tools
                       else {}),
                    **({"ious": [iou_of(t, record) for t in texts]}
                       if iou_of is not None and (record["problem_type"] in GROUNDING_TYPES
                                                  or record.get("evidence") is not None) else {}),
                })
                scored += 1
                if scored == crash_after:
                    log.error("simulated crash after %d questions (%s)", scored, CRASH_ENV)
                    os._exit(17)
        bar.update(sum(len(run) for run in runs))
    bar.close()
    return scored


def image_sizes(record: dict, prompt, patch: int) -> list[tuple[int, int, int, int]]:
    """Per image of the record: (height, width) of the file and of the model's input (the processor's grid x the
    patch size), for protocols whose boxes are in the model's input pixels."""
    from PIL import Image

    grid = prompt.inputs.get("image_grid_thw")
    out = []
    for i, path in enumerate(media_paths(record, record["_root"]) if record.get("data_type") == "image" else []):
        with Image.open(path) as image:
            width, height = image.size
        out.append((height, width, int(grid[i][1]) * patch, int(grid[i][2]) * patch))
    return out


def merge_and_summarize(out: Path, usable: list[dict], skipped: list[dict], samples: int) -> dict:
    """Rank 0: every rank's prediction lines merged into predictions.jsonl in the files' order (atomically; the
    per-rank files removed), the skips of every rank added, and the summary."""
    merged_file = out / "predictions.jsonl"
    order = {record_key(r): i for i, r in enumerate(usable)}
    rows = {}
    for path in [merged_file, *sorted(out.glob("predictions.rank*.jsonl"))]:
        for row in _read_jsonl(path):
            rows[row["key"]] = row
    predictions = sorted(rows.values(), key=lambda r: order.get(r["key"], len(order)))
    skip_rows = {s["where"]: s for path in sorted(out.glob("skipped.rank*.jsonl")) for s in _read_jsonl(path)}
    skipped = skipped + list(skip_rows.values())
    tmp = merged_file.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in predictions))
    os.replace(tmp, merged_file)
    for path in out.glob("predictions.rank*.jsonl"):
        path.unlink()
    return summarize(predictions, skipped, samples)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    configure_logging()
    try:
        rest, protocol = list(argv[1:]), None
        if "--protocol" in rest:
            at = rest.index("--protocol")
            if at + 1 >= len(rest):
                raise ConfigError("--protocol needs a preset name (configs/eval/) or a YAML file")
            protocol = rest[at + 1]
            del rest[at : at + 2]
        files = [a for a in rest if not OVERRIDE.match(a)]
        summary = evaluate(argv[0], files, [a for a in rest if OVERRIDE.match(a)], protocol=protocol)
    except ConfigError as error:
        raise SystemExit(f"config error: {error}") from None
    except CheckpointPathError as error:
        raise SystemExit(f"model error: {error}") from None
    except EvaluationMismatch as error:
        raise SystemExit(f"evaluation error: {error}") from None
    if summary is not None:
        print(markdown(summary, f"Evaluation of {argv[0]}"))
    from app.runtime.distributed import shutdown

    shutdown()  # torn down before exit, not by the interpreter


if __name__ == "__main__":
    main()
