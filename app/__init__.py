"""prefix-grpo: GRPO for Qwen-VL video reasoning with a shared-prefix (Prefix Grouper) forward."""

from app import compat as _compat  # noqa: F401  (must run before anything imports torchvision)

__version__ = "0.1.0"
