"""Peer benchmark: Agent Lightning 0.3.0's LightningStore (in-memory, behind its HTTP server) on our workload.

Two roles in one file:

* **launcher** (the default; runs in the product venv): makes sure the side venv ``.venv-peer`` exists with
  ``agentlightning==0.3.0`` (creating it if missing), re-executes this file there as the driver, and relays the
  driver's one JSON line. ``run_peer()`` does the same from Python and returns the parsed dict. Agent Lightning
  is never imported into, or installed in, the product venv.
* **driver** (``--role driver``, runs inside ``.venv-peer``): starts AL's store server (``agentlightning.cli.store``,
  in-memory backend, one worker, 127.0.0.1, free port) as a child process, enqueues N rollouts, starts R runner
  processes that dequeue rollouts (``dequeue_rollout`` already creates the attempt), write S LLM-call spans of
  about 1 KB per rollout and mark the attempt succeeded, and times from the first span written until the store
  reports all N rollouts succeeded and all N*S spans stored (polled; the client refuses long waits).

Span path: ``otlp`` posts one OTLP/HTTP protobuf ``ExportTraceServiceRequest`` per rollout (S spans) to the
store's ``/v1/traces`` (its only bulk write path over HTTP); ``add_span`` uses ``LightningStoreClient.add_many_spans``,
which posts one span per request. ``auto`` (default) probes OTLP end to end before timing and falls back to
``add_span`` if the probe fails.

Output: one JSON line, ``{"spans_per_s", "rollouts_per_s", "spans", "seconds", "path", "runners", ...}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PEER_VENV = ROOT / ".venv-peer"
PEER_PYTHON = PEER_VENV / "bin" / "python"
AGL_VERSION = "0.3.0"
VOCABULARY = 49152  # SmolLM2's, as in bench/common.py's 1 KB LLM span
MODEL = "SmolLM2-135M-Instruct"
ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # otherwise importing agentlightning hangs ~10 s offline


def log(message: str) -> None:
    print(f"[peer-agentlightning] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------------
# Launcher role (product venv): side venv + re-exec.
# --------------------------------------------------------------------------------------------------------------


def _installed_agl_version() -> str | None:
    if not PEER_PYTHON.exists():
        return None
    probe = subprocess.run(
        [str(PEER_PYTHON), "-I", "-c", "import importlib.metadata as m; print(m.version('agentlightning'))"],
        capture_output=True, text=True, timeout=60,
    )
    return probe.stdout.strip() if probe.returncode == 0 else None


def ensure_peer_venv(timeout_s: float = 900) -> Path:
    """Create ``.venv-peer`` with agentlightning==0.3.0 unless it is already there; returns its python."""
    import fcntl

    lock_path = Path(tempfile.gettempdir()) / f"agentstream-venv-peer-{os.getuid()}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two benches starting at once must not both pip install
        version = _installed_agl_version()
        if version == AGL_VERSION:
            return PEER_PYTHON
        started = time.monotonic()
        if not PEER_PYTHON.exists():
            log(f"creating side venv {PEER_VENV} ...")
            subprocess.run(["python3", "-m", "venv", str(PEER_VENV)], check=True, timeout=timeout_s,
                           stdout=sys.stderr)
        log(f"installing agentlightning=={AGL_VERSION} into {PEER_VENV} (found: {version or 'none'}); "
            "this takes a minute or two ...")
        subprocess.run([str(PEER_PYTHON), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                        f"agentlightning=={AGL_VERSION}"], check=True, timeout=timeout_s, stdout=sys.stderr)
        version = _installed_agl_version()
        if version != AGL_VERSION:
            raise RuntimeError(f"side venv {PEER_VENV} has agentlightning {version!r} after install, "
                               f"expected {AGL_VERSION}")
        log(f"side venv ready in {time.monotonic() - started:.1f} s")
        return PEER_PYTHON


def run_peer(rollouts: int, spans_per_rollout: int, runners: int, timeout_s: float = 300,
             path: str = "auto") -> dict:
    """Run the Agent Lightning peer benchmark in its side venv and return its result dict.

    ``timeout_s`` bounds the measurement run (server start, enqueue, runners, polling); creating the side venv,
    when needed, is bounded separately. Raises RuntimeError on failure or timeout.
    """
    python = ensure_peer_venv()
    command = [str(python), "-I", str(Path(__file__).resolve()), "--role", "driver",
               "--rollouts", str(rollouts), "--spans-per-rollout", str(spans_per_rollout),
               "--runners", str(runners), "--timeout", str(timeout_s), "--path", path]
    environ = {**os.environ, **ENV}
    environ.pop("VIRTUAL_ENV", None)
    # Its own session, so that a hard kill on timeout reaches the driver's children as well.
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=None, env=environ, text=True,
                              start_new_session=True)
    try:
        stdout, _ = driver.communicate(timeout=timeout_s + 60)  # the driver enforces timeout_s itself
    except BaseException as error:
        _kill_group(driver)
        raise RuntimeError(f"Agent Lightning peer driver (pid {driver.pid}) did not finish within "
                           f"{timeout_s + 60:.0f} s; killed it") from error
    if driver.returncode != 0:
        raise RuntimeError(f"Agent Lightning peer driver failed (exit {driver.returncode}); see its stderr above")
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"Agent Lightning peer driver printed no JSON result: {stdout[-500:]!r}")
    return json.loads(lines[-1])


def _kill_group(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)  # the group that process leads (start_new_session)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=wait)
            return


# --------------------------------------------------------------------------------------------------------------
# Driver role (side venv).
# --------------------------------------------------------------------------------------------------------------


def _libc() -> Any:
    with contextlib.suppress(Exception):
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True)
    return None


_LIBC = None


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (no orphans if the driver is killed).
    Safe as a ``preexec_fn``: libc is loaded beforehand, so the forked child only makes the call."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SpanMaker:
    """LLM-call spans like bench/common.py's ``llm_span``: 100 prompt ids, 100 response ids, 100 logprobs, gen_ai
    attributes. A pool of pre-built payloads is cycled so that the runners spend their time on the store."""

    def __init__(self, seed: int, pool: int = 64) -> None:
        import random

        rng = random.Random(seed)
        self.attributes = []
        for index in range(pool):
            self.attributes.append({
                "gen_ai.system": "agentstream", "gen_ai.request.model": MODEL, "gen_ai.request.temperature": "1.0",
                "gen_ai.usage.output_tokens": "100", "agent_name": "math-agent", "kind": "LLM",
                "task_id": f"task-{index % 7473:05d}", "model": MODEL, "policy_version": 3,
                "prompt_token_ids": [int(VOCABULARY ** rng.random()) for _ in range(100)],
                "response_token_ids": [int(VOCABULARY ** rng.random()) for _ in range(100)],
                "response_logprobs": [-rng.expovariate(2.0) for _ in range(100)],
            })
        self._proto_pool: list[Any] | None = None
        self.counter = 0

    @staticmethod
    def ids(rollout_id: str, index: int) -> tuple[bytes, bytes]:
        import hashlib

        return (hashlib.blake2b(rollout_id.encode(), digest_size=16).digest(),
                hashlib.blake2b(f"{rollout_id}/{index}".encode(), digest_size=8).digest())

    # OTLP protobuf -----------------------------------------------------------------------------------------------
    def _protos(self) -> list[Any]:
        if self._proto_pool is None:
            from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
            from opentelemetry.proto.trace.v1.trace_pb2 import Status as ProtoStatus

            self._proto_pool = []
            for attributes in self.attributes:
                span = ProtoSpan(name=f"chat {MODEL}", kind=ProtoSpan.SPAN_KIND_CLIENT)
                span.status.code = ProtoStatus.STATUS_CODE_OK
                for key, value in attributes.items():
                    kv = span.attributes.add()
                    kv.key = key
                    if isinstance(value, str):
                        kv.value.string_value = value
                    elif isinstance(value, int):
                        kv.value.int_value = value
                    elif isinstance(value[0], float):
                        for item in value:
                            kv.value.array_value.values.add().double_value = item
                    else:
                        for item in value:
                            kv.value.array_value.values.add().int_value = item
                self._proto_pool.append(span)
        return self._proto_pool

    def otlp_request(self, rollout_id: str, attempt_id: str, count: int) -> bytes:
        from agentlightning.semconv import LightningResourceAttributes
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        pool = self._protos()
        request = ExportTraceServiceRequest()
        resource_spans = request.resource_spans.add()
        for key, value in ((LightningResourceAttributes.ROLLOUT_ID.value, rollout_id),
                           (LightningResourceAttributes.ATTEMPT_ID.value, attempt_id),
                           ("service.name", "agentstream-peer-runner")):
            kv = resource_spans.resource.attributes.add()
            kv.key, kv.value.string_value = key, value
        scope_spans = resource_spans.scope_spans.add()
        scope_spans.scope.name = "agentstream.bench.peer"
        now = time.time_ns()
        for index in range(count):
            span = scope_spans.spans.add()
            span.CopyFrom(pool[self.counter % len(pool)])
            self.counter += 1
            span.trace_id, span.span_id = self.ids(rollout_id, index)
            span.start_time_unix_nano = now + index * 1_000_000
            span.end_time_unix_nano = now + index * 1_000_000 + 250_000_000
        return request.SerializeToString()

    # AL Span models (add_span path) ------------------------------------------------------------------------------
    def spans(self, rollout_id: str, attempt_id: str, count: int) -> list[Any]:
        from agentlightning.types import OtelResource, Span, SpanContext, TraceStatus

        now = time.time()
        spans = []
        for index in range(count):
            trace_id, span_id = (raw.hex() for raw in self.ids(rollout_id, index))
            attributes = self.attributes[self.counter % len(self.attributes)]
            self.counter += 1
            spans.append(Span(
                rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=index + 1, trace_id=trace_id,
                span_id=span_id, parent_id=None, name=f"chat {MODEL}", status=TraceStatus(status_code="OK"),
                attributes=attributes, events=[], links=[], start_time=now + index * 0.001,
                end_time=now + index * 0.001 + 0.25,
                context=SpanContext(trace_id=trace_id, span_id=span_id, is_remote=False, trace_state={}),
                parent=None,
                resource=OtelResource(attributes={"service.name": "agentstream-peer-runner"}, schema_url=""),
            ))
        return spans


async def _post_otlp(session: Any, url: str, body: bytes) -> None:
    """One OTLP/HTTP export; retried on connection trouble (span ids are deterministic, so a replay is dropped
    by the store as a duplicate rather than double counted)."""
    import asyncio

    import aiohttp

    for attempt, delay in enumerate((0.0, 0.5, 1.0, 2.0)):
        if delay:
            await asyncio.sleep(delay)
        try:
            async with session.post(url, data=body, headers={"Content-Type": "application/x-protobuf"}) as response:
                payload = await response.read()
                if response.status == 200:
                    return
                raise RuntimeError(f"OTLP export to {url} returned HTTP {response.status}: {payload[:300]!r}")
        except (TimeoutError, aiohttp.ClientConnectionError):
            if attempt == 3:
                raise


async def _write_rollout(client: Any, session: Any, maker: SpanMaker, path: str, rollout_id: str, attempt_id: str,
                         spans_per_rollout: int) -> None:
    if path == "otlp":
        await _post_otlp(session, client.otlp_traces_endpoint(),
                         maker.otlp_request(rollout_id, attempt_id, spans_per_rollout))
    else:
        written = await client.add_many_spans(maker.spans(rollout_id, attempt_id, spans_per_rollout))
        if len(written) != spans_per_rollout:
            raise RuntimeError(f"add_many_spans stored {len(written)} of {spans_per_rollout} spans for {rollout_id}")
    # What AL's own runner does when a rollout ends; the store carries the status over to the rollout.
    await client.update_attempt(rollout_id, attempt_id, status="succeeded")


def _runner_main(index: int, endpoint: str, path: str, spans_per_rollout: int, go: Any, reports: Any) -> None:
    """A runner process: dequeue, write spans, complete; until the queue stays empty."""
    global _LIBC
    _LIBC = _libc()
    _die_with_parent()
    os.environ.update(ENV)
    try:
        import asyncio

        import aiohttp
        from agentlightning.store.client_server import LightningStoreClient

        maker = SpanMaker(seed=1000 + index)
        reports.put(("ready", index, None))
        while not go.wait(1.0):
            if os.getppid() == 1:
                return

        async def work() -> tuple[float | None, int, int, float]:
            cpu = time.process_time()
            client = LightningStoreClient(endpoint)
            first, rollouts, spans, empty = None, 0, 0, 0
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                try:
                    while True:
                        rollout = await client.dequeue_rollout(worker_id=f"peer-runner-{index}")
                        if rollout is None:  # the client also says None on a failed request: look again
                            empty += 1
                            if empty >= 3:
                                break
                            await asyncio.sleep(0.05)
                            continue
                        empty = 0
                        if first is None:
                            first = time.time()
                        await _write_rollout(client, session, maker, path, rollout.rollout_id,
                                             rollout.attempt.attempt_id, spans_per_rollout)
                        rollouts += 1
                        spans += spans_per_rollout
                finally:
                    await client.close()
            return first, rollouts, spans, time.process_time() - cpu

        reports.put(("done", index, asyncio.run(work())))
    except BaseException as error:  # reported to the driver, which fails the run
        import traceback

        reports.put(("error", index, f"{error!r}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None


async def _probe_otlp(client: Any, spans_per_rollout: int) -> tuple[bool, str]:
    """Write one rollout's spans over OTLP and read them back; True if the store kept them intact."""
    import aiohttp

    maker = SpanMaker(seed=7)
    rollout = await client.start_rollout(input={"probe": True}, mode="train")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            await _write_rollout(client, session, maker, "otlp", rollout.rollout_id, rollout.attempt.attempt_id,
                                 spans_per_rollout)
        stored = await client.query_spans(rollout.rollout_id)
        if len(stored) != spans_per_rollout:
            return False, f"probe stored {len(stored)} of {spans_per_rollout} spans"
        attributes = stored[0].attributes
        if len(attributes.get("prompt_token_ids", ())) != 100 or len(attributes.get("response_logprobs", ())) != 100:
            return False, f"probe spans lost their token arrays: {sorted(attributes)}"
        return True, "ok"
    except Exception as error:  # any failure means "use add_span"
        with contextlib.suppress(Exception):
            await client.update_attempt(rollout.rollout_id, rollout.attempt.attempt_id, status="failed")
        return False, repr(error)


