"""Run under torchrun: one variant of the expert-parallel benchmark (``app.bench.parallel.experts``) on a MoE
checkpoint, every rank its own prompts (so the ranks route differently), and rank r's measurements to
OUT/rank{r}.json.

    python -m torch.distributed.run --nproc_per_node 2 -m app.bench.parallel.worker CHECKPOINT VARIANT OUT JSON

VARIANT: ``zero3`` (ZeRO-3 alone: transformers' sparse blocks, every rank gathering all E experts of a layer),
``autoep1`` (AutoEP's layer at EP = 1: every rank holds all experts, no all-to-all: the layer's own cost) or ``epN``
(EP = N: each rank holds E / N, tokens sent to their experts' ranks). JSON: the workload ({"prompt", "group",
"completion", "new_tokens", "steps", and "dtype": float32 or bfloat16}); on CUDA each rank uses its GPU (NCCL).

Measured: a training step (the grouped forward with the routers' statistics, backward, optimizer step: the median
of ``steps`` after one warm-up), a rollout (``generate_groups`` under the full gather, greedy to a fixed length),
the bytes each kind of collective brought to this rank in one step and one rollout (DeepSpeed's communication
backend wrapped: ZeRO-3's gathers and reduce-scatters, the all-to-alls, all-reduces and broadcasts), and the heap's
peak above the step's start (``app.runtime.heap.HeapPeak``).
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import app  # noqa: F401


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    return sum(t.nbytes for t in value) if isinstance(value, (list, tuple)) else 0


# DeepSpeed's backend method -> (its arguments in order, its kind, the bytes it brings to this rank from the others:
# the arguments by name, n the group's size, me this rank's place in it). DeepSpeed wraps these methods with
# (*args, **kwargs), so their names are written out here, as ``deepspeed/comm/torch.py`` declares them.
MOVED = {
    "all_gather_into_tensor": (("output_tensor", "input_tensor", "group"), "gather",
                               lambda a, n, me: _nbytes(a["output_tensor"]) - _nbytes(a["input_tensor"])),
    "all_gather_base": (("output_tensor", "input_tensor", "group"), "gather",
                        lambda a, n, me: _nbytes(a["output_tensor"]) - _nbytes(a["input_tensor"])),
    "all_gather": (("tensor_list", "tensor", "group"), "gather",
                   lambda a, n, me: _nbytes(a["tensor_list"]) - _nbytes(a["tensor"])),
    "all_gather_coalesced": (("output_tensors", "input_tensors", "group"), "gather",
                             lambda a, n, me: _nbytes(a["output_tensors"]) - _nbytes(a["input_tensors"])),
    "reduce_scatter_tensor": (("output_tensor", "input_tensor", "op", "group"), "reduce_scatter",
                              lambda a, n, me: _nbytes(a["input_tensor"]) - _nbytes(a["output_tensor"])),
    "reduce_scatter": (("output", "input_list", "op", "group"), "reduce_scatter",
                       lambda a, n, me: _nbytes(a["input_list"]) - _nbytes(a["output"])),
    "all_to_all_single": (("output", "input", "output_split_sizes", "input_split_sizes", "group"), "all_to_all",
                          lambda a, n, me: _arrived(a["output"], a.get("output_split_sizes"), n, me)),
    "all_to_all": (("output_tensor_list", "input_tensor_list", "group"), "all_to_all",
                   lambda a, n, me: _nbytes(a["output_tensor_list"]) - _nbytes(a["output_tensor_list"][me])),
    "all_reduce": (("tensor", "op", "group"), "all_reduce",
                   lambda a, n, me: 2 * _nbytes(a["tensor"]) * (n - 1) / n),  # a ring
    "all_reduce_coalesced": (("tensors", "op", "group"), "all_reduce",
                             lambda a, n, me: 2 * _nbytes(a["tensors"]) * (n - 1) / n),
    "broadcast": (("tensor", "src", "group"), "broadcast",
                  lambda a, n, me: _nbytes(a["tensor"]) if me != a["src"] else 0),
}


def _arrived(output, splits, n: int, me: int) -> float:
    """An all-to-all's bytes from the other ranks: its output but this rank's own rows."""
    if not isinstance(output, torch.Tensor) or output.numel() == 0:
        return 0.0
    if splits:
        return float(sum(s for i, s in enumerate(splits) if i != me) * output.nbytes / output.shape[0])
    return output.nbytes * (n - 1) / n


class Traffic:
    """Bytes each kind of collective brings to this rank from the others, counted on DeepSpeed's communication
    backend (``deepspeed.comm.comm.cdb``, through which ZeRO-3 and AutoEP call every collective; ``MOVED``). The
    project's own few torch.distributed calls (step metrics, lock-step flags) do not go through it."""

    def __init__(self):
        import deepspeed.comm.comm as comm

        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        for name, (names, kind, moved) in MOVED.items():
            original = getattr(comm.cdb, name, None)
            if original is not None:
                setattr(comm.cdb, name, self._counting(original, names, kind, moved))

    def _counting(self, original, names, kind, moved):
        import torch.distributed as dist

        def call(*args, **kwargs):
            named = {**dict(zip(names, args)), **kwargs}
            group = named.get("group")
            self.bytes[kind] += float(moved(named, dist.get_world_size(group), dist.get_rank(group)))
            self.calls[kind] += 1
            return original(*args, **kwargs)

        return call

    def take(self) -> dict:
        out = {f"{k}_bytes": v for k, v in self.bytes.items()} | {f"{k}_calls": v for k, v in self.calls.items()}
        self.bytes.clear()
        self.calls.clear()
        return out


