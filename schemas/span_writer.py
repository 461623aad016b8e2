"""Hand-written Avro encoder for Span and SpanBatch records: the datums fastavro writes, several times faster.

fastavro pays a Python-level cost for every item of a span's token-id and logprob arrays. Here
a span is *prepared* once (its scalar fields written in plain Python with cached strings, its
token ids packed into int32 bytes and its logprobs into float32 bytes, one struct call each),
and the zigzag varints of the token ids of a whole wave of records are then written, and each
record joined, in one call to compiled code (``native/``, `SpanBatchEncoder.encode_batches`).

A non-empty token-id array is written as one block with its size in bytes (the Avro
spec's negative block count), where fastavro writes the count alone: every Avro reader
(fastavro, Apache Avro, ClickHouse) reads the same values, and a reader that does not
need the ids (the stream processors) steps over them without walking their varints.
Everything else is byte for byte what fastavro writes.

Values are checked as they are written: anything fastavro would reject raises `EncodeError`.
This encoder is stricter in three places: an int array item outside the 32-bit range, a float
where an integer belongs, and a bool where a long belongs are errors (fastavro writes them).
"""

from __future__ import annotations

import operator
import reprlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import numpy as np

from .binary import DOUBLE, END, NULL, PRESENT, check_layout, write_long, write_string
from .catalog import SPAN, SPAN_BATCH, current_schemas
from .codec import MAGIC_BYTE
from .errors import EncodeError
from .native import span_records
from .records import SpanRecord
from .schema_ids import SchemaRegistry, default_registry

# The Span layout the functions below write, field by field. A different bundled Span schema
# has a different content address, and the encoder refuses to run rather than write wrong bytes.
SPAN_SCHEMA_ID = 1310064008

_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1
_LONG_MIN, _LONG_MAX = -(1 << 63), (1 << 63) - 1
_HEADER = struct.Struct(">BI")

_CACHE_SIZE = 1 << 14  # entries per cache below; a full cache is emptied and refilled
_CACHED_STRING_BYTES = 64
_STRINGS: dict[str, bytes] = {}  # short string -> its Avro bytes
_OPTIONAL_STRINGS: dict[str, bytes] = {}  # short string -> its branch and Avro bytes in a nullable union
_INT32S: dict[int, struct.Struct] = {}  # item count -> struct packing that many int32
_FLOAT32S: dict[int, struct.Struct] = {}  # item count -> struct packing that many float32


PreparedSpan = tuple[bytes, bytes, bytes, bytes, bytes, int]
"""A span checked and mostly written: ``(head, prompt_ids, middle, response_ids, tail, nbytes)``.

Its Avro body is ``head + block(prompt_ids) + middle + block(response_ids) + tail``, where
the ids are little-endian int32 bytes (empty when the field is null or empty; ``head`` or
``middle`` then ends the array itself), ``block`` is the block header (minus the count, then
the byte size) and the varints, and
nbytes is the memory it holds. A plain tuple of bytes on purpose: the garbage collector stops
tracking it, which matters when tens of thousands wait in a publisher's buffer. A named tuple
would not do: CPython never untracks an instance of a tuple subclass, and making one costs
several times a tuple's display. Read it by unpacking, or its size as ``prepared[NBYTES]``.
"""
NBYTES: Final = 5
"""The position of ``nbytes`` in a PreparedSpan."""


def prepare_span(span: SpanRecord) -> PreparedSpan:
    """Check `span` against the Span schema and write everything but its token-id varints.

    Checked at run time whatever its static type: a span may come from code mypy never saw.
    """
    try:
        return _prepare_common(span)
    except _NOT_COMMON:
        return _prepare_checked(span)


