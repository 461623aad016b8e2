"""`agentstream up | status | down` run as a user runs them: separate processes, their own stack home."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import clickhouse_connect
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError
from confluent_kafka.admin import AdminClient

from tests.conftest import stack_environment

CLI = [sys.executable, "-m", "agentstream"]
ROLES = ("tasks", "spans", "transitions", "checkpoints", "dlq")


def agentstream(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _pids(home: Path) -> list[int]:
    import json

    return [json.loads(p.read_text())["pid"] for p in (home / "run").glob("*.json")]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.fixture
def user_env(tmp_path):
    home = tmp_path / "home"
    env = stack_environment(home)
    yield env, home
    agentstream(env, "down")


def test_up_status_down_as_a_user(user_env):
    env, home = user_env
    started = agentstream(env, "up")
    assert started.returncode == 0, started.stderr
    broker = f"127.0.0.1:{env['AGENTSTREAM_BROKER_PORT']}"
    assert f"ready: KAFKA_BOOTSTRAP_SERVERS={broker}" in started.stdout
    pids = _pids(home)
    assert len(pids) == 4 and all(_alive(pid) for pid in pids), "broker, its object store, ClickHouse, schema registry"

    topics = AdminClient({"bootstrap.servers": broker}).list_topics(timeout=10).topics
    assert {f"agentstream.{role}" for role in ROLES} <= set(topics)
    client = clickhouse_connect.get_client(host="127.0.0.1", port=int(env["AGENTSTREAM_CLICKHOUSE_PORT"]))
    assert client.query("SELECT count() FROM agentstream.spans").result_rows == [(0,)]
    client.command("CREATE TABLE default.survives (a UInt8) ENGINE = MergeTree ORDER BY a")
    client.command("INSERT INTO default.survives VALUES (7)")
    client.close()

    again = agentstream(env, "up")
    assert again.returncode == 0 and _pids(home) == pids, "a second `up` reuses the running services"

    status = agentstream(env, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    for role in ROLES:
        assert f"agentstream.{role}" in status.stdout
    assert "reachable" in status.stdout and "version 26." in status.stdout
    assert "agentstream.train_steps" in status.stdout
    assert f"storage: durable, {home.resolve() / 'broker-data'}" in status.stdout

    stopped = agentstream(env, "down")
    assert stopped.returncode == 0
    assert not any(_alive(pid) for pid in pids), "down must leave no process of the stack"
    after = agentstream(env, "status")
    assert after.returncode == 1
    assert "the stack is down" in after.stdout and "agentstream up" in after.stdout
    assert "Retrying" not in after.stdout + after.stderr, "no urllib3 retry noise before the plain answer"

    assert agentstream(env, "up").returncode == 0
    client = clickhouse_connect.get_client(host="127.0.0.1", port=int(env["AGENTSTREAM_CLICKHOUSE_PORT"]))
    assert client.query("SELECT a FROM default.survives").result_rows == [(7,)], "ClickHouse data survives down/up"
    client.close()


def test_a_stack_with_keys_as_a_user(user_env):
    """The writer's password, a reader and registry keys: `up` migrates with them, status and the CLI use them."""
    env, home = user_env
    env.update({"CLICKHOUSE_USER": "writer", "CLICKHOUSE_PASSWORD": "w-secret",
                "AGENTSTREAM_CLICKHOUSE_READERS": "analyst:r-secret", "AGENTSTREAM_REGISTRY_KEYS": "reg-key",
                "AGENTSTREAM_BROKER_STORAGE": "memory"})
    started = agentstream(env, "up")
    assert started.returncode == 0, started.stdout + started.stderr
    port = int(env["AGENTSTREAM_CLICKHOUSE_PORT"])
    with pytest.raises(DatabaseError, match="AUTHENTICATION_FAILED"):
        clickhouse_connect.get_client(host="127.0.0.1", port=port)
    reader = clickhouse_connect.get_client(host="127.0.0.1", port=port, username="analyst", password="r-secret")
    assert reader.query("SELECT count() FROM agentstream.spans").result_rows == [(0,)]
    with pytest.raises(DatabaseError, match="READONLY"):
        reader.command("DROP TABLE agentstream.spans")
    reader.close()
    assert "w-secret" not in (home / "logs" / "clickhouse.log").read_text()
    settings = home / "run" / "clickhouse.toml"
    assert settings.stat().st_mode & 0o077 == 0, "the file that hands the server its passwords is private"

    status = agentstream(env, "status")
    assert status.returncode == 0 and "agentstream.train_steps" in status.stdout, status.stdout + status.stderr
    registered = agentstream(env, "schema-registry", "register")
    assert registered.returncode == 0, registered.stdout + registered.stderr
    without_key = agentstream({**env, "AGENTSTREAM_REGISTRY_KEYS": ""}, "schema-registry", "register")
    lines = without_key.stderr.strip().splitlines()
    assert without_key.returncode == 1 and len(lines) == 1 and "registry_keys" in lines[0], without_key.stderr


def test_taken_port_is_a_one_line_error(user_env):
    env, _ = user_env
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", int(env["AGENTSTREAM_BROKER_PORT"])))
        blocker.listen()
        result = agentstream(env, "up")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "port" in lines[0] and "already in use" in lines[0], result.stderr


def test_missing_broker_binary_is_a_one_line_error(user_env, tmp_path):
    env, _ = user_env
    result = agentstream({**env, "TANSU_BIN": str(tmp_path / "no-such-tansu")}, "up")
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: TANSU_BIN={tmp_path / 'no-such-tansu'} is not an executable file"


def test_down_never_signals_a_process_it_did_not_start(user_env):
    env, home = user_env
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        (home / "run").mkdir(parents=True)
        # A pidfile whose PID now belongs to another process (PID reuse): the start time differs.
        (home / "run" / "broker.json").write_text(
            f'{{"name": "broker", "pid": {bystander.pid}, "start_ticks": 1, "address": "127.0.0.1:1", '
            f'"command": ["tansu"], "log_path": "x"}}'
        )
        result = agentstream(env, "down")
        assert result.returncode == 0 and "stale pidfile" in result.stdout
        time.sleep(0.2)
        assert bystander.poll() is None, "the bystander must still be running"
    finally:
        bystander.kill()
        bystander.wait()


def test_external_services_start_nothing(stack, stack_config, tmp_path):
    env = stack_environment(tmp_path / "ext")
    env.update({"KAFKA_BOOTSTRAP_SERVERS": stack.bootstrap_servers, "CLICKHOUSE_URL": stack.clickhouse_url,
                "SCHEMA_REGISTRY_URL": f"http://127.0.0.1:{stack_config.schema_registry.port}"})
    result = agentstream(env, "up")
    assert result.returncode == 0, result.stderr
    assert "tansu pid" not in result.stdout and "chdb pid" not in result.stdout
    assert not (tmp_path / "ext" / "run").exists() or _pids(tmp_path / "ext") == []
    status = agentstream(env, "status")
    assert status.returncode == 0 and status.stdout.count("[external]") == 2


def test_secrets_never_printed(stack, tmp_path):
    env = stack_environment(tmp_path / "sec")
    env.update({"KAFKA_SASL_PASSWORD": "hunter2-kafka", "CLICKHOUSE_URL": "http://bob:hunter2-ch@127.0.0.1:1"})
    for args in (["config"], ["status"]):
        result = agentstream(env, *args, timeout=60)
        assert "hunter2" not in result.stdout + result.stderr
    shown = agentstream(env, "config").stdout
    assert '"sasl_password": "***"' in shown and '"username": "bob"' in shown
