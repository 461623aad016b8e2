"""Who the ClickHouse front lets in: users from the configuration, credentials as ClickHouse HTTP sends them, and the
marks a browser puts on requests from other sites."""

from __future__ import annotations

import base64

import pytest

from agentstream.infra.config import ConfigError, load_config
from agentstream.stack.chaccess import Access, Credentials, Users, cross_site, parse_readers, presented


def test_users_come_from_the_configuration() -> None:
    users = Users.from_config(load_config(environ={"CLICKHOUSE_USER": "w", "CLICKHOUSE_PASSWORD": "pw",
                                                   "AGENTSTREAM_CLICKHOUSE_READERS": "a:1, b:two:parts"}))
    assert users.access(Credentials("w", "pw")) is Access.WRITE
    assert users.access(Credentials("a", "1")) is Access.READ
    assert users.access(Credentials("b", "two:parts")) is Access.READ
    assert users.access(Credentials("a", "pw")) is None  # a reader's name with the writer's password
    assert users.access(Credentials("w", "1")) is None
    assert users.access(Credentials()) is None
    assert not users.open


def test_without_a_writer_password_the_front_is_open() -> None:
    users = Users.from_config(load_config(environ={}))
    assert users.open and users.access(Credentials()) is Access.WRITE
    assert users.access(Credentials("anyone", "anything")) is Access.WRITE


@pytest.mark.parametrize(("text", "problem"), [
    ("alice", "no password"), (":pw", "no user name"), ("alice:", "no password"), ("a:1,a:2", "twice")])
def test_malformed_readers_are_refused(text: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        parse_readers(text)


def test_readers_need_a_writer_password_and_names_of_their_own() -> None:
    with pytest.raises(ConfigError, match="needs \\[clickhouse\\] password"):
        Users(readers={"a": "1"})
    with pytest.raises(ConfigError, match="which is the writer"):
        Users("default", "pw", {"default": "1"})


def test_credentials_as_clickhouse_http_takes_them() -> None:
    basic = "Basic " + base64.b64encode(b"u:p:q").decode()
    assert presented({"Authorization": basic}, {"user": "x"}) == Credentials("u", "p:q")
    assert presented({"X-ClickHouse-User": "u", "X-ClickHouse-Key": "k"}, {}) == Credentials("u", "k")
    assert presented({}, {"user": "u", "password": "k"}) == Credentials("u", "k")
    assert presented({}, {}) == Credentials("default", "")
    assert presented({"Authorization": "Basic %%%"}, {}).user == ""  # garbage is nobody, not the default user


def test_what_marks_a_request_from_another_site() -> None:
    here = {"Host": "127.0.0.1:8123"}
    assert cross_site(here, "http", loopback_names=True) is None
    assert cross_site({**here, "Origin": "http://127.0.0.1:8123"}, "http", loopback_names=True) is None
    assert cross_site({**here, "Sec-Fetch-Site": "same-origin"}, "http", loopback_names=True) is None
    assert "Origin" in str(cross_site({**here, "Origin": "http://localhost:8123"}, "http", loopback_names=True))
    assert "cross-site" in str(cross_site({**here, "Sec-Fetch-Site": "cross-site"}, "http", loopback_names=True))
    assert "same-site" in str(cross_site({**here, "Sec-Fetch-Site": "same-site"}, "http", loopback_names=True))
    for name in ("localhost:8123", "[::1]:8123", "127.0.0.2"):
        assert cross_site({"Host": name}, "http", loopback_names=True) is None, name
    assert "loopback" in str(cross_site({"Host": "rebound.example:8123"}, "http", loopback_names=True))
    # a front with a password, or one put on the network on purpose, is reached by other names
    assert cross_site({"Host": "ch.lan:8123"}, "http", loopback_names=False) is None
    assert cross_site({"Host": "ch.lan:8123", "Origin": "http://ch.lan:8123"}, "http", loopback_names=False) is None
