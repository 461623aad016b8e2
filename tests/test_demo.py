"""`agentstream demo` (what `make demo` runs) on its own stack home and ports."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import stack_environment


def test_demo_publishes_queries_and_stops_its_stack(tmp_path):
    env = stack_environment(tmp_path / "demo")
    result = subprocess.run([sys.executable, "-m", "pipeline", "demo"], env=env, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "published 32 spans in 8 Avro SpanBatch records" in out
    assert "inserted 32 rows into ClickHouse agentstream.spans" in out
    table = out[out.index("agent_name"):out.index("(8 rows)")]
    assert table.count(" LLM ") == 2 and table.count(" REWARD ") == 2
    assert "stopped (pid" in out and not list((tmp_path / "demo" / "run").glob("*.json"))
