"""The on-disk journal: Kafka records kept in local files while the broker is away, replayed in order after.

Also the one record type the whole publisher passes around (:class:`Record`): what the
accumulator builds, the sender puts on the wire, and the journal writes and reads back.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import uuid
import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_JOURNAL_MAGIC = b"ASJ1"
_RECORD_HEAD = struct.Struct("<II")  # body length, CRC-32 of the body
_BODY_HEAD = struct.Struct("<IH")  # spans in the record, key length
_MAX_JOURNAL_RECORD = 1 << 30  # a longer length field can only be garbage


@dataclass(slots=True)
class Record:
    """One Kafka record: key, wire-format value, how many spans it carries, and what it settles."""

    key: bytes
    value: bytes
    spans: int
    first_seq: int = -1
    """Sequence number of the oldest publish() call inside; -1 for records read back from the journal."""
    nbytes: int = 0
    """Buffered bytes it gives back when it is acknowledged or journaled."""


@dataclass(slots=True)
class _Segment:
    """One journal file, held with an exclusive flock by this process."""

    path: Path
    fd: int
    start: int  # offset of the first record, after the header
    size: int  # end of the complete records


class Journal:
    """Kafka records of one topic kept on local disk while the broker is unreachable, to be replayed in order.

    Each process writes its own file ``<topic>.<pid>.<random>.journal`` and holds an exclusive
    flock on every file it writes or replays, so files of a crashed process are recognised (their
    lock is free) and adopted by the next journal opened on the directory for the same topic.
    A file is the magic ``ASJ1``, the topic (u16 length + UTF-8), then records: u32 body length,
    u32 CRC-32 of the body, body = u32 span count, u16 key length, key, value (little-endian).
    Appends are fsync'd once per batch; a record cut short or failing its CRC ends its file, which
    is what a crash in the middle of a write leaves behind.
    """

    def __init__(self, directory: Path, topic: str) -> None:
        self.directory = directory
        self.topic = topic
        self._header = _JOURNAL_MAGIC + struct.pack("<H", len(topic.encode())) + topic.encode()
        directory.mkdir(parents=True, exist_ok=True)
        self._segments: deque[_Segment] = deque(self._adopt_orphans())
        self._writer: _Segment | None = None
        self._offset = self._segments[0].start if self._segments else 0  # read position in the first segment

    @property
    def empty(self) -> bool:
        """True when no record is waiting to be replayed."""
        return all(segment.size <= (self._offset if i == 0 else segment.start)
                   for i, segment in enumerate(self._segments))

    @property
    def location(self) -> Path:
        """The file being written, or the directory when there is none."""
        return self._writer.path if self._writer else self.directory

    def append(self, records: Iterable[Record]) -> int:
        """Write `records` after everything already journaled and fsync them; returns the bytes written."""
        parts: list[bytes] = []
        for record in records:
            body = _BODY_HEAD.pack(record.spans, len(record.key)) + record.key + record.value
            parts += (_RECORD_HEAD.pack(len(body), zlib.crc32(body)), body)
        if not parts:
            return 0
        writer = self._writer or self._new_segment()
        data = memoryview(b"".join(parts))
        written = 0
        try:
            while written < len(data):
                written += os.write(writer.fd, data[written:])
            os.fsync(writer.fd)
        except OSError:
            self._cut_back(writer)
            raise
        writer.size += len(data)
        return len(data)

    def _cut_back(self, writer: _Segment) -> None:
        """Remove what a failed append left after the last whole record (a full disk writes part of a batch).

        Records appended later must follow a whole record: a torn one ends its file for the reader. When
        even the truncation fails, the next append starts a new file.
        """
        try:
            os.ftruncate(writer.fd, writer.size)  # O_APPEND: the next write goes to the new end
        except OSError:
            self._writer = None

    def read(self, max_bytes: int) -> tuple[list[Record], int]:
        """Records from the read position (about `max_bytes` of them, at least one) and the bytes they take."""
        while self._segments:
            segment = self._segments[0]
            records, used = self._read_segment(segment, max_bytes)
            if records or segment is self._writer:
                return records, used
            self._retire(self._segments.popleft())  # a crashed process's file, fully replayed
            self._offset = self._segments[0].start if self._segments else 0
        return [], 0

    def consume(self, used: int) -> None:
        """Mark `used` bytes after the read position as replayed; files replayed to the end are deleted."""
        self._offset += used
        segment = self._segments[0]
        if self._offset >= segment.size:
            self._retire(self._segments.popleft())
            if segment is self._writer:
                self._writer = None
            self._offset = self._segments[0].start if self._segments else 0

    def close(self) -> None:
        """Release the files; records not yet replayed stay on disk for the next journal on this directory."""
        for segment in self._segments:
            os.close(segment.fd)
        self._segments.clear()
        self._writer = None

    def _adopt_orphans(self) -> list[_Segment]:
        adopted = []
        for path in sorted(self.directory.glob(f"{self.topic}.*.journal")):  # each holds one process's records
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:  # its owner finished replaying it just now
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live process owns it
                os.close(fd)
                continue
            size = os.fstat(fd).st_size
            if size > 0 and os.pread(fd, len(self._header), 0) != self._header:
                log.warning("journal %s: not a journal of topic %s, left alone", path, self.topic)
                os.close(fd)
                continue
            adopted.append(_Segment(path, fd, len(self._header), max(size, len(self._header))))
        return adopted

    def _new_segment(self) -> _Segment:
        path = self.directory / f"{self.topic}.{os.getpid()}.{uuid.uuid4().hex[:12]}.journal"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.write(fd, self._header) != len(self._header):
                raise OSError(errno.ENOSPC, "the journal's header was cut short", str(path))
            os.fsync(fd)
            directory = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(directory)  # the new name survives a crash too
            finally:
                os.close(directory)
        except OSError:  # a full disk: leave no file without its header behind
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        segment = self._writer = _Segment(path, fd, len(self._header), len(self._header))
        if not self._segments:
            self._offset = segment.start
        self._segments.append(segment)
        return segment

    def _read_segment(self, segment: _Segment, max_bytes: int) -> tuple[list[Record], int]:
        offset = self._offset
        data = os.pread(segment.fd, min(segment.size - offset, max(max_bytes, 1 << 20)), offset)
        records: list[Record] = []
        position = 0
        while position + _RECORD_HEAD.size <= len(data) and position < max_bytes:
            length, crc = _RECORD_HEAD.unpack_from(data, position)
            end = position + _RECORD_HEAD.size + length
            if length > _MAX_JOURNAL_RECORD or offset + end > segment.size:
                break
            if end > len(data):  # a record longer than this read: read it whole
                data = os.pread(segment.fd, end, offset)
            body = data[position + _RECORD_HEAD.size:end]
            if length < _BODY_HEAD.size or zlib.crc32(body) != crc:
                break
            spans, key_length = _BODY_HEAD.unpack_from(body)
            key_end = _BODY_HEAD.size + key_length
            records.append(Record(body[_BODY_HEAD.size:key_end], body[key_end:], spans))
            position = end
        if not records and offset + position < segment.size:
            log.warning("journal %s: ignored the last %d bytes, a record cut short by a crash",
                        segment.path, segment.size - offset - position)
            segment.size = offset + position
        return records, position

    def _retire(self, segment: _Segment) -> None:
        # Emptied before it is unlinked: a process that opened it meanwhile finds nothing to replay again.
        os.ftruncate(segment.fd, 0)
        segment.path.unlink(missing_ok=True)
        os.close(segment.fd)
