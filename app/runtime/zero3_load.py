"""One workaround for transformers' ZeRO-3 load (5.19): MoE expert tensors stored in the other layout.

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
