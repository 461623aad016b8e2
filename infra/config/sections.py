"""The whole configuration (Config, a field per section) and which class reads each table of the file (SECTIONS)."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentstream.infra.config.checkpoints import CheckpointsConfig
from agentstream.infra.config.clickhouse import ClickHouseConfig
from agentstream.infra.config.credit import CreditRule
from agentstream.infra.config.demo import DemoConfig
from agentstream.infra.config.deploy import DeployConfig
from agentstream.infra.config.kafka import KafkaConfig, TopicsConfig
from agentstream.infra.config.otlp import OtlpConfig
from agentstream.infra.config.runner import AglConfig, RunnerConfig
from agentstream.infra.config.schema_registry import SchemaRegistryConfig
from agentstream.infra.config.security import SecurityConfig
from agentstream.infra.config.serving import ProxyConfig, ServerConfig
from agentstream.infra.config.stack import StackConfig
from agentstream.infra.config.streams import StreamsConfig
from agentstream.infra.config.tracking import TrackingConfig
from agentstream.infra.config.trainer import TrainerConfig


@dataclass(frozen=True)
class Config:
    """The whole configuration; build it with :func:`load_config`."""

    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    topics: TopicsConfig = field(default_factory=TopicsConfig)
    clickhouse: ClickHouseConfig = field(default_factory=ClickHouseConfig)
    stack: StackConfig = field(default_factory=StackConfig)
    streams: StreamsConfig = field(default_factory=StreamsConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    credit: tuple[CreditRule, ...] = (CreditRule(),)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoints: CheckpointsConfig = field(default_factory=CheckpointsConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    agl: AglConfig = field(default_factory=AglConfig)
    deploy: DeployConfig = field(default_factory=DeployConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    schema_registry: SchemaRegistryConfig = field(default_factory=SchemaRegistryConfig)
    otlp: OtlpConfig = field(default_factory=OtlpConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


SECTIONS: dict[str, type] = {
    "kafka": KafkaConfig,
    "topics": TopicsConfig,
    "clickhouse": ClickHouseConfig,
    "stack": StackConfig,
    "streams": StreamsConfig,
    "runner": RunnerConfig,
    "trainer": TrainerConfig,
    "checkpoints": CheckpointsConfig,
    "server": ServerConfig,
    "proxy": ProxyConfig,
    "agl": AglConfig,
    "deploy": DeployConfig,
    "demo": DemoConfig,
    "schema_registry": SchemaRegistryConfig,
    "otlp": OtlpConfig,
    "security": SecurityConfig,
    "tracking": TrackingConfig,
}
RULE_LISTS: dict[str, type] = {"credit": CreditRule}
