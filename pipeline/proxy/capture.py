"""One LLM call as the proxy sees it: the request it sends upstream, what each choice generated, and its spans.

The proxy asks the model server for token ids and logprobs (vLLM's ``return_token_ids`` / ``logprobs``
contract), accumulates each choice across stream chunks or reads it from one response, strips from the
client's view whatever the client did not ask for, and turns each choice into one LLM span.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentstream.deploy.deployments import split_adapter_name
from agentstream.deploy.routing import Route
from agentstream.pipeline.proxy.trace_context import TraceContext
from agentstream.pipeline.sdk import Rollout, build_span
from agentstream.schemas.records import SpanRecord
from agentstream.schemas.responses_api import ResponsesAnswer


@dataclass
class ChoiceCapture:
    """What one choice generated: accumulated across stream chunks or read from one response."""

    index: int
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None


@dataclass
class CallCapture:
    """One proxied call: request, attribution, timing and the per-choice captures."""

    operation: str
    request: dict[str, Any]
    owner: Rollout
    started_us: int
    route: Route | None = None
    policy_version: int | None = None
    response_id: str | None = None
    response_model: str | None = None
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    choices: dict[int, ChoiceCapture] = field(default_factory=dict)
    error: str | None = None
    trace: TraceContext | None = None
    upstream: str | None = None  # the model server that answered (set when the proxy fronts several)
    retried: bool = False  # it failed on one model server before its first byte and went to another
    answer: ResponsesAnswer | None = None  # the client called /v1/responses: what it reads is reshaped

    def choice(self, index: int) -> ChoiceCapture:
        return self.choices.setdefault(index, ChoiceCapture(index))


def upstream_request(body: dict[str, Any], operation: str, route: Route | None = None) -> dict[str, Any]:
    """The request sent upstream: the client's, on its routed model, plus token ids and sampled-token logprobs."""
    forwarded = dict(body)
    if route is not None and route.reason != "unrouted":
        forwarded["model"] = route.upstream_model
    forwarded["return_token_ids"] = True
    if operation == "chat":
        forwarded["logprobs"] = True
    elif not isinstance(body.get("logprobs"), int) or isinstance(body.get("logprobs"), bool):
        forwarded["logprobs"] = 0
    if body.get("stream"):
        forwarded["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return forwarded


def client_view(payload: dict[str, Any], request: dict[str, Any], operation: str) -> dict[str, Any]:
    """Remove from a response (or stream chunk) the fields the client did not ask for."""
    keep_ids = bool(request.get("return_token_ids"))
    wants_logprobs = request.get("logprobs") not in (None, False) if operation == "chat" else \
        request.get("logprobs") is not None
    if not keep_ids:
        payload.pop("prompt_token_ids", None)
    for choice in payload.get("choices") or ():
        if not keep_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if not wants_logprobs and "logprobs" in choice:
            choice["logprobs"] = None
    return payload


def _chat_logprobs(choice: dict[str, Any]) -> list[float] | None:
    content = (choice.get("logprobs") or {}).get("content")
    return None if content is None else [float(entry["logprob"]) for entry in content]


def _completion_logprobs(choice: dict[str, Any]) -> list[float] | None:
    values = (choice.get("logprobs") or {}).get("token_logprobs")
    return None if values is None else [float(v) for v in values]


def absorb(capture: CallCapture, payload: dict[str, Any], streamed: bool) -> None:
    """Fold a response body, or one stream chunk, into the capture."""
    capture.response_id = payload.get("id", capture.response_id)
    capture.response_model = payload.get("model", capture.response_model)
    if payload.get("prompt_token_ids") is not None:
        capture.prompt_token_ids = list(payload["prompt_token_ids"])
    if payload.get("usage"):
        capture.usage = payload["usage"]
    for choice in payload.get("choices") or ():
        slot = capture.choice(int(choice.get("index", 0)))
        if choice.get("prompt_token_ids") is not None:
            slot.prompt_token_ids = list(choice["prompt_token_ids"])
        if choice.get("token_ids") is not None:
            slot.token_ids = (slot.token_ids or []) + list(choice["token_ids"])
        logprobs = _chat_logprobs(choice) if capture.operation == "chat" else _completion_logprobs(choice)
        if logprobs is not None:
            slot.logprobs = (slot.logprobs or []) + logprobs
        if choice.get("finish_reason"):
            slot.finish_reason = choice["finish_reason"]
        message = choice.get("delta" if streamed else "message") or {}
        if capture.operation == "text_completion":
            slot.text += choice.get("text") or ""
        else:
            slot.text += message.get("content") or ""
            _merge_tool_calls(slot.tool_calls, message.get("tool_calls") or [], streamed)


def _merge_tool_calls(into: list[dict[str, Any]], calls: list[dict[str, Any]], streamed: bool) -> None:
    if not streamed:
        into.extend(calls)
        return
    for delta in calls:  # stream deltas carry an index; arguments arrive in pieces
        index = delta.get("index", len(into))
        while len(into) <= index:
            into.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        call = into[index]
        call["id"] = delta.get("id") or call["id"]
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""


def spans_of(capture: CallCapture, ended_us: int) -> list[SpanRecord]:
    """One LLM span per choice (n > 1 samples are separate trajectories' steps), or one error span."""
    request = capture.request
    served = capture.response_model or request.get("model")
    model = split_adapter_name(served)[0] if isinstance(served, str) else served  # the trained model, not its adapter
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": capture.operation,
        "gen_ai.request.model": request.get("model"),
        "gen_ai.request.stream": bool(request.get("stream")),
    }
    for key, name in (("temperature", "gen_ai.request.temperature"), ("top_p", "gen_ai.request.top_p"),
                      ("max_tokens", "gen_ai.request.max_tokens"), ("n", "gen_ai.request.choice.count"),
                      ("seed", "gen_ai.request.seed")):
        if request.get(key) is not None:
            attributes[name] = request[key]
    if "messages" in request:
        attributes["gen_ai.input.messages"] = request["messages"]
    elif "prompt" in request:
        attributes["gen_ai.input.prompt"] = request["prompt"]
    if request.get("tools"):
        attributes["gen_ai.tool.definitions"] = request["tools"]
    if capture.response_id:
        attributes["gen_ai.response.id"] = capture.response_id
    if capture.response_model:
        attributes["gen_ai.response.model"] = capture.response_model
    attributes["agentstream.latency_ms"] = round((ended_us - capture.started_us) / 1000, 3)
    if capture.route is not None and capture.route.reason != "unrouted":
        attributes["agentstream.route"] = capture.route.reason
    if capture.upstream is not None:
        attributes["agentstream.upstream"] = capture.upstream
    if capture.retried:
        attributes["agentstream.upstream.retried"] = True
    trace = capture.trace
    if trace is not None and trace.trace_id:
        attributes["otel.trace_id"] = trace.trace_id
    common: dict[str, Any] = {"model": model, "policy_version": capture.policy_version,
                              "parent_id": trace.parent_span_id if trace is not None else None}
    name = f"{'chat' if capture.operation == 'chat' else 'text_completion'} {model}"
    if capture.error is not None or not capture.choices:
        if capture.usage:
            attributes.update(_usage(capture.usage.get("prompt_tokens"), capture.usage.get("completion_tokens")))
        return [build_span(capture.owner, name, "LLM", capture.started_us, ended_us, attributes=attributes,
                           status="ERROR", status_message=capture.error or "upstream returned no choices", **common)]
    spans = []
    for index in sorted(capture.choices):
        choice = capture.choices[index]
        prompt_ids = choice.prompt_token_ids if choice.prompt_token_ids is not None else capture.prompt_token_ids
        choice_attributes = {**attributes, "gen_ai.response.finish_reasons": [choice.finish_reason],
                             "agentstream.choice.index": index,
                             "gen_ai.output.messages": [{"role": "assistant", "content": choice.text or None,
                                                         "tool_calls": choice.tool_calls or None}]}
        if prompt_ids is None or choice.token_ids is None:
            choice_attributes["agentstream.token_ids_missing"] = True
        choice_attributes.update(_choice_usage(capture, choice, first=index == min(capture.choices)))
        spans.append(build_span(
            capture.owner, name, "LLM", capture.started_us, ended_us, attributes=choice_attributes,
            prompt_token_ids=prompt_ids, response_token_ids=choice.token_ids, response_logprobs=choice.logprobs,
            **common))
    return spans


def _usage(input_tokens: Any, output_tokens: Any) -> dict[str, Any]:
    return {name: value for name, value in (("gen_ai.usage.input_tokens", input_tokens),
                                            ("gen_ai.usage.output_tokens", output_tokens)) if value is not None}


def _choice_usage(capture: CallCapture, choice: ChoiceCapture, *, first: bool) -> dict[str, Any]:
    """A choice's own token counts, summable in SQL: its completion tokens, and the prompt once per call.

    The prompt was processed once for all ``n`` choices, so only the first choice's span carries
    ``gen_ai.usage.input_tokens``; every span carries its own ``gen_ai.usage.output_tokens``
    (the length of its token ids, or the call's usage when there is a single choice without ids).
    """
    usage = capture.usage or {}
    single = len(capture.choices) == 1
    output = len(choice.token_ids) if choice.token_ids is not None else (
        usage.get("completion_tokens") if single else None)
    prompt_ids = choice.prompt_token_ids if choice.prompt_token_ids is not None else capture.prompt_token_ids
    prompt = usage.get("prompt_tokens", len(prompt_ids) if prompt_ids is not None else None)
    return _usage(prompt if first else None, output)


