"""The dashboard's SQL: one function per chart or table, each returning a :class:`Chart` (title, shape, SQL).

Every query is plain ClickHouse SQL over the product tables, with ``{name:Type}`` parameters, so
the text the "show query" toggle displays can be pasted into any ClickHouse tool (Grafana's
ClickHouse data source, clickhouse-client, a notebook) with the parameters filled in.

Tables are ReplacingMergeTrees and are read with FINAL where a replayed row would count twice
(sums, counts, averages); ``max()`` reads need no FINAL. The exception is the aggregates over all
spans (throughput, LLM calls): FINAL over a million spans costs 3-5x the query itself, so they read
the table as stored. A span re-inserted by a replay after a crash counts twice there until
ClickHouse merges its part (minutes); ``agentstream report`` reads with FINAL for exact figures.
One rollout's spans are always read with FINAL. Time series end at the newest activity
in the database rather than at "now", so a finished run still shows; gaps are filled with zeros
by ``WITH FILL``.

Shapes the page knows how to draw:

- ``lines``: rows of (x, series, y) when ``series`` is set (one line per distinct series value),
  else rows of (x, y1, y2, ...), one line per column after x.
- ``table``: rows shown as they come.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from agentstream.infra.clickhouse import ROLLOUT_POLICY_VERSION
from agentstream.report import COMPLETION_TOKENS, PENDING_STATUS, PROMPT_TOKENS

Shape = Literal["lines", "table"]

# A rollout counts as evaluation traffic when it was captured but never trained on: the gate's
# and a demo's held-out runs (credit rule train = false, or the span's agentstream.train opt-out).
# Rollouts sampled for training are "sampled"; a failed or unrewarded rollout has no mode ('').
MODE = ("multiIf(training IN ('sampled', 'opted_in'), 'sampled', "
        "training IN ('not_trained', 'opted_out'), 'evaluation', '')")

# The newest activity of the database: series end here (an idle or finished run still shows).
NEWEST = ("greatest((SELECT max(start_time) FROM spans), (SELECT max(end_time) FROM rollouts), "
          "(SELECT max(created_at) FROM transitions))")


@dataclass(frozen=True)
class Chart:
    """One panel: a key (DOM id, API name), a title, what it draws and the SQL that feeds it."""

    key: str
    title: str
    shape: Shape
    sql: str
    x: str = ""                 # lines: the x column
    x_time: bool = False        # lines: x is unix seconds
    series: str = ""            # lines: long form, the column naming each line
    y: str = ""                 # lines: long form, the value column
    unit: str = ""              # the y axis' label
    note: str = ""              # one line under the title: what the chart counts
    parameters: tuple[str, ...] = field(default=())  # the parameters the SQL reads


# ---------------------------------------------------------------------------------------------- Overview

def throughput() -> Chart:
    """Spans, finished rollouts and transitions per second, per bucket, over the window ending at the newest."""
    sql = f"""
WITH {NEWEST} AS newest, toUnixTimestamp(newest) - {{window_s:UInt32}} AS since
SELECT bucket,
       sum(n_spans) / {{bucket_s:UInt32}} AS spans_per_s,
       sum(n_rollouts) / {{bucket_s:UInt32}} AS rollouts_per_s,
       sum(n_transitions) / {{bucket_s:UInt32}} AS transitions_per_s
FROM (
    SELECT toUnixTimestamp(toStartOfInterval(start_time, toIntervalSecond({{bucket_s:UInt32}}))) AS bucket,
           count() AS n_spans, toUInt64(0) AS n_rollouts, toUInt64(0) AS n_transitions
    FROM spans WHERE start_time >= toDateTime(since, 'UTC') GROUP BY bucket
    UNION ALL
    SELECT toUnixTimestamp(toStartOfInterval(end_time, toIntervalSecond({{bucket_s:UInt32}}))),
           toUInt64(0), count(), toUInt64(0)
    FROM rollouts FINAL WHERE end_time >= toDateTime(since, 'UTC') AND status != '{PENDING_STATUS}' GROUP BY 1
    UNION ALL
    SELECT toUnixTimestamp(toStartOfInterval(created_at, toIntervalSecond({{bucket_s:UInt32}}))),
           toUInt64(0), toUInt64(0), count()
    FROM transitions FINAL WHERE created_at >= toDateTime(since, 'UTC') GROUP BY 1
)
GROUP BY bucket
ORDER BY bucket WITH FILL STEP {{bucket_s:UInt32}}"""
    return Chart("throughput", "Throughput: spans, rollouts and transitions per second", "lines", sql.strip(),
                 x="bucket", x_time=True, unit="per second", parameters=("window_s", "bucket_s"),
                 note="spans by start time; rollouts by end time (finished, not awaiting a reward); transitions "
                      "by creation")


def serving() -> Chart:
    """Per trained model: the version serving, the canary and its share, and the versions still candidates."""
    sql = """
