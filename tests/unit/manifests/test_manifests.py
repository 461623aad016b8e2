"""The Kubernetes manifests, the compose file and docs/deployment.md say only what the code accepts.

Docker and kubectl cannot run here, so what they would run is checked with what can: every
agentstream command line parses with the real CLI (torchrun's own options with torchrun's
parser), every environment variable of an agentstream container that looks like a setting is one
the config loader reads, every agentstream.toml loads with the real loader (which rejects unknown
keys), every port a role's container, Service or compose service declares is the port that role
listens on by its command line and configuration, and every URL a role is given names a Service
(or compose service) on a port it serves.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import yaml

from agentstream.cli import main as cli
from agentstream.infra.config import CONFIG_FILE_VARIABLE, ENVIRONMENT, Config, load_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
KUBERNETES = ROOT / "manifests" / "kubernetes"
COMPOSE = ROOT / "manifests" / "compose.yaml"
DOCKERFILE = ROOT / "manifests" / "Dockerfile"
DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"
IMAGE = "agentstream"
IMAGE_SOURCE = "/opt/agentstream/"
"""Where manifests/Dockerfile copies this repository: a path under it names a file of this checkout."""
SETTING_PREFIXES = ("AGENTSTREAM_", "KAFKA_", "CLICKHOUSE_", "SCHEMA_REGISTRY_")
"""Names in these namespaces are agentstream settings: a misspelled one would be ignored silently."""
PLACEHOLDER = "placeholder-key"


# ---------------------------------------------------------------- what the code accepts


def parse_command(argv: list[str]) -> click.Context:
    """The innermost click context of an ``agentstream ...`` or ``torchrun ... -m agentstream ...`` line.

    Raises click's usage errors (an unknown option, a bad value, a missing required option) as
    running it would; nothing is invoked.
    """
    if argv[0] == "torchrun":
        argv = ["agentstream", *torchrun_arguments(argv[1:]).training_script_args]
    if argv[0] != "agentstream":
        raise ValueError(f"not an agentstream command line: {argv}")
    context = cli.make_context("agentstream", argv[1:])
    while isinstance(context.command, click.Group):
        # click 8.x keeps the subcommand's name apart from the rest; click 9 leaves all in args
        remaining = [*getattr(context, "_protected_args", ()), *context.args]
        name, command, rest = context.command.resolve_command(context, remaining)
        assert command is not None, f"no command in {argv}"
        context = command.make_context(name, rest, parent=context)
    return context


def torchrun_arguments(argv: list[str]) -> Any:
    """torchrun's own parse of its options; the script must be ``-m agentstream``."""
    from torch.distributed.run import parse_args

    arguments = parse_args(argv)
    if not (arguments.module and arguments.training_script == "agentstream"):
        raise ValueError(f"torchrun must start `-m agentstream`, got {argv}")
    return arguments


def in_checkout(path: str) -> Path:
    """The file of this checkout that a path in the image names."""
    assert path.startswith(IMAGE_SOURCE), f"{path} is not under {IMAGE_SOURCE}, where the image holds the code"
    return ROOT / path.removeprefix(IMAGE_SOURCE)


def unknown_settings(names: list[str]) -> list[str]:
    """The names in agentstream's namespaces that the config loader does not read."""
    return [name for name in names if name.startswith(SETTING_PREFIXES)
            and name not in ENVIRONMENT and name != CONFIG_FILE_VARIABLE]


def listening_ports(argv: list[str], config: Config) -> set[int]:
    """The TCP ports the process of ``argv`` listens on, by its options and then the configuration."""
    if argv[0] == "torchrun":
        arguments = torchrun_arguments(argv[1:])
        endpoint = arguments.rdzv_endpoint if arguments.rdzv_backend == "c10d" else ""
        return {int(endpoint.rpartition(":")[2])} if ":" in endpoint else set()
    context = parse_command(argv)
    path, options = context.command_path.split()[1:], context.params
    if path in (["proxy"], ["serve-model"], ["dashboard"]):
        return {options["port"]}
    if path == ["collector"]:
        grpc = config.otlp.grpc_port if options["grpc_port"] is None else options["grpc_port"]
        return {options["port"] or config.otlp.port} | ({grpc} if grpc else set())
    if path == ["schema-registry", "serve"]:
        return {options["port"] or config.schema_registry.port}
    return set()


def role_config(config_text: str, environment: Mapping[str, str], tmp_path: Path) -> Config:
    """The configuration a role loads from its agentstream.toml and environment (secrets stand in as placeholders)."""
    path = tmp_path / "agentstream.toml"
    path.write_text(config_text)
    return load_config(path, environ=dict(environment))


