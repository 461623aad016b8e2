"""The Schema Registry API in process (in-memory log) against the official confluent-kafka client, and the
codec on a user's registry (RemoteRegistry): its ids on the wire, BACKWARD checks before a new version is used."""

from __future__ import annotations

import json
import struct
import urllib.error
import urllib.request
import uuid
from typing import Any

import pytest
from confluent_kafka.schema_registry import (
    AssociationCreateOrUpdateRequest,
    AsyncSchemaRegistryClient,
    ConfigCompatibilityLevel,
    Metadata,
    MetadataProperties,
    Rule,
    RuleKind,
    RuleMode,
    RuleSet,
    Schema,
    SchemaRegistryClient,
    ServerConfig,
)
from confluent_kafka.schema_registry.common.schema_registry_client import SchemaVersion
from confluent_kafka.schema_registry.error import SchemaRegistryError

from agentstream.infra.config import load_config
from agentstream.infra.registry_client import (
    IncompatibleSchemaVersion,
    RegistryClient,
    RemoteRegistry,
    register_product_schemas,
)
from agentstream.infra.registry_client.errors import Unauthorized, error_for
from agentstream.infra.registry_client.product import product_schemas
from agentstream.infra.security import KeySet
from agentstream.schemas import TASK, AvroCodec, current_schemas, schema_id
from agentstream.schemas.catalog import schema_json
from agentstream.stack.registry_server import MemoryLog, RegistryService, RegistryState, create_app
from agentstream.stack.registry_server.service import registry_client
from tests.support.avro_samples import ROOT
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


def test_an_incompatible_answer_is_known_by_either_code() -> None:
    """Confluent answers an incompatible schema with error_code 40901 since its associations release, 409 before."""
    assert isinstance(error_for(409, 40901, "incompatible"), IncompatibleSchemaVersion)
    assert isinstance(error_for(409, 409, "incompatible"), IncompatibleSchemaVersion)


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
                               ("DELETE", "/config", None),
                               ("DELETE", f"/config/{TASK}", None),
                               ("PUT", "/mode", {"mode": "READONLY"}),
                               ("PUT", f"/mode/{TASK}", {"mode": "READONLY"}),
                               ("DELETE", f"/mode/{TASK}", None),
                               ("DELETE", f"/subjects/{TASK}/versions/1", None),
                               ("DELETE", f"/subjects/{TASK}", None),
                               ("DELETE", "/subjects/x-value", None)):
        status, answer = raw(url + path, method, body)
        assert status == 401 and answer["error_code"] == 40101, (method, path, answer)
    assert anonymous.get_compatibility() == "BACKWARD" and "x-value" not in anonymous.get_subjects()
    assert anonymous.get_global_mode() == "READWRITE" and anonymous.get_versions(TASK) == [1]
    for call, args in ((anonymous.delete_subject, (TASK,)), (anonymous.delete_version, (TASK, 1)),
                       (anonymous.update_global_mode, ("READONLY",)), (anonymous.delete_config, ())):
        assert answer_of(call, *args) == (401, 40101), call

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



def test_refused_credentials_name_the_registry_the_user_and_where_to_set_them(keyed_registry) -> None:
    """A user's registry (Confluent's, Karapace) says only "Unauthorized": agentstream's error says the rest."""
    config = load_config(environ={"SCHEMA_REGISTRY_URL": keyed_registry.url, "SCHEMA_REGISTRY_USERNAME": "me",
                                  "SCHEMA_REGISTRY_PASSWORD": "not-a-key"})
    with pytest.raises(Unauthorized) as refused:
        RegistryClient.from_config(config.schema_registry).register("y-value", X_SCHEMA.schema_str)
    message = str(refused.value)
    assert message.startswith(f"the schema registry at {keyed_registry.url} refused POST /subjects/y-value/versions "
                              "as user 'me' (401: this registry takes writes only with a key"), message
    assert message.endswith("; set them in [schema_registry] username and password "
                            "(SCHEMA_REGISTRY_USERNAME, SCHEMA_REGISTRY_PASSWORD)")
    assert "not-a-key" not in message
    with pytest.raises(Unauthorized, match=r"/subjects/y-value/versions without credentials \(401: "):
        RegistryClient(keyed_registry.url).register("y-value", X_SCHEMA.schema_str)


