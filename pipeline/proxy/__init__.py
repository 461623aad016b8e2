"""The LLM proxy, the OpenAI-compatible front every LLM call of a rollout goes through (``agentstream proxy``).

``server`` routes and relays calls (one handler per endpoint), ``capture`` turns a call into LLM spans with
the exact token ids, ``trace_context`` reads W3C trace context, ``access`` says who may call what,
``upstreams`` is the fleet of model servers behind it, ``feedback`` builds end users' reward URLs, and
``main`` is the process. The package imports nothing itself, so ``import agentstream`` stays light.
"""
