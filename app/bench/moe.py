"""Mixture-of-experts models grouped against repeated, beside the dense model of the same active width.

    python -m app.bench.moe --out docs/bench/moe [--quick]      (scripts/bench.sh moe)

``app.bench.hybrid``'s points at its reduced width (hidden 256, 4 decoder layers, 4 query / 2 KV heads of 64, a 32k
vocabulary; a text prompt of 2k or 8k tokens, G = 8 completions of 128, float32, each point in its own process):
Qwen3-VL-MoE with every layer sparse (16 experts, 4 per token, of 256) against Qwen3-VL with an MLP of 1,024, and
Qwen3.5-MoE (16 experts, 4 per token, of 192, plus a shared expert of 256) against Qwen3.5 with an MLP of 1,024:
the same FLOPs per token in the MLPs, the MoE models' routers and grouped_mm on top. Time, the allocator's peak above
the weights and gradient buffers, torch's flop counter. The 30B-A3B-width case is ``scripts/gpu_check.sh``'s ``moe``
part.
"""

from __future__ import annotations

from pathlib import Path

from app.bench.common import cli
from app.bench.hybrid import run as run_points

FAMILIES = ("qwen3_vl_moe", "qwen3_vl", "qwen3_5_moe", "qwen3_5")
TITLE = ("Mixture of experts against the dense model of the same active width, grouped vs repeated (hidden 256, "
         "4 layers, 16 experts of which 4 per token, float32, CPU; one measured forward+backward per point)")


def run(out: Path, quick: bool = False) -> dict:
    return run_points(out, quick, families=FAMILIES, name="moe", title=TITLE)


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/bench/moe", argv)


if __name__ == "__main__":
    main()
