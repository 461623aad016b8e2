"""JSON from outside (a request body, an attribute, a tool call's arguments), refused with a reason whatever the
bytes: the one parser the servers share.

Python's ``json`` raises ``RecursionError`` on a document nested some thousands of levels deep; a server
that catches only ``JSONDecodeError`` answers such a body with a 500 and a traceback. Here every text is
a value (or a ``dict``, for :func:`json_object`) or a :class:`NotJson` saying why not.
"""

from __future__ import annotations

import json
from typing import Any

from agentstream.schemas.errors import AgentstreamError

__all__ = ["NotAJsonObject", "NotJson", "json_object", "json_value"]


class NotJson(AgentstreamError, ValueError):
    """The text is not JSON: not UTF-8, not valid JSON, or nested too deeply to parse."""


class NotAJsonObject(NotJson):
    """The body is not a JSON object: not JSON at all, or another JSON value."""


def json_value(raw: bytes | str) -> Any:
    """``raw`` parsed as any JSON value, or :class:`NotJson` naming what is wrong with it (never RecursionError)."""
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise NotJson("the body is not UTF-8 text") from None
    except RecursionError:
        raise NotJson("the body is JSON nested too deeply") from None
    except json.JSONDecodeError as error:
        raise NotJson(f"the body is not valid JSON: {error}") from None


def json_object(raw: bytes | str) -> dict[str, Any]:
    """``raw`` parsed as a JSON object, or :class:`NotAJsonObject` naming what is wrong with it."""
    try:
        value = json_value(raw)
    except NotJson as error:
        raise NotAJsonObject(str(error)) from None
    if not isinstance(value, dict):
        raise NotAJsonObject(f"the body must be a JSON object, not {type(value).__name__}")
    return value
