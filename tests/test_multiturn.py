"""Multi-turn rollouts with tools drawn as prefix trees (app.rollout.multiturn): the loop's bookkeeping on a scripted
sampler, and on the real Qwen2.5-VL class, the sampled log-probs of every model token equal the tree forward's, with
a video clip inside the path."""

from __future__ import annotations

import json

import pytest
import torch

from app.data.records import EncodedPrompt
from app.rollout.generate import Rollout
from app.rollout.multiturn import TurnLimits, observation_encoder, tree_rollout
from app.rollout.tools import ToolContext, ToolLimits, build_tools
from tests.helpers import load, prompt_batch, tokenizer_of


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


class Scripted:
    """A sampler that writes the given texts, turn by turn (one list per call, in batch order)."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.calls = tokenizer, list(turns), []

    def __call__(self, prompts, group_size, seeds, max_new_tokens):
        texts = self.turns.pop(0)
        group_sizes = [group_size] * len(prompts)
        assert len(texts) == sum(group_sizes)
        self.calls.append((len(prompts), group_sizes, max_new_tokens))
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        width = max(len(i) for i in ids)
        return Rollout(completion_ids=torch.tensor([i + [0] * (width - len(i)) for i in ids]),
                       completion_mask=torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids]),
                       logprobs=torch.tensor([[-0.5] * len(i) + [0.0] * (width - len(i)) for i in ids]),
                       group_sizes=list(group_sizes),
                       stop_reasons=["stop_string" if t.endswith("</tool_call>") else "eos" for t in texts],
                       prefill_tokens=0)


def make_setting(family, tiny_checkpoints, videos):
    model, processor = load(family, tiny_checkpoints)
    prompts = [EncodedPrompt({"problem_id": str(i)}, prompt_batch(family, processor, videos, ["video"]))
               for i in range(2)]
    context = ToolContext({}, videos[1], 3.0, ToolLimits(max_frames=4, min_pixels=3136, max_pixels=6272))
    return model, processor, prompts, context


@pytest.fixture(scope="module")
def setting(tiny_checkpoints, videos):
    return make_setting("qwen2_5_vl", tiny_checkpoints, videos)


def test_the_loop_builds_trees_runs_tools_and_survives_bad_calls(setting):
    _, processor, prompts, context = setting
    tok = tokenizer_of(processor)
    sampler = Scripted(tok, [
        [call("get_frames", start=0.5, end=2.5), "<tool_call>{oops</tool_call>",  # prompt 0, two first turns
         "<answer>3</answer>", call("crop", x=1)],                               # prompt 1
        [call("zoom", frame_time=1.0, box=[0, 0, 0.5, 0.5]), "<answer>7</answer>",  # under prompt 0's node 0
         "<answer>1</answer>", "<answer>2</answer>",                               # under prompt 0's node 1
         call("get_frames", start=5.0, end=9.0), "<answer>4</answer>"],          # under prompt 1's node 1
        [call("get_frames", start=0.0, end=1.0), "<answer>5</answer>"],           # third turns: 1 sample each
    ])
    limits = TurnLimits(max_turns=3, branching=(2, 2), max_new_tokens=64)
    rollout = tree_rollout(sampler, prompts, [context, context], tools=build_tools(["get_frames", "zoom"]),
                           encode=observation_encoder(processor), limits=limits, tokenizer=tok)
    first, second = rollout.trees
    assert [n.parent for n in first.nodes] == [-1, -1, 0, 0, 1, 1, 2]
    assert [n.parent for n in second.nodes] == [-1, -1, 1, 1, 2]
    assert first.paths == [[0, 3], [1, 4], [1, 5], [0, 2, 6]] and second.paths == [[0], [1, 3], [1, 2, 4]]
    assert rollout.leaf_reasons == [["eos", "eos", "eos", "max_turns"], ["eos", "eos", "eos"]]
    assert rollout.answers[0][:3] == ["<answer>7</answer>", "<answer>1</answer>", "<answer>2</answer>"]
    video_node = first.nodes[0]  # a model turn, then the clip it asked for: context, not trained
    assert video_node.trained.any() and not video_node.trained.all()
    assert int(video_node.mm_token_type_ids.max()) == 2 and "pixel_values_videos" in video_node.vision
    assert not video_node.trained[video_node.mm_token_type_ids > 0].any()
    assert int(first.nodes[2].mm_token_type_ids.max()) == 1  # the zoom's image
    assert first.nodes[1].mm_token_type_ids.max() == 0  # the malformed call's error observation is text
    for tree, sampled in zip(rollout.trees, rollout.sampled):  # log-probs for the model's tokens only
        for node, lp in zip(tree.nodes, sampled):
            assert lp.shape == node.trained.shape and torch.equal(lp != 0, node.trained)
    kinds = [[r.error for r in path] for path in rollout.calls[1]]
    assert kinds == [[], ["unknown_tool"], ["unknown_tool", "out_of_range"]]
    metrics = rollout.stats.metrics()
    assert (metrics["tools/calls"], metrics["tools/valid"], metrics["tools/malformed"],
            metrics["tools/unknown_tool"], metrics["tools/out_of_range"]) == (5, 2, 1, 1, 1)
    assert [c[1] for c in sampler.calls] == [[2, 2], [2, 2, 2], [1, 1]]  # branching, then 1 per open node
    views = [node.view for node in first.nodes]  # what an engine with its own processor is given, per node
    assert views[0]["media"][0][0] == "video" and views[2]["media"][0][0] == "image" and views[4]["media"] == []
    assert len(views[0]["prompt_ids"]) < len(first.nodes[0].input_ids)  # the clip's placeholder unexpanded
    assert len(sampler.turns) == 0


def test_a_rollout_stops_at_its_token_budget(setting):
    _, processor, prompts, context = setting
    tok = tokenizer_of(processor)
    sampler = Scripted(tok, [[call("get_frames", start=0.0, end=2.0)]])
    rollout = tree_rollout(sampler, prompts[:1], [context], tools=build_tools(["get_frames"]),
                           encode=observation_encoder(processor),
                           limits=TurnLimits(max_turns=3, max_total_tokens=40), tokenizer=tok)
    assert rollout.leaf_reasons == [["budget"]] and rollout.trees[0].nodes[0].trained.all()
    with pytest.raises(ValueError, match="branching"):
        TurnLimits(max_turns=1, branching=(2, 2))


def call_then_sampled(model, tok, most: int, record_routing: bool = False):
    """A turn sampler: turn 1 a fixed get_frames call (its log-probs teacher-forced on ``model``; with
    ``record_routing`` its experts as the forward routed them), later turns sampled by the grouped engine (at most
    ``most`` tokens, recording its experts with ``record_routing``)."""
    from app.data.prompts import collate_prompts
    from app.grouping import completion_logprobs
    from app.rollout.generate import SamplingConfig, generate_groups

    scripted = Scripted(tok, [[call("get_frames", start=0.0, end=2.0)] * 2])

    def generate(asked, group_size, seeds, max_new_tokens):
        batch = collate_prompts([p.inputs for p in asked], tok.pad_token_id)
        if scripted.turns:
            rollout = scripted(asked, group_size, seeds, max_new_tokens)
            with torch.no_grad():
                forced = completion_logprobs(model, batch, rollout.completion_ids, rollout.completion_mask,
                                             group_size, record_routing=record_routing)
            rollout.logprobs, rollout.routing = forced.logprobs, forced.routing
            return rollout
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=min(max_new_tokens, most))
        return generate_groups(model, batch, group_size, sampling, tokenizer=tok, eos_ids=[], prompt_seeds=seeds,
                               record_routing=record_routing)

    return generate


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_sampled_logprobs_equal_the_tree_forward_with_a_clip_inside(family, tiny_checkpoints, videos):
    """Turn 1 is a fixed call (its log-probs teacher-forced on the real model); turn 2 is sampled by the grouped
    engine from [P; turn 1; the clip] prompts. The tree forward of the resulting tree gives every model token the
    log-prob the sampler reported (1e-5): the engine and the trainer see the same positions, media and attention
    (Qwen3.5: each turn's GDN states are those the path left, and the tree forward hands each node its parent's)."""
    setting = make_setting(family, tiny_checkpoints, videos)
    from app.grouping.tree.forward import tree_logprobs

    model, processor, prompts, context = setting
    tok = tokenizer_of(processor)
    generate = call_then_sampled(model, tok, 8)
    rollout = tree_rollout(generate, prompts[:1], [context], tools=build_tools(["get_frames"]),
                           encode=observation_encoder(processor), limits=TurnLimits(max_turns=2, branching=(2, 3)),
                           tokenizer=tok, seeds=[11])
    tree = rollout.trees[0]
    assert len(tree.paths) == 6 and len(tree.nodes[0].vision["video_grid_thw"]) == 1
    with torch.no_grad():
        scores = tree_logprobs(model, tree, "tree")
    sampled = torch.stack([torch.nn.functional.pad(torch.cat([rollout.sampled[0][n] for n in path]),
                                                   (0, scores.logprobs.shape[1] - scores.lengths[i]))
                           for i, path in enumerate(tree.paths)])
    trained = scores.trained
    assert trained.sum() > 6 * 8
    torch.testing.assert_close(scores.logprobs[trained], sampled[trained], rtol=0, atol=1e-5)
    assert len({tuple(tree.nodes[n].input_ids.tolist()) for n in tree.leaves}) > 1  # really sampled


def test_rollouts_differ_by_seed_not_by_batch(setting):
    _, processor, prompts, context = setting
    tok = tokenizer_of(processor)
    seen = []

    def generate(asked, group_size, seeds, max_new_tokens):
        seen.append(list(seeds))
        return Scripted(tok, [["<answer>1</answer>"] * group_size * len(asked)])(asked, group_size, seeds,
                                                                                 max_new_tokens)

    settings = dict(tools={}, encode=observation_encoder(processor), limits=TurnLimits(), tokenizer=tok)
    tree_rollout(generate, prompts, [context] * 2, seeds=[5, 6], **settings)
    tree_rollout(generate, prompts[1:], [context], seeds=[6], **settings)
    assert seen[0][1] == seen[1][0] and seen[0][0] != seen[0][1]


def test_answers_are_read_as_plain_grpo_reads_completions(setting):
    """The text rewards and evaluation see is the last model turn without special tokens (an <|im_end|> the model
    ends with would otherwise fail an exact format reward)."""
    _, processor, prompts, context = setting
    tok = tokenizer_of(processor)
    sampler = Scripted(tok, [["<think>a</think><answer>B</answer><|im_end|>"]])
    rollout = tree_rollout(sampler, prompts[:1], [context], tools={}, encode=observation_encoder(processor),
                           limits=TurnLimits(max_turns=1), tokenizer=tok)
    assert rollout.answers == [["<think>a</think><answer>B</answer>"]]


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_routing_replay_on_trees_routes_every_token_as_its_rollout_did(family, tiny_checkpoints, videos):
    """rollout.routing_replay=r3 with tools: turn 1 a fixed call (teacher-forced, its experts recorded by the
    forward), turn 2 sampled by the grouped engine recording its experts from [P; turn 1; the clip]. The trees carry
    a record for every token but each leaf's last (the prompt's and the observation's from the prefill that first
    computed them); replayed, the tree forward equals its paths run one by one (log-probs 1e-5, gradients 1e-4,
    routers included) and, on the same weights, the free forward (no router would choose otherwise); a record
    sending tokens elsewhere changes the log-probs and is counted; a missing one stops naming the tree and node."""
    from app.grouping.experts.routers import RoutingError
    from app.grouping.tree.forward import forest_logprobs
    from tests.helpers import max_rel_diff

    model, processor, prompts, context = make_setting(family, tiny_checkpoints, videos)
    tok = tokenizer_of(processor)
    generate = call_then_sampled(model, tok, 6, record_routing=True)
    rollout = tree_rollout(generate, prompts[:1], [context], tools=build_tools(["get_frames"]),
                           encode=observation_encoder(processor), limits=TurnLimits(max_turns=2, branching=(2, 2)),
                           tokenizer=tok, seeds=[11])
    tree = rollout.trees[0]
    record = tree.packed_routing()
    assert record is not None and record.shape[0] == tree.total_len and record.dtype == torch.int16
    lasts = [tree.starts[n] + tree.lengths[n] - 1 for n in tree.leaves]
    present = (record >= 0).all(-1).all(-1)
    assert bool(present[[i for i in range(tree.total_len) if i not in lasts]].all())

    def run(mode, trees, replay=True):
        model.zero_grad(set_to_none=True)
        scores = forest_logprobs(model, trees, mode, replay=replay)
        (scores.logprobs * torch.linspace(0.5, 1.5, scores.logprobs.shape[1])[None]).sum().backward()
        return scores, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    packed, grads = run("tree", [tree])
    paths, ref = run("paths", [tree])
    assert max_rel_diff(packed.logprobs, paths.logprobs) <= 1e-5
    assert set(grads) == set(ref) and any("gate" in n for n in grads)
    assert max(max_rel_diff(grads[n], ref[n]) for n in grads) <= 1e-4
    assert packed.replay_differs[0] == 0 and packed.replay_differs[1] >= tree.total_len - len(lasts)
    free, _ = run("tree", [tree], replay=False)
    torch.testing.assert_close(packed.logprobs, free.logprobs, rtol=0, atol=1e-6)

    import copy

    from app.grouping.experts.blocks import expert_shape

    moved = copy.deepcopy(tree)
    for node in moved.nodes:
        node.routing = torch.where(node.routing >= 0, (node.routing + 1) % expert_shape(model).experts, node.routing)
    shifted, _ = run("tree", [moved])
    assert shifted.replay_differs[0] > 0 and not torch.allclose(shifted.logprobs, packed.logprobs, atol=1e-4)
    moved.nodes[0].routing[0] = -1
    with pytest.raises(RoutingError, match="tree 0: the routing record of its token .* \\(node 0\\) is missing"):
        forest_logprobs(model, [moved], "tree", replay=True)
