"""OTel spans made by the official OpenTelemetry SDK, encoded by its OTLP encoder, mapped to Span records."""

from __future__ import annotations

import json

import pytest
from google.rpc import status_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentstream.pipeline.collector.mapping import TraceMapper, any_value, unflatten
from agentstream.pipeline.collector.receiver import PROTOBUF, Refused, decode_request, status_protobuf
from agentstream.schemas.span_writer import prepare_span


def export(build, resource: dict | None = None):
    """Run ``build(tracer)`` on a real SDK tracer; the OTLP request its exporter would send."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "math-agent", **(resource or {})}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    build(provider.get_tracer("test-agent", "1.0"))
    provider.shutdown()
    return encode_spans(exporter.get_finished_spans())


def by_name(mapped) -> dict[str, dict]:
    return {span["name"]: span for span in mapped.spans}


def test_gen_ai_spans_and_rewards_map_to_one_rollout_per_trace():
    def build(tracer):
        with tracer.start_as_current_span("invoke_agent solver", attributes={"gen_ai.operation.name": "invoke_agent",
                                                                             "custom.flag": True}) as root:
            with tracer.start_as_current_span("chat gpt-4o", kind=trace.SpanKind.CLIENT, attributes={
                    "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o",
                    "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 3}) as llm:
                llm.add_event("gen_ai.user.message", {"content": "2+2?"})
                llm.add_event("gen_ai.choice", {"index": 0, "finish_reason": "stop", "message": '{"content":"4"}'})
            with tracer.start_as_current_span("execute_tool calculator", attributes={
                    "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "calculator",
                    "agentstream.reward": 0.5}):
                pass
            root.add_event("gen_ai.evaluation.result", {"gen_ai.evaluation.name": "correctness",
                                                        "gen_ai.evaluation.score.value": 1.0,
                                                        "gen_ai.evaluation.score.label": "pass"})
            root.add_event("retry", {"attempt": 2})
            root.set_status(trace.StatusCode.OK)

    mapped = TraceMapper().map(export(build), now_us=1)
    spans = by_name(mapped)
    root, llm, tool = spans["invoke_agent solver"], spans["chat gpt-4o"], spans["execute_tool calculator"]
    trace_id = root["attributes"]["otel.trace_id"]
    assert {span["rollout_id"] for span in mapped.spans} == {trace_id}
    assert {span["attempt_id"] for span in mapped.spans} == {f"{trace_id}-1"}
    assert (root["kind"], llm["kind"], tool["kind"]) == ("AGENT", "LLM", "TOOL")
    assert llm["parent_id"] == root["span_id"] and tool["parent_id"] == root["span_id"] and root["parent_id"] is None
    assert llm["model"] == "gpt-4o" and llm["prompt_token_ids"] is None, "analytics only: no token ids"
    assert mapped.analytics_only_llm == 1
    assert json.loads(llm["attributes"]["gen_ai.input.messages"]) == [{"role": "user", "content": "2+2?"}]
    assert json.loads(llm["attributes"]["gen_ai.output.messages"])[0]["finish_reason"] == "stop"
    assert root["agent_name"] == "math-agent" and root["attributes"]["otel.resource.service.name"] == "math-agent"
    assert root["attributes"]["custom.flag"] == "true", "unmapped attributes are kept"
    assert json.loads(root["attributes"]["otel.events"]) == [{"name": "retry", "time_us": pytest.approx(
        json.loads(root["attributes"]["otel.events"])[0]["time_us"]), "attributes": {"attempt": 2}}]
    assert root["attributes"]["otel.scope.name"] == "test-agent" and llm["attributes"]["otel.span_kind"] == "CLIENT"
    rewards = [span for span in mapped.spans if span["kind"] == "REWARD"]
    assert sorted((r["reward"], r["parent_id"]) for r in rewards) == [(0.5, tool["span_id"]), (1.0, root["span_id"])]
    evaluation = next(r for r in rewards if r["reward"] == 1.0)
    assert evaluation["reward_dimensions"] == {"correctness": 1.0}
    assert evaluation["attributes"]["gen_ai.evaluation.score.label"] == "pass"
    assert [(e["rollout_id"], e["event"]) for e in mapped.events] == [(trace_id, "SUCCEEDED")]
    for span in mapped.spans:
        prepare_span(span)  # every record fits the Span schema


def test_openinference_and_openllmetry_names_fill_gen_ai_and_token_ids_make_a_trainable_span():
    def build(tracer):
        with tracer.start_as_current_span("agent", attributes={"openinference.span.kind": "AGENT",
                                                               "input.value": "question"}):
            with tracer.start_as_current_span("ChatCompletion", attributes={
                    "openinference.span.kind": "LLM", "llm.model_name": "tiny", "llm.token_count.prompt": 5,
                    "llm.token_count.completion": 2, "llm.input_messages.0.message.role": "user",
                    "llm.input_messages.0.message.content": "hi", "llm.output_messages.0.message.role": "assistant",
                    "llm.output_messages.0.message.content": "yo",
                    "llm.invocation_parameters": '{"temperature": 0.7, "max_tokens": 9}',
                    "agentstream.prompt_token_ids": [1, 2, 3], "agentstream.response_token_ids": [4, 5],
                    "agentstream.response_logprobs": [-0.5, -0.25], "agentstream.policy_version": 3}):
                pass
            with tracer.start_as_current_span("openai.chat", attributes={
                    "llm.request.type": "chat", "gen_ai.system": "openai", "gen_ai.request.model": "gpt-4o-mini",
                    "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "hello",
                    "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "hi",
                    "gen_ai.usage.prompt_tokens": 7, "gen_ai.usage.completion_tokens": 1}):
                pass
            with tracer.start_as_current_span("search.tool", attributes={
                    "traceloop.span.kind": "tool", "traceloop.entity.name": "search",
                    "traceloop.entity.input": '{"q": "x"}'}):
                pass
            with tracer.start_as_current_span("reward", attributes={"agentlightning.reward.0.value": 0.25}):
                pass

    spans = by_name(TraceMapper().map(export(build, {"agentstream.rollout_id": "r-42"}), now_us=1))
    assert {span["rollout_id"] for span in spans.values()} == {"r-42"}
    oi, traceloop = spans["ChatCompletion"], spans["openai.chat"]
    assert oi["kind"] == "LLM" and oi["model"] == "tiny"
    assert (oi["prompt_token_ids"], oi["response_token_ids"], oi["response_logprobs"]) == ([1, 2, 3], [4, 5],
                                                                                           [-0.5, -0.25])
    assert oi["policy_version"] == 3 and "agentstream.prompt_token_ids" not in oi["attributes"]
    assert oi["attributes"]["gen_ai.usage.input_tokens"] == "5" and oi["attributes"]["gen_ai.request.temperature"]
    assert json.loads(oi["attributes"]["gen_ai.input.messages"]) == [{"role": "user", "content": "hi"}]
    assert oi["attributes"]["llm.input_messages.0.message.content"] == "hi", "originals are kept"
    assert traceloop["kind"] == "LLM" and traceloop["model"] == "gpt-4o-mini"
    assert json.loads(traceloop["attributes"]["gen_ai.output.messages"]) == [{"role": "assistant", "content": "hi"}]
    assert traceloop["attributes"]["gen_ai.usage.output_tokens"] == "1"
    assert traceloop["attributes"]["gen_ai.provider.name"] == "openai"
    assert spans["search.tool"]["kind"] == "TOOL" and spans["search.tool"]["attributes"]["gen_ai.tool.name"] == "search"
    assert spans["agent"]["kind"] == "AGENT"
    assert (spans["reward"]["kind"], spans["reward"]["reward"]) == ("REWARD", 0.25)
    for span in spans.values():
        prepare_span(span)


def test_agent_lightning_token_id_attributes_make_a_trainable_span_and_ours_win_where_both_are_set():
    """Agent Lightning's AgentOps instrumentation writes ``prompt_token_ids``/``response_token_ids`` on its LLM
    spans; they fill the token fields as ours do. Where a span carries both names, ``agentstream.*`` wins and the
    other stays an attribute."""
    def build(tracer):
        with tracer.start_as_current_span("agent"):
            with tracer.start_as_current_span("openai.chat.completion", attributes={
                    "gen_ai.operation.name": "chat", "gen_ai.request.model": "tiny",
                    "prompt_token_ids": [7, 8, 9], "response_token_ids": [10, 11]}):
                pass
            with tracer.start_as_current_span("both", attributes={
                    "gen_ai.operation.name": "chat", "agentstream.prompt_token_ids": [1], "prompt_token_ids": [2],
                    "agentstream.response_token_ids": [3], "response_token_ids": "not ids"}):
                pass

    spans = by_name(TraceMapper().map(export(build), now_us=1))
    agl, both = spans["openai.chat.completion"], spans["both"]
    assert (agl["kind"], agl["prompt_token_ids"], agl["response_token_ids"]) == ("LLM", [7, 8, 9], [10, 11])
    assert "prompt_token_ids" not in agl["attributes"] and "response_token_ids" not in agl["attributes"]
    assert (both["prompt_token_ids"], both["response_token_ids"]) == ([1], [3])
    assert json.loads(both["attributes"]["prompt_token_ids"]) == [2] and both["attributes"]["response_token_ids"] \
        == "not ids"
    for span in spans.values():
        prepare_span(span)


@pytest.mark.parametrize("logprobs", ["[" + "9" * 400 + "]", "[1e400]", '["-0.5", "nan"]', "[-0.5, true]", "[]"])
def test_logprobs_that_are_not_finite_numbers_are_kept_as_an_attribute_and_never_reach_the_logprobs_field(logprobs):
    """A hostile exporter's logprobs (an int past a double's range, infinity, NaN as text, a bool, none): no error,
    the token ids are kept (a span with ids and no logprobs is trainable) and so is what was sent, as text."""
    def build(tracer):
        with tracer.start_as_current_span("chat", attributes={
                "gen_ai.operation.name": "chat", "agentstream.prompt_token_ids": [1, 2],
                "agentstream.response_token_ids": [3], "agentstream.response_logprobs": logprobs}):
            pass

    [span] = TraceMapper().map(export(build), now_us=1).spans
    assert (span["prompt_token_ids"], span["response_token_ids"], span["response_logprobs"]) == ([1, 2], [3], None)
    assert span["attributes"]["agentstream.response_logprobs"] == logprobs
    prepare_span(span)


def test_a_named_rollout_is_remembered_across_requests_and_not_ended_by_a_root():
    mapper = TraceMapper()
    tracer_state = {}

    def first(tracer):
        with tracer.start_as_current_span("root", attributes={"agentstream.rollout_id": "r-7"}) as root:
            tracer_state["context"] = trace.set_span_in_context(root)

    def second(tracer):
        with tracer.start_as_current_span("late child", context=tracer_state["context"]):
            pass

    one = mapper.map(export(first), now_us=1)
    two = mapper.map(export(second), now_us=1)
    assert one.spans[0]["rollout_id"] == two.spans[0]["rollout_id"] == "r-7"
    assert one.events == [], "a rollout named by attribute ends after idle time, not at a root span"


def test_bad_spans_are_refused_one_by_one_and_bad_bodies_as_a_whole():
    request = export(lambda tracer: tracer.start_span("ok").end())
    request.resource_spans[0].scope_spans[0].spans.add(trace_id=b"\x01" * 5, span_id=b"\x02" * 8, name="short id")
    mapped = TraceMapper().map(request, now_us=1)
    assert [span["name"] for span in mapped.spans] == ["ok"]
    (reason, refused), = mapped.rejected
    assert "trace_id must be 16 bytes" in reason and refused["name"] == "short id"
    with pytest.raises(Refused) as raised:
        decode_request(b"\x0a\xff\xff\xff\xff\x0f garbage", PROTOBUF)
    assert raised.value.status == 400
    with pytest.raises(Refused):
        decode_request(b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}', "application/json")
    status = status_pb2.Status.FromString(status_protobuf(3, "bad body ✓"))
    assert (status.code, status.message) == (3, "bad body ✓")


def test_unflatten():
    attributes = {"p.0.role": "user", "p.0.tool_calls.0.name": "f", "p.1.role": "assistant", "p.x": 1}
    assert unflatten(attributes, "p.") == [{"role": "user", "tool_calls": [{"name": "f"}]}, {"role": "assistant"}]


def _one_by_one(value: AnyValue) -> object:
    """What the collector reads value by value (the path for arrays the compiled reader leaves to it)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_one_by_one(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return {item.key: _one_by_one(item.value) for item in value.kvlist_value.values}
    return None if kind is None else value.bytes_value.hex() if kind == "bytes_value" else getattr(value, kind)


PRIMITIVE_VALUES = st.one_of(
    st.builds(lambda v: AnyValue(int_value=v), st.integers(-(2**63), 2**63 - 1)),
    st.builds(lambda v: AnyValue(double_value=v), st.floats(allow_nan=False)),
    st.builds(lambda v: AnyValue(string_value=v), st.text(max_size=20)),
    st.builds(lambda v: AnyValue(bool_value=v), st.booleans()),
    st.builds(lambda v: AnyValue(bytes_value=v), st.binary(max_size=8)),
    st.just(AnyValue()))


def _array(items: list[AnyValue], nested: list[AnyValue] | None) -> AnyValue:
    value = AnyValue()
    value.array_value.values.extend(items)
    if nested is not None:
        value.array_value.values.add().array_value.values.extend(nested)
    return value


@settings(max_examples=600, deadline=None, derandomize=True)
@given(st.one_of(
    st.builds(lambda kind, size: _array([kind] * size, None), PRIMITIVE_VALUES, st.integers(0, 300)),
    st.builds(_array, st.lists(PRIMITIVE_VALUES, max_size=12), st.none() | st.lists(PRIMITIVE_VALUES, max_size=3))))
def test_arrays_read_in_compiled_code_equal_those_read_value_by_value(value):
    """Token ids and logprobs arrive as arrays of hundreds of values: the compiled reader takes an array of one
    primitive kind in one pass, and leaves mixed, nested, bytes and unset values to the Python path; either way
    the result is what reading each value gives."""
    assert any_value(value) == _one_by_one(value)
