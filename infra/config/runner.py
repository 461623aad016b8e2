"""The runner side's sections: how a task runner stops ([runner]), what Agent Lightning agents are handed ([agl])."""

from __future__ import annotations

from dataclasses import dataclass

from agentstream.infra.config.checks import Checks


@dataclass(frozen=True)
class RunnerConfig:
    """The task runner (``agentstream run``): how long a stopping runner may take to finish its rollouts.

    After SIGTERM or SIGINT a runner stops taking tasks, lets the rollouts in flight finish and
    commits their offsets; when ``shutdown_grace_s`` passes first (a long rollout, a broker that is
    gone) it exits anyway, and the unfinished tasks, never committed, go to another runner.
    """

    shutdown_grace_s: float = 30.0

    def __post_init__(self) -> None:
        Checks("runner", self).above("shutdown_grace_s", 0)


@dataclass(frozen=True)
class AglConfig:
    """What Agent Lightning agents are handed (``agentstream run``/``train`` on an ``@rollout``/``LitAgent`` agent).

    The LLM resource ``llm_resource`` (Agent Lightning's ``main_llm``) points at the rollout's
    proxy URL with ``model`` (default: the trained model, ``trainer.model_name`` or the served
    name of ``trainer.model``) and sampling parameters ``temperature`` (and ``top_p`` when it
    is not 1). ``prompt_template`` (with ``prompt_engine``) becomes the ``prompt_template``
    resource. ``env_map`` feeds an Agent Lightning 1.0 agent's task fields to its environment
    (``QUESTION=input.question,ANSWER=input.answer``; default: each top-level field, upper-cased).
    """

    model: str | None = None
    llm_resource: str = "main_llm"
    temperature: float = 1.0
    top_p: float = 1.0
    prompt_template: str | None = None
    prompt_engine: str = "f-string"
    env_map: str = ""

    def __post_init__(self) -> None:
        check = Checks("agl", self)
        check.one_of("prompt_engine", ("f-string", "jinja", "poml"))
        check.at_least("temperature", 0)
        check.within("top_p", "(0, 1]")
