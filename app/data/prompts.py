"""Chat messages -> model inputs: the processor's chat template, media decoded through qwen-vl-utils."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.data.video import decode_video


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


def encode_prompts(processor, conversations: Sequence[Sequence[dict]]) -> dict[str, torch.Tensor]:
    """Encode B conversations (each ending with the user turn) into one left-padded batch.

    Video elements ({"type": "video", "video": path, "fps", "max_frames", "min_pixels", "max_pixels"}) are decoded
    with decord through qwen-vl-utils; the real fps goes to the processor as metadata (without it Qwen2.5-VL
    assumes 24 fps for ``second_per_grid_ts``). Images ({"type": "image", "image": path or PIL image}) go through
    qwen-vl-utils' ``fetch_image``.
    """
    texts = [processor.apply_chat_template(list(c), add_generation_prompt=True, tokenize=False) for c in conversations]
    if not is_multimodal_processor(processor):
        if any(media_elements(c) for c in conversations):
            raise ValueError("a conversation has images or videos but the checkpoint has no vision processor")
        return dict(processor(texts, padding=True, padding_side="left", return_tensors="pt"))
    from qwen_vl_utils import fetch_image

    patch = image_patch_size(processor)
    videos, metadata, images = [], [], []
    for conversation in conversations:
        for element in media_elements(conversation):
            if element["type"] == "video":
                frames, meta = decode_video(element, image_patch_size=patch)
                videos.append(frames)
                metadata.append(meta)
            else:
                images.append(fetch_image(element, image_patch_size=patch))
    kwargs = {}
    if videos:
        kwargs.update(videos=videos, video_metadata=metadata, do_sample_frames=False)
    if images:
        kwargs.update(images=images)
    return dict(processor(text=texts, padding=True, padding_side="left", return_tensors="pt", **kwargs))
