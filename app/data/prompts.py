"""Prompts: the named question templates (``PROMPT_TEMPLATES``: Video-R1's training and evaluation templates, this
project's first), the per-type answer instructions, the question text of a record, the system message; and chat
messages -> model inputs (the processor's chat template, media decoded through qwen-vl-utils)."""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from app.data.shares import share_marker, with_whole_grids
from app.data.video import decode_share, decode_video

TYPE_TEMPLATES = {
    "multiple choice": " Please provide only the single option letter (e.g., A, B, C, D, etc.) within the "
                       "<answer> </answer> tags.",
    "numerical": " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
    "OCR": " Please transcribe text from the image/video clearly and provide your text answer within the "
           "<answer> </answer> tags.",
    "free-form": " Please provide your text answer within the <answer> </answer> tags.",
    "regression": " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
    # grounding (this project's wording; not in Video-R1's template): an answer in the units the reward reads
    "temporal grounding": " Please provide the start and end time of the moment in seconds, as [start, end], within "
                          "the <answer> </answer> tags.",
    "spatial grounding": " Please provide the bounding box as [x1, y1, x2, y2] within the <answer> </answer> tags.",
    "object tracking": " Please provide the object's bounding box in each frame, in order, as a list of boxes "
                       "[[x1, y1, x2, y2], ...] within the <answer> </answer> tags.",
}
# Video-R1's QUESTION_TEMPLATE, verbatim (its missing period after "thought expressions" included): the prompt
# Video-R1's checkpoints were trained on.
VIDEO_R1_QUESTION = ("{question}\nPlease think about this question as if you were a human pondering deeply. Engage "
                     "in an internal dialogue using expressions such as 'let me think', 'wait', 'Hmm', 'oh, I see', "
                     "'let's break it down', etc, or other natural language thought expressions It's encouraged to "
                     "include self-reflection or verification in the reasoning process. Provide your detailed "
                     "reasoning between the <think> </think> tags, and then give your final answer between the "
                     "<answer> </answer> tags.")
# Video-R1's EVALUATION template (src/eval_bench.py), verbatim: it differs from the training one above in two places
# ("between the <think> and </think> tags", "between the <answer> and </answer> tags"); the eval/video_r1 protocol
# uses it so that published numbers can be reproduced.
VIDEO_R1_EVAL_QUESTION = ("{question}\nPlease think about this question as if you were a human pondering deeply. "
                          "Engage in an internal dialogue using expressions such as 'let me think', 'wait', 'Hmm', "
                          "'oh, I see', 'let's break it down', etc, or other natural language thought expressions "
                          "It's encouraged to include self-reflection or verification in the reasoning process. "
                          "Provide your detailed reasoning between the <think> and </think> tags, and then give your "
                          "final answer between the <answer> and </answer> tags.")
# This project's first template (kept for runs and checkpoints made with it).
PREFIX_GRPO_QUESTION = ("{question}\nPlease think about this question as if you were a human pondering deeply. "
                        "Provide your detailed reasoning between the <think> </think> tags, and then give your final "
                        "answer between the <answer> </answer> tags.")
PREFIX_GRPO_SYSTEM = ("A conversation between User and Assistant. The Assistant first thinks about the question and "
                      "then answers. The reasoning goes in <think> </think> tags and the final answer in <answer> "
                      "</answer> tags.")


# TimeZero's evaluation prompt for temporal grounding (www-Ye/TimeZero, evaluate.py GROUND_TEMPLATE), verbatim, the
# event sentence in place of its [EVENT]: the eval/timezero_charades_sta protocol reproduces its Charades-STA numbers.
TIMEZERO_GROUNDING = ('To accurately pinpoint the event "{question}" in the video, determine the precise time period '
                      "of the event.\n\nOutput your thought process within the <think> </think> tags, including "
                      "analysis with either specific timestamps (xx.xx) or time ranges (xx.xx to xx.xx) in <timestep> "
                      "</timestep> tags.\n\nThen, provide the start and end times (in seconds, precise to two decimal "
                      'places) in the format "start time to end time" within the <answer> </answer> tags. For '
                      'example: "12.54 to 17.83".')

