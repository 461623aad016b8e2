"""The OTLP receiver's decoding: an OTLP/JSON body with hex ids decodes and maps to a span."""

from __future__ import annotations

import json

from agentstream.pipeline.collector.mapping import TraceMapper
from agentstream.pipeline.collector.receiver import decode_request


def test_otlp_json_with_hex_ids_decodes():
    body = json.dumps({"resourceSpans": [{"resource": {"attributes": [
        {"key": "service.name", "value": {"stringValue": "js-agent"}}]}, "scopeSpans": [{"spans": [{
            "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174",
            "parentSpanId": "eee19b7ec3c1b173", "name": "chat m", "kind": 3,
            "startTimeUnixNano": "1544712660000000000", "endTimeUnixNano": 1544712661000000000,
            "attributes": [{"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}},
                           {"key": "gen_ai.request.model", "value": {"stringValue": "m"}}],
            "status": {"code": 2, "message": "boom"}, "unknownField": 1}]}]}]}).encode()
    (span,) = TraceMapper().map(decode_request(body, "application/json"), now_us=1).spans
    assert (span["rollout_id"], span["span_id"], span["parent_id"]) == (
        "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174", "eee19b7ec3c1b173")
    assert (span["kind"], span["status"], span["status_message"], span["agent_name"]) == ("LLM", "ERROR", "boom",
                                                                                         "js-agent")
    assert span["start_time_us"] == 1544712660000000
