"""``python -m stack.schema_registry``: serve the Schema Registry API over the configured Kafka (what ``up`` starts)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from agentstream.infra.config import Config, ConfigError, load_config
from agentstream.infra.kafka import client_options
from agentstream.infra.security import KeySet, check_bind
from agentstream.stack.registry_server.server import RegistryService, serve
from agentstream.stack.registry_server.state import ID_STRATEGIES, RegistryState
from agentstream.stack.registry_server.store import KafkaLog, MemoryLog, SchemaLog
from agentstream.stack.signals import stop_on_signals


def default_bootstrap(config: Config) -> str:
    """The configured Kafka, else where the embedded broker listens."""
    return config.kafka.bootstrap_servers or f"{config.stack.host}:{config.stack.broker_port}"


def run(config: Config, bootstrap_servers: str, host: str, port: int, topic: str | None = None,
        ids: str | None = None, memory: bool = False, announce=print, seed: bool = True) -> None:
    """Serve until SIGTERM or SIGINT: the log is ``topic`` on ``bootstrap_servers`` (or memory); ``seed`` registers
    the product's schemas (current and retired) first."""
    settings = config.schema_registry
    keys = KeySet(config.security.registry_keys)
    check_bind("Schema Registry", host, keys, "registry_keys", config.security)
    state = RegistryState(ids or settings.ids, settings.compatibility.upper())
    schema_log: SchemaLog = MemoryLog() if memory else KafkaLog(
        config.kafka, client_options(config.kafka, bootstrap_servers),
        topic or settings.topic_name(config.topics.prefix), config.topics.replication_factor)
    where = "memory" if memory else f"topic {topic or settings.topic_name(config.topics.prefix)} on {bootstrap_servers}"

    async def main() -> None:
        await serve(RegistryService(state, schema_log), host, port, seed=seed, stop=stop_on_signals(), keys=keys,
                    ready=lambda url: announce(f"schema registry on {url} ({state.ids} ids, {where})", flush=True))

    asyncio.run(main())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stack.schema_registry", description=__doc__)
    parser.add_argument("--config", type=Path, default=None, help="TOML config file (else the usual lookup)")
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--topic", default=None)
    parser.add_argument("--ids", choices=ID_STRATEGIES, default=None)
    parser.add_argument("--memory", action="store_true", help="keep the log in memory (nothing survives)")
    parser.add_argument("--no-seed", action="store_true", help="do not register agentstream's schemas at start")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    try:
        config = load_config(args.config)
        run(config, args.bootstrap_servers or default_bootstrap(config), args.host or config.stack.host,
            args.port or config.schema_registry.port, args.topic, args.ids, args.memory, seed=not args.no_seed)
    except ConfigError as error:  # a bad file, or keys missing for a bind beyond loopback: one line
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()
