"""Share decoding (``data.decode_shares``, ``app.data.shares``): under sequence parallelism a rank's prompt holds
only its share of each video, decoded alone, and is the whole prompt in every other respect; collating, gathering
it whole again, the stream's agreement on skips and the plan's host phase, on real H.264 files and the real
processors of every VL family."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from app.data.prompts import encode_prompts
from app.data.video import video_element
from app.grouping.media import SHARE, collate, keep_share, share_of, whole_from_shares

KEY = "pixel_values_videos"
BUDGETS = {"per frame": dict(fps=8, max_frames=64, min_pixels=3136, max_pixels=12544),
           "whole-video budget": dict(fps=8, max_frames=64, min_pixels=3136, total_pixels=30 * 3136 * 2)}


def conversation(*paths, text="What happens?"):
    return [{"role": "user", "content": [*[video_element(p, **BUDGETS["per frame"]) for p in paths],
                                         {"type": "text", "text": text}]}]


def processor_of(tiny_checkpoints, family, budget=None):
    """The family's processor; ``budget``: its video processor's whole-video pixel limit (a tiny Qwen3-family
    checkpoint's 65,536 shrinks these clips, a real checkpoint's does not)."""
    from app.runtime.models import load_processor

    processor = load_processor(tiny_checkpoints[family])
    if budget is not None:
        processor.video_processor.size = {**dict(processor.video_processor.size), "longest_edge": budget}
    return processor


def assert_share_of(whole: dict, mine: dict, rank: int, size: int) -> None:
    """``mine`` is ``whole`` but for its pixels, which are bitwise this rank's share (``media.keep_share``)."""
    cut = keep_share(dict(whole), rank, size)
    assert torch.equal(mine[KEY], cut[KEY]) and share_of(mine, KEY) == (rank, size)
    for key, value in whole.items():
        if key != KEY:
            assert torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(value)), key


CASES = [("qwen2_5_vl", None), ("qwen3_vl", None), ("qwen3_vl", 10**9), ("qwen3_5", None), ("qwen2_vl", None)]


@pytest.mark.parametrize("family,budget", CASES, ids=[f"{f}-{'wide' if b else 'tiny'}" for f, b in CASES])
def test_a_ranks_prompt_is_the_whole_prompt_with_its_share_of_the_pixels(clips, tiny_checkpoints, family, budget):
    """Each rank of S = 2 and 3: the same token ids, grid, timestamps (Qwen3-VL's text), frame timing and masks as
    the whole prompt, and pixel rows bitwise those ``keep_share`` cuts from the whole decode's; joined again they are
    the whole's. Qwen3-VL's processor weighs its resize by the frame count: with the tiny checkpoint's budget it
    shrinks these frames (and must shrink a share as it shrinks the whole), with a real one's it does not."""
    processor = processor_of(tiny_checkpoints, family, budget)
    for clip, budget_kind in (("ntsc", "per frame"), ("twelve", "whole-video budget")):
        chat = [{"role": "user", "content": [video_element(clips[clip], **BUDGETS[budget_kind]),
                                             {"type": "text", "text": "What happens?"}]}]
        whole = encode_prompts(processor, [chat])
        for size in (2, 3):
            shares = []
            for rank in range(size):
                mine = encode_prompts(processor, [chat], sp_share=(rank, size))
                assert_share_of(whole, mine, rank, size)
                shares.append(mine[KEY])
            assert torch.equal(whole_from_shares(shares, whole["video_grid_thw"]), whole[KEY])


def test_a_prompt_with_two_videos_and_an_image_holds_its_share_of_each_video(clips, tiny_checkpoints, tmp_path):
    """Two videos (at S = 10 the 29.97 fps clip's 8 temporal patches are fewer than the ranks: held whole, the
    other's 15 split) and an image: the videos' shares as ``keep_share`` cuts them, the image untouched."""
    import numpy as np
    from PIL import Image

    processor = processor_of(tiny_checkpoints, "qwen2_5_vl")
    image = tmp_path / "picture.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (70, 90, 3), dtype=np.uint8)).save(image)
    chat = conversation(clips["ntsc"], clips["twelve"])
    chat[0]["content"].insert(0, {"type": "image", "image": str(image), "min_pixels": 3136, "max_pixels": 12544})
    whole = encode_prompts(processor, [chat])
    assert whole["video_grid_thw"][:, 0].tolist() == [8, 15] and "pixel_values" in whole
    for rank, size in ((1, 2), (2, 3), (7, 10)):
        assert_share_of(whole, encode_prompts(processor, [chat], sp_share=(rank, size)), rank, size)