def _prepare_common(span: Mapping[str, Any]) -> PreparedSpan:
    """The fast path for the usual span: cached strings, list arrays, int timestamps; raises for anything else.

    It writes exactly what _prepare_checked writes; where a value is unusual it raises one of
    _NOT_COMMON (an unhashable value in a cache lookup, say) and the checked path takes over.
    """
    if type(span) is not dict or not _FIELD_NAMES.issuperset(span):
        raise _Unusual
    get, strings = span.get, _STRINGS
    options: dict[Any, bytes] = _OPTIONAL_STRINGS  # looked up with a field's value: None misses like any uncached one
    start, end, version = get("start_time_us"), get("end_time_us"), get("policy_version")
    if type(start) is not int or type(end) is not int or not (_LONG_MIN <= start <= _LONG_MAX
                                                              and _LONG_MIN <= end <= _LONG_MAX):
        raise _Unusual
    prompt_start, prompt = _list_of_ints(get("prompt_token_ids"), "prompt_token_ids")
    response_start, response = _list_of_ints(get("response_token_ids"), "response_token_ids")
    head = b"".join((
        _unique_string(span["span_id"]),
        strings.get(span["rollout_id"]) or _string(span["rollout_id"], "rollout_id"),
        strings.get(span["attempt_id"]) or _string(span["attempt_id"], "attempt_id"),
        options.get(get("parent_id")) or _optional_string(get("parent_id"), "parent_id"),
        strings.get(span["name"]) or _string(span["name"], "name"),
        _KIND[span["kind"]],
        write_long(start),
        write_long(end),
        _STATUS[get("status", "UNSET")],
        options.get(get("status_message")) or _optional_string(get("status_message"), "status_message"),
        options.get(get("agent_name")) or _optional_string(get("agent_name"), "agent_name"),
        options.get(get("task_id")) or _optional_string(get("task_id"), "task_id"),
        options.get(get("group_id")) or _optional_string(get("group_id"), "group_id"),
        options.get(get("model")) or _optional_string(get("model"), "model"),
        _string_map(get("attributes", _NO_ATTRIBUTES), "attributes"),
        prompt_start,
    ))
    middle = END + response_start if prompt else response_start
    logprobs, reward, dimensions = get("response_logprobs"), get("reward"), get("reward_dimensions")
    if type(logprobs) is list and logprobs:
        count = len(logprobs)
        floats = (_FLOAT32S.get(count) or _packer(_FLOAT32S, "f", count)).pack(*logprobs)
        logprobs_start, logprobs_end = _array_start(count), END
    else:
        logprobs_start, floats, logprobs_end = _float_array(logprobs, "response_logprobs"), b"", b""
    tail = b"".join((
        END if response else b"",
        logprobs_start,
        floats,
        logprobs_end,
        NULL if reward is None else PRESENT + _double(reward, "reward"),
        NULL if dimensions is None else PRESENT + _double_map(dimensions, "reward_dimensions"),
        NULL if version is None else PRESENT + _long(version, "policy_version"),
    ))
    return head, prompt, middle, response, tail, len(head) + len(middle) + len(tail) + len(prompt) + len(response)


def _list_of_ints(value: Any, name: str) -> tuple[bytes, bytes]:
    """_int_array's fast path for a non-empty list (anything else goes through _int_array)."""
    if type(value) is not list or not value:
        return _int_array(value, name)
    count = len(value)
    return PRESENT, (_INT32S.get(count) or _packer(_INT32S, "i", count)).pack(*value)


def _array_start(count: int) -> bytes:
    """Union branch 1 and the block count of a non-empty array."""
    return _ARRAY_STARTS[count] if count < len(_ARRAY_STARTS) else PRESENT + write_long(count)


def _prepare_checked(span: Mapping[str, Any]) -> PreparedSpan:
    """prepare_span one field at a time, each checked on its own so an error names the field."""
    if not isinstance(span, Mapping):
        raise EncodeError(f"{SPAN} does not match: {reprlib.repr(span)} is not a record")
    if not _FIELD_NAMES.issuperset(span):
        extra = sorted(map(str, set(span) - _FIELD_NAMES))
        raise EncodeError(f"{SPAN} does not match: record contains more fields than the schema specifies: {extra}")
    get = span.get
    prompt_start, prompt = _int_array(get("prompt_token_ids"), "prompt_token_ids")
    response_start, response = _int_array(get("response_token_ids"), "response_token_ids")
    head = b"".join((
        _string(get("span_id"), "span_id"),
        _string(get("rollout_id"), "rollout_id"),
        _string(get("attempt_id"), "attempt_id"),
        _optional_string(get("parent_id"), "parent_id"),
        _string(get("name"), "name"),
        _enum(get("kind"), "kind", _KIND),
        _long(get("start_time_us"), "start_time_us"),
        _long(get("end_time_us"), "end_time_us"),
        _enum(get("status", "UNSET"), "status", _STATUS),
        _optional_string(get("status_message"), "status_message"),
        _optional_string(get("agent_name"), "agent_name"),
        _optional_string(get("task_id"), "task_id"),
        _optional_string(get("group_id"), "group_id"),
        _optional_string(get("model"), "model"),
        _string_map(get("attributes", _NO_ATTRIBUTES), "attributes"),
        prompt_start,
    ))
    # A block of items ends with a zero count: after the prompt ids, and after the response ids.
    middle = END + response_start if prompt else response_start
    reward, dimensions, version = get("reward"), get("reward_dimensions"), get("policy_version")
    tail = b"".join((
        END if response else b"",
        _float_array(get("response_logprobs"), "response_logprobs"),
        NULL if reward is None else PRESENT + _double(reward, "reward"),
        NULL if dimensions is None else PRESENT + _double_map(dimensions, "reward_dimensions"),
        NULL if version is None else PRESENT + _long(version, "policy_version"),
    ))
    return head, prompt, middle, response, tail, len(head) + len(middle) + len(tail) + len(prompt) + len(response)


