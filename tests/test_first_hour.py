"""What a new user hit in the first hour: one test per class of defect (silent wrong evaluations, a hang after a
kill, settings blamed on files, contradictions accepted, misleading or missing messages)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.config.loading import ConfigError, load_config
from tests.helpers import world_of_one
from tests.test_trainer import assets, overrides  # noqa: F401  (assets: fixture)

ROOT = Path(__file__).resolve().parents[1]


# ---- a kill during DeepSpeed's first-use op build must not hang every later launch --------------------------------
def _load_op_in_subprocess(**kwargs):
    code = ("import logging; logging.basicConfig(level=logging.INFO); import app; from app.runtime import distributed; "
            "print('op', distributed.prepare_comm_op(), flush=True)")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kwargs)


@pytest.fixture
def own_op_dir(tmp_path, monkeypatch):
    """A private copy of this environment's built op (TORCH_EXTENSIONS_DIR for this test and its children), so the
    lock these tests plant and hold is theirs alone: a launch of another test running beside them (pytest -n 2)
    loads the environment's own copy and never touches it."""
    import shutil

    from torch.utils.cpp_extension import _get_build_directory

    from app.runtime.distributed import COMM_OP, prepare_comm_op

    prepare_comm_op()  # built once per environment (setup_env.sh does it at install)
    built = Path(_get_build_directory(COMM_OP, verbose=False))
    root = tmp_path / "torch_extensions"
    shutil.copytree(built, root / built.name, symlinks=True, ignore=shutil.ignore_patterns("lock", "*.owner"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    mine = Path(_get_build_directory(COMM_OP, verbose=False))
    assert mine != built and (mine / "build.ninja").is_file()
    return mine


def test_a_stale_build_lock_is_cleared_with_a_warning(own_op_dir):
    """torch's JIT build lock left by a killed process: the next start removes it, names it, and goes on."""
    lock = own_op_dir / "lock"
    lock.write_text("")  # what a process killed inside torch's FileBaton leaves behind
    proc = _load_op_in_subprocess()
    try:
        out, err = proc.communicate(timeout=240)  # today's code sleeps on the lock forever
    finally:
        proc.kill()
        lock.unlink(missing_ok=True)
    assert proc.returncode == 0, err[-2000:]
    assert "removing a stale build lock" in err and str(lock) in err


def test_a_live_builder_is_waited_for_by_name(own_op_dir):
    """While another live process holds the op, a start waits and says whom it waits for (never silently)."""
    from app.runtime.distributed import comm_op_guard

    with comm_op_guard():
        proc = _load_op_in_subprocess()
        deadline, seen = time.monotonic() + 180, ""
        while time.monotonic() < deadline and "waiting for process" not in seen:
            line = proc.stderr.readline()
            if not line:
                break
            seen += line
        assert f"waiting for process {os.getpid()}" in seen, seen[-2000:]
        assert proc.poll() is None  # still waiting while the lock is held
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "op True" in out, err[-2000:]


# ---- settings are validated, never blamed on the file -------------------------------------------------------------
def test_max_frames_below_two_is_a_config_error():
    with pytest.raises(ConfigError, match="'data.max_frames' must be >= 2"):
        load_config(None, ["model.path=x", "data.max_frames=1"], training=False)


def test_a_setting_that_breaks_frame_sampling_names_the_setting(videos):
    from app.data.video import SettingError, VideoDecodeError, decode_video, video_element

    element = video_element(videos[0], fps=2.0, max_frames=1, min_pixels=3136, max_pixels=3136)
    with pytest.raises(SettingError, match="data.max_frames") as caught:
        decode_video(element)
    assert not isinstance(caught.value, VideoDecodeError)


@pytest.mark.parametrize(("settings", "message"), [
    (["lora.rank=4", "lora.vision_tower=true", "model.freeze_vision_tower=true"], "lora.vision_tower"),
    (["lora.rank=4", "lora.projector=true", "model.freeze_projector=true"], "lora.projector"),
    (["rewards.length=true", "rewards.length_min_tokens=300", "rollout.max_completion_length=200"],
     "no completion could earn the bonus"),
])
def test_contradictions_that_cannot_work_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.path=x", "data.train_file=y", *settings])


@pytest.mark.parametrize(("settings", "message"), [
    (["train.max_steps=10", "train.stop_at_step=20"], "train.stop_at_step=20 is past train.max_steps=10"),
    (["train.max_steps=10", "train.warmup_steps=10"], "never reaches train.learning_rate"),
    (["grpo.beta=0", "model.reference_path=z"], "no reference model is used"),
    (["rewards.length=true", "rewards.length_max_tokens=900", "rollout.max_completion_length=500"],
     "never reached"),
])
def test_contradictions_that_run_are_warned(settings, message, caplog):
    with caplog.at_level(logging.WARNING, logger="app.config.loading"):
        load_config(None, ["model.path=x", "data.train_file=y", *settings])
    assert message in caplog.text


# ---- one summary of the skips, from rank 0, the full list in a file ---------------------------------------------
def _many_missing(tmp_path: Path, assets, missing: int) -> Path:  # noqa: F811
    lines = Path(assets["train"]).read_text().splitlines()
    bad = [json.dumps({**json.loads(lines[0]), "path": f"videos/gone{i}.mp4"}) for i in range(missing)]
    out = tmp_path / "mixed.jsonl"
    out.write_text("\n".join(lines + bad) + "\n")
    return out


def test_skips_at_load_are_one_summary_from_rank_zero(assets, tmp_path, caplog):  # noqa: F811
    from app.data.stream import load_stream
    from app.runtime.models import load_processor

    train = _many_missing(tmp_path, assets, missing=40)
    cfg = load_config(None, [f"model.path={assets['checkpoint']}", f"data.train_file={train}",
                             f"data.data_root={Path(assets['train']).parent}", "data.max_skip_fraction=0.9"])
    processor = load_processor(assets["checkpoint"])
    with caplog.at_level(logging.WARNING, logger="app.data.records"):
        stream = load_stream(cfg.data, processor, 0, rank=1, world_size=2, skip_log=tmp_path / "rank1.jsonl")
    assert caplog.records == [] and not (tmp_path / "rank1.jsonl").exists()  # other ranks stay quiet
    assert sum(stream.skipped.values()) == 40  # but count (the skip limit is per rank)
    with caplog.at_level(logging.WARNING, logger="app.data.records"):
        load_stream(cfg.data, processor, 0, rank=0, world_size=2, skip_log=tmp_path / "skips.jsonl")
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert "40 of 56 records" in line and "video file not found: 40" in line and "skips.jsonl" in line
    assert len((tmp_path / "skips.jsonl").read_text().splitlines()) == 40


def test_detail_lines_reach_the_log_file_only(tmp_path, capsys):
    from app.runtime.tracking import configure_logging

    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = [logging.StreamHandler(sys.stderr)]
    try:
        configure_logging(tmp_path / "rank1.log", rank=1)
        logging.getLogger("app.x").info("an info line")
        logging.getLogger("app.x").warning("a detail line", extra={"detail": True})
        logging.getLogger("app.x").warning("a warning")
        for handler in root.handlers:
            handler.flush()
    finally:
        for handler in root.handlers:
            if isinstance(handler, logging.FileHandler):
                handler.close()
        root.handlers = saved
    console = capsys.readouterr().err
    assert "a warning" in console and "an info line" not in console and "a detail line" not in console
    assert "a detail line" in (tmp_path / "rank1.log").read_text()


# ---- the recipes in one process: learning rate, start-up arithmetic, SFT targets ----------------------------------
def test_grpo_logs_the_learning_rate_its_update_used_and_says_the_batch(assets, tmp_path, monkeypatch,  # noqa: F811
                                                                     caplog):
    from app.training.trainer import GRPOTrainer

    cfg = load_config("configs/demo_cpu.yaml", overrides(assets, tmp_path / "run", **{
        "train.warmup_steps": 3, "train.max_steps": 5, "train.prompts_per_rank": 2, "rollout.group_size": 2,
        "rollout.max_completion_length": 4, "grpo.beta": 0.0}))
    with world_of_one(monkeypatch), caplog.at_level(logging.INFO, logger="app.training.recipe"):
        trainer = GRPOTrainer(cfg)
        first, second = trainer.train_step(0), trainer.train_step(1)
    assert first["learning_rate"] == pytest.approx(1e-3 * 1 / 4)  # warmup: (step + 1) / (warmup + 1)
    assert second["learning_rate"] == pytest.approx(1e-3 * 2 / 4)
    said = "\n".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("batch:"))
    assert "2 prompts per step" in said and "G=2 -> 4 completions per step" in said
    assert "gradient accumulation 2" in said
    from transformers.utils import logging as hf_logging

    assert not hf_logging.is_progress_bar_enabled()  # no per-rank weight-loading bars over the training bar


def test_sft_skips_records_without_a_process_and_logs_the_rate_it_used(assets, tmp_path, monkeypatch):  # noqa: F811
    from app.training.sft import SFTTrainer

    records = [json.loads(line) for line in Path(assets["train"]).read_text().splitlines()]
    for i, record in enumerate(records):
        record["process"] = "" if i % 2 else f"<think>look ({i})</think>"
    train = tmp_path / "cot.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = load_config("configs/demo_cpu.yaml", overrides(assets, tmp_path / "run", **{
        "data.train_file": train, "data.data_root": Path(assets["train"]).parent, "train.warmup_steps": 1,
        "sft.max_target_length": 64, "data.max_skip_fraction": 0.6}))
    with world_of_one(monkeypatch):
        trainer = SFTTrainer(cfg)
        examples = trainer.examples()
        metrics = trainer.train_step(1)
    assert examples and all(p.record["process"] for p, _ in examples)
    assert trainer.stream.skipped["no process for SFT"] >= 1
    assert metrics["learning_rate"] == pytest.approx(1e-3 / 2)
    assert SFTTrainer.name == "SFT"


