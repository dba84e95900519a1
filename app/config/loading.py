"""Typed configuration: YAML files, ``key=value`` overrides, validation that names the bad key.

    cfg = load_config("configs/demo_cpu.yaml", ["grpo.beta=0.0", "train.max_steps=20"])

Every field carries a help string (``python -m app.config`` prints them all).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
import sys
from pathlib import Path
from typing import Any, get_origin, get_type_hints

import yaml

from app.config.checks import validate, warnings_for
from app.config.sections import SECTIONS, Config, ConfigError


class _Loader(yaml.SafeLoader):
    """YAML with YAML 1.2's booleans: only true/false. PyYAML follows YAML 1.1, where yes/no/on/off (and y/n in some
    places) silently become booleans (`system_prompt: no` would be False); here they stay strings, and a boolean
    key given one gets an error that says so."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


RENAMED = {  # old key -> what to write instead
    "grpo.loss_aggregation": "grpo.loss_type (sequence -> grpo, token -> bnpo; dapo is the step-wide token mean)",
    "grpo.grouping": "forward.grouping (the forward settings serve GRPO, SFT and evaluation alike)",
    "grpo.attention_backend": "forward.attention_backend",
    "grpo.self_check": "forward.self_check",
    "grpo.logprob_chunk_size": "forward.logprob_chunk_size",
}


def _section_types() -> dict[str, type]:
    hints = get_type_hints(Config)
    return {name: hints[name] for name in SECTIONS}


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _section_types().items() for f in dataclasses.fields(cls)]


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys(), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def _coerce(key: str, value: Any, annotation) -> Any:
    target = annotation if get_origin(annotation) is None else get_origin(annotation)
    if target is bool:
        if isinstance(value, bool):
            return value
        hint = (" (yes/no/on/off are not booleans here: YAML 1.2 rules)"
                if isinstance(value, str) and value.lower() in ("yes", "no", "on", "off", "y", "n") else "")
        raise ConfigError(f"'{key}' must be true or false, got {value!r}{hint}")
    if target is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"'{key}' must be an integer, got {value!r}")
        return value
    if target is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"'{key}' must be a number, got {value!r}")
        return float(value)
    if target is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"'{key}' must be a string, got {value!r}")
        return str(value)
    if target is list:
        if not isinstance(value, list):
            raise ConfigError(f"'{key}' must be a list, got {value!r}")
        return value
    return value


def _apply(config: Config, section: str, values: dict, source: str) -> None:
    types = _section_types()
    if section not in types:
        raise _unknown(section)
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: section '{section}' must be a mapping")
    target = getattr(config, section)
    hints = get_type_hints(types[section])
    names = {f.name: f for f in dataclasses.fields(types[section])}
    for name, value in values.items():
        key = f"{section}.{name}"
        if key in RENAMED:
            raise ConfigError(f"'{key}' was renamed: use {RENAMED[key]}")
        if name not in names:
            raise _unknown(key)
        value = _coerce(key, value, hints[name])
        choices = names[name].metadata.get("choices")
        if choices and value not in choices:
            raise ConfigError(f"'{key}' must be one of {list(choices)}, got {value!r}")
        setattr(target, name, value)


def parse_override(text: str) -> tuple[str, str, Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form section.key=value")
    key, raw = text.split("=", 1)
    if key.count(".") != 1:
        raise ConfigError(f"override key '{key}' must be section.key (e.g. grpo.beta=0.0)")
    section, name = key.split(".")
    try:
        value = _yaml(raw) if raw != "" else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"override '{text}': value is not valid YAML ({error})") from error
    return section, name, value


def _config_files(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict]]:
    """``path``'s sections, after those of the file its ``extends:`` names (relative to it), base first."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" + (f" (extended by {seen[-1]})" if seen else ""))
    if path.resolve() in seen:
        raise ConfigError(f"{seen[-1]}: 'extends' makes a circle through {path}")
    try:
        raw = _yaml(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({error})") from error
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    base = raw.pop("extends", None)
    if base is None:
        return [(path, raw)]
    if not isinstance(base, str):
        raise ConfigError(f"{path}: 'extends' must name one YAML file, got {base!r}")
    return [*_config_files(path.parent / base, (*seen, path.resolve())), (path, raw)]


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                training: bool = True) -> Config:
    config = Config()
    for source, raw in _config_files(Path(path)) if path is not None else ():
        for section, values in raw.items():
            _apply(config, section, values, str(source))
    for text in overrides:
        section, name, value = parse_override(text)
        _apply(config, section, {name: value}, f"override '{text}'")
    validate(config, training)
    for warning in warnings_for(config, training):
        logging.getLogger("app.config.loading").warning("config: %s", warning)
    return config


def describe() -> str:
    lines = []
    for section, cls in _section_types().items():
        lines.append(f"{section}:")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {f.name} = {default!r}\n      {f.metadata.get('help', '')}")
    return "\n".join(lines)


CONFIG_PAGE = "docs/config.md"


def reference_markdown() -> str:
    """The config reference page (``docs/config.md``), generated from the declarations above: ``python -m
    app.config.loading --markdown > docs/config.md`` (a test fails when the committed page is stale)."""
    lines = ["# Configuration reference", "",
             "Generated by `python -m app.config --markdown` from the declarations in `app/config/sections.py`; do not edit by "
             "hand. Every key is `section.key` in a YAML file or a `section.key=value` override; `python -m app.config` "
             "prints the same in the terminal.", ""]
    for section, cls in _section_types().items():
        lines += [f"## `{section}`", "", "| key | default | choices | what it does |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = ", ".join(f"`{c}`" for c in f.metadata.get("choices", ()))
            text = f.metadata.get("help", "").replace("|", "\\|")
            lines.append(f"| `{section}.{f.name}` | `{default!r}` | {choices} | {text} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    """``python -m app.config``: every key with its help; ``--markdown``: the reference page; ``CONFIG.yaml
    [overrides]``: the resolved config."""
    if sys.argv[1:] == ["--markdown"]:
        print(reference_markdown(), end="")
    elif len(sys.argv) == 1:
        print(describe())
    else:
        print(yaml.safe_dump(load_config(sys.argv[1], sys.argv[2:]).to_dict()))


if __name__ == "__main__":
    main()
