"""Latency the LLM proxy adds over calling the same upstream directly.

A private stack (the proxy publishes its spans to a real broker), the dev model server with
the tiny model, greedy one-token chat completions; direct and proxied calls alternate so both
see the same machine state. Prints proxy_overhead_p50_ms / _p99_ms as JSON lines.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import httpx

from agentstream.models import load_model
from agentstream.pipeline.proxy.server import LLMProxy
from agentstream.pipeline.publisher import SpanPublisher
from agentstream.serving.app import create_app
from bench.common import emit, percentile, private_stack
from tests.support.http_thread import ServerThread

REQUESTS = 400
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}


def main() -> None:
    with private_stack() as (config, endpoints), tempfile.TemporaryDirectory() as journal:
        upstream = ServerThread(create_app(load_model("tiny")))
        with SpanPublisher(config, endpoints.bootstrap_servers, journal_dir=Path(journal)) as publisher:
            proxy = ServerThread(LLMProxy(upstream.url, publisher).app)
            direct, proxied = [], []
            with httpx.Client(timeout=30) as client:
                for round_ in range(REQUESTS + 20):
                    for url, sink in ((upstream.url, direct), (f"{proxy.url}/rollouts/bench-{round_}", proxied)):
                        started = time.perf_counter()
                        response = client.post(f"{url}/v1/chat/completions", json=BODY)
                        elapsed = (time.perf_counter() - started) * 1000
                        response.raise_for_status()
                        if round_ >= 20:  # warm-up rounds are not counted
                            sink.append(elapsed)
            proxy.stop()
            upstream.stop()
        overhead = [p - d for p, d in zip(proxied, direct, strict=True)]
        extra = {"requests": REQUESTS, "direct_p50_ms": round(statistics.median(direct), 3)}
        emit("proxy", "proxy_overhead_p50_ms", statistics.median(overhead), "ms", **extra)
        emit("proxy", "proxy_overhead_p99_ms", percentile(overhead, 0.99), "ms", **extra)


if __name__ == "__main__":
    main()
