"""The embedded ClickHouse: the chdb engine behind ClickHouse's HTTP interface.

Any ClickHouse HTTP client (clickhouse-connect, curl, a BI tool) talks to it as it would to
a ClickHouse server: ``POST /`` or ``GET /?query=...`` with ``database``, ``default_format``,
``param_<name>`` bind parameters and ClickHouse settings as URL parameters, data for
``INSERT ... FORMAT <fmt>`` in the body (gzip, deflate, lz4 or zstd Content-Encoding), errors
as ClickHouse formats them, with ``X-ClickHouse-Exception-Code``. GET requests and
``readonly=1|2`` run on a read-only connection, as on a real server.

Callers are checked first (:mod:`agentstream.stack.chaccess`): a web page from another site is refused, and
with ``[clickhouse] password`` set only the writer and the ``[security] clickhouse_readers`` get
in, readers on sessions held at ``readonly = 1``.

One process owns the data directory (chdb locks it), so every component reaches the data
through this server. Statements run in parallel on pooled chdb sessions (chdb runs statements of
different connections concurrently and releases the GIL), so a long dashboard read never holds
the workers' inserts; each session serves one statement at a time.

Run it with ``python -m agentstream.stack.chserver --port 8123 --data-dir PATH [--config FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import logging
import re
import shutil
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import chdb
from aiohttp import web
from multidict import MultiDict

from agentstream.infra.config import ConfigError, load_config
from agentstream.infra.security import KeySet, check_bind, is_loopback
from agentstream.schemas.errors import AgentstreamError
from agentstream.stack.chaccess import Access, Users, cross_site, presented
from agentstream.stack.signals import stop_on_signals

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

# The readonly levels the pools run at: the writer's own, the writer's read-only requests, a reader's.
WRITABLE, READ_ONLY, READER = 0, 2, 1
# Functions that read the machine's files: chdb runs as clickhouse-local, where ``file()`` reads any path (a server
# confines it to user_files_path), and ``readonly = 1`` refuses the table function but not the scalar one.
LOCAL_FILE_CALL = re.compile(r"\b(?:file|filecluster)\s*\(", re.IGNORECASE)
STRING_LITERAL = re.compile(r"'(?:[^'\\]|\\.)*'")
SESSIONS_PER_POOL = 4
SPOOL_DIR = "insert-spool"  # in the data directory: each insert's body, for the statement's lifetime

# ClickHouse answers some error codes with a specific HTTP status; the rest get 500.
HTTP_STATUS_BY_CODE = {
    62: 400,  # SYNTAX_ERROR
    60: 404,  # UNKNOWN_TABLE
    81: 404,  # UNKNOWN_DATABASE
    47: 404,  # UNKNOWN_IDENTIFIER
    164: 403,  # READONLY
    516: 401,  # AUTHENTICATION_FAILED
    497: 403,  # ACCESS_DENIED
}


class RequestError(AgentstreamError):
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


class _Session:
    """One chdb connection at one readonly level and the database it was left in; one thread uses it at a time."""

    def __init__(self, data_dir: Path, readonly: int) -> None:
        self.conn = chdb.connect(str(data_dir))
        self.readonly = readonly
        if readonly:
            self.conn.query(f"SET readonly = {readonly}")
        self.database = "default"

    def use(self, database: str) -> None:
        if self.database != database:
            self.conn.query(f"USE {_identifier(database)}")
            self.database = database


class _Pool:
    """``size`` sessions at one readonly level, each statement on a thread of its own, waiting for a free session.

    chdb runs statements on different connections to one path in parallel (and releases the GIL),
    so a long read on one session holds none of the others.
    """

    def __init__(self, data_dir: Path, readonly: int, size: int) -> None:
        self.sessions = tuple(_Session(data_dir, readonly) for _ in range(size))
        self._idle = list(self.sessions)
        self._free = asyncio.Semaphore(size)
        self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix=f"chdb-readonly{readonly}")

    async def run(self, work: Callable[[_Session], Outcome]) -> Outcome:
        async with self._free:
            session = self._idle.pop()
            try:
                return await asyncio.get_running_loop().run_in_executor(self._executor, work, session)
            finally:
                self._idle.append(session)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        for session in self.sessions:
            session.conn.close()


class Engine:
    """The chdb sessions, pooled by what they may do: the writer's, its read-only ones (readonly=2) and readers'.

    A reader's statements run at ``readonly = 1``, set on the session, which no request can lower:
    ClickHouse refuses ``SET readonly`` and ``SETTINGS readonly`` there, and at that level also
    table functions (``file``, ``url``), which ``readonly = 2`` still runs.
    """

    def __init__(self, data_dir: Path, sessions: int = SESSIONS_PER_POOL) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.spool = data_dir / SPOOL_DIR  # on the data's disk: when it is full, inserts fail before they start
        shutil.rmtree(self.spool, ignore_errors=True)  # what a killed server left
        self.spool.mkdir()
        self._pools = {level: _Pool(data_dir, level, sessions) for level in (WRITABLE, READ_ONLY, READER)}
        probe = self._pools[WRITABLE].sessions[0].conn
        self._defaults = self._setting_defaults(probe)
        self.version = probe.query("SELECT version()", "TabSeparated").bytes().decode().strip()

    @staticmethod
    def _setting_defaults(conn) -> dict[str, str]:
        rows = conn.query("SELECT name, value FROM system.settings", "JSONCompactEachRow").bytes()
        return dict(json.loads(line) for line in rows.splitlines() if line)

    async def run(self, statement: bytes, data: bytes | None, *, database: str, output_format: str,
                  params: dict[str, str], settings: dict[str, str], readonly: int) -> Outcome:
        """Run one statement on a free session of the ``readonly`` level (0, 2 for the writer; 1 for readers)."""
        return await self._pools[readonly].run(
            lambda session: self._run(session, statement, data, database, output_format, params, settings))

    def _run(self, session: _Session, statement: bytes, data: bytes | None, database: str, output_format: str,
             params: dict[str, str], settings: dict[str, str]) -> Outcome:
        conn = session.conn
        applied: list[str] = []
        try:
            session.use(database)
            try:
                for name, value in settings.items():
                    conn.query(f"SET {_identifier(name)} = {_literal(value)}")
                    applied.append(name)
                if data is not None:
                    return self._insert(conn, statement, data)
                if session.readonly == READER:
                    self._check_reader_query(conn, statement.decode("utf-8"))
                return self._query(conn, statement.decode("utf-8"), output_format, params)
            finally:  # the session serves other callers next: what this request set goes back
                for name in applied:
                    if name in self._defaults:
                        conn.query(f"SET {_identifier(name)} = {_literal(self._defaults[name])}")
        except RequestError:
            raise
        except Exception as error:  # chdb raises ChdbError/RuntimeError with ClickHouse's text
            raise _as_request_error(error) from None

    @staticmethod
    def _check_reader_query(conn, sql: str) -> None:
        """Refuse a reader's statement that is several statements (chdb would run them all) or that calls a function
        reading the machine's files (a config file holding keys, say).

        ClickHouse's own parser (``formatQuery``) refuses several statements and writes the one back
        in a normal form: every quoting of a function name undone, comments dropped, strings as
        '...' literals, which are cut out before the function names are looked for.
        """
        normal = conn.query(f"SELECT formatQuerySingleLine({_quoted(sql)})", "TabSeparatedRaw").bytes().decode()
        code = STRING_LITERAL.sub("''", normal)
        if LOCAL_FILE_CALL.search(code):
            raise RequestError("Code: 497. DB::Exception: a reader may not call file(): it reads the machine's files, "
                               "not tables. (ACCESS_DENIED)", 497, 403)

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

    def _insert(self, conn, head: bytes, data: bytes) -> Outcome:
        """Insert the body from a spool file: chdb's streaming insert (``send_insert``) reports success for data it
        could not write (a full disk: rows_written 1, no error, no row), where ``INSERT ... FROM INFILE`` raises
        ClickHouse's error (243 NOT_ENOUGH_SPACE), so the caller keeps its data and retries."""
        match = INSERT_WITH_FORMAT.match(head)
        if match is None:
            raise RequestError("Code: 62. DB::Exception: expected INSERT INTO ... FORMAT <format> before the data. "
                               "(SYNTAX_ERROR)", 62)
        target = match.group("target").decode("utf-8")
        fmt = match.group("format").decode("ascii")
        spooled = self.spool / f"{uuid.uuid4().hex}.data"
        try:
            try:
                spooled.write_bytes(data)
            except OSError as error:
                raise RequestError(f"Code: 243. DB::Exception: cannot spool the insert's {len(data)} bytes to "
                                   f"{self.spool}: {error}. (NOT_ENOUGH_SPACE)", 243, 500) from None
            result = conn.query(f"INSERT INTO {target} FROM INFILE {_quoted(str(spooled))} COMPRESSION 'none' "
                                f"FORMAT {fmt}")
        finally:
            spooled.unlink(missing_ok=True)
        return Outcome(b"", fmt, written_rows=result.rows_written(), written_bytes=result.bytes_written(),
                       elapsed_s=result.elapsed())

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


