-- Credit computed by the stream processors, staged so ClickHouse can join it with the token ids
-- it already holds (rollout_spans) when it writes transitions: a batch is a few rows of scalars
-- per LLM call, addressed by batch_id; the token arrays never travel back to the processor.

CREATE TABLE IF NOT EXISTS {database}.credit_staging
(
    batch_id       String,
    transition_id  String,
    rollout_id     String,
    span_id        String,
    agent_name     String,
    model          String,
    step_index     Int32,
    reward         Float64,
    return_value   Float64,
    advantage      Float64,
    group_id       Nullable(String),
    created_at_us  Int64,
    staged_at      DateTime DEFAULT now()
)
ENGINE = MergeTree
ORDER BY (batch_id, rollout_id, step_index)
TTL staged_at + INTERVAL 1 DAY;
