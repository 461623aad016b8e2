"""Every use the publisher makes of aiokafka beyond its documented API, in one place.

Written against aiokafka 0.14 (pinned ``aiokafka>=0.14,<0.15`` in pyproject.toml). The
documented producer API (``start``, ``stop``, ``partitions_for``, ``create_batch``,
``send_batch``) has no way to drop the batches a producer still holds, nor to ask the cluster
whether a topic exists without creating it, and :mod:`agentstream.pipeline.publisher.sender` needs both.
So it goes through the functions here, and nothing else in ``pipeline/publisher/`` names a
private member of aiokafka or its (undocumented) ``AIOKafkaClient``. Each function names the
upstream members it relies on and what they do in the pinned version.

``tests/unit/pipeline/publisher/test_aiokafka_compat.py`` checks the installed aiokafka against this
list (no broker needed). When it fails after an upgrade, read the upstream code of the member
it names, adapt this module (and only it), then move the pin and the version below.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from aiokafka import AIOKafkaProducer

AIOKAFKA_SERIES = "0.14"


async def abandon_producer(producer: AIOKafkaProducer, timeout_s: float) -> None:
    """Stop a producer without flushing: its sender task is cancelled, its connections closed, its batches dropped.

    aiokafka: ``AIOKafkaProducer._closed`` is False from ``__init__`` until ``stop()``, and
    ``__del__`` warns "Unclosed AIOKafkaProducer" (and calls the loop's exception handler)
    while it is False; True also makes a later ``stop()`` return at once. ``_sender`` is the
    producer's ``Sender``, whose ``close()`` cancels and awaits its background sender task
    (the one that retries queued batches). ``client.close()`` cancels the metadata task and
    closes every broker connection. Raises what those raise (TimeoutError after `timeout_s`
    waiting for the sender task, KafkaError, OSError); the producer counts as closed anyway.
    """
    producer._closed = True  # it will never flush: no "unclosed producer" warning for it
    await asyncio.wait_for(producer._sender.close(), timeout_s)
    await producer.client.close()


def fetch_all_metadata(producer: AIOKafkaProducer) -> Awaitable[Any]:
    """The cluster's metadata for every topic, fetched now, without adding a topic to those the producer tracks.

    aiokafka: ``AIOKafkaClient.fetch_all_metadata()`` (the producer's ``client``) is a coroutine
    returning a fresh ``ClusterMetadata`` (whose ``topics()`` is the set of topic names), or
    raising KafkaError when no known broker answers.
    """
    return producer.client.fetch_all_metadata()


def force_metadata_update(producer: AIOKafkaProducer) -> Awaitable[bool]:
    """Refresh the metadata the producer routes with (partition leaders), now rather than at its max age.

    aiokafka: ``AIOKafkaClient.force_metadata_update()`` wakes the client's metadata task at
    once (a plain call) and returns a shielded future of whether the update succeeded.
    """
    return producer.client.force_metadata_update()