def test_progress_without_a_bar_is_one_line_per_logged_step(tmp_path, caplog):
    from app.config.sections import LoggingConfig
    from app.runtime.tracking import Tracker

    tracker = Tracker(LoggingConfig(wandb_mode="disabled", progress_bar=False), tmp_path, {}, True, 10, label="SFT")
    with caplog.at_level(logging.INFO, logger="app.progress"):
        tracker.log(3, {"loss": 0.5, "time/step": 1.25, "other": 1.0})
    assert [r.getMessage() for r in caplog.records] == ["SFT step 3/10 | loss 0.5 | 1.25 s/step"]


def test_a_data_error_is_one_clean_line(assets, tmp_path):  # noqa: F811
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"problem": "q", "problem_type": "multiple choice", "solution": "A",
                                       "data_type": "video", "path": f"videos/none{i}.mp4"}) + "\n"
                           for i in range(4)))
    result = subprocess.run([sys.executable, "-m", "app.training.trainer", "configs/demo_cpu.yaml",
                             *overrides(assets, tmp_path / "run", **{"data.train_file": bad})],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "data error:" in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]


# ---- exports load with plain transformers / peft from this environment --------------------------------------------
def test_plain_transformers_and_peft_import_in_this_environment(tmp_path):
    code = "import peft; from transformers import AutoProcessor, Qwen2ForCausalLM; import torchvision; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


