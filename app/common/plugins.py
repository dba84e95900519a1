"""``path/to/file.py:function`` entries in config (custom rewards, custom tools): the one loader."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path


def load_function(spec: str, what: str, error: type[Exception], hint: str = "") -> Callable:
    """The function ``spec`` names; ``error(message)`` naming ``what`` (the config entry) when the spec is not
    ``path/to/file.py:function``, the file is missing, or it has no such function."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise error(f"{what} {spec!r} must look like {hint or 'path/to/file.py:function'}")
    file = Path(path)
    if not file.is_file():
        raise error(f"{what} {spec!r}: file {file} not found")
    module_spec = importlib.util.spec_from_file_location(f"plugin_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise error(f"{what} {spec!r}: {file} has no function {name!r}")
    return fn
