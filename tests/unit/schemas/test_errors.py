"""Every exception the product defines derives from AgentstreamError, and `retriable` marks the transient ones.

The classes are found by importing every module of the product packages, not from a hand list,
so a new exception class that forgets the base fails here.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import agentstream
from agentstream.schemas.errors import AgentstreamError

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("agentstream", "deploy", "infra", "models", "pipeline", "schemas", "serving", "stack", "streams", "trainer")

PRIVATE_EXEMPT = {"agentstream.stack.objectstore._NotModified", "agentstream.schemas.span_writer._Unusual"}
"""Control flow inside one module (a 304 answer, the span writer's fast path): never raised out of it."""

RETRIABLE = {
    "agentstream.infra.checkpoint_store.StoreUnreachable",
    "agentstream.infra.clickhouse.ClickHouseUnreachable",
    "agentstream.infra.kafka.KafkaUnreachable",
    "agentstream.infra.registry_client.errors.RegistryUnavailable",
    "agentstream.infra.registry_client.errors.StoreError",
    "agentstream.infra.registry_client.errors.StoreTimeout",
    "agentstream.pipeline.collector.receiver.Busy",
    "agentstream.pipeline.proxy.server.UpstreamError",
    "agentstream.pipeline.publisher.errors.FlushTimeout",
    "agentstream.pipeline.publisher.errors.PublisherFull",
    "agentstream.serving.hotswap.StoreNotReachable",
}
"""Outages and back-pressure: the same call, made again later, may succeed."""

PUBLIC_ERRORS = {"AgentLoadError", "AgentstreamError", "CodecError", "ConfigError", "EncodeError", "FlushTimeout",
                 "NoRollout", "NoSink", "PublisherClosed", "PublisherError", "PublisherFull", "RewardError",
                 "TaskFileError", "TokenMismatch"}
"""What a user of the SDK or the CLI can meet, exported by ``import agentstream``."""


def product_modules(root: Path = ROOT) -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__main__":
                continue  # importing it runs the command
            if package != "agentstream":
                parts = ("agentstream", *parts)  # the room's folder is the subpackage agentstream.<room>
            elif parts[1] in PACKAGES:
                continue  # agentstream/<room> links to the room's folder, walked as the room
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def exception_classes(modules: list[str]) -> dict[str, type[BaseException]]:
    """Exception classes by qualified name, each counted in the module that defines it (not where re-exported)."""
    found: dict[str, type[BaseException]] = {}
    for name in modules:
        module = importlib.import_module(name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == name:
                found[f"{name}.{value.__qualname__}"] = value
    return found


def outside_the_base(classes: dict[str, type[BaseException]]) -> list[str]:
    return sorted(name for name, cls in classes.items()
                  if not issubclass(cls, AgentstreamError) and name not in PRIVATE_EXEMPT)


@pytest.fixture(scope="module")
def classes() -> dict[str, type[BaseException]]:
    return exception_classes(product_modules())


def test_the_walk_finds_the_product_exceptions(classes):
    assert len(classes) > 80
    for name in ("agentstream.schemas.errors.CodecError", "agentstream.pipeline.sdk.NoRollout",
                 "agentstream.trainer.policy.PolicyError",
                 "agentstream.infra.registry_client.errors.StoreTimeout", *PRIVATE_EXEMPT, *RETRIABLE):
        assert name in classes


def test_every_product_exception_derives_from_agentstream_error(classes):
    assert outside_the_base(classes) == []


def test_the_check_sees_a_class_outside_the_base(classes):
    class Planted(ValueError):
        pass

    assert outside_the_base({**classes, "planted.Planted": Planted}) == ["planted.Planted"]


def test_the_exemptions_are_private_to_their_module(classes):
    sources = {path: path.read_text() for package in PACKAGES for path in (ROOT / package).rglob("*.py")
               if package != "agentstream" or path.relative_to(ROOT).parts[1] not in PACKAGES}
    for qualified in PRIVATE_EXEMPT:
        module, _, name = qualified.rpartition(".")
        assert name.startswith("_") and not issubclass(classes[qualified], AgentstreamError)
        users = sorted(str(path.relative_to(ROOT)) for path, text in sources.items() if name in text)
        assert users == [module.removeprefix("agentstream.").replace(".", "/") + ".py"]


def test_the_retriable_errors_are_the_transient_ones(classes):
    chosen = {name for name, cls in classes.items() if issubclass(cls, AgentstreamError) and cls.retriable}
    assert chosen == RETRIABLE
    assert all(type(cls.retriable) is bool for cls in classes.values() if issubclass(cls, AgentstreamError))
    assert AgentstreamError.retriable is False


def test_builtin_bases_that_callers_catch_are_kept(classes):
    assert issubclass(classes["agentstream.infra.config.ConfigError"], ValueError)
    assert issubclass(classes["agentstream.pipeline.runner.errors.AgentLoadError"], ImportError)
    assert issubclass(classes["agentstream.schemas.contracts.RewardError"], ValueError)
    assert issubclass(classes["agentstream.pipeline.publisher.errors.PublisherError"], RuntimeError)


def test_agentstream_exports_its_errors():
    assert PUBLIC_ERRORS - set(agentstream.__all__) == set()
    for name in agentstream.__all__:
        value = getattr(agentstream, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert issubclass(value, AgentstreamError), name
    assert agentstream.AgentstreamError is AgentstreamError
