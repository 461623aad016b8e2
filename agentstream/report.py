"""`agentstream report`: read-only analytics over the ClickHouse tables, in five sections.

1. reward by policy version and agent (``rollouts``),
2. LLM calls by model: tokens and latency percentiles (``spans`` of kind LLM),
3. rollout status counts by agent (``rollouts``),
4. training: policy lag (staleness) and dropped stale samples per trained policy version (``train_steps``),
5. throughput: spans, LLM calls, tokens and finished rollouts per time bucket (``spans`` and ``rollouts``),
6. spans by source (SDK and proxy, OpenTelemetry): LLM spans without token ids are analytics only, never trained on.

Every table is a ReplacingMergeTree, so every query reads it with FINAL: a replayed insert must
not count twice. Filters are ClickHouse query parameters (``{name:Type}``), never formatted into
the SQL; an empty ``agent``/``model`` and a zero ``since_s`` mean "no filter".

A rollout's policy version comes from ``rollouts.policy_versions``: the stream processor fills it
with the distinct ``spans.policy_version`` of the rollout's LLM calls, so it is the version that
generated the behaviour (``transitions`` exist only for credited rollouts, and reading spans would
mean a join). A rollout that saw a hot swap has several versions; it counts under the newest one
and in the ``mixed_versions`` column.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

from clickhouse_connect.driver.client import Client

from agentstream.infra.clickhouse import ROLLOUT_POLICY_VERSION, ClickHouseError, server_message

# Statuses of a rollout that ended well: SUCCEEDED (a managed rollout's runner said so) and
# COMPLETED (an unmanaged one, e.g. online traffic, finished with a reward).
SUCCESS_STATUSES = ("SUCCEEDED", "COMPLETED")
# Not an outcome yet: the rollout is complete but waits for a late reward.
PENDING_STATUS = "AWAITING_REWARD"

ROLLOUT_FILTERS = """
    ({agent:String} = '' OR agent_name = {agent:String})
    AND ({model:String} = '' OR model = {model:String})
    AND ({since_s:UInt64} = 0 OR start_time >= now64(6) - toIntervalSecond({since_s:UInt64}))"""

SPAN_FILTERS = ROLLOUT_FILTERS  # spans carry the same agent_name, model and start_time columns

# Tokens of an LLM call: the exact token ids when the model server returned them, else the usage
# the API reported (OpenTelemetry GenAI attribute names, as the proxy records them). A call with
# n > 1 choices has one span per choice: each counts its own completion tokens, and the prompt
# is counted once, on the first choice's span (the proxy records input tokens only there).
PROMPT_TOKENS = ("if(attributes['agentstream.choice.index'] NOT IN ('', '0'), toUInt64(0), "
                 "if(empty(prompt_token_ids), toUInt64OrZero(attributes['gen_ai.usage.input_tokens']), "
                 "toUInt64(length(prompt_token_ids))))")
COMPLETION_TOKENS = ("if(empty(response_token_ids), toUInt64OrZero(attributes['gen_ai.usage.output_tokens']), "
                     "toUInt64(length(response_token_ids)))")

REWARD_BY_VERSION_SQL = f"""
SELECT
    agent_name AS agent,
    {ROLLOUT_POLICY_VERSION} AS policy_version,
    count() AS rollouts,
    countIf(length(policy_versions) > 1) AS mixed_versions,
    count(final_reward) AS rewarded,
    avg(final_reward) AS mean_reward,
    min(final_reward) AS min_reward,
    max(final_reward) AS max_reward,
    countIf(status IN {SUCCESS_STATUSES}) / nullIf(countIf(status != '{PENDING_STATUS}'), 0) AS success_rate
FROM rollouts FINAL
WHERE {ROLLOUT_FILTERS}
GROUP BY agent, policy_version
ORDER BY agent, policy_version NULLS FIRST
"""

LLM_BY_MODEL_SQL = f"""
SELECT
    model,
    count() AS calls,
    countIf(status = 'ERROR') AS errors,
    sum(prompt_tokens) AS prompt_tokens_total,
    sum(completion_tokens) AS completion_tokens_total,
    avg(completion_tokens) AS completion_tokens_per_call,
    quantile(0.5)(duration_ms) AS p50_ms,
    quantile(0.9)(duration_ms) AS p90_ms,
    quantile(0.99)(duration_ms) AS p99_ms,
    max(duration_ms) AS max_ms