async def _counts(client: Any) -> tuple[int, int]:
    """(spans stored, rollouts succeeded), as the store reports them."""
    statistics = await client.statistics()
    succeeded = await client.query_rollouts(status_in=["succeeded"], limit=1)
    return int(statistics["total_spans"]), int(succeeded.total)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time a live process has used so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _span_bytes(path: str, spans_per_rollout: int) -> int:
    """Average encoded size of one span on the chosen path (protobuf in the OTLP request, JSON for add_span)."""
    maker = SpanMaker(seed=3)
    if path == "otlp":
        return round(len(maker.otlp_request("ro-000000000000", "at-00000000", spans_per_rollout)) / spans_per_rollout)
    return round(sum(len(span.model_dump_json()) for span in maker.spans("ro-000000000000", "at-00000000",
                                                                          spans_per_rollout)) / spans_per_rollout)


def driver(args: argparse.Namespace) -> int:
    import asyncio
    import multiprocessing

    global _LIBC
    _LIBC = _libc()
    os.environ.update(ENV)
    from agentlightning.store.client_server import LightningStoreClient
    from agentlightning.types import EnqueueRolloutRequest

    deadline = time.monotonic() + args.timeout
    total_spans = args.rollouts * args.spans_per_rollout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"Agent Lightning peer benchmark exceeded its {args.timeout:.0f} s timeout")
        return remaining

    server_log_fd, server_log = tempfile.mkstemp(prefix="agentstream-peer-store-", suffix=".log")
    server: subprocess.Popen | None = None
    runners: list[Any] = []
    try:
        port = _free_port()
        endpoint = f"http://127.0.0.1:{port}"
        # AL's own `agl store` entry point: InMemoryLightningStore(thread_safe=True) behind LightningStoreServer,
        # asyncio launch mode with one worker (the in-memory store refuses multi-worker mode).
        server = subprocess.Popen(
            [sys.executable, "-I", "-m", "agentlightning.cli.store", "--host", "127.0.0.1", "--port", str(port),
             "--backend", "memory", "--n-workers", "1", "--log-level", "WARNING"],
            stdout=server_log_fd, stderr=subprocess.STDOUT, env={**os.environ, **ENV}, preexec_fn=_die_with_parent,
        )
        log(f"store server pid {server.pid} on {endpoint}")

        async def prepare() -> tuple[str, int, int]:
            import aiohttp

            async with aiohttp.ClientSession() as session:
                while True:
                    if server.poll() is not None:
                        raise RuntimeError(f"store server exited with {server.returncode}")
                    with contextlib.suppress(aiohttp.ClientError, OSError):
                        async with session.get(f"{endpoint}/v1/agl/health") as response:
                            if response.status == 200:
                                break
                    if left() > 0:
                        await asyncio.sleep(0.1)
            client = LightningStoreClient(endpoint)
            try:
                path = args.path
                if path in ("auto", "otlp"):
                    ok, why = await _probe_otlp(client, args.spans_per_rollout)
                    if not ok and path == "otlp":
                        raise RuntimeError(f"OTLP path requested but the probe failed: {why}")
                    if not ok:
                        log(f"OTLP probe failed ({why}); falling back to add_span")
                    path = "otlp" if ok else "add_span"
                for start in range(0, args.rollouts, 500):
                    batch = [EnqueueRolloutRequest(input={"task_id": f"task-{index % 7473:05d}", "index": index},
                                                   mode="train")
                             for index in range(start, min(args.rollouts, start + 500))]
                    await client.enqueue_many_rollouts(batch)
                    left()
                spans, succeeded = await _counts(client)
                return path, spans, succeeded
            finally:
                await client.close()

        path, base_spans, base_succeeded = asyncio.run(prepare())
        log(f"enqueued {args.rollouts} rollouts; path={path}; starting {args.runners} runner processes")

        import threading

        # Fork is safe here (nothing but the main thread runs: the asyncio loops above are closed) and spares
        # each runner the seconds-long agentlightning import; spawn otherwise.
        context = multiprocessing.get_context("fork" if threading.active_count() == 1 else "spawn")
        reports, go = context.Queue(), context.Event()
        for index in range(args.runners):
            process = context.Process(target=_runner_main, name=f"peer-runner-{index}", daemon=True,
                                      args=(index, endpoint, path, args.spans_per_rollout, go, reports))
            process.start()
            runners.append(process)
        results: dict[int, Any] = {}

        def collect(block_s: float) -> None:
            import queue

            with contextlib.suppress(queue.Empty):
                while True:
                    kind, index, payload = reports.get(timeout=block_s)
                    block_s = 0.01
                    if kind == "error":
                        raise RuntimeError(f"runner {index} failed: {payload}")
                    results[index] = (kind, payload)

        while sum(1 for kind, _ in results.values() if kind == "ready") < args.runners:
            collect(min(0.5, left()))
            for process in runners:
                if process.exitcode is not None:
                    raise RuntimeError(f"runner {process.name} (pid {process.pid}) exited early "
                                       f"with {process.exitcode}")
        server_cpu = _cpu_seconds(server.pid)
        go.set()
        log("runners ready; timing starts at the first span written")

        async def wait_complete() -> tuple[float, int, int]:
            client = LightningStoreClient(endpoint)
            try:
                spans = succeeded = 0
                while True:
                    stats = await client.statistics()
                    spans = int(stats["total_spans"]) - base_spans
                    if spans >= total_spans:
                        succeeded = int((await client.query_rollouts(status_in=["succeeded"], limit=1)).total)
                        succeeded -= base_succeeded
                        if succeeded >= args.rollouts:
                            return time.time(), spans, succeeded
                    collect(0)
                    if all(process.exitcode is not None for process in runners):
                        collect(1.0)
                        # One more look: the last update may have landed after this poll began.
                        spans, succeeded = (value - base for value, base in
                                            zip(await _counts(client), (base_spans, base_succeeded), strict=True))
                        if spans >= total_spans and succeeded >= args.rollouts:
                            return time.time(), spans, succeeded
                        raise RuntimeError(f"all runners exited but the store holds {spans}/{total_spans} spans "
                                           f"and {succeeded}/{args.rollouts} succeeded rollouts")
                    try:
                        left()
                    except TimeoutError as error:
                        spans, succeeded = (value - base for value, base in
                                            zip(await _counts(client), (base_spans, base_succeeded), strict=True))
                        raise TimeoutError(f"{error}: store holds {spans}/{total_spans} spans, "
                                           f"{succeeded}/{args.rollouts} succeeded rollouts") from None
                    await asyncio.sleep(0.1)
            finally:
                await client.close()

        finished, _spans, _succeeded = asyncio.run(wait_complete())
        server_cpu = _cpu_seconds(server.pid) - server_cpu
        while any(kind != "done" for kind, _ in results.values()):
            collect(min(1.0, left()))
        firsts = [payload[0] for _, payload in results.values() if payload[0] is not None]
        if not firsts:
            raise RuntimeError("no runner wrote a span")
        seconds = finished - min(firsts)
        per_runner = [payload[1] for _, payload in results.values()]

        async def verify() -> None:
            import random

            client = LightningStoreClient(endpoint)
            try:
                page = await client.query_rollouts(status_in=["succeeded"], limit=-1)
                ids = [rollout.rollout_id for rollout in page]
                for rollout_id in random.Random(0).sample(ids, min(25, len(ids))):
                    stored = await client.query_spans(rollout_id, "latest")
                    if len(stored) != args.spans_per_rollout:
                        raise RuntimeError(f"rollout {rollout_id} has {len(stored)} spans, "
                                           f"expected {args.spans_per_rollout}")
            finally:
                await client.close()

        asyncio.run(verify())
        result = {
            "spans_per_s": round(total_spans / seconds, 1), "rollouts_per_s": round(args.rollouts / seconds, 1),
            "spans": total_spans, "seconds": round(seconds, 3), "path": path, "runners": args.runners,
            "span_bytes": _span_bytes(path, args.spans_per_rollout), "rollouts_per_runner": sorted(per_runner),
            "cpu_s": {"store_server": round(server_cpu, 1),
                      "runners": round(sum(payload[3] for _, payload in results.values()), 1)},
            "cpus": os.cpu_count(),
            "peer": f"agentlightning {AGL_VERSION} LightningStoreServer(InMemoryLightningStore), HTTP, 1 worker",
        }
        print(json.dumps(result), flush=True)
        return 0
    except BaseException as error:
        log(f"FAILED: {error}")
        with contextlib.suppress(Exception):
            tail = Path(server_log).read_text(errors="replace")[-2000:]
            if tail.strip():
                log(f"store server log tail:\n{tail}")
        return 1
    finally:
        for process in runners:
            if process.is_alive():
                process.terminate()
        for process in runners:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        if server is not None and server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=10)
        os.close(server_log_fd)
        with contextlib.suppress(OSError):
            os.unlink(server_log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--spans-per-rollout", type=int, default=8)
    parser.add_argument("--runners", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=300, help="abort the measurement after this many seconds")
    parser.add_argument("--path", choices=["auto", "otlp", "add_span"], default="auto")
    parser.add_argument("--role", choices=["launcher", "driver"], default="launcher", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.rollouts, args.spans_per_rollout, args.runners) < 1:
        parser.error("--rollouts, --spans-per-rollout and --runners must be positive")
    if args.role == "driver":
        return driver(args)
    try:
        result = run_peer(args.rollouts, args.spans_per_rollout, args.runners, args.timeout, args.path)
    except RuntimeError as error:
        log(str(error))
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
