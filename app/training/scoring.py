"""Scorers: what turns a micro-batch into the per-token log-probs the loss, the KL reference and the old policy
use. The recipe holds one, built once, and asks it for scores; how they are made (the grouped or repeated layout,
the sequence-parallel forward, prefix trees) is the scorer's business.

    scorer(model, inputs, completion_ids, completion_mask, group_sizes, temperature=..., vision_calls=...,
           return_entropy=..., families=...) -> scores with .logprobs [n, L], .entropy, .layout (packed_tokens,
           repeated_tokens)

- ``GroupScorer``: one prompt per group and G completions (``app.grouping.completion_logprobs``), as
  ``forward.*`` configures it (grouping, backend, log-prob chunk size, sequence parallelism); ``families``: runs
  of consecutive groups whose prompts share a video (``data.questions_per_video``), packed with it once;
- ``TreeScorer``: groups that are prefix trees (multi-turn rollouts with tools; ``inputs["trees"]``), all of a
  micro-batch's trees in one packed row (``app.grouping.tree.layout.forest_logprobs``; tree attention ``masked``, or
  ``split`` when ``forward.attention_backend=split``); ``forward.grouping=repeated`` runs each root-to-leaf path as
  its own row instead;
- ``without_grad(scorer, model, ...)``: any scorer's log-probs for the reference and the old policy (no gradient,
  the ZeRO-3 gather, the adapters-off reference);
- ``kl_reference``: what reference log-probs come from (nothing, the policy adapters-off, a frozen model), and
  ``reference_replays``: whether the reference forward replays the rollout's routing (r3).
"""

from __future__ import annotations

import logging

import torch

from app.grouping import completion_logprobs
from app.grouping.experts.blocks import expert_shape
from app.grouping.tree.forward import forest_logprobs
from app.grouping.vision.cache import attach as attach_vision_cache
from app.runtime import lora, zero
from app.runtime.models import load_model

log = logging.getLogger("app.training.scoring")


class GroupScorer:
    def __init__(self, forward_cfg, sequence_parallel=None):
        self.cfg, self.sp = forward_cfg, sequence_parallel

    def __call__(self, model, inputs, completion_ids, completion_mask, group_sizes, *, families=None, **kwargs):
        f = self.cfg
        return completion_logprobs(model, inputs, completion_ids, completion_mask, group_sizes, mode=f.grouping,
                                   backend=f.backend, chunk_size=f.logprob_chunk_size, sequence_parallel=self.sp,
                                   families=families, **kwargs)


def tree_backend(attention_backend: str) -> str:
    """The prefix-tree attention for ``forward.attention_backend``: split (CPU) and flex build no [T, T] mask;
    anything else (auto included) is the dense tree mask, ``masked``."""
    return attention_backend if attention_backend in ("split", "flex") else "masked"


class TreeScorer:
    def __init__(self, forward_cfg):
        self.cfg = forward_cfg

    def __call__(self, model, inputs, completion_ids, completion_mask, group_sizes, *, temperature: float = 1.0,
                 vision_calls=None, return_entropy: bool = False, families=None,
                 router_statistics: str = "off"):  # a tree shares within itself; no router sums (RouterTerm says so)
        mode = "tree" if self.cfg.grouping == "grouped" else "paths"
        backend = tree_backend(self.cfg.attention_backend)
        trees = inputs["trees"]
        return forest_logprobs(model, trees, mode, temperature=temperature,
                               chunk_size=self.cfg.logprob_chunk_size, return_entropy=return_entropy,
                               vision_calls=vision_calls, backend=backend,
                               replay=any(t.routing is not None for t in trees))  # rollout.routing_replay=r3


@torch.no_grad()
def without_grad(scorer, model, inputs, completion_ids, completion_mask, group_sizes, *, gather: str = "full",
                 vision_calls=None, temperature: float = 1.0, families=None, **routing) -> torch.Tensor:
    """``scorer``'s log-probs under ``model`` without gradient, in eval mode, its parameters gathered for inference
    as ``gather`` (``rollout.zero3_gather``) says; ``model`` may be ``lora.AdaptersOff`` (the policy with its
    adapters off: the reference under LoRA). ``vision_calls`` are passed only where DeepSpeed's hooks stay on
    (per_step), where every rank's tower calls must agree; ``routing``: a rollout's record to replay."""
    model, adapters_off = lora.resolve(model)
    hooked = gather == "per_step" and zero.forwards_are_collective(model)
    with (zero.gathered_for_inference(model, gather) as (module, _),
          lora.adapters_disabled(module, adapters_off)):
        was_training = module.training
        module.eval()
        scores = scorer(module, inputs, completion_ids, completion_mask, group_sizes, temperature=temperature,
                        vision_calls=vision_calls if hooked else None, families=families, **routing)
        module.train(was_training)
    return scores.logprobs


def kl_reference(cfg, engine, ds_config: dict, device, dtype, vision_cache=None):
    """What reference log-probs come from, decided here only: nothing (beta 0), the policy with its adapters off
    (LoRA: the base weights are the policy's own, frozen), or a frozen model (partitioned like the policy under
    ZeRO-3). The trainer passes the result wherever a model goes (``lora.resolve`` tells them apart). A frozen
    reference loaded from the policy's own checkpoint shares the policy's ``vision_cache``: its tower weights are the
    policy's frozen ones, so what the cache holds is what its tower would compute."""
    if cfg.grpo.beta == 0:
        return None
    if cfg.lora.rank:
        return lora.AdaptersOff(engine)
    path = cfg.model.reference_path or cfg.model.path
    reference = load_model(path, dtype=dtype, attn_implementation=cfg.model.vision_attention,
                           trust_remote_code=cfg.model.trust_remote_code)
    reference = zero.build_reference(reference, ds_config, device)
    if vision_cache is not None and vision_cache.plan != "count" and path == cfg.model.path:
        attach_vision_cache(reference, vision_cache)
    return reference


def reference_replays(reference, replayed, path: str) -> bool:
    """Whether the reference forward replays the rollout's routing (r3): the policy with its adapters off, or a
    separate model of the policy's expert shape (the preflight refused any other MoE shape). A dense reference runs
    without replay, said once here."""
    if replayed is None or reference is None:
        return False
    shape = expert_shape(lora.resolve(reference)[0])
    if shape is None:
        log.info("rollout.routing_replay=r3: the reference model %s is dense, so its log-probs are computed without "
                 "replay (the policy's forwards replay the rollout's experts)", path)
    return shape is not None
