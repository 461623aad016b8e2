"""A ledger of what a SpanPublisher had acknowledged: which span ids and rollout events, per producer process.

The publisher reports acknowledgement through ``flush()``: when it returns, every span and event
published before the call is acknowledged by the broker (acks=all) or fsynced to the publisher's
journal, which the next publisher on the same directory replays. There is no per-span callback,
so :class:`LedgeredPublisher` (a SpanPublisher subclass, installed into an unmodified
``agentstream`` command by bench/chaos_ledger.py) remembers the ids it was handed and, five times a
second, calls ``flush()`` and then appends the ids published before that call to a ledger file
(fsynced). A process SIGKILLed between an acknowledgement and its ledger line only makes the
ledger smaller: every line in it was acknowledged to its producer.

Ledger lines (tab-separated; a line cut short by a kill has no newline and is ignored):

- ``T  <unix time>  <pid>``: the time a flush returned, before the ids it settled;
- ``S  <span id>  <rollout id>  <attempt id>  <kind>  <model>  <1 if it has token ids>``;
- ``E  <rollout id>  <attempt id>  <event>`` (STARTED, SUCCEEDED, FAILED, ...);
- ``D  <records dropped so far>``: the publisher's count of records the broker refused for good.

Written by :class:`LedgeredPublisher`, read by :class:`LedgerReader`; ``bench/chaos_ledger.py`` installs
the publisher into an ``agentstream`` command (the chaos soak's producers).
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentstream.pipeline.publisher import FlushTimeout, PublisherClosed, SpanPublisher

LEDGER_ENV = "AGENTSTREAM_CHAOS_LEDGER"


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

    ledger_interval_s = 0.2  # the ack time a round records is late by up to this

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


@dataclass
class LedgerState:
    """Everything the ledger files said so far, read incrementally."""

    spans: dict[str, tuple[str, str, str, str, str, bool, float]] = field(default_factory=dict)
    """span id -> (producer, rollout, attempt, kind, model, has token ids, acknowledged at)"""
    events: dict[str, list[tuple[str, str, float]]] = field(default_factory=lambda: defaultdict(list))
    """rollout id -> [(attempt, event, acknowledged at)]"""
    producer_of_rollout: dict[str, str] = field(default_factory=dict)
    last_round: dict[str, float] = field(default_factory=dict)  # producer -> time of its newest ledger round
    dropped: dict[str, int] = field(default_factory=dict)  # ledger file -> records the publisher dropped (max seen)


class LedgerReader:
    """The ``*.ledger`` files of a folder (one per producer, named after it), read on from where the last poll ended."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.offsets: dict[Path, int] = {}
        self.state = LedgerState()

    def poll(self) -> LedgerState:
        for path in sorted(self.folder.glob("*.ledger")):
            producer = path.stem
            with open(path, "rb") as handle:
                handle.seek(self.offsets.get(path, 0))
                data = handle.read()
            end = data.rfind(b"\n") + 1  # a line cut short by a kill (no newline yet) waits
            self.offsets[path] = self.offsets.get(path, 0) + end
            at = 0.0
            for line in data[:end].decode(errors="replace").splitlines():
                parts = line.split("\t")
                if parts[0] == "T" and len(parts) == 3:
                    at = float(parts[1])
                    self.state.last_round[producer] = max(self.state.last_round.get(producer, 0.0), at)
                elif parts[0] == "S" and len(parts) == 7:
                    self.state.spans[parts[1]] = (producer, parts[2], parts[3], parts[4], parts[5], parts[6] == "1", at)
                elif parts[0] == "E" and len(parts) == 4:
                    self.state.events[parts[1]].append((parts[2], parts[3], at))
                    self.state.producer_of_rollout.setdefault(parts[1], producer)
                elif parts[0] == "D" and len(parts) == 2:
                    self.state.dropped[producer] = max(self.state.dropped.get(producer, 0), int(parts[1]))
        return self.state
