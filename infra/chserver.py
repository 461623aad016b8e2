"""The embedded ClickHouse: the chdb engine behind ClickHouse's HTTP interface.

Any ClickHouse HTTP client (clickhouse-connect, curl, a BI tool) talks to it as it would to
a ClickHouse server: ``POST /`` or ``GET /?query=...`` with ``database``, ``default_format``,
``param_<name>`` bind parameters and ClickHouse settings as URL parameters, data for
``INSERT ... FORMAT <fmt>`` in the body (gzip, deflate, lz4 or zstd Content-Encoding), errors
as ClickHouse formats them, with ``X-ClickHouse-Exception-Code``. GET requests and
``readonly=1|2`` run on a read-only connection, as on a real server.

One process owns the data directory (chdb locks it), so every component reaches the data
through this server. Queries run one at a time on a dedicated thread; chdb is not
documented as safe for concurrent use of one connection.

Run it with ``python -m infra.chserver --port 8123 --data-dir PATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import logging
import re
import signal
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import chdb
from aiohttp import web
from multidict import MultiDict

log = logging.getLogger("agentstream.chserver")

# URL parameters that steer the HTTP exchange rather than being ClickHouse settings.
TRANSPORT_PARAMS = frozenset(
    {
        "query", "database", "default_format", "session_id", "session_timeout", "session_check",
        "query_id", "user", "password", "compress", "decompress", "enable_http_compression",
        "send_progress_in_http_headers", "http_headers_progress_interval_ms", "wait_end_of_query",
        "cancel_http_readonly_queries_on_client_close", "client_protocol_version", "buffer_size",
        "http_response_buffer_size", "readonly", "quota_key", "role",
    }
)

INSERT_WITH_FORMAT = re.compile(
    rb"^\s*INSERT\s+INTO\s+(?P<target>.+?)\s+FORMAT\s+(?P<format>[A-Za-z0-9_]+)[ \t]*\r?\n?",
    re.IGNORECASE | re.DOTALL,
)
EXCEPTION_CODE = re.compile(r"Code:\s*(\d+)")
FORMAT_CLAUSE = re.compile(r"\bFORMAT\s+([A-Za-z0-9_]+)\s*;?\s*$", re.IGNORECASE)

# ClickHouse answers some error codes with a specific HTTP status; the rest get 500.
HTTP_STATUS_BY_CODE = {
    62: 400,  # SYNTAX_ERROR
    60: 404,  # UNKNOWN_TABLE
    81: 404,  # UNKNOWN_DATABASE
    47: 404,  # UNKNOWN_IDENTIFIER
    164: 403,  # READONLY
    516: 401,  # AUTHENTICATION_FAILED
}


class RequestError(Exception):
    """A request the server cannot run; carries the ClickHouse error code and HTTP status."""

    def __init__(self, message: str, code: int, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


@dataclass
class Outcome:
    """What one statement produced: the response body and its statistics."""

    body: bytes
    output_format: str
    read_rows: int = 0
    read_bytes: int = 0
    written_rows: int = 0
    written_bytes: int = 0
    elapsed_s: float = 0.0


class Engine:
    """The chdb connections (read-write and read-only) and the single thread that uses them."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chdb")
        self._writer = chdb.connect(str(data_dir))
        self._reader = chdb.connect(str(data_dir))
        self._reader.query("SET readonly = 2")
        self._defaults = self._setting_defaults()
        self._current_db = {id(self._writer): "default", id(self._reader): "default"}
        self.version = self._writer.query("SELECT version()", "TabSeparated").bytes().decode().strip()

    def _setting_defaults(self) -> dict[str, str]:
        rows = self._writer.query("SELECT name, value FROM system.settings", "JSONCompactEachRow").bytes()
        return dict(json.loads(line) for line in rows.splitlines() if line)

    async def run(self, statement: bytes, data: bytes | None, *, database: str, output_format: str,
                  params: dict[str, str], settings: dict[str, str], readonly: bool) -> Outcome:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, self._run, statement, data, database, output_format, params, settings, readonly
        )

    def _run(self, statement: bytes, data: bytes | None, database: str, output_format: str,
             params: dict[str, str], settings: dict[str, str], readonly: bool) -> Outcome:
        conn = self._reader if readonly else self._writer
        try:
            self._use(conn, database)
            for name, value in settings.items():
                conn.query(f"SET {_identifier(name)} = {_literal(value)}")
            try:
                if data is not None:
                    return self._insert(conn, statement, data)
                return self._query(conn, statement.decode("utf-8"), output_format, params)
            finally:
                for name in settings:
                    if name in self._defaults:
                        conn.query(f"SET {_identifier(name)} = {_literal(self._defaults[name])}")
        except RequestError:
            raise
        except Exception as error:  # chdb raises ChdbError/RuntimeError with ClickHouse's text
            raise _as_request_error(error) from None

    def _use(self, conn, database: str) -> None:
        if self._current_db[id(conn)] != database:
            conn.query(f"USE {_identifier(database)}")
            self._current_db[id(conn)] = database

    @staticmethod
    def _query(conn, sql: str, output_format: str, params: dict[str, str]) -> Outcome:
        sql = sql.strip().rstrip(";")
        match = FORMAT_CLAUSE.search(sql)
        if match:
            output_format = match.group(1)
        result = conn.query(sql, output_format, params=params or None)
        return Outcome(
            body=result.bytes() or b"",
            output_format=output_format,
            read_rows=result.rows_read(),
            read_bytes=result.bytes_read(),
            elapsed_s=result.elapsed(),
        )

    @staticmethod
    def _insert(conn, head: bytes, data: bytes) -> Outcome:
        match = INSERT_WITH_FORMAT.match(head)
        if match is None:
            raise RequestError("Code: 62. DB::Exception: expected INSERT INTO ... FORMAT <format> before the data. "
                               "(SYNTAX_ERROR)", 62)
        target = match.group("target").decode("utf-8")
        fmt = match.group("format").decode("ascii")
        with conn.send_insert(f"INSERT INTO {target}", fmt) as inserter:
            if data:
                inserter.append(data)
            summary = inserter.finish()
        return Outcome(b"", fmt, written_rows=summary.rows_written, written_bytes=summary.bytes_written,
                       elapsed_s=summary.elapsed)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._reader.close()
        self._writer.close()


