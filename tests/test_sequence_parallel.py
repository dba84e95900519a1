"""Sequence parallelism around the grouped forward (app/grouping/sequence_parallel.py): S ranks on one packed row
give the one-rank log-probs and, summed, its parameter gradients; the vision tower split by temporal patches
gives the whole tower's embeddings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from app.grouping.layout import LayoutError
from app.grouping.sequence_parallel import shard_bounds
from app.runtime.models import MOE_FAMILIES, QSA_FAMILIES

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def long_videos(tmp_path_factory):
    """Videos with several temporal patches each (16 and 12 frames sampled to 8 and 6)."""
    from app.data.video import write_mp4

    root = tmp_path_factory.mktemp("sp-videos")
    rng = np.random.default_rng(0)
    return [str(write_mp4(root / f"clip{i}.mp4", rng.integers(0, 255, (n, h, w, 3), dtype=np.uint8), fps=4))
            for i, (n, h, w) in enumerate([(16, 56, 84), (12, 64, 64)])]


def launch_workers(tmp_path, module: str, world: int, spec: dict, timeout: int = 600,
                   check: bool = True) -> subprocess.CompletedProcess:
    """``tests.workers.<module>`` on ``world`` processes through torch.distributed.run, its spec in a JSON file."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec_file = tmp_path / f"{module}.spec.json"
    spec_file.write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(world), "-m", f"tests.workers.{module}", str(spec_file)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    if check:
        assert done.returncode == 0, done.stderr[-5000:]
    return done


# ---- every multi-process check of this module is a job; a launch runs a batch of them ------------------------------
# A job: (world, slow, worker module, spec without checkpoint, videos and out). The jobs of one (world, slow) batch
# run in ONE launch of ``world`` processes (tests.workers.jobs), the first time a test asks for one of them: a
# test module pays each start of S processes once (make test: one launch of 2 and one of 4; the slow set: one
# more of each), not once per test (docs/testing.md).
JOBS: dict[str, tuple[int, bool, str, dict]] = {}


def job(name: str, world: int, module: str, slow: bool = False, **spec) -> str:
    JOBS[name] = (world, slow, module, spec)
    return name


SPREAD_CASES = [{"plan": [0, 0, 0, 1, -1], "chunk": 24},
                {"plan": [0], "chunk": 16},
                {"plan": [0, 0, 1, 1], "temperature": 1.0, "decode": "static", "max_new": 12, "eos": [7, 40]}]
SETUP_CASES = [{"plan": [0, 0, 0, -1], "chunk": 24, "setup": "lora", "temperature": 1.0},
               {"plan": [0], "setup": "frozen", "chunk": 20},
               {"plan": [0, 0, 1], "setup": "frozen", "decode": "static", "temperature": 1.0, "max_new": 12}]
FORWARD_CASES = [("qwen2_5_vl", 2, None, False), ("qwen2_5_vl", 4, ["split"], False), ("qwen3_vl", 2, ["packed"], False),
                 ("qwen3_vl", 4, None, True),  # 4 ranks are covered on Qwen2.5-VL in make test
                 ("qwen3_5", 2, ["split"], False),  # the GDN layers Ulysses over their key and value heads too
                 ("qwen3_5", 4, ["split", "masked"], True),
                 # mixture of experts: each rank's shard routes its own tokens; the router's and experts' gradients
                 # summed over the ranks equal one rank's
                 ("qwen3_vl_moe", 2, ["split"], False), ("qwen3_5_moe", 2, ["split"], True),
                 # Qwen3.8-Flash-Next: QSA layers (the shard's queries against the whole row's keys), PLE (windows
                 # reaching into other shards), GDN, experts and hyper-connections
                 ("qwen4_exp", 2, ["split"], True)]
for _family, _size, _backends, _slow in FORWARD_CASES:
    job(f"forward-{_family}-{_size}", _size, "sequence_parallel", _slow, family=_family,
        kinds=["video", "text", "image+video"], group_sizes=[3, 1, 2], backends=_backends)
job("forward-frozen-tower", 2, "sequence_parallel", family="qwen2_5_vl", kinds=["video", "video"], group_sizes=[2, 3],
    backends=["split"], freeze_tower=True)
job("forward-text-model", 2, "sequence_parallel", family="qwen2", kinds=["text", "text"], group_sizes=[1, 4],
    backends=["split"], chunk_size=0)  # whole logits