def main(checkpoint: str, variant: str, out: str, workload: str) -> None:
    from transformers import AutoConfig

    from app.grouping import completion_logprobs
    from app.rollout.generate import SamplingConfig, generate_groups
    from app.runtime import distributed, expert_parallel, zero
    from app.runtime.models import load_model

    work = json.loads(workload)
    dtype = work.get("dtype", "float32")
    rank, world = distributed.init_distributed()
    dev = distributed.local_device()
    ds = zero.load_deepspeed_config("deepspeed_configs/zero3.json", gradient_accumulation_steps=1, max_grad_norm=1.0,
                                    dtype=dtype)
    if variant != "zero3":
        size = 1 if variant == "autoep1" else int(variant.removeprefix("ep"))
        ds["expert_parallel"] = expert_parallel.section(AutoConfig.from_pretrained(checkpoint), size)
    keep = zero.hf_deepspeed_config(ds)  # noqa: F841 (held: transformers' ZeRO-3 load partitions while it lives)
    torch.manual_seed(0)
    model = load_model(checkpoint, dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    model.requires_grad_(True)
    engine = zero.build_engine(model, ds, torch.optim.AdamW(model.parameters(), lr=1e-5), None)
    traffic = Traffic()
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own prompts: they route differently
    ids = torch.randint(10, 30000, (2, work["prompt"]), generator=generator).to(dev)
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
    completions = torch.randint(10, 30000, (2 * work["group"], work["completion"]), generator=generator).to(dev)
    mask = torch.ones_like(completions)

    def step():
        engine.train()
        scores = completion_logprobs(engine, prompts, completions, mask, work["group"], router_statistics="loss")
        engine.backward(-scores.logprobs.sum() / mask.sum() + 1e-3 * scores.router.probability.pow(2).sum())
        engine.step()

    step()  # warm-up
    traffic.take()
    times, peaks = [], []
    for _ in range(work["steps"]):
        distributed.barrier()
        with peak_of(dev) as peak:
            start = time.perf_counter()
            step()
            synchronize(dev)
            times.append(time.perf_counter() - start)
        peaks.append(peak.above_bytes)
    step_traffic = {k: v / work["steps"] for k, v in traffic.take().items()}
    greedy = SamplingConfig(temperature=0, max_new_tokens=work["new_tokens"])

    def rollout():
        engine.eval()
        with zero.gathered_for_inference(engine, "full") as (module, collective):
            generate_groups(module, prompts, work["group"], greedy, eos_ids=[], pad_id=0, synced=collective)

    rollout()  # warm-up
    traffic.take()
    distributed.barrier()
    start = time.perf_counter()
    rollout()
    synchronize(dev)
    rollout_seconds = time.perf_counter() - start
    result = {"variant": variant, "world": world, "ep": expert_parallel.size_of(engine),
              "step_seconds": sorted(times)[len(times) // 2], "rollout_seconds": rollout_seconds,
              "step_peak_bytes": max(peaks), "max_rss_mb": _max_rss_mb(),
              "step": step_traffic, "rollout": traffic.take()}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    distributed.exit_worker()


def synchronize(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _CudaPeak:
    """The allocator's peak above its start on CUDA (``above_bytes``), as ``HeapPeak`` measures the heap on CPU."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.above_bytes = torch.cuda.max_memory_allocated() - self.start
        return False


def peak_of(dev):
    from app.runtime.heap import HeapPeak

    return _CudaPeak() if dev.type == "cuda" else HeapPeak()


def _max_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    main(*sys.argv[1:5])
