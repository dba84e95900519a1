"""Prefix Grouper core: one packed row per batch of prompt groups, exact against the repeated [P;Ri] layout.

Knows nothing of GRPO. Public API:
- ``completion_logprobs(model, prompts, completion_ids, completion_mask, group_sizes, mode, *, backend, ...)``
- ``verify_grouping(...)``: the optional self-check (grouped vs repeated on one batch)
- ``GroupedDecoder``: one prefill per prompt, then grouped decode steps (what a rollout samples from)
- ``GroupLayout``: pack/unpack geometry; ``grouped_attention`` and the registered attention backends
- ``unwrap``, ``text_config``, ``set_text_attention``: reaching inside a (wrapped) model.
- ``continue_after_media`` / ``use_qwen_positions``: M-RoPE ids after a video as Qwen's code and vLLM place them.

Inside: the layout, positions, attention backends and forward at the top; ``decoding/`` (the grouped KV cache and
decode steps, chunked prefill), ``vision/`` (tower passes, the vision cache, agreed tower calls), ``tree/`` (prefix
trees).
May import: nothing of ``app`` outside ``app.grouping`` (torch and transformers only).
Exports: the names in ``__all__``.
"""

from app.grouping.attention import (
    ATTENTION_NAME,
    BACKENDS,
    GroupedAttentionPlan,
    default_backend,
    grouped_attention,
    register,
    usable_backends,
)
from app.grouping.checks.selfcheck import GroupingMismatchError, SelfCheck, text_before_media, verify_grouping
from app.grouping.decoding.decode import GroupedDecoder, idle_forward
from app.grouping.decoding.static import DECODE_MODES, StaticSteps, decode_mode
from app.grouping.forward import (
    DEFAULT_CHUNK_SIZE,
    MODES,
    CompletionScores,
    completion_logprobs,
    repeated_inputs,
)
from app.grouping.layout import GroupLayout, LayoutError, normalize_group_sizes
from app.grouping.modules import attention_restored, set_text_attention, text_config, unwrap
from app.grouping.positions import continue_after_media, use_qwen_positions
from app.grouping.precision import PrecisionComparison, compare_to_reference, float32_forward
from app.grouping.vision.calls import MODALITIES, aligned_vision_calls, present_vision_calls

__all__ = [
    "ATTENTION_NAME", "BACKENDS", "attention_restored", "DECODE_MODES", "DEFAULT_CHUNK_SIZE", "MODALITIES", "MODES", "CompletionScores", "GroupLayout",
    "GroupedAttentionPlan", "GroupedDecoder", "StaticSteps", "GroupingMismatchError", "LayoutError", "PrecisionComparison",
    "SelfCheck", "aligned_vision_calls", "compare_to_reference", "completion_logprobs", "continue_after_media",
    "decode_mode", "default_backend",
    "float32_forward", "grouped_attention", "idle_forward", "normalize_group_sizes", "present_vision_calls",
    "register", "repeated_inputs", "set_text_attention", "text_config", "unwrap", "usable_backends",
    "text_before_media", "use_qwen_positions", "verify_grouping",
]
