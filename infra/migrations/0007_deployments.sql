-- Every deployment decision (schemas/avro/deployment.avsc): candidate, evaluation scores,
-- canary results, promotion, rejection, rollback. "Why is v17 not serving?" is
--   SELECT decided_at, action, decided_by, reason FROM deployments FINAL
--   WHERE model = 'M' AND version = 17 ORDER BY decided_at

CREATE TABLE IF NOT EXISTS {database}.deployments
(
    decision_id        String,
    model              LowCardinality(String),
    version            Int64,
    action             LowCardinality(String),
    decided_by         LowCardinality(String),
    reason             String,
    format             LowCardinality(String),
    stable_version     Int64,
    canary_version     Nullable(Int64),
    canary_share       Float64,
    candidate_version  Nullable(Int64),
    candidate_score    Nullable(Float64),
    stable_score       Nullable(Float64),
    eval_tasks         Int64,
    canary_reward      Nullable(Float64),
    canary_rollouts    Int64,
    stable_reward      Nullable(Float64),
    stable_rollouts    Int64,
    decided_at         DateTime64(6, 'UTC')
)
ENGINE = ReplacingMergeTree
ORDER BY (model, version, decision_id);