SELECT latest.model AS model, serving_version, canary_version, canary_share, candidates, last_action, last_decided_at
FROM (
    SELECT model, argMax(stable_version, decided_at) AS serving_version,
           argMax(canary_version, decided_at) AS canary_version, argMax(canary_share, decided_at) AS canary_share,
           argMax(concat(action, ' v', toString(version)), decided_at) AS last_action,
           max(decided_at) AS last_decided_at
    FROM deployments FINAL GROUP BY model
) AS latest
LEFT JOIN (
    SELECT model, arraySort(groupArray(version)) AS candidates
    FROM (SELECT model, version, argMax(action, decided_at) AS action FROM deployments FINAL GROUP BY model, version)
    WHERE action IN ('CANDIDATE', 'CANARY')
    GROUP BY model
) AS pending ON pending.model = latest.model
ORDER BY model"""
    return Chart("serving", "Serving versions per trained model", "table", sql.strip(),
                 note="from the deployments table: the routing after each model's latest decision")


def decisions() -> Chart:
    """The latest gate, canary and promotion decisions, newest first."""
    sql = """
SELECT decided_at, model, version, action, decided_by, candidate_score, stable_score, canary_reward, stable_reward,
       canary_rollouts, reason
FROM deployments FINAL
ORDER BY decided_at DESC
LIMIT {limit:UInt32}"""
    return Chart("decisions", "Latest deployment decisions (gate, canary, promotion)", "table", sql.strip(),
                 parameters=("limit",))


# ---------------------------------------------------------------------------------------------- Learning

def reward_by_version() -> Chart:
    """Mean final reward per policy version, one line per agent and mode (sampled for training, or evaluation)."""
    sql = f"""
SELECT {ROLLOUT_POLICY_VERSION} AS policy_version, concat(agent_name, ' · ', {MODE}) AS series,
       avg(final_reward) AS mean_reward
FROM rollouts FINAL
WHERE final_reward IS NOT NULL AND policy_version IS NOT NULL AND {MODE} != ''
GROUP BY policy_version, series
ORDER BY policy_version, series"""
    return Chart("reward_by_version", "Reward per policy version, by agent (sampled vs evaluation)", "lines",
                 sql.strip(), x="policy_version", series="series", y="mean_reward", unit="mean reward",
                 note="sampled: rollouts trained on; evaluation: captured, never trained on (held-out, gate)")


def heldout_accuracy() -> Chart:
    """Evaluation rollouts' mean reward over time, per agent, with the gate's candidate scores."""
    sql = f"""
WITH {NEWEST} AS newest, toUnixTimestamp(newest) - {{window_s:UInt32}} AS since
SELECT bucket, series, value FROM (
    SELECT toUnixTimestamp(toStartOfInterval(end_time, toIntervalSecond({{bucket_s:UInt32}}))) AS bucket,
           agent_name AS series, avg(final_reward) AS value
    FROM rollouts FINAL
    WHERE {MODE} = 'evaluation' AND final_reward IS NOT NULL AND end_time >= toDateTime(since, 'UTC')
    GROUP BY bucket, series
    UNION ALL
    SELECT toUnixTimestamp(toStartOfInterval(decided_at, toIntervalSecond({{bucket_s:UInt32}}))),
           concat(model, ' gate candidate score'), avg(candidate_score)
    FROM deployments FINAL
    WHERE candidate_score IS NOT NULL AND decided_at >= toDateTime(since, 'UTC')
    GROUP BY 1, 2
)
ORDER BY bucket, series"""
    return Chart("heldout_accuracy", "Held-out accuracy over time", "lines", sql.strip(), x="bucket", x_time=True,
                 series="series", y="value", unit="mean reward", parameters=("window_s", "bucket_s"),
                 note="evaluation rollouts' mean reward per bucket, and the gate's score for each candidate")


def _train_metric(key: str, title: str, metrics: tuple[str, ...], unit: str, note: str = "") -> Chart:
    names = ", ".join(f"'{metric}'" for metric in metrics)
    values = ", ".join(f"toFloat64({metric})" for metric in metrics)
    label = "model" if len(metrics) == 1 else "concat(model, ' · ', metric)"
    sql = f"""
