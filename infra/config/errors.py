"""What a bad configuration raises (ConfigError) and how a secret value travels (Secret), shared by every section."""

from __future__ import annotations

from agentstream.schemas.errors import AgentstreamError


class ConfigError(AgentstreamError, ValueError):
    """The configuration file or an environment variable holds a value we cannot use."""


class Secret:
    """A string that hides itself from repr/str so it cannot leak into logs."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)
