"""The whole configuration (Config, a field per section) and which class reads each table of the file (SECTIONS).

One section is defined above infra: the demos' ``[demo]`` (``agentstream.demo.settings``). Config keeps
its field, and :func:`add_section` names its class, so the loader reads, checks, describes and dumps it
like infra's own sections without importing the layer that defines it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from agentstream.infra.config.checkpoints import CheckpointsConfig
from agentstream.infra.config.clickhouse import ClickHouseConfig
from agentstream.infra.config.credit import CreditRule
from agentstream.infra.config.deploy import DeployConfig
from agentstream.infra.config.environment import ENVIRONMENT
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
    demo: Any = field(default_factory=lambda: _added_default("demo"))  # agentstream.demo.settings.DemoConfig
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
    "schema_registry": SchemaRegistryConfig,
    "otlp": OtlpConfig,
    "security": SecurityConfig,
    "tracking": TrackingConfig,
}
RULE_LISTS: dict[str, type] = {"credit": CreditRule}


def add_section(name: str, cls: type, environment: Mapping[str, str]) -> None:
    """Make ``cls`` (a frozen dataclass) the section ``Config.<name>`` holds and ``[<name>]`` is read into.

    For a section defined above infra (the demos' ``[demo]``), added when its module is imported:
    ``environment`` maps each of its variables to the field it sets (``DEMO_QUICK`` -> ``quick``).
    Its table is read, its unknown keys refused and its values coerced and checked like any section's.
    """
    order = [f.name for f in fields(Config)]
    if name not in order or name in RULE_LISTS:
        raise ValueError(f"Config has no field for a section {name!r}")
    held = SECTIONS.get(name)
    if held is not None and (held.__module__, held.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"section {name!r} is {held.__module__}.{held.__qualname__} already")
    sections = {**SECTIONS, name: cls}
    SECTIONS.clear()
    SECTIONS.update((section, sections[section]) for section in order if section in sections)  # Config's order
    ENVIRONMENT.update((variable, (name, key)) for variable, key in environment.items())


def _added_default(name: str) -> Any:
    """The default of a section added from above: its class's defaults, or None while none is added."""
    cls: Callable[[], Any] | None = SECTIONS.get(name)
    return cls() if cls is not None else None