SELECT step, {label} AS series, value
FROM train_steps FINAL
ARRAY JOIN [{names}] AS metric, [{values}] AS value
ORDER BY step, series"""
    return Chart(key, title, "lines", sql.strip(), x="step", series="series", y="value", unit=unit, note=note)


def step_time() -> Chart:
    """Seconds per optimizer step."""
    return _train_metric("step_time", "Trainer step time", ("step_time_s",), "seconds")


def tokens_per_s() -> Chart:
    """Trained tokens per second of step time."""
    return _train_metric("tokens_per_s", "Trainer tokens/s", ("tokens_per_s",), "tokens/s")


def staleness() -> Chart:
    """Transitions dropped as too stale, and the mean policy lag of those trained on, per step."""
    return _train_metric("staleness", "Staleness: dropped transitions and mean lag per step",
                         ("dropped_stale", "staleness_mean"), "transitions / versions",
                         note="dropped_stale: transitions older than max_policy_lag; staleness_mean: versions behind")


def kl_clip() -> Chart:
    """KL to the behaviour policy and the clipped fraction of token ratios, per step."""
    return _train_metric("kl_clip", "KL and clip fraction per step", ("kl", "clip_fraction"), "")


def prefix_merges_breaks() -> Chart:
    """Per agent, LLM calls merged into the trajectory sample before them and prefix breaks, per bucket of end time."""
    sql = f"""
WITH {NEWEST} AS newest, toUnixTimestamp(newest) - {{window_s:UInt32}} AS since
SELECT bucket, concat(agent_name, ' · ', counted) AS series, sum(value) AS calls
FROM (
    SELECT toUnixTimestamp(toStartOfInterval(end_time, toIntervalSecond({{bucket_s:UInt32}}))) AS bucket,
           agent_name, prefix_merges, prefix_breaks
    FROM rollouts FINAL
    WHERE end_time >= toDateTime(since, 'UTC') AND status != '{PENDING_STATUS}'
)
ARRAY JOIN ['merges', 'breaks'] AS counted, [prefix_merges, prefix_breaks] AS value
GROUP BY bucket, series
ORDER BY bucket, series"""
    return Chart("prefix_merges_breaks", "Trajectory merges and prefix breaks per agent", "lines", sql.strip(),
                 x="bucket", x_time=True, series="series", y="calls", unit="LLM calls",
                 parameters=("window_s", "bucket_s"),
                 note="merges: calls whose prompt extended the previous call's tokens exactly; breaks: calls where "
                      "it did not (retokenization drift); 0 at transition level")


def prefix_by_agent() -> Chart:
    """Per agent over the window: rollouts, merges, breaks and the break rate (breaks per call after the first)."""
    sql = f"""
WITH {NEWEST} AS newest, toUnixTimestamp(newest) - {{window_s:UInt32}} AS since
SELECT agent_name AS agent, count() AS rollouts, sum(prefix_merges) AS merges, sum(prefix_breaks) AS breaks,
       if(merges + breaks = 0, NULL, round(breaks / (merges + breaks), 4)) AS break_rate
FROM rollouts FINAL
WHERE end_time >= toDateTime(since, 'UTC') AND status != '{PENDING_STATUS}'
GROUP BY agent
ORDER BY agent"""
    return Chart("prefix_by_agent", "Prefix break rate per agent", "table", sql.strip(), parameters=("window_s",),
                 note="breaks / (merges + breaks) over the window: how often the agent's next prompt re-rendered "
                      "the previous call into other tokens")


def trajectory_samples() -> Chart:
    """LLM calls per trained sample and the samples that start at a prefix break, per step."""
    return _train_metric("trajectory_samples", "Calls per sample and prefix breaks per step",
                         ("calls_per_sample", "prefix_breaks"), "calls / samples",
                         note="calls_per_sample: LLM calls merged into each sample (1 at transition level); "
                              "prefix_breaks: samples of the step that start where a prefix broke")


# ---------------------------------------------------------------------------------------------- LLM calls

LLM_CALLS = f"""
    SELECT start_time, model, policy_version, status, duration_ms,
           {PROMPT_TOKENS} AS prompt_tokens, {COMPLETION_TOKENS} AS completion_tokens
    FROM spans
    WHERE kind = 'LLM'"""


def llm_by_model_version() -> Chart:
    """Calls, errors, tokens and latency percentiles per model and policy version, over the window."""
    sql = f"""
