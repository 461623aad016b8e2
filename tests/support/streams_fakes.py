"""Stand-ins for the stream processors' collaborators, for tests without a broker: what they send, what they hold,
and span nodes built by hand."""

from __future__ import annotations

from agentstream.streams.trajectory import SpanNode


class Sent:
    """Collects what a processor sends to Kafka (the Emitter protocol), for a test without a broker."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes | None, bytes]] = []

    async def send(self, topic, key, value, headers=None) -> None:
        self.records.append((topic, key, value))

    async def flush(self) -> None:
        pass


class Held:
    def hold(self, record) -> None:
        pass

    def release(self, record) -> None:
        pass


def node(span_id, kind, start, end=None, parent="", reward=None, attempt="a1", tokens=True, model="m"):
    return SpanNode(span_id=span_id, parent_id=parent, kind=kind, name=kind.lower(), start_us=start,
                    end_us=end if end is not None else start, attempt_id=attempt, agent_name="agent", model=model,
                    has_token_ids=tokens and kind == "LLM", reward=reward)
