"""Multi-turn rollouts with tools, drawn as prefix trees: the model writes, stops at ``</tool_call>``, the tool runs,
its result (text, images, a video clip) is appended as the next turn, and the model continues, for at most
``max_turns`` model turns and ``max_total_tokens`` tokens after the prompt.

    rollout = tree_rollout(generate, prompts, contexts, tools=tools, encode=encode, limits=TurnLimits(branching=(4, 2)),
                           tokenizer=tokenizer)

``generate(prompts, group_size, seeds, max_new_tokens) -> Rollout`` is any engine's sampler (``RolloutEngine.
generate`` with ``STOP`` among its stop strings); each turn is one call whose prompts are [P; path so far], media
inside included (``EncodedPrompt``: the expanded inputs, and the unexpanded ids with their media for an engine with
its own processor), so vLLM gets a request per turn and its prefix cache reuses the earlier turns, and the grouped
engine prefills each path once per turn. ``branching[t]`` samples continue each open
node at turn t (1 past the list): the rollouts split at turn boundaries and siblings share their parent's tokens,
which the tree keeps once (``app.grouping.tree.layout``). A node is one model turn followed by its tool's observation
(``trained`` False there); sampled log-probs are kept for the model's tokens only. A call that cannot run becomes an
error observation (``app.rollout.tools``); nothing the model writes stops the run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from app.data.prompts import encode_observation
from app.data.records import EncodedPrompt
from app.grouping.positions import VISION_KEYS
from app.grouping.tree.layout import PrefixTree, TreeNode
from app.rollout.generate import derive_seed
from app.rollout.tools import RESPONSE_CLOSE, RESPONSE_OPEN, ToolContext, ToolResult, ToolStats, run_call

LEAF_REASONS = ("eos", "length", "answered", "max_turns", "budget")


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int = 3  # model turns per rollout
    max_total_tokens: int = 4096  # tokens after the prompt: model turns and observations
    max_new_tokens: int = 512  # per model turn
    branching: tuple[int, ...] = (1,)  # samples per open node at turn 0, 1, ...; the product is G

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_total_tokens < 1 or self.max_new_tokens < 1:
            raise ValueError("max_turns, max_total_tokens and max_new_tokens must be >= 1")
        if not self.branching or any(b < 1 for b in self.branching):
            raise ValueError(f"branching must list numbers >= 1, got {list(self.branching)}")
        if len(self.branching) > self.max_turns:
            raise ValueError(f"branching {list(self.branching)} splits at more turns than max_turns={self.max_turns}")

    @property
    def group_size(self) -> int:
        size = 1
        for b in self.branching:
            size *= b
        return size


@dataclass
class TreeRollout:
    trees: list[PrefixTree]
    sampled: list[list[torch.Tensor]]  # per tree, per node: the sampled log-prob of each model token, 0 elsewhere
    leaf_reasons: list[list[str]]  # per tree, per leaf (tree.paths order): why the rollout ended (LEAF_REASONS)
    calls: list[list[list[ToolResult]]]  # per tree, per leaf: the tool results along its path
    answers: list[list[str]]  # per tree, per leaf: its last model turn, special tokens left out (what rewards read)
    stats: ToolStats = field(default_factory=ToolStats)


def observation_encoder(processor) -> Callable[[list[dict]], tuple[dict, dict]]:
    """A tool result's content items -> (its tokens and media as a <tool_response> user turn, its engine view)."""

    def encode(content: list[dict]) -> tuple[dict, dict]:
        return encode_observation(processor, content, RESPONSE_OPEN, RESPONSE_CLOSE, with_media=True)

    return encode


def _path_view(prompt: EncodedPrompt, nodes: list[TreeNode], path: list[int]) -> dict | None:
    """[P; path] unexpanded, with its media in order (None when the prompt carries no engine view)."""
    if prompt.engine_view is None:
        return None
    ids, media = list(prompt.engine_view["prompt_ids"]), list(prompt.engine_view["media"])
    for n in path:
        ids += nodes[n].view["prompt_ids"]
        media += nodes[n].view["media"]
    return {"prompt_ids": ids, "media": media}


