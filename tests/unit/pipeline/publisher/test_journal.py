"""The publisher's journal: records read back in order, a live journal's files locked, a torn tail dropped."""

from __future__ import annotations

from agentstream.pipeline.publisher.journal import Journal, Record


def test_journal_round_trip_lock_and_torn_tail(tmp_path):
    records = [Record(f"ro-{n}".encode(), bytes([n]) * (n * 1000), spans=n) for n in range(1, 6)]
    journal = Journal(tmp_path, "t.spans")
    assert journal.empty
    journal.append(records[:3])
    journal.append(records[3:])
    assert Journal(tmp_path, "t.spans").empty, "a live journal's files are locked, not adopted"
    read, used = journal.read(2500)
    assert [(r.key, r.value, r.spans) for r in read] == [(r.key, r.value, r.spans) for r in records[:2]]
    journal.consume(used)
    rest, used = journal.read(1 << 20)
    assert [r.key for r in rest] == [r.key for r in records[2:]]
    (path,) = sorted(tmp_path.glob("*.journal"))
    journal.close()  # as in a crash: the file stays, with a torn record at its end
    with path.open("ab") as torn:
        torn.write(b"\xff\x00\x00\x00garbage")

    adopted = Journal(tmp_path, "t.spans")
    assert not adopted.empty
    again, used = adopted.read(1 << 20)
    assert [r.key for r in again] == [r.key for r in records]
    adopted.consume(used)
    assert adopted.read(1 << 20) == ([], 0) and adopted.empty
    assert sorted(tmp_path.glob("*.journal")) == []
    assert Journal(tmp_path, "other.topic").empty
