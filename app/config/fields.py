"""The building blocks of the configuration's sections: the error that names a bad key (``ConfigError``) and the
field declaration every section uses (``_f``: a default, a help string and, where there are some, its choices)."""

from __future__ import annotations

from dataclasses import field


class ConfigError(ValueError):
    """A configuration that cannot run, with the offending key named."""


def _f(default, help: str, **kwargs):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})