def urls_given(argv: list[str], config: Config) -> list[str]:
    """The URLs of other roles that a command line and its configuration give the process."""
    context = parse_command(argv)
    values = [value for name in ("upstreams", "server_urls", "server_url", "proxy_url")
              for value in _as_list(context.params.get(name))]
    if context.command.name in ("proxy", "deployments") and not context.params.get("upstreams") \
            and not context.params.get("server_urls"):
        values += config.proxy.upstreams
    return [value for value in values if value.startswith(("http://", "https://"))]


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [str(value)]


# ---------------------------------------------------------------- the manifests as roles


@dataclass(frozen=True)
class Role:
    """One container that runs agentstream's image, as a manifest or the compose file declares it."""

    where: str
    argv: list[str]
    environment: dict[str, str]
    config_text: str | None
    ports: set[int]
    pod_ports: frozenset[int] = frozenset()  # every container's of its pod: what 127.0.0.1 reaches

    def config(self, tmp_path: Path) -> Config:
        """What this role loads; a role without ``AGENTSTREAM_CONFIG`` would run on the defaults (the local stack)."""
        assert self.config_text is not None, f"{self.where}: no {CONFIG_FILE_VARIABLE}, so it would run on defaults"
        return role_config(self.config_text, self.environment, tmp_path)


def kubernetes_documents() -> list[dict[str, Any]]:
    return [document for path in sorted(KUBERNETES.glob("*.yaml")) if path.name != "kustomization.yaml"
            for document in yaml.safe_load_all(path.read_text()) if document]


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [document for document in kubernetes_documents() if document["kind"] == kind]


