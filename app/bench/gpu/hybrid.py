"""Qwen3.5 on one GPU at the 9B width, 4 layers (3 Gated DeltaNet layers, 1 gated attention layer):

    python -m app.bench.gpu.hybrid --out outputs/gpu/gpu_hybrid [--quick]      (scripts/gpu_check.sh part qwen3_5)

- **kernels**: which GDN kernels ran (flash-linear-attention's varlen ones, or transformers' torch fallback) and
  fla's initial-state gradient against autograd through the torch path on one level of segments (the same inputs,
  float32: the largest relative difference of dh0 and of every input's gradient);
- **train**: the grouped forward+backward of the completion log-probs against the repeated one at G = 8 on a text
  prompt of 8k and 16k tokens, bfloat16: time (CUDA events), the allocator's peak, and the largest log-prob
  difference between the two;
- **decode**: the grouped engine's decode step (static shapes, eager) at an 8k prompt, G = 8: its time against the
  bytes it must read (the weights, the attention layer's K/V, and every sample's GDN states read and written) over
  the GPU's nominal bandwidth.

``--quick`` runs the same code on this CPU at a toy width (the kernels part then says fla does not run here).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from app.bench.common import device, markdown_table, write_report

PRESET, LAYERS, PREFIXES, GROUP, COMPLETION = "qwen3_5_9b", 4, (8192, 16384), 8, 256


def model_at(quick: bool, dev, dtype, preset: str = PRESET, tiny: str = "qwen3_5"):
    """``preset`` at full width and ``LAYERS`` layers on ``dev`` (random weights); ``quick``: the reduced-width
    ``tiny`` family of ``scripts/bench.sh hybrid``."""
    from app.planning import shapes

    if quick:
        from app.bench.hybrid import tiny_model

        return tiny_model(tiny).to(dev, dtype)
    config = shapes.hf_config(preset, layers=LAYERS, vision_layers=1)
    torch.manual_seed(0)
    with torch.device(dev):
        return shapes.random_model(config, dtype)


def kernels_check(dev) -> dict:
    """fla's chunked delta rule (varlen, per-sequence initial states) against the torch path's autograd."""
    from app.grouping.recurrent import kernels
    from app.grouping.recurrent.segments import Segments

    chosen = kernels.level_kernels(dev)
    row = {"kernels": chosen.name, "fla_available": kernels.fla_available()}
    if chosen.name != "fla":
        row["note"] = "flash-linear-attention does not run here: the torch fallback is what runs"
        return row
    segments = Segments((0, 300, 420, 700), (300, 120, 280, 64), (-1, 0, 0, 2), 764)
    level = segments.level_index(segments.levels[1], 4)
    generator = torch.Generator(device=dev).manual_seed(0)
    heads, dim, n = 8, 128, len(level.level)
    tokens = int(level.valid.sum())

    def inputs():
        q, k, v = (torch.randn(1, tokens, heads, dim, device=dev, generator=generator) for _ in range(3))
        g = -torch.rand(1, tokens, heads, device=dev, generator=generator)
        beta = torch.rand(1, tokens, heads, device=dev, generator=generator)
        state = torch.randn(n, heads, dim, dim, device=dev, generator=generator) * 0.1
        return [t.requires_grad_() for t in (q, k, v, g, beta, state)]

    fla_inputs = inputs()
    torch_inputs = [t.detach().clone().requires_grad_() for t in fla_inputs]
    out, final = chosen.rule(*fla_inputs[:3], g=fla_inputs[3], beta=fla_inputs[4], initial_state=fla_inputs[5],
                             index=level)
    weight = torch.randn_like(out)
    ((out * weight).sum() + final.square().sum()).backward()
    # the torch path on the same sequences one by one (its own chunking, float32)
    q, k, v, g, beta, state = torch_inputs
    bounds = level.cu_seqlens.tolist()
    outs, finals = [], []
    for i in range(n):
        part = slice(bounds[i], bounds[i + 1])
        o, f = kernels.torch_chunk_rule()(q[:, part], k[:, part], v[:, part], g=g[:, part], beta=beta[:, part],
                                          initial_state=state[i:i + 1], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
        outs.append(o)
        finals.append(f)
    ((torch.cat(outs, 1) * weight).sum() + torch.cat(finals).square().sum()).backward()

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    row.update(out=rel(out.detach(), torch.cat(outs, 1).detach()),
               dh0=rel(fla_inputs[5].grad, torch_inputs[5].grad),
               grads=max(rel(a.grad, b.grad) for a, b in zip(fla_inputs[:5], torch_inputs[:5])))
    return row


def timed(fn, dev) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def train_rows(model, dev, prefixes, group, completion) -> list[dict]:
    from app.bench.measure import allocator_peak
    from app.grouping import attention_restored, completion_logprobs

    rows = []
    generator = torch.Generator().manual_seed(0)
    for prefix in prefixes:
        ids = torch.randint(10, 30000, (1, prefix), generator=generator).to(dev)
        prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
        completions = torch.randint(10, 30000, (group, completion), generator=generator).to(dev)
        mask = torch.ones_like(completions)
        row = {"prefix": prefix, "G": group, "completion": completion}
        logprobs = {}
        for mode in ("grouped", "repeated"):
            def one(mode=mode, batch=(prompts, completions, mask), kept=logprobs):
                with attention_restored(model):
                    scores = completion_logprobs(model, *batch, group, mode=mode)
                    scores.logprobs.sum().backward()
                kept[mode] = scores.logprobs.detach().float()
            try:
                timed(one, dev)  # warm-up (kernels compiled, autotuned)
                model.zero_grad(set_to_none=True)
                box = {}
                seconds = timed(lambda: box.update(peak=allocator_peak(one)[1]), dev)  # noqa: B023
                row.update({f"seconds_{mode}": seconds, f"peak_gib_{mode}": box["peak"] / 2**30})
            except Exception as error:  # noqa: BLE001 - a row that says why (e.g. the repeated layout out of memory)
                row[f"error_{mode}"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            model.zero_grad(set_to_none=True)
        if len(logprobs) == 2:
            row["max_logprob_diff"] = float((logprobs["grouped"] - logprobs["repeated"]).abs().max())
        if "seconds_grouped" in row and "seconds_repeated" in row:
            row["time_ratio"] = row["seconds_grouped"] / row["seconds_repeated"]
        rows.append(row)
    return rows


def decode_row(model, dev, prefix: int, group: int, steps: int) -> dict:
    from app.bench.gpu.decode import nominal_bandwidth
    from app.grouping import GroupedDecoder

    ids = torch.randint(10, 30000, (1, prefix), generator=torch.Generator().manual_seed(1)).to(dev)
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
    with torch.no_grad():
        decoder = GroupedDecoder(model, prompts, [group], steps + 4, decode="static")
        tokens = torch.full((group,), 7, dtype=torch.long, device=dev)
        for _ in range(3):
            decoder.step(tokens)
        seconds = timed(lambda: [decoder.step(tokens) for _ in range(steps)], dev) / steps
        read = decoder.bytes_per_step
        decoder.close()
    row = {"prefix": prefix, "G": group, "step_ms": seconds * 1e3, "bytes_per_step": read,
           "state_bytes": decoder.state_bytes}
    bandwidth = nominal_bandwidth(torch.cuda.get_device_name(0)) if dev.type == "cuda" else None
    if bandwidth:
        row["limit_ms"] = read / bandwidth * 1e3
        row["vs_limit"] = row["step_ms"] / row["limit_ms"]
    return row


def run(out: Path, quick: bool = False) -> dict:
    dev = device()
    dtype = torch.float32 if quick else torch.bfloat16
    payload: dict = {"preset": "tiny" if quick else PRESET, "layers": LAYERS}
    payload["kernels"] = kernels_check(dev)
    write_report(out, "gpu_hybrid", payload, table(payload), quiet=True)
    model = model_at(quick, dev, dtype)
    payload["train"] = train_rows(model, dev, (256,) if quick else PREFIXES, 4 if quick else GROUP,
                                  16 if quick else COMPLETION)
    write_report(out, "gpu_hybrid", payload, table(payload), quiet=True)
    model.eval()
    payload["decode"] = [decode_row(model, dev, 256 if quick else 8192, 4 if quick else GROUP, 8 if quick else 64)]
    write_report(out, "gpu_hybrid", payload, table(payload))
    return payload


def table(payload: dict) -> str:
    parts = [f"## Qwen3.5 at {payload['preset']} width, {payload['layers']} layers (3 GDN + 1 attention)\n",
             "kernels: " + ", ".join(f"{k} {v}" for k, v in payload.get("kernels", {}).items())]
    if payload.get("train"):
        columns = ["prefix", "G", "completion", "seconds_grouped", "seconds_repeated", "time_ratio",
                   "peak_gib_grouped", "peak_gib_repeated", "max_logprob_diff"]
        parts.append("\n### grouped vs repeated forward+backward\n\n" + markdown_table(
            payload["train"], columns, {c: ".3f" for c in columns[3:]}))
    if payload.get("decode"):
        columns = ["prefix", "G", "step_ms", "limit_ms", "vs_limit", "bytes_per_step", "state_bytes"]
        parts.append("\n### decode step\n\n" + markdown_table(payload["decode"], columns,
                                                               {"step_ms": ".2f", "limit_ms": ".2f",
                                                                "vs_limit": ".2f", "bytes_per_step": ".3e",
                                                                "state_bytes": ".3e"}))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    from app.bench.common import cli

    cli(run, __doc__, "outputs/gpu/gpu_hybrid", argv)


if __name__ == "__main__":
    main()
