"""scripts/eval.sh: 2 ranks merge to the single-rank result; a killed evaluation resumes without re-scoring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.data.synthetic import generate
from app.runtime.models import build_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.distributed
EVAL = ["data.min_pixels=3136", "data.max_pixels=3136", "eval.max_new_tokens=12", "eval.batch_size=3"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    files = generate(root / "data", train=2, heldout=11, seed=1)
    (files["heldout"].parent / "heldout.jsonl").write_text(
        files["heldout"].read_text() + '{"problem": "broken", "problem_type": "multiple choice", "solution": "x", '
        '"data_type": "video", "path": "videos/missing.mp4"}\n')
    return {"model": build_tiny_checkpoint(root / "tiny", "qwen2_5_vl", seed=0), "data": files["heldout"]}


def run_eval(assets, out: Path, nproc: int = 1, extra=(), env=None, check=True):
    args = ["bash", "scripts/eval.sh", str(assets["model"]), str(assets["data"]), f"eval.output_dir={out}", *EVAL,
            *extra]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NPROC_PER_NODE": str(nproc), **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(result.stdout[-3000:] + result.stderr[-3000:])
    return result


def predictions(out: Path) -> dict:
    return {r["key"]: r for r in map(json.loads, (out / "predictions.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def straight(assets, tmp_path_factory):
    """One single-rank evaluation through scripts/eval.sh, the reference of the two-rank and the resumed ones."""
    out = tmp_path_factory.mktemp("eval-straight") / "one"
    run_eval(assets, out)
    return out


def test_two_ranks_merge_to_the_single_rank_result(assets, straight, tmp_path):
    run_eval(assets, tmp_path / "two", nproc=2)
    one, two = (json.loads((d / "summary.json").read_text()) for d in (straight, tmp_path / "two"))
    assert two["world_size"] == 2 and one["world_size"] == 1
    for key in ("overall", "by_problem_type", "by_data_source", "skipped", "skipped_total"):
        assert one[key] == two[key], key
    assert one["overall"]["count"] == 11 and one["skipped_total"] == 1
    assert predictions(straight) == predictions(tmp_path / "two")
    ids = [r["problem_id"] for r in predictions(straight).values()]
    assert ids == list(range(2, 13))  # file order, not rank order
    table = (straight / "summary.md").read_text()
    assert "| **overall** | 11 |" in table and "video file not found" in table


@pytest.mark.slow  # two launches
def test_killed_evaluation_resumes_without_rescoring(assets, straight, tmp_path):
    out = tmp_path / "resumed"
    killed = run_eval(assets, out, env={"PREFIX_GRPO_EVAL_CRASH_AFTER": "4"}, check=False)
    assert killed.returncode == 17
    finished = [json.loads(line) for line in (out / "predictions.rank0.jsonl").read_text().splitlines()]
    assert len(finished) == 4
    run_eval(assets, out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_file"] == 4 and summary["scored_this_run"] == 7
    merged = predictions(out)
    assert len(merged) == 11
    for row in finished:  # the rows written before the kill are kept as they were
        assert merged[row["key"]] == row
    assert json.loads((straight / "summary.json").read_text())["overall"] == summary["overall"]


def test_sampled_evaluation_reports_pass_at_k(assets, tmp_path):
    """In this process (scripts/eval.sh is run by the tests above)."""
    from app.evaluation.evaluate import evaluate

    evaluate(assets["model"], [assets["data"]], [f"eval.output_dir={tmp_path / 'k'}", *EVAL, "eval.samples=4",
                                                  "eval.temperature=1.0"])
    summary = json.loads((tmp_path / "k" / "summary.json").read_text())
    assert summary["samples_per_question"] == 4 and "pass@4" in summary["overall"]
    assert all(len(r["completions"]) == 4 for r in predictions(tmp_path / "k").values())
    assert summary["overall"]["pass@4"] >= summary["overall"]["accuracy"] - 1e-9


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`make demo` on a handful of records and steps, once: its smoke test reads it and the objectives demo reuses
    its checkpoint, data and warm start, as it does after a user's `make demo`."""
    root = tmp_path_factory.mktemp("demo")
    result = subprocess.run(
        [sys.executable, "-m", "app.demos.video", "--out", str(root / "demo"), "--data", str(root / "data"),
         "--train-size", "8", "--heldout-size", "4", "--warm-steps", "2", "--ab-steps", "2", "train.max_steps=2",
         "train.prompts_per_rank=2", "train.groups_per_micro_batch=2", "train.save_every=0",
         "logging.wandb_mode=disabled", "logging.progress_bar=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    return root, result


@pytest.mark.slow  # about a minute (five launcher runs): make test-all and CI run it
def test_demo_smoke(demo):
    """The `make demo` pipeline end to end on a handful of records and steps (the real run: README)."""
    tmp_path, result = demo
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "demo" / "demo_summary.json").read_text())
    assert summary["heldout_questions"] == 4
    assert set(summary["accuracy"]) == {"untrained", "format warm start", "after GRPO"}
    for png in ("training_curves.png", "heldout_accuracy.png", "grouped_vs_repeated.png"):
        assert (tmp_path / "demo" / png).stat().st_size > 10_000
    assert "before / after" in result.stdout
    assert summary["task"] == "order" and summary["ab"]["steps"] == 2
    # The repeated layout on the grouped run's recorded rollouts: the same rewards, and loss, KL and gradient norm
    # within float rounding (this fails when the A/B's training parts); HF generate is timed beside them.
    runs = summary["ab"]["runs"]
    assert set(runs) == {"grouped (Prefix Grouper)", "repeated layout, same rollouts", "repeated + HF generate"}
    assert summary["ab"]["max_reward_difference"] == 0.0
    assert summary["ab"]["max_relative_difference"] < 1e-4
    assert runs["repeated + HF generate"]["max_reward_difference"] < 1e-6  # 2 steps: no draw flipped yet
    assert "pixel cap" not in result.stdout + result.stderr  # no third-party warning per process


