"""The trainer's configuration error, apart from torch so that a caller can catch it without importing a model."""

from __future__ import annotations

from agentstream.schemas.errors import AgentstreamError


class TrainerConfigError(AgentstreamError, ValueError):
    """A trainer setting, or a combination of settings and arguments, that cannot work: fix it, then start again."""

    retriable = False