def _identifier(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise RequestError(f"Code: 115. DB::Exception: Unknown setting or bad name {name!r}. (UNKNOWN_SETTING)", 115)
    return name


def _literal(value: str) -> str:
    if re.fullmatch(r"-?\d+(\.\d+)?", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _as_request_error(error: Exception) -> RequestError:
    text = str(error).strip() or type(error).__name__
    match = EXCEPTION_CODE.search(text)
    code = int(match.group(1)) if match else 1002
    if not match:
        text = f"Code: {code}. DB::Exception: {text}. (UNKNOWN_EXCEPTION)"
    return RequestError(text, code, HTTP_STATUS_BY_CODE.get(code, 500))


def _decode_body(body: bytes, encoding: str | None) -> bytes:
    encoding = (encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return body
    try:
        return _decompress(body, encoding)
    except RequestError:
        raise
    except Exception as error:
        raise RequestError(f"Code: 271. DB::Exception: cannot decompress {encoding} request body: {error}. "
                           "(CANNOT_DECOMPRESS)", 271) from None


def _decompress(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    if encoding == "lz4":
        return _decompress_lz4_frames(body)
    if encoding == "zstd":
        import io

        import zstandard

        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True) as reader:
            return reader.read()
    raise RequestError(f"Code: 1. DB::Exception: Unsupported Content-Encoding {encoding!r}. (UNSUPPORTED_METHOD)", 1)


def _decompress_lz4_frames(body: bytes) -> bytes:
    """Decompress every LZ4 frame in the body: streaming clients send one frame per block."""
    import lz4.frame

    chunks = []
    while body:
        decompressor = lz4.frame.LZ4FrameDecompressor()
        chunks.append(decompressor.decompress(body))
        if not decompressor.eof:
            raise RequestError("Code: 1. DB::Exception: truncated LZ4 frame in request body. (CANNOT_DECOMPRESS)", 271)
        body = decompressor.unused_data
    return b"".join(chunks)


def _split_statement(query_param: str | None, body: bytes) -> tuple[bytes, bytes | None]:
    """Return (statement, insert data or None) the way ClickHouse joins the URL query and body."""
    if query_param is not None:
        head = query_param.encode("utf-8")
        if INSERT_WITH_FORMAT.match(head + b"\n"):
            return head, body
        return (head + b" " + body) if body.strip() else head, None
    match = INSERT_WITH_FORMAT.match(body)
    if match:
        return body[: match.end()], body[match.end():]
    return body, None


async def _form_fields(request: web.Request) -> tuple[MultiDict, bytes]:
    """A multipart form (clients send long bind parameters that way): its fields join the URL parameters.

    The query comes in the ``query`` field; a file part would be external data, which the
    embedded server does not support.
    """
    params = MultiDict(request.query)
    reader = await request.multipart()
    async for part in reader:
        if part.filename:  # type: ignore[union-attr]  # aiohttp's stub: parts of a flat form are BodyPartReaders
            raise RequestError("Code: 48. DB::Exception: external data (file parts) is not supported by the embedded "
                               "server. (NOT_IMPLEMENTED)", 48, 501)
        value = (await part.read(decode=False)).decode("utf-8")  # type: ignore[union-attr]  # as above
        params[part.name] = value  # type: ignore[union-attr,index]  # as above; a form field has a name
    return params, b""


class Server:
    """The aiohttp application that speaks ClickHouse HTTP in front of an :class:`Engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # We decode Content-Encoding ourselves: aiohttp knows gzip but not lz4, which clients send.
        self.app = web.Application(client_max_size=1 << 30, handler_args={
            "auto_decompress": False, "max_line_size": 1 << 20, "max_field_size": 1 << 20})
        self.app.router.add_get("/ping", self.ping)
        self.app.router.add_get("/", self.handle)
        self.app.router.add_post("/", self.handle)

    async def ping(self, request: web.Request) -> web.Response:
        return web.Response(text="Ok.\n")

    async def handle(self, request: web.Request) -> web.Response:
        query_id = request.query.get("query_id") or str(uuid.uuid4())
        headers = {
            "X-ClickHouse-Query-Id": query_id,
            "X-ClickHouse-Server-Display-Name": "agentstream-chdb",
            "X-ClickHouse-Timezone": "UTC",
        }
        try:
            outcome = await self._execute(request)
        except RequestError as error:
            headers["X-ClickHouse-Exception-Code"] = str(error.code)
            body = f"{error} (version {self.engine.version} (chdb))\n"
            return web.Response(status=error.status, text=body, headers=headers)
        headers["X-ClickHouse-Format"] = outcome.output_format
        headers["X-ClickHouse-Summary"] = json.dumps(
            {
                "read_rows": str(outcome.read_rows), "read_bytes": str(outcome.read_bytes),
                "written_rows": str(outcome.written_rows), "written_bytes": str(outcome.written_bytes),
                "total_rows_to_read": str(outcome.read_rows), "result_rows": "0", "result_bytes": "0",
                "elapsed_ns": str(int(outcome.elapsed_s * 1e9)),
            }
        )
        return web.Response(body=outcome.body, headers=headers, content_type="text/plain", charset="utf-8")

    async def _execute(self, request: web.Request) -> Outcome:
        params = request.query
        if request.content_type.startswith("multipart/"):
            params, body = await _form_fields(request)
        else:
            body = _decode_body(await request.read(), request.headers.get("Content-Encoding"))
        statement, data = _split_statement(params.get("query"), body)
        if not statement.strip():
            raise RequestError("Code: 62. DB::Exception: Empty query. (SYNTAX_ERROR)", 62)
        readonly = request.method == "GET" or params.get("readonly", "0") not in ("0", "")
        if readonly and data is not None:
            raise RequestError("Code: 164. DB::Exception: Cannot execute query in readonly mode. (READONLY)", 164, 403)
        return await self.engine.run(
            statement,
            data,
            database=params.get("database", "default"),
            output_format=params.get("default_format", "TabSeparated"),
            params={key[6:]: value for key, value in params.items() if key.startswith("param_")},
            settings={key: value for key, value in params.items()
                      if key not in TRANSPORT_PARAMS and not key.startswith("param_")},
            readonly=readonly,
        )


async def serve(host: str, port: int, data_dir: Path) -> None:
    """Serve until SIGTERM or SIGINT, then close the engine cleanly so the data is flushed."""
    engine = Engine(data_dir)
    runner = web.AppRunner(Server(engine).app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    log.info("ClickHouse HTTP (chdb %s) on http://%s:%d, data in %s", engine.version, host, port, data_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    engine.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve the chdb ClickHouse engine over ClickHouse's HTTP interface.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--data-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvloop

    uvloop.run(serve(args.host, args.port, args.data_dir.resolve()))


if __name__ == "__main__":
    main()
