"""Prefix trees: one packed row for a group whose rollouts share more than the prompt (earlier turns, branches).

A group is a tree. The prompt P (system, video, question) is the root; every other node is a run of tokens that
continues its parent: a model turn, a tool's observation (text, images or a video clip, vision placeholders
included), or both. Each root-to-leaf path is one rollout [P; path]. The packed row is [P; node 0; node 1; ...]
(parents before children), so every node's tokens, and the vision inputs inside them, are computed once however
many rollouts share them. Exact against running each path as its own row (``mode="paths"``), because:

- attention: a token sees P causally, all tokens of its node's ancestors, and its own node's earlier tokens; never a
  sibling's or a cousin's (``tree_mask``; an ancestor precedes its descendants in the row, so the rule is
  ``key <= query and ancestor_or_self[node(query), node(key)]``);
- positions: each node's tokens get exactly the ids they have in [P; path] for any path through the node, computed
  by the model's own ``get_rope_index`` on that path (M-RoPE with media inside a response placed as Qwen's code
  places them: ``positions.prompt_positions``, which also continues after media as Qwen and vLLM do); paths that
  share a node agree on its ids (checked);
- vision: the row's images and videos are P's, then each node's in row order, so the tower runs once per distinct
  item and its outputs land on the placeholders in the order the model scatters them;
- log-probs: node n's first token is predicted by its parent's last token (P's last for a first turn), the others
  by their own predecessor; a path's scores are its nodes' scores in order, so a node shared by k paths is
  computed once and its gradient is the sum of the k paths' (autograd sums the gathered copies).

``trained`` marks the tokens a loss may use (the model's own); observation tokens are context only, and their
log-probs are still returned (masked). The grouping of plain groups (``completion_logprobs``) is the tree of depth
1 whose nodes are nodes 0..G-1 under the root; this module does not replace it, it generalises it. Attention
(``TreeAttentionPlan``): ``masked``, the default, one SDPA call under the dense tree mask ([T, T] bool); ``split``
(CPU), each set of siblings in one exact two-part call over torch's fused kernel, no [T, T] mask, for rows whose
mask would not fit (about the same time at a 4k-token tree here: docs/bench/tree.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from app.grouping.layout import LayoutError
from app.grouping.modules import unwrap
from app.grouping.positions import VISION_KEYS, prompt_positions, rope_index_owner


@dataclass
class TreeNode:
    """A run of tokens continuing node ``parent`` (-1: the prompt). ``vision``: the processor's tensors for the
    images / videos whose placeholders are in ``input_ids`` (pixel_values, image_grid_thw, pixel_values_videos,
    video_grid_thw, second_per_grid_ts), in their order; ``mm_token_type_ids`` (0 text, 1 image, 2 video) is
    needed when there are any."""

    parent: int
    input_ids: torch.Tensor  # [n] long
    trained: torch.Tensor  # [n] bool: the model's own tokens (scored for the loss); False: observation tokens
    mm_token_type_ids: torch.Tensor | None = None  # [n]; None: all text
    vision: dict = field(default_factory=dict)
    # for an engine with its own processor (vLLM): these tokens unexpanded and their media (``encode_prompts``'
    # engine view); not used by the forward
    view: dict | None = None
    # routing replay (rollout.routing_replay=r3): the experts each token went to in the rollout, [n, S, k] int16
    # (-1: none; a leaf's last token is never fed back)
    routing: torch.Tensor | None = None


@dataclass
class PrefixTree:
    """One prompt (a processor's output for ONE unpadded prompt: input_ids [1, Lp], attention_mask,
    mm_token_type_ids and vision tensors for VL models) and its nodes, parents listed before children."""

    prompt: Mapping[str, torch.Tensor]
    nodes: Sequence[TreeNode]
    routing: torch.Tensor | None = None  # routing replay: the prompt's experts [Lp, S, k] int16 (``TreeNode.routing``)
    layers: tuple[int, ...] = ()  # the sparse layers the records are of

    def __post_init__(self) -> None:
        ids = self.prompt.get("input_ids")
        if ids is None or ids.dim() != 2 or ids.shape[0] != 1:
            raise LayoutError("a prefix tree's prompt is ONE prompt: input_ids of shape [1, Lp]")
        mask = self.prompt.get("attention_mask")
        if mask is not None and not bool(mask.bool().all()):
            raise LayoutError("a prefix tree's prompt must be unpadded (attention_mask all ones)")
        if not self.nodes:
            raise LayoutError("a prefix tree needs at least one node")
        for n, node in enumerate(self.nodes):
            if not -1 <= node.parent < n:
                raise LayoutError(f"node {n}: parent {node.parent} must be -1 (the prompt) or an earlier node")
            if node.input_ids.dim() != 1 or node.input_ids.numel() == 0:
                raise LayoutError(f"node {n}: input_ids must be a non-empty 1-D tensor")
            if node.trained.shape != node.input_ids.shape:
                raise LayoutError(f"node {n}: trained {tuple(node.trained.shape)} and input_ids "
                                  f"{tuple(node.input_ids.shape)} differ in shape")
            if node.mm_token_type_ids is not None and node.mm_token_type_ids.shape != node.input_ids.shape:
                raise LayoutError(f"node {n}: mm_token_type_ids and input_ids differ in shape")

    def to(self, device) -> PrefixTree:
        """The same tree with every tensor on ``device``."""
        prompt = {k: v.to(device) for k, v in self.prompt.items()}
        nodes = [TreeNode(n.parent, n.input_ids.to(device), n.trained.to(device),
                          None if n.mm_token_type_ids is None else n.mm_token_type_ids.to(device),
                          {k: v.to(device) for k, v in n.vision.items()}, n.view,
                          None if n.routing is None else n.routing.to(device)) for n in self.nodes]
        return PrefixTree(prompt, nodes, None if self.routing is None else self.routing.to(device), self.layers)

    def packed_routing(self) -> torch.Tensor | None:
        """Routing replay: [T, S, k], the prompt's record then every node's in row order (None without records)."""
        if self.routing is None or any(n.routing is None for n in self.nodes):
            return None
        return torch.cat([self.routing, *[n.routing.to(self.routing.device) for n in self.nodes]])

    # ---- geometry -------------------------------------------------------------------------------------------
    @property
    def prompt_len(self) -> int:
        return int(self.prompt["input_ids"].shape[1])

    @cached_property
    def lengths(self) -> list[int]:
        return [int(node.input_ids.numel()) for node in self.nodes]

    @cached_property
    def starts(self) -> list[int]:
        """Each node's first position in the packed row."""
        out, cursor = [], self.prompt_len
        for length in self.lengths:
            out.append(cursor)
            cursor += length
        return out

    @property
    def total_len(self) -> int:
        return self.prompt_len + sum(self.lengths)

    @cached_property
    def leaves(self) -> list[int]:
        parents = {node.parent for node in self.nodes}
        return [n for n in range(len(self.nodes)) if n not in parents]

    @cached_property
    def paths(self) -> list[list[int]]:
        """Root-to-leaf node lists, one per leaf (a rollout each), leaves in node order."""
        out = []
        for leaf in self.leaves:
            path, n = [], leaf
            while n >= 0:
                path.append(n)
                n = self.nodes[n].parent
            out.append(path[::-1])
        return out

    @cached_property
    def node_of_token(self) -> torch.Tensor:
        """[T]: 0 for P's tokens, n + 1 for node n's."""
        ids = [0] * self.prompt_len
        for n, length in enumerate(self.lengths):
            ids += [n + 1] * length
        return torch.tensor(ids)

    @cached_property
    def ancestor_or_self(self) -> torch.Tensor:
        """[N+1, N+1] bool: entry [a, b] says node b (0 = P) is node a itself or one of its ancestors."""
        count = len(self.nodes) + 1
        table = torch.zeros(count, count, dtype=torch.bool)
        table[:, 0] = True
        for n, node in enumerate(self.nodes):
            table[n + 1] = table[node.parent + 1]
            table[n + 1, n + 1] = True
        return table

    def path_tokens(self, path: Sequence[int], key: str = "input_ids") -> torch.Tensor:
        if key == "mm_token_type_ids":
            return torch.cat([self.nodes[n].mm_token_type_ids if self.nodes[n].mm_token_type_ids is not None
                              else torch.zeros_like(self.nodes[n].input_ids) for n in path])
        return torch.cat([getattr(self.nodes[n], key) for n in path])

    @cached_property
    def predict_index(self) -> torch.Tensor:
        """[K]: the packed position whose output predicts each node token (node order, then token order)."""
        index = []
        for n, node in enumerate(self.nodes):
            parent_last = self.prompt_len - 1 if node.parent < 0 else (self.starts[node.parent]
                                                                      + self.lengths[node.parent] - 1)
            index += [parent_last, *range(self.starts[n], self.starts[n] + self.lengths[n] - 1)]
        return torch.tensor(index)

    def packed(self, key: str) -> torch.Tensor:
        """[1, T]: the prompt's ``input_ids`` or ``mm_token_type_ids`` followed by every node's."""
        prompt = self.prompt.get(key)
        if prompt is None:
            prompt = torch.zeros_like(self.prompt["input_ids"])
        nodes = self.path_tokens(range(len(self.nodes)), key).to(prompt.device)
        return torch.cat([prompt[0], nodes.to(prompt.dtype)])[None]

    def vision(self, path: Sequence[int] | None = None) -> dict:
        """The vision tensors of P and then of the nodes of ``path`` (all nodes, in row order, when None)."""
        nodes = range(len(self.nodes)) if path is None else path
        out = {}
        for key in VISION_KEYS:
            parts = [self.prompt[key]] if self.prompt.get(key) is not None else []
            parts += [self.nodes[n].vision[key] for n in nodes if self.nodes[n].vision.get(key) is not None]
            if parts:
                out[key] = torch.cat([p.to(parts[0].device) for p in parts])
        return out


