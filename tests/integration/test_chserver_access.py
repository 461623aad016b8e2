"""Who reaches the embedded ClickHouse front, with the official client and raw HTTP: the writer's password, read-only
readers whatever they ask, no web page from another site, and inserts that never queue behind a long read."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import clickhouse_connect
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from agentstream.infra.clickhouse import ClickHouseError, connect
from agentstream.infra.config import ClickHouseConfig, ConfigError, Secret, load_config
from agentstream.infra.processes import free_port, wait_for_port
from agentstream.infra.security import OpenBindRefused
from agentstream.stack.control import OBJECTSTORE, Stack

pytestmark = pytest.mark.clickhouse_only  # no broker: the Apache Kafka pass leaves these out

WRITER, WRITER_PASSWORD = "writer", "w-secret"
READER, READER_PASSWORD = "analyst", "r-secret"
CONFIG = f"""
[clickhouse]
username = "{WRITER}"
password = "{WRITER_PASSWORD}"

[security]
clickhouse_readers = "{READER}:{READER_PASSWORD}, bi:another"
"""
WRITES = [
    "DROP TABLE default.facts",
    "INSERT INTO default.facts VALUES (99, 'reader')",
    "ALTER TABLE default.facts DELETE WHERE 1",
    "CREATE TABLE default.reader_made (a UInt8) ENGINE = Memory",
    "SYSTEM DROP MARK CACHE",
    "INSERT INTO FUNCTION file('reader.csv', 'CSV', 'a UInt8') VALUES (1)",
    "SELECT * FROM file('/etc/hostname', 'LineAsString')",
    "DROP DATABASE default",
]


def clean_environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items()
            if not key.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_", "SCHEMA_REGISTRY_"))}


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    """A ClickHouse front with a writer password and two readers, on its own data, as `up` starts it."""
    folder = tmp_path_factory.mktemp("chserver")
    (folder / "config.toml").write_text(CONFIG)
    port = free_port()
    command = [sys.executable, "-m", "agentstream.stack.chserver", "--port", str(port),
               "--data-dir", str(folder / "data"),
               "--config", str(folder / "config.toml")]
    with (folder / "chserver.log").open("ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=clean_environment())
    wait_for_port("127.0.0.1", port, 60, process, folder / "chserver.log")
    url = f"http://127.0.0.1:{port}"
    writer = connect(ClickHouseConfig(username=WRITER, password=Secret(WRITER_PASSWORD)), url)
    writer.command("CREATE TABLE default.facts (a UInt32, s String) ENGINE = MergeTree ORDER BY a")
    writer.insert("default.facts", [[1, "one"], [2, "two"]], column_names=["a", "s"])
    writer.close()
    yield url
    process.terminate()
    process.wait(timeout=30)


def http(url: str, sql: str = "SELECT 1", *, method: str = "POST", headers: dict | None = None, body: bytes = b"",
         **params: str) -> tuple[int, dict, bytes]:
    full = url + "/?" + urllib.parse.urlencode({"query": sql, **params})
    request = urllib.request.Request(full, data=body if method == "POST" else None, method=method,
                                     headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def facts(url: str) -> list[tuple]:
    writer = connect(ClickHouseConfig(username=WRITER, password=Secret(WRITER_PASSWORD)), url)
    try:
        return writer.query("SELECT a, s FROM default.facts ORDER BY a").result_rows
    finally:
        writer.close()


def test_the_writer_gets_in_with_its_password_and_nobody_else(front):
    writer = connect(ClickHouseConfig(username=WRITER, password=Secret(WRITER_PASSWORD)), front)
    assert writer.query("SELECT count() FROM default.facts").result_rows == [(2,)]
    writer.close()
    for config in (ClickHouseConfig(username=WRITER), ClickHouseConfig(username=WRITER, password=Secret("guess")),
                   ClickHouseConfig(), ClickHouseConfig(username=READER, password=Secret("guess"))):
        with pytest.raises(ClickHouseError, match="Authentication failed"):
            connect(config, front)


def test_credentials_arrive_every_way_clickhouse_http_takes_them(front):
    for user, password in ((WRITER, WRITER_PASSWORD), (READER, READER_PASSWORD)):
        ways = [dict(headers=basic(user, password)),
                dict(headers={"X-ClickHouse-User": user, "X-ClickHouse-Key": password}),
                dict(user=user, password=password)]
        for way in ways:
            status, _, body = http(front, "SELECT currentDatabase()", **way)  # type: ignore[arg-type]
            assert (status, body) == (200, b"default\n"), (user, way)
    for way in [dict(), dict(headers=basic(WRITER, "wrong")), dict(headers={"X-ClickHouse-User": WRITER}),
                dict(user=READER, password=WRITER_PASSWORD), dict(headers={"Authorization": "Basic !!!"})]:
        status, headers, body = http(front, **way)  # type: ignore[arg-type]
        assert status == 401 and headers["X-ClickHouse-Exception-Code"] == "516", (way, body)
        assert b"AUTHENTICATION_FAILED" in body


def test_a_reader_reads_and_cannot_write_whatever_it_asks(front):
    reader = clickhouse_connect.get_client(host="127.0.0.1", port=urllib.parse.urlsplit(front).port,
                                           username=READER, password=READER_PASSWORD)
    assert reader.query("SELECT a, s FROM default.facts ORDER BY a").result_rows == [(1, "one"), (2, "two")]
    assert reader.query("SELECT {n:UInt8} + 1", parameters={"n": 41}).result_rows == [(42,)]
    for statement in WRITES:  # the two through file() are refused before they run, as a reader's file() is
        with pytest.raises(DatabaseError, match=r"(?i)readonly|ACCESS_DENIED"):
            reader.command(statement)
    with pytest.raises(DatabaseError, match=r"(?i)readonly"):
        reader.insert("default.facts", [[3, "three"]], column_names=["a", "s"])
    reader.close()

    credentials = basic(READER, READER_PASSWORD)
    for statement in WRITES:  # asking for a writable session changes nothing
        status, headers, body = http(front, statement, headers=credentials, readonly="0")
        assert status == 403 and headers["X-ClickHouse-Exception-Code"] in ("164", "497"), (statement, body)
    for statement in ("SET readonly = 0", "SELECT 1 SETTINGS readonly = 0", "SET readonly = 2"):
        status, _, body = http(front, statement, headers=credentials)
        assert status == 403 and b"Cannot modify 'readonly'" in body, (statement, body)
    status, _, _ = http(front, "INSERT INTO default.facts FORMAT CSV", headers=credentials, body=b"4,four\n",
                        readonly="0")
    assert status == 403
    status, _, body = http(front, "SELECT getSetting('readonly')", headers=credentials)
    assert body == b"1\n", "a reader's session is still read-only after every attempt"
    assert facts(front) == [(1, "one"), (2, "two")]


READS_OF_FILES = [
    "SELECT file('{path}')",
    "SELECT length(FiLe('{path}')) AS n",
    "SELECT `file`('{path}')",
    'SELECT "file"(\'{path}\')',
    "SELECT file /* a comment */ ($${path}$$)",
    "WITH file('{path}') AS f SELECT f",
    "SELECT 1 WHERE 'x' IN (SELECT file('{path}'))",
    "SELECT 1; SELECT file('{path}')",
    "SELECT fileCluster('default', '{path}')",
    "SELECT file('{path}') FORMAT Hash",
]


def test_a_reader_cannot_read_the_machines_files_however_it_spells_file(front, tmp_path):
    """chdb is clickhouse-local, whose scalar file() reads any path even at readonly = 1: readers are refused it."""
    secret = tmp_path / "secret.toml"
    secret.write_text("password = 'do-not-show'\n")
    credentials = basic(READER, READER_PASSWORD)
    for template in READS_OF_FILES:
        statement = template.format(path=secret)
        status, headers, body = http(front, statement, headers=credentials)
        assert status in (400, 403) and b"do-not-show" not in body, (statement, status, body)
        assert headers["X-ClickHouse-Exception-Code"] in ("497", "62"), (statement, body)  # refused, or 2 statements
    status, _, body = http(front, "SELECT 'file(' || s FROM default.facts WHERE a = 1", headers=credentials)
    assert (status, body) == (200, b"file(one\n"), "a string that spells file( is still a string"
    status, _, body = http(front, f"SELECT file('{secret}')", headers=basic(WRITER, WRITER_PASSWORD))
    assert status == 200 and b"do-not-show" in body, "the writer, who may do anything on this machine, still may"


@pytest.mark.parametrize("browser", [
    {"Origin": "https://evil.example", "Content-Type": "text/plain;charset=UTF-8"},
    {"Origin": "null", "Content-Type": "text/plain"},
    {"Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"},
    {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "no-cors"},
], ids=["other-origin", "opaque-origin", "cross-site", "same-site"])
def test_a_web_page_from_elsewhere_is_refused_before_any_sql(stack, clickhouse, browser):
    """On the open stack (no password, as `make demo` runs it): a page's simple POST cannot drop a database."""
    clickhouse.command("CREATE DATABASE IF NOT EXISTS browser_probe")
    try:
        for method in ("POST", "GET"):
            status, headers, body = http(stack.clickhouse_url, "DROP DATABASE browser_probe", method=method,
                                         headers=browser, body=b"")
            assert status == 403 and headers["X-ClickHouse-Exception-Code"] == "497", body
            assert b"refused a request from a web page" in body
        status, _, body = http(stack.clickhouse_url, body=b"DROP DATABASE browser_probe", headers=browser)
        assert status == 403, body
        assert clickhouse.query("SELECT count() FROM system.databases WHERE name = 'browser_probe'"
                                ).result_rows == [(1,)]
    finally:
        clickhouse.command("DROP DATABASE IF EXISTS browser_probe")


