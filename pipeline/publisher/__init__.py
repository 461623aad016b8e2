"""Publishes spans and rollout events to Kafka from any thread, journaling them on disk while the broker is away.

The public API is what ``__all__`` lists; the modules inside are the implementation:
``front`` (SpanPublisher and its stats), ``errors``, ``accumulator`` (the queue shared by callers
and the loop), ``sender`` (the background loop that delivers, journals and replays),
``journal`` (the on-disk record format), ``exit_hooks`` (atexit and SIGTERM) and
``aiokafka_compat`` (every use of aiokafka internals).
"""

from agentstream.pipeline.publisher.errors import FlushTimeout, PublisherClosed, PublisherError, PublisherFull
from agentstream.pipeline.publisher.front import PublisherStats, SpanPublisher, process_publisher

__all__ = ["FlushTimeout", "PublisherClosed", "PublisherError", "PublisherFull", "PublisherStats",
           "SpanPublisher", "process_publisher"]
