"""The prefix-tree forward: several trees (a micro-batch's groups) packed in one row, each node's tokens computed
once, scored for every root-to-leaf path (``forest_logprobs``); or each path as its own row (``paths``, the
reference the tree is tested against). The trees themselves, their mask, positions and attention plan are
``app.grouping.tree.layout``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.grouping.attention import ATTENTION_NAME, PLAN_KWARG
from app.grouping.logprobs import head_returns_logprobs
from app.grouping.modules import keeps_attention_unless_grad, set_text_attention, unwrap
from app.grouping.positions import VISION_KEYS, prompt_positions
from app.grouping.tree.layout import PrefixTree, TreeAttentionPlan, tree_positions
from app.grouping.vision.calls import aligned_vision_calls

TREE_MODES = ("tree", "paths")


@dataclass
class TreeScores:
    """Per-path log-probs of one or several trees (their paths one after another): ``logprobs`` [paths, W] (each
    path's node tokens in order, observation tokens included, 0 past its end), ``trained`` [paths, W] (the model's
    tokens: what a loss may use), ``entropy`` (when asked), ``packed_tokens`` (the row's length) and
    ``repeated_tokens`` (what one row per path would take)."""

    logprobs: torch.Tensor
    trained: torch.Tensor
    lengths: list[int]
    paths: list[list[int]]
    entropy: torch.Tensor | None = None
    packed_tokens: int = 0
    repeated_tokens: int = 0
    replay_differs: torch.Tensor | None = None  # routing replay: (tokens routed otherwise, tokens replayed)

    @property
    def mask(self) -> torch.Tensor:
        return self.trained

    @property
    def layout(self):  # what the trainer counts (``tokens``): the trees' own numbers
        return self


def _rows(per_path: list[torch.Tensor]) -> torch.Tensor:
    width = max(len(r) for r in per_path)
    return torch.stack([F.pad(r, (0, width - len(r))) for r in per_path])


def forest_vision(trees: Sequence[PrefixTree]) -> dict:
    """The vision tensors of several trees packed in one row, in row order."""
    out = {}
    for key in VISION_KEYS:
        parts = [t.vision()[key] for t in trees if key in t.vision()]
        if parts:
            out[key] = torch.cat([p.to(parts[0].device) for p in parts])
    return out


def _forest_forward(model, trees: Sequence[PrefixTree], temperature: float, chunk_size: int, entropy: bool,
                    backend: str, *, routed=None):
    """Per tree, per node: (log-probs, entropy) of its tokens, from ONE packed row holding every tree. ``routed``:
    the trees' routing records replayed (``routing.tree_replay``)."""
    device = trees[0].prompt["input_ids"].device
    set_text_attention(model, ATTENTION_NAME)
    positions = torch.cat([tree_positions(model, t).to(device) for t in trees], dim=1)
    position_ids = positions[:, None] if positions.shape[0] > 1 else positions
    kwargs = forest_vision(trees)
    if trees[0].prompt.get("mm_token_type_ids") is not None:
        kwargs["mm_token_type_ids"] = torch.cat([t.packed("mm_token_type_ids") for t in trees], dim=1)
    offsets = [0]
    for t in trees:
        offsets.append(offsets[-1] + t.total_len)
    predict = torch.cat([t.predict_index + off for t, off in zip(trees, offsets)]).to(device)
    targets = torch.cat([t.path_tokens(range(len(t.nodes))) for t in trees]).to(device)
    input_ids = torch.cat([t.packed("input_ids") for t in trees], dim=1)
    if routed is not None:
        from app.grouping.tree.routing import forest_record

        kwargs.update(routed.plan_for(forest_record(trees, device), None))
    with head_returns_logprobs(unwrap(model), targets, None, temperature, chunk_size or 1024, entropy):
        both = model(input_ids=input_ids, attention_mask=None, position_ids=position_ids, use_cache=False,
                     logits_to_keep=predict, **{PLAN_KWARG: TreeAttentionPlan(trees, backend)}, **kwargs).logits[0]
    counts = [sum(t.lengths) for t in trees]
    return [(list(torch.split(c, t.lengths)), list(torch.split(e.detach(), t.lengths)))
            for t, c, e in zip(trees, torch.split(both[:, 0], counts), torch.split(both[:, 1], counts))]


def _paths_forward(model, tree: PrefixTree, temperature: float, chunk_size: int, entropy: bool, *, routed=None):
    """Every path of ``tree`` as its own row [P; path] (right-padded), its own copy of P's media: the reference.
    Per path, per node on it: (log-probs, entropy). ``routed``: the tree's routing record replayed on every row."""
    set_text_attention(model, "sdpa")
    prompt_ids = tree.prompt["input_ids"][0]
    device = prompt_ids.device
    rows = [torch.cat([prompt_ids, tree.path_tokens(p).to(device)]) for p in tree.paths]
    width = max(len(r) for r in rows)
    input_ids = torch.stack([F.pad(r, (0, width - len(r))) for r in rows])
    mask = torch.stack([F.pad(torch.ones_like(r), (0, width - len(r))) for r in rows])
    batch = {"input_ids": input_ids, "attention_mask": mask}
    for key in VISION_KEYS:
        parts = [tree.vision(p)[key] for p in tree.paths if key in tree.vision(p)]
        if parts:
            batch[key] = torch.cat(parts)
    if tree.prompt.get("mm_token_type_ids") is not None:
        types = [torch.cat([tree.prompt["mm_token_type_ids"][0], tree.path_tokens(p, "mm_token_type_ids").to(device)])
                 for p in tree.paths]
        batch["mm_token_type_ids"] = torch.stack([F.pad(t, (0, width - len(t))) for t in types])
    batch["position_ids"] = prompt_positions(unwrap(model), input_ids, mask, batch)
    if batch["position_ids"].shape[0] == 1:
        batch["position_ids"] = batch["position_ids"][0]
    keep = width - tree.prompt_len + 1  # position Lp - 1 + j predicts path token j; the last one predicts nothing
    valid = mask[:, tree.prompt_len:].bool()
    select = torch.cat([valid, valid.new_zeros(len(rows), 1)], dim=1)
    targets = input_ids[:, tree.prompt_len:][valid]
    if routed is not None:
        from app.grouping.tree.routing import paths_record

        batch.update(routed.plan_for(paths_record(tree, width, device), None))
    with head_returns_logprobs(unwrap(model), targets, select, temperature, chunk_size or 1024, entropy):
        both = model(**batch, use_cache=False, logits_to_keep=keep).logits[:, :-1]
    out = []
    for r, path in enumerate(tree.paths):
        pieces, cursor = [], 0
        for n in path:
            span = both[r, cursor:cursor + tree.lengths[n]]
            pieces.append((span[:, 0], span[:, 1].detach()))
            cursor += tree.lengths[n]
        out.append(pieces)
    return out


@keeps_attention_unless_grad
def forest_logprobs(model, trees: Sequence[PrefixTree], mode: str = "tree", *, temperature: float = 1.0,
                    chunk_size: int = 1024, return_entropy: bool = False, vision_calls=None,
                    backend: str | None = None, replay: bool = False) -> TreeScores:
    """Log-probs of every path's node tokens for several trees (their paths one after another): ``tree`` packs
    them all into ONE row (each node once, trees never seeing each other), ``paths`` runs each path as its own row
    (the reference). Differentiable; keep the model's attention setting until the backward has finished.
    ``vision_calls``: the tower calls this forward must make (ZeRO-3, ``app.grouping.aligned_vision_calls``);
    ``backend``: the tree attention (``TREE_BACKENDS``; default ``masked``); ``replay``: route every token through
    the trees' routing records (``routing.tree_replay``; ``replay_differs`` says how many routers would not)."""
    if mode not in TREE_MODES:
        raise ValueError(f"unknown tree mode {mode!r}; expected one of {TREE_MODES}")
    logprobs, entropies, trained, differs = [], [], [], []
    routed = None
    if replay:
        from app.grouping.tree.routing import tree_replay

        routed = tree_replay(model, trees)
    with aligned_vision_calls(model, forest_vision(trees), vision_calls):
        if mode == "tree":
            per_tree = _forest_forward(model, trees, temperature, chunk_size, return_entropy, backend or "masked",
                                       routed=routed)
            differs.append(routed.replay_differs() if routed is not None else None)
            for tree, (values, ents) in zip(trees, per_tree):
                logprobs += [torch.cat([values[n] for n in p]) for p in tree.paths]
                entropies += [torch.cat([ents[n] for n in p]) for p in tree.paths]
        else:
            for tree in trees:
                for pieces in _paths_forward(model, tree, temperature, chunk_size, return_entropy, routed=routed):
                    logprobs.append(torch.cat([v for v, _ in pieces]))
                    entropies.append(torch.cat([e for _, e in pieces]))
                differs.append(routed.replay_differs() if routed is not None else None)
    for tree in trees:
        trained += [tree.path_tokens(p, "trained").bool() for p in tree.paths]
    values = _rows(logprobs)
    return TreeScores(
        logprobs=values, trained=_rows(trained).to(values.device), lengths=[len(r) for r in logprobs],
        paths=[p for t in trees for p in t.paths], entropy=_rows(entropies) if return_entropy else None,
        packed_tokens=sum(t.total_len for t in trees),
        repeated_tokens=sum(t.prompt_len + sum(t.lengths[n] for n in p) for t in trees for p in t.paths),
        replay_differs=torch.stack(differs).sum(0) if differs and differs[0] is not None else None)


def tree_logprobs(model, tree: PrefixTree, mode: str = "tree", *, temperature: float = 1.0,
                  chunk_size: int = 1024, backend: str | None = None) -> TreeScores:
    """``forest_logprobs`` of one tree."""
    return forest_logprobs(model, [tree], mode, temperature=temperature, chunk_size=chunk_size, backend=backend)
