"""The Schema Registry API in process (in-memory log) against the official confluent-kafka client, and the
codec on a user's registry (RemoteRegistry): its ids on the wire, BACKWARD checks before a new version is used."""

from __future__ import annotations

import json
import struct
import urllib.error
import urllib.request

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from infra.config import load_config
from infra.schema_registry import (
    IncompatibleSchemaVersion,
    RegistryClient,
    RemoteRegistry,
    register_product_schemas,
)
from infra.schema_registry.errors import Unauthorized
from infra.schema_registry.product import product_schemas, schema_json
from infra.security import KeySet
from schemas import TASK, AvroCodec, current_schemas, schema_id
from stack.schema_registry import MemoryLog, RegistryService, RegistryState, create_app
from stack.schema_registry.service import registry_client
from tests.support.http_thread import ServerThread

TASK_VALUE = {"task_id": "t1", "rollout_id": "r1", "group_id": None, "agent_name": None, "input": "{}",
              "attempt": 1, "max_attempts": 1, "timeout_s": 2.5, "enqueued_at_us": 1_700_000_000_000_000,
              "metadata": {"split": "train"}}


class Registry:
    """A registry on a loopback port, its log in memory (writes only with one of ``keys``, when given)."""

    def __init__(self, ids: str, seed: bool, keys: str | None = None) -> None:
        self.service = RegistryService(RegistryState(ids), MemoryLog())
        self.thread = ServerThread(create_app(self.service, KeySet(keys)))
        self.thread.call(self.service.start())
        if seed:
            self.thread.call(self.service.seed(product_schemas()))
        self.url = self.thread.url

    def stop(self) -> None:
        self.thread.call(self.service.stop())
        self.thread.stop()


@pytest.fixture
def stack_registry():
    registry = Registry("fingerprint", seed=True)
    yield registry
    registry.stop()


@pytest.fixture
def keyed_registry():
    registry = Registry("fingerprint", seed=True, keys="first-key, second-key")
    yield registry
    registry.stop()


@pytest.fixture
def users_registry():
    """The user's own registry: sequential ids, already holding other schemas, so its ids differ from ours."""
    registry = Registry("sequential", seed=False)
    client = RegistryClient(registry.url)
    for index in range(3):
        client.register(f"other-{index}-value", json.dumps(
            {"type": "record", "name": f"Other{index}", "fields": [{"name": "x", "type": "int"}]}))
    yield registry
    registry.stop()