class SpanBatchEncoder:
    """Writes Span and SpanBatch records in the Confluent wire format, byte for byte what `AvroCodec` writes.

    The schema ids come from `registry` (the bundled one by default), so a registry that
    publishes on register sees both schemas once, when the encoder is made.
    """

    def __init__(self, registry: SchemaRegistry | None = None) -> None:
        check_layout(SPAN, SPAN_SCHEMA_ID, "agentstream.schemas.span_writer")
        schemas = current_schemas()
        registry = registry if registry is not None else default_registry()
        self._span_header = _HEADER.pack(MAGIC_BYTE, registry.register(schemas[SPAN]))
        self._batch_header = _HEADER.pack(MAGIC_BYTE, registry.register(schemas[SPAN_BATCH]))

    def encode_span(self, span: SpanRecord) -> bytes:
        """Wire-format bytes of one Span record."""
        (body,) = span_records([[prepare_span(span)]], (self._span_header,), b"")
        return body

    def encode_span_batch(self, spans: Iterable[SpanRecord]) -> bytes:
        """Wire-format bytes of one SpanBatch record holding `spans`."""
        return self.encode_batches([[prepare_span(span) for span in spans]])[0]

    def encode_batches(self, batches: Sequence[Sequence[PreparedSpan]]) -> list[bytes]:
        """One wire-format SpanBatch record per sequence of prepared spans, all token ids varint-encoded at once."""
        headers = [self._batch_header + write_long(len(batch)) if batch else self._batch_header for batch in batches]
        records: list[bytes] = span_records(batches, headers, END)  # the varints, in compiled code
        return records


class _Unusual(Exception):
    """A span the fast path leaves to the checked one: control flow inside this module, never raised out of it."""


def _fail(name: str, value: Any, expected: str, cause: Exception | None = None) -> EncodeError:
    error = EncodeError(f"{SPAN} does not match: {SPAN}.{name} is {reprlib.repr(value)}, expected {expected}")
    error.__cause__ = cause
    return error


def _string(value: Any, name: str) -> bytes:
    """Length-prefixed UTF-8; short strings are cached, since most repeat from span to span (ids, names, attributes)."""
    if type(value) is str:
        cached = _STRINGS.get(value)
        if cached is not None:
            return cached
    elif not isinstance(value, str):
        raise _fail(name, value, "string")
    try:
        encoded = value.encode()
    except UnicodeEncodeError as error:
        raise _fail(name, value, "string (valid Unicode)", error) from error
    written = write_long(len(encoded)) + encoded
    if len(encoded) <= _CACHED_STRING_BYTES:
        if len(_STRINGS) >= _CACHE_SIZE:
            _STRINGS.clear()
        _STRINGS[value] = written
    return written


def _unique_string(value: Any) -> bytes:
    """A span id: unique, so not worth a cache entry."""
    if type(value) is not str:
        raise _Unusual
    return write_string(value)


def _optional_string(value: Any, name: str) -> bytes:
    """Branch and string of a ["null", "string"] union; short strings are cached with their branch."""
    if value is None:
        return NULL
    written = PRESENT + _string(value, name)
    if len(written) <= _CACHED_STRING_BYTES:
        if len(_OPTIONAL_STRINGS) >= _CACHE_SIZE:
            _OPTIONAL_STRINGS.clear()
        _OPTIONAL_STRINGS[value] = written
    return written


def _long(value: Any, name: str) -> bytes:
    if type(value) is not int:
        if isinstance(value, bool):
            raise _fail(name, value, "long")
        try:
            value = operator.index(value)  # numpy integers
        except TypeError as error:
            raise _fail(name, value, "long", error) from error
    if not _LONG_MIN <= value <= _LONG_MAX:
        raise _fail(name, value, "long (64-bit)")
    return write_long(value)


