"""Typed configuration for every agentstream component: one TOML file plus environment variables.

Precedence, lowest first: built-in defaults, the TOML file (``agentstream.toml`` in the
working directory, or the path in ``AGENTSTREAM_CONFIG``), then environment variables.
Secrets are wrapped in :class:`Secret` so they never show up in a repr, a log line or a
status print.

The package: ``loader`` reads the file and the environment (and writes the file back out),
``environment`` names the variables, ``sections`` holds :class:`Config`, a module per section (or
small family of sections) holds its dataclass and its checks, stated with ``checks``. The demos'
``[demo]`` is defined with the demos (``agentstream.demo.settings``), which add it (``add_section``).
"""

from agentstream.infra.config.checkpoints import CHECKPOINT_BUCKET, OBJECTSTORE_SERVICE, CheckpointsConfig
from agentstream.infra.config.checks import Checks
from agentstream.infra.config.clickhouse import ClickHouseConfig
from agentstream.infra.config.credit import LEVELS, STRATEGIES, CreditRule
from agentstream.infra.config.deploy import DeployConfig
from agentstream.infra.config.environment import CONFIG_FILE_VARIABLE, ENVIRONMENT
from agentstream.infra.config.errors import ConfigError, Secret
from agentstream.infra.config.kafka import IDEMPOTENCE, KafkaConfig, TopicsConfig
from agentstream.infra.config.loader import describe, dump_toml, load_config
from agentstream.infra.config.otlp import OtlpConfig
from agentstream.infra.config.runner import AglConfig, RunnerConfig
from agentstream.infra.config.schema_registry import COMPATIBILITY_LEVELS, SCHEMA_REGISTRY_IDS, SchemaRegistryConfig
from agentstream.infra.config.sections import RULE_LISTS, SECTIONS, Config, add_section
from agentstream.infra.config.security import SecurityConfig
from agentstream.infra.config.serving import ProxyConfig, ServerConfig, server_urls_problem
from agentstream.infra.config.stack import BROKER_STORAGES, BROKERS, StackConfig
from agentstream.infra.config.streams import StreamsConfig
from agentstream.infra.config.tracking import MLFLOW_SCHEMES, WANDB_MODES, TrackingConfig, masked_uris, uri_scheme
from agentstream.infra.config.trainer import TrainerConfig

__all__ = [
    "BROKERS",
    "BROKER_STORAGES",
    "CHECKPOINT_BUCKET",
    "COMPATIBILITY_LEVELS",
    "CONFIG_FILE_VARIABLE",
    "ENVIRONMENT",
    "IDEMPOTENCE",
    "LEVELS",
    "MLFLOW_SCHEMES",
    "OBJECTSTORE_SERVICE",
    "RULE_LISTS",
    "SCHEMA_REGISTRY_IDS",
    "SECTIONS",
    "STRATEGIES",
    "WANDB_MODES",
    "AglConfig",
    "CheckpointsConfig",
    "Checks",
    "ClickHouseConfig",
    "Config",
    "ConfigError",
    "CreditRule",
    "DeployConfig",
    "KafkaConfig",
    "OtlpConfig",
    "ProxyConfig",
    "RunnerConfig",
    "SchemaRegistryConfig",
    "Secret",
    "SecurityConfig",
    "ServerConfig",
    "StackConfig",
    "StreamsConfig",
    "TopicsConfig",
    "TrackingConfig",
    "TrainerConfig",
    "add_section",
    "describe",
    "dump_toml",
    "load_config",
    "masked_uris",
    "server_urls_problem",
    "uri_scheme",
]
