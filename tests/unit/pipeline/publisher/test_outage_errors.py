"""Which broker answers the publisher journals through and which drop: only a refusal of the records drops."""

from __future__ import annotations

import pytest
from aiokafka.errors import (
    BrokerNotAvailableError,
    CorruptRecordException,
    KafkaConnectionError,
    KafkaStorageError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NotLeaderForPartitionError,
    RecordListTooLargeError,
    RequestTimedOutError,
    UnknownError,
)

from agentstream.pipeline.publisher.sender import _unreachable


@pytest.mark.parametrize("error", [
    UnknownError(),  # tansu's answer while its object store is full: aiokafka calls it fatal, the spans are not lost
    KafkaStorageError(), BrokerNotAvailableError(), NotLeaderForPartitionError(), RequestTimedOutError(),
    KafkaTimeoutError(), KafkaConnectionError("refused"), ConnectionResetError(), TimeoutError(),
])
def test_a_broker_that_fails_is_an_outage_to_journal_through(error):
    assert _unreachable(error)


@pytest.mark.parametrize("error", [MessageSizeTooLargeError(), RecordListTooLargeError(), CorruptRecordException()])
def test_a_broker_that_refuses_the_records_themselves_is_no_outage(error):
    assert not _unreachable(error)