def _path_prompt(prompt: dict, nodes: list[TreeNode], path: list[int]) -> dict:
    """[P; path] as one unpadded prompt: ids, types and the vision inputs of P then of the path's nodes."""
    if not path:
        return dict(prompt)
    ids = torch.cat([prompt["input_ids"][0], *[nodes[n].input_ids.to(prompt["input_ids"].device) for n in path]])
    out = {"input_ids": ids[None], "attention_mask": torch.ones_like(ids)[None]}
    if prompt.get("mm_token_type_ids") is not None:
        types = [prompt["mm_token_type_ids"][0]] + [
            (nodes[n].mm_token_type_ids if nodes[n].mm_token_type_ids is not None
             else torch.zeros_like(nodes[n].input_ids)).to(ids.device) for n in path]
        out["mm_token_type_ids"] = torch.cat(types)[None]
    for key in VISION_KEYS:
        parts = ([prompt[key]] if prompt.get(key) is not None else []) + [
            nodes[n].vision[key].to(ids.device) for n in path if nodes[n].vision.get(key) is not None]
        if parts:
            out[key] = torch.cat(parts)
    return out


def _path_to(nodes: list[TreeNode], n: int) -> list[int]:
    path = []
    while n >= 0:
        path.append(n)
        n = nodes[n].parent
    return path[::-1]


