"""Plan a run before launching it: memory per rank, FLOPs and time per step, and whether it fits.

    scripts/plan.sh CONFIG.yaml [section.key=value ...] [--nodes 1] [--gpus-per-node 8] [--gpu-memory-gib 80]
                    [--peak-tflops 989] [--bandwidth-tbs 3.35] [--calibration KEY=VALUE ...] [--videos N]
                    [--model PRESET|PRESET@LAYERS|DIR] [--frames N] [--out DIR]
                    [--host-cores N [--source-fps 30] [--video-size WxH] [--bitrate low|medium|high]]
                    [--measure-video FILE]

It reads the config the trainer reads (same keys, same errors) and the model's shape from ``model.path`` when that
is a checkpoint here, else from the preset its name matches (``configs/models``), or ``--model``. Nothing is
allocated at full size; the model of a run is ``app/planning/planner.py``, its formulas ``app/planning/costs.py``, and what was
checked against measurement is in docs/planner.md. It prints a table and writes ``plan.json`` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from app.config.loading import ConfigError, load_config
from app.planning import shapes
from app.planning.costs import GiB
from app.planning.planner import PlanError, World, model_of, model_source, plan, sequence_parallel_sizes
from app.planning.remedies import SEARCH_LIMIT, expert_parallel_options, largest_frames, remedies


def calibration_of(pairs: list[str]):
    """--calibration KEY=VALUE ... -> a Calibration (an unknown key or a bad value named)."""
    from app.planning.timing import calibration_from

    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            values[key] = float(value) if sep else None
        except ValueError:
            values[key] = None
        if values[key] is None:
            raise PlanError(f"--calibration {pair!r}: expected KEY=NUMBER")
    try:
        return calibration_from(values)
    except ValueError as error:
        raise PlanError(f"--calibration: {error}") from None


def video_size_of(text: str) -> tuple[int, int] | None:
    """--video-size WxH -> (width, height); "" -> None."""
    if not text:
        return None
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or not int(width) or not int(height):
        raise PlanError(f"--video-size {text!r}: expected WIDTHxHEIGHT, e.g. 1280x720")
    return int(width), int(height)


def host_of(args, cfg):
    """(cores per node, source, rates) for the data phase, or None when neither --host-cores nor --measure-video."""
    from app.planning import host

    if not args.host_cores and not args.measure_video:
        return None
    if args.host_cores < 0:
        raise PlanError(f"--host-cores must be > 0, got {args.host_cores}")
    size = video_size_of(args.video_size) or (1280, 720)
    source = host.Source(fps=args.source_fps, width=size[0], height=size[1], bitrate=args.bitrate,
                         keyframe_interval=args.keyframe_interval)
    try:
        source.check()
    except ValueError as error:
        raise PlanError(f"--source-fps / --video-size / --bitrate / --keyframe-interval: {error}") from None
    rates = host.MEASURED
    if args.measure_video:
        if not Path(args.measure_video).is_file():
            raise PlanError(f"--measure-video {args.measure_video}: no such file")
        try:
            rates = host.measure_video(args.measure_video, cfg.data.fps, cfg.data.max_pixels, cfg.data.min_pixels)
        except Exception as error:  # decord's own error types
            raise PlanError(f"--measure-video {args.measure_video}: could not be decoded ({error})") from None
    return (args.host_cores or float(os.cpu_count() or 1)), source, rates


def _gib(value: float) -> str:
    return f"{value / GiB:8.2f}"


def expert_lines(result: dict, options: list[dict]) -> list[str]:
    """A mixture-of-experts plan: what ZeRO-3 gathers of a sparse layer's experts against what EP's all-to-all sends,
    the experts' traffic per step, the plan at each expert-parallel size the world allows, and a suggestion."""
    from app.planning.remedies import suggested_expert_parallel

    e = result["experts"]
    if not e:
        return []
    mib = 2**20
    lines = ["", f"mixture of experts at EP={e['ep']} (train.expert_parallel_size), per rank: one micro-batch's forward "
             f"gathers {e['layer_gather_bytes'] / mib:.1f} MiB of a sparse layer's experts (ZeRO-3; "
             f"{e['layer_gather_bytes_without_ep'] / mib:.1f} MiB without EP) and its all-to-all sends "
             f"{e['layer_exchange_bytes'] / mib:.1f} MiB; a step moves {e['gather_bytes'] / GiB:.2f} GiB of expert "
             f"gathers and {e['exchange_bytes'] / GiB:.2f} GiB of all-to-all in {int(e['collectives'])} collective calls"]
    if options:
        lines.append(f"    {'EP':<6}{'peak GiB':>10}{'step s':>10}{'rollout s':>11}{'gathers GiB':>13}{'all-to-all GiB':>16}")
        refused = [o for o in options if "refused" in o]
        for o in options:
            mark = " (this config)" if o["ep"] == e["ep"] else ""
            if "refused" in o:  # the config checks' own words, said once for the sizes they refuse alike
                if o is refused[0]:
                    sizes = ", ".join(str(r["ep"]) for r in refused)
                    lines.append(f"    EP={sizes}: not available here: {o['refused']}")
                continue
            lines.append(f"    {o['ep']:<6}{o['peak_gib']:>10.1f}{o['step_s']:>10.1f}{o['rollout_s']:>11.1f}"
                         f"{o['gather_gib']:>13.2f}{o['exchange_gib']:>16.2f}{'' if o['fits'] else '  does not fit'}{mark}")
        best = suggested_expert_parallel(options, e["ep"])
        if best is not None:
            lines.append(f"  suggested: train.expert_parallel_size={best['ep']} (step {best['step_s']:.1f} s, peak "
                         f"{best['peak_gib']:.1f} GiB)")
    return lines


