"""Scorers: what turns a micro-batch into the per-token log-probs the loss, the KL reference and the old policy
use. The recipe holds one, built once, and asks it for scores; how they are made (the grouped or repeated layout,
the sequence-parallel forward, prefix trees) is the scorer's business.

    scorer(model, inputs, completion_ids, completion_mask, group_sizes, temperature=..., vision_calls=...,
           return_entropy=...) -> scores with .logprobs [n, L], .entropy, .layout (packed_tokens, repeated_tokens)

- ``GroupScorer``: one prompt per group and G completions (``app.grouping.completion_logprobs``), as
  ``forward.*`` configures it (grouping, backend, log-prob chunk size, sequence parallelism);
- ``TreeScorer``: groups that are prefix trees (multi-turn rollouts with tools; ``inputs["trees"]``), all of a
  micro-batch's trees in one packed row (``app.grouping.tree.forest_logprobs``; tree attention ``masked``, or
  ``split`` when ``forward.attention_backend=split``); ``forward.grouping=repeated`` runs each root-to-leaf path as
  its own row instead.
"""

from __future__ import annotations

from app.grouping import completion_logprobs
from app.grouping.tree import forest_logprobs


class GroupScorer:
    def __init__(self, forward_cfg, sequence_parallel=None):
        self.cfg, self.sp = forward_cfg, sequence_parallel

    def __call__(self, model, inputs, completion_ids, completion_mask, group_sizes, **kwargs):
        f = self.cfg
        return completion_logprobs(model, inputs, completion_ids, completion_mask, group_sizes, mode=f.grouping,
                                   backend=f.backend, chunk_size=f.logprob_chunk_size, sequence_parallel=self.sp,
                                   **kwargs)


class TreeScorer:
    def __init__(self, forward_cfg):
        self.cfg = forward_cfg

    def __call__(self, model, inputs, completion_ids, completion_mask, group_sizes, *, temperature: float = 1.0,
                 vision_calls=None, return_entropy: bool = False):
        mode = "tree" if self.cfg.grouping == "grouped" else "paths"
        backend = "split" if self.cfg.attention_backend == "split" else "masked"  # split: no [T, T] mask (CPU)
        return forest_logprobs(model, inputs["trees"], mode, temperature=temperature,
                               chunk_size=self.cfg.logprob_chunk_size, return_entropy=return_entropy,
                               vision_calls=vision_calls, backend=backend)