def test_what_is_decoded_whole_is_cut_when_collated_beside_shares(clips, tiny_checkpoints):
    """A batch of held prompts (a family's two questions on one tensor, and another video) collates to what
    ``keep_share`` cuts from the whole batch; a prompt decoded whole beside them (a frame folder, a shuffled one)
    is cut to the same share; prompts holding different shares are refused."""
    from app.data.prompts import collate_prompts

    processor = processor_of(tiny_checkpoints, "qwen2_5_vl")
    chats = [conversation(clips["ntsc"]), conversation(clips["twelve"])]
    whole = [encode_prompts(processor, [c]) for c in chats]
    held = [encode_prompts(processor, [c], sp_share=(1, 2)) for c in chats]
    family = [held[0], {**held[0]}, held[1]]  # a family's questions hold the very same pixel tensor
    want = collate_prompts([whole[0], {**whole[0]}, whole[1]], 0, share=(1, 2))
    got = collate_prompts(family, 0, share=(1, 2))
    assert got[KEY].shape[0] == want[KEY].shape[0]  # the family's pixels once
    for key in (KEY, f"{KEY}_rows", SHARE[KEY], "video_grid_thw", "input_ids"):
        assert torch.equal(got[key], want[key]), key
    mixed = collate([held[0], whole[1]])
    assert torch.equal(mixed[KEY], collate([held[0], held[1]])[KEY])
    with pytest.raises(ValueError, match="different ranks' shares"):
        collate([held[0], encode_prompts(processor, [chats[1]], sp_share=(0, 2))])


def test_a_rollout_on_whole_families_gathers_the_groups_shares(clips, tiny_checkpoints):
    """``rollout.whole_media``: the shares gathered from the group make each prompt's whole pixels again (bitwise),
    once per tensor (a family's questions keep sharing one), the share's mark dropped; whole prompts untouched."""
    from app.data.records import EncodedPrompt
    from app.rollout.base import whole_media

    processor = processor_of(tiny_checkpoints, "qwen3_vl")
    chats = [conversation(clips["ntsc"]), conversation(clips["twelve"])]
    whole = [encode_prompts(processor, [c]) for c in chats]
    per_rank = [[encode_prompts(processor, [c], sp_share=(r, 3)) for c in chats] for r in range(3)]
    calls = []

    class Group:  # every rank's share of the tensor at hand, as ParallelContext.gather_in_group gives it
        def gather_in_group(self, tensors):
            index = next(i for i in range(2) if tensors[0] is per_rank[0][i][KEY])
            calls.append(index)
            return [[per_rank[r][index][KEY]] for r in range(3)]

    mine = per_rank[0]
    prompts = [EncodedPrompt({}, mine[0]), EncodedPrompt({}, {**mine[0]}), EncodedPrompt({}, mine[1]),
               EncodedPrompt({}, whole[1])]
    out = whole_media(prompts, Group())
    assert calls == [0, 1]
    assert torch.equal(out[0].inputs[KEY], whole[0][KEY]) and out[0].inputs[KEY] is out[1].inputs[KEY]
    assert torch.equal(out[2].inputs[KEY], whole[1][KEY]) and out[3] is prompts[3]
    assert all(SHARE[KEY] not in p.inputs for p in out)