WITH {NEWEST} AS newest, toUnixTimestamp(newest) - {{window_s:UInt32}} AS since
SELECT model, policy_version, count() AS calls, countIf(status = 'ERROR') AS errors,
       sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens,
       round(quantile(0.5)(duration_ms), 1) AS p50_ms, round(quantile(0.9)(duration_ms), 1) AS p90_ms,
       round(quantile(0.99)(duration_ms), 1) AS p99_ms
FROM ({LLM_CALLS} AND start_time >= toDateTime(since, 'UTC')
)
GROUP BY model, policy_version
ORDER BY model, policy_version NULLS FIRST"""
    return Chart("llm_by_model_version", "LLM calls by model and version: tokens and latency", "table", sql.strip(),
                 parameters=("window_s",), note="over the window chosen at the top")


def llm_calls_over_time() -> Chart:
    """LLM calls per second, one line per model and version."""
    sql = f"""
WITH {NEWEST} AS newest, toUnixTimestamp(newest) - {{window_s:UInt32}} AS since
SELECT toUnixTimestamp(toStartOfInterval(start_time, toIntervalSecond({{bucket_s:UInt32}}))) AS bucket,
       concat(model, ' v', ifNull(toString(policy_version), '?')) AS series,
       count() / {{bucket_s:UInt32}} AS calls_per_s
FROM ({LLM_CALLS} AND start_time >= toDateTime(since, 'UTC')
)
GROUP BY bucket, series
ORDER BY bucket, series"""
    return Chart("llm_calls_over_time", "LLM calls per second by model and version", "lines", sql.strip(),
                 x="bucket", x_time=True, series="series", y="calls_per_s", unit="calls/s",
                 parameters=("window_s", "bucket_s"))


def llm_tokens_over_time() -> Chart:
    """Prompt and completion tokens per second."""
    sql = f"""
WITH {NEWEST} AS newest, toUnixTimestamp(newest) - {{window_s:UInt32}} AS since
SELECT toUnixTimestamp(toStartOfInterval(start_time, toIntervalSecond({{bucket_s:UInt32}}))) AS bucket,
       sum(prompt_tokens) / {{bucket_s:UInt32}} AS prompt_tokens_per_s,
       sum(completion_tokens) / {{bucket_s:UInt32}} AS completion_tokens_per_s
FROM ({LLM_CALLS} AND start_time >= toDateTime(since, 'UTC')
)
GROUP BY bucket
ORDER BY bucket WITH FILL STEP {{bucket_s:UInt32}}"""
    return Chart("llm_tokens_over_time", "LLM tokens per second", "lines", sql.strip(), x="bucket", x_time=True,
                 unit="tokens/s", parameters=("window_s", "bucket_s"))


def llm_latency_over_time() -> Chart:
    """Latency percentiles of LLM calls per bucket."""
    sql = f"""
WITH {NEWEST} AS newest, toUnixTimestamp(newest) - {{window_s:UInt32}} AS since
SELECT toUnixTimestamp(toStartOfInterval(start_time, toIntervalSecond({{bucket_s:UInt32}}))) AS bucket,
       quantile(0.5)(duration_ms) AS p50_ms, quantile(0.9)(duration_ms) AS p90_ms,
       quantile(0.99)(duration_ms) AS p99_ms
FROM ({LLM_CALLS} AND start_time >= toDateTime(since, 'UTC')
)
GROUP BY bucket
ORDER BY bucket"""
    return Chart("llm_latency_over_time", "LLM call latency percentiles", "lines", sql.strip(), x="bucket",
                 x_time=True, unit="ms", parameters=("window_s", "bucket_s"))


# ---------------------------------------------------------------------------------------------- Rollouts

def rollout_list() -> Chart:
    """The newest rollouts matching the filters (an empty filter matches everything)."""
    sql = f"""