# VideoChat-R1's evaluation prompt for object tracking on GOT-10k (OpenGVLab/VideoChat-R1, src_eval/eval_prompts.py
# TRACK_THINK, its trailing newline included), verbatim: the record's ``object`` in place of [OBJECT] and its
# ``initial_box`` written as Python writes a list in place of [START] (``str(gt[0])`` in its evaluate_track.py).
VIDEOCHAT_R1_TRACK = ('Track the "{object}" in the video based on its initial coordinates "{initial_box}". The output '
                      "should be a list containing eight sublists. Each sublist includes four normalized coordinates "
                      "[x0, y0, x1, y1] representing the bounding box of the object at specific time intervals.\n\n"
                      "Output your thought process within the <think> </think> tags.\n\nProvide your answer within "
                      "the <answer> </answer> tags as a list of eight sublists, where each sublist contains the "
                      "normalized coordinates [x0, y0, x1, y1]. For example: <answer>[[0.1, 0.5, 0.3, 0.55], [0.72, "
                      "0.25, 0.84, 0.43], ...]</answer>.\n")
# VideoChat-R1's evaluation prompt for grounded QA on NExT-GQA (src_eval/eval_prompts.py GQA_THINK_ANSWER_GLUE,
# its trailing newline included), verbatim: the record's ``problem`` in place of [QUESTION] and its ``options`` list
# as Python writes it in place of [OPTION] (``str(options)`` in its evaluate_gqa.py).
VIDEOCHAT_R1_GQA = ('Answer the question: "{problem}" according to the content of the video. Select the answer from '
                    ":{options}.\n\nOutput your thought process within the <think> </think> tags, including analysis "
                    "with either specific timestamps (xx.xx) or time ranges (xx.xx to xx.xx) in <timestep> </timestep> "
                    "tags.\n\nThen, provide your answer within the <answer> </answer> tags, output the corresponding "
                    "letter of the option. At the same time, in the <glue> </glue> tags, present the precise time "
                    "period in seconds of the video clips on which you base your answer to this question in the format "
                    "of [(s1, e1), (s2, e2), ...]. For example: <answer>A</answer><glue>[(5.2, 10.4)]</glue>.\n")

# VLM-R1's referring-expression evaluation prompt (om-ai-lab/VLM-R1, src/eval/test_rec_r1.py QUESTION_TEMPLATE),
# verbatim: the record's problem (its files write "Please provide the bounding box coordinate of the region this
# sentence describes: ...") as {question}; the image before the text, no system message.
VLM_R1_REC = ("{question} First output the thinking process in <think> </think> tags and then output the final answer "
              "in <answer> </answer> tags. Output the final answer in JSON format.")


@dataclass(frozen=True)
class PromptTemplate:
    question: str  # format string with {question} and, where a benchmark's prompt needs them, {record_field}s
    options: str  # "video_r1": problem + "Options:\n" + each option + "\n"; "lines": "\nOptions:\n" + joined by "\n"
    system: str | None  # None: no system message (the chat template's default applies)
    type_instruction: bool = True  # append the problem type's answer instruction (TYPE_TEMPLATES)
    text_first: bool = False  # the question's text before the video/images in the user turn (TimeZero's order)


PROMPT_TEMPLATES = {
    "video_r1": PromptTemplate(VIDEO_R1_QUESTION, "video_r1", None),
    "video_r1_eval": PromptTemplate(VIDEO_R1_EVAL_QUESTION, "video_r1", None),
    "prefix_grpo": PromptTemplate(PREFIX_GRPO_QUESTION, "lines", PREFIX_GRPO_SYSTEM),
    "timezero_grounding": PromptTemplate(TIMEZERO_GROUNDING, "lines", None, type_instruction=False, text_first=True),
    "videochat_r1_track": PromptTemplate(VIDEOCHAT_R1_TRACK, "lines", None, type_instruction=False, text_first=True),
    "videochat_r1_gqa": PromptTemplate(VIDEOCHAT_R1_GQA, "lines", None, type_instruction=False, text_first=True),
    "vlm_r1_rec": PromptTemplate(VLM_R1_REC, "lines", None, type_instruction=False),
}


_LABELLED = re.compile(r"^\s*\(?[A-Z]\s*[.):：]")


def labelled_options(options: list) -> list[str]:
    """Options as the prompt shows them: already labelled ("A. red", "(B) blue") as they are; otherwise (some
    benchmark files list bare texts) each gets its letter, "A. ", "B. ", ... in order, so that an answer letter means
    something. Up to 26 options."""
    texts = [str(o) for o in options]
    if all(_LABELLED.match(t) for t in texts):
        return texts
    if len(texts) > 26:
        raise ValueError(f"{len(texts)} unlabelled options; letters run out after Z")
    return [f"{chr(65 + i)}. {t}" for i, t in enumerate(texts)]


