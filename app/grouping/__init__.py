"""Prefix Grouper core: one packed row per batch of prompt groups, exact against the repeated [P;Ri] layout.

Knows nothing of GRPO. Public API:
- ``completion_logprobs(model, prompts, completion_ids, completion_mask, group_sizes, mode, backend)``
- ``verify_grouping(...)``: the optional self-check (grouped vs repeated on one batch)
- ``GroupLayout``: pack/unpack geometry; ``grouped_attention`` and the registered attention backends.
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
from app.grouping.forward import (
    MODES,
    CompletionScores,
    GroupingMismatchError,
    SelfCheck,
    completion_logprobs,
    repeated_inputs,
    verify_grouping,
)
from app.grouping.layout import GroupLayout, LayoutError
from app.grouping.precision import PrecisionComparison, compare_to_reference, float32_forward
from app.grouping.vision_calls import MODALITIES, aligned_vision_calls, present_vision_calls

__all__ = [
    "ATTENTION_NAME", "BACKENDS", "MODES", "CompletionScores", "GroupLayout", "GroupedAttentionPlan",
    "GroupingMismatchError", "LayoutError", "PrecisionComparison", "SelfCheck", "compare_to_reference",
    "completion_logprobs", "float32_forward", "MODALITIES", "aligned_vision_calls", "present_vision_calls", "default_backend", "grouped_attention",
    "register", "repeated_inputs", "usable_backends", "verify_grouping",
]