SHARING_CASES = [("qwen2_5_vl", 2, "full", False), ("qwen2_vl", 2, "lora", True), ("qwen3_vl", 2, "frozen tower", True),
                 ("qwen2_5_vl", 4, "lora", True), ("qwen3_vl", 4, "full", True)]
for _family, _size, _variant, _slow in SHARING_CASES:
    job(f"sharing-{_family}-{_size}-{_variant}", _size, "sequence_parallel", _slow, family=_family,
        plan=[0, 0, 0, 1, -1], families=[3, 1, 1], group_sizes=[2, 3, 1, 2, 1], backends=["split", "masked", "flash"],
        freeze_tower=_variant == "frozen tower", lora=4 if _variant == "lora" else 0)
job("rollout-families", 2, "sp_rollout", family="qwen2_5_vl", plan=[0, 0, 0, 1, 1, 1, -1], chunk=0)
job("rollout-spread", 2, "sp_rollout", family="qwen2_5_vl", plan=[0, 0, 0, 1, -1], chunk=24)
job("rollout-fewer-families", 2, "sp_rollout", family="qwen2_5_vl", plan=[0, 0, 0], chunk=24)
for _name, _plan in (("moe", [0, 0, 1, -1]), ("moe-one-family", [0, 0])):  # whole families per rank, one idle
    job(f"rollout-families-{_name}", 2, "sp_rollout", family="qwen3_vl_moe", plan=_plan, setting="families",
        record=True)
job("spread-qwen2_5_vl-2", 2, "spread_rollout", family="qwen2_5_vl", sp=2, cases=SPREAD_CASES)
job("spread-qwen3_5-2", 2, "spread_rollout", family="qwen3_5", sp=2, cases=SPREAD_CASES)
job("spread-qwen3_5-4", 4, "spread_rollout", True, family="qwen3_5", sp=4, cases=SPREAD_CASES)
job("spread-qwen2_vl-4-4", 4, "spread_rollout", True, family="qwen2_vl", sp=4, cases=SETUP_CASES)
job("spread-qwen3_vl-4-2", 4, "spread_rollout", True, family="qwen3_vl", sp=2, cases=SETUP_CASES)
for _family in ("qwen3_vl_moe", "qwen3_5_moe"):  # mixture of experts: each rank's 1/S of the prefill routes its own
    job(f"spread-{_family}-2", 2, "spread_rollout", True, family=_family, sp=2, cases=SPREAD_CASES)


@pytest.fixture(scope="module")
def launched(tiny_checkpoints, long_videos, tmp_path_factory):
    """``launched(name)``: the output path of job ``name``, its batch launched on first use (once per module)."""
    root = tmp_path_factory.mktemp("sp-jobs")
    failed: dict[tuple[int, bool], str] = {}

    def result(name: str) -> Path:
        world, slow, _, _ = JOBS[name]
        batch = (world, slow)
        if batch not in failed:
            jobs = [{"module": module, "spec": {**spec, "checkpoint": str(tiny_checkpoints[spec["family"]]),
                                                "videos": long_videos, "out": str(root / other)}}
                    for other, (w, s, module, spec) in JOBS.items() if (w, s) == batch]
            done = launch_workers(root / f"batch-{world}{'-slow' if slow else ''}", "jobs", world, {"jobs": jobs},
                                  timeout=1800, check=False)
            failed[batch] = "" if done.returncode == 0 else done.stderr[-5000:]
        errors = sorted(root.glob(f"{name}.error.*"))
        assert not errors, errors[0].read_text()[-5000:]
        assert list(root.glob(f"{name}*")), f"job {name} did not run: its launch failed before it\n{failed[batch]}"
        return root / name

    return result


def run_ranks(launched, name: str, size: int) -> dict:
    result = json.loads(launched(name).read_text())
    assert result["size"] == size
    return result["report"]


@pytest.mark.distributed
@pytest.mark.parametrize(("family", "size"), [pytest.param(f, n, marks=[pytest.mark.slow] if slow else [])
                                              for f, n, _, slow in FORWARD_CASES])
