"""A run never silently uses what does not belong to it: replay pairs completions with prompts by the prompts'
identity (not their place in a step), a resume refuses a checkpoint of other data, settings or model by name, and a
save that runs out of space stops with the path and the bytes, leaving the last good checkpoint usable."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from app.rollout.replay import ReplayError
from tests.test_shared_video_train import one_step, shared_assets  # noqa: F401 - the module's fixture, reused

ROOT = Path(__file__).resolve().parents[1]


def test_a_replay_in_another_order_is_the_recorded_step(shared_assets, tmp_path, monkeypatch):  # noqa: F811
    """Recorded at k = 1 on a shuffled file; replayed at k = 4, which orders the prompts by video, and again with
    another shuffle seed of the data order alone: every prompt gets its own recorded completions, so the step is
    the recorded step (one step holds all 8 questions: the same prompts, in another order)."""
    step = {"train.prompts_per_rank": 8, "train.groups_per_micro_batch": 8, "data.shuffle": True}
    base, base_grads, base_t = one_step(shared_assets, tmp_path / "k1", monkeypatch, **step, **{"rollout.record": True})
    replays = {
        "k4": {"data.questions_per_video": 4},
        "micro-batches of 2": {"train.groups_per_micro_batch": 2, "data.questions_per_video": 4},
    }
    recorded = {p.record["problem_id"]: (base_t.rollout, i) for i, p in enumerate(base_t.prompts)}
    for name, extra in replays.items():
        got, grads, t = one_step(shared_assets, tmp_path / name.replace(" ", "_"), monkeypatch, **{
            **step, **extra, "rollout.engine": "replay", "rollout.replay_dir": tmp_path / "k1"})
        order = [p.record["problem_id"] for p in t.prompts]
        assert sorted(order) == sorted(recorded) and order != [p.record["problem_id"] for p in base_t.prompts], name
        g = 2
        for i, p in enumerate(t.prompts):  # each prompt's completions are the ones recorded for that prompt
            rollout, j = recorded[p.record["problem_id"]]
            mine = t.rollout.completion_ids[i * g:(i + 1) * g]
            theirs = rollout.completion_ids[j * g:(j + 1) * g]
            width = max(int(t.rollout.completion_mask[i * g:(i + 1) * g].sum(1).max()), 1)
            assert torch.equal(mine[:, :width], theirs[:, :width]), (name, p.record["problem_id"])
        assert math.isclose(got["loss"], base["loss"], rel_tol=1e-5, abs_tol=1e-7), name
        assert math.isclose(norm(grads), norm(base_grads), rel_tol=1e-4), name
        assert norm(base_grads) > 0 and base["reward/std"] > 0


def norm(grads: dict) -> float:
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))


def test_a_prompt_the_record_lacks_stops_the_replay_by_name(shared_assets, tmp_path, monkeypatch):  # noqa: F811
    """Other frame settings make other prompts: the replay stops on the first, naming its record and saying what
    the record holds; another group size is named as such."""
    one_step(shared_assets, tmp_path / "rec", monkeypatch, **{"rollout.record": True})
    replay = {"rollout.engine": "replay", "rollout.replay_dir": tmp_path / "rec"}
    with pytest.raises(ReplayError, match=r"replay: prompt .*train\.jsonl:\d+ \(problem_id .*\) is not in .*no "
                                          r"prompt with its tokens and media.*the record holds 4 rollouts of 4 prompts"):
        one_step(shared_assets, tmp_path / "frames", monkeypatch, **replay, **{"data.max_frames": 2})
    with pytest.raises(ReplayError, match=r"recorded at G=2 epoch 0, not at G=4 epoch 0"):
        one_step(shared_assets, tmp_path / "g4", monkeypatch, **replay, **{"rollout.group_size": 4})
    with pytest.raises(ReplayError, match=r"other sampling settings \(rollout.temperature: recorded 1.0, this run 0.5"):
        one_step(shared_assets, tmp_path / "t", monkeypatch, **replay, **{"rollout.temperature": 0.5})


# ---- resume: the checkpoint's fingerprint ------------------------------------------------------------------------
FINGERPRINTED_CHANGES = {  # setting -> (override, what the refusal names)
    "data.shuffle": ({"data.shuffle": False}, "data.shuffle: True -> False"),
    "train.seed": ({"train.seed": 7}, "train.seed: 0 -> 7"),
    "train.prompts_per_rank": ({"train.prompts_per_rank": 4}, "train.prompts_per_rank: 2 -> 4"),
    "rollout.group_size": ({"rollout.group_size": 4}, "rollout.group_size: 2 -> 4"),
    "data.questions_per_video": ({"data.questions_per_video": 2}, "data.questions_per_video: 1 -> 2"),
    "data file contents": ({"data.train_file": "REORDERED"}, "data.train_file: other contents"),
    "model": ({"model.path": "OTHER_MODEL"}, "model.path: another model"),
}


def resume_settings(assets, out, **extra) -> dict:
    base = {"model.path": assets["checkpoint"], "data.train_file": assets["train"], "train.output_dir": out,
            "data.shuffle": True, "data.max_frames": 4, "train.max_steps": 2, "train.prompts_per_rank": 2,
            "train.groups_per_micro_batch": 2, "train.learning_rate": 1e-3, "train.save_every": 1,
            "rollout.group_size": 2, "rollout.max_completion_length": 6, "grpo.beta": 0.04,
            "logging.progress_bar": False, "logging.wandb_mode": "disabled", "train.export_hf": False,
            "rewards.functions": f"[format, accuracy, '{assets['plugin']}']"}
    return {**base, **extra}


def test_every_fingerprinted_setting_changes_the_fingerprint_by_name(shared_assets, tmp_path):  # noqa: F811
    """In process: each setting of the list (and the data file's content, and the model) shows up in the
    differences by name with its old and new value; settings that define neither the data nor the objective (logging,
    save_every, the decode mode, the prefill chunk) leave it alone; the schedule is apart from it."""
    from app.config.loading import load_config
    from app.runtime.models import build_tiny_checkpoint
    from app.training.fingerprint import resume_problems, run_fingerprint

    def fingerprint(**extra):
        values = resume_settings(shared_assets, tmp_path / "out", **extra)
        return run_fingerprint(load_config("configs/demo_cpu.yaml", [f"{k}={v}" for k, v in values.items()]))

    reordered = tmp_path / "reordered.jsonl"
    lines = open(shared_assets["train"]).read().splitlines()
    reordered.write_text("\n".join(reversed(lines)) + "\n")
    other = build_tiny_checkpoint(tmp_path / "other", "qwen2_5_vl", seed=1)
    base = fingerprint()
    for name, (override, named) in FINGERPRINTED_CHANGES.items():
        override = {k: {"REORDERED": reordered, "OTHER_MODEL": other}.get(v, v) for k, v in override.items()}
        problems = resume_problems(base, fingerprint(**override))
        assert len(problems) == 1 and problems[0].startswith(named), (name, problems)
    free = {"logging.log_every": 5, "train.save_every": 3, "rollout.decode": "static", "rollout.prefill_chunk_size": 64,
            "train.keep_checkpoints": 5, "train.max_steps": 9, "train.learning_rate": 5e-4}
    assert resume_problems(base, fingerprint(**free)) == []
    assert fingerprint(**free)["schedule"]["max_steps"] == 9


@pytest.mark.slow  # 3 runs through scripts/train.sh (one of them refused): about 50 s
def test_a_resume_with_other_settings_stops_naming_each_and_continue_goes_on(shared_assets, tmp_path,  # noqa: F811
                                                                               monkeypatch):
    """Through scripts/train.sh: 2 steps saved; a resume that changes any one setting of the list stops before
    loading a model, in one line naming it with its old and new value and the setting that continues anyway (the
    first setting through the launcher; each other one through the same command line, ``app.training.train``, in
    this process: the launch adds nothing to a refusal made before any model is loaded);
    train.resume_if_different=continue resumes (each difference warned); a longer max_steps continues, saying how the
    schedule goes on."""
    import app.training.recipe as recipe_module
    from app.runtime.models import build_tiny_checkpoint
    from app.training.train import main as train_main
    from tests.helpers import world_of_one
    from tests.test_trainer import run

    out = tmp_path / "run"

    def train(**extra):
        values = resume_settings(shared_assets, out, **extra)
        return [str(ROOT / "scripts" / "train.sh"), "configs/demo_cpu.yaml", *[f"{k}={v}" for k, v in values.items()]]

    run(train())
    reordered = tmp_path / "reordered.jsonl"
    reordered.write_text("\n".join(reversed(open(shared_assets["train"]).read().splitlines())) + "\n")
    other = build_tiny_checkpoint(tmp_path / "other", "qwen2_5_vl", seed=1)
    for number, (name, (override, named)) in enumerate(FINGERPRINTED_CHANGES.items()):
        override = {k: {"REORDERED": reordered, "OTHER_MODEL": other}.get(v, v) for k, v in override.items()}
        if number == 0:  # through the launcher
            refused = run(train(**override, **{"train.resume": True}), check=False)
            assert refused.returncode != 0, name
            lines = [line for line in refused.stderr.splitlines() if line.startswith("resume error:")]
            assert len(lines) == 1 and named in lines[0] and "train.resume_if_different=continue" in lines[0], \
                (name, refused.stderr[-2000:])
            assert "loading the policy" not in refused.stderr, name  # stopped before any model was loaded
            continue
        with monkeypatch.context() as patch, world_of_one(patch):
            patch.setattr(recipe_module, "load_processor", lambda *a, _name=name, **k: pytest.fail(
                f"{_name}: a model was loaded"))
            with pytest.raises(SystemExit) as stopped:
                train_main(train(**override, **{"train.resume": True})[1:])
        message = str(stopped.value)
        assert message.startswith("resume error:") and "\n" not in message, (name, message)
        assert named in message and "train.resume_if_different=continue" in message, (name, message)
    went_on = run(train(**{"train.resume": True, "train.max_steps": 3, "data.questions_per_video": 2,
                           "train.resume_if_different": "continue"}))
    assert "resume despite a difference (train.resume_if_different=continue): data.questions_per_video: " \
           "1 -> 2" in went_on.stderr
    assert "train.max_steps 2 -> 3" in went_on.stderr and "next step's learning rate is" in went_on.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


# ---- saves on a full disk ----------------------------------------------------------------------------------------
@pytest.mark.slow  # three runs through scripts/train.sh: about 60 s
def test_a_save_that_runs_out_of_space_stops_by_name_and_the_last_checkpoint_resumes_bitwise(shared_assets,  # noqa: F811
                                                                                           tmp_path):
    """The save at step 2 hits a file-size limit (as a full disk would stop its writes): the run ends with one line
    naming the checkpoint, the bytes it needs and the bytes free; step 1's checkpoint and `latest` are untouched and
    a resume from them ends at the uninterrupted run's weights bit for bit. Then the export at the end fails the same
    way; a resume with nothing left to train writes it."""
    from app.runtime.checkpoint import FILE_LIMIT_ENV
    from tests.test_trainer import run, weights

    def train(out, **extra):
        values = resume_settings(shared_assets, out, **{"train.max_steps": 3, "train.export_hf": True, **extra})
        return [str(ROOT / "scripts" / "train.sh"), "configs/demo_cpu.yaml", *[f"{k}={v}" for k, v in values.items()]]

    run(train(tmp_path / "straight"))
    out = tmp_path / "full"
    failed = run(train(out), env={FILE_LIMIT_ENV: "200000@2"}, check=False)
    assert failed.returncode != 0
    lines = [line for line in failed.stderr.splitlines() if line.startswith("save error:")]
    assert len(lines) == 1, failed.stderr[-3000:]
    assert re.search(r"saving checkpoint .*step-0000002 failed .*needs about \d+ bytes .* and \d+ bytes .* are free "
                     r"there; this process may not write files over 200000 bytes .*latest still names step-0000001",
                     lines[0]), lines[0]
    assert "Traceback" not in failed.stderr
    assert (out / "checkpoints" / "latest").read_text() == "step-0000001"
    assert not (out / "checkpoints" / ".incoming" / "step-0000002").exists()
    failed = run(train(out, **{"train.resume": True}), env={FILE_LIMIT_ENV: "200000@export"}, check=False)
    lines = [line for line in failed.stderr.splitlines() if line.startswith("save error:")]
    assert failed.returncode != 0 and len(lines) == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert re.search(r"exporting to .*final failed .*needs about \d+ bytes.*redo the export with the same command and "
                     r"train.resume=true", lines[0]), lines[0]
    assert (out / "checkpoints" / "latest").read_text() == "step-0000003" and not (out / "final").exists()
    exported = run(train(out, **{"train.resume": True}))
    assert "resumed from" in exported.stderr and "step-0000003" in exported.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    straight = weights(tmp_path / "straight" / "final")
    got = weights(out / "final")
    assert sum(not torch.equal(straight[n], weights(Path(shared_assets["checkpoint"]))[n]) for n in straight) > 0
    for name in straight:
        assert torch.equal(got[name], straight[name]), name


def test_a_failed_save_leaves_the_last_checkpoint_and_names_the_bytes(tmp_path, monkeypatch):
    """In process: a save whose write fails with ENOSPC raises SaveError naming the checkpoint, the bytes needed and
    free, removes its partial files and leaves `latest` as it was; the estimate follows DeepSpeed's files."""
    import errno

    from app.runtime import checkpoint

    root = tmp_path / "checkpoints"
    (root / "step-0000001").mkdir(parents=True)
    (root / "latest").write_text("step-0000001")

    class FullDisk:
        def save_checkpoint(self, folder, tag, save_latest):
            (Path(folder) / tag).mkdir(parents=True, exist_ok=True)
            (Path(folder) / tag / "part.pt").write_bytes(b"x" * 10)
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(checkpoint.SaveError, match=r"saving checkpoint .*step-0000002 failed \(OSError: .*No space left "
                                                   r"on device\): it needs about 123 bytes .* are free there.*latest "
                                                   r"still names step-0000001"):
        checkpoint.save_checkpoint(FullDisk(), tmp_path, 2, {"step": 2}, need_bytes=123)
    assert (root / "latest").read_text() == "step-0000001" and not (root / ".incoming" / "step-0000002").exists()
    # DeepSpeed 0.19 on the tiny model (240,352 fp32 parameters): ZeRO-2 3,871,468 bytes of .pt files, ZeRO-3
    # 2,918,572, ZeRO-3 with LoRA (rank 4: 8,192 adapter parameters) 1,136,290; the export 961,408 of weights
    sizes = {"zero2": checkpoint.save_bytes(240352, 240352, 4, 2), "zero3": checkpoint.save_bytes(240352, 240352, 4, 3),
             "lora": checkpoint.save_bytes(240352, 8192, 4, 3, adapter=8192, save_adapter=True)}
    # below the files by DeepSpeed's pickled names and shapes (26-75 KB here, per tensor: about 1e-5 of a 7B model's)
    for name, measured in (("zero2", 3871468), ("zero3", 2918572), ("lora", 1136290)):
        assert 0 < measured - sizes[name]["checkpoint"] < 80_000, (name, sizes[name], measured)
    assert sizes["zero2"]["export"] == 961408


def test_a_run_warns_at_start_when_its_disk_cannot_hold_a_checkpoint_and_the_export(tmp_path, monkeypatch, caplog):
    """The start-up check: the output directory's free bytes against a checkpoint plus the export, both named."""
    from app.config.loading import load_config
    from app.runtime import checkpoint
    from app.training.recipe import disk_check

    engine = type("Engine", (), {"module": torch.nn.Linear(100, 10)})()  # 1,010 fp32 parameters, all trained
    cfg = load_config("configs/demo_cpu.yaml", [f"train.output_dir={tmp_path}"])
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 5000)
    with caplog.at_level("WARNING"):
        sizes = disk_check(engine, cfg, 2, tmp_path)
    assert sizes == {"checkpoint": 1010 * 16, "export": 1010 * 4}
    assert "has 5000 bytes (0.00 GiB) free, but a checkpoint takes about 16160 bytes" in caplog.text
    assert "and the export 4040 bytes" in caplog.text
    caplog.clear()
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 10**9)
    disk_check(engine, cfg, 2, tmp_path)
    assert "free, but" not in caplog.text
