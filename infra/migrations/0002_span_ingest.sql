-- Span ingestion without decoding in Python: stream processors post the Avro bodies of
-- SpanBatch records as an Avro object container file into spans_ingest (a Null table, so
-- nothing is stored there); the materialized views below flatten the batches into `spans`
-- (analytics, sorted by agent and time) and `rollout_spans` (trajectory assembly, sorted by
-- rollout, kept for a week). Column names mirror schemas/avro/span.avsc.

CREATE TABLE IF NOT EXISTS {database}.spans_ingest
(
    spans Array(Tuple(
        span_id String, rollout_id String, attempt_id String, parent_id Nullable(String), name String,
        kind String, start_time_us Int64, end_time_us Int64, status String, status_message Nullable(String),
        agent_name Nullable(String), task_id Nullable(String), group_id Nullable(String), model Nullable(String),
        attributes Map(String, String), prompt_token_ids Array(Int32), response_token_ids Array(Int32),
        response_logprobs Array(Float32), reward Nullable(Float64), reward_dimensions Map(String, Float64),
        policy_version Nullable(Int64)))
)
ENGINE = Null;

CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.spans_ingest_to_spans TO {database}.spans AS
SELECT
    s.span_id AS span_id, s.rollout_id AS rollout_id, s.attempt_id AS attempt_id,
    ifNull(s.parent_id, '') AS parent_id, s.name AS name, toString(s.kind) AS kind,
    fromUnixTimestamp64Micro(s.start_time_us, 'UTC') AS start_time,
    fromUnixTimestamp64Micro(s.end_time_us, 'UTC') AS end_time,
    toString(s.status) AS status, ifNull(s.status_message, '') AS status_message,
    ifNull(s.agent_name, '') AS agent_name, ifNull(s.task_id, '') AS task_id, ifNull(s.group_id, '') AS group_id,
    ifNull(s.model, '') AS model, s.policy_version AS policy_version, s.attributes AS attributes,
    arrayMap(x -> toUInt32(x), s.prompt_token_ids) AS prompt_token_ids,
    arrayMap(x -> toUInt32(x), s.response_token_ids) AS response_token_ids,
    s.response_logprobs AS response_logprobs, s.reward AS reward, s.reward_dimensions AS reward_dimensions
FROM {database}.spans_ingest
ARRAY JOIN spans AS s;

CREATE TABLE IF NOT EXISTS {database}.rollout_spans
(
    rollout_id         String,
    attempt_id         String,
    span_id            String,
    parent_id          String,
    name               String,
    kind               LowCardinality(String),
    start_us           Int64,
    end_us             Int64,
    status             LowCardinality(String),
    agent_name         LowCardinality(String),
    task_id            String,
    group_id           String,
    model              LowCardinality(String),
    policy_version     Nullable(Int64),
    prompt_token_ids   Array(Int32),
    response_token_ids Array(Int32),
    response_logprobs  Array(Float32),
    has_token_ids      UInt8,
    reward             Nullable(Float64),
    reward_dimensions  Map(String, Float64),
    ingested_at        DateTime DEFAULT now()
)
ENGINE = ReplacingMergeTree
ORDER BY (rollout_id, attempt_id, span_id)
TTL ingested_at + INTERVAL 7 DAY;

CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.spans_ingest_to_rollout_spans TO {database}.rollout_spans AS
SELECT
    s.rollout_id AS rollout_id, s.attempt_id AS attempt_id, s.span_id AS span_id,
    ifNull(s.parent_id, '') AS parent_id, s.name AS name, toString(s.kind) AS kind,
    s.start_time_us AS start_us, s.end_time_us AS end_us, toString(s.status) AS status,
    ifNull(s.agent_name, '') AS agent_name, ifNull(s.task_id, '') AS task_id, ifNull(s.group_id, '') AS group_id,
    ifNull(s.model, '') AS model, s.policy_version AS policy_version,
    s.prompt_token_ids AS prompt_token_ids, s.response_token_ids AS response_token_ids,
    s.response_logprobs AS response_logprobs,
    toUInt8(length(s.prompt_token_ids) > 0 AND length(s.response_token_ids) > 0) AS has_token_ids,
    s.reward AS reward, s.reward_dimensions AS reward_dimensions
FROM {database}.spans_ingest
ARRAY JOIN spans AS s;