FROM (
    SELECT model, status, duration_ms, {PROMPT_TOKENS} AS prompt_tokens, {COMPLETION_TOKENS} AS completion_tokens
    FROM spans FINAL
    WHERE kind = 'LLM' AND {SPAN_FILTERS}
)
GROUP BY model
ORDER BY calls DESC, model
"""

ROLLOUT_STATUS_SQL = f"""
SELECT
    agent_name AS agent,
    status,
    count() AS rollouts,
    count() / sum(count()) OVER (PARTITION BY agent_name) AS share,
    avg(final_reward) AS mean_reward,
    avg(dateDiff('microsecond', start_time, end_time)) / 1e6 AS mean_duration_s
FROM rollouts FINAL
WHERE {ROLLOUT_FILTERS}
GROUP BY agent_name, status
ORDER BY agent, rollouts DESC, status
"""

# Per-step means are weighted by the step's trained samples, so a big step counts for more.
TRAINING_SQL = """
SELECT
    model,
    policy_version,
    count() AS steps,
    min(step) AS first_step,
    max(step) AS last_step,
    sum(transitions) AS samples,
    sum(staleness_mean * transitions) / nullIf(sum(transitions), 0) AS lag_mean,
    max(staleness_max) AS lag_max,
    sum(dropped_stale) AS stale_dropped,
    sum(reward_mean * transitions) / nullIf(sum(transitions), 0) AS mean_reward,
    avg(loss) AS mean_loss,
    avg(kl) AS mean_kl
FROM train_steps FINAL
WHERE ({model:String} = '' OR model = {model:String})
  AND ({since_s:UInt64} = 0 OR created_at >= now64(6) - toIntervalSecond({since_s:UInt64}))
GROUP BY model, policy_version
ORDER BY model, policy_version
"""

# The newest activity (µs since the epoch, 0 when none): the throughput window ends at its bucket.
# max() needs no FINAL: a replayed row repeats a time, it cannot raise the maximum.
THROUGHPUT_NEWEST_SQL = f"""
SELECT greatest(
    (SELECT max(toUnixTimestamp64Micro(start_time)) FROM spans WHERE {SPAN_FILTERS}),
    (SELECT max(toUnixTimestamp64Micro(end_time)) FROM rollouts
     WHERE status != '{PENDING_STATUS}' AND {ROLLOUT_FILTERS})
) AS newest_us
"""

THROUGHPUT_SQL = f"""
SELECT bucket, sum(n_spans) AS spans, sum(n_llm) AS llm_calls, sum(n_tokens) AS tokens,
       sum(n_finished) AS rollouts_finished
FROM (
    SELECT toUnixTimestamp(toStartOfInterval(start_time, toIntervalSecond({{bucket_s:UInt32}}))) AS bucket,
           count() AS n_spans, countIf(kind = 'LLM') AS n_llm,
           sumIf({PROMPT_TOKENS} + {COMPLETION_TOKENS}, kind = 'LLM') AS n_tokens, toUInt64(0) AS n_finished
    FROM spans FINAL
    WHERE start_time >= fromUnixTimestamp64Micro({{from_us:Int64}}, 'UTC') AND {SPAN_FILTERS}
    GROUP BY bucket
    UNION ALL
    SELECT toUnixTimestamp(toStartOfInterval(end_time, toIntervalSecond({{bucket_s:UInt32}}))) AS bucket,
           toUInt64(0), toUInt64(0), toUInt64(0), count()
    FROM rollouts FINAL
    WHERE end_time >= fromUnixTimestamp64Micro({{from_us:Int64}}, 'UTC') AND status != '{PENDING_STATUS}'
      AND {ROLLOUT_FILTERS}
    GROUP BY bucket
)
GROUP BY bucket
ORDER BY bucket
"""

# Where spans came from (the OTLP receiver marks its own with agentstream.source = 'otlp'), and how many LLM
# spans have no token ids: those are captured and queryable but never become transitions (a hosted model's
# calls, or an instrumented client's view of a call the proxy captured with token ids).
SOURCES_SQL = f"""
SELECT
    if(attributes['agentstream.source'] = '', 'agentstream', attributes['agentstream.source']) AS source,
    count() AS spans,
    uniqExact(rollout_id) AS rollouts,
    countIf(kind = 'LLM') AS llm_spans,
    countIf(kind = 'LLM' AND (empty(prompt_token_ids) OR empty(response_token_ids))) AS llm_spans_without_token_ids,
    countIf(kind = 'REWARD') AS rewards
