"""`agentstream dataset export`: rollouts from ClickHouse as a dataset file (schemas/dataset.py), streamed page by page.

The selection is a WHERE over ``rollouts FINAL`` (the command's filters as query parameters, plus
an optional user clause). It is read in pages of rollout ids (keyset pagination on
``rollout_id``), and for each page the rollouts' LLM spans and training samples are fetched and
written: one Parquet row group or a run of JSON lines per page, so memory holds one page, never
the selection. The file is written as ``OUT.<random>.partial`` and renamed at the end, so an export
that dies leaves no file that looks complete.

The user's WHERE clause is SQL, run read-only: the client connects with ``readonly=1`` (no
writes, no DDL, no setting changes); the clause must be one expression (its parentheses balance
and never close the query's own, no ``;``) that ClickHouse's parser accepts and that calls no
table function (``url``, ``file``, ``remote``...: a real server refuses them at ``readonly=1``, the
embedded stack's front runs a default user's read-only queries at ``readonly=2``, which does not).
A refusal is a :class:`WhereClauseError` naming the clause, before any file is written.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

import pyarrow.parquet as pq
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import OperationalError

from agentstream.infra.clickhouse import ROLLOUT_POLICY_VERSION, ClickHouseError, ClickHouseUnreachable, server_message
from agentstream.report import parse_duration
from agentstream.schemas.dataset import (
    ARROW_SCHEMA,
    Call,
    DatasetError,
    DatasetRow,
    Message,
    Sample,
    arrow_table,
    format_of,
    json_line,
)

DEFAULT_BATCH_ROLLOUTS = 500
PROGRESS_EVERY_S = 2.0


class WhereClauseError(DatasetError, ValueError):
    """A ``--where`` clause that is not one SQL expression over ``rollouts``, or that ClickHouse refused."""


@dataclass(frozen=True)
class ExportFilters:
    """Which rollouts to export; an unset field filters nothing. Times bound ``start_time`` (since <= t < until)."""

    where: str = ""
    agents: tuple[str, ...] = ()
    min_reward: float | None = None
    max_reward: float | None = None
    since: datetime | None = None
    until: datetime | None = None
    min_version: int | None = None
    max_version: int | None = None
    limit: int | None = None

    def parameters(self) -> dict[str, Any]:
        """The query parameters of :data:`SELECTION_FILTERS`."""
        return {"agents": list(self.agents), "min_reward": self.min_reward, "max_reward": self.max_reward,
                "since": _naive_utc(self.since), "until": _naive_utc(self.until),
                "min_version": self.min_version, "max_version": self.max_version}


# A rollout's version is the one `agentstream report` counts it under: the newest that generated any of its calls.
SELECTION_FILTERS = f"""
    (empty({{agents:Array(String)}}) OR has({{agents:Array(String)}}, agent_name))
    AND ({{min_reward:Nullable(Float64)}} IS NULL OR final_reward >= {{min_reward:Nullable(Float64)}})
    AND ({{max_reward:Nullable(Float64)}} IS NULL OR final_reward <= {{max_reward:Nullable(Float64)}})
    AND ({{since:Nullable(DateTime64(6, 'UTC'))}} IS NULL OR start_time >= {{since:Nullable(DateTime64(6, 'UTC'))}})
    AND ({{until:Nullable(DateTime64(6, 'UTC'))}} IS NULL OR start_time < {{until:Nullable(DateTime64(6, 'UTC'))}})
    AND ({{min_version:Nullable(Int64)}} IS NULL OR {ROLLOUT_POLICY_VERSION} >= {{min_version:Nullable(Int64)}})
    AND ({{max_version:Nullable(Int64)}} IS NULL OR {ROLLOUT_POLICY_VERSION} <= {{max_version:Nullable(Int64)}})"""

ROLLOUT_COLUMNS = ("rollout_id", "agent_name", "task_id", "group_id", "model", "status", "start_time", "end_time",
                   "final_reward", "total_reward", "policy_versions")

PAGE_SQL = """
SELECT {columns}
FROM rollouts FINAL
WHERE rollout_id > {{after:String}} AND {filters}
    AND (
{where}
    )
