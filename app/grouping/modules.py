"""The model behind a wrapper, its text config, the text model's attention setting, and instance patches: what
every part of grouping (and its callers) needs to reach inside a model. One definition each."""

from __future__ import annotations

import contextlib

from app.grouping import attention
from app.grouping.recurrent.segments import current_forward  # noqa: F401  (the instance patches' chain)


def unwrap(model):
    """The transformers model inside a wrapper such as a DeepSpeed engine (which is still what gets called)."""
    return getattr(model, "module", model)


def text_config(model):
    config = unwrap(model).config
    return getattr(config, "text_config", None) or config


def set_text_attention(model, name: str) -> None:
    """Switch the language model's attention implementation (the vision tower keeps its own): ``"sdpa"`` for
    ordinary batches, ``attention.ATTENTION_NAME`` for grouped rows (registered on first use; the layer kinds that
    are not attention functions read the same plan: ``install_layer_patches``)."""
    model = unwrap(model)
    install_layer_patches(model)
    if text_config(model)._attn_implementation == name:
        return
    if name == attention.ATTENTION_NAME:
        attention.register()
    if getattr(model.config, "vision_config", None) is not None:
        model.set_attn_implementation({"text_config": name})
    else:
        model.set_attn_implementation(name)


def install_layer_patches(model) -> None:
    """The instance patches of the layer kinds that are not attention functions, each reading the same plan as the
    attention (``attention.PLAN_KWARG``) and running the class's forward without one (idempotent, per module): Gated
    DeltaNet layers (``recurrent.layer``), PLE n-gram layers (``recurrent.ngrams``), QSA indexed attention
    (``sparse.layer``: also the vectorised indexer in ordinary batches)."""
    from app.grouping.recurrent import layer, ngrams
    from app.grouping.sparse import layer as sparse_layer

    model = unwrap(model)
    for install in (layer.install, ngrams.install, sparse_layer.install):
        install(model, attention.PLAN_KWARG)


@contextlib.contextmanager
def attention_restored(model):
    """The language model's attention setting as it was before the block, whatever the block switched it to. A
    forward that will be differentiated must keep its setting until its backward has finished (activation
    checkpointing recomputes through it), so a block around a training forward ends after the backward."""
    previous = text_config(model)._attn_implementation
    try:
        yield
    finally:
        set_text_attention(model, previous)


def keeps_attention_unless_grad(function):
    """``function(model, ...)`` leaves the model's attention setting as it found it when no gradient is being
    recorded (nothing will recompute through it); with gradients on, the caller restores it after the backward
    (``attention_restored``)."""
    import functools

    import torch

    @functools.wraps(function)
    def wrapper(model, *args, **kwargs):
        if torch.is_grad_enabled():
            return function(model, *args, **kwargs)
        with attention_restored(model):
            return function(model, *args, **kwargs)

    return wrapper


# ---- instance patches: a method replaced on ONE object (the class and other instances keep theirs) ----------------
def patch_instance(obj, name: str, replacement) -> None:
    """``obj.name`` replaced by an instance attribute for good (until ``unpatch_instance``). On a module the class's
    ``__call__`` still runs, so hooks around it (ZeRO-3's gathering, DeepSpeed's) run around the replacement."""
    object.__setattr__(obj, name, replacement)


def unpatch_instance(obj, name: str) -> None:
    """The class's ``name`` back on ``obj`` (nothing when it was not patched)."""
    obj.__dict__.pop(name, None)


@contextlib.contextmanager
def patched(obj, name: str, replacement):
    """``obj.name`` replaced for the block (``patch_instance``), then exactly what the instance had before comes
    back: a patch made inside another one's block restores the outer patch, not the class's method."""
    missing = object()
    previous = obj.__dict__.get(name, missing)
    patch_instance(obj, name, replacement)
    try:
        yield
    finally:
        if previous is missing:
            unpatch_instance(obj, name)
        else:
            patch_instance(obj, name, previous)