def question_text(record: dict, template: str = "video_r1") -> str:
    chosen = PROMPT_TEMPLATES[template]
    question = record["problem"]
    options = record.get("options")
    if record["problem_type"] == "multiple choice" and options:
        options = labelled_options(options)
        if chosen.options == "video_r1":
            question = question + "Options:\n" + "".join(str(o) + "\n" for o in options)
        else:
            question = question + "\nOptions:\n" + "\n".join(str(o) for o in options)
    instruction = TYPE_TEMPLATES[record["problem_type"]] if chosen.type_instruction else ""
    values = {"question": question}
    for _, name, _, _ in string.Formatter().parse(chosen.question):
        if name and name != "question":
            if name not in record:
                raise ValueError(f"prompt template {template!r} needs the record field {name!r}, which this record "
                                 "lacks")
            values[name] = str(record[name])  # a list as Python writes it, as the benchmark's script does
    return chosen.question.format(**values) + instruction


def system_message(data_cfg) -> str | None:
    """``data.system_prompt``: "template" takes the template's own (video_r1: none), "" none, else the text."""
    text = data_cfg.system_prompt
    if text == "template":
        return PROMPT_TEMPLATES[data_cfg.prompt_template].system
    return text or None



def media_elements(conversation: Sequence[dict]) -> list[dict]:
    elements = []
    for message in conversation:
        content = message.get("content")
        if isinstance(content, list):
            elements += [item for item in content if item.get("type") in ("image", "video")]
    return elements


def is_multimodal_processor(processor) -> bool:
    return hasattr(processor, "tokenizer") and hasattr(processor, "video_processor")


def image_patch_size(processor) -> int:
    return getattr(getattr(processor, "image_processor", None), "patch_size", 14)


def encode_prompts(processor, conversations: Sequence[Sequence[dict]], shuffle_frames_seed: int | None = None,
                   with_media: bool = False, *, decoded: dict | None = None, sp_share: tuple[int, int] | None = None):
    """Encode B conversations (each ending with the user turn) into one left-padded batch.

    Video elements ({"type": "video", "video": path, "fps", "max_frames", "min_pixels", "max_pixels"}) are decoded
    with decord through qwen-vl-utils; the real fps goes to the processor as metadata (without it Qwen2.5-VL
    assumes 24 fps for ``second_per_grid_ts``). Images ({"type": "image", "image": path or PIL image}) go through
    qwen-vl-utils' ``fetch_image``. ``shuffle_frames_seed`` permutes each video's frames (temporal GRPO).

    ``with_media``: also return, per conversation, what an engine with its own processor needs to see exactly
    these inputs (``app.rollout.vllm``): ``{"prompt_ids": the template's ids before the processor expands the
    placeholders, "media": [("video", frames [T, H, W, 3] uint8, metadata) | ("image", PIL image), ...]}`` with
    the very frames and images encoded here.

    ``decoded``: a dict shared by several calls on the same media (questions on one video): each video or image
    element is decoded once, the first time, and its frames reused (``media_decodes`` counts what was decoded).

    ``sp_share`` = (rank, S): the videos' pixels only that sequence-parallel rank's share of them, decoded alone
    (``app.data.shares``), where ``decodes_share`` allows; else whole.
    """
    texts = [processor.apply_chat_template(list(c), add_generation_prompt=True, tokenize=False) for c in conversations]
    if not is_multimodal_processor(processor):
        if any(media_elements(c) for c in conversations):
            raise ValueError("a conversation has images or videos but the checkpoint has no vision processor")
        batch = dict(processor(texts, padding=True, padding_side="left", return_tensors="pt"))
        return (batch, _engine_view(processor, texts, [[] for _ in texts])) if with_media else batch
    elements = [media_elements(c) for c in conversations]
    share = sp_share if sp_share and decodes_share(elements, sp_share, shuffle_frames_seed, with_media) else None
    # None: decoded whole (collating cuts it to the share: media.collate)
    kwargs, media = _media_kwargs(processor, elements, shuffle_frames_seed, with_media, decoded, share)
    if "whole_frames" in kwargs:  # the share's pixels, the whole video's grid and text (app.data.shares)
        processor = with_whole_grids(processor, kwargs.pop("whole_frames"))
    batch = dict(processor(text=texts, padding=True, padding_side="left", return_tensors="pt", **kwargs))
    if share is not None and batch.get("pixel_values_videos") is not None:
        batch.update(share_marker(*share))
    return (batch, _engine_view(processor, texts, media)) if with_media else batch


def decodes_share(elements: Sequence[Sequence[dict]], share: tuple[int, int], shuffle_frames_seed: int | None,
                  with_media: bool) -> bool:
    """Whether prompts with these media elements decode only rank/size ``share``'s frames: S > 1, every video a
    file (a frame folder is read whole), frames in their order (temporal GRPO's shuffle needs them all), and no
    engine that needs the whole frames (``with_media``)."""
    videos = [e for items in elements for e in items if e["type"] == "video"]
    return (share[1] > 1 and bool(videos) and shuffle_frames_seed is None and not with_media
            and all(not Path(e["video"]).is_dir() for e in videos))