def tree_mask(tree: PrefixTree, device=None) -> torch.Tensor:
    """[T, T] bool: query i sees key j iff j <= i and j's node is i's node or one of its ancestors (P for all)."""
    node = tree.node_of_token.to(device)
    index = torch.arange(tree.total_len, device=device)
    return (index[None, :] <= index[:, None]) & tree.ancestor_or_self.to(device)[node[:, None], node[None, :]]


def tree_positions(model, tree: PrefixTree) -> torch.Tensor:
    """[axes, T] position ids of the packed row: P's as the model computes them, each node's as they are in
    [P; path] for a path through it (the model's own ``get_rope_index`` on each path, then ``continue_after_media``);
    1-D RoPE models: the path offset. Paths that share a node must agree on its ids (a LayoutError otherwise)."""
    model = unwrap(model)
    out, placed = None, torch.zeros(tree.total_len, dtype=torch.bool)
    for path in tree.paths:
        ids = torch.cat([tree.prompt["input_ids"][0], tree.path_tokens(path).to(tree.prompt["input_ids"].device)])
        inputs = tree.vision(path)
        if rope_index_owner(model) is not None:
            inputs["mm_token_type_ids"] = torch.cat([tree.prompt["mm_token_type_ids"][0],
                                                     tree.path_tokens(path, "mm_token_type_ids").to(ids.device)])[None]
        positions = prompt_positions(model, ids[None], torch.ones_like(ids)[None], inputs)[:, 0]  # [axes, Lp + n]
        if out is None:
            out = positions.new_zeros(positions.shape[0], tree.total_len)
            out[:, :tree.prompt_len] = positions[:, :tree.prompt_len]
        cursor = tree.prompt_len
        for n in path:
            span = slice(tree.starts[n], tree.starts[n] + tree.lengths[n])
            mine = positions[:, cursor:cursor + tree.lengths[n]]
            if placed[span].any() and not torch.equal(out[:, span], mine):
                raise LayoutError(f"node {n}: two paths through it give its tokens different positions")
            out[:, span], placed[span] = mine, True
            cursor += tree.lengths[n]
    return out


