"""Tiny checkpoints through save_pretrained/from_pretrained, the self-check, and the errors bad input gets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.grouping import GroupingMismatchError, LayoutError, completion_logprobs, verify_grouping
from app.runtime.models import (
    FAMILIES,
    VL_FAMILIES,
    build_processor,
    build_tokenizer,
    load_model,
    load_processor,
    model_class,
    tiny_config,
)
from tests.helpers import load, max_rel_diff, prompt_batch, random_completions, tokenizer_of


def test_torchvision_fix_in_a_fresh_interpreter(monkeypatch):
    """The torchvision fix, and torch.compile's compile processes: one on a host of 4 cores or fewer, unless the user
    chose (app.compat)."""
    code = (
        "import os, sys, app, app.compat as c; import torchvision, qwen_vl_utils; import torch._inductor.config as i; "
        "from transformers import Qwen2ForCausalLM, Qwen2VLVideoProcessor; "
        "import app.runtime.zero as z; z._deepspeed(); import deepspeed.runtime.zero.muon.original_muon as m; "
        "print('torch._inductor.compile_fx' in sys.modules, hasattr(m.muon_update, '__wrapped__')); "
        "print(len(os.sched_getaffinity(0)), i.compile_threads); print(c.TORCHVISION_STATUS)"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_COMPILE_THREADS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    *_, muon, (cores, threads), status = [line.split() for line in result.stdout.strip().splitlines()]
    assert muon == ["False", "True"]  # DeepSpeed's Muon imported for its engines, inductor's compiler not yet
    assert status[0] in {"native", "schemas"}
    assert int(threads) == 1 if int(cores) <= 4 else int(threads) > 1
    from app import compat

    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
    compat.set_environment_defaults()
    assert os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "3"


def test_a_module_imported_without_compiling_compiles_each_function_at_its_first_call(tmp_path, monkeypatch):
    """app.compat.import_without_compiling: torch.compile, as a decorator with and without options, runs at the
    first call of each wrapped function, with its options, and torch.compile is torch's again afterwards."""
    import torch

    from app import compat

    compiled = []

    def recording_compile(model=None, **options):
        compiled.append((model.__name__, options))
        return lambda *args: ("compiled", model(*args))

    (tmp_path / "wrapped_at_import.py").write_text(
        "import torch\n@torch.compile\ndef double(x):\n    return 2 * x\n"
        "@torch.compile(dynamic=False)\ndef square(x):\n    return x * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch, "compile", recording_compile)
    assert compat.import_without_compiling("wrapped_at_import") and torch.compile is recording_compile
    import wrapped_at_import as module

    assert compiled == [] and module.double.__name__ == "double"
    assert module.double(3) == ("compiled", 6) and module.double(4) == ("compiled", 8)
    assert module.square(3) == ("compiled", 9)
    assert compiled == [("double", {}), ("square", {"dynamic": False})]  # each once, with its options
    assert not compat.import_without_compiling("wrapped_at_import")  # imported already: left alone
    monkeypatch.delitem(sys.modules, "wrapped_at_import")
    assert not compat.import_without_compiling("no_such_module_here")


@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_round_trip_runs_grouped(family, tmp_path, videos):
    tokenizer = build_tokenizer()
    config = tiny_config(family, tokenizer)
    torch.manual_seed(0)
    original = model_class(config).from_config(config)
    original.save_pretrained(tmp_path)
    build_processor(family, tokenizer).save_pretrained(tmp_path)

    loaded, processor = load_model(tmp_path), load_processor(tmp_path)
    assert type(loaded) is type(original)
    assert type(processor).__name__.endswith("Processor") == (family in VL_FAMILIES)
    held = loaded.state_dict()  # a PLE n-gram table is no parameter once loaded: it is read from the files, compared below
    assert {n for n in original.state_dict() if n not in held} == {n for n in original.state_dict()
                                                                   if ".ngram_embedding." in n}
    for name, b in held.items():
        assert torch.equal(original.state_dict()[name], b), name
    for ours, theirs in zip([m for m in loaded.modules() if hasattr(m, "ngram_embedding")],
                            [m for m in original.modules() if hasattr(m, "ngram_embedding")]):
        rows = torch.arange(theirs.ngram_embedding.num_embeddings)
        assert torch.equal(ours.ngram_embedding(rows), theirs.ngram_embedding(rows))

    prompts = prompt_batch(family, processor, videos, ["video", "text"])
    tok = tokenizer_of(processor)
    ids, mask = random_completions([4, 1, 7], len(tok), tok.pad_token_id)
    with torch.no_grad():
        grouped = completion_logprobs(loaded, prompts, ids, mask, [2, 1]).logprobs
        repeated = completion_logprobs(original, prompts, ids, mask, [2, 1], mode="repeated").logprobs
    assert max_rel_diff(grouped, repeated) <= 1e-5
    assert verify_grouping(loaded, prompts, ids, mask, [2, 1]).max_diff < 1e-4


def test_self_check_raises_on_a_broken_backend(tiny_checkpoints, videos, monkeypatch):
    import app.grouping.attention as attention_module

    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    prompts = prompt_batch("qwen2_5_vl", processor, videos, ["video", "video"])
    tok = tokenizer_of(processor)
    ids, mask = random_completions([5, 3, 6, 2], len(tok), tok.pad_token_id)
    monkeypatch.setitem(attention_module._BACKEND_FNS, "packed",
                        lambda plan, q, k, v, scale, dropout: attention_module._sdpa(q, k, v, is_causal=True))
    with pytest.raises(GroupingMismatchError, match=r"who sees whom: .*completion 1, token 0 .*completion\(s\) \[0\]"):
        verify_grouping(model, prompts, ids, mask, 2, backend="packed")  # every response sees its elder siblings
    real = attention_module._packed
    monkeypatch.setitem(attention_module._BACKEND_FNS, "packed",  # the right tokens seen, values off by 1%
                        lambda plan, q, k, v, scale, dropout: real(plan, q, k, v, scale, dropout) * 1.01)
    with pytest.raises(GroupingMismatchError, match="grouped and repeated log-probs differ"):
        verify_grouping(model, prompts, ids, mask, 2, backend="packed")


@pytest.fixture
def vl_case(tiny_checkpoints, videos):
    model, processor = load("qwen2_5_vl", tiny_checkpoints, sharpen=None)
    prompts = prompt_batch("qwen2_5_vl", processor, videos, ["video", "text"])
    tok = tokenizer_of(processor)
    ids, mask = random_completions([3, 2], len(tok), tok.pad_token_id)
    return model, prompts, ids, mask


def test_video_tokens_not_matching_features(vl_case):
    model, prompts, ids, mask = vl_case
    broken = dict(prompts, video_grid_thw=prompts["video_grid_thw"] * torch.tensor([[2, 1, 1]]))
    with pytest.raises(LayoutError, match="prompt 0 has .* video tokens but its video features give"):
        completion_logprobs(model, broken, ids, mask, 1, mode="repeated")


def test_rows_beyond_max_positions(vl_case):
    model, prompts, ids, mask = vl_case
    model.config.text_config.max_position_embeddings = 20
    with pytest.raises(LayoutError, match="group 0 reaches position .* max_position_embeddings=20"):
        completion_logprobs(model, prompts, ids, mask, 1)


def test_missing_mm_token_type_ids(vl_case):
    model, prompts, ids, mask = vl_case
    prompts = {k: v for k, v in prompts.items() if k != "mm_token_type_ids"}
    with pytest.raises(LayoutError, match="mm_token_type_ids"):
        completion_logprobs(model, prompts, ids, mask, 1)


def test_mismatched_completion_shapes(vl_case):
    model, prompts, ids, mask = vl_case
    with pytest.raises(LayoutError, match="completion_ids .* and completion_mask .* differ in shape"):
        completion_logprobs(model, prompts, ids, mask[:, :1], 1)


def test_unknown_mode(vl_case):
    model, prompts, ids, mask = vl_case
    with pytest.raises(ValueError, match="unknown grouping mode 'fast'"):
        completion_logprobs(model, prompts, ids, mask, 1, mode="fast")


def test_missing_checkpoint_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path / "nowhere")