def test_same_origin_and_rebound_names(stack, front):
    port = urllib.parse.urlsplit(stack.clickhouse_url).port
    itself = {"Origin": f"http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-origin"}
    assert http(stack.clickhouse_url, headers=itself)[0] == 200
    assert http(stack.clickhouse_url, headers={"Sec-Fetch-Site": "none"})[0] == 200  # typed in the address bar
    # DNS rebinding: the page's own name now points at 127.0.0.1, so its Origin matches its Host
    rebound = {"Host": f"rebound.example:{port}", "Origin": f"http://rebound.example:{port}"}
    status, _, body = http(stack.clickhouse_url, "SELECT 1", headers=rebound)
    assert status == 403 and b"not a loopback name" in body
    # with a password the name does not matter (a page cannot know it), the origin still does
    front_port = urllib.parse.urlsplit(front).port
    named = {"Host": f"ch.internal:{front_port}", **basic(WRITER, WRITER_PASSWORD)}
    assert http(front, headers=named)[0] == 200
    status, _, _ = http(front, headers={**named, "Origin": "https://evil.example"})
    assert status == 403


def test_inserts_do_not_wait_behind_long_reads(front):
    """The writer's 3 s scans (read-only, as the dashboard sends them, and not) and a reader's 3 s query run while
    the writer inserts: no insert waits for them."""
    scan = "SELECT count() FROM numbers(100000000000) WHERE sipHash64(number) % 7 = 3"
    limits = {"max_execution_time": "3", "timeout_overflow_mode": "break", "max_threads": "1"}
    slow = "SELECT sum(sleepEachRow(0.5)) FROM numbers(6)"  # a reader may not change settings (readonly = 1)
    finished: list[float] = []

    def read(sql: str, headers: dict[str, str], **params: str) -> None:
        status, _, body = http(front, sql, headers=headers, **params)
        assert status == 200, body
        finished.append(time.monotonic())

    readers = [threading.Thread(target=read, args=(slow, basic(READER, READER_PASSWORD))),
               threading.Thread(target=read, args=(scan, basic(WRITER, WRITER_PASSWORD)), kwargs=limits),
               threading.Thread(target=read, args=(scan, basic(WRITER, WRITER_PASSWORD)),
                                kwargs={**limits, "readonly": "2"})]
    started = time.monotonic()
    for thread in readers:
        thread.start()
    time.sleep(0.3)
    writer = connect(ClickHouseConfig(username=WRITER, password=Secret(WRITER_PASSWORD)), front)
    waits = []
    for index in range(5):
        begun = time.monotonic()
        writer.insert("default.facts", [[1000 + index, "during"]], column_names=["a", "s"])
        waits.append(time.monotonic() - begun)
    inserted = time.monotonic()
    writer.close()
    for thread in readers:
        thread.join()
    assert len(finished) == 3 and min(finished) - started > 2.5, "the scans ran their 3 s"
    assert inserted < min(finished), "every insert was done while the scans still ran"
    assert max(waits) < 1.0, waits
    writer = connect(ClickHouseConfig(username=WRITER, password=Secret(WRITER_PASSWORD)), front)
    writer.command("DELETE FROM default.facts WHERE s = 'during'")
    writer.close()


