"""The rollout on a clock and its decode step kept: every part of time/rollout accounted for in a real step; the
static step captured once per shape bucket and replayed in every later rollout (a stand-in for CUDA's capture on
this CPU), never while the data-prefetch threads work, captured again when the weights moved; the compiled step
compiled once and never recompiled across prompts of other lengths, with the eager step's greedy tokens."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from app.config.loading import load_config
from app.grouping import StaticSteps
from app.rollout.generate import SamplingConfig, generate_groups
from tests.helpers import load, prompt_batch, tokenizer_of, world_of_one
from tests.test_shared_video_train import shared_assets, shared_overrides  # noqa: F401 - the module's fixture, reused

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=10)
ORDERS = (["video", "text"], ["text", "video"], ["video", "video"], ["text", "text"], ["video", "text"])


def steps_in_process(assets, out, monkeypatch, steps, **extra):
    """``steps`` GRPO steps of one trainer in this process: each step's metrics, the last step's trajectory."""
    from app.training.trainer import GRPOTrainer

    cfg = load_config("configs/demo_cpu.yaml", shared_overrides(assets, out, **{"train.max_steps": steps, **extra}))
    with world_of_one(monkeypatch):
        trainer = GRPOTrainer(cfg)
        kept, collect = {}, trainer.collect
        trainer.collect = lambda index: kept.setdefault(index, collect(index))
        metrics = [trainer.train_step(step) for step in range(steps)]
    return metrics, kept[steps - 1]


@pytest.mark.parametrize("extra", [{}, {"data.questions_per_video": 4}, {"rollout.decode": "static"}],
                         ids=["eager", "k4", "static"])
def test_every_part_of_the_rollout_is_accounted_for(extra, shared_assets, tmp_path, monkeypatch):  # noqa: F811
    """Real steps in process: the parts the trainer logs (gathering, the tower, the prefill, capture, decode,
    sampling, scoring, waiting for data) sum to time/rollout within 5%; each is measured (the tower apart from the
    prefill, a decode step's milliseconds from the steps taken). A region left off the clock is missing from every
    step; the scheduler's pauses (the other pytest worker's processes share the 2 cores) land in one step's 0.1 s
    now and then, so the closest of three steps is held to 5%, and every step to the parts' own checks."""
    steps, t = steps_in_process(shared_assets, tmp_path / "run", monkeypatch, 3, **extra)
    names = ("gather", "tower", "prefill", "capture", "decode", "sampling", "scoring")
    gaps = []
    for metrics in steps:
        parts = {name: metrics[f"rollout/{name}_s"] for name in names}
        assert all(value >= 0 for value in parts.values()), parts
        assert all(parts[name] > 0 for name in ("tower", "prefill", "decode", "sampling", "scoring")), parts
        accounted = sum(parts.values()) + metrics["time/data_wait"]
        assert metrics["rollout/other_s"] == pytest.approx(metrics["time/rollout"] - accounted)
        gaps.append((abs(accounted - metrics["time/rollout"]) / metrics["time/rollout"], parts))
    assert min(gap for gap, _ in gaps) <= 0.05, gaps
    metrics = steps[-1]
    decoded = int(t.rollout.completion_mask.shape[1])
    assert metrics["rollout/decode_steps"] >= decoded - 1 and metrics["rollout/decode_ms_per_step"] > 0


class FakeGraph:
    """CUDA's capture played on the CPU: recording runs nothing; a replay runs the recorded work again into the
    same output tensor (what a graph replay does to the addresses it recorded)."""

    def __init__(self, run, logits):
        self.run, self.logits, self.replays = run, logits, 0

    def replay(self):
        self.logits.copy_(self.run())
        self.replays += 1


def captured_on_cpu(monkeypatch):
    import app.grouping.decoding.decode as decode

    made = []

    def capture_graph(run, guard):
        with guard():
            made.append(FakeGraph(run, None))
        return made[-1], None

    original = decode.GroupedDecoder._capture

    def capture(self, run):
        original(self, run)
        graph = self.kept.graph if self.kept is not None else self.graph
        if graph is not None and graph.logits is None:  # the recorded step's output: the eager run's shape
            graph.logits = torch.empty_like(self.logits)
            if self.kept is not None:
                self.kept.logits = graph.logits
            else:
                self._graph_logits = graph.logits

    monkeypatch.setattr(decode, "capturable", lambda cache: True)
    monkeypatch.setattr(decode, "capture_graph", capture_graph)
    monkeypatch.setattr(decode.GroupedDecoder, "_capture", capture)
    monkeypatch.setattr(decode, "decode_mode", lambda requested, device, synced: requested)
    return made


