"""OpenTelemetry spans (OTLP protobuf messages) mapped onto agentstream Span records.

What is recognised, and what it becomes:

* **Rollout**: a trace is a rollout (``rollout_id`` = the 32-hex trace id), unless a span or its
  resource names one with ``agentstream.rollout_id`` (set it as a resource attribute, or put it in
  W3C baggage and copy baggage onto spans with ``opentelemetry-processor-baggage``); one span of a
  trace naming it names it for the whole trace, remembered across export requests.
  ``agentstream.attempt_id``/``agent_name``/``task_id``/``group_id`` work the same way; the
  agent name falls back to the trace's ``gen_ai.agent.name`` (its root's first) and then the
  resource's ``service.name``.
* **Span kind**: ``gen_ai.operation.name`` (current GenAI conventions: ``chat``/
  ``text_completion``/``generate_content`` → LLM, ``execute_tool`` → TOOL, ``invoke_agent``/
  ``create_agent``/``invoke_workflow`` → AGENT), OpenInference's ``openinference.span.kind``
  (LLM, TOOL, AGENT, EVALUATOR ...), OpenLLMetry's ``llm.request.type`` and ``traceloop.span.kind``.
* **GenAI attributes**: OpenInference (``llm.model_name``, ``llm.token_count.*``,
  ``llm.input_messages.*``/``llm.output_messages.*``, ``llm.invocation_parameters``, ``tool.name``,
  ``input.value``/``output.value``) and OpenLLMetry (``gen_ai.prompt.N.*``, ``gen_ai.completion.N.*``,
  ``llm.usage.*``, ``gen_ai.usage.prompt_tokens``, ``traceloop.entity.*``) names also set the current
  ``gen_ai.*`` names (``gen_ai.input.messages``, ``gen_ai.usage.input_tokens``, ...); so do the message
  *events* (``gen_ai.user.message`` ..., ``gen_ai.choice``, ``gen_ai.client.inference.operation.details``).
* **Rewards**: a span named ``reward`` (or an evaluation span: ``gen_ai.operation.name`` ``evaluate``,
  OpenInference EVALUATOR) becomes a REWARD span; a ``gen_ai.evaluation.result`` event (score in
  ``gen_ai.evaluation.score.value``, its name a reward dimension) or a ``reward`` event becomes a REWARD
  span under the span that carries it; a reward *attribute* (``agentstream.reward``, dimensions as
  ``agentstream.reward.<name>``, Agent Lightning's ``agentlightning.reward.N.value``) on any other span
  becomes a REWARD child of it.
* **Token ids**: ``agentstream.prompt_token_ids``/``response_token_ids``/``response_logprobs`` (int and
  double arrays; or Agent Lightning's names, the same without ``agentstream.``) and
  ``agentstream.policy_version`` fill the first-class fields. Spans without them are
  analytics only: stored and queryable, never made into training transitions.

Nothing is dropped: every attribute is kept (values as text, arrays and maps as JSON), resource
attributes as ``otel.resource.<key>``, the scope as ``otel.scope.name``/``version``, the OTel span kind,
trace id and trace state, links as ``otel.links`` and the events that are not rewards as ``otel.events``.

It is one module of about 500 lines on purpose: the table above is one contract, and the code below implements
it line by line.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtelSpan

from agentstream.schemas.errors import AgentstreamError
from agentstream.schemas.json_body import NotJson, json_value
from agentstream.schemas.native import array_values
from agentstream.schemas.records import RolloutEventRecord, SpanRecord

SOURCE_ATTRIBUTE = "agentstream.source"
SOURCE = "otlp"
ROLLOUT_KEYS = ("agentstream.rollout_id", "agentlightning.rollout_id")
ATTEMPT_KEYS = ("agentstream.attempt_id", "agentlightning.attempt_id")
AGENT_KEYS = ("agentstream.agent_name",)
TASK_KEYS = ("agentstream.task_id",)
GROUP_KEYS = ("agentstream.group_id",)
MAX_KEY_DEPTH = 16
"""Dotted attribute keys are unflattened this many levels deep at most."""
MAX_INDEX_DIGITS = 6
"""A list index in a dotted key longer than this is not an index (``int()`` refuses 4,300+ digits)."""
TOKEN_KEYS = (("agentstream.prompt_token_ids", "prompt_token_ids"),
              ("agentstream.response_token_ids", "response_token_ids"),
              ("agentstream.response_logprobs", "response_logprobs"))
"""The attributes of each token field, ours first: Agent Lightning's instrumentation writes them without a prefix."""
POLICY_KEY = "agentstream.policy_version"
REWARD_KEY = "agentstream.reward"
REWARD_NAMES = frozenset({"reward", "agentstream.reward", "agentlightning.reward"})
EVALUATION_EVENT = "gen_ai.evaluation.result"
SCORE_KEY = "gen_ai.evaluation.score.value"

