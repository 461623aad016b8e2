"""Errors of the runner side that ``import agentstream`` exports, kept apart from the runner (which imports aiohttp)."""

from __future__ import annotations

from agentstream.schemas.errors import AgentstreamError


class AgentLoadError(AgentstreamError, ImportError):
    """`module:function` does not name an importable callable."""
