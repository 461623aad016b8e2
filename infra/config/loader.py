"""Reading the configuration (defaults, then the TOML file, then the environment) and writing it back out.

:func:`load_config` builds every section from its table and its environment variables, coercing each
value to its field's type; :func:`describe` is what ``agentstream config`` prints (secrets masked) and
:func:`dump_toml` the file a session hands its child processes (secrets included).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, get_type_hints

from agentstream.infra.config.credit import check_rule
from agentstream.infra.config.environment import CONFIG_FILE_VARIABLE, ENVIRONMENT
from agentstream.infra.config.errors import ConfigError, Secret
from agentstream.infra.config.sections import RULE_LISTS, SECTIONS, Config
from agentstream.infra.config.tracking import masked_uris


def load_config(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Read defaults, then the TOML file, then the environment, into a validated :class:`Config`."""
    environ = os.environ if environ is None else environ
    raw: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    rules: dict[str, Any] = {}
    config_path = Path(path) if path else _default_config_path(environ)
    if config_path is not None:
        document = _read_toml(config_path)
        rules = {name: document.pop(name) for name in RULE_LISTS if name in document}
        raw = _merge(raw, document)
    for variable, (section, key) in ENVIRONMENT.items():
        value = environ.get(variable)
        if value not in (None, ""):
            raw[section][key] = value
    rule_lists: dict[str, Any] = {name: _build_rules(name, value) for name, value in rules.items()}
    config = Config(**{name: _build_section(name, raw[name]) for name in SECTIONS}, **rule_lists)
    return _normalise(config)


def _default_config_path(environ: Mapping[str, str]) -> Path | None:
    if environ.get(CONFIG_FILE_VARIABLE):
        return Path(environ[CONFIG_FILE_VARIABLE])
    local = Path("agentstream.toml")
    return local if local.is_file() else None


def _read_toml(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
    unknown = set(data) - set(SECTIONS) - set(RULE_LISTS)
    if unknown:
        raise ConfigError(f"config file {path}: unknown section(s) {sorted(unknown)}; known: {sorted(SECTIONS)}")
    return data


def _merge(base: dict[str, dict[str, Any]], extra: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: {**base.get(name, {}), **extra.get(name, {})} for name in base}


def _build_rules(name: str, values: Any) -> tuple[Any, ...]:
    if not isinstance(values, list):
        raise ConfigError(f"[[{name}]] must be an array of tables, one per rule")
    return tuple(_build_section(f"{name}[{index}]", rule, RULE_LISTS[name]) for index, rule in enumerate(values))


def _build_section(name: str, values: dict[str, Any], cls: type | None = None) -> Any:
    cls = cls or SECTIONS[name]
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"[{name}]: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    return cls(**{key: _coerce(f"{name}.{key}", hints[key], value) for key, value in values.items()})


def _coerce(where: str, hint: Any, value: Any) -> Any:
    text = str(hint)
    try:
        if "Secret" in text:
            return value if isinstance(value, Secret) else Secret(str(value))
        if hint is bool:
            return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes", "on")
        if hint is int:
            return int(value)
        if hint is float:
            return float(value)
        if hint is Path:
            return Path(value)
        if text == "tuple[str, ...]":  # a TOML array, or a comma-separated environment value
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(str(item).strip() for item in items if str(item).strip())
        return value if value is None else str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: cannot use {value!r} (expected {text})") from None


def _normalise(config: Config) -> Config:
    """Move credentials embedded in CLICKHOUSE_URL into their own fields and check each credit rule."""
    config = replace(config, clickhouse=config.clickhouse.with_url_credentials())
    for index, rule in enumerate(config.credit):
        check_rule(f"credit[{index}]", rule)
    return config


def describe(config: Config) -> dict[str, Any]:
    """A printable view of the configuration with every secret masked."""
    view: dict[str, Any] = {
        name: {key: ("***" if isinstance(value, Secret) else masked_uris(value) if isinstance(value, str) else value)
               for key, value in dataclasses.asdict(getattr(config, name)).items()}
        for name in SECTIONS
    }
    view.update({name: [dataclasses.asdict(rule) for rule in getattr(config, name)] for name in RULE_LISTS})
    return view


def dump_toml(config: Config) -> str:
    """The configuration as a TOML file that :func:`load_config` reads back to the same values.

    Used to hand one effective configuration (with secrets, so write it privately) to the child
    processes of a session; unset optional values are left out.
    """

    def literal(value: Any) -> str:
        if isinstance(value, Secret):
            value = value.reveal()
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (int, float)):
            return repr(value)
        if isinstance(value, tuple):
            return "[" + ", ".join(literal(item) for item in value) + "]"
        return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'

    def table(header: str, section: Any) -> list[str]:
        return [header, *(f"{f.name} = {literal(getattr(section, f.name))}" for f in fields(section)
                          if getattr(section, f.name) is not None), ""]

    lines: list[str] = []
    for name in SECTIONS:
        lines += table(f"[{name}]", getattr(config, name))
    for name in RULE_LISTS:
        for rule in getattr(config, name):
            lines += table(f"[[{name}]]", rule)
    return "\n".join(lines)
