"""The faust-streaming and aiokafka internals that streams.dependency_adapters relies on, on the installed classes.

An upgrade that renames, removes or reshapes one of them fails here with a message naming the
member and what the adapter does with it, instead of a worker that silently fetches slowly or
commits past a held record. No broker needed: the consumers are built, never started.
"""

from __future__ import annotations

import asyncio
import collections.abc
import inspect
from importlib.metadata import version
from typing import Any

import aiokafka
import faust
import pytest
from aiokafka.consumer.group_coordinator import GroupCoordinator
from faust.tables.manager import TableManager
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread, Consumer
from faust.types import TP, Message

from agentstream.streams import dependency_adapters
from agentstream.streams.transport import StreamsTransport

ADAPTER = "streams/dependency_adapters.py"

# (class, method, its parameters, what the adapter does with it)
OVERRIDDEN = [
    (AIOKafkaConsumerThread, "_create_worker_consumer", ["self", "transport"],
     "WorkerConsumerThread overrides it to adjust the worker's AIOKafkaConsumer (the fetch wait)"),
    (Consumer, "_new_consumer_thread", ["self"],
     "HookedConsumer overrides it to create the consumer thread with the fetch-wait hook"),
    (Consumer, "_new_offset", ["self", "tp"],
     "HookedConsumer overrides it so no commit passes a held record"),
    (Consumer, "getmany", ["self", "timeout"],
     "StreamsConsumer overrides it to notice records below faust's read offset (a log reset) before faust drops them"),
    (Consumer, "ack", ["self", "message"],
     "StreamsConsumer overrides it so records read before a log reset do not count towards a commit"),
    (AIOKafkaConsumerThread, "on_start", ["self"],
     "WorkerConsumerThread overrides it to watch the started consumer's group coordinator for fatal errors"),
    (AIOKafkaConsumerThread, "on_thread_stop", ["self"],
     "WorkerConsumerThread overrides it to stop that watch"),
    (TableManager, "on_start", ["self"],
     "PromptTableManager overrides it to start recovery without faust's 1 s pause"),
    (TableManager, "_update_channels", ["self"],
     "PromptTableManager calls it first, as faust's on_start does after its pause"),
    (GroupCoordinator, "check_errors", ["self"],
     "WorkerConsumerThread calls it (AIOKafkaConsumer._coordinator.check_errors) to raise a refused join"),
]
# (class, attribute set in __init__, what the adapter does with it)
READ = [
    (Consumer, "_unacked_messages", "unacked_messages() reads the messages delivered and not acknowledged"),
    (Consumer, "_acked", "acked_offsets() edits the acknowledged offsets the next commit consumes"),
    (aiokafka.AIOKafkaConsumer, "_fetch_max_wait_ms", "set_fetch_max_wait() replaces the wait start() hands on"),
]
# the per-TP structures forget_offsets() and read_offset() use after a log reset
RESET = ["_read_offset", "_committed_offset", "_acked_index", "_gap"]


def missing_method(owner: type, name: str, parameters: list[str]) -> str | None:
    """Why ``owner.name`` is not the method the adapter overrides, or None when it is."""
    method = getattr(owner, name, None)
    if not callable(method):
        return f"{owner.__module__}.{owner.__qualname__} has no method {name}"
    found = list(inspect.signature(method).parameters)
    if found != parameters:
        return f"{owner.__module__}.{owner.__qualname__}.{name} takes {found}, the adapter expects {parameters}"
    return None


def fail(problem: str, use: str) -> None:
    pytest.fail(f"{problem}: {use}. faust-streaming {version('faust-streaming')} / aiokafka {version('aiokafka')} "
                f"installed, {ADAPTER} was written against faust-streaming {dependency_adapters.FAUST_VERSION} / "
                f"aiokafka {dependency_adapters.AIOKAFKA_SERIES}; read the upstream code and adapt that module.",
                pytrace=False)


def test_installed_versions_are_the_pinned_ones():
    installed = version("faust-streaming"), version("aiokafka")
    if installed[0] != dependency_adapters.FAUST_VERSION or not (
            installed[1] + ".").startswith(dependency_adapters.AIOKAFKA_SERIES + "."):
        fail(f"faust-streaming {installed[0]} / aiokafka {installed[1]} installed",
             "every private member the adapter touches must be re-read before the pins and its versions move")


@pytest.mark.parametrize(("owner", "name", "parameters", "use"), OVERRIDDEN,
                         ids=[f"{o.__name__}.{n}" for o, n, _, _ in OVERRIDDEN])
def test_overridden_methods_exist(owner, name, parameters, use):
    problem = missing_method(owner, name, parameters)
    if problem:
        fail(problem, use)


def test_the_check_fails_on_a_class_without_the_member():
    class Renamed:
        def _next_offset(self, tp): ...

    class Reshaped:
        def _new_offset(self, tp, generation): ...

    assert "has no method _new_offset" in missing_method(Renamed, "_new_offset", ["self", "tp"])
    assert "takes ['self', 'tp', 'generation']" in missing_method(Reshaped, "_new_offset", ["self", "tp"])
    with pytest.raises(pytest.fail.Exception, match=r"has no method _new_offset.*adapt that module"):
        fail(missing_method(Renamed, "_new_offset", ["self", "tp"]), "a use")


