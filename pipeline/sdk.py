"""The agent-side SDK: spans, rewards, messages and rollouts, attributed through contextvars.

Everything an agent emits attaches itself to the current rollout: the one entered with
:func:`rollout` (or started by the runner) in this context. Context variables follow asyncio
tasks automatically and threads started with ``contextvars.copy_context().run`` or
``asyncio.to_thread``; a thread that carries no context falls back to the process's only
open rollout, when there is exactly one.

Spans go to a :class:`SpanSink` (the Kafka publisher in production): set one with
:func:`set_sink`, or let the runner set it.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import threading
import time
import traceback
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict, Unpack
from urllib.parse import quote

from agentstream.schemas.contracts import TRAIN_ATTRIBUTE, resolve_reward
from agentstream.schemas.errors import AgentstreamError
from agentstream.schemas.records import RolloutEventRecord, SpanRecord

log = logging.getLogger(__name__)

UNUSED_API_KEY = "unused"  # what an OpenAI client sends to a proxy that asks for no key


class SpanSink(Protocol):
    """Where spans and rollout events go: publish must not block for long (it buffers)."""

    def publish(self, span: SpanRecord) -> None: ...

    def publish_event(self, event: RolloutEventRecord) -> None: ...


class NoRollout(AgentstreamError, RuntimeError):
    """An emit_* call happened outside any rollout, so there is nothing to attribute it to."""


class NoSink(AgentstreamError, RuntimeError):
    """Spans were emitted before a sink was configured with set_sink()."""


@dataclass
class Rollout:
    """One execution of an agent on one task (or one production request): the unit credit is assigned to.

    ``train`` is this rollout's training choice: True opts it in, False opts it out (an evaluation
    or a request that must not be learned from), None leaves it to the credit rules' sample rate.
    Every span built for the rollout carries it as the ``agentstream.train`` attribute, so the
    stream processors see it whichever span of the rollout they read.

    ``proxy_key`` is the API key its LLM calls present to the proxy (one of ``[security] proxy_keys``;
    None when the proxy asks for none).
    """

    rollout_id: str
    attempt_id: str
    agent_name: str | None = None
    task_id: str | None = None
    group_id: str | None = None
    sink: SpanSink | None = None
    proxy_url: str | None = None
    root_span_id: str | None = None
    attempt: int = 1
    rewards: list[float] = field(default_factory=list)
    train: bool | None = None
    proxy_key: str | None = field(default=None, repr=False)  # a secret: kept out of logged reprs

    def llm_base_url(self) -> str:
        """The OpenAI base URL that records this rollout's LLM calls (rollout, attempt and agent) at the proxy."""
        if not self.proxy_url:
            raise RuntimeError("no LLM proxy configured for this rollout (set proxy_url / --proxy)")
        base = f"{self.proxy_url.rstrip('/')}/rollouts/{self.rollout_id}/attempts/{self.attempt_id}"
        return f"{base}/agents/{quote(self.agent_name, safe='')}/v1" if self.agent_name else f"{base}/v1"

    def llm_api_key(self) -> str:
        """The ``api_key`` for an OpenAI client at :meth:`llm_base_url`: the proxy's key, else a placeholder.

        The openai SDK refuses an empty key, and a proxy without keys ignores whatever it is sent.
        """
        return self.proxy_key or UNUSED_API_KEY

    def _sink(self) -> SpanSink:
        sink = self.sink or _default_sink
        if sink is None:
            raise NoSink("no span sink configured: call pipeline.sdk.set_sink(publisher) first")
        return sink


_current_rollout: contextvars.ContextVar[Rollout | None] = contextvars.ContextVar("agentstream_rollout", default=None)
_current_span: contextvars.ContextVar[str | None] = contextvars.ContextVar("agentstream_span", default=None)
_default_sink: SpanSink | None = None
_open_rollouts: dict[str, Rollout] = {}
_open_lock = threading.Lock()

HEARTBEAT_S = 5.0
"""How often an open rollout scope says it is alive, well inside the stream processors' ``idle_timeout_s`` (30 s)."""


