"""One grouped decode step, eager against torch.compile: does compiling the decode step pay on this machine?

    python -m app.bench.decoding.decode_step --out outputs/bench/decode_step [--quick]
    scripts/bench.sh decode_step [...]

The rollout benchmark's checkpoint and text prompt (2,048 tokens; ``--quick``: 128), G samples decoding against
the one prefix (``GroupedDecoder``), 64 steps after 5 warm-up steps, median of 3. Variants, each in a fresh
process (compiled code does not leak between them):

- eager: as ``generate_groups`` runs it;
- compiled layers: every decoder layer ``torch.compile(dynamic=True)`` (the attention, which reads the grouped
  cache, included; the batch shrinks as samples finish and the own keys grow every step, hence dynamic);
- compiled MLP + norms: only the layers' MLPs and RMSNorms (the parts with no cache in them).

Reported: ms per step, the ratio to eager, the seconds the first 5 steps took (compilation), and the largest
difference of the step's logits from eager's. Decide from the table whether ``torch.compile`` belongs in the
rollout; the README quotes the result.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from app.bench.common import cli, device, isolated, markdown_table, write_report

VARIANTS = ("eager", "compiled layers", "compiled MLP + norms")


def measure(variant: str, checkpoint: str, root: str, group: int, prompt: int, steps: int) -> dict:
    from app.bench.decoding.rollout import prompt_inputs
    from app.grouping import GroupedDecoder
    from app.grouping.modules import unwrap
    from app.runtime.models import load_model, load_processor

    model = load_model(checkpoint).to(device()).eval()
    processor = load_processor(checkpoint)
    prompts = {k: v.to(device()) for k, v in prompt_inputs(processor, Path(root), {"kind": "text", "prompt": prompt,
                                                                                   "group": group}).items()}
    layers = unwrap(model).model.language_model.layers
    if variant == "compiled layers":
        for i in range(len(layers)):
            layers[i] = torch.compile(layers[i], dynamic=True)
    elif variant == "compiled MLP + norms":
        for layer in layers:
            layer.mlp = torch.compile(layer.mlp, dynamic=True)
            layer.input_layernorm = torch.compile(layer.input_layernorm, dynamic=True)
            layer.post_attention_layernorm = torch.compile(layer.post_attention_layernorm, dynamic=True)
    tokens = torch.full((group,), 100, dtype=torch.long, device=device())
    with torch.no_grad():
        decoder = GroupedDecoder(model, prompts, [group], 5 + 3 * steps + 1)
        start = time.perf_counter()
        for _ in range(5):
            logits = decoder.step(tokens)
        first = time.perf_counter() - start
        per_step = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(steps):
                decoder.step(tokens)
            if device().type == "cuda":
                torch.cuda.synchronize()
            per_step.append((time.perf_counter() - start) / steps * 1e3)
        decoder.close()
    return {"ms_per_step": statistics.median(per_step), "first_5_steps_s": first,
            "logits_after_5": logits[:, :4096].float().cpu().tolist()}


def run(out: Path, quick: bool = False) -> dict:
    from app.bench.decoding.rollout import prepare

    checkpoint = prepare(out, quick=True)  # the checkpoint only; the text prompt needs no clip
    prompt, steps = (128, 8) if quick else (2048, 64)
    rows = []
    for group in ((4,) if quick else (8, 16)):
        results = {v: isolated("app.bench.decoding.decode_step:measure", variant=v, checkpoint=str(checkpoint),
                               root=str(out), group=group, prompt=prompt, steps=steps) for v in VARIANTS}
        eager = results["eager"]
        for variant, result in results.items():
            diff = (torch.tensor(result["logits_after_5"]) - torch.tensor(eager["logits_after_5"])).abs().max()
            rows.append({"G": group, "variant": variant, "ms_per_step": result["ms_per_step"],
                         "vs_eager": result["ms_per_step"] / eager["ms_per_step"],
                         "first_5_steps_s": result["first_5_steps_s"], "max_logit_diff": float(diff)})
    columns = ["G", "variant", "ms_per_step", "vs_eager", "first_5_steps_s", "max_logit_diff"]
    table = markdown_table(rows, columns, {"ms_per_step": ".2f", "vs_eager": ".2f", "first_5_steps_s": ".1f",
                                           "max_logit_diff": ".1e"})
    table = (f"## One grouped decode step on {device().type}: prompt {prompt} tokens, median of 3 x {steps} steps; "
             f"torch threads {torch.get_num_threads()}\n\n{table}")
    payload = {"rows": rows, "prompt_tokens": prompt, "steps": steps}
    write_report(out, "decode_step", payload, table)
    return payload


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/bench/decode_step", argv)


if __name__ == "__main__":
    main()
