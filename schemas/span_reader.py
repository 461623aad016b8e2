"""Reading span datums straight from their Avro bytes: the fields assembly needs, token arrays left encoded.

A stream worker sees every span it ingests, so it keeps each open rollout's spans in memory
instead of reading them back from ClickHouse. Decoding a 1 KB LLM span in full (300 numbers)
costs more than the rest of its processing; here a reader compiled once per writer schema walks
a datum, decodes the scalars and skips each token array, keeping its bytes: a Transition's
arrays have the same encoding, so a transition is built by concatenating them
(schemas/transition_writer.py). The reader makes each span with the class it is given (the
stream processor's ``agentstream.streams.trajectory.SpanNode``), called with the keywords of :class:`ReadSpan`.

The same reader walks a ClickHouse ``FORMAT Avro`` result whose columns are named after the
Span fields, which is how rollouts that wait for a late reward get their spans back.

Of the ``attributes`` map only one entry matters here, the rollout's training choice
(``agentstream.train``): the reader steps over the map comparing key bytes only where a key has
that length, and decodes nothing else.

The stream worker reads with :class:`SpanReader`, compiled code (Rust, ``native/``, the ``agentstream_native``
extension ``make install`` builds): a sixth of the Python reader's CPU per span. The Python reader generated below,
:class:`ReferenceSpanReader`, is its reference: the tests run both, and hold the compiled one to make the same nodes
and raise the same :class:`MalformedSpan` on every record they fuzz.

It is one module of about 550 lines on purpose: the generated readers and the layout checks they rely on change
together, with the Span schema.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from .binary import DOUBLE, END, FLOAT, NULL, PRESENT, TOKEN_FIELDS
from .catalog import schema_json
from .contracts import TRAIN_ATTRIBUTE, TRAIN_FALSE, TRAIN_TRUE
from .errors import AgentstreamError
from .native import CompiledSpanReader

Reader = Callable[[bytes, int], tuple[Any, int]]
"""``reader(buffer, position) -> (value, next position)``."""

SKIPPED_FIELDS = frozenset({"status_message"})  # stored by ClickHouse, not needed for credit
FLAG_FIELD = "attributes"  # a span's attributes: only the training flag is read from them
TRAIN_KEY = TRAIN_ATTRIBUTE.encode()
TRAIN_KEY_SIZE = len(TRAIN_KEY)
TRAIN_WORDS: dict[bytes, bool] = {**{w.encode(): True for w in TRAIN_TRUE}, **{w.encode(): False for w in TRAIN_FALSE}}
SPAN_MARKERS = frozenset({"span_id", "attempt_id", "kind", "start_time_us", "end_time_us"})  # a record that is a span
SPAN_NODE_FIELDS = frozenset({
    "span_id", "rollout_id", "attempt_id", "parent_id", "name", "kind", "start_time_us", "end_time_us", "status",
    "agent_name", "task_id", "group_id", "model", "policy_version", "reward", "reward_dimensions", *TOKEN_FIELDS})
VARINT_RUN_CACHE = 1024  # distinct array lengths whose patterns are kept; others are compiled (and cached by re)
_VARINT_RUNS: dict[int, re.Pattern[bytes]] = {}


class MalformedSpan(AgentstreamError, ValueError):
    """The bytes do not hold a datum of the writer schema they claim (truncated, or a bad union branch)."""


class NonFiniteReward(MalformedSpan):
    """A span whose reward or a reward dimension is NaN or infinite: written by a client that skipped every check."""


class ReadSpan(Protocol):
    """What the reader makes of a span: the class it is given (``agentstream.streams.trajectory.SpanNode``), called
    with the
    keywords span_id, rollout_id, parent_id, kind, name, start_us, end_us, attempt_id, agent_name, task_id,
    group_id, model, policy_version, has_token_ids, reward, reward_dimensions, status, train and tokens.

    ``tokens``: the Avro of the three token arrays (prompt ids, response ids, logprobs) as a
    Transition holds them, or empty where the span lacks prompt or response ids
    (``has_token_ids`` false); ``train``: the span's ``agentstream.train`` attribute as a flag.
    The reader itself reads back only what the reward check needs.
    """

    span_id: str
    rollout_id: str
    reward: float | None
    reward_dimensions: dict[str, float]


Span = TypeVar("Span", bound=ReadSpan)


def read_long(buffer: bytes, position: int) -> tuple[int, int]:
    """One zigzag varint (Avro int or long) and the position after it."""
    byte = buffer[position]
    if byte < 0x80:
        return (byte >> 1) ^ -(byte & 1), position + 1
    result, shift = byte & 0x7F, 7
    while True:
        position += 1
        byte = buffer[position]
        if shift == 63 and byte > 1:  # Avro's int and long are 64 bits: a tenth byte holds one bit at most
            raise MalformedSpan("varint longer than 64 bits")
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (result >> 1) ^ -(result & 1), position + 1
        shift += 7


def varint_run_cache_size() -> int:
    """How many compiled varint-run patterns are cached (bounded by VARINT_RUN_CACHE)."""
    return len(_VARINT_RUNS)


def _skip_varints(buffer: bytes, position: int, count: int) -> int:
    """The position after ``count`` varints.

    A regular expression walks them at C speed (possessive: no backtracking). Every varint takes
    at least one byte, so a count larger than the bytes left is malformed before any pattern is
    built (a huge count would overflow the pattern's repetition limit).
    """
    if count > len(buffer) - position:
        raise MalformedSpan(f"array of {count} ints in {max(len(buffer) - position, 0)} bytes")
    run = _VARINT_RUNS.get(count)
    if run is None:
        run = re.compile(rb"(?:[\x80-\xff]*+[\x00-\x7f]){%d}" % count, re.DOTALL)
        if len(_VARINT_RUNS) < VARINT_RUN_CACHE:
            _VARINT_RUNS[count] = run
    match = run.match(buffer, position)
    if match is None:
        raise MalformedSpan("array of ints cut short")
    return match.end()


def array_items(buffer: bytes, position: int, item_size: int | None) -> tuple[bytes, int, int]:
    """The Avro array of numbers at ``position``: its items' bytes back to back (block headers dropped), their count
    and the position after it. ``item_size``: bytes per item (4 float, 8 double), None for varints (int, long)."""
    parts: list[bytes] = []
    total = 0
    while True:
        count, position = read_long(buffer, position)
        if count == 0:
            return (parts[0] if len(parts) == 1 else b"".join(parts)), total, position
        if count < 0:  # a block with its size in bytes
            count = -count
            size, position = read_long(buffer, position)
            if size < 0:
                raise MalformedSpan(f"negative block size {size}")
            end = position + size
        else:
            end = position + count * item_size if item_size else _skip_varints(buffer, position, count)
        if end > len(buffer):
            raise MalformedSpan("array runs past the end of the datum")
        parts.append(buffer[position:end])
        total += count
        position = end


def _read_string(buffer: bytes, position: int) -> tuple[str, int]:
    size = buffer[position]
    if size < 0x80 and not size & 1:  # most strings are shorter than 64 bytes: a one-byte length
        position, size = position + 1, size >> 1
    else:
        size, position = read_long(buffer, position)
    end = position + size
    if size < 0:
        raise MalformedSpan(f"negative string length {size}")
    if end > len(buffer):
        raise MalformedSpan("string runs past the end of the datum")
    return buffer[position:end].decode("utf-8"), end


def _skip_string(buffer: bytes, position: int) -> tuple[None, int]:
    size = buffer[position]
    if size < 0x80 and not size & 1:
        return None, position + 1 + (size >> 1)
    size, position = read_long(buffer, position)
    if size < 0:
        raise MalformedSpan(f"negative string length {size}")
    return None, position + size


def _read_bytes(buffer: bytes, position: int) -> tuple[bytes, int]:
    size, position = read_long(buffer, position)
    end = position + size
    if size < 0 or end > len(buffer):
        raise MalformedSpan("bytes run past the end of the datum")
    return buffer[position:end], end


def _read_double(buffer: bytes, position: int) -> tuple[float, int]:
    return DOUBLE.unpack_from(buffer, position)[0], position + 8


def _read_float(buffer: bytes, position: int) -> tuple[float, int]:
    return FLOAT.unpack_from(buffer, position)[0], position + 4


def _read_null(buffer: bytes, position: int) -> tuple[None, int]:
    return None, position


def _read_boolean(buffer: bytes, position: int) -> tuple[bool, int]:
    return buffer[position] != 0, position + 1


PRIMITIVES: dict[str, Reader] = {
    "null": _read_null, "boolean": _read_boolean, "int": read_long, "long": read_long, "float": _read_float,
    "double": _read_double, "string": _read_string, "bytes": _read_bytes,
}


def _blocks(items: Reader | None, item_size: int | None, keyed: bool) -> Reader:
    """An array or map: blocks of items until a zero count. Returns the items (a list, a dict) or,
    with ``items`` None, the encoded bytes of the whole array (numbers are skipped, not decoded)."""

    def read(buffer: bytes, position: int) -> tuple[Any, int]:
        start = position
        out: Any = {} if keyed else []
        while True:
            count, position = read_long(buffer, position)
            if count == 0:
                break
            if count < 0:  # a negative count is followed by the block's size in bytes
                count = -count
                size, position = read_long(buffer, position)
                if size < 0:
                    raise MalformedSpan(f"negative block size {size}")
                if items is None:
                    position += size
                    continue
            if items is None:
                position = position + count * item_size if item_size else _skip_varints(buffer, position, count)
            elif keyed:
                for _ in range(count):
                    key, position = _read_string(buffer, position)
                    out[key], position = items(buffer, position)
            else:
                for _ in range(count):
                    value, position = items(buffer, position)
                    out.append(value)
        if position > len(buffer):
            raise MalformedSpan("array runs past the end of the datum")
        return (buffer[start:position] if items is None else out), position

    return read


def _union(branches: list[Reader]) -> Reader:
    def read(buffer: bytes, position: int) -> tuple[Any, int]:
        branch = buffer[position] >> 1  # branch numbers are small: a one-byte varint
        if branch >= len(branches) or buffer[position] & 0x81:
            raise MalformedSpan(f"union branch byte {buffer[position]} does not name a branch")
        return branches[branch](buffer, position + 1)

    return read


def _enum(symbols: list[str]) -> Reader:
    def read(buffer: bytes, position: int) -> tuple[str, int]:
        byte = buffer[position]
        if byte & 0x81:  # more than 63 symbols or a negative index: the general path
            index, position = read_long(buffer, position)
            if not 0 <= index < len(symbols):
                raise MalformedSpan(f"enum index {index} does not exist")
            return symbols[index], position
        if byte >> 1 >= len(symbols):
            raise MalformedSpan(f"enum index {byte >> 1} does not exist")
        return symbols[byte >> 1], position + 1

    return read


def _record(fields: list[tuple[str, Reader]]) -> Reader:
    def read(buffer: bytes, position: int) -> tuple[dict[str, Any], int]:
        values = {}
        for name, field_reader in fields:
            values[name], position = field_reader(buffer, position)
        return values, position

    return read


def _skipper(schema: Any) -> Reader:
    """A reader that steps over a value of ``schema`` and returns None (strings are not decoded)."""
    if schema in ("string", "bytes"):
        return _skip_string
    if isinstance(schema, dict) and schema["type"] == "map" and schema["values"] == "string":
        return _skip_string_map
    return compile_reader(schema)


def _skip_string_map(buffer: bytes, position: int) -> tuple[None, int]:
    while True:
        count, position = read_long(buffer, position)
        if count == 0:
            return None, position
        if count < 0:
            size, position = read_long(buffer, position)
            if size < 0:
                raise MalformedSpan(f"negative block size {size}")
            position += size
            continue
        for _ in range(2 * count):
            _, position = _skip_string(buffer, position)


def _read_train_flag(buffer: bytes, position: int) -> tuple[bool | None, int]:
    """Step over a map of strings, returning its ``agentstream.train`` value as a flag (None: absent or not a word).

    Only a key of the flag's length is compared (a slice and a bytes compare); nothing is
    decoded, so neither the other entries nor a garbage flag value can raise.
    """
    flag = None
    while True:
        count, position = read_long(buffer, position)
        if count == 0:
            return flag, position
        if count < 0:  # a block with its byte size: its entries are still walked, to find the flag
            count = -count
            size, position = read_long(buffer, position)
            if size < 0:
                raise MalformedSpan(f"negative block size {size}")
        for _ in range(count):
            size = buffer[position]
            if size < 0x80 and not size & 1:
                position, size = position + 1, size >> 1
            else:
                size, position = read_long(buffer, position)
                if size < 0:
                    raise MalformedSpan(f"negative string length {size}")
            if size == TRAIN_KEY_SIZE and buffer[position:position + size] == TRAIN_KEY:
                value, position = _read_bytes(buffer, position + size)
                flag = TRAIN_WORDS.get(value.strip().lower())
                continue
            position += size
            size = buffer[position]
            if size < 0x80 and not size & 1:
                position += 1 + (size >> 1)
            else:
                size, position = read_long(buffer, position)
                if size < 0:
                    raise MalformedSpan(f"negative string length {size}")
                position += size


def _flag_reader(schema: Any) -> Reader:
    """A reader for the ``attributes`` field that returns the training flag it holds (None where it has none)."""
    if isinstance(schema, list):
        return _union([_flag_reader(branch) for branch in schema])
    if isinstance(schema, dict) and schema["type"] == "map" and schema["values"] == "string":
        return _read_train_flag
    return _skipper(schema)


def compile_reader(schema: Any, raw_arrays: frozenset[str] = frozenset(), field: str = "",
                   skipped: frozenset[str] = frozenset(), node: Callable[..., Any] | None = None) -> Reader:
    """A reader for ``schema`` (parsed, self-contained); arrays of the fields named in ``raw_arrays``
    come back as their encoded bytes (None where a union holds null), fields named in ``skipped`` as None.
    With ``node``, a span record comes back as ``node(**fields)`` (the keywords of :class:`ReadSpan`)."""
    if field in skipped:
        return _union([_skipper(b) for b in schema]) if isinstance(schema, list) else _skipper(schema)
    if isinstance(schema, str):
        if schema not in PRIMITIVES:
            raise ValueError(f"cannot read Avro type {schema!r}")
        return PRIMITIVES[schema]
    if isinstance(schema, list):
        return _union([compile_reader(branch, raw_arrays, field, node=node) for branch in schema])
    kind = schema["type"]
    if kind == "record" and node is not None and {f["name"] for f in schema["fields"]} >= SPAN_MARKERS:
        return _span_reader(schema, raw_arrays, skipped, node)
    if kind == "record":
        return _record([(f["name"], compile_reader(f["type"], raw_arrays, f["name"], skipped, node))
                        for f in schema["fields"]])
    if kind == "enum":
        return _enum(list(schema["symbols"]))
    if kind == "array":
        if field in raw_arrays:
            sizes = {"float": 4, "double": 8}
            items = schema["items"]
            if items not in ("int", "long", "float", "double"):
                raise ValueError(f"{field}: only arrays of numbers are kept encoded")
            return _blocks(None, sizes.get(items), keyed=False)
        return _blocks(compile_reader(schema["items"], raw_arrays, skipped=skipped, node=node), None, keyed=False)
    if kind == "map":
        return _blocks(compile_reader(schema["values"], raw_arrays, node=node), None, keyed=True)
    if kind == "fixed":
        size = schema["size"]
        return lambda buffer, position: (buffer[position:position + size], position + size)
    return compile_reader(kind, raw_arrays, field, node=node)  # {"type": "long", "logicalType": ...}


_STRING = """\
    size = buf[pos]
    if size < 0x80 and not size & 1:
        pos += 1
        size >>= 1
    else:
        size, pos = read_long(buf, pos)
        if size < 0:
            raise MalformedSpan(f'negative string length {size}')
    {var} = buf[pos:pos + size].decode()
    pos += size
"""
_LONG = """\
    byte = buf[pos]
    if byte < 0x80:
        {var} = (byte >> 1) ^ -(byte & 1)
        pos += 1
    else:
        {var}, pos = read_long(buf, pos)
"""
_DOUBLE_VALUE = """\
    {var} = unpack_double(buf, pos)[0]
    pos += 8
"""
_INLINE = {"string": _STRING, "long": _LONG, "int": _LONG, "double": _DOUBLE_VALUE}
_RAW_ARRAY = """\
    branch = buf[pos]
    pos += 1
    if branch == {null}:
        {var} = None
    elif branch == {present}:
        start = pos
        while True:
            byte = buf[pos]
            if byte < 0x80:
                count = (byte >> 1) ^ -(byte & 1)
                pos += 1
            else:
                count, pos = read_long(buf, pos)
            if count == 0:
                break
            if count < 0:  # a block with its size in bytes (the span writer's): stepped over at once
                size, pos = read_long(buf, pos)
                if size < 0:
                    raise MalformedSpan(f'negative block size {size}')
                pos += size
            else:
                pos = {skip}
        if pos > len(buf):
            raise MalformedSpan('array runs past the end of the datum')
        {var} = buf[start:pos]
    else:
        raise MalformedSpan(f'union branch byte {branch} does not name a branch')
""".replace("{null}", str(NULL[0])).replace("{present}", str(PRESENT[0]))
_ITEM_BYTES = {"float": 4, "double": 8}


def _inline_raw_array(schema: Any) -> str | None:
    """Source that keeps a nullable array of numbers encoded into {var}; None for any other shape."""
    if not (isinstance(schema, list) and len(schema) == 2 and schema[0] == "null" and isinstance(schema[1], dict)
            and schema[1].get("type") == "array" and schema[1].get("items") in ("int", "long", "float", "double")):
        return None
    size = _ITEM_BYTES.get(schema[1]["items"])
    return _RAW_ARRAY.replace("{skip}", f"pos + count * {size}" if size else "skip_varints(buf, pos, count)")


def _inline(schema: Any) -> str | None:
    """Source that reads a value of ``schema`` into {var}, for the types spans are made of; None for the rest."""
    if isinstance(schema, dict) and schema["type"] in _INLINE and len(schema) <= 2 + ("logicalType" in schema):
        schema = schema["type"]
    if isinstance(schema, str):
        return _INLINE.get(schema)
    if isinstance(schema, list) and len(schema) == 2 and schema[0] == "null":
        value = _inline(schema[1])
        if value:
            body = value.replace("\n    ", "\n        ")
            return (f"    branch = buf[pos]\n    pos += 1\n    if branch == {NULL[0]}:\n        {{var}} = None\n"
                    f"    elif branch == {PRESENT[0]}:\n    " + body +
                    "    else:\n        raise MalformedSpan(f'union branch byte {branch} does not name a branch')\n")
    return None


def _span_reader(schema: dict[str, Any], raw_arrays: frozenset[str], skipped: frozenset[str],
                 node: Callable[..., Any]) -> Reader:
    """A reader for a span record straight into ``node``, generated as Python source for this writer schema.

    The span fields' scalars are read inline (a call per field costs more than reading it);
    maps, token arrays and anything unusual go through the compiled readers above.
    """
    names = {f["name"] for f in schema["fields"]}
    lines = ["def read(buf, pos):"]
    scope: dict[str, Any] = {"read_long": read_long, "MalformedSpan": MalformedSpan, "Node": node,
                             "EMPTY": END, "unpack_double": DOUBLE.unpack_from, "skip_varints": _skip_varints}
    for index, spec in enumerate(schema["fields"]):
        variable = f"v_{index}"
        if spec["name"] in skipped:
            source = None
        elif spec["name"] in raw_arrays:
            source = _inline_raw_array(spec["type"])
        else:
            source = _inline(spec["type"])
        if spec["name"] == FLAG_FIELD:
            scope[f"read_{index}"] = _flag_reader(spec["type"])
            lines.append(f"    {variable}, pos = read_{index}(buf, pos)")
        elif source is None:
            scope[f"read_{index}"] = compile_reader(spec["type"], raw_arrays, spec["name"], skipped, node)
            lines.append(f"    {variable}, pos = read_{index}(buf, pos)")
        else:
            lines.append(source.replace("{var}", variable).rstrip("\n"))
    value = {f["name"]: f"v_{i}" for i, f in enumerate(schema["fields"])}
    for name in (SPAN_NODE_FIELDS | {FLAG_FIELD}) - names:
        value[name] = "None"
    lines.append(f"""\
    if pos > len(buf):
        raise IndexError('span runs past the end of its datum')
    prompt = {value['prompt_token_ids']} or EMPTY
    response = {value['response_token_ids']} or EMPTY
    has_tokens = prompt != EMPTY and response != EMPTY
    return Node(
        span_id={value['span_id']}, rollout_id={value['rollout_id']} or '', parent_id={value['parent_id']} or '',
        kind={value['kind']}, name={value['name']}, start_us={value['start_time_us']}, end_us={value['end_time_us']},
        attempt_id={value['attempt_id']}, agent_name={value['agent_name']} or '', task_id={value['task_id']} or '',
        group_id={value['group_id']} or '', model={value['model']} or '', policy_version={value['policy_version']},
        has_token_ids=has_tokens, reward={value['reward']}, reward_dimensions={value['reward_dimensions']} or {{}},
        status={value['status']} or 'UNSET', train={value[FLAG_FIELD]},
        tokens=prompt + response + ({value['response_logprobs']} or EMPTY) if has_tokens else b'',
    ), pos""")
    exec(compile("\n".join(lines), f"<span reader {schema.get('name', '')}>", "exec"), scope)
    return scope["read"]


class _SpanBatches(Generic[Span]):
    """What both readers share: a SpanBatch's spans (or a row's), its whole length used, its rewards finite."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self._batch = any(f["name"] == "spans" for f in schema.get("fields", ()))

    def _datum(self, body: bytes) -> tuple[Any, int]:
        raise NotImplementedError

    def rows(self, count: int, datums: bytes) -> list[Span]:
        """``count`` concatenated span rows (a block of an Avro container file)."""
        raise NotImplementedError

    def batch(self, body: bytes) -> list[Span]:
        """The spans of one SpanBatch datum (the body of a spans-topic record)."""
        values, end = self._datum(body)
        if end != len(body):
            raise MalformedSpan(f"{len(body) - end} bytes left after the span batch")
        nodes: list[Span] = values["spans"] if self._batch else [values]
        for node in nodes:
            if node.reward is not None or node.reward_dimensions:
                check_finite_reward(node)
        return nodes