class _ThreadHeartbeats:
    """The heartbeats of rollout scopes entered outside any event loop (a WSGI handler, a script): one daemon
    thread beats for all of them, so a thousand open requests cost one thread, not a thousand."""

    _due: dict[int, tuple[float, rollout]]  # by id(scope): when its next beat is due
    _changed: threading.Condition
    _thread: threading.Thread | None

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Start afresh (in a forked child: its parent's thread, lock and scopes did not come along as they were)."""
        self._due, self._changed, self._thread = {}, threading.Condition(), None

    def add(self, scope: rollout) -> None:
        with self._changed:
            self._due[id(scope)] = (time.monotonic() + scope.heartbeat_s, scope)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="agentstream-heartbeats", daemon=True)
                self._thread.start()
            self._changed.notify()

    def remove(self, scope: rollout) -> None:
        """Once this returns, no beat of ``scope`` is in flight or will come (beats are sent under the lock)."""
        with self._changed:
            self._due.pop(id(scope), None)

    def _run(self) -> None:
        with self._changed:
            while True:
                now = time.monotonic()
                for key, (due, scope) in list(self._due.items()):
                    if due <= now:
                        self._beat(key, scope, now)
                soonest = min((due for due, _ in self._due.values()), default=None)
                self._changed.wait(None if soonest is None else max(0.0, soonest - time.monotonic()))

    def _beat(self, key: int, scope: rollout, now: float) -> None:
        try:
            scope.event("HEARTBEAT")
        except Exception as error:  # a closed or missing sink: that scope beats no more, the others go on
            log.warning("rollout %s: heartbeat not sent, no more will be: %s", scope.state.attempt_id, error)
            del self._due[key]
            return
        self._due[key] = (now + scope.heartbeat_s, scope)


_thread_heartbeats = _ThreadHeartbeats()
os.register_at_fork(after_in_child=_thread_heartbeats.forget)


def set_sink(sink: SpanSink | None) -> None:
    """Make ``sink`` the destination of every rollout that has none of its own."""
    global _default_sink
    _default_sink = sink


def current_rollout() -> Rollout | None:
    """The rollout this code runs in: the context's, else the process's only open rollout, else None."""
    found = _current_rollout.get()
    if found is not None:
        return found
    with _open_lock:
        if len(_open_rollouts) == 1:
            return next(iter(_open_rollouts.values()))
    return None


def new_id() -> str:
    return uuid.uuid4().hex


def now_us() -> int:
    return time.time_ns() // 1000


def _require_rollout() -> Rollout:
    found = current_rollout()
    if found is None:
        raise NoRollout("emitted outside a rollout: wrap the work in `with rollout(...)` or run it under the runner")
    return found


def _attribute_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str, separators=(",", ":"))


class SpanFields(TypedDict, total=False):
    """The Span fields (schemas/records.py :class:`SpanRecord`) that :func:`build_span` takes as keywords."""

    model: str | None
    prompt_token_ids: list[int] | None
    response_token_ids: list[int] | None
    response_logprobs: list[float] | None
    reward: float | None
    reward_dimensions: Mapping[str, float] | None
    policy_version: int | None


def build_span(owner: Rollout, name: str, kind: str, start_us: int, end_us: int, *, span_id: str | None = None,
               parent_id: str | None = None, attributes: Mapping[str, Any] | None = None, status: str = "OK",
               status_message: str | None = None, **fields: Unpack[SpanFields]) -> SpanRecord:
    """A Span record (schemas/avro/span.avsc) attributed to ``owner``.

    When the owner made a training choice (``owner.train`` not None) the span carries it as the
    ``agentstream.train`` attribute ("true"/"false"), overriding one set by hand: a rollout's spans
    never disagree about it.
    """
    texts = {key: _attribute_text(value) for key, value in (attributes or {}).items()}
    if owner.train is not None:
        texts[TRAIN_ATTRIBUTE] = "true" if owner.train else "false"
    return {
        "span_id": span_id or new_id(),
        "rollout_id": owner.rollout_id,
        "attempt_id": owner.attempt_id,
        "parent_id": parent_id,
        "name": name,
        "kind": kind,
        "start_time_us": start_us,
        "end_time_us": end_us,
        "status": status,
        "status_message": status_message,
        "agent_name": owner.agent_name,
        "task_id": owner.task_id,
        "group_id": owner.group_id,
        "attributes": texts,
        **fields,
    }


