"""Configuration: defaults, TOML file, environment precedence, validation and secret masking."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from agentstream.infra.config import ConfigError, CreditRule, Secret, describe, dump_toml, load_config


def test_defaults_are_the_embedded_loopback_stack():
    config = load_config(environ={})
    assert config.kafka.bootstrap_servers is None and not config.kafka.external
    assert config.clickhouse.url is None and config.clickhouse.database == "agentstream"
    assert (config.stack.host, config.stack.broker_port, config.stack.clickhouse_port) == ("127.0.0.1", 9092, 8123)
    assert config.topics.prefix == "agentstream."


def test_environment_overrides_the_file(tmp_path: Path):
    path = tmp_path / "agentstream.toml"
    path.write_text('[topics]\nprefix = "file."\npartitions = 8\n[stack]\nbroker_port = 19000\n')
    config = load_config(path, environ={"AGENTSTREAM_TOPIC_PREFIX": "env.", "AGENTSTREAM_HOME": "/tmp/h"})
    assert config.topics.prefix == "env."
    assert config.topics.partitions == 8
    assert config.stack.broker_port == 19000
    assert config.stack.home == Path("/tmp/h")


def test_clickhouse_url_credentials_move_into_secret_fields():
    config = load_config(environ={"CLICKHOUSE_URL": "https://alice:p%40ss@ch.example:8443/"})
    assert config.clickhouse.url == "https://ch.example:8443/"
    assert config.clickhouse.username == "alice"
    assert config.clickhouse.password == Secret("p@ss")
    assert "p@ss" not in repr(config) and "p@ss" not in str(describe(config))


def test_kafka_sasl_and_tls_from_environment():
    config = load_config(environ={"KAFKA_BOOTSTRAP_SERVERS": "k1:9093,k2:9093", "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                                  "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "KAFKA_SASL_USERNAME": "svc",
                                  "KAFKA_SASL_PASSWORD": "s3cret"})
    assert config.kafka.external
    assert config.kafka.sasl_password.reveal() == "s3cret"
    assert describe(config)["kafka"]["sasl_password"] == "***"
    from agentstream.infra.kafka import client_options

    options = client_options(config.kafka, config.kafka.bootstrap_servers)
    assert options["sasl_mechanism"] == "SCRAM-SHA-512" and options["sasl_plain_password"] == "s3cret"
    assert "ssl_context" in options


@pytest.mark.parametrize("content, message", [
    ("[nope]\na = 1\n", "unknown section"),
    ("[stack]\nbrokr_port = 1\n", "unknown key"),
    ("[stack]\nbroker_port = 'abc'\n", "cannot use 'abc'"),
    ("[stack]\nbroker_port = 70000\n", "must be a TCP port"),
    ("[stack]\nbroker_storage = 'disk'\n", "broker_storage must be durable or memory, got 'disk'"),
    ("[stack]\nobjectstore_port = 70000\n", "objectstore_port must be a TCP port"),
    ("[topics\n", "not valid TOML"),
])
def test_bad_config_files_are_clear_errors(tmp_path: Path, content: str, message: str):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_config(path, environ={})


def test_missing_config_file_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(environ={"AGENTSTREAM_CONFIG": str(tmp_path / "missing.toml")})


def test_non_http_clickhouse_url_is_refused():
    with pytest.raises(ConfigError, match="http:// or https://"):
        load_config(environ={"CLICKHOUSE_URL": "tcp://ch:9000"})


def test_dump_toml_reads_back_to_the_same_configuration(tmp_path):
    from agentstream.infra.config import CreditRule, dump_toml

    config = load_config(environ={"CLICKHOUSE_PASSWORD": 'p"w\\x', "DEMO_QUICK": "1", "KAFKA_BOOTSTRAP_SERVERS": "h:1"})
    config = dataclasses.replace(config, credit=(CreditRule(agent="a*", strategy="grpo", group_size=4),
                                                 CreditRule(train=False)))
    path = tmp_path / "dumped.toml"
    path.write_text(dump_toml(config))
    assert load_config(path, environ={}) == config


def test_trainer_config_section_is_typed_and_validated(tmp_path):
    path = tmp_path / "agentstream.toml"
    path.write_text('[trainer]\nmodel = "tiny"\nlr = 0.002\nlora = true\nbatch_transitions = 32\n')
    config = load_config(path, environ={})
    assert (config.trainer.model, config.trainer.lr, config.trainer.lora, config.trainer.batch_transitions) == \
        ("tiny", 0.002, True, 32)
    path.write_text('[trainer]\nclip_eps = 1.5\n')
    with pytest.raises(ConfigError, match="clip_eps"):
        load_config(path, environ={})


def _config_with(tmp_path, rule: str):
    path = tmp_path / "agentstream.toml"
    path.write_text(f"[[credit]]\nagent = \"*\"\n{rule}\n")
    return load_config(environ={"AGENTSTREAM_CONFIG": str(path), "AGENTSTREAM_HOME": str(tmp_path)})


def test_sample_rate_defaults_to_one_and_is_validated(tmp_path):
    assert CreditRule().sample_rate == 1.0
    assert _config_with(tmp_path, "sample_rate = 0.25").credit[0].sample_rate == 0.25
    assert _config_with(tmp_path, "sample_rate = 0").credit[0].sample_rate == 0.0
    for bad in ("1.5", "-0.1", "nan"):
        with pytest.raises(ConfigError, match=r"credit\[0\].sample_rate must be within \[0, 1\]"):
            _config_with(tmp_path, f"sample_rate = {bad}")


def test_deploy_reconcile_s_is_validated(tmp_path):
    path = tmp_path / "agentstream.toml"
    path.write_text("[deploy]\nreconcile_s = -1\n")
    with pytest.raises(ConfigError, match=r"deploy\.reconcile_s must be >= 0"):
        load_config(path, environ={})
    path.write_text("[deploy]\nreconcile_s = 0\n")
    assert load_config(path, environ={}).deploy.reconcile_s == 0
    assert load_config(environ={}).deploy.reconcile_s == 10.0


def test_proxy_upstreams_from_the_file_and_the_environment(tmp_path):
    path = tmp_path / "agentstream.toml"
    path.write_text('[proxy]\nupstreams = ["http://a:8000", "http://b:8000"]\neject_after = 5\n')
    config = load_config(path, environ={})
    assert config.proxy.upstreams == ("http://a:8000", "http://b:8000") and config.proxy.eject_after == 5
    assert config.proxy.health_interval_s == 2.0 and config.proxy.health_timeout_s == 2.0
    env = load_config(path, environ={"AGENTSTREAM_PROXY_UPSTREAMS": "http://c:8000, http://d:8000"})
    assert env.proxy.upstreams == ("http://c:8000", "http://d:8000")
    again = tmp_path / "again.toml"
    again.write_text(dump_toml(config))
    assert load_config(again, environ={}).proxy == config.proxy
    path.write_text('[proxy]\nupstreams = ["a:8000"]\n')
    with pytest.raises(ConfigError, match="upstreams"):
        load_config(path, environ={})
    path.write_text('[proxy]\nupstreams = ["http://a:8000", "http://a:8000/v1"]\n')
    with pytest.raises(ConfigError, match="a model server named twice: http://a:8000"):
        load_config(path, environ={})



def test_tracking_is_off_unless_configured_and_reaches_child_processes(tmp_path):
    assert not load_config(environ={}).tracking.enabled
    their_own = {"MLFLOW_TRACKING_URI": "http://mlflow:5000", "WANDB_MODE": "offline"}  # the trackers' variables
    assert not load_config(environ=their_own).tracking.enabled
    config = load_config(environ={"AGENTSTREAM_MLFLOW_URI": "file:./mlruns", "AGENTSTREAM_WANDB_MODE": "offline",
                                  "AGENTSTREAM_WANDB_DIR": "runs"})
    assert (config.tracking.mlflow_uri, config.tracking.wandb_mode, config.tracking.wandb_dir) == (
        "file:./mlruns", "offline", "runs")
    path = tmp_path / "child.toml"
    path.write_text(dump_toml(config))  # what a session hands its trainer
    assert load_config(path, environ={}).tracking == config.tracking


@pytest.mark.parametrize(("key", "value", "message"), [
    ("wandb_mode", "disabled", "wandb_mode must be offline, online or empty"),
    ("mlflow_uri", "s3://bucket/runs", "MLflow cannot take the scheme 's3'"),
    ("mlflow_uri", "ftp://host/x", "MLflow cannot take the scheme 'ftp'"),
    ("mlflow_uri", "http//mlflow:5000", "lacks the colon of http://"),  # else a folder ./http/mlflow:5000
    ("mlflow_uri", "HTTPS//mlflow", "lacks the colon of https://"),
    ("mlflow_uri", " ", "spaces around it"),  # else tracking on, into a folder named ' '
    ("mlflow_uri", "file:./mlruns\n", "spaces around it"),
    ("queue_size", 0, "queue_size must be >= 1"),
    ("timeout_s", 0, "timeout_s must be > 0"),
])
def test_tracking_settings_are_validated(tmp_path, key, value, message):
    path = tmp_path / "agentstream.toml"
    path.write_text(f"[tracking]\n{key} = {value!r}\n".replace("'", '"'))
    with pytest.raises(ConfigError, match=message):
        load_config(path, environ={})


@pytest.mark.parametrize("uri", ["file:./mlruns", "./mlruns", "/srv/mlruns", "file:///srv/mlruns", "http://h:5000",
                                 "https://h", "databricks", "sqlite:///mlflow.db", "postgresql+psycopg2://u@h/db"])
def test_tracking_takes_what_mlflow_takes(uri):
    assert load_config(environ={"AGENTSTREAM_MLFLOW_URI": uri}).tracking.mlflow_uri == uri


def test_kafka_idempotence_is_one_of_auto_on_off():
    assert load_config(environ={}).kafka.idempotence == "auto"
    assert load_config(environ={"KAFKA_IDEMPOTENCE": "off"}).kafka.idempotence == "off"
    with pytest.raises(ConfigError, match=r"kafka\.idempotence must be auto, on or off, got 'yes'"):
        load_config(environ={"KAFKA_IDEMPOTENCE": "yes"})


def test_stack_broker_is_tansu_or_kafka():
    assert load_config(environ={}).stack.broker == "tansu"
    assert load_config(environ={"AGENTSTREAM_BROKER": "kafka"}).stack.broker == "kafka"
    with pytest.raises(ConfigError, match=r"stack\.broker must be tansu or kafka, got 'redpanda'"):
        load_config(environ={"AGENTSTREAM_BROKER": "redpanda"})