class SpanReader(_SpanBatches[Span]):
    """Reads the spans of one writer schema (a SpanBatch, or a row of Span fields) into ``node`` objects, in compiled
    code (the ``agentstream_native`` extension, built from ``native/`` by ``make install``).

    It makes the same nodes and raises the same :class:`MalformedSpan` as :class:`ReferenceSpanReader`, which the
    tests hold it to on every input they try (in both, a long that does not fit Avro's 64 bits is malformed)."""

    def __init__(self, schema: dict[str, Any], node: Callable[..., Span]) -> None:
        self._reader = CompiledSpanReader(schema_json(schema), node, MalformedSpan,
                                          sorted(SKIPPED_FIELDS), TRAIN_KEY, list(TRAIN_WORDS.items()))
        super().__init__(schema)

    def _datum(self, body: bytes) -> tuple[Any, int]:
        result: tuple[Any, int] = self._reader.datum(body, "span batch")
        return result

    def rows(self, count: int, datums: bytes) -> list[Span]:
        rows: list[Span] = self._reader.rows(count, datums, "span row")
        return rows


class ReferenceSpanReader(_SpanBatches[Span]):
    """The same reader in Python, generated per writer schema: the reference :class:`SpanReader` is tested against."""

    def __init__(self, schema: dict[str, Any], node: Callable[..., Span]) -> None:
        self._read = compile_reader(schema, frozenset(TOKEN_FIELDS), skipped=SKIPPED_FIELDS, node=node)
        super().__init__(schema)

    def _datum(self, body: bytes) -> tuple[Any, int]:
        try:
            return self._read(body, 0)
        except (IndexError, struct.error, UnicodeDecodeError) as error:
            raise _malformed("span batch", error) from None

    def rows(self, count: int, datums: bytes) -> list[Span]:
        nodes: list[Span] = []
        position = 0
        try:
            for _ in range(count):
                node, position = self._read(datums, position)
                nodes.append(node)
        except (IndexError, struct.error, UnicodeDecodeError) as error:
            raise _malformed("span row", error) from None
        return nodes


def check_finite_reward(node: ReadSpan) -> None:
    """Raise :class:`NonFiniteReward` where a span's reward or a reward dimension is not a finite number.

    The SDK, proxy and collector refuse such rewards; one written straight onto the topic would
    make every running mean and group advantage it enters NaN, so its record is a dead letter.
    """
    if node.reward is not None and not math.isfinite(node.reward):
        raise NonFiniteReward(f"span {node.span_id!r} of rollout {node.rollout_id!r} has reward {node.reward!r}: "
                              "a reward must be a finite number")
    for name, value in node.reward_dimensions.items():
        if not math.isfinite(value):
            raise NonFiniteReward(f"span {node.span_id!r} of rollout {node.rollout_id!r} has reward dimension "
                                  f"{name!r} = {value!r}: a reward must be a finite number")


def _malformed(what: str, error: Exception) -> MalformedSpan:
    if isinstance(error, UnicodeDecodeError):
        return MalformedSpan(f"a string in the {what} is not UTF-8: {error}")
    return MalformedSpan(f"the {what} is cut short: it ends inside a value of its writer schema")
