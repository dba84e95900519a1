"""The model and adapter sections of the configuration (``model.*``, ``lora.*``): which checkpoint, in what dtype,
what trains, and the LoRA adapters, mixture-of-experts parts included."""

from __future__ import annotations

from dataclasses import dataclass

from app.config.fields import _f
from app.grouping.experts.blocks import EXPERTS_IMPLEMENTATIONS
from app.grouping.vision.attention import VISION_ATTENTIONS


@dataclass
class ModelConfig:
    path: str = _f("", "Local checkpoint directory (Hugging Face format). Nothing is downloaded.")
    reference_path: str = _f("", "Reference model directory; empty means the same as `path`.")
    dtype: str = _f("float32", "Parameter dtype: float32 (CPU) or bfloat16 (GPU).", choices=("float32", "bfloat16"))
    vision_attention: str = _f("auto", "Attention implementation for the vision tower. auto: on CUDA in bfloat16, "
                               "torch's own varlen flash kernel, one call per block (flash_attention_2 when the "
                               "flash-attn package is installed); elsewhere sdpa, one call per frame or window. "
                               "torch_flash_varlen asks for torch's kernel (its per-frame SDPA where it cannot run).",
                               choices=VISION_ATTENTIONS)
    gradient_checkpointing: bool = _f(False, "Activation checkpointing in the policy forward.")
    trust_remote_code: bool = _f(False, "Allow code from the checkpoint directory to run. Off by default.")
    freeze_vision_tower: bool = _f(False, "Do not train the vision tower (its blocks; the projector is separate).")
    freeze_projector: bool = _f(False, "Do not train the projector (the merger from vision into the language model).")
    experts_implementation: str = _f("auto", "Mixture-of-experts models (Qwen3-VL-MoE, Qwen3.5-MoE): how the fused "
                                     "experts run (transformers' experts_implementation). auto: grouped_mm where "
                                     "torch has it (CPU included), else eager; eager loops over the experts that "
                                     "were hit; batched_mm gathers each token's k experts' weights. Same numbers to "
                                     "float rounding (tested equal); the one in use is logged. No effect on a dense "
                                     "model.", choices=EXPERTS_IMPLEMENTATIONS)
    train_router: bool = _f(False, "Mixture-of-experts models, full-weight training: let the routers (each sparse "
                            "block's `mlp.gate`) train. Off by default: RL updates are small and noisy, and a router "
                            "that moves changes which experts every token meets between rollout and update (the "
                            "instability routing replay, arXiv 2510.11370, and GSPO, arXiv 2507.18071, were made "
                            "for); with LoRA the routers are base weights and stay frozen regardless.")


@dataclass
class LoRAConfig:
    rank: int = _f(0, "LoRA rank; 0 trains all weights. With LoRA every base weight is frozen, only the adapters "
                   "train, and the KL reference is the policy with its adapters off (no second model in memory).")
    alpha: float = _f(32.0, "LoRA alpha: the adapter's update is scaled by alpha / rank.")
    dropout: float = _f(0.0, "Dropout on the adapter input. Above 0 the policy forward is random, so pi/pi_old is no "
                        "longer 1 at the first iteration and grouped vs repeated no longer match bit for bit.")
    target_modules: list = _f(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                              "Language-model Linear layers (by last name) that get adapters.")
    vision_tower: bool = _f(False, "Adapters on every Linear layer of the vision tower too.")
    projector: bool = _f(False, "Adapters on the projector (merger) too.")
    target_parameters: list = _f([], "Mixture-of-experts models: fused expert weights (nn.Parameter, not Linear) "
                                 "that get adapters through peft's target_parameters, by the name's end, e.g. "
                                 "[mlp.experts.gate_up_proj, mlp.experts.down_proj] for the routed experts. Empty: "
                                 "the routed experts stay frozen (the shared expert's Linear layers are "
                                 "lora.target_modules like any MLP's); a run says so by name at start-up. A name "
                                 "that matches no parameter stops the run.")
    save_adapter: bool = _f(True, "With train.export_hf, also write the adapter alone (peft format) to "
                            "OUTPUT_DIR/final-adapter; final/ always holds the merged weights.")
