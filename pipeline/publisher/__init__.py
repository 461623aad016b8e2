"""Publishes spans and rollout events to Kafka from any thread, journaling them on disk while the broker is away."""

from pipeline.publisher.front import FlushTimeout, PublisherClosed, PublisherError, PublisherStats, SpanPublisher

__all__ = ["FlushTimeout", "PublisherClosed", "PublisherError", "PublisherStats", "SpanPublisher"]
