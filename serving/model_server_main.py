"""The `agentstream serve-model` process: a model behind vLLM's OpenAI-compatible API (the dev model server)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import uvloop

from agentstream.infra.config import Config
from agentstream.infra.security import KeySet, check_bind
from agentstream.models import load_model
from agentstream.models.precision import resolve_precision
from agentstream.serving.app import serve
from agentstream.serving.protocol import Contract


@dataclass(frozen=True)
class ModelServerOptions:
    """Where the server listens and how it runs; None takes the ``[server]`` setting."""

    model_spec: str = "smollm2"
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    max_tokens: int | None = None
    contract: str | None = None


def run_model_server(config: Config, options: ModelServerOptions) -> None:
    """Load the model and serve it until SIGINT (ModelLoadError, PrecisionError: it cannot be loaded as asked)."""
    logging.getLogger("agentstream").setLevel(logging.INFO)
    settings = config.server
    admin_token = KeySet(config.security.admin_token)
    check_bind("model server", options.host, admin_token, "admin_token", config.security)
    precision = resolve_precision(options.device or settings.device, options.dtype or settings.dtype)
    loaded = load_model(options.model_spec, precision=precision,
                        threads=settings.threads if options.threads is None else options.threads, inference_only=True)
    served_contract = Contract(options.contract or settings.contract)
    print(f"serving {loaded.name} on {precision.describe()} ({served_contract} contract)", flush=True)
    try:
        uvloop.run(serve(loaded, host=options.host, port=options.port, served_model_names=options.served_model_names,
                         contract=served_contract, admin_token=admin_token,
                         max_tokens=settings.max_tokens if options.max_tokens is None else options.max_tokens))
    except KeyboardInterrupt:
        pass