def tree_rollout(generate: Callable, prompts: Sequence[EncodedPrompt], contexts: Sequence[ToolContext], *,
                 tools: dict, encode: Callable[[list[dict]], tuple[dict, dict]], limits: TurnLimits, tokenizer,
                 seeds: Sequence[int] | None = None, keep_pace: Callable[[bool], bool] | None = None) -> TreeRollout:
    """Sample a tree of rollouts for each prompt (``EncodedPrompt``: one unpadded prompt each). ``keep_pace(busy)``: whether
    any rank still samples this turn (ranks whose sampling is collective, ZeRO-3): a rank with nothing left joins
    with a throwaway one-token sample of its first prompt until none has."""
    seeds = list(seeds) if seeds is not None else list(range(len(prompts)))
    nodes: list[list[TreeNode]] = [[] for _ in prompts]
    sampled: list[list[torch.Tensor]] = [[] for _ in prompts]
    ended: list[dict[int, str]] = [{} for _ in prompts]  # node -> why its rollout ended there
    results: list[dict[int, ToolResult]] = [{} for _ in prompts]
    answers: list[dict[int, str]] = [{} for _ in prompts]
    stats = ToolStats()
    records = TreeRecords(len(prompts))  # routing replay: the experts each tree token went to (when recorded)
    frontier = [(t, -1) for t in range(len(prompts))]
    for turn in range(limits.max_turns):
        busy = keep_pace(bool(frontier)) if keep_pace is not None else bool(frontier)
        if not busy:
            break
        if not frontier:  # others still sample, collectively: join them and discard what comes back
            generate([prompts[0]], 1, [derive_seed(seeds[0], "idle", turn)], 1)
            continue
        width = limits.branching[turn] if turn < len(limits.branching) else 1
        paths = [_path_to(nodes[t], n) for t, n in frontier]
        used = [sum(int(nodes[t][m].input_ids.numel()) for m in path) for (t, _), path in zip(frontier, paths)]
        room = min(limits.max_new_tokens, limits.max_total_tokens - max(used))
        asked = [EncodedPrompt(prompts[t].record, _path_prompt(prompts[t].inputs, nodes[t], path),
                               _path_view(prompts[t], nodes[t], path)) for (t, _), path in zip(frontier, paths)]
        turn_seeds = [derive_seed(seeds[t], "turn", turn, n) for t, n in frontier]
        rollout = generate(asked, width, turn_seeds, max(1, room))
        records.prefilled(rollout.routing, frontier, paths, nodes, asked)
        opened = []
        for i, (t, parent) in enumerate(frontier):
            for j in range(width):
                k = i * width + j
                keep = rollout.completion_mask[k].bool()
                ids = rollout.completion_ids[k][keep].cpu()
                logprobs = rollout.logprobs[k][keep].float().cpu()
                text = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
                reason = rollout.stop_reasons[k]
                last_turn = turn + 1 == limits.max_turns
                result = run_call(text, tools, contexts[t]) if reason == "stop_string" and not last_turn else None
                node = TreeNode(parent, ids, torch.ones(len(ids), dtype=torch.bool), torch.zeros_like(ids),
                                view={"prompt_ids": ids.tolist(), "media": []},
                                routing=records.sampled(rollout.routing, k, keep))
                index = len(nodes[t])
                answers[t][index] = tokenizer.decode(ids.tolist(), skip_special_tokens=True)  # as rewards read
                if result is None:
                    called = reason == "stop_string" and last_turn and "<tool_call>" in text
                    ended[t][index] = "max_turns" if called else {"eos": "eos", "length": "length"}.get(reason,
                                                                                                       "answered")
                else:
                    stats.add(result)
                    observation, view = encode(result.content)
                    seen = observation["input_ids"][0].cpu()
                    if used[i] + len(ids) + len(seen) >= limits.max_total_tokens:
                        ended[t][index] = "budget"  # no room to show the result and answer after it
                    else:
                        types = observation.get("mm_token_type_ids", torch.zeros_like(observation["input_ids"]))
                        node = TreeNode(parent, torch.cat([ids, seen]),
                                        torch.cat([node.trained, torch.zeros(len(seen), dtype=torch.bool)]),
                                        torch.cat([node.mm_token_type_ids, types[0].cpu()]),
                                        {key: observation[key].cpu() for key in VISION_KEYS
                                         if observation.get(key) is not None},
                                        {"prompt_ids": ids.tolist() + list(view["prompt_ids"]),
                                         "media": list(view["media"])}, records.extended(node.routing, len(seen)))
                        logprobs = torch.cat([logprobs, torch.zeros(len(seen))])
                        results[t][index] = result
                        opened.append((t, index))
                nodes[t].append(node)
                sampled[t].append(logprobs)
        frontier = opened
    for t, n in frontier:  # open after the last turn (cannot happen: the last turn's calls end their rollouts)
        ended[t][n] = "max_turns"
    trees = [PrefixTree(prompts[t].inputs, nodes[t], records.prompts[t], records.layers) for t in range(len(prompts))]
    leaf_reasons = [[ended[t][leaf] for leaf in tree.leaves] for t, tree in enumerate(trees)]
    calls = [[[results[t][n] for n in path if n in results[t]] for path in tree.paths] for t, tree in enumerate(trees)]
    texts = [[answers[t][leaf] for leaf in tree.leaves] for t, tree in enumerate(trees)]
    return TreeRollout(trees, sampled, leaf_reasons, calls, texts, stats)