TREE_BACKENDS = ("split", "masked", "flex")


def sibling_sets(tree: PrefixTree) -> list[tuple[list[int], list[int]]]:
    """For the prompt and each node with children: (the positions its children all see in full: P and the tokens
    of the node and its ancestors, ascending; its children in order)."""
    children: dict[int, list[int]] = {}
    for n, node in enumerate(tree.nodes):
        children.setdefault(node.parent, []).append(n)
    out = []
    for parent, kids in children.items():
        seen = list(range(tree.prompt_len))
        chain, n = [], parent
        while n >= 0:
            chain.append(n)
            n = tree.nodes[n].parent
        for m in reversed(chain):
            seen += range(tree.starts[m], tree.starts[m] + tree.lengths[m])
        out.append((seen, kids))
    return out


def depth_first_intervals(tree: PrefixTree) -> tuple[dict[int, int], dict[int, int]]:
    """Each node's number in a depth-first (pre-order) numbering of the tree, P (-1) first, children in node order,
    and the largest number in its subtree."""
    children: dict[int, list[int]] = {}
    for n, node in enumerate(tree.nodes):
        children.setdefault(node.parent, []).append(n)
    number, end, stack = {}, {}, [(-1, False)]
    while stack:
        n, done = stack.pop()
        if done:
            end[n] = len(number) - 1
            continue
        number[n] = len(number)
        stack.append((n, True))
        stack.extend((child, False) for child in reversed(children.get(n, [])))
    return number, end