# ---- the library default never builds [tokens, vocab] logits -------------------------------------------------------
def test_completion_logprobs_is_chunked_by_default(tiny_checkpoints, videos):
    from app.grouping import completion_logprobs
    from tests.helpers import load, prompt_batch, random_completions

    model, processor = load("qwen2_5_vl", tiny_checkpoints, sharpen=None)
    prompts = prompt_batch("qwen2_5_vl", processor, videos, ["video", "text"])
    tok = processor.tokenizer
    ids, mask = random_completions([3, 4, 2, 5], len(tok), tok.pad_token_id)
    widths = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: widths.append(out.shape[-1]))
    try:
        for mode in ("grouped", "repeated"):
            completion_logprobs(model, prompts, ids, mask, [2, 2], mode=mode)
    finally:
        hook.remove()
    assert widths == [2, 2]  # (log-prob, entropy) per token, never a vocabulary-wide row


def test_temporal_grpo_on_data_without_video_is_warned():
    from app.training.trainer import data_warnings

    cfg = load_config(None, ["model.path=x", "data.train_file=images.jsonl", "rewards.temporal=true"])
    images = [{"data_type": "image"}, {"data_type": "image"}]
    assert any("no video records" in w for w in data_warnings(cfg, images))
    assert data_warnings(cfg, images + [{"data_type": "video"}]) == []
    cfg.rewards.temporal = False
    assert data_warnings(cfg, images) == []
