-- The five product tables. Every engine is ReplacingMergeTree keyed by a deterministic id,
-- so a replayed insert after a crash collapses into the row it repeats (query with FINAL,
-- or rely on background merges). Sort keys put the common analytics filters first.

CREATE TABLE IF NOT EXISTS {database}.spans
(
    span_id            String,
    rollout_id         String,
    attempt_id         String,
    parent_id          String,
    name               LowCardinality(String),
    kind               LowCardinality(String),
    start_time         DateTime64(6, 'UTC'),
    end_time           DateTime64(6, 'UTC'),
    status             LowCardinality(String),
    status_message     String,
    agent_name         LowCardinality(String),
    task_id            String,
    group_id           String,
    model              LowCardinality(String),
    policy_version     Nullable(Int64),
    attributes         Map(LowCardinality(String), String),
    prompt_token_ids   Array(UInt32),
    response_token_ids Array(UInt32),
    response_logprobs  Array(Float32),
    reward             Nullable(Float64),
    reward_dimensions  Map(LowCardinality(String), Float64),
    ingested_at        DateTime64(3, 'UTC') DEFAULT now64(3),
    duration_ms        Float64 ALIAS dateDiff('microsecond', start_time, end_time) / 1000,
    INDEX rollout_idx rollout_id TYPE bloom_filter GRANULARITY 4,
    INDEX policy_idx policy_version TYPE minmax GRANULARITY 4
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(start_time)
ORDER BY (agent_name, toStartOfHour(start_time), rollout_id, span_id);

CREATE TABLE IF NOT EXISTS {database}.rollouts
(
    rollout_id         String,
    attempt_id         String,
    task_id            String,
    group_id           String,
    agent_name         LowCardinality(String),
    model              LowCardinality(String),
    status             LowCardinality(String),
    start_time         DateTime64(6, 'UTC'),
    end_time           DateTime64(6, 'UTC'),
    span_count         UInt32,
    llm_calls          UInt32,
    llm_calls_without_tokens UInt32,
    final_reward       Nullable(Float64),
    total_reward       Float64,
    reward_dimensions  Map(LowCardinality(String), Float64),
    policy_versions    Array(Int64),
    updated_at         DateTime64(6, 'UTC'),
    INDEX start_idx start_time TYPE minmax GRANULARITY 4
)
ENGINE = ReplacingMergeTree(updated_at)
ORDER BY (agent_name, rollout_id);

CREATE TABLE IF NOT EXISTS {database}.transitions
(
    transition_id      String,
    rollout_id         String,
    span_id            String,
    agent_name         LowCardinality(String),
    model              LowCardinality(String),
    policy_version     Int64,
    step_index         UInt32,
    group_id           String,
    prompt_token_ids   Array(UInt32),
    response_token_ids Array(UInt32),
    behaviour_logprobs Array(Float32),
    reward             Float64,
    return_value       Float64,
    advantage          Float64,
    created_at         DateTime64(6, 'UTC'),
    INDEX rollout_idx rollout_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplacingMergeTree
ORDER BY (model, policy_version, transition_id);

CREATE TABLE IF NOT EXISTS {database}.checkpoints
(
    model              LowCardinality(String),
    version            Int64,
    uri                String,
    sha256             String,
    step               Int64,
    format             LowCardinality(String),
    metrics            Map(LowCardinality(String), Float64),
    created_at         DateTime64(6, 'UTC')
)
ENGINE = ReplacingMergeTree
ORDER BY (model, version);

CREATE TABLE IF NOT EXISTS {database}.train_steps
(
    model              LowCardinality(String),
    step               Int64,
    policy_version     Int64,
    loss               Float64,
    reward_mean        Float64,
    advantage_mean     Float64,
    advantage_std      Float64,
    kl                 Float64,
    entropy            Float64,
    clip_fraction      Float64,
    importance_weight_mean Float64,
    staleness_mean     Float64,
    staleness_max      Int64,
    dropped_stale      Int64,
    transitions        Int64,
    tokens             Int64,
    tokens_per_s       Float64,
    step_time_s        Float64,
    created_at         DateTime64(6, 'UTC')
)
ENGINE = ReplacingMergeTree
ORDER BY (model, step);
