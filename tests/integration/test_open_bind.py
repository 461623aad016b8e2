"""Servers started as processes refuse to listen beyond loopback without keys, in one line on stderr:
the dev model server (`agentstream serve-model`) and the Schema Registry (`python -m stack.schema_registry`).
"""

from __future__ import annotations

import os
import subprocess
import sys

from agentstream.infra.processes import free_port


def test_serve_model_refuses_to_listen_beyond_loopback_without_an_admin_token(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("AGENTSTREAM_")}
    env["AGENTSTREAM_HOME"] = str(tmp_path)
    command = [sys.executable, "-m", "agentstream", "serve-model", "--model", "tiny", "--host", "0.0.0.0",
               "--port", str(free_port())]
    refused = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert refused.returncode != 0
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "refusing to serve the model server on 0.0.0.0" in lines[0]
    assert "admin_token" in lines[0]


def test_the_registry_refuses_an_open_bind_in_one_line() -> None:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTSTREAM_", "SCHEMA_REGISTRY_"))}
    result = subprocess.run([sys.executable, "-m", "agentstream.stack.registry_server", "--host", "0.0.0.0",
                             "--memory"],
                            env=environment, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: refusing to serve the Schema Registry on 0.0.0.0 without keys: anyone who reaches 0.0.0.0 could "
        "call it. Set [security] registry_keys, listen on 127.0.0.1, or set [security] allow_open_bind = true"]