def _pod_templates() -> Iterator[tuple[str, dict[str, Any]]]:
    for document in kubernetes_documents():
        if document["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield f"{document['kind']}/{document['metadata']['name']}", document["spec"]["template"]


def _is_ours(image: str) -> bool:
    return image.rsplit("/", 1)[-1].split(":")[0] == IMAGE


def _secret_value(reference: Mapping[str, Any]) -> str:
    """A placeholder for a secretKeyRef, after checking that the Secret and its key exist."""
    name, key = reference["secretKeyRef"]["name"], reference["secretKeyRef"]["key"]
    secrets = {secret["metadata"]["name"]: secret for secret in _by_kind("Secret")}
    assert name in secrets, f"Secret {name} is not in manifests/kubernetes"
    assert key in secrets[name].get("stringData", {}) | secrets[name].get("data", {}), f"Secret {name} has no {key}"
    return PLACEHOLDER


def _mounted_config(path: str, container: Mapping[str, Any], pod: Mapping[str, Any]) -> str:
    """The text of the ConfigMap key mounted where ``path`` points in this container."""
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for mount in container.get("volumeMounts", ()):
        folder = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(folder) and "configMap" in volumes[mount["name"]]:
            name, key = volumes[mount["name"]]["configMap"]["name"], path[len(folder):]
            maps = {config_map["metadata"]["name"]: config_map for config_map in _by_kind("ConfigMap")}
            assert name in maps and key in maps[name]["data"], f"{path}: ConfigMap {name} has no key {key}"
            return str(maps[name]["data"][key])
    raise AssertionError(f"{path} is not in a mounted ConfigMap")


def kubernetes_roles() -> list[Role]:
    roles = []
    for workload, template in _pod_templates():
        pod = template["spec"]
        pod_ports = frozenset(port["containerPort"] for container in pod["containers"]
                              for port in container.get("ports", ()))
        for container in [*pod.get("initContainers", ()), *pod["containers"]]:
            if not _is_ours(container["image"]):
                continue
            environment = {entry["name"]: entry["value"] if "value" in entry else _secret_value(entry["valueFrom"])
                           for entry in container.get("env", ())}
            config_path = environment.get(CONFIG_FILE_VARIABLE)
            roles.append(Role(f"{workload}/{container['name']}", [*container["command"], *container.get("args", ())],
                              environment, _mounted_config(config_path, container, pod) if config_path else None,
                              {port["containerPort"] for port in container.get("ports", ())}, pod_ports))
    return roles


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _interpolated(value: Any) -> str:
    """A compose value with ``${NAME:?...}`` references replaced by a placeholder, as secrets are."""
    return re.sub(r"\$\{[^}]*\}", PLACEHOLDER, str(value))


def _container_port(mapping: Any) -> int:
    return int(str(mapping).rpartition(":")[2].split("/")[0])


def compose_roles() -> list[Role]:
    compose = _compose()
    roles = []
    for name, service in compose["services"].items():
        if not _is_ours(service.get("image", "")):
            continue
        environment = {key: _interpolated(value) for key, value in (service.get("environment") or {}).items()}
        config_text = None
        if CONFIG_FILE_VARIABLE in environment:
            targets = {config["target"]: config["source"] for config in service.get("configs", ())}
            source = targets.get(environment[CONFIG_FILE_VARIABLE])
            assert source, f"compose service {name}: no config is mounted at {environment[CONFIG_FILE_VARIABLE]}"
            config_text = (COMPOSE.parent / compose["configs"][source]["file"]).read_text()
        roles.append(Role(f"compose/{name}", [str(part) for part in service["command"]], environment, config_text,
                          {_container_port(port) for port in service.get("ports", ())}))
    return roles


def _roles_that_run_agentstream(roles: list[Role]) -> list[Role]:
    return [role for role in roles if role.argv[0] in ("agentstream", "torchrun")]


KUBERNETES_ROLES = kubernetes_roles()
COMPOSE_ROLES = compose_roles()


# ---------------------------------------------------------------- the checks


@pytest.mark.parametrize("role", _roles_that_run_agentstream(KUBERNETES_ROLES + COMPOSE_ROLES),
                         ids=lambda role: role.where)
def test_each_role_parses_reads_known_settings_and_declares_its_ports(role: Role, tmp_path: Path) -> None:
    parse_command(role.argv)
    assert not unknown_settings(list(role.environment)), f"{role.where}: unknown settings"
    config = role.config(tmp_path)
    listening = listening_ports(role.argv, config)
    if role.where.startswith("compose/"):
        assert role.ports <= listening, f"{role.where} publishes {role.ports}, listens on {listening}"
    else:
        assert role.ports == listening, f"{role.where} declares {role.ports}, listens on {listening}"
    assert config.kafka.external and config.clickhouse.external, f"{role.where} would look for the embedded stack"
    if config.deploy.gate:
        tasks = config.deploy.eval_tasks
        assert in_checkout(tasks).is_file(), f"{role.where}: the image has no {tasks}"


def test_every_agentstream_container_runs_a_role_or_a_one_off_download() -> None:
    for role in KUBERNETES_ROLES + COMPOSE_ROLES:
        assert role.argv[0] in ("agentstream", "torchrun") or "snapshot_download" in " ".join(role.argv), role.where


def test_each_service_port_is_one_a_selected_container_declares() -> None:
    templates = [template for _, template in _pod_templates()]
    for service in _by_kind("Service"):
        selector = service["spec"]["selector"]
        pods = [template for template in templates if selector.items() <= template["metadata"]["labels"].items()]
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        declared = {(port.get("name"), port["containerPort"]) for pod in pods
                    for container in pod["spec"]["containers"] for port in container.get("ports", ())}
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert any(target in pair for pair in declared), \
                f"Service {service['metadata']['name']}: port {target} is not a container's ({declared})"


def _service_ports() -> dict[str, set[int]]:
    return {service["metadata"]["name"]: {port["port"] for port in service["spec"]["ports"]}
            for service in _by_kind("Service")}


def _kubernetes_service(host: str, services: Mapping[str, set[int]]) -> str:
    """``proxy`` or ``model-server-0.model-server`` (a StatefulSet pod under its headless Service)."""
    labels = host.split(".")
    if labels[0] in services:
        return labels[0]
    assert len(labels) > 1 and labels[1] in services, f"{host} names no Service"
    return labels[1]


def test_each_url_given_to_a_kubernetes_role_names_a_service_port(tmp_path: Path) -> None:
    services = _service_ports()
    checked = 0
    for role in _roles_that_run_agentstream(KUBERNETES_ROLES):
        for url in urls_given(role.argv, role.config(tmp_path)):
            parts = urlsplit(url)
            if parts.hostname == "127.0.0.1":  # a container beside it in the pod (hot swap beside vLLM)
                assert parts.port in role.pod_ports, f"{role.where}: {url}, but its pod declares {role.pod_ports}"
                checked += 1
                continue
            name = _kubernetes_service(str(parts.hostname), services)
            assert parts.port in services[name], f"{role.where}: {url}, but Service {name} serves {services[name]}"
            checked += 1
    assert checked >= 4  # the proxy's upstreams, hot swap's server, the gate's server and proxy, the runners' proxy


def _compose_listening(tmp_path: Path) -> dict[str, set[int]]:
    """What each compose service listens on: agentstream roles by their command and config, others by --port."""
    ports: dict[str, set[int]] = {}
    by_name = {role.where.removeprefix("compose/"): role for role in _roles_that_run_agentstream(COMPOSE_ROLES)}
    for name, service in _compose()["services"].items():
        if name in by_name:
            ports[name] = listening_ports(by_name[name].argv, by_name[name].config(tmp_path))
        elif "--port" in (command := [str(part) for part in service.get("command") or ()]):
            ports[name] = {int(command[command.index("--port") + 1])}
    return ports


def test_each_url_given_to_a_compose_role_names_a_service_that_listens_there(tmp_path: Path) -> None:
    listening = _compose_listening(tmp_path)
    services = _compose()["services"]
    checked = 0
    for role in _roles_that_run_agentstream(COMPOSE_ROLES):
        for url in urls_given(role.argv, role.config(tmp_path)):
            parts = urlsplit(url)
            assert parts.hostname in services, f"{role.where}: {url} names no compose service"
            assert parts.port in listening.get(str(parts.hostname), set()), \
                f"{role.where}: {url}, but {parts.hostname} listens on {listening.get(str(parts.hostname))}"
            checked += 1
    assert checked >= 4
    for name, service in services.items():  # vLLM's exposed port is the one it serves on
        for port in service.get("expose", ()):
            assert int(port) in listening[name], f"compose/{name} exposes {port}, listens on {listening[name]}"


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"]
    manifests = [path.name for path in KUBERNETES.glob("*.yaml") if path.name != "kustomization.yaml"]
    assert sorted(listed) == sorted(manifests)


def test_the_dockerfile_sets_only_known_settings() -> None:
    names = [match.group(1) for match in re.finditer(r"\b([A-Z][A-Z0-9_]+)=", DOCKERFILE.read_text())]
    assert "AGENTSTREAM_HOME" in names
    assert not unknown_settings(names)


# ---------------------------------------------------------------- docs/deployment.md


def _code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DEPLOYMENT_DOC.read_text(), flags=re.S)


