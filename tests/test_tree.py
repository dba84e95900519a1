"""Prefix trees (app.grouping.tree.layout): the packed tree equals every root-to-leaf path run as its own [P; path] row,
on the real Qwen2.5-VL and Qwen3-VL classes, with observations that hold images and video clips inside the
responses, uneven branching and leaves of different lengths: log-probs (1e-5) and every gradient, the vision
tower's included (1e-4), in float32. A node that sees a sibling, or a position off by one at a turn boundary,
fails the comparison."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from app.data.prompts import encode_observation
from app.grouping.tree.forward import tree_logprobs
from app.grouping.tree.layout import PrefixTree, TreeNode, tree_mask, tree_positions
from tests.helpers import load, max_rel_diff, patch_size, prompt_batch, tokenizer_of, video_element

LOGPROB_RTOL = 1e-5
GRAD_RTOL = 1e-4


def model_tokens(tok, n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, min(len(tok), tok.vocab_size), (n,), generator=generator)


def turn(tok, parent: int, model_len: int, seed: int, observation: dict | None = None) -> TreeNode:
    """A node: an observation (context, not trained) if given, then ``model_len`` of the model's own tokens."""
    ids = model_tokens(tok, model_len, seed)
    if observation is None:
        return TreeNode(parent, ids, torch.ones(model_len, dtype=torch.bool), torch.zeros_like(ids))
    seen = observation["input_ids"][0]
    types = observation.get("mm_token_type_ids", torch.zeros_like(observation["input_ids"]))[0]
    vision = {k: v for k, v in observation.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    return TreeNode(parent, torch.cat([seen, ids]),
                    torch.cat([torch.zeros(len(seen), dtype=torch.bool), torch.ones(model_len, dtype=torch.bool)]),
                    torch.cat([types, torch.zeros_like(ids)]), vision)


def build_tree(family, processor, videos) -> PrefixTree:
    """P (a video question), two first turns, then uneven branches: an image, a video clip, text only, and an
    image + a clip in one observation; four leaves of different depths and lengths."""
    factor = 2 * patch_size(family)
    tok = tokenizer_of(processor)
    prompt = prompt_batch(family, processor, videos, ["video"])

    def image(seed):
        pixels = np.random.default_rng(seed).integers(0, 255, (factor * 2, factor * 2, 3), dtype=np.uint8)
        return {"type": "image", "image": Image.fromarray(pixels), "min_pixels": factor * factor * 2,
                "max_pixels": factor * factor * 4}

    def clip(i):
        return video_element(videos[i], fps=2.0, min_pixels=factor * factor * 2, max_pixels=factor * factor * 4)

    def observe(*items):
        return encode_observation(processor, [*items, {"type": "text", "text": "What next?"}])

    nodes = [
        turn(tok, -1, 4, seed=1),                                        # 0: first turn A
        turn(tok, -1, 6, seed=2),                                        # 1: first turn B
        turn(tok, 0, 3, seed=3, observation=observe(image(0))),          # 2: A -> an image
        turn(tok, 0, 5, seed=4, observation=observe(clip(1))),           # 3: A -> a video clip
        turn(tok, 0, 2, seed=5),                                         # 4: A -> text only, no observation
        turn(tok, 1, 4, seed=6, observation=observe()),                  # 5: B -> a text observation
        turn(tok, 3, 3, seed=7, observation=observe(image(1), clip(2))),  # 6: clip -> an image and a clip
    ]
    return PrefixTree(prompt, nodes)


def scores_and_grads(model, tree, mode, backend=None):
    model.zero_grad(set_to_none=True)
    scores = tree_logprobs(model, tree, mode, backend=backend)
    weights = torch.linspace(0.5, 1.5, scores.logprobs.shape[1])[None, :] * torch.tensor([1.0, -0.7, 1.3, 0.4])[:, None]
    (scores.logprobs.float() * scores.trained * weights).sum().backward()  # the model's tokens, as a loss uses them
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return scores, grads


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"])
def case(request, tiny_checkpoints, videos):
    model, processor = load(request.param, tiny_checkpoints)
    tree = build_tree(request.param, processor, videos)
    return request.param, model, processor, tree


def test_the_tree_is_what_it_says(case):
    _, _, _, tree = case
    assert tree.paths == [[0, 2], [0, 4], [1, 5], [0, 3, 6]]  # leaves in node order
    assert len(set(tree.lengths)) > 3 and len({sum(tree.lengths[n] for n in p) for p in tree.paths}) == 4
    kinds = {int(t) for node in tree.nodes for t in node.mm_token_type_ids.unique()}
    assert kinds == {0, 1, 2}  # observations hold images and videos
    mask = tree_mask(tree)
    a, b = tree.starts[2], tree.starts[3]  # siblings: neither sees the other
    assert not mask[b, a] and not mask[b:b + tree.lengths[3], a:a + tree.lengths[2]].any()
    assert mask[tree.starts[6], tree.starts[3]] and mask[tree.starts[6], tree.starts[0]]  # ancestors seen


@pytest.mark.parametrize("backend", ["split", "masked"])
def test_tree_equals_each_path_on_its_own(case, backend):
    family, model, _, tree = case
    tree_scores, tree_grads = scores_and_grads(model, tree, "tree", backend)
    path_scores, path_grads = scores_and_grads(model, tree, "paths")
    assert torch.equal(tree_scores.trained, path_scores.trained) and tree_scores.lengths == path_scores.lengths
    assert max_rel_diff(tree_scores.logprobs, path_scores.logprobs) <= LOGPROB_RTOL  # observation tokens too
    assert tree_grads.keys() == path_grads.keys()
    assert any(".visual." in n or n.startswith("model.visual") for n in tree_grads)  # the tower is in the check
    for name, grad in path_grads.items():
        assert max_rel_diff(tree_grads[name], grad) <= GRAD_RTOL, (family, name)


def test_every_node_is_computed_once(case):
    """The packed row holds P and each node once; the vision inputs hold P's media and each node's once."""
    _, _, _, tree = case
    assert tree.total_len == tree.prompt_len + sum(tree.lengths)
    row = tree.packed("input_ids")[0]
    paths_total = sum(tree.prompt_len + sum(tree.lengths[n] for n in p) for p in tree.paths)
    assert len(row) < paths_total
    grids = tree.vision()
    per_path = [tree.vision(p) for p in tree.paths]
    for key in ("image_grid_thw", "video_grid_thw"):
        distinct = (tree.prompt.get(key) is not None) + sum(
            node.vision.get(key) is not None and len(node.vision[key]) for node in tree.nodes)
        assert len(grids.get(key, [])) == distinct
    assert sum(len(v["video_grid_thw"]) for v in per_path) == 4 + 1 + 1  # P's video on every path, the clips once


@pytest.mark.parametrize(("bug", "backend"), [("sibling_visible", "masked"), ("sibling_visible", "split"),
                                              ("sibling_visible", "flex"), ("position_off_by_one", "split")])
def test_a_broken_tree_fails_the_comparison(bug, backend, case, monkeypatch):
    """Mutations: a node that also sees its earlier sibling (in either backend's own bookkeeping), or a node's
    positions shifted by one at the turn boundary. Either must break equality with the paths."""
    import app.grouping.tree.forward as forward_module
    import app.grouping.tree.layout as tree_module

    _, model, _, tree = case
    with torch.no_grad():
        want = tree_logprobs(model, tree, "paths").logprobs
    if bug == "sibling_visible" and backend == "masked":
        honest = tree_module.tree_mask

        def leaky(t, device=None):
            mask = honest(t, device).clone()
            a, b = t.starts[2], t.starts[3]  # node 3's tokens also see node 2's
            mask[b:b + t.lengths[3], a:a + t.lengths[2]] = True
            return mask

        monkeypatch.setattr(tree_module, "tree_mask", leaky)
    elif bug == "sibling_visible" and backend == "flex":
        honest_intervals = tree_module.TreeAttentionPlan.node_intervals

        def leaky_intervals(plan):  # node 2's interval stretched over its next sibling, node 3: node 3 sees node 2
            first, last = honest_intervals(plan)
            two, three = plan.trees[0].starts[2], plan.trees[0].starts[3]
            last = last.clone()
            last[two:two + plan.trees[0].lengths[2]] = first[three]
            return first, last

        monkeypatch.setattr(tree_module.TreeAttentionPlan, "node_intervals", leaky_intervals)
    elif bug == "sibling_visible":
        honest_sets = tree_module.sibling_sets

        def leaky_sets(t):  # node 0's children (2, 3, 4) all also see node 1, their parent's sibling
            return [(sorted({*seen, *range(t.starts[1], t.starts[1] + t.lengths[1])}) if 3 in kids else seen, kids)
                    for seen, kids in honest_sets(t)]

        monkeypatch.setattr(tree_module, "sibling_sets", leaky_sets)
    else:
        honest = forward_module.tree_positions  # what the tree forward calls

        def shifted(m, t):
            out = honest(m, t).clone()
            out[:, t.starts[3]:t.starts[3] + t.lengths[3]] += 1
            return out

        monkeypatch.setattr(forward_module, "tree_positions", shifted)
    with torch.no_grad():
        got = tree_logprobs(model, tree, "tree", backend=backend).logprobs
    assert max_rel_diff(got, want) > LOGPROB_RTOL


def test_positions_follow_each_path_and_bad_trees_are_named(case):
    from app.grouping import LayoutError

    _, model, _, tree = case
    positions = tree_positions(model, tree)
    for sibling in (2, 3, 4):  # children of node 0 all start one past node 0's largest id
        first = positions[:, tree.starts[sibling]]
        assert torch.equal(first, positions[:, tree.starts[2]])
    with pytest.raises(LayoutError, match="node 1: parent 5 must be -1"):
        PrefixTree(tree.prompt, [tree.nodes[0], TreeNode(5, tree.nodes[1].input_ids, tree.nodes[1].trained)])
    with pytest.raises(LayoutError, match="ONE prompt"):
        PrefixTree({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, tree.nodes)


@pytest.mark.slow  # the fp32 exactness above is in make test; make test-all and CI run this
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_bf16_tree_no_worse_than_bf16_paths(family, tiny_checkpoints, videos):
    """The bfloat16 criterion of plain groups (app.grouping.precision): against a float32 run of the same weights,
    the bf16 tree's log-prob errors (mean, max) and per-parameter gradient errors are within the bounds of the
    bf16 paths' own."""
    import dataclasses

    from app.grouping import compare_to_reference
    from tests.test_bf16 import bf16_rounded, grad_excess

    model32, model16, processor = bf16_rounded(family, tiny_checkpoints)
    tree = build_tree(family, processor, videos)

    def rounded(vision):  # the bf16 model rounds its pixels; give the float32 reference the same ones
        return {k: v.to(torch.bfloat16).float() if k.startswith("pixel_values") else v for k, v in vision.items()}

    tree = PrefixTree(rounded(dict(tree.prompt)),
                      [dataclasses.replace(node, vision=rounded(node.vision)) for node in tree.nodes])
    (ref, ref_grads), (paths, path_grads), (ours, our_grads) = (
        scores_and_grads(m, tree, mode) for m, mode in ((model32, "paths"), (model16, "paths"), (model16, "tree")))
    valid = torch.arange(ref.logprobs.shape[1])[None, :] < torch.tensor(ref.lengths)[:, None]
    comparison = compare_to_reference(ours.logprobs.detach(), paths.logprobs.detach(), ref.logprobs.detach(), valid)
    assert comparison.repeated_mean > 1e-4 and comparison.passes(), comparison.describe()
    worst, excess, mine, theirs = grad_excess(our_grads, path_grads, ref_grads)
    assert excess <= 0, (worst, mine, theirs)


def test_several_trees_in_one_row_equal_their_paths(case, videos):
    """A micro-batch of trees packs them into ONE row (trees never see each other): log-probs, entropy and every
    gradient equal the paths run one row each."""
    from app.grouping.tree.forward import forest_logprobs

    family, model, processor, first = case
    second = build_tree(family, processor, videos[::-1])  # another prompt (other videos), the same shape of tree
    second = PrefixTree(second.prompt, second.nodes[:4])  # and a smaller tree
    runs = {}
    for mode in ("tree", "paths"):
        model.zero_grad(set_to_none=True)
        scores = forest_logprobs(model, [first, second], mode, return_entropy=True)
        (scores.logprobs * scores.trained).sum().backward()
        runs[mode] = scores, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    (tree, tree_grads), (paths, path_grads) = runs["tree"], runs["paths"]
    assert len(tree.paths) == len(first.paths) + len(second.paths) and tree.packed_tokens < tree.repeated_tokens
    assert max_rel_diff(tree.logprobs, paths.logprobs) <= LOGPROB_RTOL
    assert max_rel_diff(tree.entropy, paths.entropy) <= LOGPROB_RTOL
    for name, grad in path_grads.items():
        assert max_rel_diff(tree_grads[name], grad) <= GRAD_RTOL, name


def test_flex_tree_attention_equals_the_paths_and_the_dense_mask(case, videos):
    """The flex tree backend (compiled FlexAttention, a block mask from the trees' node intervals, no [T, T] tensor):
    its block mask allows exactly the dense tree mask, and two trees in one row score as their paths do. Forward
    only: FlexAttention's backward needs CUDA (tests/test_gpu.py runs it there)."""
    from app.grouping.flex import tree_mask_mod
    from app.grouping.tree.forward import forest_logprobs
    from app.grouping.tree.layout import TreeAttentionPlan

    family, model, processor, first = case
    second = build_tree(family, processor, videos[::-1])
    second = PrefixTree(second.prompt, second.nodes[:4])
    plan = TreeAttentionPlan([first, second], "flex")
    index = torch.arange(plan.total_len)
    allowed = tree_mask_mod(*plan.node_intervals())(None, None, index[:, None], index[None, :])
    assert torch.equal(allowed, plan.mask("cpu"))  # the dense block-diagonal tree mask, element by element
    with torch.no_grad():
        flex = forest_logprobs(model, [first, second], "tree", backend="flex")
        paths = forest_logprobs(model, [first, second], "paths")
    assert max_rel_diff(flex.logprobs, paths.logprobs) <= LOGPROB_RTOL


def test_the_tree_scorer_follows_the_forward_settings(case, monkeypatch):
    """TreeScorer: forward.grouping=repeated runs the paths; forward.attention_backend=split or flex picks that tree
    attention, anything else the dense mask."""
    import app.training.scoring as scoring
    from app.config.sections import ForwardConfig

    _, model, _, tree = case
    seen = []
    monkeypatch.setattr(scoring, "forest_logprobs", lambda m, trees, mode, **kw: seen.append((mode, kw["backend"])))
    for grouping, backend in (("grouped", "split"), ("grouped", "flex"), ("grouped", "auto"), ("repeated", "auto")):
        scoring.TreeScorer(ForwardConfig(grouping=grouping, attention_backend=backend))(model, {"trees": [tree]},
                                                                                          None, None, None)
    assert seen == [("tree", "split"), ("tree", "flex"), ("tree", "masked"), ("paths", "masked")]


def test_an_observation_repeated_across_samples_goes_through_the_tower_once(case, videos):
    """Two samples that asked for the same window get the same clip: with a frozen tower the step's vision cache
    encodes it once (a hit for the repeat), and the log-probs are bitwise those of the cache off."""
    from app.grouping.vision import cache as vision_cache

    family, model, processor, _ = case
    factor = 2 * patch_size(family)
    tok = tokenizer_of(processor)

    def same_clip():
        return encode_observation(processor, [video_element(videos[1], fps=2.0, min_pixels=factor * factor * 2,
                                                            max_pixels=factor * factor * 4),
                                              {"type": "text", "text": "What next?"}])

    prompt = prompt_batch(family, processor, videos, ["video"])
    nodes = [turn(tok, -1, 4, seed=1), turn(tok, 0, 3, seed=2, observation=same_clip()),
             turn(tok, 0, 5, seed=3, observation=same_clip()), turn(tok, -1, 2, seed=4)]
    tree = PrefixTree(prompt, nodes)
    trains = {n: p.requires_grad for n, p in model.named_parameters()}
    model.model.visual.requires_grad_(False)
    try:
        with torch.no_grad():
            cache = vision_cache.install(model, "off")
            off = tree_logprobs(model, tree, "tree").logprobs
            cache = vision_cache.install(model, "step")
            on = tree_logprobs(model, tree, "tree").logprobs
            counts = cache.counts()
    finally:
        vision_cache.detach(model)
        for name, p in model.named_parameters():
            p.requires_grad_(trains[name])
    assert cache.plan == "outputs"
    assert counts["tower_items"] == 2 and counts["cache_hits"] == 1  # P's video and the clip; the repeat served
    assert torch.equal(on, off)
