"""Agent Lightning's agent API without installing Agent Lightning: ``import agentstream.agl as agl``.

The names an Agent Lightning 0.3 agent file uses, for users who do not want its dependency tree
(``pip install 'agentstream[agl]'``). The same agent file runs unchanged on the real package
(``pip install 'agentstream[agentlightning]'``): ``agentstream run``/``train`` adapt either.
The implementation lives in ``pipeline/runner/agl.py``.
"""

from agentstream.pipeline.runner.agl import (
    LLM,
    Attempt,
    AttemptedRollout,
    FunctionalLitAgent,
    LitAgent,
    NamedResources,
    PromptTemplate,
    ProxyLLM,
    Rollout,
    emit_exception,
    emit_message,
    emit_object,
    emit_reward,
    llm_rollout,
    prompt_rollout,
    rollout,
)

__all__ = [
    "LLM",
    "Attempt",
    "AttemptedRollout",
    "FunctionalLitAgent",
    "LitAgent",
    "NamedResources",
    "PromptTemplate",
    "ProxyLLM",
    "Rollout",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "llm_rollout",
    "prompt_rollout",
    "rollout",
]
