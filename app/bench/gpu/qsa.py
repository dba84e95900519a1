"""Qwen3.8-Flash-Next on one GPU at its released width, 2 decoder layers (a GDN layer with PLE, a QSA layer; 512
experts top-10 and a shared expert in each), bfloat16:

    python -m app.bench.gpu.qsa --out outputs/gpu/gpu_qsa [--quick]      (scripts/gpu_check.sh part qsa)

- **train**: the grouped forward+backward against the repeated one at G = 8 on text prompts of 8k and 16k tokens
  (``app.bench.gpu.hybrid.train_rows``): time, the allocator's peak, the largest log-prob difference; the grouped
  row's QSA layers run torch's varlen kernel over each query's gathered keys (``sparse.layer.gathered_attention``)
  where it runs (bf16, sm80+), the repeated rows transformers' masked attention;
- **self_check**: the bf16 self-check on a 2k prompt with G = 8 completions of 64 (``verify_grouping``: QSA keys and
  PLE n-grams compared exactly, ties counted): whether it passed and how many QSA choices differed within a tie.

The PLE table is cut to a base of 100,003 rows a head (the released 20M would be 102 GB on the GPU here: the
trainer keeps it in host memory, ``runtime.zero.HostTable``, which a random model does not have); its lookups cost
the same. ``--quick`` runs the same code on this CPU at the reduced width of ``scripts/bench.sh qsa_grouping``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from app.bench.common import device, markdown_table, write_report
from app.bench.gpu.hybrid import train_rows
from app.bench.gpu.moe import self_check_row

PRESET, PREFIXES, GROUP, COMPLETION = "qwen3_8_flash_next", (8192, 16384), 8, 256


def model_at(quick: bool, dev, dtype):
    from app.planning import shapes

    if quick:
        from app.bench.hybrid import tiny_model

        return tiny_model("qwen4_exp").to(dev, dtype)
    config = shapes.hf_config(PRESET, layers=2, vision_layers=1)
    text = config.text_config
    text.layer_types, text.ple_layer_ids, text.ngram_vocab_size_base = ["linear_attention", "indexed_attention"], [1], \
        100_000
    config = type(config)(text_config=text.to_dict(), vision_config=config.vision_config.to_dict(),
                          image_token_id=config.image_token_id, video_token_id=config.video_token_id,
                          vision_start_token_id=config.vision_start_token_id,
                          vision_end_token_id=config.vision_end_token_id)
    torch.manual_seed(0)
    with torch.device(dev):
        return shapes.random_model(config, dtype)


def run(out: Path, quick: bool = False) -> dict:
    dev = device()
    dtype = torch.float32 if quick else torch.bfloat16
    payload: dict = {"preset": "tiny" if quick else PRESET, "layers": 2}
    model = model_at(quick, dev, dtype)
    payload["self_check"] = [self_check_row(model, dev, 256 if quick else 2048, 4 if quick else GROUP,
                                            16 if quick else 64)]
    write_report(out, "gpu_qsa", payload, table(payload), quiet=True)
    payload["train"] = train_rows(model, dev, (256,) if quick else PREFIXES, 4 if quick else GROUP,
                                  16 if quick else COMPLETION)
    write_report(out, "gpu_qsa", payload, table(payload))
    return payload


def table(payload: dict) -> str:
    parts = [f"## Qwen3.8-Flash-Next at {payload['preset']} width, {payload['layers']} layers (GDN + PLE, QSA)\n"]
    if payload.get("self_check"):
        parts.append("### the bf16 self-check\n\n" + markdown_table(
            payload["self_check"], ["prefix", "G", "completion", "dtype", "passed", "describe"]))
    if payload.get("train"):
        parts.append("### grouped vs repeated forward+backward\n\n" + markdown_table(
            payload["train"], ["prefix", "G", "completion", "seconds_grouped", "seconds_repeated", "peak_gib_grouped",
                               "peak_gib_repeated", "max_logprob_diff", "error_grouped", "error_repeated"],
            {"seconds_grouped": ".2f", "seconds_repeated": ".2f", "peak_gib_grouped": ".2f",
             "peak_gib_repeated": ".2f", "max_logprob_diff": ".3e"}))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    from app.bench.common import cli

    cli(run, __doc__, "outputs/gpu/gpu_qsa", argv)


if __name__ == "__main__":
    main()