class span:
    """A span around a block of agent work; use as ``with span(...)`` or ``async with span(...)``.

    Nested spans become children; an exception marks the span ERROR (and propagates).
    """

    def __init__(self, name: str, kind: str = "OTHER", **attributes: Any) -> None:
        self.name = name
        self.kind = kind
        self.attributes = attributes
        self.span_id = new_id()
        self._token: contextvars.Token | None = None
        self._owner: Rollout | None = None
        self._parent: str | None = None
        self._start_us = 0

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def __enter__(self) -> span:
        self._owner = _require_rollout()
        self._parent = _current_span.get() or self._owner.root_span_id
        self._start_us = now_us()
        self._token = _current_span.set(self.span_id)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._token is not None:
            _current_span.reset(self._token)
        owner = self._owner
        assert owner is not None
        status, message = ("ERROR", f"{exc_type.__name__}: {exc}") if exc_type else ("OK", None)
        owner._sink().publish(build_span(owner, self.name, self.kind, self._start_us, now_us(), span_id=self.span_id,
                                         parent_id=self._parent, attributes=self.attributes, status=status,
                                         status_message=message))

    async def __aenter__(self) -> span:
        return self.__enter__()

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.__exit__(exc_type, exc, tb)


def _emit(kind: str, name: str, attributes: Mapping[str, Any] | None = None, *, status: str = "OK",
          status_message: str | None = None, **fields: Unpack[SpanFields]) -> str:
    owner = _require_rollout()
    at = now_us()
    record = build_span(owner, name, kind, at, at, parent_id=_current_span.get() or owner.root_span_id,
                        attributes=attributes, status=status, status_message=status_message, **fields)
    owner._sink().publish(record)
    return record["span_id"]


def emit_reward(value: float | Mapping[str, float], *, primary: str | None = None) -> str:
    """Record a reward: a float, or named dimensions whose ``primary`` one (default: their sum) is the scalar.

    Raises ``agentstream.schemas.contracts.RewardError`` (a ValueError) for a value that is not a finite number
    (NaN, ±Infinity, a float overflow, a bool, a string) or an unknown primary: nothing is recorded.

    Call it as often as the task gives feedback: intermediate rewards are kept in order and
    credit assignment can honour them.
    """
    if isinstance(value, Mapping):
        scalar, dimensions = resolve_reward(dimensions=value, primary=primary)
    else:
        scalar, dimensions = resolve_reward(value)
    _require_rollout().rewards.append(scalar)
    return _emit("REWARD", "reward", reward=scalar, reward_dimensions=dimensions)


class TokenMismatch(AgentstreamError, ValueError):
    """An LLM call's token arrays cannot be trained on: no prompt or response ids, or logprobs of another length."""


def emit_llm_call(prompt_token_ids: Sequence[int], response_token_ids: Sequence[int], *, model: str,
                  logprobs: Sequence[float] | None = None, policy_version: int | None = None,
                  messages: Any = None, output: Any = None) -> str:
    """Record an LLM call made without the proxy, with the token ids as the model saw and wrote them.

    With ``logprobs`` (one per response token, from the model that generated them) it trains like a
    captured call. Without, it is a demonstration (a scripted or human-written answer): the trainer
    raises its likelihood instead of weighing it by an importance ratio (``agentstream.demonstration``
    says so on the span). ``messages`` and ``output`` (the assistant messages) are kept as the
    ``gen_ai.input.messages`` / ``gen_ai.output.messages`` attributes, as the proxy records them.
    Raises :class:`TokenMismatch` for empty arrays or logprobs of another length.
    """
    prompt, response = [int(i) for i in prompt_token_ids], [int(i) for i in response_token_ids]
    if not prompt or not response:
        raise TokenMismatch("an LLM call needs prompt and response token ids")
    values = [float(v) for v in logprobs] if logprobs is not None else []
    if logprobs is not None and len(values) != len(response):
        raise TokenMismatch(f"{len(values)} logprobs for {len(response)} response tokens")
    attributes: dict[str, Any] = {"gen_ai.operation.name": "chat", "gen_ai.request.model": model}
    if logprobs is None:
        attributes["agentstream.demonstration"] = True
    if messages is not None:
        attributes["gen_ai.input.messages"] = messages
    if output is not None:
        attributes["gen_ai.output.messages"] = output
    return _emit("LLM", f"chat {model}", attributes, model=model, prompt_token_ids=prompt, response_token_ids=response,
                 response_logprobs=values, policy_version=policy_version)


def emit_message(text: str, **attributes: Any) -> str:
    """Record a free-text message (a log line worth keeping with the trajectory)."""
    return _emit("MESSAGE", "message", {"message": text, **attributes})


def emit_exception(error: BaseException) -> str:
    """Record an exception with OpenTelemetry's exception.* attributes; the span's status is ERROR."""
    return _emit("EXCEPTION", "exception", {
        "exception.type": type(error).__name__,
        "exception.message": str(error),
        "exception.stacktrace": "".join(traceback.format_exception(error)),
    }, status="ERROR", status_message=f"{type(error).__name__}: {error}")