def media_decodes(decoded: dict) -> int:
    """How many media elements a ``decoded`` dict (``encode_prompts``) holds: the files decoded into it."""
    return len(decoded)


def _element_key(element: dict) -> str:
    return repr(sorted((k, repr(v)) for k, v in element.items()))


def _decoded_once(decoded: dict | None, element: dict, decode):
    if decoded is None:
        return decode()
    key = _element_key(element)
    if key not in decoded:
        decoded[key] = decode()
    return decoded[key]


def _media_kwargs(processor, elements: Sequence[Sequence[dict]], shuffle_frames_seed: int | None = None,
                  with_media: bool = False, decoded: dict | None = None,
                  share: tuple[int, int] | None = None) -> tuple[dict, list[list]]:
    """The processor's media arguments for lists of image / video elements (decoded with decord through
    qwen-vl-utils; with ``decoded``, each element once), and per list what an engine with its own processor needs
    (``encode_prompts``' ``with_media``). ``share`` = (rank, S): each video file's share alone
    (``video.decode_share``); the whole videos' frame counts are then under ``"whole_frames"``."""
    from qwen_vl_utils import fetch_image

    patch = image_patch_size(processor)
    temporal = int(getattr(processor.video_processor, "temporal_patch_size", 2) or 2)
    videos, metadata, images, media = [], [], [], []
    for items in elements:
        media.append([])
        for element in items:
            if element["type"] == "video" and share is not None:
                frames, meta, _ = _decoded_once(decoded, {**element, "share": share}, lambda e=element: decode_share(
                    e, *share, image_patch_size=patch, temporal_patch=temporal))
                videos.append(frames)
                metadata.append(meta)
            elif element["type"] == "video":
                frames, meta = _decoded_once(decoded, element, lambda e=element: decode_video(e, image_patch_size=patch))
                if shuffle_frames_seed is not None:
                    order = torch.randperm(frames.shape[0], generator=torch.Generator().manual_seed(shuffle_frames_seed))
                    frames = frames[order]
                videos.append(frames)
                metadata.append(meta)
                if with_media:
                    media[-1].append(("video", _frames_uint8(frames), dict(meta)))
            else:
                images.append(_decoded_once(decoded, element, lambda e=element: fetch_image(e, image_patch_size=patch)))
                media[-1].append(("image", images[-1]))
    kwargs = {}
    if videos:
        # Frames arrive sampled and sized by qwen-vl-utils (its per-frame pixel cap applied there); False is what
        # transformers 5.23 does by default, said explicitly so it does not warn in every process.
        kwargs.update(videos=videos, video_metadata=metadata, do_sample_frames=False, cap_pixels_per_frame=False)
    if images:
        kwargs.update(images=images)
    if share is not None and videos:
        kwargs["whole_frames"] = [len(meta["frames_indices"]) for meta in metadata]
    return kwargs, media


# Qwen's chat templates (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) write a media item of a turn as these strings.
MEDIA_PLACEHOLDERS = {"image": "<|vision_start|><|image_pad|><|vision_end|>",
                      "video": "<|vision_start|><|video_pad|><|vision_end|>"}
OBSERVATION_OPEN = "<|im_end|>\n<|im_start|>user\n"
OBSERVATION_CLOSE = "<|im_end|>\n<|im_start|>assistant\n"


def observation_text(content: Sequence[dict], opening: str = OBSERVATION_OPEN,
                     closing: str = OBSERVATION_CLOSE) -> str:
    """The observation turn as text, media as their (unexpanded) placeholders, as Qwen's template writes them."""
    return opening + "".join(MEDIA_PLACEHOLDERS[item["type"]] if item["type"] in MEDIA_PLACEHOLDERS else item["text"]
                             for item in content) + closing


