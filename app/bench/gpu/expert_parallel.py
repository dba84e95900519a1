"""Expert parallelism on a host with 2 or more GPUs: Qwen3-VL-30B-A3B at its full width, 2 decoder layers (both
sparse: 128 experts, 8 per token), bfloat16, ZeRO-3 alone against EP = the GPUs on the host, NCCL.

    python -m app.bench.gpu.expert_parallel --out outputs/gpu/gpu_ep [--quick]     (scripts/gpu_check.sh part ep)

Each variant is one torchrun launch over every GPU of the host (``app.bench.parallel.worker``, each rank its own
prompts: 2 text prompts of 4,096 tokens, G = 8 completions of 256): a training step's time (grouped forward with
the routers' statistics, backward, AdamW step), a rollout's (the full gather, 8 samples of 64 tokens a prompt), the
bytes each kind of collective brought to a rank (ZeRO-3's gathers and reduce-scatters, EP's all-to-all), and the
allocator's peak above the step's start. What the planner guesses for EP (the link's efficiency, a collective's
latency, the eager decode under EP: docs/scaling.md) waits for these figures. On a host with one GPU it writes a row
saying so and runs nothing. ``--quick`` runs ``scripts/bench.sh ep --quick`` (2 processes on this CPU, toy sizes).
"""

from __future__ import annotations

from pathlib import Path

import torch

from app.bench.common import cli, exit_if_failed, write_report

PRESET, LAYERS = "qwen3_vl_30b_a3b", 2
WORKLOAD = {"prompt": 4096, "group": 8, "completion": 256, "new_tokens": 64, "steps": 3, "dtype": "bfloat16"}
TITLE = ("Expert parallelism against ZeRO-3 alone on {gpus} GPUs (NCCL): Qwen3-VL-30B-A3B width, 2 sparse layers "
         "(128 experts, 8 per token), bfloat16; 2 prompts of {prompt} tokens a rank, G={group} completions of "
         "{completion}; a rollout of {group} samples x {new_tokens} tokens per prompt")


def run(out: Path, quick: bool = False) -> dict:
    from app.bench.parallel import experts

    if quick:
        return experts.run(out, quick=True, name="gpu_ep")
    gpus = torch.cuda.device_count()
    if gpus < 2:
        payload = {"skipped": f"expert parallelism needs 2 or more GPUs; this host has {gpus}"}
        write_report(out, "gpu_ep", payload, f"## expert parallelism\n\n{payload['skipped']}: nothing was run.")
        return payload
    from app.planning.shapes import build_real_width_checkpoint

    path = build_real_width_checkpoint(out / "checkpoint" / PRESET, PRESET, layers=LAYERS, vision_layers=1,
                                       dtype=torch.bfloat16, device="cuda")
    work = {**WORKLOAD, "gpus": gpus}
    rows = experts.compare("qwen3_vl_moe", path, out, work, ("zero3", f"ep{gpus}"), processes=gpus)
    payload = {"workload": work, "rows": rows}
    write_report(out, "gpu_ep", payload, experts.table(rows, work, TITLE))
    exit_if_failed(sum("error" in r for r in rows), len(rows), out)
    return payload


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/gpu/gpu_ep", argv)


if __name__ == "__main__":
    main()