def doc_command_lines() -> list[list[str]]:
    """Every agentstream or torchrun command in the doc's bash blocks (after `kubectl exec ... --`, env settings
    or a .venv/bin/ path), as the shell would split it."""
    commands = []
    for block in _code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if "--" in words and words[0] in ("kubectl", "docker"):
                words = words[words.index("--") + 1:]
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                words = words[1:]
            if words and words[-1] == "&":
                words = words[:-1]
            if words and Path(words[0]).name in ("agentstream", "torchrun"):
                commands.append([Path(words[0]).name, *(str(in_checkout(word)) if word.startswith(IMAGE_SOURCE)
                                                        else word for word in words[1:])])
    return commands


def test_the_docs_command_lines_parse() -> None:
    commands = doc_command_lines()
    assert len(commands) >= 8, commands
    for argv in commands:
        parse_command(argv)


def test_the_docs_toml_loads(tmp_path: Path) -> None:
    blocks = _code_blocks("toml")
    assert blocks
    for block in blocks:
        role_config(block, {}, tmp_path)


def test_the_docs_name_only_known_settings() -> None:
    names = re.findall(r"\b((?:AGENTSTREAM|KAFKA|CLICKHOUSE|SCHEMA_REGISTRY)_[A-Z0-9_]*[A-Z0-9])\b",
                       DEPLOYMENT_DOC.read_text())
    assert names
    assert not unknown_settings(names)


# ---------------------------------------------------------------- the checks catch what they are for


def test_the_checks_refuse_planted_mistakes(tmp_path: Path) -> None:
    with pytest.raises(click.NoSuchOption):
        parse_command(["agentstream", "proxy", "--prot", "8080"])
    with pytest.raises(click.MissingParameter):
        parse_command(["torchrun", "--nproc-per-node", "2", "-m", "agentstream", "hotswap", "--model", "m"])
    with pytest.raises(SystemExit):  # argparse's refusal of an unknown torchrun option
        torchrun_arguments(["--nproc-per-nodes", "2", "-m", "agentstream", "train-worker"])
    assert unknown_settings(["AGENTSTREAM_PROXY_KEY", "KAFKA_BOOTSTRAP_SERVER", "AWS_REGION"]) == [
        "AGENTSTREAM_PROXY_KEY", "KAFKA_BOOTSTRAP_SERVER"]
    config = role_config("[otlp]\nport = 4320\n", {}, tmp_path)
    assert listening_ports(["agentstream", "collector"], config) == {4320, 4317}
    assert listening_ports(["agentstream", "schema-registry", "serve", "--port", "18081"], config) == {18081}
    from agentstream.infra.config import ConfigError

    with pytest.raises(ConfigError, match="unknown key"):
        role_config("[proxy]\nupstream = ['http://a:8000']\n", {}, tmp_path)