FROM spans FINAL
WHERE {SPAN_FILTERS}
GROUP BY source
ORDER BY source
"""

# The columns of each section, in the SQL's order: an empty result carries no column names, and an
# empty table still shows what it would hold.
REWARD_BY_VERSION_COLUMNS = ("agent", "policy_version", "rollouts", "mixed_versions", "rewarded", "mean_reward",
                             "min_reward", "max_reward", "success_rate")
LLM_BY_MODEL_COLUMNS = ("model", "calls", "errors", "prompt_tokens_total", "completion_tokens_total",
                        "completion_tokens_per_call", "p50_ms", "p90_ms", "p99_ms", "max_ms")
ROLLOUT_STATUS_COLUMNS = ("agent", "status", "rollouts", "share", "mean_reward", "mean_duration_s")
TRAINING_COLUMNS = ("model", "policy_version", "steps", "first_step", "last_step", "samples", "lag_mean", "lag_max",
                    "stale_dropped", "mean_reward", "mean_loss", "mean_kl")
THROUGHPUT_COLUMNS = ("bucket", "spans", "llm_calls", "tokens", "rollouts_finished")
SOURCES_COLUMNS = ("source", "spans", "rollouts", "llm_spans", "llm_spans_without_token_ids", "rewards")

DURATION = re.compile(r"(\d+)\s*([smhdw])")
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


@dataclass(frozen=True)
class ReportFilters:
    """What to report on: an agent, a model, a recent window, and the throughput bucketing."""

    agent: str = ""
    model: str = ""
    since_s: int = 0  # 0: all time
    bucket_s: int = 60
    buckets: int = 30

    def parameters(self) -> dict[str, Any]:
        """The query parameters every section's SQL understands (unused ones are ignored by the server)."""
        return {"agent": self.agent, "model": self.model, "since_s": self.since_s, "bucket_s": self.bucket_s}


@dataclass
class Section:
    """One table of the report: a stable key (JSON, CSV), a title (tables), its columns and rows."""

    key: str
    title: str
    columns: list[str]
    rows: list[tuple] = field(default_factory=list)

    def records(self) -> list[dict[str, Any]]:
        """Rows as JSON-ready objects: NaN and infinities become null, times ISO strings."""
        return [{column: _json_value(value) for column, value in zip(self.columns, row, strict=True)}
                for row in self.rows]


def parse_duration(text: str) -> int:
    """Seconds in a duration such as ``30s``, ``5m``, ``1h30m``, ``2d`` (a bare number is seconds), else ValueError."""
    cleaned = text.strip().lower()
    if cleaned.isdigit():
        seconds = int(cleaned)
    elif cleaned and DURATION.sub("", cleaned).strip() == "":
        seconds = sum(int(amount) * UNIT_SECONDS[unit] for amount, unit in DURATION.findall(cleaned))
    else:
        raise ValueError(f"{text!r} is not a duration like 30s, 5m, 1h or 2d")
    if seconds <= 0:
        raise ValueError(f"{text!r} must be longer than zero")
    return seconds


def _query(client: Client, sql: str, parameters: dict[str, Any]) -> tuple[list[str], list[tuple]]:
    """Run one read query; a server error becomes a ClickHouseError with ClickHouse's own message."""
    try:
        result = client.query(sql, parameters=parameters)
    except Exception as error:  # clickhouse-connect raises several types; the server's text says why
        raise ClickHouseError(server_message(error)) from None
    return list(result.column_names), [tuple(row) for row in result.result_rows]


def query_section(client: Client, key: str, title: str, sql: str, columns: Sequence[str],
                  filters: ReportFilters) -> Section:
    """One section straight from one SQL query; ``columns`` name them when the result is empty (and carries none)."""
    returned, rows = _query(client, sql, filters.parameters())
    if returned and tuple(returned) != tuple(columns):  # the SQL and its column list were edited apart
        raise ClickHouseError(f"report section {key}: query returned columns {returned}, expected {list(columns)}")
    return Section(key, title, list(columns), rows)


