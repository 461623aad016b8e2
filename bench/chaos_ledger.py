"""The chaos soak's ledger: which span ids and rollout events each producer process had acknowledged.

The publisher reports acknowledgement through ``flush()``: when it returns, every span and event
published before the call is acknowledged by the broker (acks=all) or fsynced to the publisher's
journal, which the next publisher on the same directory replays. There is no per-span callback,
so :class:`LedgeredPublisher` (a SpanPublisher subclass, installed into an unmodified
``agentstream`` command by this module's launcher) remembers the ids it was handed and, twice a
second, calls ``flush()`` and then appends the ids published before that call to a ledger file
(fsynced). A process SIGKILLed between an acknowledgement and its ledger line only makes the
ledger smaller: every line in it was acknowledged to its producer.

Ledger lines (tab-separated; a line cut short by a kill has no newline and is ignored):

- ``T  <unix time>  <pid>``: the time a flush returned, before the ids it settled;
- ``S  <span id>  <rollout id>  <attempt id>  <kind>  <model>  <1 if it has token ids>``;
- ``E  <rollout id>  <attempt id>  <event>`` (STARTED, SUCCEEDED, FAILED, ...);
- ``D  <records dropped so far>``: the publisher's count of records the broker refused for good.

Run as::

    python -m bench.chaos_ledger --ledger FILE -- run examples.arithmetic:solve --proxy URL   # any agentstream command
    python -m bench.chaos_ledger --ledger FILE publish --journal DIR --rollouts-per-s 10   # direct SpanPublisher load
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentstream.pipeline.publisher import FlushTimeout, PublisherClosed, SpanPublisher
from bench.common import llm_span

LEDGER_ENV = "AGENTSTREAM_CHAOS_LEDGER"
DIRECT_MODEL = "chaos-direct"  # not the trained model: the trainer skips these transitions (their token ids are random)
DIRECT_AGENT = "chaos-direct"
LLM_SPANS_PER_ROLLOUT = 15


class LedgerFile:
    """Appends lines to the ledger and fsyncs them (one process per file at a time; O_APPEND keeps lines whole)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, lines: list[str]) -> None:
        data = ("".join(line + "\n" for line in lines)).encode()
        written = 0
        while written < len(data):
            written += os.write(self.fd, data[written:])
        os.fsync(self.fd)


class LedgeredPublisher(SpanPublisher):
    """A SpanPublisher that writes what it acknowledged to the ledger named by $AGENTSTREAM_CHAOS_LEDGER."""

    ledger_interval_s = 0.5

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ledger = LedgerFile(Path(os.environ[LEDGER_ENV]))
        self._unsettled: list[str] = []
        self._ledger_lock = threading.Lock()
        self._ledger_stop = threading.Event()
        self._ledger_thread: threading.Thread | None = None

    def start(self):
        super().start()
        if self._ledger_thread is None:
            self._ledger_thread = threading.Thread(target=self._record_loop, name="chaos-ledger", daemon=True)
            self._ledger_thread.start()
        return self

    def publish(self, span: Mapping[str, Any]) -> None:
        super().publish(span)
        self._remember(_span_line(span))

    async def publish_async(self, span: Mapping[str, Any]) -> None:
        await super().publish_async(span)
        self._remember(_span_line(span))

    def publish_event(self, event: Mapping[str, Any]) -> None:
        super().publish_event(event)
        self._remember(f"E\t{event['rollout_id']}\t{event.get('attempt_id') or ''}\t{event['event']}")

    def close(self, timeout_s: float | None = None) -> None:
        self._ledger_stop.set()
        if self._ledger_thread is not None:
            self._ledger_thread.join(60)
        super().close(timeout_s)
        if self.stats().buffered_bytes == 0:  # everything was acknowledged or journaled on the way out
            self._record(self._take())

    def _remember(self, line: str) -> None:
        with self._ledger_lock:
            self._unsettled.append(line)

    def _take(self) -> list[str]:
        with self._ledger_lock:
            lines, self._unsettled = self._unsettled, []
        return lines

    def _record_loop(self) -> None:
        while not self._ledger_stop.wait(self.ledger_interval_s):
            lines = self._take()
            if not lines:
                continue
            try:
                self.flush(120)
            except FlushTimeout:
                with self._ledger_lock:  # not settled yet: try again with the next round
                    self._unsettled[:0] = lines
                continue
            except PublisherClosed:
                return
            self._record(lines)

    def _record(self, lines: list[str]) -> None:
        if lines:
            self._ledger.write([f"T\t{time.time():.3f}\t{os.getpid()}", *lines,
                                f"D\t{self.stats().records_dropped}"])