def stack_config(tmp_path: Path, **environ: str):
    return load_config(environ={"AGENTSTREAM_HOME": str(tmp_path / "home"), **environ})


def test_up_beyond_loopback_needs_the_password_and_registry_keys(tmp_path):
    open_wide = {"AGENTSTREAM_HOST": "0.0.0.0"}
    with pytest.raises(OpenBindRefused, match=r"embedded ClickHouse on 0\.0\.0\.0 .* Set \[clickhouse\] password"):
        Stack(stack_config(tmp_path, **open_wide)).up(timeout_s=5, progress=lambda line: None)
    assert not (tmp_path / "home" / "run").exists(), "nothing was started"
    with pytest.raises(OpenBindRefused, match=r"Schema Registry .* \[security\] registry_keys"):
        Stack(stack_config(tmp_path, CLICKHOUSE_PASSWORD="pw", **open_wide)).check_binds()
    with pytest.raises(OpenBindRefused, match=r"embedded Kafka broker on 0\.0\.0\.0: it checks no credential"):
        Stack(stack_config(tmp_path, CLICKHOUSE_PASSWORD="pw", AGENTSTREAM_REGISTRY_KEYS="k", **open_wide)
              ).check_binds()
    Stack(stack_config(tmp_path, CLICKHOUSE_PASSWORD="pw", AGENTSTREAM_REGISTRY_KEYS="k",
                       KAFKA_BOOTSTRAP_SERVERS="kafka.internal:9092", **open_wide)).check_binds()
    Stack(stack_config(tmp_path, AGENTSTREAM_ALLOW_OPEN_BIND="true", **open_wide)).check_binds()
    with pytest.raises(ConfigError, match="clickhouse_readers needs \\[clickhouse\\] password"):
        Stack(stack_config(tmp_path, AGENTSTREAM_CLICKHOUSE_READERS="a:b")).check_binds()
    with pytest.raises(ConfigError, match="user:password pairs"):
        Stack(stack_config(tmp_path, CLICKHOUSE_PASSWORD="pw", AGENTSTREAM_CLICKHOUSE_READERS="nopassword")
              ).check_binds()


def test_the_server_itself_refuses_an_open_bind_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "agentstream.stack.chserver", "--host", "0.0.0.0",
                             "--port", str(free_port()),
                             "--data-dir", str(tmp_path / "data")], env=clean_environment(), capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: refusing to serve the embedded ClickHouse on 0.0.0.0 without keys: anyone who reaches 0.0.0.0 could "
        "call it. Set [clickhouse] password, listen on 127.0.0.1, or set [security] allow_open_bind = true"]


def _outward_address() -> str | None:
    """This machine's address on its network (no packet is sent), or None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_the_object_store_listens_on_loopback_whatever_the_stack_host(tmp_path):
    stack = Stack(stack_config(tmp_path, AGENTSTREAM_HOST="0.0.0.0"))
    stack._broker_storage(30, lambda line: None)
    try:
        record = stack.services.record(OBJECTSTORE)
        assert record is not None and record.address.startswith("127.0.0.1:")
        port = int(record.address.rpartition(":")[2])
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        outward = _outward_address()
        if outward is not None:
            with pytest.raises(OSError):
                socket.create_connection((outward, port), timeout=5).close()
    finally:
        stack.services.stop(OBJECTSTORE)
