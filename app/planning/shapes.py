"""Real model shapes: the published architecture of each Qwen-VL (and Qwen3.5) checkpoint users train, without its
weights.

``configs/models/<preset>.json`` holds the released ``config.json`` of one checkpoint (its source and what it was
checked against are in the file). From it:

- ``hf_config(preset, layers=k, vision_layers=j)``: the transformers config, at full width and optionally reduced
  depth (the layer indices a tower singles out, full-attention blocks and deepstack taps, are kept within depth);
- ``meta_model(...)``: the real model class on the meta device, for counting parameters at full size;
- ``random_model(config)`` / ``random_tower(config)``: the real class (or its vision tower alone) with random weights,
  for measuring passes at real widths;
- ``build_real_width_checkpoint(...)``: random weights at full width and reduced depth, written with
  ``save_pretrained`` together with Qwen's real tokenizer and processor, and loaded by the same code as a real
  checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from app.planning.parallelism import PlanError
from app.runtime.lora import part_of
from app.runtime.models import build_processor, build_qwen_tokenizer, family_problem, model_class

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"


class PresetError(ValueError):
    """An unknown model preset (the message lists the known ones)."""


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_preset(name: str) -> dict:
    """The preset file of ``name``: name, hub_id, source, checked_against and the released ``config``."""
    path = PRESET_DIR / f"{name}.json"
    if not path.is_file():
        raise PresetError(f"unknown model preset {name!r}; known presets: {', '.join(preset_names())}")
    return json.loads(path.read_text())


def preset_for_path(path: str) -> str | None:
    """The preset whose hub id names the last part of ``path`` (``/models/Qwen2.5-VL-7B-Instruct`` ->
    ``qwen2_5_vl_7b``); None when no preset matches."""
    leaf = Path(str(path).rstrip("/")).name.lower()
    for name in preset_names():
        hub = load_preset(name)["hub_id"].split("/")[-1].lower()
        base = hub.removesuffix("-instruct")
        if leaf in (hub, base) or leaf.startswith(base + "-"):
            return name
    return None


def _reduced(config: dict, layers: int | None, vision_layers: int | None) -> dict:
    config = json.loads(json.dumps(config))
    text = config.get("text_config", config)
    if layers is not None:
        if not 1 <= layers <= text["num_hidden_layers"]:
            raise ValueError(f"layers={layers} is outside 1..{text['num_hidden_layers']}")
        text["num_hidden_layers"] = layers
        if "max_window_layers" in text:
            text["max_window_layers"] = layers
        if "layer_types" in text:  # a hybrid's first ``layers`` layers (Qwen3.5 at 4: three GDN, one attention)
            text["layer_types"] = text["layer_types"][:layers]
    vision = config.get("vision_config")
    if vision is not None and vision_layers is not None:
        if not 1 <= vision_layers <= vision["depth"]:
            raise ValueError(f"vision_layers={vision_layers} is outside 1..{vision['depth']}")
        vision["depth"] = vision_layers
        for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):
            if key in vision:  # the singled-out blocks within depth; at least one (the last) stays singled out
                vision[key] = [i for i in vision[key] if i < vision_layers] or [vision_layers - 1]
    return config


# a preset's decoder at a toy width with its layout kept (head_dim 128, M-RoPE's sections, grouped K/V heads, the
# vocabulary and its special ids): what the GPU benchmarks' ``--quick`` runs build on a CPU, a second instead of 10-14
NARROW = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1}


def hf_config(preset: str, layers: int | None = None, vision_layers: int | None = None, *, narrow: bool = False):
    """The transformers config of ``preset`` at full width; ``layers`` / ``vision_layers`` reduce the depth;
    ``narrow`` sets the decoder's width to ``NARROW`` (the tower's output follows it)."""
    from transformers import AutoConfig

    config = _reduced(load_preset(preset)["config"], layers, vision_layers)
    if narrow:
        config.get("text_config", config).update(NARROW)
        if "out_hidden_size" in config.get("vision_config", {}):
            config["vision_config"]["out_hidden_size"] = NARROW["hidden_size"]
    return AutoConfig.for_model(**config)


@dataclass(frozen=True)
class Counts:
    """Parameters of one model, by part (counted on the meta device: nothing is allocated)."""

    total: int  # on the GPUs: every parameter but the host-resident tables (``host``)
    vision: int  # the tower's blocks and patch embedding
    projector: int  # the merger
    embedding: int
    head: int  # 0 when tied to the embedding
    decoder_layer: int  # one decoder layer
    layers: int
    active: int = 0  # met by one token: the total less each sparse layer's unchosen routed experts (= total if dense)
    tensors: int = 0  # parameter tensors (the routed experts fused: two a sparse layer)
    pushed: int = 0  # tensors a vLLM weight push sends: the released layout, each expert's gate, up and down apart
    host: int = 0  # frozen tables kept in host memory, one copy per node (Qwen3.8-Flash-Next's PLE n-gram tables:
    #                 ``app.runtime.zero.HostTable``): never on a GPU, a token reads a few of their rows


def meta_model(config):
    """``config``'s model on the meta device, never partitioned (in a ZeRO-3 run's process too)."""
    from app.runtime.zero import without_hf_zero3

    with torch.device("meta"), without_hf_zero3():
        return model_class(config).from_config(config)


def random_model(config, dtype: torch.dtype = torch.float32):
    """``config``'s real class with random weights from transformers' own initialiser (``init_weights``: normal with
    std ``initializer_range``, norms at one, ties applied), drawn once. torch's per-module defaults, which that
    initialiser overwrites anyway, are skipped (``no_init_weights`` while the modules are built): at the 7B width with
    one layer the build takes 8.9 s instead of 14.0 on one thread. Every parameter is set (tests/test_plan.py).
    A transformers without ``transformers.initialization`` builds the plain way."""
    with _torch_init_skipped():
        model = model_class(config).from_config(config, dtype=dtype)
    model.init_weights()
    return model


def _torch_init_skipped():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an older transformers: draw twice
        import contextlib

        return contextlib.nullcontext()
    return no_init_weights()


def random_tower(config, dtype: torch.dtype = torch.float32):
    """The vision tower of ``config``'s model alone (its own class on ``config.vision_config``), initialised as
    ``random_model`` does: for measuring a tower without drawing the language model's billion numbers."""
    tower_class = type(meta_model(config).model.visual)
    with _torch_init_skipped():
        tower = tower_class._from_config(config.vision_config, dtype=dtype)
    tower.init_weights()
    return tower