class TreeRecords:
    """Routing replay on trees (rollout.routing_replay=r3): each turn's rollout record (``Rollout.routing``) becomes
    the trees' (``PrefixTree.routing``, ``TreeNode.routing``). A model token's experts are those of the decode step
    that fed it; a token first computed in a prefill (the prompt, an observation, a turn's last token, fed in the
    next turn's prefill) keeps the first prefill's. Later turns prefill a path again; what they route there only
    fills what is still missing (a leaf's last token is never fed: no record, as in a plain rollout)."""

    def __init__(self, count: int):
        self.prompts: list[torch.Tensor | None] = [None] * count
        self.layers: tuple[int, ...] = ()

    def prefilled(self, routing, frontier, paths, nodes, asked) -> None:
        """After a turn's rollout: each asked [P; path]'s prompt record, cut into P's and each path node's."""
        if routing is None:
            return
        self.layers = tuple(routing.layers)
        for i, ((t, _), path) in enumerate(zip(frontier, paths)):
            length = int(asked[i].inputs["input_ids"].shape[1])
            record = routing.prompt[i, routing.prompt.shape[1] - length:].cpu()
            start = length - sum(int(nodes[t][m].input_ids.numel()) for m in path)
            self.prompts[t] = _filled(self.prompts[t], record[:start])
            for m in path:
                end = start + int(nodes[t][m].input_ids.numel())
                nodes[t][m].routing = _filled(nodes[t][m].routing, record[start:end])
                start = end

    @staticmethod
    def sampled(routing, row: int, keep: torch.Tensor) -> torch.Tensor | None:
        """A new node's model tokens: the experts of the decode steps that fed them."""
        return None if routing is None else routing.completion[row, : keep.shape[0]][keep.to(
            routing.completion.device)].cpu()

    @staticmethod
    def extended(record: torch.Tensor | None, count: int) -> torch.Tensor | None:
        """A node's record with ``count`` observation tokens after it (none yet: the next turn's prefill fills
        them)."""
        return None if record is None else torch.cat([record, record.new_full((count, *record.shape[1:]), -1)])


def _filled(record: torch.Tensor | None, fresh: torch.Tensor) -> torch.Tensor:
    """``record`` with its missing entries (-1) taken from ``fresh`` (or ``fresh`` where there is no record)."""
    return fresh.clone() if record is None else torch.where(record >= 0, record, fresh)


def answer_sampler(engine, cfg, processor, sampling) -> Callable:
    """``sample(prompts, samples, seeds) -> (texts, tool calls)``: each prompt's ``samples`` answers as a list, and
    each answer's tool calls in order (``call_summary``: error kind, what the observation says). One turn from ``engine`` when ``rollout.tools`` is empty; otherwise multi-turn
    rollouts with the configured tools and limits (``rollout.*``), all ``samples`` drawn at the first turn, the
    answer being the last model turn (what evaluation scores, as training's rewards do)."""
    import dataclasses
    from pathlib import Path

    from app.rollout.tools import STOP, ToolLimits, build_tools, context_for

    tokenizer = getattr(processor, "tokenizer", processor)
    r = cfg.rollout
    if not r.tools:
        def one_turn(prompts, samples, seeds):
            rollout = engine.generate(prompts, samples, seeds)
            texts = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                     for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]
            return [texts[b * samples:(b + 1) * samples] for b in range(len(prompts))], \
                [[[] for _ in range(samples)] for _ in prompts]

        return one_turn
    tools = build_tools(r.tools)
    limits_of_tools = ToolLimits(max_frames=r.tool_max_frames, min_pixels=cfg.data.min_pixels,
                                 max_pixels=r.tool_max_pixels, zoom_max_pixels=r.tool_zoom_max_pixels)
    turn = dataclasses.replace(sampling, stop_strings=(*sampling.stop_strings, STOP))

    def generate(asked, group_size, seeds, max_new_tokens):
        return engine.generate(asked, group_size, seeds, sampling=dataclasses.replace(turn, max_new_tokens=max_new_tokens))

    def with_tools(prompts, samples, seeds):
        limits = TurnLimits(max_turns=r.max_turns, max_total_tokens=r.max_total_tokens,
                            max_new_tokens=sampling.max_new_tokens, branching=(samples,))
        contexts = [context_for(p.record, Path(p.record.get("_root", ".")), limits_of_tools) for p in prompts]
        drawn = tree_rollout(generate, prompts, contexts, tools=tools, encode=observation_encoder(processor),
                             limits=limits, tokenizer=tokenizer, seeds=seeds)
        return drawn.answers, [[[call_summary(r) for r in path] for path in calls] for calls in drawn.calls]

    return with_tools


def call_summary(result) -> dict:
    """A tool call as evaluation records it: its error kind (None when it ran) and the observation's text (the
    tool's own line, e.g. the window it returned, or the error message)."""
    text = " ".join(item["text"] for item in result.content if item.get("type") == "text")
    return {"error": result.error, "observation": text}