ORDER BY rollout_id
LIMIT {{page:UInt32}}
"""

CALLS_SQL = """
SELECT rollout_id, span_id, policy_version, prompt_token_ids, response_token_ids, response_logprobs
FROM spans FINAL
WHERE kind = 'LLM' AND rollout_id IN {ids:Array(String)}
ORDER BY rollout_id, start_time, span_id
"""

# The conversation is the last LLM call's (it holds every earlier turn): only its messages are fetched.
MESSAGES_SQL = """
SELECT rollout_id,
       argMax(attributes['gen_ai.input.messages'], (start_time, span_id)) AS input_messages,
       argMax(attributes['gen_ai.output.messages'], (start_time, span_id)) AS output_messages
FROM spans FINAL
WHERE kind = 'LLM' AND rollout_id IN {ids:Array(String)}
GROUP BY rollout_id
"""

SAMPLES_SQL = """
SELECT rollout_id, transition_id, policy_version, prompt_token_ids, response_token_ids, loss_mask, reward, advantage,
       merged_calls
FROM transitions FINAL
WHERE rollout_id IN {ids:Array(String)}
ORDER BY rollout_id, step_index, transition_id
"""

# Scalar functions that read the server's files: ClickHouse runs them even at readonly=1 (the embedded engine
# reads any path with `file`), so the table-function check alone would let a clause read, say, /etc/passwd.
FILE_READERS = frozenset({"file"})

_WHERE_TOKENS = re.compile(r"""'(?:[^'\\]|\\.|'')*'|"(?:[^"\\]|\\.|"")*"|`(?:[^`\\]|\\.|``)*`|--[^\n]*|#[^\n]*"""
                           r"""|/\*(?:.*?\*/|.*)|[();]|[^'"`()#;/-]+|.""", re.DOTALL)


def check_where(clause: str) -> str:
    """``clause`` when it is one expression that cannot reach outside the query's WHERE, else WhereClauseError.

    Outside string literals and quoted names, its parentheses must balance without ever closing
    more than it opened (so it cannot end the query's own parenthesis and append a UNION, a
    FORMAT or a SETTINGS), and it may hold no ``;`` (one statement only). Whether it is valid
    SQL is ClickHouse's to say when it runs.
    """
    text = clause.strip()
    if not text:
        raise WhereClauseError("--where is empty: give an expression over rollouts' columns, "
                               "e.g. \"status = 'SUCCEEDED'\"")
    depth = 0
    for token in _WHERE_TOKENS.findall(text):
        if token.startswith(("'", '"', "`")) and (len(token) < 2 or token[-1] != token[0]):
            raise WhereClauseError(f"--where {clause!r}: a quote is not closed")
        if token.startswith("/*") and not token.endswith("*/"):
            raise WhereClauseError(f"--where {clause!r}: a comment is not closed")
        if token == ";":
            raise WhereClauseError(f"--where {clause!r}: ';' is refused: the clause is one expression over rollouts, "
                                   f"not statements")
        depth += {"(": 1, ")": -1}.get(token, 0)
        if depth < 0:
            raise WhereClauseError(f"--where {clause!r}: a ')' closes a parenthesis the clause did not open")
    if depth:
        raise WhereClauseError(f"--where {clause!r}: {depth} parenthesis(es) not closed")
    return text


def screen_where(client: Client, clause: str) -> str:
    """``clause`` checked by :func:`check_where` and by ClickHouse's parser (``EXPLAIN AST``, nothing runs).

    The parse must succeed (a syntax error names the clause) and call no table function: a
    ``TableExpression`` node whose table is a ``Function`` (``url``, ``file``, ``s3``...) reads
    outside the product's tables, so it is refused, and so is the scalar ``file(path)``
    (:data:`FILE_READERS`).
    """
    text = check_where(clause)
    try:
        result = client.query(f"EXPLAIN AST SELECT 1 FROM rollouts WHERE (\n{text}\n)")
    except Exception as error:  # clickhouse-connect raises several types; the server's text says why
        raise WhereClauseError(f"--where {clause!r}: ClickHouse refused the clause: "
                               f"{_short(server_message(error))}") from None
    lines = [str(row[0]).strip() for row in result.result_rows]
    functions = sorted({following.split()[1] for line, following in itertools.pairwise(lines)
                        if line.startswith("TableExpression") and following.startswith("Function ")})
    if functions:
        raise WhereClauseError(f"--where {clause!r}: table functions ({', '.join(functions)}) are refused: the "
                               f"clause may read the product's tables only")
    readers = sorted({line.split()[1].lower() for line in lines
                      if line.startswith("Function ") and line.split()[1].lower() in FILE_READERS})
    if readers:
        raise WhereClauseError(f"--where {clause!r}: functions that read files ({', '.join(readers)}) are refused: "
                               f"the clause may read the product's tables only")
    return text


