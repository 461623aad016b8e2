"""The exporter's parts without ClickHouse: the pager's memory bound, the WHERE check, messages, times, the writer."""

from __future__ import annotations

import bisect
import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from agentstream.dataset import (
    DatasetWriter,
    RolloutHead,
    WhereClauseError,
    check_where,
    iso_utc,
    message,
    pages,
    parse_time,
)
from agentstream.schemas.dataset import DatasetError, check_row, read_rows


class Selection:
    """A sorted selection of rollout ids served page by page, recording each request the pager makes."""

    def __init__(self, count: int) -> None:
        self.ids = [f"r{index:05d}" for index in range(count)]
        self.requests: list[tuple[str, int]] = []

    def fetch(self, after: str, size: int) -> list[RolloutHead]:
        self.requests.append((after, size))
        start = bisect.bisect_right(self.ids, after)
        return [RolloutHead((rollout_id,)) for rollout_id in self.ids[start:start + size]]


@pytest.mark.parametrize("count, batch, limit", [(0, 3, None), (7, 3, None), (6, 3, None), (7, 500, None),
                                                 (7, 3, 5), (7, 3, 0), (7, 1, 7), (10_000, 64, None)])
def test_pages_cover_the_selection_once_in_order_holding_at_most_one_page(count, batch, limit):
    selection = Selection(count)
    seen: list[str] = []
    for page in pages(selection.fetch, batch, limit):
        assert 0 < len(page) <= batch
        assert len(selection.requests) == len(seen) // batch + 1  # the next page is asked for only after this one
        seen.extend(head.rollout_id for head in page)
    assert seen == selection.ids[:limit]
    assert all(size <= batch for _, size in selection.requests)
    assert [after for after, _ in selection.requests][1:] == seen[batch - 1::batch][:len(selection.requests) - 1]


def test_pages_refuse_an_empty_batch():
    with pytest.raises(ValueError, match="at least 1"):
        next(pages(Selection(1).fetch, 0))


@pytest.mark.parametrize("clause", [
    "status = 'SUCCEEDED'", "(a > 1) AND (b < 2 OR c IN (SELECT x FROM t))", "name = ')' OR name = '('",
    "x = 'it''s ;' AND y = 'a\\'b)'", '"odd)name" = 1', "`back;tick` = 1", "a = 1 -- a note ) ;",
    "a = 1 /* ) ; */",
])
def test_one_expression_passes_the_where_check(clause):
    assert check_where(f"  {clause}  ") == clause


@pytest.mark.parametrize("clause, why", [
    ("", "empty"), ("1) OR (1", "closes a parenthesis"), ("1) UNION ALL SELECT * FROM system.users --", "closes"),
    ("(1", "not closed"), ("1; DROP TABLE rollouts", "';' is refused"), ("a = 'open", "quote is not closed"),
    ("a = 1 /* open", "comment is not closed"),
])
def test_the_where_check_refuses_what_could_leave_the_where(clause, why):
    with pytest.raises(WhereClauseError, match=why):
        check_where(clause)


def test_messages_fit_the_fixed_struct():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert message({"role": "assistant", "content": None, "tool_calls": calls}) == {
        "role": "assistant", "content": None, "name": None, "tool_call_id": None, "tool_calls": json.dumps(calls)}
    assert message({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url",
                                                                                  "image_url": {"url": "u"}}]}) == {
        "role": "user", "content": 'a{"type": "image_url", "image_url": {"url": "u"}}', "name": None,
        "tool_call_id": None, "tool_calls": None}
    parts = {"role": "assistant", "parts": [{"type": "text", "content": "ok"},
                                            {"type": "tool_call", "id": "c2", "name": "g", "arguments": {}}]}
    converted = message(parts)
    assert converted["content"] == "ok" and json.loads(converted["tool_calls"] or "")[0]["id"] == "c2"
    assert message("plain")["content"] == "plain" and message({"role": "tool", "content": {"v": 1}})["content"] == (
        '{"v": 1}')
    row_messages = [message(item) for item in ({"role": "user", "content": "x"}, 5, None)]
    check_row({**ROW, "messages": row_messages})


def test_times_are_iso_utc_both_ways():
    now = datetime(2026, 11, 27, 18, 0, tzinfo=UTC)
    assert parse_time("2h", now) == now - timedelta(hours=2)
    assert parse_time("2026-11-27T18:00:00Z") == now == parse_time("2026-11-27 18:00")
    assert parse_time("2026-11-27T20:00:00+02:00") == now
    with pytest.raises(ValueError, match="neither an ISO 8601 time"):
        parse_time("yesterday")
    assert iso_utc(datetime(2026, 1, 2, 3, 4, 5, 6)) == "2026-01-02T03:04:05.000006Z"
    assert iso_utc(datetime(2026, 1, 2, 5, 4, 5, tzinfo=timezone(timedelta(hours=2)))) == "2026-01-02T03:04:05.000000Z"


@pytest.mark.parametrize("name, kind", [("d.jsonl", "jsonl"), ("d.jsonl.gz", "jsonl"), ("d.parquet", "parquet")])
def test_the_file_gets_its_name_only_when_complete(tmp_path, name, kind):
    out = tmp_path / name
    rows = [check_row(ROW)]
    writer = DatasetWriter(out, kind)
    writer.write(rows)
    assert writer.partial.exists() and not out.exists()
    writer.commit()
    assert not writer.partial.exists() and list(read_rows(out)) == rows
    failed = DatasetWriter(tmp_path / f"failed-{name}", kind)
    failed.write(rows)
    failed.discard()
    assert sorted(path.name for path in tmp_path.iterdir()) == [name]
    with pytest.raises(DatasetError, match=r"cannot write .*missing"):
        DatasetWriter(tmp_path / "missing" / name, kind)


ROW = {"rollout_id": "r", "agent_name": "a", "task_id": "", "group_id": "", "model": "", "status": "",
       "start_time": "", "end_time": "", "reward": None, "total_reward": 0.0, "policy_versions": [],
       "messages": [], "calls": [], "samples": []}


def test_a_duration_beyond_the_calendar_is_a_value_error():
    with pytest.raises(ValueError, match="'99999999d' reaches before year 1"):
        parse_time("99999999d", datetime(2026, 11, 27, 18, tzinfo=UTC))


@pytest.mark.parametrize("name, kind", [("d.jsonl", "jsonl"), ("d.parquet", "parquet")])
def test_two_exports_to_one_file_each_write_their_own_partial(tmp_path, name, kind):
    """Two exports started on the same OUT (a retry while the first still runs) must not write into one partial
    file, nor fail at the rename: each finishes whole and the last rename wins."""
    out = tmp_path / name
    first, second = DatasetWriter(out, kind), DatasetWriter(out, kind)
    assert first.partial != second.partial
    first.write([check_row({**ROW, "rollout_id": "a"})])
    second.write([check_row({**ROW, "rollout_id": "b"}), check_row({**ROW, "rollout_id": "c"})])
    first.commit()
    second.commit()
    assert [row["rollout_id"] for row in read_rows(out)] == ["b", "c"]
    assert sorted(path.name for path in tmp_path.iterdir()) == [name]
