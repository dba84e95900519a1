"""Installed into the environment's site-packages by scripts/setup_env.sh, with a one-line .pth that imports it at
every interpreter start-up: any Python started from this environment (a plain ``from transformers import
AutoProcessor``, ``import peft``, a vLLM worker subprocess) gets the torchvision-on-CPU fix of ``app.compat``
before torchvision loads. It costs nothing until something imports torchvision: torch is not imported here.
"""

import importlib.abc
import sys


class _FixTorchvisionFirst(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision" and not name.startswith("torchvision."):
            return None
        sys.meta_path.remove(self)  # once: app.compat imports torch, which must not come back here
        try:
            import app.compat  # noqa: F401  (defines the op schemas torchvision's import needs)
        except Exception as error:  # never break an import that might have worked without the fix
            print(f"prefix-grpo: torchvision fix not applied ({error})", file=sys.stderr)
        return None  # the ordinary finders load torchvision


if not any(isinstance(f, _FixTorchvisionFirst) for f in sys.meta_path):
    sys.meta_path.insert(0, _FixTorchvisionFirst())
