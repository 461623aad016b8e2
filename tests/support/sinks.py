"""A span sink that keeps what it is given, for tests of code that emits spans without a broker."""

from __future__ import annotations

from collections.abc import Sequence


class ListSink:
    """Collects published spans and rollout events in lists."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.events: list[dict] = []

    def publish(self, span: dict) -> None:
        self.spans.append(span)

    def publish_event(self, event: dict) -> None:
        self.events.append(event)

    async def publish_async(self, span: dict) -> None:
        self.spans.append(span)

    def offer(self, spans: Sequence[dict], events: Sequence[dict] = ()) -> list:
        self.spans.extend(spans)
        self.events.extend(events)
        return []

    saturated = False

    def of(self, kind: str) -> list[dict]:
        return [span for span in self.spans if span["kind"] == kind]

    def rewards(self) -> list[dict]:
        return self.of("REWARD")