def report(result: dict, frames_by_size: dict, fixes: list[dict], experts: list[dict] | None = None) -> str:
    """The plan as text: memory per rank by part, FLOPs and time per step grouped vs repeated, the verdict."""
    w, s, r, t = result["workload"], result["states"], result["rollout"], result["training"]
    zero = result["zero"]
    lines = [
        f"model {result['model']}: {result['parameters']['total'] / 1e9:.2f}B parameters, "
        f"{result['trainable'] / 1e9:.3f}B trainable; {result['ranks']} ranks "
        f"({result['world']['nodes']} x {result['world']['gpus_per_node']} GPUs of {result['world']['gpu_memory_gib']:g} "
        f"GiB), ZeRO stage {zero['stage']}{' + optimizer offload' if zero['offload_optimizer'] else ''}"
        f"{' + parameter offload' if zero['offload_param'] else ''}, S={result['sequence_parallel']}, "
        f"attention {result['attention']}",
        f"one prompt: {result['frames']} frames -> {w['visual']} visual tokens ({w['patches']} tower patches) + "
        f"{w['prefix'] - w['visual']} text = prefix {w['prefix']}; G={w['group_size']} x {w['completion']} "
        f"completion tokens; {w['groups']} group(s) per micro-batch",
    ]
    if w.get("questions", 1) > 1:  # data.questions_per_video
        lines.append(f"questions per video k={w['questions']}: each micro-batch's families hold the system prompt and "
                     f"the video ({w['prefix'] - w['question']} tokens) once for k questions of {w['question']} "
                     "tokens each; FLOPs below are per question")
    split = result.get("rollout_split")
    if split:  # rollout.sp_split=auto, priced both ways (the tower left out), as the trainer chooses each step
        lines.append(f"rollout over the S={result['sequence_parallel']} ranks: "
                     f"{'each family spread over them' if split['split'] == 'spread' else 'whole families per rank'}"
                     f" (the busiest rank's rollout {split['spread_s']:.2f} s spread, {split['families_s']:.2f} s "
                     "whole; rollout.sp_split forces either)")
    lines += ["", "memory per rank (GiB)", "  model states"]
    for key in ("weights", "gradients", "optimizer", "reference"):
        lines.append(f"    {key:<22}{_gib(s[key])}")
    if s["host"]:
        lines.append(f"    {'(host memory, offload)':<22}{_gib(s['host'])}")
    lines.append("  rollout (on top of the states)")
    lines += [f"    {key:<22}{_gib(value)}" for key, value in r.items() if key != "total"]
    lines.append("  training forward+backward (on top of the states)")
    lines += [f"    {key:<22}{_gib(value)}" for key, value in t.items() if key not in ("total", "saved", "whole_pass")]
    lines.append(f"    {'(saved tensors)':<22}{_gib(t['saved'])}")
    lines.append(f"    {'(pass with the tower)':<22}{_gib(t['whole_pass'])}  (the language model's and the tower's "
                 "peaks come at different times)")
    by_layout = result["activations_by_layout"]
    lines.append(f"    {'(activations by layout)':<22} grouped {by_layout['grouped'] / GiB:.2f}, repeated "
                 f"{by_layout['repeated'] / GiB:.2f} ({by_layout['grouped'] / by_layout['repeated']:.2f}x)")
    lines += [f"  peak {_gib(result['peak']).strip()} GiB of {_gib(result['usable']).strip()} usable "
              f"({result['world']['headroom']:.0%} of the GPU): {'FITS' if result['fits'] else 'DOES NOT FIT'}"]
    host = result["host"]
    lines += [f"host memory per node (GiB): {host['node'] / GiB:.1f} of {host['usable'] / GiB:.1f} usable "
              f"({result['world']['gpus_per_node']} ranks x {host['rank']['total'] / GiB:.2f}: pixels held for the step "
              f"and the prefetch {host['rank']['pixels'] / GiB:.2f}, decoding {host['rank']['decoding'] / GiB:.2f}, "
              f"offloaded states {host['rank']['offload'] / GiB:.2f}): "
              + ("fits" if host["fits"] else "DOES NOT FIT: the host is the limit (data.prefetch, "
                 "data.prefetch_workers, fewer ranks per node)"), ""]
    lines.append("FLOPs per group (one prompt, G completions): grouped against the repeated layout (TRL-style), under "
                 "masked SDPA (every tile) and under flash-attn (masked tiles skipped)")
    per = result["flops_per_group"]
    grouped = per["grouped"]
    lines.append(f"    {'phase':<18}{'grouped':>12}{'SDPA':>12}{'ratio':>8}{'flash-attn':>12}{'ratio':>8}")
    for phase in grouped:
        cells = "".join(f"{per[kernel][phase] / 1e12:10.1f}TF"
                        + (f"{grouped[phase] / per[kernel][phase]:8.3f}" if per[kernel][phase] else "       -")
                        for kernel in ("repeated", "repeated_flash"))
        lines.append(f"    {phase:<18}{grouped[phase] / 1e12:10.1f}TF{cells}")
    totals = {layout: sum(per[layout].values()) for layout in per}
    lines.append(f"    {'total':<18}{totals['grouped'] / 1e12:10.1f}TF"
                 + "".join(f"{totals[k] / 1e12:10.1f}TF{totals['grouped'] / totals[k]:8.3f}"
                           for k in ("repeated", "repeated_flash")))
    lines += [f"WARNING: {w}" for w in result.get("warnings", [])]
    lines += ["", *time_table(result)]
    lines += expert_lines(result, experts or [])
    if result.get("data"):
        from app.planning.host import lines as host_lines

        lines += host_lines(result["data"])
    lines += ["", *disk_lines(result["disk"])]
    lines += ["", "largest video that fits (frames at data.max_pixels), by sequence-parallel size S:"]
    lines.append("    " + ", ".join(f"S={size}: {frames if frames else 'none'}{'+ (the search stops there)' if frames >= SEARCH_LIMIT else ''}"
                                  for size, frames in frames_by_size.items()))
    if not result["fits"]:
        lines += ["", "to fit, change (each on top of the ones above it):"]
        lines += [f"    {fix['change']:<58} not available here: {fix['refused']}" if "refused" in fix else
                  f"    {fix['change']:<58} peak {fix['peak_gib']:.1f} GiB{'  <- fits' if fix['fits'] else ''}"
                  f"{'' if fix.get('kept', True) else '  (not enough: not kept below)'}"
                  for fix in fixes] or ["    nothing in the list fits; use more GPUs or fewer frames"]
        if not any(fix.get("fits") for fix in fixes):
            lines.append("    nothing in the list fits; use more GPUs or fewer frames")
    return "\n".join(lines)