# What each public method of confluent-kafka's SchemaRegistryClient gets from this registry: the test below drives
# every one; docs/schema-registry.md has the same table.
SERVED_METHODS = {
    "close", "config", "clear_caches", "clear_latest_caches", "new_client",
    "register_schema", "register_schema_full_response", "lookup_schema", "get_schema", "get_schema_by_guid",
    "get_schema_types", "get_subjects_by_schema_id", "get_schema_versions", "get_subjects", "get_versions",
    "get_version", "get_latest_version", "get_latest_with_metadata", "get_referenced_by", "delete_subject",
    "delete_version", "test_compatibility", "test_compatibility_all_versions", "get_compatibility",
    "set_compatibility", "get_config", "set_config", "delete_config", "get_mode", "update_mode", "delete_mode",
    "get_global_mode", "update_global_mode", "get_contexts", "get_associations_by_resource_name",
    "delete_associations",
}
REFUSED_METHODS = {"create_association"}


def answer_of(call: Any, *args: Any, **kwargs: Any) -> tuple[int, int]:
    """The (HTTP status, error_code) the registry refused a client call with."""
    with pytest.raises(SchemaRegistryError) as refused:
        call(*args, **kwargs)
    return refused.value.http_status_code, refused.value.error_code


@pytest.fixture
def empty_registry():
    registry = Registry("fingerprint", seed=False)
    yield registry
    registry.stop()


def test_the_table_names_every_public_method_of_the_client() -> None:
    """A client release that adds a method fails here until the registry and docs/schema-registry.md say what
    it gets."""
    public = {name for name in dir(SchemaRegistryClient) if not name.startswith("_")}
    assert public == SERVED_METHODS | REFUSED_METHODS
    assert public <= {name for name in dir(AsyncSchemaRegistryClient) if not name.startswith("_")} | {"close"}
    table = (ROOT / "docs" / "schema-registry.md").read_text()
    assert all(f"`{name}`" in table for name in public)


