"""The ``eval:`` section: held-out evaluation's settings (``scripts/eval.sh``; ``app/evaluation``)."""

from __future__ import annotations

from dataclasses import dataclass

from app.config.fields import _f
from app.rewards.protocols import ANSWER_EXTRACTION
from app.rollout.registry import ENGINE_NAMES


@dataclass
class EvalConfig:
    output_dir: str = _f("outputs/eval", "Where predictions.jsonl, summary.json and summary.md go.")
    samples: int = _f(1, "Completions per question (k). 1 with temperature 0 is greedy; k > 1 reports pass@k "
                      "and mean accuracy, all k drawn from one shared prefill.")
    engine: str = _f("grouped", "grouped: this project's shared-prefill decoder; hf: plain HF generate; vllm: a "
                     "vLLM engine in each evaluation process (its settings: rollout.vllm_*), fed the same prompts and "
                     "media. (replay is for training only.)", choices=ENGINE_NAMES)
    temperature: float = _f(0.0, "0 for greedy; > 0 samples.")
    top_p: float = _f(1.0, "Nucleus sampling threshold when sampling.")
    repetition_penalty: float = _f(1.0, "> 1 makes tokens already in the prompt or the output less likely (HF's and "
                                   "vLLM's rule: a seen token's logit divided by it when positive, multiplied when "
                                   "negative); Qwen2.5-VL-Instruct's generation_config.json sets 1.05, which HF "
                                   "generate applies unless told otherwise (TimeZero's protocol).")
    answer_extraction: str = _f("project", "How an output is scored: project (the trainer's reward code: the last "
                                "closed <answer>, option letters in the forms models write, regression by MRA) or "
                                "video_r1 (Video-R1's evaluation script: the first <answer> or the whole output, "
                                "exact string match for options, OCR and free-form scored 0), to reproduce its "
                                "published numbers; timezero, videochat_r1_track, videochat_r1_gqa and vlm_r1_rec: "
                                "those scripts' grounding scores (videochat_r1_gqa and vlm_r1_rec also report IoUs "
                                "beside their accuracy).",
                                choices=tuple(ANSWER_EXTRACTION))
    max_new_tokens: int = _f(256, "Maximum new tokens per completion.")
    batch_size: int = _f(4, "Questions per generate call on each rank.")
    share_video: bool = _f(True, "A video's questions in one batch: decoded, and prefilled (engine grouped), once.")
    seed: int = _f(0, "Sampling seed.")
    resume: bool = _f(True, "Keep finished predictions found in output_dir and score only the rest, when they were "
                      "made by the same model, data files and settings (recorded in output_dir/run.json).")
    if_different: str = _f("stop", "When output_dir holds predictions of another model, other data files or other "
                           "settings: stop (say what differs) or new_dir (evaluate into output_dir-2, -3, ...: the "
                           "first that is empty or holds this very evaluation).", choices=("stop", "new_dir"))
