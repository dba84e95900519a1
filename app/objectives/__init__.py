"""The advantage and the loss: group-normalised advantages, dynamic-sampling helpers, and the policy objectives
(GRPO with its loss aggregations, GSPO, CISPO, SAPO) as one ``GRPOLoss`` built from ``LossOptions``. Pure tensor
functions: no model code.

May import: ``app.common``.
Exports: ``GRPOLoss``, ``LossOptions``, ``advantages``.
"""

from app.objectives.grpo import GRPOLoss, LossOptions, advantages

__all__ = ["GRPOLoss", "LossOptions", "advantages"]