def _built(fetch_max_wait_ms: int = 37) -> tuple[faust.App, Any]:
    """A worker app on the streams transport and its faust consumer, neither started (no broker is contacted)."""
    app = faust.App("adapter-check", broker="kafka://127.0.0.1:9", web_enabled=False, store="memory://")
    app.transport = StreamsTransport(app.conf.broker_consumer, app, fetch_max_wait_ms=fetch_max_wait_ms,
                                   read_gap_patience_s=2.0)

    async def callback(message: Message) -> None: ...

    consumer = app.transport.create_consumer(callback=callback, on_partitions_revoked=None,
                                             on_partitions_assigned=None)
    return app, consumer


def test_attributes_the_adapter_reads_are_there():
    async def check() -> None:
        _, consumer = _built()
        for owner, name, use in READ[:2]:
            if not hasattr(consumer, name):
                fail(f"a {owner.__module__}.{owner.__qualname__} has no attribute {name}", use)
        if not isinstance(consumer._unacked_messages, collections.abc.MutableSet):
            fail(f"Consumer._unacked_messages is a {type(consumer._unacked_messages)}, not a set", READ[0][2])
        if not isinstance(consumer._acked[TP("t", 0)], list):
            fail(f"Consumer._acked[tp] is a {type(consumer._acked[TP('t', 0)])}, not a list", READ[1][2])
        plain = aiokafka.AIOKafkaConsumer(bootstrap_servers="127.0.0.1:9", fetch_max_wait_ms=123)
        try:
            if getattr(plain, "_fetch_max_wait_ms", None) != 123:
                fail("AIOKafkaConsumer keeps fetch_max_wait_ms elsewhere than _fetch_max_wait_ms", READ[2][2])
        finally:
            await plain.stop()
        if "self._fetch_max_wait_ms" not in inspect.getsource(aiokafka.AIOKafkaConsumer.start):
            fail("AIOKafkaConsumer.start() no longer reads _fetch_max_wait_ms", READ[2][2])

    asyncio.run(check())


def test_the_worker_consumer_gets_the_configured_fetch_wait():
    async def check() -> None:
        _, consumer = _built(fetch_max_wait_ms=37)
        if not isinstance(consumer._thread, dependency_adapters.WorkerConsumerThread):
            fail(f"faust created a {type(consumer._thread)} thread", OVERRIDDEN[1][3])
        kafka_consumer = consumer._thread._create_consumer(asyncio.get_running_loop())  # faust's own entry point
        try:
            if kafka_consumer._fetch_max_wait_ms != 37:
                fail(f"the worker's consumer waits {kafka_consumer._fetch_max_wait_ms} ms, not 37", OVERRIDDEN[0][3])
        finally:
            await kafka_consumer.stop()

    asyncio.run(check())


def test_commits_stop_below_a_held_record(monkeypatch):
    async def check() -> None:
        app, consumer = _built()
        monkeypatch.setattr(app.topics, "acks_enabled_for", lambda topic: True)
        tp = TP("spans", 0)
        messages = [Message(tp.topic, tp.partition, offset, 0.0, 0, None, b"k", b"v", None, tp=tp)
                    for offset in range(3)]
        for message in messages:
            consumer.track_message(message)
        consumer.ack(messages[1])
        consumer.ack(messages[2])  # offset 0 is held: faust alone would commit up to 3 here
        if consumer._filter_committable_offsets([tp]) != {}:  # the commit path faust runs, through _new_offset
            fail("a commit passed the held offset 0", OVERRIDDEN[2][3])
        assert dependency_adapters.acked_offsets(consumer, tp) == [1, 2], "offsets above the hold wait, unconsumed"
        consumer.ack(messages[0])
        assert consumer._filter_committable_offsets([tp]) == {tp: 3}, "released: the commit goes past all three"

    asyncio.run(check())


def test_a_log_reset_forgets_old_offsets_and_old_acks_do_not_count(monkeypatch):
    """After a log reset a partition commits from the new log's start: faust's committed offset is forgotten (it
    refuses to commit below it) and a record read from the old log, released later, is not counted (its offset
    would let a commit jump past new records)."""
    async def check() -> None:
        app, consumer = _built()
        for name in RESET:
            if not hasattr(consumer, name):
                fail(f"faust's Consumer has no attribute {name}", "forget_offsets() empties it after a log reset")
        monkeypatch.setattr(app.topics, "acks_enabled_for", lambda topic: True)
        tp = TP("spans", 0)

        def message(offset: int) -> Message:
            found = Message(tp.topic, tp.partition, offset, 0.0, 0, None, b"k", b"v", None, tp=tp)
            consumer.track_message(found)
            return found

        old = [message(offset) for offset in (500, 501, 502)]
        consumer.ack(old[0])
        assert consumer._filter_committable_offsets([tp]) == {tp: 501}
        consumer._committed_offset[tp] = 501
        consumer._start_over(tp)  # the log now starts again at 0
        assert dependency_adapters.read_offset(consumer, tp) is None
        new = [message(offset) for offset in range(3)]
        consumer.ack(old[2])  # released after the reset: must not count
        for found in new[:2]:
            consumer.ack(found)
        assert consumer._filter_committable_offsets([tp]) == {tp: 2}, "commits restart from the new log's start"
        consumer.ack(old[1])
        consumer.ack(new[2])
        assert consumer._filter_committable_offsets([tp]) == {tp: 3}

    asyncio.run(check())


def test_the_aiokafka_consumer_under_faust_is_reachable_for_its_member_id():
    async def check() -> None:
        _, consumer = _built()
        if not hasattr(getattr(consumer, "_thread", None), "_consumer"):
            fail("faust's consumer thread keeps no _consumer", "kafka_consumer() reads the worker's group member id")
        assert dependency_adapters.kafka_consumer(consumer) is None  # not started: no consumer yet

    asyncio.run(check())
