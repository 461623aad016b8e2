"""Agent Lightning agents, unchanged: its 0.3 agent API, the adapter that runs it, and its 1.0 subprocess contract.

Three kinds of agent object run under ``agentstream run``/``train`` as they are written for
Agent Lightning:

* 0.3 agents: ``@rollout`` / ``@llm_rollout`` / ``@prompt_rollout`` functions and ``LitAgent``
  subclasses (``rollout``/``rollout_async``, ``training_``/``validation_`` variants), sync or
  async, from the real ``agentlightning`` package or from the light surface below (re-exported
  as ``agentstream.agl`` for users who do not install Agent Lightning). Each rollout calls
  ``training_rollout[_async](task, resources=..., rollout=...)`` (``validation_...`` for
  evaluation tasks) with the resources Agent Lightning names: an ``LLM`` (``[agl]
  llm_resource``, ``main_llm`` by default) whose endpoint is this rollout's proxy URL and whose
  ``api_key`` is the proxy's key, a ``PromptTemplate`` when ``[agl] prompt_template`` is set, and
  an ``AttemptedRollout`` carrying agentstream's rollout and attempt ids. A number returned is the
  final reward.
* ``emit_reward``/``emit_message``/``emit_object``/``emit_exception``: the light ones here write
  agentstream spans directly; for the real package a tracer is installed as its active tracer
  (so ``agl.emit_reward`` no longer raises "No active tracer found") and turns its annotation
  spans back into agentstream rewards, messages, objects and exceptions.
* 1.0 agents: a class whose ``run(self)`` takes nothing. Each rollout runs it in a subprocess with
  ``AGL_OPENAI_BASE_URL`` (this rollout's proxy URL), ``AGL_EVENT_URL`` (the proxy's event
  endpoint for this attempt; ``{"event_type": "reward", "data": {"value": 1.0}}`` is a reward),
  ``AGL_KEY`` (the proxy's key, which the agent sends as its OpenAI ``api_key`` and as ``Authorization:
  Bearer`` on its events) and the task's fields as environment variables (``[agl] env_map``).

It is one module of about 500 lines on purpose: it is the whole Agent Lightning surface, so following a new
Agent Lightning release is one file's work.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import inspect
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from agentstream.infra.config import AglConfig
from agentstream.pipeline import sdk
from agentstream.schemas.contracts import resolve_reward
from agentstream.schemas.errors import AgentstreamError
from agentstream.schemas.json_body import json_value

log = logging.getLogger("agentstream.agl")

T = TypeVar("T")
AgentFunction = Callable[..., Any]

REWARD_PREFIX = "agentlightning.reward."
MESSAGE_BODY = "agentlightning.message.body"
OBJECT_JSON = "agentlightning.object.json"
OBJECT_LITERAL = "agentlightning.object.literal"
EXCEPTION_SPAN = "agentlightning.exception"


# ------------------------------------------------------------------ the light surface (Agent Lightning 0.3's names)


@dataclass(kw_only=True)
class LLM:
    """An LLM resource: an OpenAI-compatible ``endpoint`` (this rollout's), ``model`` and sampling parameters."""

    endpoint: str
    model: str
    api_key: str | None = None
    sampling_parameters: dict[str, Any] = field(default_factory=dict)
    resource_type: str = "llm"

    def get_base_url(self, *args: Any, **kwargs: Any) -> str:
        return self.endpoint


@dataclass(kw_only=True)
class ProxyLLM(LLM):
    """An LLM behind a proxy: :meth:`get_base_url` names the rollout and attempt in the path."""

    resource_type: str = "proxy_llm"

    def get_base_url(self, rollout_id: str | None = None, attempt_id: str | None = None) -> str:
        if rollout_id is None and attempt_id is None:
            return self.endpoint
        base = self.endpoint.rstrip("/")
        has_v1 = base.endswith("/v1")
        base = (base[:-3] if has_v1 else base) + f"/rollout/{rollout_id}/attempt/{attempt_id}"
        return base + "/v1" if has_v1 else base

    def with_attempted_rollout(self, rollout: AttemptedRollout) -> LLM:
        return LLM(endpoint=self.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id), model=self.model,
                   api_key=self.api_key, sampling_parameters=dict(self.sampling_parameters))


@dataclass(kw_only=True)
class PromptTemplate:
    """A prompt template resource; :meth:`format` renders the ``f-string`` engine."""

    template: str
    engine: str = "f-string"
    resource_type: str = "prompt_template"

    def format(self, **kwargs: Any) -> str:
        if self.engine != "f-string":
            raise NotImplementedError("format() renders the f-string engine only")
        return self.template.format(**kwargs)