def _span_line(span: Mapping[str, Any]) -> str:
    tokens = 1 if span.get("response_token_ids") else 0
    return (f"S\t{span['span_id']}\t{span['rollout_id']}\t{span.get('attempt_id') or ''}\t{span.get('kind') or ''}"
            f"\t{span.get('model') or ''}\t{tokens}")


def install() -> None:
    """Make every SpanPublisher an ``agentstream`` command creates from now on a ledgered one."""
    import agentstream.pipeline.publisher
    import agentstream.pipeline.publisher.front

    # process_publisher (front) builds the processes' publishers; the package's name is patched for any other caller
    agentstream.pipeline.publisher.SpanPublisher = LedgeredPublisher  # type: ignore[misc]
    agentstream.pipeline.publisher.front.SpanPublisher = LedgeredPublisher  # type: ignore[misc]


def publish_direct(journal: Path, rollouts_per_s: float, seed: int) -> None:
    """Steady direct load: rollouts of 15 LLM spans, a reward and SUCCEEDED, until SIGTERM or SIGINT."""
    from agentstream.infra.config import load_config
    from agentstream.stack.control import Stack

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    config = load_config()
    rng = random.Random(seed * 1_000_003 + os.getpid())
    pool = [llm_span(rng, i) for i in range(64)]
    prefix = f"d{seed}-{os.getpid()}-{int(time.time())}"
    with LedgeredPublisher(config, Stack(config).endpoints().bootstrap_servers, journal_dir=journal) as publisher:
        print(f"direct publisher {os.getpid()}: {rollouts_per_s:g} rollouts/s of {LLM_SPANS_PER_ROLLOUT + 1} spans",
              flush=True)
        begin, sent = time.monotonic(), 0
        while not stop.is_set():
            pause = begin + sent / rollouts_per_s - time.monotonic()
            if pause > 0:
                stop.wait(pause)
                continue
            sent += 1
            rollout_id = f"{prefix}-{sent:07d}"
            attempt = f"{rollout_id}-1"
            now = time.time_ns() // 1000
            event = {"rollout_id": rollout_id, "attempt_id": attempt, "task_id": f"t{sent}", "agent_name": DIRECT_AGENT}
            publisher.publish_event({**event, "event": "STARTED", "at_us": now})
            for index in range(LLM_SPANS_PER_ROLLOUT):
                template = pool[(sent * 7 + index) % len(pool)]
                publisher.publish({**template, "span_id": f"{rollout_id}-{index}", "rollout_id": rollout_id,
                                   "attempt_id": attempt, "agent_name": DIRECT_AGENT, "model": DIRECT_MODEL,
                                   "policy_version": 0, "start_time_us": now + index, "end_time_us": now + index + 1})
            publisher.publish({"span_id": f"{rollout_id}-r", "rollout_id": rollout_id, "attempt_id": attempt,
                               "name": "reward", "kind": "REWARD", "start_time_us": now + 100, "end_time_us": now + 100,
                               "status": "OK", "agent_name": DIRECT_AGENT, "attributes": {}, "reward": 1.0})
            publisher.publish_event({**event, "event": "SUCCEEDED", "at_us": time.time_ns() // 1000})
        print(f"direct publisher {os.getpid()}: stopping after {sent} rollouts", flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ledger", type=Path, required=True)
    if "--" in argv:  # an agentstream command with the ledgered publisher
        split = argv.index("--")
        args = parser.parse_args(argv[:split])
        os.environ[LEDGER_ENV] = str(args.ledger)
        install()
        from agentstream.cli import main as agentstream

        agentstream(args=argv[split + 1:], prog_name="agentstream")
        return
    commands = parser.add_subparsers(dest="command", required=True)
    direct = commands.add_parser("publish", help="direct SpanPublisher load")
    direct.add_argument("--journal", type=Path, required=True)
    direct.add_argument("--rollouts-per-s", type=float, default=10.0)
    direct.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ[LEDGER_ENV] = str(args.ledger)
    publish_direct(args.journal, args.rollouts_per_s, args.seed)


if __name__ == "__main__":
    main()