BOUNDS = {"tower": "FLOPs + attention calls", "prefill": "FLOPs", "decode": "bandwidth + launches",
          "rollout_overhead": "fixed", "reference": "FLOPs", "old_policy": "FLOPs", "router_counts": "FLOPs",
          "update": "FLOPs + per layer",
          "weight_sync": "tensors + bandwidth", "rollout": "", "step": ""}


def time_table(result: dict) -> list[str]:
    """Seconds per phase on one rank, this layout against the TRL-style one ([P;Ri] rows, HF generate) under masked
    SDPA and under flash-attn, the time per question, and how far the planned step has been from measured steps
    on GPU points left out of the fit."""
    from app.planning.timing import leave_one_out_line

    w = result["world"]
    sec = result["phase_seconds"]["grouped"]
    sdpa, flash = result["phase_seconds"]["repeated"], result["phase_seconds"]["repeated_flash"]
    lines = [f"step time per rank, by phase (at {w['peak_tflops']:g} TFLOP/s and {w['bandwidth_tbs']:g} TB/s, the "
             "calibration's efficiencies: docs/planner.md); TRL-style = [P;Ri] rows and HF generate",
             f"    {'phase':<20}{'bound':<24}{'this config':>12}{'TRL, SDPA':>12}{'TRL, flash':>12}"]
    for phase in (*("tower", "prefill", "decode", "rollout_overhead"), "rollout", "reference", "old_policy",
                  "router_counts", "update", "weight_sync", "step"):
        if phase in ("rollout", "step") or sec[phase] or sdpa[phase] or flash[phase]:
            label = f"  {phase}" if phase in ("tower", "prefill", "decode", "rollout_overhead") else phase
            lines.append(f"    {label:<20}{BOUNDS[phase]:<24}{sec[phase]:>10.2f} s{sdpa[phase]:>10.2f} s"
                         f"{flash[phase]:>10.2f} s")
    prompts = result["prompts_per_rank"]
    lines.append(f"  per question ({prompts} per replica, k={result['questions']}): {sec['step'] / prompts:.2f} s "
                 f"(TRL-style with masked SDPA {sdpa['step'] / prompts:.2f} s: {sec['step'] / sdpa['step']:.2f}x; "
                 f"with flash-attn {flash['step'] / prompts:.2f} s: {sec['step'] / flash['step']:.2f}x)")
    lines.append(f"  {leave_one_out_line()}")
    return lines


