"""The `agentstream proxy` process: the LLM proxy, following the deployments topic, recording every call."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass

import uvloop

from agentstream.deploy.deployments import DeploymentFollower
from agentstream.infra.config import Config
from agentstream.infra.grace import until_signalled
from agentstream.infra.security import KeySet, check_bind
from agentstream.pipeline.proxy.feedback import proxy_feedback_secret
from agentstream.pipeline.proxy.server import LLMProxy, serve_proxy
from agentstream.pipeline.proxy.upstreams import HealthSettings
from agentstream.pipeline.publisher import process_publisher

DEPLOYMENTS_PATIENCE_S = 30.0
"""How long the proxy waits at start for the deployments topic before it routes with what it knows."""


@dataclass(frozen=True)
class ProxyOptions:
    """Where the proxy listens and what it forwards to: one model server's URL, or several (a fleet)."""

    upstream: str | tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8080
    agent_name: str | None = None
    follow_deployments: bool = True


def run_proxy(config: Config, bootstrap_servers: str, options: ProxyOptions) -> None:
    """Serve the OpenAI-compatible LLM proxy until SIGTERM or SIGINT, publishing each call as a span."""
    keys = KeySet(config.security.proxy_keys)
    check_bind("LLM proxy", options.host, keys, "proxy_keys", config.security)
    feedback_secret = proxy_feedback_secret(config)
    logging.getLogger("agentstream.deployments").setLevel(logging.INFO)
    host, port = options.host, options.port
    upstreams = (options.upstream,) if isinstance(options.upstream, str) else options.upstream
    health = HealthSettings(config.proxy.health_interval_s, config.proxy.health_timeout_s, config.proxy.eject_after)

    async def serve() -> None:
        started = time.monotonic()
        stop = asyncio.Event()
        follower = DeploymentFollower(
            config, bootstrap_servers, newest_first=True, patience_s=DEPLOYMENTS_PATIENCE_S,
            on_decision=lambda d: print(f"{d.model}: serving {d.routing.describe()}", flush=True),
        ) if options.follow_deployments else None
        following = asyncio.create_task(follower.run(stop)) if follower else None
        if follower is not None:  # each request waits for its own model's routing (DeploymentFollower.current)
            try:
                await asyncio.wait_for(follower.tail_read.wait(), DEPLOYMENTS_PATIENCE_S)
            except TimeoutError:
                print(f"warning: the deployments topic did not answer within {DEPLOYMENTS_PATIENCE_S:.0f} s; requests "
                      "go to the model they name until it does", file=sys.stderr, flush=True)
        followed = time.monotonic()
        with process_publisher(config, bootstrap_servers, "proxy") as publisher:
            published = time.monotonic()
            proxy = LLMProxy(upstreams, publisher, agent_name=options.agent_name, deployments=follower,
                             max_tokens=config.proxy.max_tokens, keys=keys, feedback_secret=feedback_secret,
                             health=health)
            runner = await serve_proxy(proxy, host, port)
            ready = time.monotonic()
            print(f"proxy on http://{host}:{port} -> {', '.join(r.url for r in proxy.pool.replicas)}; "
                  f"point OpenAI clients at http://{host}:{port}/rollouts/<rollout_id>/v1 (ready in "
                  f"{ready - started:.1f} s: deployments {followed - started:.1f} s, publisher "
                  f"{published - followed:.1f} s, model servers checked {ready - published:.1f} s)", flush=True)
            try:
                await until_signalled(stop)
            finally:
                await runner.cleanup()
                stop.set()
                if following is not None:
                    await following

    uvloop.run(serve())