def test_sequence_parallel_equals_one_rank(family, size, launched):
    """S = 2 and 4 ranks (tiny models: 4 query heads, 2 KV heads, so S = 4 repeats each KV head) on a batch of a
    video prompt, a text prompt and an image + video prompt, groups of 3, 1 and 2 completions of unequal lengths:
    log-probs equal the one-rank grouped forward's to 1e-5 and every parameter's gradient, summed over the ranks,
    to 1e-4 (the vision tower's too, run split by temporal patches); every CPU backend inside it (None = all).
    Qwen3.8-Flash-Next: every query of every QSA layer chooses the keys it chooses on one rank (index heads and
    selection, with prompts long enough that queries drop keys), every PLE layer looks up the same n-gram rows."""
    report = run_ranks(launched, f"forward-{family}-{size}", size)
    replay, selection = report.pop("replay", None), report.pop("selection", None)
    moe = family in (*MOE_FAMILIES, *QSA_FAMILIES)
    if moe:  # routing replay under SP: each rank replays its shard's records (a shifted record)
        assert replay["moved"] > 1e-3 and replay["logprob"] <= 1e-5 and replay["grad"] <= 1e-4, replay
        assert replay["differs"] == replay["alone_differs"] and replay["differs"][0] > 0, replay
    if family in QSA_FAMILIES:
        assert selection["qsa_equal"] and selection["ngram_equal"], selection
        assert selection["layers"] > 0 and selection["ple_calls"] > 0 and selection["dropped_queries"] > 0, selection
    for backend, r in report.items():
        assert r["logprob"] <= 1e-5 and r["entropy"] <= 1e-5, (backend, r)
        assert r["grad"] <= 1e-4, (backend, r)
        assert r["masked_zero"] and not r["no_grad"], (backend, r)
        if moe:  # the load-balancing loss in the objective, its sums over the group's shards
            assert r["router"] <= 1e-5 and r["aux"] <= 1e-6 and r["flipped"] == 0, (backend, r)


@pytest.mark.distributed
def test_sequence_parallel_with_a_frozen_tower_and_a_text_model(launched):
    """A frozen tower (run without a backward) and the text-only family (its output head computing whole logits
    instead of chunks)."""
    frozen, text = run_ranks(launched, "forward-frozen-tower", 2), run_ranks(launched, "forward-text-model", 2)
    for r in (*frozen.values(), *text.values()):
        assert r["logprob"] <= 1e-5 and r["entropy"] <= 1e-5 and r["grad"] <= 1e-4, r
        assert ".visual." not in r["worst"]


@pytest.mark.distributed
@pytest.mark.parametrize(("family", "size", "variant"), [pytest.param(f, n, v, marks=[pytest.mark.slow] if slow else [])
                                                         for f, n, v, slow in SHARING_CASES])
def test_questions_sharing_a_video_under_sequence_parallelism(family, size, variant, launched):
    """A family [V; Q1; R1*; Q2; R2*; Q3; R3*] (three questions on one video), a question on another video and a
    text prompt (families [3, 1, 1]), the row sharded over S ranks: log-probs equal the one-rank forward of the same
    families and the one-rank per-question forward (k = 1) to 1e-5, every gradient summed over the ranks to 1e-4,
    on every backend that shares a video (split, masked, flash played by SDPA; flex's backward needs CUDA); LoRA
    (adapters only) and a frozen tower as variants. The family's video is in the row once."""
    report = run_ranks(launched, f"sharing-{family}-{size}-{variant}", size)
    for backend, r in report.items():
        assert r["logprob"] <= 1e-5 and r["entropy"] <= 1e-5 and r["grad"] <= 1e-4, (backend, r)
        assert r["k1_logprob"] <= 1e-5 and r["k1_grad"] <= 1e-4, (backend, r)
        assert r["masked_zero"] and not r["no_grad"] and r["shared_tokens"] > 0, (backend, r)
        assert (r["adapters"] == r["params"]) if variant == "lora" else not r["adapters"], (backend, r)
        if variant == "frozen tower":
            assert ".visual." not in r["worst"]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vision_tower_split_by_temporal_patches_equals_the_whole(family, tiny_checkpoints, long_videos):
    """Why frame sharding is exact: the tower run on temporal patches [0, a) and [a, t) of a video gives exactly
    the rows of the whole video's output (and Qwen3-VL's deepstack features): no block attends across temporal
    patches and the position embeddings repeat per temporal patch."""
    from app.grouping.vision.frames import _tower_output
    from tests.helpers import load, max_rel_diff, prompt_batch

    model, processor = load(family, tiny_checkpoints)
    prompts = prompt_batch(family, processor, long_videos, ["video"])
    pixels, grid = prompts["pixel_values_videos"], prompts["video_grid_thw"]
    t, h, w = grid[0].tolist()
    assert t >= 3
    visual = model.model.visual
    merge = visual.spatial_merge_size
    with torch.no_grad():
        whole, whole_deep = _tower_output(visual(pixels, grid_thw=grid))
        cut = 1
        first, first_deep = _tower_output(visual(pixels[: cut * h * w], grid_thw=torch.tensor([[cut, h, w]])))
        rest, rest_deep = _tower_output(visual(pixels[cut * h * w :], grid_thw=torch.tensor([[t - cut, h, w]])))
    assert first.shape[0] == cut * h * w // (merge * merge)
    # fp32 rounding only (attention batches of other shapes): the largest difference relative to the largest value
    assert max_rel_diff(torch.cat([first, rest]), whole) <= 1e-5
    if whole_deep is not None:
        for a, b, c in zip(first_deep, rest_deep, whole_deep, strict=True):
            assert max_rel_diff(torch.cat([a, b]), c) <= 1e-5


