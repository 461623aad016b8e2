"""The publisher's exceptions, in one module so every part of it can raise them without importing the others."""

from __future__ import annotations

from agentstream.schemas.errors import AgentstreamError


class PublisherError(AgentstreamError, RuntimeError):
    """Base class of the publisher's errors."""


class PublisherClosed(PublisherError):
    """The publisher is closed (or was never started), so it takes no more spans."""


class FlushTimeout(PublisherError):
    """flush() ran out of time before every span published before it was acknowledged or journaled."""

    retriable = True


class PublisherFull(PublisherError):
    """offer() found no room in the buffer toward the broker for what it was given, so it queued none of it."""

    retriable = True

    def __init__(self, needed: int, buffered: int, limit: int, state: str) -> None:
        super().__init__(f"{buffered} of {limit} buffered bytes wait for the broker ({state}); "
                         f"{needed} more do not fit now")
