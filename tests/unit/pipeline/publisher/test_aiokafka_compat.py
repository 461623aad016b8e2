"""The aiokafka internals that pipeline.publisher.aiokafka_compat relies on, on a real AIOKafkaProducer.

An upgrade that renames, removes or reshapes one of them fails here with a message naming the
member and what the adapter does with it, instead of a publisher that, after a broker outage,
delivers journaled spans twice and out of order (an abandoned producer still retrying) or
never notices that the broker is back. No broker needed: the producer is built inside an event
loop and never connects.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import warnings
from importlib.metadata import version

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from agentstream.pipeline.publisher import aiokafka_compat

ADAPTER = "pipeline/publisher/aiokafka_compat.py"
NOBODY = "127.0.0.1:9"  # nothing listens there; the producer never gets that far anyway

# (member of an AIOKafkaProducer, what it must be, what the adapter does with it)
MEMBERS = [
    ("_closed", "attribute",
     "abandon_producer() sets it to True so the abandoned producer neither warns at garbage collection nor flushes"),
    ("_sender", "attribute", "abandon_producer() stops the producer's Sender through it"),
    ("_sender.close", "coroutine method",
     "abandon_producer() awaits it to cancel the sender task that would retry the journaled batches"),
    ("client", "attribute", "abandon_producer() and the metadata functions reach the AIOKafkaClient through it"),
    ("client.close", "coroutine method", "abandon_producer() awaits it to close every broker connection"),
    ("client.fetch_all_metadata", "coroutine method",
     "fetch_all_metadata() awaits it to learn whether the topic exists once the broker answers again"),
    ("client.force_metadata_update", "plain method",
     "force_metadata_update() calls it and awaits the future it returns before the journal is replayed"),
]


def problem_with(owner: object, dotted: str, kind: str) -> str | None:
    """Why ``owner.<dotted>`` is not the member the adapter uses, or None when it is."""
    value = owner
    for depth, name in enumerate(dotted.split(".")):
        if not hasattr(value, name):
            where = ".".join(dotted.split(".")[:depth]) or "the producer"
            return f"{where} ({type(value).__module__}.{type(value).__qualname__}) has no attribute {name}"
        value = getattr(value, name)
    if kind == "attribute":
        return None
    if not callable(value):
        return f"{dotted} is a {type(value).__name__}, not a method"
    if kind == "coroutine method" and not inspect.iscoroutinefunction(value):
        return f"{dotted} is no longer a coroutine method"
    if kind == "plain method" and inspect.iscoroutinefunction(value):
        return f"{dotted} became a coroutine method"
    parameters = list(inspect.signature(value).parameters)
    if parameters:
        return f"{dotted} now takes {parameters}, the adapter passes no arguments"
    return None


def fail(problem: str, use: str) -> None:
    pytest.fail(f"{problem}: {use}. aiokafka {version('aiokafka')} installed, {ADAPTER} was written against "
                f"aiokafka {aiokafka_compat.AIOKAFKA_SERIES}; read the upstream code and adapt that module.",
                pytrace=False)


def require(producer: AIOKafkaProducer, *members: str) -> None:
    """Fail with the adapter's message, before a behaviour check would stumble on a missing member."""
    for dotted, kind, use in MEMBERS:
        problem = problem_with(producer, dotted, kind) if dotted in members else None
        if problem:
            fail(problem, use)


def in_a_loop(check) -> None:
    """Run `check(producer)` in a fresh event loop, with an AIOKafkaProducer built there (it needs a running loop)."""

    async def run() -> None:
        await check(AIOKafkaProducer(bootstrap_servers=NOBODY, acks="all", request_timeout_ms=2000))

    asyncio.run(run())


def test_installed_version_is_the_pinned_series():
    installed = version("aiokafka")
    if not (installed + ".").startswith(aiokafka_compat.AIOKAFKA_SERIES + "."):
        fail(f"aiokafka {installed} installed",
             "every private member the adapter touches must be re-read before the pin and its version move")