@dataclass(frozen=True)
class RolloutHead:
    """A selected rollout's own columns, as the page query returns them (:data:`ROLLOUT_COLUMNS`)."""

    values: tuple[Any, ...]

    @property
    def rollout_id(self) -> str:
        return str(self.values[0])


FetchPage = Callable[[str, int], list[RolloutHead]]
"""Given the last rollout id of the previous page ('' at first) and a size: the next page, ordered by rollout id."""


def pages(fetch: FetchPage, batch_rollouts: int, limit: int | None = None) -> Iterator[list[RolloutHead]]:
    """The selection page by page (keyset pagination): each page is fetched only when the previous one is done.

    At most ``batch_rollouts`` rollouts are held at a time, however large the selection; ``limit``
    caps the total. A short page is the last.
    """
    if batch_rollouts < 1:
        raise ValueError(f"batch_rollouts must be at least 1, got {batch_rollouts}")
    after, left = "", limit
    while left is None or left > 0:
        size = batch_rollouts if left is None else min(batch_rollouts, left)
        page = fetch(after, size)
        if page:
            yield page
            after = page[-1].rollout_id
            if left is not None:
                left -= len(page)
        if len(page) < size:
            return


@dataclass
class ExportResult:
    """What an export wrote: rollouts, LLM calls and samples, the file, and how long it took."""

    path: Path
    format: str
    rollouts: int = 0
    calls: int = 0
    samples: int = 0
    seconds: float = 0.0
    pages: int = 0


class DatasetWriter:
    """A dataset file written as ``OUT.<random>.partial`` page by page, renamed to ``OUT`` by :meth:`commit` only.

    The random part keeps two exports to one ``OUT`` (a retry while the first still runs) from
    writing into one file: each renames its own, whole, and the last rename wins.
    """

    def __init__(self, path: Path, format: str) -> None:
        self.path, self.format = path, format
        self.partial = path.with_name(f"{path.name}.{secrets.token_hex(4)}.partial")
        self._text: IO[str] | None = None
        self._parquet: pq.ParquetWriter | None = None
        try:
            if format == "parquet":
                self._parquet = pq.ParquetWriter(self.partial, ARROW_SCHEMA, compression="zstd")
            else:
                self._text = _text_file(self.partial, compressed=path.name.lower().endswith(".gz"))
        except OSError as error:
            raise DatasetError(f"cannot write {self.partial}: {error.strerror or error}") from None

    def write(self, rows: Sequence[DatasetRow]) -> None:
        """One page: a Parquet row group, or one JSON line per row."""
        if self._parquet is not None:
            if rows:
                self._parquet.write_table(arrow_table(rows))
        elif self._text is not None:
            self._text.writelines(json_line(row) for row in rows)

    def commit(self) -> None:
        """Close the file and give it its name (an atomic rename: readers see no file or the whole one)."""
        self._close()
        os.replace(self.partial, self.path)

    def discard(self) -> None:
        """Close and remove the partial file (the export failed)."""
        self._close()
        self.partial.unlink(missing_ok=True)

    def _close(self) -> None:
        if self._parquet is not None:
            self._parquet.close()
            self._parquet = None
        if self._text is not None:
            self._text.close()
            self._text = None


def _text_file(path: Path, *, compressed: bool) -> IO[str]:
    """A new UTF-8 text file (gzip-compressed on the fly when ``compressed``); the writer closes it."""
    if compressed:
        return gzip.open(path, "wt", encoding="utf-8")
    return open(path, "w", encoding="utf-8")