def encode_observation(processor, content: Sequence[dict], opening: str = OBSERVATION_OPEN,
                       closing: str = OBSERVATION_CLOSE, with_media: bool = False):
    """A turn inside a response (a tool's result, shown to the model): ``opening`` + the content items (text,
    images, videos, as in a conversation's user turn) + ``closing`` -> the processor's tensors for it alone
    (input_ids [1, n] with the placeholders expanded, mm_token_type_ids, and the media's pixel tensors), so a
    response can hold media as Qwen's template writes a user turn. ``with_media``: also its engine view (the
    unexpanded ids and the very frames and images encoded, as ``encode_prompts`` gives a prompt's)."""
    text = observation_text(content, opening, closing)
    media = [item for item in content if item["type"] in MEDIA_PLACEHOLDERS]
    if media and not is_multimodal_processor(processor):
        raise ValueError("an observation holds images or videos but the checkpoint has no vision processor")
    if not is_multimodal_processor(processor):
        batch = dict(processor([text], add_special_tokens=False, return_tensors="pt"))
        return (batch, _engine_view(processor, [text], [[]])[0]) if with_media else batch
    kwargs, views = _media_kwargs(processor, [media], with_media=with_media)
    batch = dict(processor(text=[text], return_tensors="pt", **kwargs))
    return (batch, _engine_view(processor, [text], views)[0]) if with_media else batch


def _frames_uint8(frames: torch.Tensor):
    """qwen-vl-utils' frames [T, 3, H, W] (float, whole numbers: resized as uint8) -> uint8 [T, H, W, 3]."""
    if not torch.equal(frames, frames.round()):
        raise ValueError("decoded frames are not whole numbers; they cannot be handed on as uint8 unchanged")
    return frames.clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def _engine_view(processor, texts: list[str], media: list[list]) -> list[dict]:
    tokenizer = getattr(processor, "tokenizer", processor)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [{"prompt_ids": list(i), "media": m} for i, m in zip(ids, media)]


PADDED_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")
CONCATENATED_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def collate_prompts(items: Sequence[dict[str, torch.Tensor]], pad_id: int, device=None,
                    share: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Join single-prompt processor outputs into one left-padded batch; vision tensors are concatenated, the pixels
    of prompts that share them (a family's questions: the same tensor) once (``app.grouping.media.collate``);
    ``share`` = (rank, S): only that sequence-parallel rank's share of the videos' pixels (``media.keep_share``:
    what its frame-split tower reads); moved to ``device`` when given (only what is kept moves)."""
    from app.grouping.media import collate, keep_share

    width = max(item["input_ids"].shape[1] for item in items)
    batch: dict[str, torch.Tensor] = {}
    for key in PADDED_KEYS:
        if key not in items[0]:
            continue
        fill = pad_id if key == "input_ids" else 0
        rows = [torch.nn.functional.pad(item[key], (width - item[key].shape[1], 0), value=fill) for item in items]
        batch[key] = torch.cat(rows)
    batch.update(collate(items))
    if share is not None:
        batch = keep_share(batch, *share)
    return batch if device is None else {k: v.to(device) for k, v in batch.items()}


VISION_END = "<|vision_end|>"


def spliced_prompt(processor, template: dict, text: str) -> dict | None:
    """The processor's output for the chat ``text`` of a question on the same media as ``template`` (a dict with
    the template prompt's ``text`` and processor ``inputs``), without running the processor again: when both texts
    agree up to the end of their last media item (the question after the media, as Video-R1's template writes it),
    the template's tokens up to there, then ``text``'s remainder tokenized alone, and the template's very vision
    tensors. Qwen's tokenizers split at special tokens first, so a text cut right after ``<|vision_end|>``
    tokenizes as the whole does; checked on the template itself (its own remainder must give its own ids). None when
    the texts part earlier or the check fails: the caller runs the processor."""
    base, inputs = template["text"], template["inputs"]
    cut = base.rfind(VISION_END)
    if cut < 0 or text[: cut + len(VISION_END)] != base[: cut + len(VISION_END)] or text.count(VISION_END) != \
            base.count(VISION_END):
        return None
    cut += len(VISION_END)
    tokenizer = getattr(processor, "tokenizer", processor)
    end_id = tokenizer.convert_tokens_to_ids(VISION_END)
    ids = inputs["input_ids"][0]
    ends = (ids == end_id).nonzero().flatten()
    if ids.shape[0] != int(inputs["attention_mask"][0].sum()) or not len(ends):
        return None
    keep = int(ends[-1]) + 1
    if "tail_checked" not in template:
        own = tokenizer(base[cut:], add_special_tokens=False)["input_ids"]
        template["tail_checked"] = own == ids[keep:].tolist()
    if not template["tail_checked"]:
        return None
    tail = torch.tensor(tokenizer(text[cut:], add_special_tokens=False)["input_ids"], dtype=ids.dtype)
    out = dict(inputs)
    out["input_ids"] = torch.cat([ids[:keep], tail])[None]
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    if "mm_token_type_ids" in inputs:
        out["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"][0][:keep],
                                              inputs["mm_token_type_ids"].new_zeros(len(tail))])[None]
    return out