def test_shards_are_contiguous_and_cover_the_row():
    assert shard_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert shard_bounds(8, 2) == [(0, 4), (4, 8)]
    with pytest.raises(LayoutError, match="cannot be split"):
        shard_bounds(3, 4)


@pytest.mark.distributed
@pytest.mark.parametrize("split", [
    "families",  # rollout-families: loads 220, 182, 47 tokens: whole families share out evenly (1.02)
    "spread",  # rollout-spread: 220, 59, 52: whole ones would load one rank 1.33 even shares
])
def test_a_sequence_parallel_groups_rollout_prefills_each_family_once(split, launched):
    """S = 2 ranks sample families of three questions on one video, questions on another and a text prompt as one
    group, chunked prefill too: whole families shared out over the ranks where they divide evenly, else every
    family spread over both (``split_of``); either way each video is prefilled once in the group (as many prompt
    tokens prefilled over both ranks as one rank sampling all, which holds each video once), and the greedy
    tokens, masks and stop reasons equal one rank's rollout of every prompt."""
    r = json.loads(launched(f"rollout-{split}").read_text())
    assert r["split"] == split, r
    assert r["tokens_equal"] and r["mask_equal"] and r["reasons_equal"] and r["sizes"] == [2] * len(JOBS[f"rollout-{split}"][3]["plan"]), r
    assert r["logprob"] <= 1e-5, r
    assert all(p > 0 for p in r["prefilled_per_rank"]), r  # both ranks sampled a share
    assert sum(r["prefilled_per_rank"]) == r["prefill_whole"] == r["prefill_group"] < r["prompt_tokens"], str(r)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["moe", "moe-one-family"])
def test_whole_families_per_rank_carry_their_routing_records(name, launched):
    """Routing replay under S = 2 with whole families per rank (rollout.sp_split=families): each rank's record
    gathered with its rollout, in prompt order, equals one rank's rollout of every prompt token for token, a rank
    without a family included (it sends an empty record)."""
    r = json.loads(launched(f"rollout-families-{name}").read_text())
    assert r["split"] == "families" and r["tokens_equal"], r
    routing = r["routing"]
    assert routing["shapes_equal"] and routing["layers_equal"] and routing["real_tokens"] > 0, routing
    assert routing["tokens"] == 0, routing


@pytest.mark.distributed
def test_a_group_with_fewer_families_than_ranks_spreads_them_through_the_engine(launched):
    """One family of three questions on one video and S = 2 (fewer families than ranks): ``SharedInGroup`` asks
    the grouped engine to spread it, both ranks prefill half of it, and the rollout
    every rank returns equals one rank's."""
    r = json.loads(launched("rollout-fewer-families").read_text())
    assert r["split"] == "spread", r
    assert r["tokens_equal"] and r["mask_equal"] and r["reasons_equal"] and r["logprob"] <= 1e-5, r
    assert sum(r["prefilled_per_rank"]) == r["prefill_whole"], r
    assert all(abs(p - r["prefill_whole"] / 2) <= 24 for p in r["prefilled_per_rank"]), r  # within one chunk


# ---- a family's rollout spread over its group: every rank samples every prompt, each with 1/S of the work -------
def run_spread(launched, name: str) -> list[dict]:
    out = launched(name)
    world = JOBS[name][0]
    return [json.loads(out.with_name(f"{out.name}.{r}.json").read_text()) for r in range(world)]