SELECT rollout_id, agent_name AS agent, status, {ROLLOUT_POLICY_VERSION} AS policy_version, final_reward,
       span_count, llm_calls, training, start_time,
       round(dateDiff('microsecond', start_time, end_time) / 1e6, 3) AS duration_s
FROM rollouts FINAL
WHERE ({{agent:String}} = '' OR agent_name = {{agent:String}})
  AND ({{status:String}} = '' OR status = {{status:String}})
  AND ({{version:Int64}} < 0 OR has(policy_versions, {{version:Int64}}))
  AND ({{min_reward:Float64}} <= -1e300 OR final_reward >= {{min_reward:Float64}})
  AND ({{since_s:UInt64}} = 0 OR start_time >= now64(6) - toIntervalSecond({{since_s:UInt64}}))
ORDER BY start_time DESC
LIMIT {{limit:UInt32}}"""
    return Chart("rollout_list", "Rollouts", "table", sql.strip(),
                 parameters=("agent", "status", "version", "min_reward", "since_s", "limit"))


def rollout_filters() -> Chart:
    """The agents, statuses and versions present, for the list's filter menus."""
    sql = f"""
SELECT facet, value, n FROM (
    SELECT 'agent' AS facet, toString(agent_name) AS value, count() AS n FROM rollouts FINAL GROUP BY value
    UNION ALL
    SELECT 'status', toString(status), count() FROM rollouts FINAL GROUP BY 2
    UNION ALL
    SELECT 'version', toString({ROLLOUT_POLICY_VERSION}) AS v, count() FROM rollouts FINAL WHERE v IS NOT NULL
    GROUP BY 2
)
ORDER BY facet, if(facet = 'version', toInt64OrZero(value), 0), value"""
    return Chart("rollout_filters", "Filter values", "table", sql.strip())


def rollout_summary() -> Chart:
    """One rollout's row."""
    sql = f"""
SELECT rollout_id, attempt_id, task_id, group_id, agent_name AS agent, model, status, training,
       {ROLLOUT_POLICY_VERSION} AS policy_version, policy_versions, final_reward, total_reward, reward_dimensions,
       span_count, llm_calls, start_time, end_time
FROM rollouts FINAL
WHERE rollout_id = {{rollout_id:String}}"""
    return Chart("rollout_summary", "Rollout", "table", sql.strip(), parameters=("rollout_id",))


def rollout_spans() -> Chart:
    """Every span of one rollout, with its messages, token counts and reward."""
    sql = """
SELECT span_id, parent_id, name, kind, start_time, end_time, round(duration_ms, 2) AS duration_ms, status,
       status_message, model, policy_version, length(prompt_token_ids) AS prompt_tokens,
       length(response_token_ids) AS completion_tokens, reward, reward_dimensions,
       attributes['gen_ai.input.messages'] AS input_messages, attributes['gen_ai.output.messages'] AS output_messages,
       attributes['gen_ai.usage.input_tokens'] AS usage_input_tokens,
       attributes['gen_ai.usage.output_tokens'] AS usage_output_tokens, attributes
FROM spans FINAL
WHERE rollout_id = {rollout_id:String}
ORDER BY start_time, span_id"""
    return Chart("rollout_spans", "Spans", "table", sql.strip(), parameters=("rollout_id",))


def rollout_transitions() -> Chart:
    """The transitions one rollout became: the credit each LLM call received."""
    sql = """
SELECT transition_id, span_id, step_index, model, policy_version, reward, return_value, advantage,
       length(prompt_token_ids) AS prompt_tokens, length(response_token_ids) AS response_tokens, created_at
FROM transitions FINAL
WHERE rollout_id = {rollout_id:String}
ORDER BY step_index"""
    return Chart("rollout_transitions", "Transitions", "table", sql.strip(), parameters=("rollout_id",))


PAGES: dict[str, tuple[Chart, ...]] = {
    "overview": (throughput(), serving(), decisions()),
    "learning": (reward_by_version(), heldout_accuracy(), step_time(), tokens_per_s(), staleness(), kl_clip(),
                 trajectory_samples(), prefix_merges_breaks(), prefix_by_agent()),
    "llm": (llm_calls_over_time(), llm_tokens_over_time(), llm_latency_over_time(), llm_by_model_version()),
}
"""The ClickHouse panels of each page, in the order they show (the overview adds Kafka's lag and dead letters)."""

ROLLOUT_DETAIL = (rollout_summary(), rollout_spans(), rollout_transitions())
