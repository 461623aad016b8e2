"""The dataset row: one rollout as `agentstream dataset export` writes it, in JSON Lines or Parquet.

This module is the one definition of the format. The exporter writes rows with :func:`json_line`
and :func:`arrow_table`; a trainer or any tool reads them back with :func:`read_rows`, which checks
every row against the types below. Hugging Face ``datasets`` loads both files as they are
(``load_dataset("json" | "parquet", data_files=...)``).

One row per rollout (:class:`DatasetRow`):

* the rollout's identity and outcome from the ``rollouts`` table: ``rollout_id``, ``agent_name``,
  ``task_id``, ``group_id``, ``model``, ``status``; ``start_time``/``end_time`` as ISO 8601 UTC
  strings (``2026-11-27T18:45:00.123456Z``); ``reward`` (the final reward, null when none came)
  and ``total_reward``; ``policy_versions``, the versions that generated its LLM calls;
* ``messages``: the conversation as chat messages, the last LLM call's input messages followed by
  its output message (:class:`Message`);
* ``calls``: every LLM span of the rollout in start order, with its token ids and logprobs exactly
  as the ``spans`` table holds them (:class:`Call`);
* ``samples``: the rollout's training samples exactly as the ``transitions`` table holds them
  (:class:`Sample`), transition level (one per call) or trajectory level (merged calls with a loss
  mask); empty for a rollout that was not trained on.

Parquet needs one struct type per column, so a message is a fixed struct of five nullable strings:
``role``; ``content`` as text (a list of content parts becomes the concatenation of its text parts,
and a part that is not text is kept as its JSON); ``name`` and ``tool_call_id`` (set on tool
messages); ``tool_calls``, the OpenAI ``tool_calls`` list as a JSON string (null when the message
calls no tool). JSON Lines rows carry the same fields, so both formats load to the same columns.

The format version (:data:`FORMAT_VERSION`) is in the Parquet file's key-value metadata under
:data:`FORMAT_VERSION_KEY`; a reader refuses a file of a version it does not know. JSON Lines
has no header line (a header would be a row to ``datasets``); its rows are checked field by field.
Fields a row has beyond those below are ignored, so a later version may add columns.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, TypedDict, cast

import pyarrow as pa
import pyarrow.parquet as pq

from agentstream.schemas.errors import AgentstreamError

FORMAT_VERSION = 1
"""Bumped when a field changes meaning or type (adding a field is not a change for readers of this module)."""
FORMAT_VERSION_KEY = b"agentstream.dataset.format_version"
"""The Parquet key-value metadata key that holds :data:`FORMAT_VERSION`."""
FORMATS = ("jsonl", "parquet")


class DatasetError(AgentstreamError):
    """A dataset file that cannot be read or written as the format says (base of the dataset errors)."""


class MalformedDatasetRow(DatasetError, ValueError):
    """A row (JSON Lines line, or Parquet row) that is not a dataset row: bad JSON, a missing field, a wrong type.

    ``path`` is the file, ``row`` the 1-based line of a JSON Lines file or the 1-based row of a
    Parquet file, ``reason`` what is wrong (naming the field).
    """

    def __init__(self, path: str, row: int, reason: str) -> None:
        super().__init__(path, row, reason)
        self.path, self.row, self.reason = path, row, reason

    def __str__(self) -> str:
        return f"{self.path}: row {self.row}: {self.reason}"


class UnknownDatasetFormat(DatasetError, ValueError):
    """A file whose name or content is not a dataset format this version reads or writes."""


class Message(TypedDict):
    """A chat message: role, text content, and the tool fields (``tool_calls`` as a JSON string)."""

    role: str | None
    content: str | None
    name: str | None
    tool_call_id: str | None
    tool_calls: str | None


class Call(TypedDict):
    """One LLM span of the rollout: the ids and logprobs the model server returned, exactly as stored."""

    span_id: str
    policy_version: int | None
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]


class Sample(TypedDict):
    """One training sample (a ``transitions`` row); an empty ``loss_mask`` trains every response token."""

    transition_id: str
    policy_version: int
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    loss_mask: list[bool]
    reward: float
    advantage: float
    merged_calls: int


class DatasetRow(TypedDict):
    """One rollout (see the module docstring for what each field holds)."""

    rollout_id: str
    agent_name: str
    task_id: str
    group_id: str
    model: str
    status: str
    start_time: str
    end_time: str
    reward: float | None
    total_reward: float
    policy_versions: list[int]
    messages: list[Message]
    calls: list[Call]
    samples: list[Sample]


_TOKEN_IDS = pa.list_(pa.int64())
MESSAGE_TYPE = pa.struct([(name, pa.string()) for name in Message.__annotations__])
CALL_TYPE = pa.struct([
    ("span_id", pa.string()),
    ("policy_version", pa.int64()),
    ("prompt_token_ids", _TOKEN_IDS),
    ("response_token_ids", _TOKEN_IDS),
    ("response_logprobs", pa.list_(pa.float32())),
])
SAMPLE_TYPE = pa.struct([
    ("transition_id", pa.string()),
    ("policy_version", pa.int64()),
    ("prompt_token_ids", _TOKEN_IDS),
    ("response_token_ids", _TOKEN_IDS),
    ("loss_mask", pa.list_(pa.bool_())),
    ("reward", pa.float64()),
    ("advantage", pa.float64()),
    ("merged_calls", pa.int64()),
])
ARROW_SCHEMA = pa.schema(
    [(name, pa.string()) for name in
     ("rollout_id", "agent_name", "task_id", "group_id", "model", "status", "start_time", "end_time")]
    + [
        ("reward", pa.float64()),
        ("total_reward", pa.float64()),
        ("policy_versions", pa.list_(pa.int64())),
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("calls", pa.list_(CALL_TYPE)),
        ("samples", pa.list_(SAMPLE_TYPE)),
    ],
    metadata={FORMAT_VERSION_KEY: str(FORMAT_VERSION).encode()},
)
"""The Parquet schema (token ids as int64, logprobs as float32: both hold the ClickHouse values exactly)."""


def format_of(path: str | Path, given: str | None = None) -> str:
    """The format a file is in: ``given`` when set, else from the suffix (.jsonl, .jsonl.gz, .ndjson, .parquet)."""
    if given is not None:
        if given not in FORMATS:
            raise UnknownDatasetFormat(f"dataset format {given!r}: expected one of {', '.join(FORMATS)}")
        return given
    name = str(path).lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
        return "jsonl"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    raise UnknownDatasetFormat(f"{path}: cannot tell the dataset format from the name; name it .jsonl, .jsonl.gz or "
                               f".parquet, or give the format")


def json_line(row: DatasetRow) -> str:
    """The row as one JSON Lines line (with its newline); non-finite floats are refused, JSON has none."""
    try:
        return json.dumps(row, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n"
    except ValueError as error:
        raise DatasetError(f"rollout {row.get('rollout_id')!r}: {error} (a NaN or infinite number cannot be "
                           f"written as JSON)") from error


def arrow_table(rows: Iterable[DatasetRow]) -> pa.Table:
    """The rows as an Arrow table of :data:`ARROW_SCHEMA` (one Parquet row group when written at once)."""
    return pa.Table.from_pylist(list(rows), schema=ARROW_SCHEMA)


def read_rows(path: str | Path, format: str | None = None, batch_rows: int = 1024) -> Iterator[DatasetRow]:
    """The rows of a dataset file, one at a time, each checked; :class:`MalformedDatasetRow` names the first bad one.

    JSON Lines (optionally gzip-compressed, ``.gz``) is read line by line, blank lines skipped;
    Parquet by batches of ``batch_rows`` rows, so neither holds the file in memory.
    """
    if format_of(path, format) == "jsonl":
        return _jsonl_rows(str(path))
    return _parquet_rows(str(path), batch_rows)


def _jsonl_rows(path: str) -> Iterator[DatasetRow]:
    with _open_text(path) as lines:
        number = 0
        try:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except ValueError as error:
                    raise MalformedDatasetRow(path, number, f"not JSON: {error}") from error
                yield check_row(value, path, number)
        except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as error:
            raise MalformedDatasetRow(path, number + 1, f"cannot be read: {error}") from error


def _open_text(path: str) -> IO[str]:
    """The file as UTF-8 text, decompressed on the fly when its name ends in .gz."""
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _parquet_rows(path: str, batch_rows: int) -> Iterator[DatasetRow]:
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as error:
        raise UnknownDatasetFormat(f"{path}: not a Parquet file: {error}") from error
    with parquet:
        version = (parquet.schema_arrow.metadata or {}).get(FORMAT_VERSION_KEY)
        if version is not None and version != str(FORMAT_VERSION).encode():
            raise UnknownDatasetFormat(f"{path}: dataset format version {version.decode(errors='replace')}; this "
                                       f"reader knows version {FORMAT_VERSION}")
        number = 0
        for batch in parquet.iter_batches(batch_size=batch_rows):
            for value in batch.to_pylist():
                number += 1
                yield check_row(value, path, number)


def check_row(value: Any, path: str = "<row>", row: int = 1) -> DatasetRow:
    """``value`` as a :class:`DatasetRow` (only its known fields), or :class:`MalformedDatasetRow` naming the field."""
    try:
        return cast(DatasetRow, _check(value, _ROW, "row"))
    except MalformedDatasetRow as wrong:  # the checkers name the field; the file and row are known only here
        raise MalformedDatasetRow(path, row, wrong.reason) from None


def _wrong(reason: str) -> MalformedDatasetRow:
    """A field's error before its file and row are known (:func:`check_row` adds them)."""
    return MalformedDatasetRow("<row>", 0, reason)