def _identifier(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise RequestError(f"Code: 115. DB::Exception: Unknown setting or bad name {name!r}. (UNKNOWN_SETTING)", 115)
    return name


def _literal(value: str) -> str:
    if re.fullmatch(r"-?\d+(\.\d+)?", value):
        return value
    return _quoted(value)


def _quoted(value: str) -> str:
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
    """The aiohttp application that speaks ClickHouse HTTP in front of an :class:`Engine`, for its :class:`Users`."""

    def __init__(self, engine: Engine, users: Users | None = None, *, on_loopback: bool = True) -> None:
        self.engine = engine
        self.users = users or Users()
        # An open front on loopback takes only loopback names in Host (DNS rebinding); one that
        # allow_open_bind put on the network is reached by other names on purpose.
        self._loopback_names = self.users.open and on_loopback
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
            outcome = await self._execute(request, self._admit(request))
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

    def _admit(self, request: web.Request) -> Access:
        """What the request may do; a web page from elsewhere and wrong credentials are refused before any SQL."""
        reason = cross_site(request.headers, request.scheme, loopback_names=self._loopback_names)
        if reason is not None:
            raise RequestError(f"Code: 497. DB::Exception: refused a request from a web page ({reason}): browsers "
                               "may not send SQL to the embedded ClickHouse. (ACCESS_DENIED)", 497, 403)
        credentials = presented(request.headers, request.query)
        access = self.users.access(credentials)
        if access is None:
            raise RequestError(f"Code: 516. DB::Exception: {credentials.user}: Authentication failed: password is "
                               "incorrect, or there is no user with such name. (AUTHENTICATION_FAILED)", 516, 401)
        return access

    async def _execute(self, request: web.Request, access: Access) -> Outcome:
        params = request.query
        if request.content_type.startswith("multipart/"):
            params, body = await _form_fields(request)
        else:
            body = _decode_body(await request.read(), request.headers.get("Content-Encoding"))
        statement, data = _split_statement(params.get("query"), body)
        if not statement.strip():
            raise RequestError("Code: 62. DB::Exception: Empty query. (SYNTAX_ERROR)", 62)
        if access is Access.READ:
            readonly = READER
        elif request.method == "GET" or params.get("readonly", "0") not in ("0", ""):
            readonly = READ_ONLY
        else:
            readonly = WRITABLE
        if readonly != WRITABLE and data is not None:
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


async def serve(host: str, port: int, data_dir: Path, users: Users | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then close the engine cleanly so the data is flushed."""
    engine = Engine(data_dir)
    server = Server(engine, users, on_loopback=is_loopback(host))
    runner = web.AppRunner(server.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    log.info("ClickHouse HTTP (chdb %s) on http://%s:%d, data in %s, %s", engine.version, host, port, data_dir,
             "open (no password)" if server.users.open else f"{len(server.users.readers)} read-only users and the "
             f"writer {server.users.writer!r}")
    await stop_on_signals().wait()
    await runner.cleanup()
    engine.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve the chdb ClickHouse engine over ClickHouse's HTTP interface.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=None,
                        help="TOML config whose [clickhouse] username/password and [security] clickhouse_readers "
                             "are the users (without it the server is open, and listens on loopback only)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = load_config(args.config)
        users = Users.from_config(config)
        check_bind("embedded ClickHouse", args.host, KeySet(users.writer_password), "[clickhouse] password",
                   config.security)
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from None
    import uvloop

    uvloop.run(serve(args.host, args.port, args.data_dir.resolve(), users))


if __name__ == "__main__":
    main()