@dataclass(kw_only=True)
class Attempt:
    rollout_id: str
    attempt_id: str
    sequence_id: int
    start_time: float
    end_time: float | None = None
    status: str = "running"
    worker_id: str | None = None
    last_heartbeat_time: float | None = None
    metadata: dict[str, Any] | None = None


@dataclass(kw_only=True)
class Rollout:
    rollout_id: str
    input: Any
    start_time: float
    end_time: float | None = None
    mode: str | None = None
    resources_id: str | None = None
    status: str = "running"
    metadata: dict[str, Any] | None = None


@dataclass(kw_only=True)
class AttemptedRollout(Rollout):
    attempt: Attempt


NamedResources = dict[str, Any]


class LitAgent(Generic[T]):
    """Agent Lightning's agent base class: override ``rollout`` or ``rollout_async`` (or training/validation forms)."""

    def __init__(self, *, trained_agents: str | None = None) -> None:
        self.trained_agents = trained_agents

    def is_async(self) -> bool:
        cls = type(self)
        return any(getattr(cls, name) is not getattr(LitAgent, name)
                   for name in ("rollout_async", "training_rollout_async", "validation_rollout_async"))

    def rollout(self, task: T, resources: NamedResources, rollout: Rollout) -> Any:
        raise NotImplementedError("Agents must implement the `rollout` method.")

    async def rollout_async(self, task: T, resources: NamedResources, rollout: Rollout) -> Any:
        raise NotImplementedError("Agents must implement the `rollout_async` method for async operations.")

    def training_rollout(self, task: T, resources: NamedResources, rollout: Rollout) -> Any:
        return self.rollout(task, resources, rollout)

    def validation_rollout(self, task: T, resources: NamedResources, rollout: Rollout) -> Any:
        return self.rollout(task, resources, rollout)

    async def training_rollout_async(self, task: T, resources: NamedResources, rollout: Rollout) -> Any:
        return await self.rollout_async(task, resources, rollout)

    async def validation_rollout_async(self, task: T, resources: NamedResources, rollout: Rollout) -> Any:
        return await self.rollout_async(task, resources, rollout)


def _first_of(resources: NamedResources, kind: type, what: str) -> Any:
    for resource in resources.values():
        if isinstance(resource, kind):
            return resource
    raise ValueError(f"No {what} resource found in the provided resources.")