Checker = Callable[[Any, str], Any]


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _wrong(f"{where} is {_shown(value)}, expected a string")
    return value


def _integer(value: Any, where: str) -> int:
    if type(value) is not int:
        raise _wrong(f"{where} is {_shown(value)}, expected an integer")
    return value


def _token_id(value: Any, where: str) -> int:
    if type(value) is not int or value < 0:
        raise _wrong(f"{where} is {_shown(value)}, expected a token id (an integer >= 0)")
    return value


def _number(value: Any, where: str) -> float:
    if type(value) not in (int, float):
        raise _wrong(f"{where} is {_shown(value)}, expected a number")
    return float(value)


def _finite(value: Any, where: str) -> float:
    number = _number(value, where)
    if not math.isfinite(number):
        raise _wrong(f"{where} is {number}, expected a finite number")
    return number


def _flag(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise _wrong(f"{where} is {_shown(value)}, expected true or false")
    return value


def _optional(check: Checker) -> Checker:
    return lambda value, where: None if value is None else check(value, where)


def _list(check: Checker) -> Checker:
    def checked(value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise _wrong(f"{where} is {_shown(value)}, expected a list")
        return [check(item, f"{where}[{index}]") for index, item in enumerate(value)]
    return checked


def _record(fields: Mapping[str, Checker]) -> Checker:
    return lambda value, where: _check(value, fields, where)


def _check(value: Any, fields: Mapping[str, Checker], where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _wrong(f"{where} is {_shown(value)}, expected an object")
    checked = {}
    for name, check in fields.items():
        if name not in value:
            raise _wrong(f"{where} has no field {name!r}")
        checked[name] = check(value[name], name if where == "row" else f"{where}.{name}")
    return checked


def _shown(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


_MESSAGE: dict[str, Checker] = {name: _optional(_text) for name in Message.__annotations__}
_CALL: dict[str, Checker] = {
    "span_id": _text,
    "policy_version": _optional(_integer),
    "prompt_token_ids": _list(_token_id),
    "response_token_ids": _list(_token_id),
    "response_logprobs": _list(_number),
}
_SAMPLE: dict[str, Checker] = {
    "transition_id": _text,
    "policy_version": _integer,
    "prompt_token_ids": _list(_token_id),
    "response_token_ids": _list(_token_id),
    "loss_mask": _list(_flag),
    "reward": _finite,
    "advantage": _finite,
    "merged_calls": _integer,
}
_ROW: dict[str, Checker] = {
    **{name: _text for name in ("rollout_id", "agent_name", "task_id", "group_id", "model", "status",
                                "start_time", "end_time")},
    "reward": _optional(_finite),
    "total_reward": _finite,
    "policy_versions": _list(_integer),
    "messages": _list(_record(_MESSAGE)),
    "calls": _list(_record(_CALL)),
    "samples": _list(_record(_SAMPLE)),
}
