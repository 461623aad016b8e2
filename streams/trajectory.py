"""A rollout's trajectory: its span tree, LLM calls in order, rewards in time, and its status."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property


@dataclass
class SpanNode:
    """The fields of a span that trajectory assembly and credit assignment need."""

    span_id: str
    parent_id: str
    kind: str
    name: str
    start_us: int
    end_us: int
    attempt_id: str
    agent_name: str = ""
    task_id: str = ""
    group_id: str = ""
    model: str = ""
    policy_version: int | None = None
    has_token_ids: bool = False
    reward: float | None = None
    reward_dimensions: dict[str, float] = field(default_factory=dict)
    status: str = "OK"
    rollout_id: str = ""
    tokens: bytes = b""  # LLM calls: the Avro of prompt ids, response ids and logprobs, as a Transition holds them
    train: bool | None = None  # the span's agentstream.train attribute: the rollout's opt-in/out, None if it made none
    children: list[SpanNode] = field(default_factory=list)


@dataclass
class Trajectory:
    """Everything credit assignment reads about one rollout attempt."""

    rollout_id: str
    attempt_id: str
    status: str
    agent_name: str
    task_id: str
    group_id: str
    spans: list[SpanNode]
    roots: list[SpanNode]
    llm_calls: list[SpanNode]
    rewards: list[SpanNode]
    error: str | None = None

    @property
    def final_reward(self) -> float | None:
        """The last reward emitted (by time): what a plain 'final reward' trainer learns from."""
        return self.rewards[-1].reward if self.rewards else None

    @property
    def total_reward(self) -> float:
        return sum(r.reward or 0.0 for r in self.rewards)

    @cached_property
    def trainable_calls(self) -> list[SpanNode]:
        return [call for call in self.llm_calls if call.has_token_ids]

    @cached_property
    def models(self) -> list[str]:
        return sorted({call.model for call in self.llm_calls if call.model})

    @property
    def reward_dimensions(self) -> dict[str, float]:
        merged: dict[str, float] = {}
        for reward in self.rewards:
            for name, value in reward.reward_dimensions.items():
                merged[name] = merged.get(name, 0.0) + value
        return merged

    @property
    def start_us(self) -> int:
        return min((s.start_us for s in self.spans), default=0)

    @property
    def end_us(self) -> int:
        return max((s.end_us for s in self.spans), default=0)


def choose_attempt(spans: list[SpanNode], attempt_id: str | None) -> str:
    """The attempt to assemble: the one the terminal event named, else the one with the latest span."""
    attempts = {s.attempt_id for s in spans}
    if attempt_id in attempts or not spans:
        return attempt_id or ""
    return max(spans, key=lambda s: s.start_us).attempt_id


def assemble(rollout_id: str, spans: list[SpanNode], status: str, attempt_id: str | None = None,
             error: str | None = None) -> Trajectory:
    """Build the tree of one attempt; a span whose parent is missing is re-attached by time envelope."""
    chosen = choose_attempt(spans, attempt_id)
    own = sorted((s for s in spans if s.attempt_id == chosen), key=lambda s: (s.start_us, s.end_us, s.span_id))
    by_id = {s.span_id: s for s in own}
    for node in own:
        node.children = []
    roots: list[SpanNode] = []
    parent_of: dict[int, SpanNode] = {}
    for node in own:
        parent = by_id.get(node.parent_id) if node.parent_id else None
        if node.parent_id and parent is None:
            parent = _tightest_envelope(node, own)
        if parent is None or parent is node:
            roots.append(node)
        else:
            parent.children.append(node)
            parent_of[id(node)] = parent
    calls = [s for s in own if s.kind == "LLM"]
    views = _client_views(calls, parent_of)
    first = next((s for s in own if s.agent_name), own[0] if own else None)
    return Trajectory(
        rollout_id=rollout_id, attempt_id=chosen, status=status, error=error,
        agent_name=first.agent_name if first else "", task_id=next((s.task_id for s in own if s.task_id), ""),
        group_id=next((s.group_id for s in own if s.group_id), ""), spans=own, roots=roots,
        llm_calls=[s for s in calls if id(s) not in views],
        rewards=sorted((s for s in own if s.kind == "REWARD" and s.reward is not None), key=lambda s: s.end_us),
    )


def _client_views(calls: list[SpanNode], parent_of: dict[int, SpanNode]) -> set[int]:
    """LLM spans without token ids that enclose an LLM span with token ids: one call seen twice.

    An OpenTelemetry-instrumented client (``chat <model>`` from an OpenAI instrumentation) wraps the
    HTTP request the proxy captures with token ids; the client's view is kept as a span, but the
    call is counted once, as the proxy's.
    """
    views: set[int] = set()
    for call in calls:
        if not call.has_token_ids:
            continue
        node, seen = parent_of.get(id(call)), 0
        while node is not None and seen < 64:  # a parent cycle in bad data ends the walk
            if node.kind == "LLM" and not node.has_token_ids:
                views.add(id(node))
            node, seen = parent_of.get(id(node)), seen + 1
    return views


def _tightest_envelope(orphan: SpanNode, candidates: list[SpanNode]) -> SpanNode | None:
    """The shortest span (other than the orphan) whose time range contains the orphan's."""
    containing = [c for c in candidates if c is not orphan and c.start_us <= orphan.start_us
                  and c.end_us >= orphan.end_us and c.end_us > c.start_us]
    return min(containing, key=lambda c: c.end_us - c.start_us, default=None)
