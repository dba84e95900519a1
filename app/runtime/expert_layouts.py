"""Tensors on disk read or written in a layout of their own (``mapped_tensors``, ``table_keys``: a checkpoint's
tensors memory-mapped without transformers, as the PLE n-gram table is read by ``zero.HostTable``), and
mixture-of-experts tensors on disk: the released checkpoints' layout and transformers' own, read under ZeRO-3
(one workaround) and written back by the export in whatever layout the source checkpoint had.

**The export** (``in_source_layout``, called by ``checkpoint.export_hf`` after ``save_pretrained``): transformers
writes Qwen3-VL-MoE's experts in its fused layout ([E, 2I, H], [E, H, I]) and Qwen3.5-MoE's one tensor per expert,
whatever the source held, and vLLM's loader takes the released layout only ("The size of tensor a (24) must match
the size of tensor b (128)"). The export rewrites every expert tensor with the source checkpoint's key names and
shapes (read from its safetensors headers, no data), from the trained fused tensors the model holds; tensors the
source has and the model does not hold (a part transformers drops on load, e.g. an MTP head) are copied from the
source as they are, so the export serves where the source did.

**The load** (transformers 5.19): MoE expert tensors stored in the other layout.

transformers converts a checkpoint's expert tensors on load (``conversion_mapping.py``): Qwen3-VL-MoE's released
checkpoints store ``mlp.experts.gate_up_proj`` as [E, H, 2I] and ``down_proj`` as [E, I, H], and the model holds
[E, 2I, H] and [E, H, I]; ``Transpose(1, 2, check_dims=True)`` transposes a tensor only when its shape differs from
the model parameter's. Under ZeRO-3 every parameter is partitioned while the model is built (``zero.Init``), so the
parameter's shape is the empty placeholder's, every tensor "differs", and a checkpoint already in the model's
layout (what ``save_pretrained`` writes) is transposed too: ``size mismatch for ...experts.down_proj: copying a
param with shape [E, I, H] from checkpoint, the shape in current model is [E, H, I]``. Plain ``from_pretrained``
under transformers' own DeepSpeed integration fails the same way, without this project's code.

``partitioned_shapes_seen`` makes that check read a partitioned parameter's full shape (DeepSpeed's ``ds_shape``)
for the duration of a load, and changes nothing else: a tensor in the model's layout is kept, one in the released
layout transposed, as without ZeRO-3. Qwen3.5-MoE's per-expert tensors (merged by ``MergeModulelist`` and
``Concatenate``, no shape check) load under ZeRO-3 without it. Tested both ways, both layouts, in
``tests/test_experts_loading.py``; drop it when transformers compares ``ds_shape`` itself.
"""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path

import torch


@contextlib.contextmanager
def partitioned_shapes_seen():
    """For the block, transformers' shape-checked transposes compare against a ZeRO-3 parameter's full shape."""
    from transformers import core_model_loading

    transpose = core_model_loading.Transpose
    original = transpose.convert

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        model, name = kwargs.get("model"), kwargs.get("full_layer_name")
        if self.check_dims and model is not None and name is not None:
            full = getattr(model.get_parameter(name), "ds_shape", None)
            if full is not None:
                target = self.get_target_pattern(input_dict, source_patterns, target_patterns)
                tensors = next(iter(input_dict.values()))
                tensor = tensors[0] if isinstance(tensors, list) else tensors
                if tuple(tensor.shape) == tuple(full):
                    return {target: tensor}
                return {target: tensor.transpose(self.dim0, self.dim1).contiguous()}
        return original(self, input_dict, source_patterns, target_patterns, **kwargs)

    transpose.convert = convert
    try:
        yield
    finally:
        transpose.convert = original


EXPERT_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # the model's fused expert tensors


def source_shapes(path) -> dict[str, tuple[int, ...]]:
    """{key: shape} of every tensor in a checkpoint folder's safetensors files (headers only)."""
    from pathlib import Path

    from safetensors import safe_open

    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({key: tuple(f.get_slice(key).get_shape()) for key in f.keys()})
    return out


def in_source_layout(written: dict, held: dict, source: dict, family: str) -> tuple[dict, list[str]]:
    """The export's tensors with its expert tensors in the source's layout: ``written`` (what ``save_pretrained``
    wrote: key -> tensor), ``held`` (the model's own fused expert tensors, key -> tensor, the trained weights),
    ``source`` (the source checkpoint's key -> shape). Each held expert tensor goes out as the source stores that
    layer's experts: fused as held, or in the released layout (``experts.blocks.released_expert_tensors``), under
    the source's prefix; whichever the source's keys and shapes name (both, for square experts: as held). Returns
    (tensors, the source keys the model does not hold); a layer whose experts match neither layout stops naming it."""
    import re

    from app.grouping.experts.blocks import released_expert_tensors

    out = {k: v for k, v in written.items() if not _is_expert_key(k)}
    for name, tensor in held.items():
        if not name.endswith(EXPERT_SUFFIXES):
            continue
        index = re.search(r"layers\.(\d+)\.mlp\.experts\.", name)
        layer = f"layers.{index.group(1)}.mlp.experts." if index else name
        prefix = next((k.split(layer)[0] for k in source if layer in k), name.split(layer)[0])
        layouts = ([(name, tensor)], released_expert_tensors(name, tensor, family))  # fused as held, released
        for pairs in ([(prefix + layer + n.split(layer, 1)[1], t) for n, t in pairs] for pairs in layouts):
            if all(tuple(source.get(k, ())) == tuple(t.shape) for k, t in pairs):
                out.update((k, t.contiguous()) for k, t in pairs)
                break
        else:
            raise ValueError(f"the source checkpoint stores {layer.rstrip('.')}'s experts in neither the model's fused "
                             f"layout nor the released one (its keys under {prefix}{layer}: "
                             f"{sorted(k for k in source if (prefix + layer) in k)[:4]})")
    return out


