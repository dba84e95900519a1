"""Prompt templates: video_r1 reproduces Video-R1's prompt verbatim; prefix_grpo keeps this project's first one."""

from __future__ import annotations

from types import SimpleNamespace

from app.data.prompts import question_text
from app.data.records import build_conversation

VIDEO_R1_MC = (
    "What moves?Options:\nA. cat\nB. dog\n\nPlease think about this question as if you were a human pondering "
    "deeply. Engage in an internal dialogue using expressions such as 'let me think', 'wait', 'Hmm', 'oh, I see', "
    "'let's break it down', etc, or other natural language thought expressions It's encouraged to include "
    "self-reflection or verification in the reasoning process. Provide your detailed reasoning between the <think> "
    "</think> tags, and then give your final answer between the <answer> </answer> tags. Please provide only the "
    "single option letter (e.g., A, B, C, D, etc.) within the <answer> </answer> tags."
)


def record(**extra):
    return {"problem": "What moves?", "problem_type": "multiple choice", "options": ["A. cat", "B. dog"],
            "solution": "<answer>B</answer>", **extra}


def test_video_r1_question_is_verbatim():
    assert question_text(record(), "video_r1") == VIDEO_R1_MC


def test_prefix_grpo_template_is_kept():
    text = question_text(record(), "prefix_grpo")
    assert text.startswith("What moves?\nOptions:\nA. cat\nB. dog\nPlease think about this question")
    assert "internal dialogue" not in text


def test_system_message_follows_the_template_unless_set():
    def cfg(template, system):
        return SimpleNamespace(prompt_template=template, system_prompt=system, fps=2.0, max_frames=4,
                               min_pixels=3136, max_pixels=3136, image_min_pixels=3136, image_max_pixels=3136)

    text_record = record(data_type="text")
    assert build_conversation(text_record, None, cfg("video_r1", "template"))[0]["role"] == "user"  # Qwen default
    assert build_conversation(text_record, None, cfg("prefix_grpo", "template"))[0]["role"] == "system"
    assert build_conversation(text_record, None, cfg("prefix_grpo", ""))[0]["role"] == "user"
    assert build_conversation(text_record, None, cfg("video_r1", "Be brief."))[0]["content"] == "Be brief."
