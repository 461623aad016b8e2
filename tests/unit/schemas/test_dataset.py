"""The dataset row contract: rows written as JSON Lines (plain, gzip) and Parquet read back equal; bad rows named."""

from __future__ import annotations

import copy
import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentstream.schemas.dataset import (
    ARROW_SCHEMA,
    FORMAT_VERSION_KEY,
    DatasetError,
    DatasetRow,
    MalformedDatasetRow,
    UnknownDatasetFormat,
    arrow_table,
    check_row,
    format_of,
    json_line,
    read_rows,
)
from agentstream.schemas.errors import AgentstreamError


def row(rollout_id: str = "r1", **changes: object) -> DatasetRow:
    value: DatasetRow = {
        "rollout_id": rollout_id, "agent_name": "calc", "task_id": "t1", "group_id": "g1", "model": "tiny",
        "status": "SUCCEEDED", "start_time": "2026-11-27T18:00:00.000001Z", "end_time": "2026-11-27T18:00:01Z",
        "reward": 1.0, "total_reward": 1.5, "policy_versions": [3, 4],
        "messages": [
            {"role": "user", "content": "Compute 2+3.", "name": None, "tool_call_id": None, "tool_calls": None},
            {"role": "assistant", "content": None, "name": None, "tool_call_id": None,
             "tool_calls": json.dumps([{"id": "c1", "type": "function",
                                        "function": {"name": "calc", "arguments": "{\"e\": \"2+3\"}"}}])},
        ],
        "calls": [{"span_id": "s1", "policy_version": 3, "prompt_token_ids": [1, 2, 3],
                   "response_token_ids": [4, 5], "response_logprobs": [-0.5, -0.25]},
                  {"span_id": "s2", "policy_version": None, "prompt_token_ids": [], "response_token_ids": [],
                   "response_logprobs": []}],
        "samples": [{"transition_id": "x1", "policy_version": 3, "prompt_token_ids": [1, 2, 3],
                     "response_token_ids": [4, 5, 6, 7], "loss_mask": [True, True, False, True], "reward": 1.0,
                     "advantage": 0.5, "merged_calls": 2}],
    }
    value.update(changes)  # type: ignore[typeddict-item]
    return value


ROWS = [row("r1"), row("r2", reward=None, samples=[], messages=[]), row("r3", total_reward=-2)]


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz", "d.parquet"])
def test_rows_read_back_equal_from_every_format(tmp_path, name):
    path = tmp_path / name
    if name.endswith(".parquet"):
        with pq.ParquetWriter(path, ARROW_SCHEMA) as writer:
            writer.write_table(arrow_table(ROWS[:2]))
            writer.write_table(arrow_table(ROWS[2:]))  # a second row group
        assert pq.ParquetFile(path).metadata.num_row_groups == 2
    else:
        text = "".join(json_line(r) for r in ROWS) + "\n"  # a trailing blank line is no row
        path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    back = list(read_rows(path, batch_rows=1))
    assert back == [check_row(r) for r in ROWS]
    assert back[2]["total_reward"] == -2.0 and back[0]["calls"][0]["response_logprobs"] == [-0.5, -0.25]


def test_parquet_schema_carries_the_format_version(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(arrow_table(ROWS), path)
    assert pq.read_schema(path).metadata[FORMAT_VERSION_KEY] == b"1"
    future = arrow_table(ROWS).replace_schema_metadata({FORMAT_VERSION_KEY: b"99"})
    pq.write_table(future, path)
    with pytest.raises(UnknownDatasetFormat, match="version 99"):
        next(read_rows(path))


def broken(change) -> DatasetRow:
    value = copy.deepcopy(row())
    change(value)
    return value


@pytest.mark.parametrize("change, field", [
    (lambda r: r.pop("calls"), "no field 'calls'"),
    (lambda r: r.update(reward="1.0"), r"reward is \"1.0\", expected a number"),
    (lambda r: r.update(total_reward=None), "total_reward is null, expected a number"),
    (lambda r: r.update(policy_versions=[1.5]), r"policy_versions\[0\] is 1.5, expected an integer"),
    (lambda r: r["calls"][1].update(prompt_token_ids=[1, -2]), r"calls\[1\].prompt_token_ids\[1\] is -2"),
    (lambda r: r["calls"][0].update(response_token_ids=[True]), r"calls\[0\].response_token_ids\[0\] is true"),
    (lambda r: r["samples"][0].update(loss_mask=[1, 0]), r"samples\[0\].loss_mask\[0\] is 1, expected true or false"),
    (lambda r: r["samples"][0].update(merged_calls="2"), r"samples\[0\].merged_calls is \"2\""),
    (lambda r: r["messages"][0].update(content=["a"]), r"messages\[0\].content is \[\"a\"\], expected a string"),
    (lambda r: r.update(messages={"role": "user"}), "messages is .*expected a list"),
    (lambda r: r["samples"].append(7), r"samples\[1\] is 7, expected an object"),
])
def test_a_wrong_type_is_named_with_file_and_line(tmp_path, change, field):
    path = tmp_path / "d.jsonl"
    path.write_text(json_line(row()) + json.dumps(broken(change)) + "\n")
    rows = read_rows(path)
    assert next(rows)["rollout_id"] == "r1"  # streaming: the good first row comes before the error
    with pytest.raises(MalformedDatasetRow, match=field) as caught:
        next(rows)
    assert caught.value.row == 2 and caught.value.path == str(path) and str(caught.value).startswith(f"{path}: row 2:")
    assert isinstance(caught.value, AgentstreamError) and not caught.value.retriable


def test_a_line_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json_line(row()) + "\n" + '{"rollout_id": "r2", \n')
    with pytest.raises(MalformedDatasetRow, match="row 3: not JSON") as caught:
        list(read_rows(path))
    assert caught.value.row == 3
    path.write_text("[1, 2]\n")
    with pytest.raises(MalformedDatasetRow, match="row 1: row is \\[1, 2\\], expected an object"):
        list(read_rows(path))


def test_a_parquet_row_of_another_type_is_named_by_row(tmp_path):
    path = tmp_path / "d.parquet"
    table = arrow_table(ROWS)
    wrong = table.set_column(table.schema.get_field_index("total_reward"), "total_reward",
                             pa.array([1.0, None, 2.0], pa.float64()))
    pq.write_table(wrong, path)
    with pytest.raises(MalformedDatasetRow, match="row 2: total_reward is null") as caught:
        list(read_rows(path, batch_rows=2))
    assert caught.value.row == 2


def test_extra_fields_are_ignored_and_unknown_files_refused(tmp_path):
    assert check_row({**row(), "later_field": 1}) == check_row(row())
    with pytest.raises(UnknownDatasetFormat, match="cannot tell"):
        format_of(tmp_path / "d.csv")
    assert format_of("D.JSONL.GZ") == "jsonl" and format_of("x", "parquet") == "parquet"
    (tmp_path / "d.parquet").write_text("not parquet")
    with pytest.raises(UnknownDatasetFormat, match="not a Parquet file"):
        next(read_rows(tmp_path / "d.parquet"))
    (tmp_path / "d.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(MalformedDatasetRow, match="cannot be read"):
        next(read_rows(tmp_path / "d.jsonl.gz"))


def test_non_finite_numbers_are_refused_when_written():
    with pytest.raises(DatasetError, match=r"rollout 'r1'.*NaN or infinite"):
        json_line(row(total_reward=float("nan")))