def test_every_client_method_as_confluent_answers(empty_registry) -> None:
    url = empty_registry.url
    with SchemaRegistryClient({"url": url}) as client:
        assert client.config()["url"] == url
        assert isinstance(SchemaRegistryClient.new_client({"url": url}), SchemaRegistryClient)
        assert client.get_schema_types() == ["AVRO"]
        assert client.get_contexts() == ["."] and client.get_contexts(offset=1) == []
        assert client.get_global_mode() == "READWRITE"

        # Registered as submitted (spacing and all), with metadata and rules; the plain schema is another schema.
        text = '{"type": "record",  "name": "A", "fields": [{"name": "a", "type": "int"}]}'
        owner_a = Metadata(tags=None, properties=MetadataProperties({"owner": "team-a"}), sensitive=None)
        rules = RuleSet(migration_rules=None, domain_rules=[Rule(
            name="positive", doc=None, kind=RuleKind.CONDITION, mode=RuleMode.WRITE, type="CEL", tags=None,
            params=None, expr="message.a > 0", on_success=None, on_failure=None, disabled=None)])
        first = client.register_schema_full_response("a-value", Schema(text, "AVRO", metadata=owner_a,
                                                                       rule_set=rules))
        assert (first.subject, first.version) == ("a-value", 1) and uuid.UUID(first.guid)
        client.clear_caches()
        served = client.get_schema(first.schema_id)
        assert served.schema_str == text and served.metadata.properties.properties == {"owner": "team-a"}
        assert served.rule_set.domain_rules[0].expr == "message.a > 0"
        assert client.get_schema_by_guid(first.guid).schema_str == text
        assert answer_of(client.get_schema_by_guid, str(uuid.uuid4())) == (404, 40403)
        widened = json.dumps({"type": "record", "name": "A", "fields": [
            {"name": "a", "type": "int"}, {"name": "b", "type": "string", "default": ""}]})
        owner_b = Metadata(tags=None, properties=MetadataProperties({"owner": "team-b"}), sensitive=None)
        second_id = client.register_schema("a-value", Schema(widened, "AVRO", metadata=owner_b))
        plain_id = client.register_schema("b-value", Schema(text, "AVRO"))
        assert len({first.schema_id, second_id, plain_id}) == 3

        # Reads, filters and pages.
        assert client.get_subjects() == ["a-value", "b-value"]
        assert client.get_subjects(subject_prefix="b") == ["b-value"]
        assert client.get_subjects(offset=1, limit=1) == ["b-value"]
        assert client.get_versions("a-value") == [1, 2] and client.get_versions("a-value", offset=1) == [2]
        assert client.get_latest_version("a-value").schema_id == second_id
        assert client.get_version("a-value", 1).schema_id == first.schema_id
        assert client.get_latest_with_metadata("a-value", {"owner": "team-a"}).version == 1
        assert client.get_latest_with_metadata("a-value", {"owner": "team-b"}).schema_id == second_id
        assert answer_of(client.get_latest_with_metadata, "a-value", {"owner": "nobody"}) == (404, 40403)
        assert client.lookup_schema("a-value", Schema(text, "AVRO", metadata=owner_a, rule_set=rules)).version == 1
        assert client.lookup_schema("b-value", Schema(text, "AVRO")).schema_id == plain_id
        assert client.get_subjects_by_schema_id(plain_id) == ["b-value"]
        assert client.get_schema_versions(plain_id) == [SchemaVersion("b-value", 1)]
        assert client.get_referenced_by("a-value", 1) == []
        status, latest = raw(f"{url}/schemas?subjectPrefix=a&latestOnly=true")  # no client method asks for this
        assert status == 200 and [(v["subject"], v["version"], v["id"]) for v in latest] == [("a-value", 2, second_id)]
        assert answer_of(client.get_referenced_by, "a-value", 9) == (404, 40402)
        breaking = Schema(json.dumps({"type": "record", "name": "A", "fields": [{"name": "c", "type": "int"}]}))
        assert client.test_compatibility("a-value", breaking) is False
        assert client.test_compatibility_all_versions("a-value", breaking) is False
        assert answer_of(client.register_schema, "a-value", breaking) == (409, 40901)

        # Config: levels only (what the client's ServerConfig adds beyond a level is refused).
        assert client.set_compatibility("a-value", "FULL") == {"compatibility": "FULL"}
        assert client.get_compatibility("a-value") == "FULL"
        assert client.set_config("b-value", ServerConfig(compatibility=ConfigCompatibilityLevel.NONE)) == {
            "compatibility": "NONE"}
        assert client.get_config("b-value").compatibility_level == ConfigCompatibilityLevel.NONE
        assert client.delete_config("b-value").compatibility_level == ConfigCompatibilityLevel.NONE
        assert answer_of(client.get_config, "b-value") == (404, 40408)
        assert answer_of(client.delete_config, "b-value") == (404, 40401)
        assert answer_of(client.set_config, None, ServerConfig(compatibility_group="app")) == (422, 42205)
        client.set_config(config=ServerConfig(compatibility=ConfigCompatibilityLevel.FULL_TRANSITIVE))
        assert client.delete_config().compatibility_level == ConfigCompatibilityLevel.FULL_TRANSITIVE
        assert client.get_config().compatibility_level == ConfigCompatibilityLevel.BACKWARD

        # Modes: READONLY refuses writes; IMPORT only where nothing is registered, unless forced.
        assert answer_of(client.get_mode, "a-value") == (404, 40409)
        assert client.update_mode("a-value", "READONLY") == "READONLY" and client.get_mode("a-value") == "READONLY"
        assert answer_of(client.register_schema, "a-value", breaking) == (422, 42205)
        assert answer_of(client.delete_subject, "a-value") == (422, 42205)
        assert answer_of(client.update_mode, "a-value", "SIDEWAYS") == (422, 42204)
        assert client.delete_mode("a-value") == "READONLY"
        assert answer_of(client.get_mode, "a-value") == (404, 40409)
        assert answer_of(client.delete_mode, "a-value") == (404, 40401)
        assert answer_of(client.update_global_mode, "IMPORT") == (422, 42205)
        assert client.update_global_mode("IMPORT", force=True) == "IMPORT"
        assert answer_of(client.register_schema, "c-value", Schema(text)) == (422, 42205)  # an import needs ids
        assert client.update_global_mode("READWRITE") == "READWRITE"
        assert client.update_mode("fresh-value", "IMPORT") == "IMPORT"  # nothing registered there: no force needed
        imported = json.dumps({"type": "record", "name": "Imported", "fields": [{"name": "i", "type": "int"}]})
        status, body = raw(f"{url}/subjects/fresh-value/versions", "POST",
                           {"schema": imported, "id": 777, "version": 3})
        assert status == 200 and (body["id"], body["version"]) == (777, 3)  # a migration keeps ids and versions
        assert client.get_schema(777).schema_str == imported
        status, body = raw(f"{url}/subjects/a-value/versions", "POST", {"schema": imported, "id": 778})
        assert (status, body["error_code"]) == (422, 42205) and "not in import mode" in body["message"]
        assert client.delete_subject("fresh-value") == [3] and client.delete_subject("fresh-value", True) == [3]
        assert answer_of(client.get_mode, "fresh-value") == (404, 40409)  # gone with its last version

        # Deletes: soft first (hidden unless asked for), then permanent.
        assert client.delete_version("a-value", 1) == 1
        assert client.get_versions("a-value") == [2] and client.get_versions("a-value", deleted=True) == [1, 2]
        assert client.get_versions("a-value", deleted_only=True) == [1]
        assert answer_of(client.get_version, "a-value", 1) == (404, 40402)
        assert client.get_version("a-value", 1, deleted=True).schema_id == first.schema_id
        client.clear_caches()
        assert client.get_schema(first.schema_id).schema_str == text  # its id still decodes
        assert client.lookup_schema("a-value", Schema(text, "AVRO", metadata=owner_a, rule_set=rules),
                                    deleted=True).version == 1
        assert answer_of(client.delete_version, "a-value", 1) == (404, 40406)
        assert answer_of(client.delete_version, "a-value", 2, permanent=True) == (404, 40407)
        assert client.delete_version("a-value", 1, permanent=True) == 1
        assert client.get_versions("a-value", deleted=True) == [2]
        assert answer_of(client.delete_subject, "b-value", permanent=True) == (404, 40405)
        assert client.delete_subject("b-value") == [1]
        assert client.get_subjects() == ["a-value"] and client.get_subjects(deleted=True) == ["a-value", "b-value"]
        assert client.get_subjects(deleted_only=True) == ["b-value"]
        assert answer_of(client.delete_subject, "b-value") == (404, 40404)
        client.clear_latest_caches()
        assert answer_of(client.get_latest_version, "b-value") == (404, 40401)
        assert client.get_schema_versions(plain_id) == []
        assert client.get_schema_versions(plain_id, deleted=True) == [SchemaVersion("b-value", 1)]
        assert client.register_schema("b-value", Schema(text, "AVRO")) == plain_id  # re-registered: a new version
        assert client.get_versions("b-value", deleted=True) == [1, 2]
        client.set_compatibility("b-value", "NONE")
        assert client.delete_subject("b-value") == [2] and client.get_compatibility("b-value") == "NONE"
        assert client.delete_subject("b-value", permanent=True) == [1, 2]
        assert client.get_subjects(deleted=True) == ["a-value"]
        assert answer_of(client.get_config, "b-value") == (404, 40408)  # gone with its last version
        client.clear_caches()
        assert answer_of(client.get_schema, plain_id) == (404, 40403)  # no version holds it any more
        assert client.register_schema_full_response("b-value", Schema(text, "AVRO")).version == 1
        assert answer_of(client.delete_subject, "nope") == (404, 40401)

        # Associations (a newer Confluent API, which serializers ask about by default): none exist, none are made.
        assert client.get_associations_by_resource_name("orders", "-", "topic", ["value"]) == []
        assert answer_of(client.delete_associations, "t1") == (404, 40410)
        assert answer_of(client.create_association, AssociationCreateOrUpdateRequest(
            resource_name="orders", resource_namespace="lkc-1", resource_id="t1", resource_type="topic",
            associations=[])) == (501, 50101)
    client.close()  # a second close is harmless