@pytest.mark.parametrize(("dotted", "kind", "use"), MEMBERS, ids=[member for member, _, _ in MEMBERS])
def test_members_the_adapter_uses_are_there(dotted, kind, use):
    async def check(producer: AIOKafkaProducer) -> None:
        try:
            problem = problem_with(producer, dotted, kind)
            if problem:
                fail(problem, use)
        finally:
            await producer.stop()

    in_a_loop(check)


def test_the_check_fails_on_a_producer_without_the_member():
    class Sender:
        def close(self): ...  # no longer a coroutine

    class Reshaped:
        _sender = Sender()

        async def fetch_all_metadata(self, topics): ...

    assert "has no attribute _closed" in problem_with(Reshaped(), "_closed", "attribute")
    assert "the producer" in problem_with(Reshaped(), "_closed", "attribute")
    assert "no longer a coroutine" in problem_with(Reshaped(), "_sender.close", "coroutine method")
    assert "now takes ['topics']" in problem_with(Reshaped(), "fetch_all_metadata", "coroutine method")
    assert "has no attribute client" in problem_with(Reshaped(), "client.close", "coroutine method")
    with pytest.raises(pytest.fail.Exception, match=r"has no attribute _closed.*adapt that module"):
        fail(problem_with(Reshaped(), "_closed", "attribute"), "a use")


def test_a_fresh_producer_is_marked_open():
    async def check(producer: AIOKafkaProducer) -> None:
        try:
            require(producer, "_closed")
            if producer._closed is not False:
                fail(f"AIOKafkaProducer._closed is {producer._closed!r} after __init__, not False", MEMBERS[0][2])
        finally:
            await producer.stop()
        if producer._closed is not True:
            fail(f"AIOKafkaProducer._closed is {producer._closed!r} after stop(), not True", MEMBERS[0][2])

    in_a_loop(check)


def test_abandoning_stops_the_sender_task_and_the_unclosed_warning():
    async def check(producer: AIOKafkaProducer) -> None:
        require(producer, "_closed", "_sender", "_sender.close", "client", "client.close")
        await producer._sender.start()  # what producer.start() runs once connected; needs no broker
        task = producer._sender.sender_task
        if not isinstance(task, asyncio.Task) or task.done():
            fail(f"the Sender's sender_task is {task!r} after Sender.start(), not a running task", MEMBERS[2][2])
        await asyncio.wait_for(aiokafka_compat.abandon_producer(producer, 5.0), 10)
        if not task.done():
            fail("the sender task still runs after abandon_producer()", MEMBERS[2][2])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del producer
            gc.collect()
        unclosed = [w for w in caught if "Unclosed AIOKafkaProducer" in str(w.message)]
        if unclosed:
            fail("an abandoned producer (never stopped) still warns that it was not closed", MEMBERS[0][2])

    in_a_loop(check)


def test_a_producer_left_open_does_warn():
    """The counterpart of the check above: without _closed set, aiokafka does warn, so that check can fail."""

    async def check(producer: AIOKafkaProducer) -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: None)  # __del__ reports here too
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del producer
            gc.collect()
        if not any("Unclosed AIOKafkaProducer" in str(w.message) for w in caught):
            fail("a producer garbage-collected unclosed no longer warns: is _closed still what __del__ reads?",
                 MEMBERS[0][2])

    in_a_loop(check)


def test_metadata_functions_answer_without_a_broker():
    async def check(producer: AIOKafkaProducer) -> None:
        try:
            require(producer, "client", "client.fetch_all_metadata", "client.force_metadata_update")
            try:
                await asyncio.wait_for(aiokafka_compat.fetch_all_metadata(producer), 10)
            except KafkaError:
                pass  # what the publisher's probe catches: no broker is known, so none answered
            except TimeoutError:
                fail("fetch_all_metadata() with no broker known hangs instead of raising KafkaError", MEMBERS[5][2])
            else:
                fail("fetch_all_metadata() with no broker known did not raise KafkaError", MEMBERS[5][2])
            update = aiokafka_compat.force_metadata_update(producer)
            if not asyncio.isfuture(update):
                fail(f"AIOKafkaClient.force_metadata_update() returned {update!r}, not a future", MEMBERS[6][2])
            update.cancel()
        finally:
            await producer.stop()

    in_a_loop(check)
