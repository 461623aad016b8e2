"""The embedded ClickHouse over HTTP: migrations, clickhouse-connect, and the raw HTTP interface."""

from __future__ import annotations

import gzip
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import clickhouse_connect
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

from agentstream.infra.clickhouse import (
    PRODUCT_TABLES,
    PatientReads,
    connect,
    load_migrations,
    migrate,
)

pytestmark = pytest.mark.clickhouse_only  # no broker: the Apache Kafka pass leaves these out


def _http(url: str, query: str | None = None, body: bytes | None = None, method: str = "POST",
          headers: dict | None = None, **params) -> tuple[int, dict, bytes]:
    if query is not None:
        params["query"] = query
    full = url + "/?" + urllib.parse.urlencode(params)
    request = urllib.request.Request(full, data=body if method == "POST" else None, method=method,
                                     headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_migrations_applied_twice_are_harmless(clickhouse, stack_config):
    database = stack_config.clickhouse.database
    assert migrate(clickhouse, database) == [], "up already applied every migration"
    assert migrate(clickhouse, database) == []
    versions = clickhouse.query(f"SELECT version, count() FROM {database}.schema_migrations "
                                "GROUP BY version ORDER BY version").result_rows
    assert versions == [(m.version, 1) for m in load_migrations()]
    tables = {row[0] for row in clickhouse.query(
        "SELECT name FROM system.tables WHERE database = {db:String}", parameters={"db": database}).result_rows}
    assert set(PRODUCT_TABLES) <= tables


def test_migrate_into_a_fresh_database_creates_every_table(clickhouse):
    applied = migrate(clickhouse, "agentstream_fresh")
    assert [m.version for m in applied] == [m.version for m in load_migrations()]
    for table in PRODUCT_TABLES:
        assert clickhouse.query(f"SELECT count() FROM agentstream_fresh.{table}").result_rows == [(0,)]
    clickhouse.command("DROP DATABASE agentstream_fresh")


def test_processes_migrating_one_fresh_database_at_once_all_succeed_into_one_schema(stack, stack_config):
    """The stream worker and the trainer migrate at start: on a fresh database their migrations interleave (one
    drops in 0005 a table the other's 0002 is still creating views on) and each must still finish."""
    def tables(client, database: str) -> list[tuple]:
        return client.query("SELECT name, engine FROM system.tables WHERE database = {db:String} ORDER BY name",
                            parameters={"db": database}).result_rows

    clients = [connect(stack_config.clickhouse, stack.clickhouse_url) for _ in range(4)]
    try:
        migrate(clients[0], "agentstream_alone")
        expected = tables(clients[0], "agentstream_alone")
        for round_ in range(6):
            database = f"agentstream_race{round_}"
            with ThreadPoolExecutor(len(clients)) as pool:  # an error in any of them is raised here
                list(pool.map(lambda client, db=database: migrate(client, db), clients))
            recorded = clients[0].query(f"SELECT DISTINCT version FROM {database}.schema_migrations ORDER BY version")
            assert [row[0] for row in recorded.result_rows] == [m.version for m in load_migrations()]
            assert tables(clients[0], database) == expected
            clients[0].command(f"DROP DATABASE {database}")
        clients[0].command("DROP DATABASE agentstream_alone")
    finally:
        for client in clients:
            client.close()


def test_replayed_insert_does_not_double_count(clickhouse, stack_config):
    database = stack_config.clickhouse.database
    columns = ["transition_id", "rollout_id", "span_id", "agent_name", "model", "policy_version", "step_index",
               "group_id", "prompt_token_ids", "response_token_ids", "behaviour_logprobs", "reward",
               "return_value", "advantage", "created_at"]
    import datetime

    now = datetime.datetime.now(datetime.UTC)
    rows = [[f"replay-{i}", "r1", f"s{i}", "agent", "m-replay", 3, i, "", [1, 2], [3], [-0.5], 1.0, 1.0, 0.2, now]
            for i in range(10)]
    clickhouse.insert(f"{database}.transitions", rows, column_names=columns)
    clickhouse.insert(f"{database}.transitions", rows, column_names=columns)  # a replay after a crash
    total = clickhouse.query(f"SELECT count() FROM {database}.transitions FINAL WHERE model = 'm-replay'").result_rows
    assert total == [(10,)]
    raw = clickhouse.query(f"SELECT count() FROM {database}.transitions WHERE model = 'm-replay'").result_rows
    assert raw[0][0] in (10, 20)  # before a merge the physical rows may still be doubled


def test_read_only_client_refuses_writes(stack_config, stack):
    reader = connect(stack_config.clickhouse, stack.clickhouse_url, readonly=True)
    assert reader.query("SELECT 1 + 1").result_rows == [(2,)]
    with pytest.raises(Exception, match="readonly"):
        reader.command("CREATE TABLE default.should_not_exist (a UInt8) ENGINE = Memory")
    reader.close()


def test_http_interface_speaks_clickhouse(stack):
    url = stack.clickhouse_url
    status, _, body = _http(url, method="GET", query="SELECT 1 + {n:UInt8}", param_n="41")
    assert (status, body) == (200, b"42\n")

    status, headers, body = _http(url, query="SELEC 1")
    assert status == 400 and headers["X-ClickHouse-Exception-Code"] == "62"
    assert body.startswith(b"Code: 62. DB::Exception: Syntax error")

    status, _, _ = _http(url, body=b"CREATE TABLE IF NOT EXISTS default.http_t (a UInt32, s String) "
                                   b"ENGINE = MergeTree ORDER BY a")
    assert status == 200
    rows = b"".join(json.dumps({"a": i, "s": f"row{i}"}).encode() + b"\n" for i in range(1000))
    status, headers, _ = _http(url, query="INSERT INTO default.http_t FORMAT JSONEachRow", body=gzip.compress(rows),
                               headers={"Content-Encoding": "gzip"})
    assert status == 200 and json.loads(headers["X-ClickHouse-Summary"])["written_rows"] == "1000"
    status, _, _ = _http(url, body=b"INSERT INTO default.http_t FORMAT CSV\n5000,inline\n5001,inline\n")
    assert status == 200

    status, headers, body = _http(url, query="SELECT toUInt32(count()), max(a) FROM default.http_t",
                                  default_format="JSONCompact")
    assert status == 200 and headers["X-ClickHouse-Format"] == "JSONCompact"
    assert json.loads(body)["data"] == [[1002, 5001]]

    status, headers, _ = _http(url, method="GET", query="DROP TABLE default.http_t")
    assert status == 403 and headers["X-ClickHouse-Exception-Code"] == "164"
    status, _, _ = _http(url, query="INSERT INTO default.http_t FORMAT CSV", body=b"1,x\n", readonly="1")
    assert status == 403

    status, _, body = _http(url, query="SELECT value FROM system.settings WHERE name = 'max_threads'",
                            max_threads="1")
    assert body.strip() in (b"1", b"'1'")
    status, _, body = _http(url, query="SELECT value = '1' FROM system.settings WHERE name = 'max_threads'")
    assert body == b"0\n", "a request's settings must not leak into the next request"
    _http(url, body=b"DROP TABLE default.http_t")


def test_ping(stack):
    with urllib.request.urlopen(stack.clickhouse_url + "/ping", timeout=10) as response:
        assert (response.status, response.read()) == (200, b"Ok.\n")


def test_long_bind_parameters_arrive_as_a_multipart_form(clickhouse):
    ids = [f"rollout-{i:032d}" for i in range(5000)]  # too long for a URL: clickhouse-connect posts a form
    assert clickhouse.query("SELECT length({ids:Array(String)}), {ids:Array(String)}[5000]",
                            parameters={"ids": ids}).result_rows == [(5000, ids[-1])]


def test_patient_reads_ask_again_while_the_server_is_too_busy_and_give_up_when_their_patience_is_spent(stack):
    impatient = clickhouse_connect.get_client(host="127.0.0.1", port=urllib.parse.urlsplit(stack.clickhouse_url).port,
                                              send_receive_timeout=1)
    said: list[str] = []
    patient = PatientReads(impatient, said.append, patience_s=4.0, pause_s=0.5)
    assert patient.query("SELECT 41 + 1").result_rows == [(42,)] and said == []
    started = time.monotonic()
    with pytest.raises(OperationalError):  # every answer takes 2 s, each ask waits 1 s
        patient.query("SELECT sleep(2)")
    assert 3.0 <= time.monotonic() - started < 10  # asked again after the first timeout, until the patience ran out
    assert len(said) >= 2 and all("timed out" in line and "asking again" in line for line in said)
    said.clear()
    with pytest.raises(DatabaseError, match="UNKNOWN_TABLE"):  # refused: asking again would not help
        patient.query("SELECT count() FROM no_such_table")
    assert said == [] and patient.server_version == impatient.server_version  # the rest is the client's


def test_the_demos_reward_per_version_counts_only_rollouts_that_got_a_reward(clickhouse):
    """At the demo's end its runners stop mid-rollout: a version may hold only rollouts without a reward (seen: the
    report's average was None and the demo died before writing its report)."""
    from rich.console import Console

    from agentstream.demo.agents import AGENTS
    from agentstream.demo.training import Dashboard

    agent = f"reward-per-version-{uuid.uuid4().hex[:6]}"
    rows = [(f"{agent}-{i}", agent, reward, [version]) for i, (reward, version) in
            enumerate([(1.0, 7), (0.0, 7), (None, 7), (None, 8)])]
    clickhouse.insert("rollouts", rows, column_names=["rollout_id", "agent_name", "final_reward", "policy_versions"])
    dashboard = Dashboard(clickhouse, Console(), "10 s", replace(AGENTS["word-problems"], name=agent))
    assert [(row["policy_version"], row["rollouts"], row["reward_mean"]) for row in dashboard.reward_per_version()
            ] == [(7, 2, 0.5)]


def test_the_demos_heldout_calls_wait_for_the_evaluations_rollouts_and_count_only_that_version(stack_config, stack,
                                                                                               clickhouse):
    """The final evaluation's rollouts reach ClickHouse through the stream processors after it returns: the report
    waits for all of them as long as more keep coming, and reads neither train rollouts nor another version's."""
    from rich.console import Console

    from agentstream.demo.agents import AGENTS
    from agentstream.demo.results import Evaluation
    from agentstream.demo.training import Dashboard

    agent = replace(AGENTS["word-problems"], name=f"heldout-calls-{uuid.uuid4().hex[:6]}")
    dashboard = Dashboard(clickhouse, Console(), "10 s", agent)
    columns = ["rollout_id", "agent_name", "final_reward", "policy_versions", "llm_calls"]
    clickhouse.insert("rollouts", [(f"{agent.name}-train", agent.name, 1.0, [9], 1),
                                   (f"{agent.name}-old", agent.eval_name, 0.0, [8], 1),
                                   (f"{agent.name}-1", agent.eval_name, 1.0, [9], 2)], column_names=columns)
    final = Evaluation(600.0, 9, 0.5, 1, 2)
    assert dashboard.heldout_calls(final, stalled_s=1.5) is None  # one of its two rollouts never came

    writer = connect(stack_config.clickhouse, stack.clickhouse_url, database=stack_config.clickhouse.database)

    def arrives(after_s: float, rollout_id: str, reward: float, calls: int) -> threading.Timer:
        """The stream processors writing a rollout while the report waits (their own connection, as they have)."""
        row = [(f"{agent.name}-{rollout_id}", agent.eval_name, reward, [9], calls)]
        timer = threading.Timer(after_s, lambda: writer.insert("rollouts", row, column_names=columns))
        timer.start()
        return timer

    # the last comes later than stalled_s after the call: it is waited for because another came meanwhile
    arrivals = [arrives(1.0, "2", 1.0, 2), arrives(2.5, "3", 0.0, 3)]
    assert dashboard.heldout_calls(Evaluation(600.0, 9, 0.5, 2, 3), stalled_s=1.8) == round(7 / 3, 3)
    for timer in arrivals:
        timer.join()
    writer.close()


def test_a_demos_fresh_database_is_the_one_its_config_names_and_starts_empty(stack_config, stack, clickhouse):
    """The online demo once migrated the training demo's database and then read its own, which did not exist."""
    from rich.console import Console

    from agentstream.demo.training import fresh_database

    database = f"agentstream_fresh_{uuid.uuid4().hex[:6]}"
    config = replace(stack_config, clickhouse=replace(stack_config.clickhouse, database=database))
    first = fresh_database(config, stack.clickhouse_url, Console())
    first.command("INSERT INTO rollouts (rollout_id, agent_name) VALUES ('left-over', 'a')")
    again = fresh_database(config, stack.clickhouse_url, Console())
    assert again.query("SELECT count() FROM rollouts").result_rows == [(0,)]  # dropped and migrated afresh
    assert clickhouse.query(f"SELECT count() FROM system.tables WHERE database = '{database}' AND name = 'rollouts'"
                            ).result_rows == [(1,)]
    clickhouse.command(f"DROP DATABASE {database}")
