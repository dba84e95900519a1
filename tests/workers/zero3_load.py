"""Run as one process: load MoE checkpoints under transformers' DeepSpeed ZeRO-3 integration, with and without
the project's workaround (``app.runtime.expert_layouts``), and compare each gathered state dict with a plain load, and
what a vLLM weight push sends (each tensor gathered alone, the experts in the released layout) with the same cut of
the plain load.
Prints one JSON line: per checkpoint, whether the plain transformers load failed (and how) and whether ours equals
the unpartitioned weights."""

from __future__ import annotations

import json
import sys

import torch

import app  # noqa: F401
from app.rollout.vllm_moe import released
from app.rollout.vllm_weights import policy_weights
from app.runtime import distributed, zero
from app.runtime.models import load_model, model_class


def main(paths: list[str]) -> None:
    distributed.init_distributed()
    plain = {path: {k: v.clone() for k, v in load_model(path).state_dict().items()} for path in paths}
    ds_config = zero.load_deepspeed_config("deepspeed_configs/zero3.json", gradient_accumulation_steps=1,
                                           max_grad_norm=1.0, dtype="float32")
    keep = zero.hf_deepspeed_config(ds_config)
    out = {}
    import deepspeed
    from transformers import AutoConfig

    for path in paths:
        entry = {}
        try:  # transformers alone
            bare = model_class(AutoConfig.from_pretrained(path)).from_pretrained(path)
            entry["transformers_alone"] = "loaded"
            del bare
        except Exception as error:  # noqa: BLE001 (the message is the finding)
            entry["transformers_alone"] = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
        model = load_model(path)
        entry["partitioned"] = all(getattr(p, "ds_numel", None) is not None for p in model.parameters())
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            state = model.state_dict()
            entry["equal"] = set(state) == set(plain[path]) and all(torch.equal(state[k], plain[path][k])
                                                                    for k in state)
        # what a vLLM push sends (rollout.engine=vllm): each partitioned tensor gathered alone, the experts cut
        # into the released layout; against the same cut of the unpartitioned weights
        family = model.config.model_type
        pushed = dict(released(policy_weights(model), family))
        want = dict(released(((k, v) for k, v in plain[path].items() if k in pushed or ".experts." in k), family))
        entry["pushed_equal"] = set(pushed) == set(want) and all(torch.equal(pushed[k], want[k]) for k in want)
        entry["pushed_tensors"] = len(pushed)
        out[path] = entry
    del keep
    print(json.dumps(out))
    distributed.exit_worker()


if __name__ == "__main__":
    main(sys.argv[1:])