def export(client: Client, out: Path, filters: ExportFilters, *, format: str | None = None,
           batch_rollouts: int = DEFAULT_BATCH_ROLLOUTS,
           progress: Callable[[ExportResult], None] | None = None) -> ExportResult:
    """Write the rollouts ``filters`` select to ``out`` (a client connected with ``readonly=1``); see the module doc."""
    kind = format_of(out, format)
    where = screen_where(client, filters.where) if filters.where.strip() else "1"
    sql = PAGE_SQL.format(columns=", ".join(ROLLOUT_COLUMNS), filters=SELECTION_FILTERS, where=where)
    parameters = filters.parameters()

    def fetch(after: str, size: int) -> list[RolloutHead]:
        try:
            result = client.query(sql, parameters={**parameters, "after": after, "page": size})
        except Exception as error:  # clickhouse-connect raises several types; the server's text says why
            if filters.where.strip() and not isinstance(error, OperationalError):  # ClickHouse answered: it refused
                raise WhereClauseError(f"--where {filters.where!r}: ClickHouse refused the selection: "
                                       f"{_short(server_message(error))}") from None
            raise _clickhouse_error(error) from None
        return [RolloutHead(tuple(row)) for row in result.result_rows]

    result = ExportResult(out, kind)
    started = last_report = time.monotonic()
    writer = DatasetWriter(out, kind)
    try:
        for page in pages(fetch, batch_rollouts, filters.limit):
            rows = page_rows(client, page)
            writer.write(rows)
            result.pages += 1
            result.rollouts += len(rows)
            result.calls += sum(len(row["calls"]) for row in rows)
            result.samples += sum(len(row["samples"]) for row in rows)
            now = time.monotonic()
            result.seconds = now - started
            if progress is not None and now - last_report >= PROGRESS_EVERY_S:
                progress(result)
                last_report = now
        writer.commit()
    except BaseException:
        writer.discard()
        raise
    result.seconds = time.monotonic() - started
    return result


def page_rows(client: Client, page: Sequence[RolloutHead]) -> list[DatasetRow]:
    """The dataset rows of one page of rollouts: their LLM calls, last conversation and samples, three queries."""
    ids = [head.rollout_id for head in page]
    calls: dict[str, list[Call]] = {rollout_id: [] for rollout_id in ids}
    for rollout_id, span_id, version, prompt, response, logprobs in _rows(client, CALLS_SQL, ids):
        calls[rollout_id].append({"span_id": span_id, "policy_version": version, "prompt_token_ids": list(prompt),
                                  "response_token_ids": list(response), "response_logprobs": list(logprobs)})
    messages = {rollout_id: conversation(inputs, outputs)
                for rollout_id, inputs, outputs in _rows(client, MESSAGES_SQL, ids)}
    samples: dict[str, list[Sample]] = {rollout_id: [] for rollout_id in ids}
    for rollout_id, transition_id, version, prompt, response, mask, reward, advantage, merged in _rows(
            client, SAMPLES_SQL, ids):
        samples[rollout_id].append({
            "transition_id": transition_id, "policy_version": version, "prompt_token_ids": list(prompt),
            "response_token_ids": list(response), "loss_mask": [bool(flag) for flag in mask], "reward": reward,
            "advantage": advantage, "merged_calls": merged})
    rows: list[DatasetRow] = []
    for head in page:
        (rollout_id, agent, task, group, model, status, start, end, reward, total_reward, versions) = head.values
        rows.append({
            "rollout_id": rollout_id, "agent_name": agent, "task_id": task, "group_id": group, "model": model,
            "status": status, "start_time": iso_utc(start), "end_time": iso_utc(end), "reward": reward,
            "total_reward": total_reward, "policy_versions": list(versions),
            "messages": messages.get(rollout_id, []), "calls": calls[rollout_id], "samples": samples[rollout_id]})
    return rows


def _rows(client: Client, sql: str, ids: list[str]) -> list[tuple[Any, ...]]:
    try:
        return [tuple(row) for row in client.query(sql, parameters={"ids": ids}).result_rows]
    except Exception as error:  # clickhouse-connect raises several types; the server's text says why
        raise _clickhouse_error(error) from None


def _clickhouse_error(error: Exception) -> ClickHouseError:
    """A failed query as our error: retriable when ClickHouse could not be reached or the connection broke."""
    if isinstance(error, OperationalError):
        return ClickHouseUnreachable(f"ClickHouse stopped answering during the export: {server_message(error)}")
    return ClickHouseError(server_message(error))