def raw(url: str, method: str = "GET", body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/vnd.schemaregistry.v1+json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_stack_registry_serves_the_ids_the_codec_writes(stack_registry) -> None:
    client = SchemaRegistryClient({"url": stack_registry.url})
    subjects = client.get_subjects()
    assert set(current_schemas()) <= set(subjects)
    for name, schema in current_schemas().items():
        assert client.get_latest_version(name).schema_id == schema_id(schema)
        served = json.loads(client.get_schema(schema_id(schema)).schema_str)
        assert served["name"] == name
    header = AvroCodec().encode(TASK, TASK_VALUE)[:5]
    assert struct.unpack(">BI", header) == (0, client.get_latest_version(TASK).schema_id)
    assert client.get_versions("io.agentstream.v1.RolloutResult") == [1, 2]  # the retired version first


def test_register_lookup_compatibility_and_config_as_confluent_answers(stack_registry) -> None:
    client = SchemaRegistryClient({"url": stack_registry.url})
    v1 = Schema(json.dumps({"type": "record", "name": "X", "fields": [{"name": "a", "type": "int"}]}), "AVRO")
    first = client.register_schema("x-value", v1)
    assert client.register_schema("x-value", v1) == first  # same schema, same id, no new version
    assert client.register_schema("y-value", v1) == first  # one id per schema across subjects
    assert client.lookup_schema("x-value", v1).version == 1
    widened = Schema(json.dumps({"type": "record", "name": "X", "fields": [
        {"name": "a", "type": "long"}, {"name": "b", "type": "string", "default": ""}]}), "AVRO")
    assert client.test_compatibility("x-value", widened)
    breaking = Schema(json.dumps({"type": "record", "name": "X", "fields": [
        {"name": "a", "type": "int"}, {"name": "b", "type": "string"}]}), "AVRO")
    assert not client.test_compatibility("x-value", breaking)
    with pytest.raises(SchemaRegistryError) as refused:
        client.register_schema("x-value", breaking)
    assert refused.value.http_status_code == 409 and "/fields/b" in refused.value.error_message
    status, body = raw(f"{stack_registry.url}/compatibility/subjects/x-value/versions/latest?verbose=true",
                       "POST", {"schema": breaking.schema_str})
    assert status == 200 and body["is_compatible"] is False and "/fields/b" in body["messages"][0]
    second = client.register_schema("x-value", widened)
    assert client.get_versions("x-value") == [1, 2] and client.get_version("x-value", 2).schema_id == second
    assert client.get_compatibility() == "BACKWARD"
    client.set_compatibility("x-value", "NONE")
    assert client.get_compatibility("x-value") == "NONE"
    assert client.get_compatibility() == "BACKWARD"
    assert client.register_schema("x-value", breaking) not in (first, second)


def test_errors_have_confluents_codes(stack_registry) -> None:
    url = stack_registry.url
    assert raw(f"{url}/schemas/ids/7") == (404, {"error_code": 40403, "message": "Schema 7 not found"})
    assert raw(f"{url}/subjects/nope/versions")[1]["error_code"] == 40401
    assert raw(f"{url}/subjects/io.agentstream.v1.Task/versions/9")[1]["error_code"] == 40402
    assert raw(f"{url}/subjects/io.agentstream.v1.Task/versions/zero")[1]["error_code"] == 42202
    assert raw(f"{url}/subjects/x/versions", "POST", {"schema": "{nope"})[1]["error_code"] == 42201
    assert raw(f"{url}/subjects/x/versions", "POST", {"schema": "\"int\"", "schemaType": "PROTOBUF"})[0] == 422
    assert raw(f"{url}/config", "PUT", {"compatibility": "SIDEWAYS"})[1]["error_code"] == 42203
    assert raw(f"{url}/config/io.agentstream.v1.Task")[1]["error_code"] == 40408
    assert raw(f"{url}/config/io.agentstream.v1.Task?defaultToGlobal=true")[1] == {"compatibilityLevel": "BACKWARD"}
    assert raw(f"{url}/no/such/path")[0] == 404


def test_the_codec_writes_the_users_registry_ids(users_registry) -> None:
    registry = RemoteRegistry(RegistryClient(users_registry.url))
    ids = register_product_schemas(registry)
    assert set(ids) == set(current_schemas())
    assert max(ids.values()) <= 3 + len(current_schemas())  # sequential, after the user's own three
    assert all(ids[name] != schema_id(schema) for name, schema in current_schemas().items())
    data = AvroCodec(registry).encode(TASK, TASK_VALUE)
    assert struct.unpack(">BI", data[:5]) == (0, ids[TASK])
    fresh = AvroCodec(RemoteRegistry(RegistryClient(users_registry.url)))  # another process: asks the registry
    assert fresh.decode(data) == (TASK, TASK_VALUE)
    bundled = AvroCodec().encode(TASK, TASK_VALUE)  # written before the registry was configured
    assert fresh.decode(bundled) == (TASK, TASK_VALUE)


def test_an_incompatible_new_version_is_refused_before_it_is_used(users_registry) -> None:
    registry = RemoteRegistry(RegistryClient(users_registry.url))
    register_product_schemas(registry)
    task = current_schemas()[TASK]
    required = {**json.loads(schema_json(task))}
    required["fields"] = [*required["fields"], {"name": "priority", "type": "int"}]
    with pytest.raises(IncompatibleSchemaVersion) as refused:
        registry.register(required)
    message = str(refused.value)
    assert "io.agentstream.v1.Task" in message and "BACKWARD" in message and "/fields/priority" in message
    assert SchemaRegistryClient({"url": users_registry.url}).get_versions(TASK) == [1]  # nothing registered
    optional = {**required, "fields": [*required["fields"][:-1], {"name": "priority", "type": "int", "default": 0}]}
    new_id = registry.register(optional)
    assert SchemaRegistryClient({"url": users_registry.url}).get_version(TASK, 2).schema_id == new_id


X_SCHEMA = Schema(json.dumps({"type": "record", "name": "X", "fields": [{"name": "a", "type": "int"}]}), "AVRO")


def test_writes_need_a_key_and_reads_stay_open(keyed_registry) -> None:
    url = keyed_registry.url
    anonymous = SchemaRegistryClient({"url": url})
    assert set(current_schemas()) <= set(anonymous.get_subjects())  # a consumer's AvroDeserializer needs no key
    assert anonymous.get_schema(schema_id(current_schemas()[TASK])).schema_type == "AVRO"
    for client in (anonymous, SchemaRegistryClient({"url": url, "basic.auth.user.info": "any:wrong-key"})):
        with pytest.raises(SchemaRegistryError) as refused:
            client.register_schema("x-value", X_SCHEMA)
        assert (refused.value.http_status_code, refused.value.error_code) == (401, 40101)
        assert "registry_keys" in refused.value.error_message
    for method, path, body in (("POST", "/subjects/x-value/versions", {"schema": X_SCHEMA.schema_str}),
                               ("POST", f"/subjects/{TASK}", {"schema": schema_json(current_schemas()[TASK])}),
                               ("PUT", "/config", {"compatibility": "NONE"}),
                               ("DELETE", "/subjects/x-value", None)):
        status, answer = raw(url + path, method, body)
        assert status == 401 and answer["error_code"] == 40101, (method, path, answer)
    assert anonymous.get_compatibility() == "BACKWARD" and "x-value" not in anonymous.get_subjects()

    keyed = SchemaRegistryClient({"url": url, "basic.auth.user.info": "anyone:second-key"})
    first = keyed.register_schema("x-value", X_SCHEMA)
    assert keyed.lookup_schema("x-value", X_SCHEMA).schema_id == first
    status, _ = raw(url + "/config", "PUT", {"compatibility": "FULL"}, {"Authorization": "Bearer first-key"})
    assert status == 200 and anonymous.get_compatibility() == "FULL"


def test_agentstreams_own_client_sends_the_key(keyed_registry) -> None:
    port = keyed_registry.url.rpartition(":")[2]
    config = load_config(environ={"AGENTSTREAM_SCHEMA_REGISTRY_PORT": port,
                                  "AGENTSTREAM_REGISTRY_KEYS": "first-key,second-key"})
    registry = RemoteRegistry(registry_client(config))
    assert registry.register(json.loads(X_SCHEMA.schema_str)) > 0
    with pytest.raises(Unauthorized, match="registry_keys"):
        RegistryClient(keyed_registry.url).register("y-value", X_SCHEMA.schema_str)
    assert registry_client(load_config(environ={"AGENTSTREAM_SCHEMA_REGISTRY_PORT": port})).subjects()