def test_bad_image_and_paths_outside_the_root_are_skipped_with_reasons(assets, tmp_path, caplog):
    """An image PIL cannot open and a path that leaves the data root: evaluation skips both with their reasons
    (as training does), scores the rest, and a resumed evaluation skips them again without dying. In this process
    (scripts/eval.sh is run by the tests above and below)."""
    import logging

    from app.evaluation.evaluate import evaluate

    def run_here(local, out, extra=()):
        return evaluate(local["model"], [local["data"]], [f"eval.output_dir={out}", *EVAL, *extra])

    data_dir = assets["data"].parent
    (data_dir / "broken.png").write_bytes(b"not an image at all")
    outside = tmp_path / "outside.mp4"
    outside.write_bytes(next((data_dir / "videos").glob("*.mp4")).read_bytes())
    records = [json.loads(line) for line in assets["data"].read_text().splitlines()][:3]
    records.append({"problem_id": "bad-image", "problem": "What is shown?", "problem_type": "multiple choice",
                    "options": ["A. x", "B. y"], "solution": "<answer>A</answer>", "data_type": "image",
                    "path": "broken.png"})
    records.append({**records[0], "problem_id": "escapes", "path": os.path.relpath(outside, data_dir)})
    data = data_dir / "mixed_bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    local = {**assets, "data": data}
    out = tmp_path / "eval"
    with caplog.at_level(logging.INFO):
        run_here(local, out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["overall"]["count"] == 3 and summary["skipped_total"] == 2
    table = (out / "summary.md").read_text()
    assert "could not build the prompt" in table and "UnidentifiedImageError" in table + caplog.text
    assert "path outside the data root" in table
    run_here(local, out)  # resumed: the finished ones are kept, the bad one is skipped again
    assert json.loads((out / "summary.json").read_text())["skipped_total"] == 2
    run_here(local, tmp_path / "allowed", extra=["data.confine_to_root=false"])
    assert json.loads((tmp_path / "allowed" / "summary.json").read_text())["overall"]["count"] == 4


def test_merged_benchmark_files_with_colliding_ids_give_one_prediction_each(assets, tmp_path):
    """Two benchmark files in Video-R1's evaluation format (JSON lists numbering problem_ids from 1, with
    original_question_type) evaluated together: one prediction per record, a table per benchmark and per
    original question type."""
    records = [json.loads(line) for line in assets["data"].read_text().splitlines()]
    videos = [r for r in records if r.get("path") and (assets["data"].parent / r["path"]).is_file()][:5]
    files = []
    for name, part, kind in (("MVBench", videos[:3], "action_sequence"), ("TempCompass", videos[3:5], "order")):
        rows = [{**r, "problem_id": i + 1, "original_question_type": kind, "data_source": name}
                for i, r in enumerate(part)]
        path = assets["data"].parent / f"eval_{name}.json"
        path.write_text(json.dumps(rows))
        files.append(path)
    out = tmp_path / "merged"
    from app.evaluation.evaluate import evaluate

    evaluate(assets["model"], files, [f"eval.output_dir={out}", *EVAL])  # in this process
    rows = predictions(out)
    assert len(rows) == 5 and [r["problem_id"] for r in rows.values()] == [1, 2, 3, 1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert {k: v["count"] for k, v in summary["by_benchmark"].items()} == {"eval_MVBench": 3, "eval_TempCompass": 2}
    assert {k: v["count"] for k, v in summary["by_original_question_type"].items()} == {"action_sequence": 3,
                                                                                         "order": 2}
    assert "| benchmark: eval_MVBench | 3 |" in (out / "summary.md").read_text()


# ---- a resume continues only the same evaluation; each question draws from its own random stream ---------------
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-small")
    files = generate(root / "data", train=2, heldout=4, seed=2)
    return {"a": build_tiny_checkpoint(root / "a", "qwen2_5_vl", seed=0),
            "b": build_tiny_checkpoint(root / "b", "qwen2_5_vl", seed=1), "data": files["heldout"]}


def in_process(model, data, out, *extra):
    from app.evaluation.evaluate import evaluate

    return evaluate(model, [data], [f"eval.output_dir={out}", *EVAL, "eval.max_new_tokens=6", *extra])


def test_resume_refuses_predictions_of_another_model_or_settings(small, tmp_path):
    from app.evaluation.evaluate import EvaluationMismatch

    out = tmp_path / "eval"
    first = in_process(small["a"], small["data"], out)
    assert first["scored_this_run"] == 4
    with pytest.raises(EvaluationMismatch, match=r"model\.files\.model\.safetensors\.sha256.*model\.path"):
        in_process(small["b"], small["data"], out)  # today: B reported A's numbers ("resumed 4")
    with pytest.raises(EvaluationMismatch, match=r"settings\.eval\.samples: 1 -> 2"):
        in_process(small["a"], small["data"], out, "eval.samples=2", "eval.temperature=1.0")
    with pytest.raises(EvaluationMismatch, match=r"settings\.data\.max_frames: 16 -> 8"):
        in_process(small["a"], small["data"], out, "data.max_frames=8")
    again = in_process(small["a"], small["data"], out)  # the very same evaluation resumes
    assert again["resumed_from_file"] == 4 and again["scored_this_run"] == 0
    other = in_process(small["b"], small["data"], out, "eval.if_different=new_dir")
    assert other["output_dir"] == str(tmp_path / "eval-2") and other["scored_this_run"] == 4
    assert json.loads((out / "summary.json").read_text())["model"] == str(small["a"])  # A's results untouched
    changed = small["data"].parent / "changed.jsonl"
    changed.write_text(small["data"].read_text().replace('"problem_id": 1,', '"problem_id": 101,'))
    with pytest.raises(EvaluationMismatch, match="data"):
        from app.evaluation.evaluate import evaluate

        evaluate(small["a"], [changed], [f"eval.output_dir={out}", *EVAL, "eval.max_new_tokens=6"])


def test_each_question_draws_its_own_samples_whatever_the_batch(small, tmp_path):
    sampled = ["eval.samples=3", "eval.temperature=1.0"]
    one = in_process(small["a"], small["data"], tmp_path / "b1", "eval.batch_size=1", *sampled)
    three = in_process(small["a"], small["data"], tmp_path / "b3", "eval.batch_size=3", *sampled)
    assert predictions(tmp_path / "b1") == predictions(tmp_path / "b3")  # today: pass@k moved with the batch size
    assert one["overall"] == three["overall"]
    # Copies of one question (different keys) get different draws, not the same characters in every batch.
    question = small["data"].read_text().splitlines()[0]
    copies = small["data"].parent / "copies.jsonl"
    copies.write_text("\n".join([question] * 4) + "\n")
    from app.evaluation.evaluate import evaluate

    evaluate(small["a"], [copies], [f"eval.output_dir={tmp_path / 'copies'}", *EVAL, "eval.max_new_tokens=6",
                                    "eval.batch_size=4", *sampled])
    completions = [tuple(r["completions"]) for r in predictions(tmp_path / "copies").values()]
    assert len(completions) == 4 and len(set(completions)) == 4


def test_evaluation_runs_in_the_configured_dtype_on_the_ranks_device(small, tmp_path, monkeypatch):
    """model.dtype=bfloat16 evaluates a bfloat16 model (not float32 on the host), inputs on the model's device,
    with the configured vision attention; float32 stays float32. The answers of both are scored."""
    import app.rollout.local as engine_module

    seen = []
    real = engine_module.generate_groups

    def spy(model, prompts, *args, **kwargs):
        seen.append((next(model.parameters()).dtype, next(model.parameters()).device, prompts["input_ids"].device,
                     model.config.vision_config._attn_implementation))
        return real(model, prompts, *args, **kwargs)

    monkeypatch.setattr(engine_module, "generate_groups", spy)
    summary = in_process(small["a"], small["data"], tmp_path / "bf16", "model.dtype=bfloat16",
                         "model.vision_attention=eager")
    assert summary["scored_this_run"] == 4
    assert {s[0] for s in seen} == {torch.bfloat16} and {s[3] for s in seen} == {"eager"}
    assert all(s[1] == s[2] for s in seen)  # inputs on the model's device
    seen.clear()
    in_process(small["a"], small["data"], tmp_path / "fp32")
    assert {s[0] for s in seen} == {torch.float32}


def test_resume_identity_reads_the_whole_weight_file(tmp_path, monkeypatch):
    """A re-export that changes only middle bytes of a large weight file (a LoRA merge with a frozen tower) is
    another model; an unchanged file is hashed once and then served from the digest cache."""
    import app.common.identity as evaluate_module

    monkeypatch.setattr(evaluate_module, "DIGEST_CACHE", tmp_path / "cache" / "sha256.json")
    big = tmp_path / "model.safetensors"
    size = 80 << 20  # past the 64 MiB where only the first and last MiB used to be read
    big.write_bytes(bytes(size))
    cache = {}
    first = evaluate_module.file_identity(big, cache)
    with big.open("r+b") as f:
        f.seek(size // 2)
        f.write(b"\x01")
    assert evaluate_module.file_identity(big, cache)["sha256"] != first["sha256"]
    calls = []
    monkeypatch.setattr(evaluate_module.hashlib, "sha256", lambda *a: calls.append(1) or __import__("hashlib").sha256())
    again = evaluate_module.file_identity(big, cache)
    assert not calls and again == evaluate_module.file_identity(big, cache)  # cached by size, times and inode


def test_evaluation_with_tools_answers_in_several_turns(small, tmp_path, monkeypatch):
    """rollout.tools in the evaluation settings: each question runs as multi-turn rollouts (the same loop as
    training), the last model turn is what is scored, and each prediction says how many calls its samples made and
    what each returned.
    The tiny model's first turn is scripted to call get_frames (it never writes a call by itself)."""
    import app.rollout.multiturn as multiturn

    honest = multiturn.tree_rollout

    def first_turn_calls(generate, prompts, contexts, **kwargs):
        state = {"first": True}

        def scripted(asked, group_size, seeds, max_new_tokens):
            rollout = generate(asked, group_size, seeds, max_new_tokens)
            if state.pop("first", False):  # the first turn: a call, in the model's own tokens
                tok = kwargs["tokenizer"]
                ids = tok.encode('<tool_call>{"name": "get_frames", "arguments": {"start": 0, "end": 1}}'
                                 '</tool_call>', add_special_tokens=False)
                rollout.completion_ids = torch.tensor([ids] * len(rollout.stop_reasons))
                rollout.completion_mask = torch.ones_like(rollout.completion_ids)
                rollout.logprobs = torch.zeros(rollout.completion_ids.shape)
                rollout.stop_reasons = ["stop_string"] * len(rollout.stop_reasons)
            return rollout

        return honest(scripted, prompts, contexts, **kwargs)

    monkeypatch.setattr(multiturn, "tree_rollout", first_turn_calls)
    summary = in_process(small["a"], small["data"], tmp_path / "tools", "rollout.tools=[get_frames]",
                         "rollout.max_turns=2")
    rows = [json.loads(line) for line in (tmp_path / "tools" / "predictions.jsonl").read_text().splitlines()]
    assert summary["scored_this_run"] == 4 and all(row["tool_calls"] == [1] for row in rows)
    assert all(row["tool_results"] == [[{"error": None, "observation": "Frames from 0.0 s to 1.0 s:"}]] for row in rows)
    assert all("<tool_call>" not in text for row in rows for text in row["completions"])  # the answer turn


@pytest.mark.slow
def test_each_objective_runs_on_the_demo_and_logs_its_ratios(demo):
    """app.demos.objectives on a handful of records and steps, in the folder `make demo` left: two objectives (the
    default clip and CISPO, whose settings differ most from it) train from the demo's own warm start (reused, not
    trained again) through scripts/train.sh and their ratio statistics reach the summary and its plot; every
    objective's settings as the runner resolves them. The runner is one loop over the objectives; each objective's
    GRPO step and ratio statistics are tests/test_stages.py's (in process, make test)."""
    from app.config.loading import load_config
    from app.demos import objectives as demo_objectives

    tmp_path, result = demo
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    warm = tmp_path / "demo" / "sft" / "final" / "model.safetensors"
    before = warm.stat().st_mtime_ns
    trained = ["clip", "cispo"]
    summary = demo_objectives.main(["--out", str(tmp_path / "demo"), "--data", str(tmp_path / "data"),
                                    "--train-size", "8", "--heldout-size", "4", "--warm-steps", "2", "--steps", "2",
                                    "train.prompts_per_rank=2", "train.groups_per_micro_batch=2",
                                    "logging.progress_bar=false", "--objectives", *trained])
    assert warm.stat().st_mtime_ns == before  # the demo's warm start, reused
    assert list(summary["objectives"]) == trained
    for name, r in summary["objectives"].items():
        assert r["steps"] == 2 and r["ratio_min"] <= r["ratio_mean"] <= r["ratio_max"], name
        assert 0.0 <= r["heldout_accuracy"] <= 1.0
    assert summary["objectives"]["cispo"]["settings"] == {"epsilon_low": 1.0, "epsilon_high": 4.0, "loss_type": "dapo"}
    ran = {name: demo_objectives.resolved(load_config(ROOT / demo_objectives.CONFIG, [
        "model.path=m", f"grpo.policy_loss={name}", *extra])) for name, extra in demo_objectives.OBJECTIVES.items()}
    assert ran["cispo"] == summary["objectives"]["cispo"]["settings"] and ran["clip"] == summary["objectives"][
        "clip"]["settings"]
    assert ran["gspo"] == {"epsilon_low": 3e-4, "epsilon_high": 4e-4, "loss_type": "grpo"}
    assert ran["sapo"] == {"sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05, "loss_type": "grpo"}
    assert (tmp_path / "demo" / "objectives" / "objectives_reward.png").stat().st_size > 10_000


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_videos_questions_are_prefilled_once_with_the_same_predictions(tmp_path, dtype, monkeypatch):
    """Video-MME's shape (3 questions on each video): with eval.share_video (the default) each video is decoded
    and prefilled once for its questions (the tower sees each clip once); greedy predictions equal the per-question
    prefill's, in float32 and bfloat16."""
    import app.rollout.local as engine_module

    files = generate(tmp_path / "data", train=0, heldout=9, seed=4, questions_per_video=3)
    model = build_tiny_checkpoint(tmp_path / "tiny", "qwen2_5_vl", seed=0)
    seen = []
    real = engine_module.generate_groups

    def spy(model_, prompts, *args, **kwargs):
        seen.append((len(kwargs.get("families") or []), int(prompts["input_ids"].shape[0])))
        patches = []
        hook = model_.model.visual.register_forward_hook(lambda m, a, o: patches.append(a[0].shape[0]))
        try:
            out = real(model_, prompts, *args, **kwargs)
        finally:
            hook.remove()
        seen[-1] += (sum(patches), int(prompts["video_grid_thw"].prod(-1).sum()))
        return out

    monkeypatch.setattr(engine_module, "generate_groups", spy)
    shared = in_process(model, files["heldout"], tmp_path / "shared", f"model.dtype={dtype}")
    assert [s[:2] for s in seen] == [(1, 3)] * 3  # batch_size 3: one video's three questions, one family
    assert all(s[2] * 3 == s[3] for s in seen)  # the tower ran once per clip, not once per question
    seen.clear()
    alone = in_process(model, files["heldout"], tmp_path / "alone", f"model.dtype={dtype}", "eval.share_video=false")
    assert all(s[2] == s[3] for s in seen)
    assert shared["overall"] == alone["overall"] and shared["scored_this_run"] == 9
    mine, theirs = predictions(tmp_path / "shared"), predictions(tmp_path / "alone")
    assert [r["completions"] for r in mine.values()] == [r["completions"] for r in theirs.values()]