def disk_lines(disk: dict) -> list[str]:
    """What a checkpoint and the export take on disk, beside the free space where they go."""
    gib = 2**30
    free = f"{disk['free'] / gib:.1f} GiB free there" if disk["free"] is not None else "its disk could not be read"
    verdict = "" if disk["free"] is None else ("  <- does not fit" if disk["need"] > disk["free"] else "  (fits)")
    return [f"disk: a checkpoint {disk['checkpoint'] / gib:.1f} GiB, the export {disk['export'] / gib:.1f} GiB; "
            f"train.output_dir {disk['output_dir']}: {disk['keep']} checkpoints kept + 1 being written + the export "
            f"= {disk['need'] / gib:.1f} GiB, {free}{verdict}"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="scripts/plan.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as the trainer takes them")
    defaults = World()
    parser.add_argument("--nodes", type=int, default=defaults.nodes)
    parser.add_argument("--gpus-per-node", type=int, default=defaults.gpus_per_node)
    parser.add_argument("--gpu-memory-gib", type=float, default=defaults.gpu_memory_gib)
    parser.add_argument("--peak-tflops", type=float, default=defaults.peak_tflops,
                        help="the device's dense bf16 peak (H100 SXM 989, H200 989, A100 312)")
    parser.add_argument("--bandwidth-tbs", type=float, default=defaults.bandwidth_tbs,
                        help="the device's memory bandwidth in TB/s (H100 SXM 3.35, H200 4.8, A100-80GB 2.0)")
    parser.add_argument("--link-tbs", type=float, default=defaults.link_tbs,
                        help="between GPUs in TB/s, per direction (ZeRO-3 gathers during a rollout)")
    parser.add_argument("--host-memory-gib", type=float, default=defaults.host_memory_gib,
                        help="CPU memory of one node in GiB (a DGX H100 / H200 has 2048)")
    parser.add_argument("--device", default=defaults.device, choices=("cuda", "cpu"),
                        help="plan a run on GPUs (the default) or on this machine's CPUs (a rehearsal)")
    parser.add_argument("--calibration", nargs="*", default=[], metavar="KEY=VALUE",
                        help="set step-time constants (app/planning/timing.py Calibration; each with its source in "
                             "docs/planner.md), e.g. train_efficiency=0.35 rollout_s=0.5")
    parser.add_argument("--no-varlen-kernel", action="store_true",
                        help="the GPUs' torch lacks torch.nn.attention.varlen (older than 2.10) or the card is older "
                             "than sm80: the tower's attention per frame or window, decode on the two-bmm path")
    parser.add_argument("--videos", type=int, default=0,
                        help="distinct videos among one replica's prompts of a step when fewer than its prompts "
                             "(data asking a video several questions at k = 1; default: one per family)")
    parser.add_argument("--headroom", type=float, default=defaults.headroom,
                        help="the share of GPU memory a plan may fill")
    parser.add_argument("--model", default="", help="a preset (configs/models) or checkpoint folder")
    parser.add_argument("--frames", type=int, default=0, help="plan this many frames (default data.max_frames)")
    parser.add_argument("--video-size", default="", metavar="WxH",
                        help="the source videos' frame size, e.g. 1280x720: the visual tokens qwen-vl-utils' resize "
                             "gives (default: frames that fill data.max_pixels, the most a frame can get)")
    parser.add_argument("--host-cores", type=float, default=0,
                        help="CPU cores of one node: adds the host's decoding and processing per step beside the GPU "
                             "phases (app/planning/host.py), with the prefetch's overlap")
    parser.add_argument("--source-fps", type=float, default=30.0, help="the source videos' frame rate (--host-cores)")
    parser.add_argument("--bitrate", default="low", choices=("low", "medium", "high"),
                        help="the source videos' bitrate class: low is the measured clip's (1.1 Mbit/s at 720p); "
                             "medium and high cost 1.5x and 2.5x to decode (a guess)")
    parser.add_argument("--keyframe-interval", type=int, default=250, help="frames between keyframes (x264: 250)")
    parser.add_argument("--measure-video", default="", metavar="FILE",
                        help="measure the host's decode and processing rates on this video here (at data.fps, "
                             "data.max_pixels) instead of the recorded ones; implies the data phase")
    parser.add_argument("--out", default="outputs/plan", help="where plan.json goes")
    args = parser.parse_intermixed_args(argv)
    start = time.perf_counter()
    try:
        cfg = load_config(args.config, args.overrides)
        world = World(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_memory_gib=args.gpu_memory_gib,
                      peak_tflops=args.peak_tflops, bandwidth_tbs=args.bandwidth_tbs, link_tbs=args.link_tbs,
                      host_memory_gib=args.host_memory_gib, device=args.device, headroom=args.headroom,
                      calibration=calibration_of(args.calibration), varlen=not args.no_varlen_kernel)
        if args.frames < 0:
            raise PlanError(f"--frames must be >= 0, got {args.frames}")
        source = model_source(cfg, args.model)
        result = plan(cfg, world, source, frames=args.frames or None, videos=args.videos or None,
                      video_size=video_size_of(args.video_size), data_host=host_of(args, cfg))
        sizes = sequence_parallel_sizes(model_of(source)[0], world.ranks)
        if cfg.train.expert_parallel_size > 1:  # expert parallelism runs without sequence parallelism
            sizes = [1]
        frames_by_size = {s: largest_frames(cfg, world, source, s) for s in sizes}
        fixes = [] if result["fits"] else remedies(cfg, world, source)
        experts = expert_parallel_options(cfg, world, source)
    except (ConfigError, PlanError, shapes.PresetError) as error:
        print(f"plan error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    text = report(result, frames_by_size, fixes, experts)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {**result, "largest_frames": frames_by_size, "remedies": fixes, "expert_parallel": experts,
               "config": args.config,
               "overrides": args.overrides, "planned_in_seconds": round(time.perf_counter() - start, 3)}
    (out / "plan.json").write_text(json.dumps(payload, indent=1, default=str))
    (out / "plan.txt").write_text(text + "\n")
    print(f"\nplanned in {payload['planned_in_seconds']:.1f} s; written: {out / 'plan.json'}, {out / 'plan.txt'}")


if __name__ == "__main__":
    main()