def test_a_subject_with_control_characters_is_refused_as_confluent_does(empty_registry) -> None:
    """A newline or NUL in a subject would forge lines in logs and keys in the backing topic: 422, 42208, and
    nothing is written; any other name (slashes, dots, unicode) is a plain subject name."""
    client = SchemaRegistryClient({"url": empty_registry.url})
    for subject in ("a\nb-value", "nul\x00-value", "tab\t-value", "del\x7f-value"):
        assert answer_of(client.register_schema, subject, X_SCHEMA) == (422, 42208), subject
        assert answer_of(client.update_mode, subject, "READONLY") == (422, 42208), subject
        assert answer_of(client.set_compatibility, subject, "NONE") == (422, 42208), subject
    assert client.get_subjects(deleted=True) == []
    for subject in ("../config", "a/b", "ünïcødé-☃", " "):
        assert client.register_schema(subject, X_SCHEMA) > 0
        assert client.get_latest_version(subject).subject == subject
    assert sorted(client.get_subjects()) == sorted(["../config", "a/b", "ünïcødé-☃", " "])


def test_an_import_beyond_confluents_32_bit_ids_and_versions_is_refused_before_anything_is_written(empty_registry):
    """Ids and versions are Java ints in Confluent's registry and 4 bytes on the wire: 2^31 is refused (400), and a
    refused registration leaves no version behind."""
    url, key = empty_registry.url, {"Authorization": "Bearer any"}
    assert raw(url + "/mode/imp-value", "PUT", {"mode": "IMPORT"})[0] == 200
    text = json.dumps({"type": "fixed", "name": "F", "size": 1})
    for body in ({"id": 2**31, "version": 1}, {"id": 5, "version": 2**31}, {"id": 2**40}):
        status, answer = raw(url + "/subjects/imp-value/versions", "POST", {"schema": text, **body}, key)
        assert (status, answer["error_code"]) == (400, 400) and "2147483647" in answer["message"], (body, answer)
    assert raw(url + "/subjects/imp-value/versions?deleted=true")[0] == 404
    status, answer = raw(url + "/subjects/imp-value/versions", "POST", {"schema": text, "id": 2**31 - 1,
                                                                        "version": 2**31 - 1}, key)
    assert status == 200 and (answer["id"], answer["version"]) == (2**31 - 1, 2**31 - 1)