@dataclass
class TreeAttentionPlan:
    """The attention-plan protocol (``attend``) for packed prefix trees (one or several, one after another in the
    row, never seeing each other). ``masked``: one call under their block-diagonal ``tree_mask`` (the reference);
    ``split`` (CPU): each prompt causally, then for each set of siblings one exact two-part call, their queries
    against what they all see (P and their ancestors, unmasked) merged by log-sum-exp with each sibling against its
    own earlier tokens (``attention._PrefixPlusOwnAttention``, the grouped ``split`` backend's kernel); ``flex``:
    compiled FlexAttention under a block mask built from the trees' node intervals (``flex.tree_mask_mod``), no
    [T, T] tensor (forward runs on CPU; its backward needs CUDA, as the grouped flex backend's)."""

    trees: Sequence[PrefixTree]
    backend: str = "masked"
    _mask: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in TREE_BACKENDS:
            raise ValueError(f"unknown tree attention backend {self.backend!r}; expected one of {TREE_BACKENDS}")

    @property
    def total_len(self) -> int:
        return sum(t.total_len for t in self.trees)

    def mask(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._mask:
            self._mask[key] = torch.block_diag(*[tree_mask(t, device) for t in self.trees])
        return self._mask[key]

    def attend(self, module, query, key, value, *, scale=None, dropout=0.0) -> torch.Tensor:
        if query.shape[2] != self.total_len:
            raise ValueError(f"packed trees have {query.shape[2]} tokens but the trees describe {self.total_len}")
        if self.backend == "flex":
            if dropout:
                raise NotImplementedError("the flex tree backend has no attention dropout")
            return self._flex(query, key, value, scale).transpose(1, 2).contiguous()
        heads = query.shape[1]
        key = key.repeat_interleave(heads // key.shape[1], dim=1) if key.shape[1] != heads else key
        value = value.repeat_interleave(heads // value.shape[1], dim=1) if value.shape[1] != heads else value
        if self.backend == "split":
            if dropout:
                raise NotImplementedError("the split tree backend has no attention dropout")
            return self._split(query, key, value, scale).transpose(1, 2).contiguous()
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=self.mask(query.device), dropout_p=dropout,
                                             scale=scale)
        return out.transpose(1, 2).contiguous()

    def node_intervals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token of the row: its node's number in a depth-first numbering of every tree (P is each tree's root;
        trees numbered one after another) and the largest number in that node's subtree. Node b is node a or an
        ancestor of a exactly when first[b] <= first[a] <= last[b]."""
        firsts, lasts, offset = [], [], 0
        for tree in self.trees:
            number, end = depth_first_intervals(tree)
            node = tree.node_of_token - 1  # -1 for P's tokens
            firsts.append(torch.tensor([offset + number[int(n)] for n in node]))
            lasts.append(torch.tensor([offset + end[int(n)] for n in node]))
            offset += len(tree.nodes) + 1
        return torch.cat(firsts), torch.cat(lasts)

    def _flex(self, q, k, v, scale) -> torch.Tensor:
        from app.grouping.flex import block_mask_from, run_flex, tree_mask_mod

        key = ("flex", str(q.device))
        if key not in self._mask:
            self._mask[key] = block_mask_from(tree_mask_mod, list(self.node_intervals()), self.total_len, q.device)
        return run_flex(q, k, v, self._mask[key], scale, alternative="forward.attention_backend=masked (a dense "
                        "[T, T] tree mask) or split (CPU)")

    def _split(self, q, k, v, scale) -> torch.Tensor:
        from app.grouping.kernels import _PrefixPlusOwnAttention

        if q.device.type != "cpu":
            raise NotImplementedError("the split tree backend uses torch's fused CPU kernel; elsewhere use masked")
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        out = torch.empty_like(q)
        offset = 0
        for tree in self.trees:
            p = slice(offset, offset + tree.prompt_len)
            out[:, :, p] = F.scaled_dot_product_attention(q[:, :, p], k[:, :, p], v[:, :, p], is_causal=True,
                                                          scale=scale)
            for seen, kids in sibling_sets(tree):
                ahead = torch.tensor(seen, device=q.device) + offset
                own = torch.cat([torch.arange(tree.starts[c], tree.starts[c] + tree.lengths[c]) for c in kids])
                own = own.to(q.device) + offset
                span = torch.cat([ahead, own])  # the keys seen ahead, then the siblings' own
                merged = _PrefixPlusOwnAttention.apply(
                    q.index_select(2, own).contiguous(), k.index_select(2, span), v.index_select(2, span),
                    (len(seen), [tree.lengths[c] for c in kids], scale))
                out = out.index_copy(2, own, merged)
            offset += tree.total_len
        return out
