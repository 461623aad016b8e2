"""Keys, feedback tokens and the loopback rule (infra/security.py)."""

import base64
import os
import stat

import pytest

from agentstream.infra.config import Secret, SecurityConfig, load_config
from agentstream.infra.security import (
    KeySet,
    OpenBindRefused,
    check_bind,
    feedback_secret,
    feedback_token,
    feedback_token_valid,
    is_loopback,
    presented_credentials,
)

pytestmark = pytest.mark.unit


def test_keys_come_from_one_config_section_and_environment():
    config = load_config(environ={"AGENTSTREAM_PROXY_KEYS": "k1, k2", "AGENTSTREAM_ALLOW_OPEN_BIND": "true"})
    assert KeySet(config.security.proxy_keys).allows({"Authorization": "Bearer k2"})
    assert config.security.allow_open_bind and config.security.feedback_tokens
    assert "k1" not in repr(config.security)


def test_a_keyset_checks_every_way_clients_send_a_key():
    keys = KeySet(Secret("alpha,beta"))
    basic = base64.b64encode(b"registry-user:beta").decode()
    assert keys.allows({"Authorization": "Bearer alpha"})
    assert keys.allows({"Authorization": f"Basic {basic}"})
    assert keys.allows({"api-key": "alpha"}) and keys.allows({"x-api-key": "beta"})
    for headers in ({}, {"Authorization": "Bearer alph"}, {"Authorization": "Bearer "}, {"Authorization": "alpha"},
                    {"Authorization": "Basic !!notbase64"}, {"Authorization": "Bearer alpha,beta"}):
        assert not keys.allows(headers), headers
    assert KeySet(None).allows({}) and not KeySet(None) and not KeySet(Secret(" , "))
    assert presented_credentials({"Authorization": "bearer  x "}) == ["x"]


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.8.0.2", True), ("localhost", True),
                                           ("::1", True), ("[::1]", True), ("0.0.0.0", False), ("::", False),
                                           ("10.0.0.4", False), ("example.com", False)])
def test_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_binding_beyond_loopback_needs_keys_or_an_explicit_yes():
    check_bind("LLM proxy", "127.0.0.1", KeySet(None), "proxy_keys", SecurityConfig())
    check_bind("LLM proxy", "0.0.0.0", KeySet("k"), "proxy_keys", SecurityConfig())
    check_bind("LLM proxy", "0.0.0.0", KeySet(None), "proxy_keys", SecurityConfig(allow_open_bind=True))
    with pytest.raises(OpenBindRefused) as refused:
        check_bind("LLM proxy", "0.0.0.0", KeySet(None), "proxy_keys", SecurityConfig())
    assert "\n" not in str(refused.value) and "proxy_keys" in str(refused.value)


def test_a_feedback_token_names_one_rollout(tmp_path):
    secret = feedback_secret(SecurityConfig(), tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / "feedback.secret").st_mode) == 0o600
    assert feedback_secret(SecurityConfig(), tmp_path) == secret  # made once, then read
    token = feedback_token(secret, "r-1")
    assert feedback_token_valid(secret, "r-1", token)
    assert not feedback_token_valid(secret, "r-2", token)
    assert not feedback_token_valid(secret, "r-1", None) and not feedback_token_valid(secret, "r-1", "")
    assert not feedback_token_valid(b"another", "r-1", token)
    configured = SecurityConfig(feedback_secret=Secret("shared"))
    assert feedback_secret(configured, tmp_path) == b"shared"


def test_the_stacks_clients_present_the_first_listed_key():
    assert KeySet(Secret(" new-key , old-key")).client_key() == "new-key"
    assert KeySet(None).client_key() is None and KeySet(Secret(" , ")).client_key() is None
