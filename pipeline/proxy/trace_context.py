"""W3C trace context on a proxied request: ``traceparent`` names the rollout and parent span, ``baggage`` stands in
for the X-Agentstream-* headers."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import unquote

TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
BAGGAGE_PREFIX = "agentstream."


@dataclass(frozen=True)
class TraceContext:
    """What a request's W3C ``traceparent`` and ``baggage`` headers say (trace_id None: no valid traceparent)."""

    trace_id: str | None = None
    parent_span_id: str | None = None
    baggage: dict[str, str] = field(default_factory=dict)


def trace_context(headers) -> TraceContext:
    """Parse ``traceparent`` (version 00 and later, invalid ones ignored as the spec says) and ``baggage``."""
    trace_id = parent = None
    match = TRACEPARENT.match((headers.get("traceparent") or "").strip().lower())
    if match and match[1] != "ff" and (match[1] != "00" or match[5] is None) \
            and match[2].strip("0") and match[3].strip("0"):
        trace_id, parent = match[2], match[3]
    baggage: dict[str, str] = {}
    for header in headers.getall("baggage", []) if hasattr(headers, "getall") else [headers.get("baggage") or ""]:
        for member in header.split(","):
            key, sep, value = member.split(";", 1)[0].partition("=")
            if sep and key.strip():
                baggage[unquote(key.strip())] = unquote(value.strip())
    return TraceContext(trace_id, parent, baggage)