def not_held(source: dict, exported) -> list[str]:
    """Source keys the export lacks that the model holds outside its state dict: under a top-level name the export
    has none of (a part transformers drops on load: ``mtp.*``), or a PLE n-gram table (``zero.HostTable``: frozen,
    read from the source's files)."""
    tops = {k.split(".")[0] for k in exported}
    return sorted(k for k in source if k not in exported and (k.split(".")[0] not in tops or ".ngram_embedding." in k))


def write_source_layout(folder, model, source_path) -> list[str]:
    """Rewrite what ``save_pretrained`` wrote to ``folder`` (one safetensors file or shards with their index) so
    its expert tensors are in ``source_path``'s layout (``in_source_layout``, shard by shard: memory of one shard)
    and the source's tensors the model does not hold are there too (``not_held``, copied into the last shard).
    Returns the keys copied from the source. A dense model: nothing done."""
    import json
    import re
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from app.grouping.experts.blocks import is_moe

    folder, family = Path(folder), model.config.model_type
    source = source_shapes(source_path)
    files = sorted(folder.glob("*.safetensors"))
    held = {k: v.detach().cpu() for k, v in model.state_dict().items() if k.endswith(EXPERT_SUFFIXES)} \
        if is_moe(model) else {}
    index = folder / "model.safetensors.index.json"
    weight_map, written = {}, []
    for file in files:
        part = load_file(str(file))
        layers = {m.group(0) for k in part for m in [re.search(r"layers\.\d+\.mlp\.experts\.", k)] if m}
        mine = {k: v for k, v in held.items() if any(layer in k for layer in layers)}
        tensors = in_source_layout(part, mine, source, family) if mine else part
        weight_map.update((k, file.name) for k in tensors)
        written.append((file, tensors, tensors is not part))
    copied = not_held(source, weight_map)
    if copied:
        extra = {}
        for file in sorted(Path(source_path).glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                extra.update({k: f.get_tensor(k) for k in f.keys() if k in copied})
        last, tensors, _ = written[-1]
        written[-1] = (last, {**tensors, **extra}, True)
        weight_map.update((k, last.name) for k in extra)
    for file, tensors, changed in written:
        if changed:
            save_file(tensors, str(file), metadata={"format": "pt"})
    if index.exists():
        parsed = json.loads(index.read_text())
        parsed["weight_map"] = dict(sorted(weight_map.items()))
        index.write_text(json.dumps(parsed, indent=2))
    return copied


def _is_expert_key(key: str) -> bool:
    """An expert tensor in either layout: fused (``mlp.experts.gate_up_proj``) or one per expert
    (``mlp.experts.3.down_proj.weight``)."""
    return ".mlp.experts." in key and ".lora_" not in key


def mapped_tensors(path: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """``names`` of a checkpoint folder's safetensors files as read-only memory maps (no copy): the file's header
    gives each tensor's dtype, shape and byte range."""
    import warnings

    import numpy as np

    kinds = {"F32": (np.float32, None), "F16": (np.float16, None), "BF16": (np.uint16, torch.bfloat16),
             "F64": (np.float64, None)}
    out, wanted = {}, set(names)
    for file in sorted(Path(path).glob("*.safetensors")):
        with open(file, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        for name in wanted & set(header):
            entry = header[name]
            numpy_dtype, view = kinds[entry["dtype"]]
            begin, _ = entry["data_offsets"]
            array = np.memmap(file, dtype=numpy_dtype, mode="r", offset=8 + size + begin, shape=tuple(entry["shape"]))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only on purpose: nothing writes the table
                tensor = torch.from_numpy(array)
            out[name] = tensor.view(view) if view is not None else tensor
    return out


def table_keys(source: Path, tail: str) -> list[str]:
    """The checkpoint's keys of one PLE table (``...{tail}.ngram_embedding.shard_{i}.weight`` in shard order, or the
    whole table's ``weight``)."""
    import re

    found = {}
    for file in sorted(source.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for key in header:
            match = re.search(re.escape(tail) + r"\.ngram_embedding\.(?:shard_(\d+)\.)?weight$", key)
            if match:
                found[key] = int(match.group(1) or 0)
    return sorted(found, key=found.get)
