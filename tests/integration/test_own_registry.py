"""agentstream with a user's own registry that is not agentstream's: Karapace, an independent Confluent-compatible
Schema Registry (Aiven's), over the session's tansu broker.

The same checks as the stack's own registry gets as "the user's registry" (test_schema_registry.py): the product's
client registers every schema there (three user subjects hold ids 1 to 3), spans carry Karapace's ids on the wire,
confluent-kafka's AvroDeserializer and agentstream's codec decode them through it, registering again changes
nothing, and a Task version agentstream's Task cannot read is refused before anything is registered.

Opt-in (``make test-registries``): Karapace comes from its source, not from a package registry, so
``AGENTSTREAM_KARAPACE`` must name the command that starts it (see tests/support/karapace.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentstream.infra.config import Config
from agentstream.infra.registry_client import RegistryClient
from agentstream.infra.registry_client.errors import Unauthorized
from agentstream.schemas import current_schemas
from tests.integration import test_schema_registry as with_a_users_registry
from tests.support.karapace import COMMAND_VARIABLE, KarapaceProcess, karapace_command, write_authfile
from tests.support.schema_registry import register_users_subjects

pytestmark = pytest.mark.registries  # `make test` leaves these out (tests/conftest.py)


def required_karapace() -> list[str]:
    """The command that starts Karapace; the test fails, saying how to name it, when there is none."""
    command = karapace_command()
    if command is None:
        pytest.fail(f"no Karapace: set {COMMAND_VARIABLE} to the command that starts it "
                    "(e.g. '/opt/karapace/.venv/bin/python -m karapace')")
    return command


def environment_for(url: str, home: Path, **settings: str) -> dict[str, str]:
    """This process's environment for an agentstream command on the registry at ``url``, and ``settings``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("AGENTSTREAM_", "SCHEMA_REGISTRY_"))},
            "SCHEMA_REGISTRY_URL": url, "AGENTSTREAM_HOME": str(home), **settings}


@pytest.fixture
def users_registry(stack, tmp_path: Path):
    """Karapace on its own topic of the session's broker, with three subjects of the user's."""
    registry = KarapaceProcess(required_karapace(), stack.bootstrap_servers, tmp_path / "karapace.log").start()
    register_users_subjects(registry.url)
    yield registry
    registry.stop()


def test_karapace_gets_the_schemas_and_its_ids_are_on_the_wire(users_registry: KarapaceProcess,
                                                               topics_config: Config, stack, tmp_path: Path) -> None:
    with_a_users_registry.test_with_the_users_registry_its_ids_are_on_the_wire(
        users_registry, topics_config, stack, tmp_path)
    again = with_a_users_registry.agentstream("schema-registry", "register",
                                              environment=environment_for(users_registry.url, tmp_path))
    assert again.returncode == 0, again.stderr
    client = RegistryClient(users_registry.url)
    assert all(client.call("GET", f"/subjects/{name}/versions") == [1] for name in current_schemas())


def test_karapace_an_incompatible_schema_is_refused_clearly(users_registry: KarapaceProcess, tmp_path: Path) -> None:
    with_a_users_registry.test_an_incompatible_schema_in_the_users_registry_is_refused_clearly(
        users_registry, tmp_path)


def test_karapace_with_basic_auth_gets_the_configured_credentials(stack, tmp_path: Path) -> None:
    """``[schema_registry] username``/``password`` reach a registry that checks them; wrong ones fail clearly."""
    authfile = write_authfile(tmp_path / "karapace-auth.json", "agentstream", "the-secret")
    registry = KarapaceProcess(required_karapace(), stack.bootstrap_servers, tmp_path / "karapace.log",
                               authfile).start()
    try:
        anonymous = with_a_users_registry.agentstream("schema-registry", "register",
                                                      environment=environment_for(registry.url, tmp_path))
        assert anonymous.returncode == 1
        assert anonymous.stderr.startswith(f"error: the schema registry at {registry.url} refused POST /subjects/"
                                           "io.agentstream.v1.Announcement without credentials (401: Unauthorized)"
                                           "; set them in [schema_registry] username and password"), anonymous.stderr
        refused = with_a_users_registry.agentstream("schema-registry", "register", environment=environment_for(
            registry.url, tmp_path, SCHEMA_REGISTRY_USERNAME="agentstream", SCHEMA_REGISTRY_PASSWORD="wrong"))
        assert refused.returncode == 1
        assert "without" not in refused.stderr and "as user 'agentstream' (401: Unauthorized)" in refused.stderr
        with pytest.raises(Unauthorized):  # Karapace's 401 has no error_code: the status says it
            RegistryClient(registry.url, "agentstream", "wrong").subjects()
        registered = with_a_users_registry.agentstream("schema-registry", "register", environment=environment_for(
            registry.url, tmp_path, SCHEMA_REGISTRY_USERNAME="agentstream", SCHEMA_REGISTRY_PASSWORD="the-secret"))
        assert registered.returncode == 0, registered.stderr
        client = RegistryClient(registry.url, "agentstream", "the-secret")
        assert set(client.subjects()) == set(current_schemas())
    finally:
        registry.stop()
