"""How long the workers' inserts wait behind a long read on the embedded ClickHouse front.

Starts ``python -m agentstream.stack.chserver`` on a fresh data folder (the one on ``PYTHONPATH``, so the same
script measures another checkout's server), times batches of 1,000 rows inserted over HTTP as
the ClickHouse sink sends them, first alone, then while a read-only query that scans for
``--read-s`` seconds runs (as a dashboard's 90-day page does), and prints each as JSON lines.

Run: ``python -m bench.clickhouse_reads [--read-s 5] [--inserts 20]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

from agentstream.stack.machine import calibrate
from bench.common import clickhouse_front, emit

BENCH = "clickhouse_reads"
ROWS = b"".join(json.dumps({"a": i, "s": f"row {i}"}).encode() + b"\n" for i in range(1000))


def post(url: str, sql: str, body: bytes = b"", **params: str) -> bytes:
    """One statement over ClickHouse HTTP (the query in the URL, data in the body)."""
    address = url + "/?" + urllib.parse.urlencode({"query": sql, **params})
    with urllib.request.urlopen(urllib.request.Request(address, data=body, method="POST"), timeout=120) as answer:
        return answer.read()


def insert_waits(url: str, count: int, pause_s: float) -> list[float]:
    """Seconds each of ``count`` inserts took, ``pause_s`` apart."""
    waits = []
    for _ in range(count):
        started = time.perf_counter()
        post(url, "INSERT INTO default.bench_inserts FORMAT JSONEachRow", ROWS)
        waits.append(time.perf_counter() - started)
        time.sleep(pause_s)
    return waits


def long_read(url: str, seconds: float, took: list[float]) -> None:
    """A read-only scan that stops after ``seconds`` (what the dashboard sends: readonly=2)."""
    started = time.perf_counter()
    post(url, "SELECT count() FROM numbers(100000000000) WHERE sipHash64(number) % 7 = 3 "
              f"SETTINGS max_execution_time = {seconds}, timeout_overflow_mode = 'break'", readonly="2")
    took.append(time.perf_counter() - started)


def report(label: str, waits: list[float], **extra: object) -> None:
    emit(BENCH, f"insert_wait_max_{label}", max(waits) * 1000, "ms", inserts=len(waits), **extra)
    emit(BENCH, f"insert_wait_median_{label}", statistics.median(waits) * 1000, "ms", inserts=len(waits), **extra)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--read-s", type=float, default=5.0, help="how long the long read scans")
    parser.add_argument("--inserts", type=int, default=20, help="inserts timed alone, and at most during the read")
    args = parser.parse_args(argv)
    calibration = calibrate()
    emit(BENCH, "machine_calibration", calibration.python_loop_s, "s", **calibration.as_dict())
    with tempfile.TemporaryDirectory(prefix="agentstream-bench-") as name, clickhouse_front(Path(name) / "ch") as url:
        post(url, "CREATE TABLE default.bench_inserts (a UInt64, s String) ENGINE = MergeTree ORDER BY a")
        report("alone", insert_waits(url, args.inserts, 0.05))
        took: list[float] = []
        reader = threading.Thread(target=long_read, args=(url, args.read_s, took))
        reader.start()
        time.sleep(0.3)  # the read is running
        waits = []
        while reader.is_alive() and len(waits) < args.inserts:
            waits += insert_waits(url, 1, args.read_s / args.inserts)
        reader.join()
        report("during_read", waits, read_s=round(took[0], 2))

if __name__ == "__main__":
    main()