def emit_object(obj: Any, name: str = "object") -> str:
    """Record any JSON-serialisable object (a plan, a retrieved document, a final answer)."""
    return _emit("OBJECT", name, {"object": obj})


class rollout:
    """A rollout scope for online use: a production request handler becomes one rollout.

    Emits a STARTED event on entry and SUCCEEDED or FAILED on exit, around a root AGENT span.
    Works as ``with`` and ``async with``; yields the :class:`Rollout`.

    ``train=True`` trains on this rollout even where the rule samples only some; ``train=False``
    keeps it out of training (it is still captured for analytics); None (the default) lets the
    matching credit rule's ``sample_rate`` decide. ``proxy_key`` is the key its LLM calls present to
    the proxy (:meth:`Rollout.llm_api_key`).

    It publishes a HEARTBEAT event every ``heartbeat_s`` until it finishes, so a model or tool call
    slower than the stream processors' ``idle_timeout_s`` does not read as a dead rollout: from a task
    on the event loop it was entered on, or, entered outside any event loop, from one thread shared by
    all such scopes. ``heartbeat_s`` 0 sends none.
    """

    def __init__(self, agent_name: str | None = None, *, rollout_id: str | None = None, attempt_id: str | None = None,
                 task_id: str | None = None, group_id: str | None = None, sink: SpanSink | None = None,
                 proxy_url: str | None = None, worker_id: str | None = None, attempt: int = 1,
                 train: bool | None = None, proxy_key: str | None = None,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        rollout_id = rollout_id or new_id()
        self.state = Rollout(rollout_id, attempt_id or f"{rollout_id}-{attempt}", agent_name, task_id, group_id, sink,
                             proxy_url, root_span_id=new_id(), attempt=attempt, train=train, proxy_key=proxy_key)
        self.worker_id = worker_id
        self.heartbeat_s = heartbeat_s
        self._token: contextvars.Token | None = None
        self._start_us = 0
        self._heartbeat: asyncio.Task | None = None

    def event(self, kind: str, error: str | None = None) -> None:
        owner = self.state
        owner._sink().publish_event({
            "rollout_id": owner.rollout_id, "attempt_id": owner.attempt_id, "event": kind, "at_us": now_us(),
            "worker_id": self.worker_id, "error": error, "task_id": owner.task_id, "agent_name": owner.agent_name,
        })

    def __enter__(self) -> Rollout:
        self._start_us = now_us()
        self._token = _current_rollout.set(self.state)
        with _open_lock:
            _open_rollouts[self.state.attempt_id] = self.state
        self.event("STARTED")
        if self.heartbeat_s > 0:
            try:
                self._heartbeat = asyncio.get_running_loop().create_task(self._beat())
            except RuntimeError:  # no event loop in this thread
                _thread_heartbeats.add(self)
        return self.state

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self.event("HEARTBEAT")

    def abandon(self) -> None:
        """End the scope without an end event (a cancelled runner attempt, run again elsewhere): no more heartbeats,
        no longer an open rollout of this process; its silence then ends it in the stream processors."""
        self._stop_heartbeat()
        self._close()

    def finish(self, status: str, error: str | None = None) -> None:
        """Close the root span and publish the terminal event (SUCCEEDED, FAILED, TIMED_OUT, CANCELLED)."""
        owner = self.state
        self._stop_heartbeat()  # before the terminal event, so no heartbeat follows it
        self._close()
        owner._sink().publish(build_span(owner, owner.agent_name or "rollout", "AGENT", self._start_us, now_us(),
                                         span_id=owner.root_span_id, status="OK" if status == "SUCCEEDED" else "ERROR",
                                         status_message=error))
        self.event(status, error)

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        else:
            _thread_heartbeats.remove(self)

    def _close(self) -> None:
        with _open_lock:
            _open_rollouts.pop(self.state.attempt_id, None)
        if self._token is not None:
            try:
                _current_rollout.reset(self._token)
            except ValueError:  # closed from another context (the runner's timeout path)
                pass
            self._token = None

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.finish("SUCCEEDED")
        elif isinstance(exc, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
            self.finish("CANCELLED", type(exc).__name__)
        else:
            emit_exception(exc)
            self.finish("FAILED", f"{type(exc).__name__}: {exc}")

    async def __aenter__(self) -> Rollout:
        return self.__enter__()

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.__exit__(exc_type, exc, tb)