def _short(message: str) -> str:
    """ClickHouse's message without the whole query it quotes after "In scope" (the clause is named already)."""
    return message.split(" In scope ")[0]


def conversation(input_messages: str, output_messages: str) -> list[Message]:
    """A call's input messages then its output messages (span attributes, JSON text) as dataset messages.

    An attribute that is absent or not a JSON list of messages contributes nothing (OpenTelemetry
    sources may send anything); the token ids in ``calls`` are the exact record either way.
    """
    return [message(item) for text in (input_messages, output_messages) for item in _json_list(text)]


def _json_list(text: str) -> list[Any]:
    if not text:
        return []
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return value if isinstance(value, list) else []


def message(item: Any) -> Message:
    """One chat message in the dataset's fixed struct (schemas/dataset.py: content as text, tool calls as JSON)."""
    if not isinstance(item, dict):
        return {"role": None, "content": _text(item), "name": None, "tool_call_id": None, "tool_calls": None}
    content = item.get("content")
    tool_calls = item.get("tool_calls")
    parts = item.get("parts")  # the newer GenAI convention: typed parts instead of content and tool_calls
    if content is None and isinstance(parts, list):
        calls = [part for part in parts if isinstance(part, dict) and part.get("type") == "tool_call"]
        content = [part for part in parts if not (isinstance(part, dict) and part.get("type") == "tool_call")] or None
        tool_calls = tool_calls or calls
    return {"role": _optional_text(item.get("role")), "content": _text(content),
            "name": _optional_text(item.get("name")), "tool_call_id": _optional_text(item.get("tool_call_id")),
            "tool_calls": json.dumps(tool_calls, ensure_ascii=False) if tool_calls else None}


def _text(content: Any) -> str | None:
    """Content as text: a string as it is, text parts concatenated, any other part (or value) as its JSON."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(part) for part in content)
    return json.dumps(content, ensure_ascii=False)


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type", "text") == "text":
        text = part.get("text", part.get("content"))
        if isinstance(text, str):
            return text
    return json.dumps(part, ensure_ascii=False)


def _optional_text(value: Any) -> str | None:
    return None if value is None else value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def iso_utc(value: datetime) -> str:
    """An ISO 8601 UTC timestamp with microseconds and a Z (a naive value is taken as UTC, as ClickHouse's are)."""
    if value.tzinfo is not None:
        value = value.astimezone(UTC).replace(tzinfo=None)
    return value.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str, now: datetime | None = None) -> datetime:
    """A time as ISO 8601 (no zone means UTC) or as a duration before ``now`` (``30m``, ``2d``), else ValueError."""
    cleaned = text.strip()
    try:
        seconds = parse_duration(cleaned)
    except ValueError:
        pass
    else:
        try:
            return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
        except OverflowError:
            raise ValueError(f"{text!r} reaches before year 1: give a shorter duration or a time") from None
    try:
        parsed = datetime.fromisoformat(cleaned.replace("Z", "+00:00") if cleaned.endswith("Z") else cleaned)
    except ValueError:
        raise ValueError(f"{text!r} is neither an ISO 8601 time (2026-11-27T18:00:00Z) nor a duration before now "
                         f"(30m, 2d)") from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def _naive_utc(value: datetime | None) -> str | None:
    """A time as ClickHouse's DateTime64 parameter text (UTC, microseconds)."""
    return None if value is None else iso_utc(value).replace("T", " ").rstrip("Z")


def progress_line(result: ExportResult) -> str:
    """A progress line for stderr: rollouts and rows so far, and the rate."""
    rate = result.rollouts / result.seconds if result.seconds > 0 else 0.0
    return (f"exported {result.rollouts:,} rollouts ({result.calls:,} LLM calls, {result.samples:,} samples) "
            f"in {result.seconds:.1f}s, {rate:,.0f} rollouts/s")


def summary_line(result: ExportResult) -> str:
    """The final line: how many rollouts went to which file, or that none matched."""
    if not result.rollouts:
        return f"no rollouts matched: wrote an empty {result.format} dataset to {result.path}"
    return (f"wrote {result.rollouts:,} rollouts ({result.calls:,} LLM calls, {result.samples:,} samples) to "
            f"{result.path} ({result.format}) in {result.seconds:.1f}s")