OPERATION_KINDS = {
    "chat": "LLM", "text_completion": "LLM", "generate_content": "LLM", "completion": "LLM",
    "execute_tool": "TOOL",
    "invoke_agent": "AGENT", "create_agent": "AGENT", "invoke_workflow": "AGENT",
}
OPENINFERENCE_KINDS = {"LLM": "LLM", "TOOL": "TOOL", "AGENT": "AGENT"}
TRACELOOP_KINDS = {"agent": "AGENT", "workflow": "AGENT", "tool": "TOOL"}
OTEL_SPAN_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}

# Older or other conventions' names → the current gen_ai.* name they also fill (first present wins).
ALIASES: dict[str, tuple[str, ...]] = {
    "gen_ai.usage.input_tokens": ("gen_ai.usage.prompt_tokens", "llm.token_count.prompt", "llm.usage.prompt_tokens"),
    "gen_ai.usage.output_tokens": ("gen_ai.usage.completion_tokens", "llm.token_count.completion",
                                   "llm.usage.completion_tokens"),
    "gen_ai.request.model": ("llm.request.model", "llm.model_name"),
    "gen_ai.response.model": ("llm.response.model",),
    "gen_ai.provider.name": ("gen_ai.system", "llm.provider", "llm.system"),
    "gen_ai.operation.name": ("llm.request.type",),
}
INVOCATION_PARAMETERS = {"temperature": "gen_ai.request.temperature", "top_p": "gen_ai.request.top_p",
                         "max_tokens": "gen_ai.request.max_tokens", "seed": "gen_ai.request.seed",
                         "max_completion_tokens": "gen_ai.request.max_tokens"}
MESSAGE_EVENTS = {"gen_ai.system.message": "system", "gen_ai.user.message": "user",
                  "gen_ai.assistant.message": "assistant", "gen_ai.tool.message": "tool"}


class RejectedSpan(AgentstreamError, ValueError):
    """One span of an export request that cannot be taken (the rest of the request is)."""


@dataclass
class Mapped:
    """What an export request became: agentstream spans, terminal rollout events, and the spans refused."""

    spans: list[SpanRecord] = field(default_factory=list)
    events: list[RolloutEventRecord] = field(default_factory=list)
    rejected: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (reason, the span as JSON)
    analytics_only_llm: int = 0


class _Attribution(TypedDict):
    """The Span fields every span mapped from one trace shares."""

    rollout_id: str
    attempt_id: str
    agent_name: str | None
    task_id: str | None
    group_id: str | None


@dataclass(frozen=True)
class Identity:
    """Where a trace's spans go: rollout, attempt and attribution (None: not named, use the default)."""

    rollout_id: str
    attempt_id: str
    named: bool  # the rollout was named by an attribute (so the trace's root does not end it)
    agent_name: str | None = None
    task_id: str | None = None
    group_id: str | None = None


def any_value(value: AnyValue) -> Any:
    """An OTLP AnyValue as plain Python (bytes as hex)."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        # the usual case, an array of numbers or strings of one kind (token ids: hundreds), read in compiled code
        bulk = array_values(value.array_value.SerializeToString())
        return bulk if bulk is not None else [any_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return {item.key: any_value(item.value) for item in value.kvlist_value.values}
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind)


def attributes_of(items: Iterable[KeyValue]) -> dict[str, Any]:
    return {item.key: any_value(item.value) for item in items}


def text(value: Any) -> str:
    """An attribute value as Span attributes hold it: strings as they are, everything else as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str, separators=(",", ":"))


