"""The model behind a wrapper, its text config, and the text model's attention setting: what every part of
grouping (and its callers) needs to reach inside a model. One definition each."""

from __future__ import annotations

from app.grouping import attention


def unwrap(model):
    """The transformers model inside a wrapper such as a DeepSpeed engine (which is still what gets called)."""
    return getattr(model, "module", model)


def text_config(model):
    config = unwrap(model).config
    return getattr(config, "text_config", None) or config


def set_text_attention(model, name: str) -> None:
    """Switch the language model's attention implementation (the vision tower keeps its own): ``"sdpa"`` for
    ordinary batches, ``attention.ATTENTION_NAME`` for grouped rows (registered on first use)."""
    model = unwrap(model)
    if text_config(model)._attn_implementation == name:
        return
    if name == attention.ATTENTION_NAME:
        attention.register()
    if getattr(model.config, "vision_config", None) is not None:
        model.set_attn_implementation({"text_config": name})
    else:
        model.set_attn_implementation(name)