def _enum(value: Any, name: str, symbols: Mapping[str, bytes]) -> bytes:
    try:
        return symbols[value]
    except (KeyError, TypeError) as error:
        raise _fail(name, value, f"one of {list(symbols)}", error) from error


def _double(value: Any, name: str) -> bytes:
    if type(value) is not float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise _fail(name, value, "double")
    try:
        return DOUBLE.pack(value)
    except OverflowError as error:  # an int too large for a double
        raise _fail(name, value, "double", error) from error


def _string_map(value: Any, name: str) -> bytes:
    if type(value) is not dict and not isinstance(value, Mapping):
        raise _fail(name, value, "map of strings")
    if not value:
        return END
    strings = _STRINGS
    parts = [write_long(len(value))]
    for key, item in value.items():
        parts.append(strings.get(key) or _string(key, name))
        try:
            parts.append(strings.get(item) or _string(item, name))
        except TypeError as error:  # unhashable, so not a string
            raise _fail(name, item, "string", error) from error
    parts.append(END)
    return b"".join(parts)


def _double_map(value: Any, name: str) -> bytes:
    if type(value) is not dict and not isinstance(value, Mapping):
        raise _fail(name, value, "null or map of doubles")
    if not value:
        return END
    parts = [write_long(len(value))]
    for key, item in value.items():
        parts.append(_string(key, name))
        parts.append(_double(item, name))
    parts.append(END)
    return b"".join(parts)


def _int_array(value: Any, name: str) -> tuple[bytes, bytes]:
    """The union branch and block header of a nullable int array, and its items as little-endian int32 bytes."""
    if value is None:
        return NULL, b""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise _fail(name, value, "null or array of int")
        if len(value) and (value.min() < _INT_MIN or value.max() > _INT_MAX):
            raise _fail(name, value, "null or array of int (32-bit)")
        ids = value.astype("<i4").tobytes()
    elif type(value) is not list and isinstance(value, (str, bytes, Mapping)):
        raise _fail(name, value, "null or array of int")
    else:
        try:
            ids = _packer(_INT32S, "i", len(value)).pack(*value)
        except (TypeError, struct.error) as error:
            raise _fail(name, value, "null or array of int (32-bit)", error) from error
    if not ids:
        return PRESENT + END, b""
    return PRESENT, ids  # the block header, which needs the varints' size, is written with them


def _float_array(value: Any, name: str) -> bytes:
    """A nullable float array: items as little-endian IEEE 754 binary32, as Avro writes `float`."""
    if value is None:
        return NULL
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "fiu":
            raise _fail(name, value, "null or array of float")
        with np.errstate(over="ignore"):  # out-of-range doubles become infinities, as in fastavro
            floats = value.astype("<f4").tobytes()
    elif type(value) is not list and isinstance(value, (str, bytes, Mapping)):
        raise _fail(name, value, "null or array of float")
    else:
        try:
            floats = _packer(_FLOAT32S, "f", len(value)).pack(*value)
        except OverflowError:  # struct refuses what does not fit a float32; Avro writers make it infinite
            with np.errstate(over="ignore"):
                floats = np.array(value, dtype=np.float64).astype("<f4").tobytes()
        except (TypeError, struct.error) as error:
            raise _fail(name, value, "null or array of float", error) from error
    if not floats:
        return PRESENT + END
    return b"".join((PRESENT, write_long(len(floats) // 4), floats, END))


def _packer(cache: dict[int, struct.Struct], code: str, count: int) -> struct.Struct:
    """A little-endian struct for `count` items of `code`, cached: one pack call converts a whole list."""
    packer = cache.get(count)
    if packer is None:
        if len(cache) >= _CACHE_SIZE:
            cache.clear()
        packer = cache[count] = struct.Struct(f"<{count}{code}")
    return packer


def _symbols(field_name: str) -> dict[str, bytes]:
    field = next(f for f in current_schemas()[SPAN]["fields"] if f["name"] == field_name)
    return {symbol: write_long(index) for index, symbol in enumerate(field["type"]["symbols"])}


_ARRAY_STARTS = tuple(PRESENT + write_long(count) for count in range(1 << 12))
_NOT_COMMON = (_Unusual, KeyError, TypeError, IndexError, struct.error, OverflowError)
_FIELD_NAMES = frozenset(field["name"] for field in current_schemas()[SPAN]["fields"])
_KIND = _symbols("kind")
_STATUS = _symbols("status")
_NO_ATTRIBUTES: Mapping[str, str] = {}