def throughput(client: Client, filters: ReportFilters) -> Section:
    """The last ``filters.buckets`` buckets, ending at the newest activity, with empty buckets as zeros.

    The window ends at the newest span or finished rollout rather than at "now", so a report over
    yesterday's run still shows that run; gaps are filled so a stall shows as zeros, not as a
    missing line. Buckets are aligned to the epoch (as ``toStartOfInterval`` aligns them).
    """
    size = filters.bucket_s
    title = f"Throughput per {format_duration(size)} bucket (UTC)"
    _, newest = _query(client, THROUGHPUT_NEWEST_SQL, filters.parameters())
    newest_us = int(newest[0][0] or 0) if newest else 0
    if newest_us <= 0:
        return Section("throughput", title, list(THROUGHPUT_COLUMNS))
    last = newest_us // 1_000_000 // size * size
    first = last - (filters.buckets - 1) * size
    _, rows = _query(client, THROUGHPUT_SQL, {**filters.parameters(), "from_us": first * 1_000_000})
    counts = {int(row[0]): row[1:] for row in rows}
    filled = []
    for start in range(first, last + 1, size):
        spans, llm_calls, tokens, finished = counts.get(start, (0, 0, 0, 0))
        stamp = datetime.fromtimestamp(start, UTC).strftime("%Y-%m-%d %H:%M:%S")
        filled.append((stamp, int(spans), int(llm_calls), int(tokens), int(finished)))
    return Section("throughput", title, list(THROUGHPUT_COLUMNS), filled)


def build_report(client: Client, filters: ReportFilters) -> list[Section]:
    """Every section of the report, in the order they print; read-only (SELECTs only)."""
    return [
        query_section(client, "reward_by_policy_version", "Reward by policy version and agent",
                      REWARD_BY_VERSION_SQL, REWARD_BY_VERSION_COLUMNS, filters),
        query_section(client, "llm_by_model", "LLM calls by model: tokens and latency",
                      LLM_BY_MODEL_SQL, LLM_BY_MODEL_COLUMNS, filters),
        query_section(client, "rollout_status", "Rollout status by agent",
                      ROLLOUT_STATUS_SQL, ROLLOUT_STATUS_COLUMNS, filters),
        query_section(client, "training", "Training: policy lag and stale samples by policy version",
                      TRAINING_SQL, TRAINING_COLUMNS, filters),
        throughput(client, filters),
        query_section(client, "sources", "Spans by source (LLM spans without token ids: analytics only, never trained)",
                      SOURCES_SQL, SOURCES_COLUMNS, filters),
    ]


def format_duration(seconds: int) -> str:
    """The shortest exact spelling of a duration (``90`` -> ``90s``, ``3600`` -> ``1h``), for titles."""
    for unit, size in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _json_value(value: Any) -> Any:
    """A value JSON can carry faithfully: NaN/inf -> None, datetimes -> ISO text, other odd types -> str."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, datetime):
        return value.isoformat()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def format_cell(column: str, value: Any) -> str:
    """A value as a table shows it: rates as percentages, floats to a few decimals, missing as '-'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        if column.endswith(("_rate", "share")):
            return f"{value * 100:.1f}%"
        if abs(value) >= 1000:
            return f"{value:,.1f}"
        return f"{value:.3f}".rstrip("0").rstrip(".") or "0"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}" if column not in ("policy_version", "first_step", "last_step") else str(value)
    return str(value)


def render_json(sections: Sequence[Section]) -> str:
    """One JSON object with a key per section, each a list of row objects."""
    return json.dumps({section.key: section.records() for section in sections}, indent=2) + "\n"


def render_csv(sections: Sequence[Section]) -> str:
    """Each section as a CSV block (header, rows) after a ``# key`` line, blocks separated by a blank line."""
    buffer = io.StringIO()
    for index, section in enumerate(sections):
        if index:
            buffer.write("\n")
        buffer.write(f"# {section.key}{' (no rows)' if not section.rows else ''}\n")
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(section.columns)
        writer.writerows([_json_value(v) for v in row] for row in section.rows)
    return buffer.getvalue()


def print_tables(sections: Sequence[Section], file: TextIO | None = None) -> None:
    """Each section as a rich table; an empty one says ``(no rows)``. Off a terminal, lines are never wrapped."""
    from rich.table import Table

    from agentstream.console import product_console

    console = product_console(file or sys.stdout)  # off a terminal: no colours, and no cell cut or folded
    for section in sections:
        table = Table(title=section.title, title_justify="left", caption="(no rows)" if not section.rows else None,
                      caption_justify="left")
        for column in section.columns:
            numeric = any(isinstance(row[section.columns.index(column)], (int, float)) for row in section.rows)
            table.add_column(column, justify="right" if numeric else "left", no_wrap=True)
        for row in section.rows:
            table.add_row(*(format_cell(column, value) for column, value in zip(section.columns, row, strict=True)))
        console.print(table)
        console.print()