def test_a_prompt_one_rank_cannot_make_is_skipped_by_its_whole_group(tiny_checkpoints, tmp_path):
    """The stream asks its group about every position (``agree``): a prompt this rank made but another could not
    (its share of the file failed there) is skipped here too, counted and named as undecodable; the agreement is
    asked once per position, for skips of its own as well, so the group stays in lock-step."""
    from app.config import Config
    from app.data.stream import load_stream
    from app.data.synthetic import generate
    from app.runtime.models import load_processor

    cfg = Config()
    cfg.data.train_file, cfg.data.shuffle = str(generate(tmp_path, train=3, heldout=1, seed=0)["train"]), False
    cfg.data.max_skip_fraction = 0.5
    records = [json.loads(line) for line in open(cfg.data.train_file)]
    asked = []

    def agree(made_here: bool) -> bool:  # the other rank could not make the second position's prompt
        asked.append(made_here)
        return made_here and len(asked) != 2

    stream = load_stream(cfg.data, load_processor(tiny_checkpoints["qwen2_5_vl"]), 0, 0, 1, sp_share=(0, 2),
                         agree=agree)
    prompts = stream.next_prompts(2)
    assert asked == [True, True, True] and len(prompts) == 2
    assert [p.record["problem"] for p in prompts] == [records[0]["problem"], records[2]["problem"]]
    assert all(share_of(p.inputs, KEY) == (0, 2) for p in prompts)
    assert sum(stream.skipped.values()) == 1 and "undecodable" in "".join(stream.skipped)


def test_the_plan_prices_a_ranks_share_of_the_decoding():
    """The host's data phase per rank: with shares (S = 4) a quarter of the sampled frames and about a quarter of
    the CPU seconds (plus each share's run-in from its keyframe), and of the host's pixels; whole videos with
    ``data.decode_shares=false`` or ``rollout.sp_split=families``."""
    from app.config import Config
    from app.planning.host import MEASURED, Source, data_seconds
    from app.planning.inputs import share_of_video

    def cfg(**over):
        c = Config()
        c.train.sequence_parallel_size, c.data.fps = 4, 1.0
        for key, value in over.items():
            section, name = key.split(".")
            setattr(getattr(c, section), name, value)
        return c

    shape = SimpleNamespace(temporal_patch=2, patch=14)
    work = SimpleNamespace(temporal=1800, patches=1800 * 16 * 30)  # an hour at 1 fps, 224 x 420
    assert (share_of_video(cfg()), share_of_video(cfg(**{"data.decode_shares": False})),
            share_of_video(cfg(**{"rollout.sp_split": "families"}))) == (4, 1, 1)
    shared = data_seconds(cfg(), shape, work, Source(), MEASURED, videos=1, cores=4)
    whole = data_seconds(cfg(**{"data.decode_shares": False}), shape, work, Source(), MEASURED, videos=1, cores=4)
    assert shared["sampled_frames"] == 900 and whole["sampled_frames"] == 3600
    assert 0.25 < shared["cpu_s"] / whole["cpu_s"] < 0.26  # the run-in: under 1 % of a share here


def test_which_runs_decode_shares_and_a_held_prompt_has_no_identity(clips, tiny_checkpoints):
    """Shares are decoded at S > 1 by a recipe that reads them, on the grouped engine, with a rollout that may spread
    and not recorded (a record is named by the prompt's whole pixels: a held prompt asked for its identity says so)."""
    from app.config import Config
    from app.data.records import EncodedPrompt
    from app.data.shares import shares_decoded
    from app.rollout.base import prompt_identity

    def cfg(**over):
        c = Config()
        for key, value in over.items():
            section, name = key.split(".")
            setattr(getattr(c, section), name, value)
        return c

    assert shares_decoded(cfg(), 2) and not shares_decoded(cfg(), 1) and not shares_decoded(cfg(), 2, False)
    for off in ({"data.decode_shares": False}, {"rollout.sp_split": "families"}, {"rollout.engine": "hf"},
                {"rollout.engine": "vllm"}, {"rollout.record": True}):
        assert not shares_decoded(cfg(**off), 2), off
    processor = processor_of(tiny_checkpoints, "qwen2_5_vl")
    held = EncodedPrompt({}, encode_prompts(processor, [conversation(clips["ntsc"])], sp_share=(0, 2)))
    with pytest.raises(ValueError, match="share of its pixels"):
        prompt_identity(held)
    assert prompt_identity(EncodedPrompt({}, encode_prompts(processor, [conversation(clips["ntsc"])])))