def count_parameters(config) -> Counts:
    model = meta_model(config)
    seen: set[int] = set()
    parts = {"vision": 0, "projector": 0, "embedding": 0, "head": 0, "layers": 0, "other": 0}
    host = 0
    text = config.get_text_config()
    chosen = getattr(text, "num_experts_per_tok", 0) / max(getattr(text, "num_experts", 0) or 1, 1)
    unchosen, tensors, pushed = 0, 0, 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        tensors += 1
        fused = ".mlp.experts." in name and p.dim() == 3  # [E, ...]: gate_up_proj is two tensors an expert
        pushed += (p.shape[0] * (2 if name.endswith("gate_up_proj") else 1)) if fused else 1
        if ".ngram_embedding." in name:  # the PLE table: host memory (runtime.zero.HostTable), not a GPU's
            host += p.numel()
        elif part_of(name) != "language":
            parts[part_of(name)] += p.numel()
        elif "embed_tokens" in name:
            parts["embedding"] += p.numel()
        elif name.startswith("lm_head"):
            parts["head"] += p.numel()
        elif ".layers." in name:
            parts["layers"] += p.numel()
            if ".mlp.experts." in name:  # the fused routed experts (E, ...): a token meets k of the E
                unchosen += round(p.numel() * (1 - chosen))
        else:
            parts["other"] += p.numel()
    total = sum(parts.values())
    return Counts(total=total, vision=parts["vision"], projector=parts["projector"],
                  embedding=parts["embedding"], head=parts["head"],
                  decoder_layer=parts["layers"] // text.num_hidden_layers, layers=text.num_hidden_layers,
                  active=total - unchosen, tensors=tensors, pushed=pushed, host=host)


def build_real_width_checkpoint(out_dir: str | Path, preset: str, *, layers: int = 1, vision_layers: int = 1,
                                seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                                max_pixels: int = 28 * 28 * 64, device: str | torch.device = "cpu") -> Path:
    """Random weights at ``preset``'s full width and the given depth, with Qwen's real tokenizer and the family's
    processor, written with ``save_pretrained``: ``load_model`` / ``load_processor`` read it as a real checkpoint.
    The weights are small random numbers (std 0.02, transformers' initialiser), not trained ones, drawn on
    ``device`` (a GPU draws billions of them in a second)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(preset, layers, vision_layers)
    family = config.model_type
    torch.manual_seed(seed)
    with torch.device(device):
        model = random_model(config, dtype)
    model.save_pretrained(out)
    del model
    tokenizer = build_qwen_tokenizer(family)
    build_processor(family, tokenizer, max_pixels=max_pixels, template=tokenizer.chat_template).save_pretrained(out)
    (out / "real_width_checkpoint.json").write_text(json.dumps({"preset": preset, "layers": layers,
                                                                "vision_layers": vision_layers, "seed": seed}))
    return out


@lru_cache(maxsize=8)
def model_of(source: str):
    """(transformers config, parameter counts, the model on the meta device) of a preset name, a preset cut to N
    decoder layers and N vision blocks (``preset@N``: what a rehearsal at full width runs) or a checkpoint folder."""
    from transformers import AutoConfig

    folder = Path(source).is_dir()
    model_type = (json.loads((Path(source) / "config.json").read_text()) if folder else
                  load_preset(source.split("@", 1)[0])["config"]).get("model_type", "?")
    if family_problem(model_type):  # the trainer's own allow-list, before transformers reads the config
        raise PlanError(f"model {source} {family_problem(model_type)}")
    if folder:
        config = AutoConfig.from_pretrained(source)
    elif "@" in source:
        name, layers = source.split("@", 1)
        config = hf_config(name, layers=int(layers), vision_layers=int(layers))
    else:
        config = hf_config(source)
    return config, count_parameters(config), meta_model(config)


def model_source(cfg, override: str = "") -> str:
    """``--model``, else ``model.path`` when it is a checkpoint folder here, else the preset its name matches."""
    if override:
        name, _, layers = override.partition("@")
        if Path(override).is_dir() or (name in preset_names() and (not layers or layers.isdigit())):
            return override
        raise PlanError(f"--model {override!r} is neither a checkpoint folder nor a preset (or PRESET@LAYERS); "
                        f"presets: {', '.join(preset_names())}")
    if (Path(cfg.model.path) / "config.json").is_file():
        return cfg.model.path
    preset = preset_for_path(cfg.model.path)
    if preset is None:
        raise PlanError(f"model.path {cfg.model.path!r} is not a checkpoint here and names no preset; pass --model "
                        f"with one of: {', '.join(preset_names())}")
    return preset