def check_spread(reports: list[dict], size: int, kv_divides: bool) -> None:
    """Every rank's rollout, given only its share of the videos' pixels, equals one process's plain rollout
    (tokens, masks, stop reasons; log-probs to float rounding); within each group the ranks' prompt positions sum
    to the plain rollout's (each rank 1/S of each prefill, within one chunk of it), the tower's work and the pixels
    held are split, and each rank holds 1/S of the K/V (with fewer KV heads than ranks, 1/Hkv)."""
    for i in range(len(reports[0]["cases"])):
        for first in range(0, len(reports), size):
            group = [r["cases"][i] for r in reports[first : first + size]]
            for case in group:
                assert case["tokens_equal"] and case["mask_equal"] and case["reasons_equal"], (i, case)
                assert case["logprob"] <= 1e-5, (i, case["logprob"])
            whole = group[0]["whole"]
            assert sum(c["mine"]["prefill_tokens"] for c in group) == whole["prefill_tokens"], (i, group)
            if whole["pixel_rows"]:
                assert max(c["mine"]["pixel_rows"] for c in group) < whole["pixel_rows"], (i, group)
            assert max(c["mine"]["tower_rows"] for c in group) < whole["tower_rows"], i
            share = size if kv_divides else 2
            held = [c["mine"]["roots"] + c["mine"]["questions"] for c in group]  # the video's and the questions'
            total = whole["roots"] + whole["questions"]
            per_token = total / whole["prefill_tokens"]  # the questions' left padding: at most S slots more
            assert all(0 <= h * share - total <= per_token * size for h in held), (i, held, whole)


@pytest.mark.distributed
def test_a_familys_rollout_spread_over_two_ranks_draws_one_rank_tokens(launched):
    """S = 2 on Qwen2.5-VL: a family of three questions on one video with a second video's question and a text
    prompt; one long prompt alone (k = 1); seeded sampling with stop tokens and static steps; a chunked prefill."""
    check_spread(run_spread(launched, "spread-qwen2_5_vl-2"), 2, kv_divides=True)


@pytest.mark.distributed
@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_hybrid_models_rollout_spread_holds_each_ranks_gdn_heads(size, launched):
    """Qwen3.5 at S = 2 and 4: the GDN heads shared out like the attention heads (each rank 1/S of every sample's
    GDN states, carried chunk to chunk in the video's prefill and from the video to each question), every rank the
    one-process tokens: a family of three questions with a chunked prefill, a long prompt alone, seeded static steps
    with stop tokens."""
    reports = run_spread(launched, f"spread-qwen3_5-{size}")
    check_spread(reports, size, kv_divides=size <= 2)
    for i in range(len(SPREAD_CASES)):
        assert all(r["cases"][i]["mine"]["states"] * size == r["cases"][i]["whole"]["states"] > 0 for r in reports)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_a_moe_models_rollout_spread_over_two_ranks_draws_one_rank_tokens(family, launched):
    """The mixture-of-experts families at S = 2 (the grouped engine's spread as on the dense ones): a family of three
    questions with a chunked prefill, a long prompt alone, seeded static steps with stop tokens. Routing recorded
    (rollout.routing_replay=r3): each rank routes its pieces of every prefill chunk, the gathered record is whole on
    every rank and equals one process's, token for token."""
    reports = run_spread(launched, f"spread-{family}-2")
    check_spread(reports, 2, kv_divides=True)
    for report in reports:
        for case in report["cases"]:
            assert case["routing_complete"] and case["routing_differs"]["tokens"] == 0, case["routing_differs"]
            assert case["routing_differs"]["real_tokens"] > 0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("family", "world", "size"), [("qwen2_vl", 4, 4), ("qwen3_vl", 4, 2)])
def test_spread_rollouts_on_every_family_with_lora_and_a_frozen_tower(family, world, size, launched):
    """Qwen2-VL at S = 4 (its 2 KV heads held by two ranks each), Qwen3-VL (deepstack) as two replicas of S = 2
    (Qwen2.5-VL at S = 2 in make test): k = 1 and k = 3, LoRA adapters and a frozen tower, greedy and seeded."""
    check_spread(run_spread(launched, f"spread-{family}-{world}-{size}"), size, kv_divides=size <= 2)