@pytest.mark.parametrize("extra, problem", [
    ({"metadata": {"properties": "x"}}, "metadata.properties"),
    ({"metadata": {"properties": {"owner": {"nested": 1}}}}, "metadata.properties"),
    ({"metadata": {"tags": {"f": "PII"}}}, "metadata.tags"),
    ({"metadata": {"sensitive": "s"}}, "metadata.sensitive"),
    ({"ruleSet": {"domainRules": "x"}}, "ruleSet.domainRules"),
    ({"ruleSet": {"migrationRules": [1]}}, "ruleSet.migrationRules"),
    ({"ruleSet": {"domainRules": [{"name": "r", "kind": "SHOUT"}]}}, "kind"),
    ({"ruleSet": {"domainRules": [{"name": "r", "mode": "SOMETIMES"}]}}, "mode"),
    ({"ruleSet": {"domainRules": [{"name": "r", "params": "x"}]}}, "params"),
])
def test_metadata_and_rules_that_the_client_cannot_read_back_are_refused(empty_registry, extra, problem):
    """A stored shape confluent-kafka's client cannot parse would break every read of the version (an
    AttributeError in from_dict) for every reader: 422 (42201), and nothing is registered."""
    url = empty_registry.url
    status, answer = raw(url + "/subjects/m-value/versions", "POST", {"schema": X_SCHEMA.schema_str, **extra})
    assert (status, answer["error_code"]) == (422, 42201) and problem in answer["message"], answer
    assert raw(url + "/subjects/m-value/versions?deleted=true")[0] == 404
    client = SchemaRegistryClient({"url": url})
    well_formed = {"metadata": {"tags": {"a": ["PII"]}, "properties": {"owner": "team-a"}, "sensitive": ["s"]},
                   "ruleSet": {"domainRules": [{"name": "r", "kind": "CONDITION", "mode": "WRITE", "type": "CEL",
                                                "expr": "message.a > 0", "params": {"k": "v"}}]}}
    assert raw(url + "/subjects/m-value/versions", "POST", {"schema": X_SCHEMA.schema_str, **well_formed})[0] == 200
    served = client.get_latest_version("m-value").schema
    assert served.metadata.tags.tags == {"a": ["PII"]} and served.rule_set.domain_rules[0].params.params == {"k": "v"}