class FunctionalLitAgent(LitAgent[T]):
    """A rollout function as a LitAgent: ``llm``, ``prompt_template`` and ``rollout`` are passed when it names them."""

    def __init__(self, rollout_func: Callable[..., Any], *, strip_proxy: bool = True) -> None:
        super().__init__()
        self._rollout_func = rollout_func
        self._strip_proxy = strip_proxy
        self._is_async = inspect.iscoroutinefunction(rollout_func)
        self._sig = inspect.signature(rollout_func)
        functools.update_wrapper(self, rollout_func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._rollout_func(*args, **kwargs)

    def is_async(self) -> bool:
        return self._is_async

    def _kwargs(self, resources: NamedResources, rollout: Rollout) -> dict[str, Any]:
        wanted = self._sig.parameters
        kwargs: dict[str, Any] = {}
        if "rollout" in wanted:
            kwargs["rollout"] = rollout
        if "llm" in wanted:
            llm = _first_of(resources, LLM, "LLM")
            if self._strip_proxy and isinstance(llm, ProxyLLM) and isinstance(rollout, AttemptedRollout):
                llm = llm.with_attempted_rollout(rollout)
            kwargs["llm"] = llm
        if "prompt_template" in wanted:
            kwargs["prompt_template"] = _first_of(resources, PromptTemplate, "prompt template")
        return kwargs

    def rollout(self, task: T, resources: NamedResources, rollout: Rollout) -> Any:
        if self._is_async:
            raise RuntimeError(f"{self._rollout_func} is asynchronous. Use rollout_async instead.")
        return self._rollout_func(task, **self._kwargs(resources, rollout))

    async def rollout_async(self, task: T, resources: NamedResources, rollout: Rollout) -> Any:
        if not self._is_async:
            raise RuntimeError(f"{self._rollout_func} is synchronous. Use rollout instead.")
        return await self._rollout_func(task, **self._kwargs(resources, rollout))


def _check_signature(func: Callable[..., Any], resource: str) -> None:
    params = list(inspect.signature(func).parameters)
    if len(params) < 2 or params[0] != "task" or resource not in params:
        raise ValueError(f"Function {func} must take 'task' first and a parameter called {resource!r}.")


def llm_rollout(func: Callable[..., Any] | None = None, *, strip_proxy: bool = True) -> Any:
    """``(task, llm[, rollout])``, sync or async, as a LitAgent."""

    def decorator(f: Callable[..., Any]) -> FunctionalLitAgent[Any]:
        _check_signature(f, "llm")
        return FunctionalLitAgent(f, strip_proxy=strip_proxy)

    return decorator if func is None else decorator(func)


def prompt_rollout(func: Callable[..., Any] | None = None) -> Any:
    """``(task, prompt_template[, rollout])``, sync or async, as a LitAgent."""

    def decorator(f: Callable[..., Any]) -> FunctionalLitAgent[Any]:
        _check_signature(f, "prompt_template")
        return FunctionalLitAgent(f)

    return decorator if func is None else decorator(func)


def rollout(func: Callable[..., Any]) -> FunctionalLitAgent[Any]:
    """``(task, llm[, rollout])`` or ``(task, prompt_template[, rollout])``, sync or async, as a LitAgent."""
    for resource in ("llm", "prompt_template"):
        try:
            _check_signature(func, resource)
        except ValueError:
            continue
        return FunctionalLitAgent(func)
    raise NotImplementedError(f"Function signature {inspect.signature(func)} does not match any known agent patterns. "
                              "Expected (task, llm[, rollout]) or (task, prompt_template[, rollout]).")


def emit_reward(reward: float | Mapping[str, Any], *, primary_key: str | None = None,
                attributes: Mapping[str, Any] | None = None, propagate: bool = True) -> str | None:
    """A reward for the current rollout; a dict of dimensions needs ``primary_key`` (the scalar).

    Agent Lightning's own checks come first (TypeError for a non-number, ValueError for a missing
    primary key); then every value must be a finite number (``RewardError``, a ValueError), checked
    even when the reward is not propagated, so an agent learns of a NaN where it made it.
    """
    if isinstance(reward, Mapping):
        for key, value in reward.items():
            if not isinstance(value, (int, float)):
                raise ValueError(f"Reward value must be a number, got: {type(value)} for key {key}")
        if primary_key is None:
            raise ValueError("When emitting a multi-dimensional reward as a dict, primary_key must be provided.")
        if primary_key not in reward:
            raise ValueError(f"Primary key '{primary_key}' not found in reward dict keys: {list(reward)}")
        _, dimensions = resolve_reward(dimensions=reward, primary=primary_key)
        return sdk.emit_reward(dimensions or {}, primary=primary_key) if propagate else None
    if not isinstance(reward, (int, float)):
        raise TypeError(f"Reward must be a number, got: {type(reward)}")
    scalar, _ = resolve_reward(reward)
    return sdk.emit_reward(scalar) if propagate else None


def emit_message(message: str, attributes: Mapping[str, Any] | None = None, propagate: bool = True) -> str | None:
    if not isinstance(message, str):
        raise TypeError(f"Message must be a string, got: {type(message)}.")
    return sdk.emit_message(message, **dict(attributes or {})) if propagate else None


def emit_object(object: Any, attributes: Mapping[str, Any] | None = None, propagate: bool = True) -> str | None:
    return sdk.emit_object(object) if propagate else None


def emit_exception(exception: BaseException, attributes: Mapping[str, Any] | None = None,
                   propagate: bool = True) -> str | None:
    if not isinstance(exception, BaseException):
        raise TypeError(f"Expected a BaseException instance, got: {type(exception)}.")
    return sdk.emit_exception(exception) if propagate else None


# ------------------------------------------------------------------ the real package's tracer


def forward_span(name: str, attributes: Mapping[str, Any]) -> str:
    """An Agent Lightning span (reward annotation, message, object, exception, other) as an agentstream span."""
    rewards: dict[int, dict[str, Any]] = {}
    rest: dict[str, Any] = {}
    for key, value in attributes.items():
        match = re.fullmatch(re.escape(REWARD_PREFIX) + r"(\d+)\.(name|value)", key)
        if match:
            rewards.setdefault(int(match.group(1)), {})[match.group(2)] = value
        else:
            rest[key] = value
    if rewards:
        dimensions = [rewards[index] for index in sorted(rewards)]
        if len(dimensions) == 1 and dimensions[0].get("name") in (None, "primary"):
            scalar, _ = resolve_reward(dimensions[0].get("value"))  # a finite number, or RewardError
            return sdk.emit_reward(scalar)
        primary = str(dimensions[0].get("name"))  # Agent Lightning lists the primary first
        _, named = resolve_reward(dimensions={str(d.get("name")): d.get("value") for d in dimensions}, primary=primary)
        return sdk.emit_reward(named or {}, primary=primary)
    if MESSAGE_BODY in rest:
        body = rest.pop(MESSAGE_BODY)
        return sdk.emit_message(str(body), **rest)
    if OBJECT_JSON in rest:
        return sdk.emit_object(json_value(rest[OBJECT_JSON]))  # NotJson (a ValueError) says why not
    if OBJECT_LITERAL in rest:
        return sdk.emit_object(rest[OBJECT_LITERAL])
    if name == EXCEPTION_SPAN:
        message = f"{rest.get('exception.type', 'Exception')}: {rest.get('exception.message', '')}"
        return sdk._emit("EXCEPTION", "exception", rest, status="ERROR", status_message=message)
    return sdk._emit("OTHER", name, rest)


_tracer_installed = False


def install_tracer() -> bool:
    """Make an agentstream tracer the real ``agentlightning`` package's active tracer; False without the package."""
    global _tracer_installed
    if _tracer_installed:
        return True
    try:
        from agentlightning.tracer.base import get_active_tracer, set_active_tracer
        from agentlightning.tracer.dummy import DummyTracer
    except ImportError:
        return False

    class AgentstreamTracer(DummyTracer):
        """Agent Lightning's emitters write through it into the current agentstream rollout."""

        def create_span(self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: float | None = None,
                        status: Any = None) -> Any:
            forward_span(name, dict(attributes or {}))
            return super().create_span(name, attributes, timestamp, status)

        @contextlib.contextmanager
        def operation_context(self, name: str, attributes: Mapping[str, Any] | None = None,
                              start_time: float | None = None, end_time: float | None = None) -> Iterator[Any]:
            with sdk.span(name, kind="OTHER", **dict(attributes or {})) as recorded, \
                    super().operation_context(name, attributes, start_time, end_time) as recording:
                yield recording
                for key, value in recording.attributes.items():
                    recorded.set_attribute(key, value)

    if get_active_tracer() is None:
        set_active_tracer(AgentstreamTracer())
    else:
        log.warning("agentlightning already has an active tracer (%s); agl.emit_* go to it, not to agentstream",
                    type(get_active_tracer()).__name__)
    _tracer_installed = True
    return True


# ------------------------------------------------------------------ running 0.3 agents


def is_litagent(obj: Any) -> bool:
    """A LitAgent (Agent Lightning's or the light one): ``is_async`` plus the training/validation rollout methods."""
    return all(callable(getattr(obj, name, None)) for name in
               ("is_async", "training_rollout", "training_rollout_async", "validation_rollout"))


def _is_real(agent: Any) -> bool:
    return any(cls.__module__.split(".")[0] == "agentlightning" for cls in type(agent).__mro__)


def _types(agent: Any) -> Any:
    """Where the resource and rollout classes come from: the agent's own package (its isinstance checks need them)."""
    if _is_real(agent):
        return importlib.import_module("agentlightning")
    return sys.modules[__name__]


def sampling_parameters(settings: AglConfig) -> dict[str, Any]:
    parameters: dict[str, Any] = {"temperature": settings.temperature}
    if settings.top_p != 1.0:
        parameters["top_p"] = settings.top_p
    return parameters


def resources_for(types: Any, state: sdk.Rollout, settings: AglConfig) -> dict[str, Any]:
    """The named resources of one rollout: its LLM (at its own proxy URL) and the prompt template when configured."""
    resources: dict[str, Any] = {settings.llm_resource: types.LLM(
        endpoint=state.llm_base_url(), model=settings.model or "default", api_key=state.llm_api_key(),
        sampling_parameters=sampling_parameters(settings))}
    if settings.prompt_template is not None:
        resources["prompt_template"] = types.PromptTemplate(template=settings.prompt_template,
                                                            engine=settings.prompt_engine)
    return resources


def attempted_rollout(types: Any, task: Any, state: sdk.Rollout, mode: str) -> Any:
    now = time.time()
    attempt = types.Attempt(rollout_id=state.rollout_id, attempt_id=state.attempt_id, sequence_id=state.attempt,
                            start_time=now, status="running", worker_id=None)
    return types.AttemptedRollout(rollout_id=state.rollout_id, input=task, start_time=now, mode=mode,
                                  status="running", attempt=attempt)


def final_reward(result: Any) -> float | None:
    """What a rollout returned, as Agent Lightning reads it: a number is the final reward; spans and None are not."""
    if isinstance(result, (bool, int, float)):
        return float(result)
    return None


def run_litagent(agent: Any, settings: AglConfig) -> AgentFunction:
    """An agentstream agent function ``(task, rollout)`` running a LitAgent as Agent Lightning's runner does."""
    types = _types(agent)

    async def litagent(task: Any, state: sdk.Rollout) -> float | None:
        mode = "val" if state.train is False else "train"
        resources = resources_for(types, state, settings)
        attempted = attempted_rollout(types, task, state, mode)
        if agent.is_async():
            method = agent.training_rollout_async if mode == "train" else agent.validation_rollout_async
            result = await method(task, resources=resources, rollout=attempted)
        else:
            method = agent.training_rollout if mode == "train" else agent.validation_rollout
            result = await asyncio.to_thread(method, task, resources=resources, rollout=attempted)
        return final_reward(result)

    litagent.__name__ = getattr(agent, "__name__", type(agent).__name__)
    litagent.__qualname__ = litagent.__name__
    return litagent


# ------------------------------------------------------------------ running 1.0 agents in subprocesses

WORKER = """
import asyncio, importlib, inspect, sys
spec = sys.argv[1]
module_name, _, class_name = spec.partition(":") if ":" in spec else spec.rpartition(".")
result = getattr(importlib.import_module(module_name), class_name)().run()
if inspect.isawaitable(result):
    asyncio.run(result)
"""


def is_agl1_agent(obj: Any) -> bool:
    """Agent Lightning 1.0's agent: a class (not a LitAgent) whose ``run(self)`` takes nothing."""
    if not isinstance(obj, type) or is_litagent(obj):
        return False
    run = getattr(obj, "run", None)
    if not callable(run):
        return False
    return len(inspect.signature(run).parameters) == 1  # self


def _resolve(value: Any, path: str) -> Any:
    if path == "input":
        return value
    if not path.startswith("input."):
        return path  # a literal, as in Agent Lightning's env_map
    for part in path.split(".")[1:]:
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


def task_environment(task: Any, env_map: str) -> dict[str, str]:
    """Environment variables from a task: ``NAME=input.path`` pairs, or each top-level field upper-cased."""
    if env_map.strip():
        pairs = [item.split("=", 1) for item in env_map.split(",") if item.strip()]
        chosen = {name.strip(): _resolve(task, path.strip()) for name, path in pairs}
    elif isinstance(task, Mapping):
        chosen = {re.sub(r"\W", "_", str(key)).upper(): value for key, value in task.items()}
    else:
        chosen = {"INPUT": task}
    return {name: value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            for name, value in chosen.items()}


class AgentProcessFailed(AgentstreamError, RuntimeError):
    """An Agent Lightning 1.0 agent's process exited with an error."""


def event_url(state: sdk.Rollout) -> str:
    if not state.proxy_url:
        raise RuntimeError("no LLM proxy configured for this rollout (set proxy_url / --proxy)")
    return f"{state.proxy_url.rstrip('/')}/api/rollouts/{state.rollout_id}/attempt/{state.attempt_id}/events"


def run_subprocess_agent(spec: str, settings: AglConfig, python: str | None = None) -> AgentFunction:
    """An agentstream agent function that runs Agent Lightning 1.0's ``spec`` (``module:Class``) once per rollout."""

    async def agl1(task: Any, state: sdk.Rollout) -> None:
        env = {**os.environ, **task_environment(task, settings.env_map), "AGL_KEY": state.llm_api_key(),
               "AGL_OPENAI_BASE_URL": state.llm_base_url(), "AGL_EVENT_URL": event_url(state)}
        process = await asyncio.create_subprocess_exec(
            python or sys.executable, "-c", WORKER, spec, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = await process.communicate()
        except asyncio.CancelledError:  # the rollout timed out or the runner stops: end the agent's process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            raise
        if process.returncode != 0:
            tail = output.decode(errors="replace")[-2000:]
            raise AgentProcessFailed(f"{spec} exited with code {process.returncode}: {tail}")

    agl1.__name__ = agl1.__qualname__ = spec.replace(":", ".").rsplit(".", 1)[-1]
    return agl1


# ------------------------------------------------------------------ the runner's entry point


def adapt_agent(obj: Any, spec: str, settings: AglConfig | None = None) -> AgentFunction | None:
    """An agentstream agent function for an Agent Lightning agent object, or None when ``obj`` is not one."""
    settings = settings or AglConfig()
    if "agentlightning" in sys.modules:  # the agent uses the real package: its emitters need our tracer
        install_tracer()
    if is_agl1_agent(obj):
        return run_subprocess_agent(spec, settings)
    if isinstance(obj, type) and is_litagent(obj):
        obj = obj()
    if is_litagent(obj):
        return run_litagent(obj, settings)
    return None
