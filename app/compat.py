"""Environment fixes that must run before torchvision, transformers or qwen-vl-utils are imported.

PyPI only ships CUDA-linked torchvision wheels. On a CPU-only torch its compiled ops fail to load, and
torchvision's import then dies registering fake kernels for ``torchvision::nms`` ("operator does not exist"),
which in turn breaks transformers' Qwen video processors and qwen-vl-utils. Defining the two op schemas lets the
pure-Python parts (transforms, io helpers) import; no compiled torchvision op is used by this project.
"""

from __future__ import annotations

import functools
import glob
import importlib
import importlib.util
import os
import sys

import torch

_TORCHVISION_SCHEMA_LIBRARY = None  # kept alive for the process: the schemas vanish with the Library object


def ensure_torchvision_importable() -> str:
    """Make ``import torchvision`` work. Returns what was done: 'absent', 'already-imported', 'native' or 'schemas'."""
    global _TORCHVISION_SCHEMA_LIBRARY
    if "torchvision" in sys.modules:
        return "already-imported"
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return "absent"
    compiled = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so")))
    if compiled:
        try:
            torch.ops.load_library(compiled[0])
            return "native"
        except (OSError, RuntimeError):
            pass
    if _TORCHVISION_SCHEMA_LIBRARY is None:
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _TORCHVISION_SCHEMA_LIBRARY = library
    return "schemas"


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_environment_defaults() -> None:
    # qwen-vl-utils reads this once at import; its fallback reader (torchvision.io) no longer exists.
    os.environ.setdefault("FORCE_QWENVL_VIDEO_READER", "decord")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Checkpoints load from local paths only: nothing reaches a model hub unasked (set HF_HUB_OFFLINE=0 to allow it).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # JIT-built torch extensions (DeepSpeed's CPU communication op) in this environment's own folder: two
    # environments on one machine no longer rebuild one shared copy in turn (each build.ninja names its env).
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    # torch.compile's inductor compiles in a pool of subprocesses, one per core, each importing torch: on a small
    # host the pool costs more than it saves (FlexAttention's first compile on 2 cores: 21 CPU-s with the pool,
    # 10 without). Above 4 cores torch's own choice is kept; TORCHINDUCTOR_COMPILE_THREADS set by the user wins.
    if usable_cores() <= 4:
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def import_without_compiling(module: str) -> bool:
    """Import ``module`` with ``torch.compile`` deferred to the first call of each function it wraps at import.

    DeepSpeed imports its Muon optimizer every time it builds a ZeRO engine (for an isinstance check), and that
    module wraps three functions in ``torch.compile`` as it is imported: the first ``torch.compile`` of a process
    imports inductor's compiler, about 2 CPU-s on every rank of every run (docs/testing.md), for an optimizer this
    project never builds. Deferred, a wrapped function compiles when first called, as it would have anyway. Returns whether the
    module was imported here (False: imported already, or absent)."""
    if module in sys.modules:
        return False
    real = torch.compile

    def deferred(model=None, **options):
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: deferred(fn, **options)
        compiled = []

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            if not compiled:
                compiled.append(real(model, **options))
            return compiled[0](*args, **kwargs)

        return first_call_compiles

    torch.compile = deferred
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    finally:
        torch.compile = real
    return True


TORCHVISION_STATUS = ensure_torchvision_importable()
set_environment_defaults()