def test_first_release_qwen2_5_vl_processor_config_loads(tmp_path, videos):
    """A first-release Qwen2.5-VL checkpoint: separate preprocessor_config.json naming "Qwen2_5_VLImageProcessor",
    which AutoProcessor refuses ("Unrecognized image processor"). load_processor maps it; the checkpoint's files
    are not touched; the processor encodes the same prompt as the current layout."""
    import json

    from app.data.prompts import encode_prompts
    from app.data.video import video_element
    from app.runtime.models import build_tiny_checkpoint, load_processor

    checkpoint = Path(build_tiny_checkpoint(tmp_path / "tiny", "qwen2_5_vl", seed=0))
    current = load_processor(checkpoint)
    config = json.loads((checkpoint / "processor_config.json").read_text())
    image = {**config.pop("image_processor"), "image_processor_type": "Qwen2_5_VLImageProcessor"}
    video = config.pop("video_processor")
    (checkpoint / "preprocessor_config.json").write_text(json.dumps(image))
    (checkpoint / "video_preprocessor_config.json").write_text(json.dumps(video))
    (checkpoint / "processor_config.json").write_text(json.dumps(config))
    from transformers import AutoProcessor

    with pytest.raises(ValueError, match="Unrecognized image processor"):
        AutoProcessor.from_pretrained(checkpoint)
    old = load_processor(checkpoint)
    assert type(old.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert "Qwen2_5_VLImageProcessor" in (checkpoint / "preprocessor_config.json").read_text()  # untouched
    conversation = [[{"role": "user", "content": [video_element(videos[0], fps=2, min_pixels=3136,
                                                                max_pixels=3136), {"type": "text", "text": "Hi"}]}]]
    a, b = encode_prompts(current, conversation), encode_prompts(old, conversation)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tool_tokens_make_qwens_call_tags_single_tokens_through_save_and_load(tmp_path):
    """``tool_tokens`` (the tool demo's checkpoint): <tool_call> and </tool_call> are one token each, as in Qwen's
    own tokenizer, and survive save_pretrained / from_pretrained; without it the toy tokenizer is unchanged."""
    from app.rollout.tools import parse_call
    from app.runtime.models import TOOL_TOKENS, build_tiny_checkpoint

    call = '<tool_call>{"name":"get_frames","arguments":{"start":3,"end":5}}</tool_call>'
    plain = build_tokenizer()
    assert len(plain(call)["input_ids"]) > 50 and not set(TOOL_TOKENS) & set(plain.get_vocab())
    build_tiny_checkpoint(tmp_path, "qwen2_5_vl", tool_tokens=True)
    tok = load_processor(tmp_path).tokenizer
    ids = tok(call)["input_ids"]
    assert len(ids) < 25 and ids[0] == tok.convert_tokens_to_ids("<tool_call>") != tok.unk_token_id
    assert ids[-1] == tok.convert_tokens_to_ids("</tool_call>")
    assert tok.decode(ids) == call and parse_call(tok.decode(ids)).arguments == {"start": 3, "end": 5}
    assert load_model(tmp_path).config.text_config.vocab_size == len(tok) == len(plain) + 2