def number(value: Any) -> float | None:
    """A finite number from an attribute (a number or a numeric string), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, (int, float)):
        try:
            converted = float(value)
        except OverflowError:  # an int past a double's range (JSON text may hold one of 4,000 digits)
            return None
        return converted if math.isfinite(converted) else None
    return None


def reward_value(value: Any, key: str) -> float | None:
    """A reward attribute's number (a number or a numeric string), None where it holds none.

    A reward that is a number but not a finite one (NaN, ±Infinity, ``"nan"``, ``"1e309"``) makes
    the span malformed: :class:`RejectedSpan`, so it is refused with a reason, never mapped to a
    span without a reward or one whose reward would poison training.
    """
    found = number(value)
    if found is not None or isinstance(value, bool):
        return found
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, (int, float)):
        raise RejectedSpan(f"{key} is {value!r}: a reward must be a finite number")
    return None


def first(keys: Iterable[str], *sources: Mapping[str, Any]) -> str | None:
    for source in sources:
        for key in keys:
            value = source.get(key)
            if value not in (None, ""):
                return str(value)
    return None


def unflatten(attributes: Mapping[str, Any], prefix: str) -> list[Any]:
    """``prefix.0.a.b = x`` style attributes (OpenInference, OpenLLMetry) as a list of nested dicts."""
    items: dict[int, dict[str, Any]] = {}
    for key, value in attributes.items():
        if not key.startswith(prefix):
            continue
        index, _, rest = key[len(prefix):].partition(".")
        if not index.isdigit() or len(index) > MAX_INDEX_DIGITS or not rest:
            continue
        node = items.setdefault(int(index), {})
        parts = rest.split(".", MAX_KEY_DEPTH)  # deeper parts stay one key: no client decides our recursion depth
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[parts[-1]] = value
    return [_lists(items[index]) for index in sorted(items)]


def _lists(node: Any) -> Any:
    """Dicts whose keys are all digits become lists (``tool_calls.0.x`` → ``tool_calls: [{x}]``)."""
    if not isinstance(node, dict):
        return node
    converted = {key: _lists(value) for key, value in node.items()}
    if converted and all(key.isdigit() and len(key) <= MAX_INDEX_DIGITS for key in converted):
        return [converted[key] for key in sorted(converted, key=int)]
    return converted


def _openinference_message(item: dict[str, Any]) -> dict[str, Any]:
    message = item.get("message", item)
    return message if isinstance(message, dict) else {"content": message}


def normalise(attributes: dict[str, Any], events: list[tuple[str, int, dict[str, Any]]], kind: str) -> dict[str, Any]:
    """The gen_ai.* names other conventions imply, for those not already set (originals are kept too)."""
    added: dict[str, Any] = {}

    def put(name: str, value: Any) -> None:
        if value not in (None, "", []) and name not in attributes and name not in added:
            added[name] = value

    for name, aliases in ALIASES.items():
        put(name, next((attributes[alias] for alias in aliases if attributes.get(alias) not in (None, "")), None))
    if "llm.input_messages.0.message.role" in attributes or "llm.input_messages.0.message.content" in attributes:
        put("gen_ai.input.messages", [_openinference_message(m) for m in unflatten(attributes, "llm.input_messages.")])
    if "llm.output_messages.0.message.role" in attributes or "llm.output_messages.0.message.content" in attributes:
        put("gen_ai.output.messages",
            [_openinference_message(m) for m in unflatten(attributes, "llm.output_messages.")])
    if any(key.startswith("gen_ai.prompt.0.") for key in attributes):
        put("gen_ai.input.messages", unflatten(attributes, "gen_ai.prompt."))
    if any(key.startswith("gen_ai.completion.0.") for key in attributes):
        put("gen_ai.output.messages", unflatten(attributes, "gen_ai.completion."))
    parameters = attributes.get("llm.invocation_parameters")
    if isinstance(parameters, str):
        try:
            parameters = json_value(parameters)
        except NotJson:
            parameters = None
    if isinstance(parameters, dict):
        for key, name in INVOCATION_PARAMETERS.items():
            put(name, parameters.get(key))
    if kind == "TOOL":
        put("gen_ai.tool.name", attributes.get("tool.name") or attributes.get("traceloop.entity.name"))
        put("gen_ai.tool.call.arguments", attributes.get("input.value") or attributes.get("traceloop.entity.input"))
        put("gen_ai.tool.call.result", attributes.get("output.value") or attributes.get("traceloop.entity.output"))
    if kind == "AGENT":
        put("gen_ai.agent.name", attributes.get("agent.name") or attributes.get("traceloop.entity.name"))
    inputs, outputs = [], []
    for name, _, event_attributes in events:
        fields = {key: value for key, value in event_attributes.items() if key not in ("gen_ai.system",
                                                                                        "gen_ai.provider.name")}
        if name in MESSAGE_EVENTS:
            inputs.append({"role": MESSAGE_EVENTS[name], **fields})
        elif name == "gen_ai.choice":
            outputs.append(fields)
        elif name == "gen_ai.content.prompt" and "gen_ai.prompt" in fields:
            put("gen_ai.input.messages", fields["gen_ai.prompt"])
        elif name == "gen_ai.content.completion" and "gen_ai.completion" in fields:
            put("gen_ai.output.messages", fields["gen_ai.completion"])
        elif name == "gen_ai.client.inference.operation.details":
            for key in ("gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.system_instructions"):
                put(key, fields.get(key))
    put("gen_ai.input.messages", inputs)
    put("gen_ai.output.messages", outputs)
    if kind == "LLM" and "gen_ai.operation.name" not in attributes:
        put("gen_ai.operation.name", "chat" if "gen_ai.input.messages" in {**attributes, **added} else None)
    return added


def span_kind(name: str, attributes: Mapping[str, Any]) -> str:
    operation = str(attributes.get("gen_ai.operation.name") or attributes.get("llm.request.type") or "")
    if _reward_like(name, attributes):
        return "REWARD"
    if operation in OPERATION_KINDS:
        return OPERATION_KINDS[operation]
    openinference = str(attributes.get("openinference.span.kind") or "").upper()
    if openinference in OPENINFERENCE_KINDS:
        return OPENINFERENCE_KINDS[openinference]
    traceloop = str(attributes.get("traceloop.span.kind") or "").lower()
    if traceloop in TRACELOOP_KINDS:
        return TRACELOOP_KINDS[traceloop]
    if "gen_ai.tool.name" in attributes and "gen_ai.request.model" not in attributes:
        return "TOOL"
    return "OTHER"


def _reward_like(name: str, attributes: Mapping[str, Any]) -> bool:
    """A span that *is* a reward or an evaluation (not one that merely carries a reward attribute)."""
    if name.lower() in REWARD_NAMES:
        return True
    operation = str(attributes.get("gen_ai.operation.name") or "")
    return operation in ("evaluate", "evaluation") or \
        str(attributes.get("openinference.span.kind") or "").upper() == "EVALUATOR"


def reward_of(attributes: Mapping[str, Any], *, own: bool) -> tuple[float | None, dict[str, float]]:
    """The scalar reward and named dimensions an attribute set carries (``own``: the span is a reward span).

    A reward value that is not finite raises :class:`RejectedSpan` (see :func:`reward_value`).
    """
    dimensions: dict[str, float] = {}
    for key, value in attributes.items():
        if key.startswith(REWARD_KEY + ".") and (found := reward_value(value, key)) is not None:
            dimensions[key[len(REWARD_KEY) + 1:]] = found
    for index, item in enumerate(unflatten(attributes, "agentlightning.reward.")):
        key = f"agentlightning.reward.{index}.value"
        if isinstance(item, dict) and (found := reward_value(item.get("value"), key)) is not None:
            dimensions[str(item.get("name") or f"reward_{index}")] = found
    scalar = reward_value(attributes.get(REWARD_KEY), REWARD_KEY)
    evaluation = reward_value(attributes.get(SCORE_KEY), SCORE_KEY)
    if scalar is None and evaluation is not None and (own or "gen_ai.evaluation.name" in attributes):
        scalar = evaluation
        if attributes.get("gen_ai.evaluation.name"):
            dimensions.setdefault(str(attributes["gen_ai.evaluation.name"]), evaluation)
    if scalar is None and own:
        key = "reward" if "reward" in attributes else "value"
        scalar = reward_value(attributes.get(key), key)
    if scalar is None and dimensions:
        primary = "reward_0" if "reward_0" in dimensions else None
        scalar = dimensions[primary] if primary else sum(dimensions.values())
        if not math.isfinite(scalar):
            raise RejectedSpan("the sum of the reward dimensions overflows a float")
    return scalar, dimensions


def _event_reward(name: str, attributes: Mapping[str, Any]) -> tuple[float | None, dict[str, float]]:
    if name == EVALUATION_EVENT:
        score = reward_value(attributes.get(SCORE_KEY), f"event {name!r}: {SCORE_KEY}")
        label = attributes.get("gen_ai.evaluation.name")
        return score, ({str(label): score} if label and score is not None else {})
    if name.lower() in REWARD_NAMES:
        return reward_of(attributes, own=True)
    return None, {}


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, str):
        try:
            value = json_value(value)
        except NotJson:
            return None
    if isinstance(value, list) and value and set(map(type, value)) == {int}:  # decoded values: no int subclass but bool
        return value
    return None


def _floats(value: Any) -> list[float] | None:
    if isinstance(value, str):
        try:
            value = json_value(value)
        except NotJson:
            return None
    if not (isinstance(value, list) and value):
        return None
    if set(map(type, value)) == {float} and all(map(math.isfinite, value)):  # the usual case, in C loops
        return value
    numbers = [n for n in map(number, value) if n is not None]  # ints, and numbers written as text
    return numbers if len(numbers) == len(value) else None


class TraceMapper:
    """Maps OTLP export requests to Span records; remembers which rollout each recent trace belongs to."""

    def __init__(self, *, complete_on_root: bool = True, remember_traces: int = 100_000) -> None:
        self.complete_on_root = complete_on_root
        self.remember = remember_traces
        self.identities: OrderedDict[str, Identity] = OrderedDict()

    def _identities(self, decoded: list[tuple[dict[str, Any], list[tuple[OtelSpan, dict[str, Any]]]]]
                    ) -> dict[str, Identity]:
        """Each trace's identity: named by any span (or resource) of it in this request, else remembered."""
        found: dict[str, dict[str, str]] = {}
        agents: dict[str, tuple[bool, int, str]] = {}  # trace -> (not a root, start, gen_ai.agent.name): roots first
        for resource, spans in decoded:
            for span, attributes in spans:
                trace = span.trace_id.hex()
                named = found.setdefault(trace, {})
                agent = attributes.get("gen_ai.agent.name")
                if agent:
                    candidate = (bool(span.parent_span_id), span.start_time_unix_nano, str(agent))
                    agents[trace] = min(agents.get(trace, candidate), candidate)
                for slot, keys in (("rollout", ROLLOUT_KEYS), ("attempt", ATTEMPT_KEYS), ("agent", AGENT_KEYS),
                                   ("task", TASK_KEYS), ("group", GROUP_KEYS)):
                    if slot not in named:
                        value = first(keys, attributes, resource)
                        if value is not None:
                            named[slot] = value
        identities = {}
        for trace, named in found.items():
            known = self.identities.get(trace)
            if known is not None and "rollout" not in named:
                identity = known
            else:
                rollout_id = named.get("rollout") or trace
                agent_name = named.get("agent") or (agents[trace][2] if trace in agents else None) or \
                    (known.agent_name if known is not None else None)
                identity = Identity(rollout_id, named.get("attempt") or f"{rollout_id}-1", "rollout" in named,
                                    agent_name, named.get("task"), named.get("group"))
            identities[trace] = identity
            self.identities[trace] = identity
            self.identities.move_to_end(trace)
        while len(self.identities) > self.remember:
            self.identities.popitem(last=False)
        return identities

    def map(self, request: ExportTraceServiceRequest, now_us: int) -> Mapped:
        mapped = Mapped()
        # each resource's attributes and its spans with theirs, decoded once
        decoded: list[tuple[dict[str, Any], list[tuple[OtelSpan, dict[str, Any]]]]] = []
        contexts: list[dict[str, str]] = []
        for resource_spans in request.resource_spans:
            resource = attributes_of(resource_spans.resource.attributes)
            resource_text = {f"otel.resource.{key}": text(value) for key, value in resource.items()
                             if value is not None}
            spans: list[tuple[OtelSpan, dict[str, Any]]] = []
            for scope_spans in resource_spans.scope_spans:
                scope = {"otel.scope.name": scope_spans.scope.name, "otel.scope.version": scope_spans.scope.version}
                context = {**resource_text, **{key: value for key, value in scope.items() if value}}
                spans.extend((span, attributes_of(span.attributes)) for span in scope_spans.spans)
                contexts.extend(context for _ in scope_spans.spans)
            decoded.append((resource, spans))
        identities = self._identities(decoded)
        position = 0
        for resource, spans in decoded:
            for span, attributes in spans:
                try:
                    self._map_span(span, attributes, identities, resource, contexts[position], mapped, now_us)
                except RejectedSpan as error:
                    mapped.rejected.append((str(error), span_json(span)))
                position += 1
        return mapped

    def _map_span(self, span: OtelSpan, attributes: dict[str, Any], identities: dict[str, Identity],
                  resource: dict[str, Any], context: dict[str, str], mapped: Mapped, now_us: int) -> None:
        if len(span.trace_id) != 16 or not any(span.trace_id):
            raise RejectedSpan(f"span {span.name!r}: trace_id must be 16 bytes, not all zero "
                               f"(got {len(span.trace_id)} bytes)")
        if len(span.span_id) != 8 or not any(span.span_id):
            raise RejectedSpan(f"span {span.name!r}: span_id must be 8 bytes, not all zero "
                               f"(got {len(span.span_id)} bytes)")
        if span.parent_span_id and len(span.parent_span_id) != 8:
            raise RejectedSpan(f"span {span.name!r}: parent_span_id must be 8 bytes or empty")
        start_us, end_us = span.start_time_unix_nano // 1000, span.end_time_unix_nano // 1000
        if start_us <= 0 or end_us < start_us:
            raise RejectedSpan(f"span {span.name!r}: needs start_time_unix_nano > 0 and end >= start "
                               f"(got {span.start_time_unix_nano}, {span.end_time_unix_nano})")
        identity = identities[span.trace_id.hex()]
        span_id, parent_id = span.span_id.hex(), span.parent_span_id.hex() or None
        events = [(event.name, event.time_unix_nano // 1000, attributes_of(event.attributes)) for event in span.events]
        name = span.name or "span"
        kind = span_kind(name, attributes)
        added = normalise(attributes, events, kind)
        merged = {**attributes, **added}
        try:
            own_reward, own_dimensions = reward_of(merged, own=kind == "REWARD")
            event_rewards = [_event_reward(event_name, event_attributes) for event_name, _, event_attributes in events]
        except RejectedSpan as error:
            raise RejectedSpan(f"span {name!r}: {error}") from None
        if kind == "REWARD" and own_reward is None:
            kind = "OTHER"  # a span named like a reward but carrying no number: kept as it is
        named = [next((key for key in names if key in merged), "") for names in TOKEN_KEYS]
        tokens = {key: merged.pop(key) for key in named if key}
        prompt_ids, response_ids = _ints(tokens.get(named[0])), _ints(tokens.get(named[1]))
        logprobs = _floats(tokens.get(named[2]))
        if prompt_ids is None or response_ids is None or (logprobs is not None and len(logprobs) != len(response_ids)):
            merged.update(tokens)  # not a usable set of token ids: kept as attributes
            prompt_ids = response_ids = logprobs = None
        elif logprobs is None and named[2]:
            merged[named[2]] = tokens[named[2]]  # logprobs that are not finite numbers: kept, the ids trainable
        policy = merged.pop(POLICY_KEY, None)
        policy_version = int(policy) if isinstance(policy, int) or (isinstance(policy, str) and policy.isdigit()) \
            else None
        if policy is not None and policy_version is None:
            merged[POLICY_KEY] = policy
        reward_events, other_events = [], []
        for index, (event, (value, dimensions)) in enumerate(zip(events, event_rewards, strict=True)):
            event_name, at_us, event_attributes = event
            if value is None:
                other_events.append({"name": event_name, "time_us": at_us, "attributes": event_attributes})
            else:
                reward_events.append((index, event_name, at_us, event_attributes, value, dimensions))
        texts = {key: text(value) for key, value in merged.items() if value is not None}
        texts.update(context)
        texts[SOURCE_ATTRIBUTE] = SOURCE
        texts["otel.trace_id"] = span.trace_id.hex()
        texts["otel.span_kind"] = OTEL_SPAN_KINDS.get(span.kind, str(span.kind))
        if span.trace_state:
            texts["otel.trace_state"] = span.trace_state
        if other_events:
            texts["otel.events"] = text(other_events)
        if span.links:
            texts["otel.links"] = text([{"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex(),
                                         "attributes": attributes_of(link.attributes)} for link in span.links])
        for counter in ("dropped_attributes_count", "dropped_events_count", "dropped_links_count"):
            if getattr(span, counter):
                texts[f"otel.{counter}"] = str(getattr(span, counter))
        status = STATUS.get(span.status.code, "UNSET")
        message = span.status.message or None
        if status == "ERROR" and message is None:
            message = next((str(e["attributes"].get("exception.message")) for e in other_events
                            if e["name"] == "exception" and e["attributes"].get("exception.message")), None)
        agent_name = identity.agent_name or _service(resource)
        model = None
        if kind == "LLM":
            model = first(("gen_ai.response.model", "gen_ai.request.model"), merged)
            if prompt_ids is None:
                mapped.analytics_only_llm += 1
        common: _Attribution = {"rollout_id": identity.rollout_id, "attempt_id": identity.attempt_id,
                                "agent_name": agent_name, "task_id": identity.task_id, "group_id": identity.group_id}
        mapped.spans.append({
            "span_id": span_id, "parent_id": parent_id, "name": name, "kind": kind, "start_time_us": start_us,
            "end_time_us": end_us, "status": status, "status_message": message, "model": model,
            "attributes": texts, "prompt_token_ids": prompt_ids, "response_token_ids": response_ids,
            "response_logprobs": logprobs if prompt_ids is not None else None,
            "reward": own_reward if kind == "REWARD" else None,
            "reward_dimensions": (own_dimensions or None) if kind == "REWARD" else None,
            "policy_version": policy_version, **common,
        })
        derived = {SOURCE_ATTRIBUTE: SOURCE, "otel.trace_id": span.trace_id.hex()}
        if kind != "REWARD" and own_reward is not None:
            mapped.spans.append({
                "span_id": f"{span_id}.reward", "parent_id": span_id, "name": "reward", "kind": "REWARD",
                "start_time_us": end_us, "end_time_us": end_us, "status": "OK", "status_message": None,
                "model": None, "attributes": {**derived, "agentstream.reward.from": "attribute"},
                "reward": own_reward, "reward_dimensions": own_dimensions or None, **common})
        for index, event_name, at_us, event_attributes, value, dimensions in reward_events:
            mapped.spans.append({
                "span_id": f"{span_id}.event{index}", "parent_id": span_id, "name": event_name, "kind": "REWARD",
                "start_time_us": at_us or end_us, "end_time_us": at_us or end_us, "status": "OK",
                "status_message": None, "model": None, "reward": value, "reward_dimensions": dimensions or None,
                "attributes": {**derived, "agentstream.reward.from": "event",
                               **{key: text(v) for key, v in event_attributes.items() if v is not None}},
                **common})
        if parent_id is None and self.complete_on_root and not identity.named:
            mapped.events.append({
                "rollout_id": identity.rollout_id, "attempt_id": identity.attempt_id,
                "event": "FAILED" if status == "ERROR" else "SUCCEEDED", "at_us": now_us, "worker_id": None,
                "error": message if status == "ERROR" else None, "task_id": identity.task_id,
                "agent_name": agent_name})


def _service(resource: Mapping[str, Any]) -> str | None:
    name = resource.get("service.name")
    return str(name) if name and not str(name).startswith("unknown_service") else None


def span_json(span: OtelSpan) -> dict[str, Any]:
    """A refused span, readable in a dead letter (ids as hex, as OTLP/JSON writes them)."""
    return {"traceId": span.trace_id.hex(), "spanId": span.span_id.hex(), "parentSpanId": span.parent_span_id.hex(),
            "name": span.name, "kind": span.kind, "startTimeUnixNano": str(span.start_time_unix_nano),
            "endTimeUnixNano": str(span.end_time_unix_nano), "attributes": attributes_of(span.attributes)}
