"""OpenTelemetry in: OTLP/HTTP protobuf exports → `agentstream collector` → Kafka → streams worker → ClickHouse rows.

Prints (JSON lines, bench/common.py's emit), after the machine's calibration line:

- ``otlp_spans_per_s``: ``--rollouts`` export requests of ``--spans`` LLM spans each (about 1 KB: 100 prompt
  and 100 response token ids and 100 logprobs as attributes, gen_ai attributes, the rollout named by the
  ``agentlightning.rollout_id`` resource attribute), posted by ``--senders`` concurrent HTTP clients to a
  collector process; timed from the first post until ClickHouse counts every span;
- ``peer_otlp_spans_per_s``: the same spans, built the same way, posted to Agent Lightning 0.3.0's own OTLP
  endpoint (``/v1/traces`` of its LightningStore server, in-memory) by its runners (bench/peer_agentlightning.py,
  ``--path otlp``), until its store holds them; and ``otlp_vs_peer_ratio``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

from agentstream.infra.clickhouse import connect
from agentstream.infra.processes import free_port, wait_for_port
from agentstream.stack.machine import calibrate
from bench.common import VOCABULARY, emit, private_stack
from bench.streams import start_worker, wait_ready

BENCH = "otlp"
MODEL = "SmolLM2-135M-Instruct"


def span_pool(seed: int, size: int = 64) -> list[ProtoSpan]:
    """LLM-call spans as the peer bench builds them: token ids and logprobs as array attributes, gen_ai names."""
    rng = random.Random(seed)
    pool = []
    for index in range(size):
        span = ProtoSpan(name=f"chat {MODEL}", kind=ProtoSpan.SPAN_KIND_CLIENT)
        span.status.code = 1
        for key, value in (("gen_ai.system", "agentstream"), ("gen_ai.request.model", MODEL),
                           ("gen_ai.request.temperature", "1.0"), ("gen_ai.usage.output_tokens", "100"),
                           ("agent_name", "math-agent"), ("kind", "LLM"), ("task_id", f"task-{index % 7473:05d}"),
                           ("model", MODEL)):
            item = span.attributes.add()
            item.key, item.value.string_value = key, value
        item = span.attributes.add()
        item.key, item.value.int_value = "policy_version", 3
        for key in ("prompt_token_ids", "response_token_ids"):
            item = span.attributes.add()
            item.key = key
            for _ in range(100):
                item.value.array_value.values.add().int_value = int(VOCABULARY ** rng.random())
        item = span.attributes.add()
        item.key = "response_logprobs"
        for _ in range(100):
            item.value.array_value.values.add().double_value = -rng.expovariate(2.0)
        pool.append(span)
    return pool


def export_body(pool: list[ProtoSpan], rollout_id: str, spans: int, counter: int) -> bytes:
    """One export request: one rollout's spans under one resource (what an exporter sends per batch)."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    for key, value in (("agentlightning.rollout_id", rollout_id), ("agentlightning.attempt_id", f"{rollout_id}-1"),
                       ("service.name", "agentstream-bench-runner")):
        item = resource_spans.resource.attributes.add()
        item.key, item.value.string_value = key, value
    scope_spans = resource_spans.scope_spans.add()
    scope_spans.scope.name = "agentstream.bench.otlp"
    now = time.time_ns()
    trace_id = hashlib.blake2b(rollout_id.encode(), digest_size=16).digest()
    for index in range(spans):
        span = scope_spans.spans.add()
        span.CopyFrom(pool[(counter + index) % len(pool)])
        span.trace_id = trace_id
        span.span_id = hashlib.blake2b(f"{rollout_id}/{index}".encode(), digest_size=8).digest()
        span.start_time_unix_nano = now + index * 1_000_000
        span.end_time_unix_nano = now + index * 1_000_000 + 250_000_000
    return request.SerializeToString()


async def post_all(url: str, bodies: list[bytes], senders: int) -> None:
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)

    async def sender(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            body = queue.get_nowait()
            async with session.post(url, data=body, headers={"Content-Type": "application/x-protobuf"}) as response:
                answer = await response.read()
                if response.status != 200:
                    raise RuntimeError(f"the collector answered HTTP {response.status}: {answer[:300]!r}")

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(sender(session) for _ in range(senders)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=2000, help="export requests, one rollout each")
    parser.add_argument("--spans", type=int, default=8, help="spans per export request")
    parser.add_argument("--senders", type=int, default=8, help="concurrent HTTP clients (the peer: runner processes)")
    parser.add_argument("--no-peer", action="store_true", help="skip Agent Lightning")
    args = parser.parse_args()
    calibration = calibrate()
    emit(BENCH, "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    total = args.rollouts * args.spans
    pool = span_pool(7)
    bodies = [export_body(pool, f"otlp-{index:07d}", args.spans, index * args.spans) for index in range(args.rollouts)]
    ours = None
    with private_stack() as (config, endpoints), \
            tempfile.TemporaryDirectory() as scratch:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_"))}
        port = free_port()
        env.update({"KAFKA_BOOTSTRAP_SERVERS": endpoints.bootstrap_servers, "CLICKHOUSE_URL": endpoints.clickhouse_url,
                    "AGENTSTREAM_HOME": scratch, "AGENTSTREAM_OTLP_PORT": str(port), "AGENTSTREAM_OTLP_GRPC_PORT": "0"})
        worker = start_worker(env, Path(scratch) / "worker.log")
        with open(Path(scratch) / "collector.log", "ab") as log:
            collector = subprocess.Popen([sys.executable, "-m", "agentstream", "collector"], env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        client = connect(config.clickhouse, endpoints.clickhouse_url, database=config.clickhouse.database)
        try:
            wait_ready(worker, Path(scratch) / "worker.log")
            wait_for_port("127.0.0.1", port, 60, collector)
            started = time.perf_counter()
            asyncio.run(post_all(f"http://127.0.0.1:{port}/v1/traces", bodies, args.senders))
            posted = time.perf_counter()
            while client.query("SELECT count() FROM spans").result_rows[0][0] < total:
                if time.perf_counter() - started > 300 or worker.poll() is not None or collector.poll() is not None:
                    raise RuntimeError("spans did not all arrive:\n" + (Path(scratch) / "collector.log").read_text()
                                       [-2000:] + (Path(scratch) / "worker.log").read_text()[-2000:])
                time.sleep(0.05)
            elapsed = time.perf_counter() - started
            ours = total / elapsed
            emit(BENCH, "otlp_post_phase_spans_per_s", total / (posted - started), "spans/s", spans=total,
                 senders=args.senders)
            emit(BENCH, "otlp_spans_per_s", ours, "spans/s", spans=total, spans_per_request=args.spans,
                 senders=args.senders, seconds=round(elapsed, 3))
        finally:
            client.close()
            for process in (collector, worker):
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    if args.no_peer:
        return
    from bench.peer_agentlightning import run_peer

    try:
        peer = run_peer(args.rollouts, args.spans, args.senders, path="otlp")
    except RuntimeError as error:
        emit(BENCH, "peer_otlp_spans_per_s", None, "spans/s", error=str(error)[:300])
        return
    emit(BENCH, "peer_otlp_spans_per_s", peer["spans_per_s"], "spans/s", peer="agentlightning==0.3.0",
         spans=peer.get("spans"), path=peer.get("path"), runners=peer.get("runners"))
    emit(BENCH, "otlp_vs_peer_ratio", ours / peer["spans_per_s"] if ours and peer["spans_per_s"] else None, "x")


if __name__ == "__main__":
    main()
