"""Constant load on one streams worker for a while (default 10 minutes): is its memory flat?

Publishes rollouts of 1 KB LLM spans at a steady rate through the full pipeline and prints the
worker's resident memory at the start and the end, plus the spans that arrived.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from agentstream.infra.clickhouse import connect
from agentstream.pipeline.publisher import SpanPublisher
from bench.common import emit, private_stack
from bench.streams import SPANS_PER_ROLLOUT, Workload, rss_mb, start_worker, wait_ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--spans-per-s", type=float, default=2000)
    args = parser.parse_args()
    with private_stack() as (config, endpoints), tempfile.TemporaryDirectory() as scratch:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "CLICKHOUSE_", "AGENTSTREAM_"))}
        env.update({"KAFKA_BOOTSTRAP_SERVERS": endpoints.bootstrap_servers, "CLICKHOUSE_URL": endpoints.clickhouse_url,
                    "AGENTSTREAM_HOME": scratch})
        log_path = Path(scratch) / "worker.log"
        worker = start_worker(env, log_path)
        try:
            wait_ready(worker, log_path)
            workload = Workload()
            rate = args.spans_per_s / SPANS_PER_ROLLOUT
            samples = []
            with SpanPublisher(config, endpoints.bootstrap_servers, journal_dir=Path(scratch) / "journal") as publisher:
                begin = time.perf_counter()
                sent = 0
                while time.perf_counter() - begin < args.seconds:
                    pause = begin + sent / rate - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)
                    workload.rollout(publisher)
                    sent += 1
                    if sent % max(1, int(rate * 30)) == 0:
                        samples.append(rss_mb(worker.pid))
                        print(f"soak: {time.perf_counter() - begin:5.0f} s, {sent * SPANS_PER_ROLLOUT} spans, "
                              f"worker RSS {samples[-1]:.0f} MB", flush=True)
                publisher.flush(60)
            client = connect(config.clickhouse, endpoints.clickhouse_url, database=config.clickhouse.database)
            expected = sent * SPANS_PER_ROLLOUT
            deadline = time.monotonic() + 120
            while (client.query("SELECT count() FROM spans").result_rows[0][0] < expected
                   and time.monotonic() < deadline):
                time.sleep(0.5)
            arrived = client.query("SELECT count() FROM spans").result_rows[0][0]
            client.close()
            extra = {"seconds": args.seconds, "load_spans_per_s": args.spans_per_s}
            emit("soak", "worker_rss_mb_start", samples[0] if samples else rss_mb(worker.pid), "MB", **extra)
            emit("soak", "worker_rss_mb_end", rss_mb(worker.pid), "MB", **extra)
            emit("soak", "spans_arrived_fraction", arrived / expected, "fraction", spans=expected)
        finally:
            worker.terminate()
            worker.wait(30)


if __name__ == "__main__":
    main()
