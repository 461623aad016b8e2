"""The request side of vLLM's OpenAI contract: body fields read and checked, so handlers get typed values or a 400.

Refusals are ``RequestError``; the app renders them as vLLM's error body
``{"error": {"message", "type", "param", "code"}}`` with code the HTTP status (400
BadRequestError, 404 NotFoundError for an unknown model or adapter). ``Contract`` names which
server the app answers as: the dev server, or vLLM itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, overload

from aiohttp import web

from agentstream.schemas.errors import AgentstreamError
from agentstream.schemas.json_body import NotAJsonObject, json_object
from agentstream.serving.generation import SamplingParams

MAX_N = 64
MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs
GREEDY_BELOW = 1e-5  # vLLM treats smaller temperatures as greedy
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
LOGPROB_FLOOR = -9999.0  # vLLM clamps -inf so the JSON stays valid
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 500: "InternalServerError"}


class Contract(StrEnum):
    """The HTTP contract served: the dev server's (vLLM's plus policy versions) or exactly vLLM's."""

    DEV = "dev"
    VLLM = "vllm"

    @property
    def versioned(self) -> bool:
        """Whether policy versions are served: ``X-Policy-Version``, ``/v1/load_weights`` and adapters' ``version``."""
        return self is Contract.DEV


class RequestError(AgentstreamError):
    """A request the server refuses, rendered as an OpenAI/vLLM-style error body."""

    def __init__(self, message: str, status: int = 400, error_type: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type or error_type_of(status)
        self.param = param


def error_type_of(status: int) -> str:
    """The vLLM error type named for an HTTP status."""
    return ERROR_TYPES.get(status, "BadRequestError")


def _value(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any, what: str) -> Any:
    """``body[name]`` if present and of an accepted type (bools are not numbers), else ``default``."""
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise RequestError(f"'{name}' must be {what}", param=name)
    return value


@overload
def int_field(body: dict[str, Any], name: str, default: int, low: int | None = None,
              high: int | None = None) -> int: ...
@overload
def int_field(body: dict[str, Any], name: str, default: None, low: int | None = None,
              high: int | None = None) -> int | None: ...
def int_field(body: dict[str, Any], name: str, default: int | None, low: int | None = None,
              high: int | None = None) -> int | None:
    """An optional integer field within [low, high]."""
    value = _value(body, name, (int,), default, "an integer")
    if value is not None and ((low is not None and value < low) or (high is not None and value > high)):
        raise RequestError(f"'{name}' must be between {low} and {high}" if high is not None
                           else f"'{name}' must be at least {low}", param=name)
    return value


def float_field(body: dict[str, Any], name: str, default: float, low: float, high: float | None = None) -> float:
    """An optional number field within [low, high]."""
    value = float(_value(body, name, (int, float), default, "a number"))
    if value < low or (high is not None and value > high):
        raise RequestError(f"'{name}' must be in [{low}, {high if high is not None else 'inf'}]", param=name)
    return value


def bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    """An optional boolean field."""
    value: bool = _value(body, name, (bool,), default, "true or false")
    return value


def str_field(body: dict[str, Any], name: str) -> str:
    """A required non-empty string field."""
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise RequestError(f"'{name}' is required and must be a non-empty string", param=name)
    return value


def stop_field(body: dict[str, Any]) -> tuple[str, ...]:
    """The stop strings: one string or a list of them."""
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(item, str) for item in stop):
        return tuple(item for item in stop if item)
    raise RequestError("'stop' must be a string or a list of strings", param="stop")


def token_ids_field(value: Any, name: str, vocab_size: int) -> list[int]:
    """A list of token ids inside the vocabulary."""
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise RequestError(f"'{name}' must be a list of token ids", param=name)
    if any(not 0 <= i < vocab_size for i in value):
        raise RequestError(f"'{name}' has token ids outside the vocabulary [0, {vocab_size})", param=name)
    return value


@dataclass(frozen=True)
class Output:
    """What the client asked to see besides text: token ids, logprobs, streaming and usage."""

    return_token_ids: bool
    logprobs: bool
    stream: bool
    include_usage: bool


def output_options(body: dict[str, Any], logprobs: bool) -> Output:
    """The output options of a request (stream_options only with stream, as vLLM insists)."""
    stream = bool_field(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise RequestError("'stream_options' must be an object and needs 'stream': true", param="stream_options")
    return Output(return_token_ids=bool_field(body, "return_token_ids", False), logprobs=logprobs, stream=stream,
                  include_usage=bool(options and bool_field(options, "include_usage", False)))


def sampling_params(body: dict[str, Any], *, prompt_tokens: int, context: int, default_max_tokens: int | None,
                    logprobs: bool, top_logprobs: int) -> SamplingParams:
    """vLLM's sampling fields of a request, checked against the room left in the model's context."""
    room = context - prompt_tokens
    if room <= 0:
        raise RequestError(f"This model's maximum context length is {context} tokens. However, your request has "
                           f"{prompt_tokens} input tokens. Please reduce the length of the input.")
    max_tokens = int_field(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = int_field(body, "max_tokens", None, 1)
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise RequestError(f"This model's maximum context length is {context} tokens. However, you requested "
                           f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the input, {max_tokens} in the "
                           "completion). Please reduce the length of the input or completion.", param="max_tokens")
    temperature = float_field(body, "temperature", 1.0, 0.0)
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(isinstance(i, int) for i in stop_token_ids):
        raise RequestError("'stop_token_ids' must be a list of token ids", param="stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=float_field(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=int_field(body, "top_k", 0, -1),
        n=int_field(body, "n", 1, 1, MAX_N),
        seed=int_field(body, "seed", None),
        stop=stop_field(body),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=bool_field(body, "ignore_eos", False),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    try:
        return json_object(await request.read())
    except NotAJsonObject as error:
        raise RequestError(str(error)) from None
