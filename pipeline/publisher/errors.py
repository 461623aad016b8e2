"""The publisher's exceptions, in one module so every part of it can raise them without importing the others."""

from __future__ import annotations


class PublisherError(RuntimeError):
    """Base class of the publisher's errors."""


class PublisherClosed(PublisherError):
    """The publisher is closed (or was never started), so it takes no more spans."""


class FlushTimeout(PublisherError):
    """flush() ran out of time before every span published before it was acknowledged or journaled."""