def test_the_graph_is_captured_once_per_bucket_and_replayed_in_every_later_rollout(tiny_checkpoints, videos,
                                                                                 monkeypatch, caplog):
    """Five rollouts of prompts of other lengths (one shape bucket): one capture, inside the guard, then every
    rollout replays it from its first step; tokens equal the eager steps'. Weights that moved are captured again,
    the reason said once."""
    made = captured_on_cpu(monkeypatch)
    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    tok = tokenizer_of(processor)
    guarded = []

    class Guard:
        def __enter__(self):
            guarded.append(1)

        def __exit__(self, *exc):
            return False

    keep = StaticSteps(guard=Guard)
    widths = set()
    for i, kinds in enumerate(ORDERS):
        prompts = prompt_batch("qwen2_5_vl", processor, videos, kinds)
        widths.add(prompts["input_ids"].shape[1])
        with torch.no_grad():
            eager = generate_groups(model, prompts, [2, 3], GREEDY, tokenizer=tok, eos_ids=[], decode="eager")
            kept = generate_groups(model, prompts, [2, 3], GREEDY, tokenizer=tok, eos_ids=[], decode="graph",
                                   static_steps=keep)
        assert torch.equal(eager.completion_ids, kept.completion_ids), kinds
        assert kept.parts["graph_replayed"] == 1.0 and kept.parts["kept/captures"] == float(i == 0), i
    assert len(widths) > 1 and len(made) == 1 and guarded == [1] and len(keep.kept) == 1
    assert made[0].replays >= 4 * (GREEDY.max_new_tokens - 1)
    import app.grouping.decoding.decode as decode

    monkeypatch.setattr(decode, "weight_pointers", lambda model: ("moved",))
    with torch.no_grad(), caplog.at_level("WARNING"):
        for _ in range(2):
            again = generate_groups(model, prompts, [2, 3], GREEDY, tokenizer=tok, eos_ids=[], decode="graph",
                                    static_steps=keep)
            assert torch.equal(again.completion_ids, eager.completion_ids)
    assert caplog.text.count("the weights moved since the step was captured") == 1


@pytest.mark.slow  # compiling the step on this CPU: about 15 s
def test_the_compiled_step_compiles_once_and_draws_the_eager_tokens(tiny_checkpoints, videos, monkeypatch, caplog):
    """rollout.decode=compiled over five rollouts of prompts of other lengths: compiled once, 0 recompiles after
    the first rollout, greedy fp32 tokens equal the eager steps'. A step that cannot compile steps on uncompiled,
    the reason named once, the same tokens."""
    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    tok = tokenizer_of(processor)
    keep = StaticSteps()
    for i, kinds in enumerate(ORDERS):
        prompts = prompt_batch("qwen2_5_vl", processor, videos, kinds)
        with torch.no_grad():
            eager = generate_groups(model, prompts, [2, 3], GREEDY, tokenizer=tok, eos_ids=[], decode="eager")
            compiled = generate_groups(model, prompts, [2, 3], GREEDY, tokenizer=tok, eos_ids=[], decode="compiled",
                                       static_steps=keep)
        assert torch.equal(eager.completion_ids, compiled.completion_ids), kinds
        assert compiled.parts["kept/compiles"] == float(i == 0) and compiled.parts["recompiles"] == 0, i
        if i == 0:
            assert compiled.parts["capture"] > 0 and compiled.parts["compiled_frames"] >= 1
        else:
            assert compiled.parts["compiled_frames"] == 0, i

    def broken(fn, **kwargs):
        def fail():
            raise RuntimeError("inductor: no C++ compiler")
        return fail

    monkeypatch.setattr(torch, "compile", broken)
    with torch.no_grad(), caplog.at_level("WARNING"):
        fallback = generate_groups(model, prompts, [2, 3], GREEDY, tokenizer=tok, eos_ids=[], decode="compiled")
    assert torch.equal(fallback.completion_ids, eager.completion_ids)
    assert "could not be compiled (RuntimeError: inductor: no C++ compiler)" in caplog.text


def test_a_capture_waits_for_the_prefetch_threads_and_they_wait_for_it():
    """``PromptStream.paused``: a prefetch job under way finishes first, and none starts while paused."""
    from app.data.stream import PromptStream

    stream = PromptStream.__new__(PromptStream)
    stream._quiet = threading.Lock()
    seen = []

    def job(name, seconds):
        seen.append(("start", name))
        time.sleep(seconds)
        seen.append(("end", name))

    running = threading.Thread(target=stream._quietly, args=(job, "before", 0.2))
    running.start()
    time.sleep(0.05)
    with stream.paused():
        seen.append(("capture", ""))
        later = threading.Thread(target=stream._quietly, args=(job, "during", 0.0))
        later.start()
        time.sleep(0.1)
        seen.append(("capture done", ""))
    running.join()
    later.join()
    assert seen == [("start", "before"), ("end", "before"), ("capture", ""), ("capture done", ""),
                    ("start", "during"), ("end", "during")]
