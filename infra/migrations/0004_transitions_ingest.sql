-- The stream processors get each batch of transitions from ClickHouse as Avro (for the Kafka
-- record) and hand the same container file back here: decoding it is cheaper than running
-- the credit/token-id join a second time. Column names mirror schemas/avro/transition.avsc.

CREATE TABLE IF NOT EXISTS {database}.transitions_ingest
(
    transition_id String, rollout_id String, span_id String, agent_name String, model String,
    policy_version Int64, step_index Int32, prompt_token_ids Array(Int32), response_token_ids Array(Int32),
    behaviour_logprobs Array(Float32), reward Float64, return_value Float64, advantage Float64,
    group_id Nullable(String), created_at_us Int64
)
ENGINE = Null;

CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.transitions_ingest_to_transitions TO {database}.transitions AS
SELECT
    transition_id, rollout_id, span_id, agent_name, model, policy_version, toUInt32(step_index) AS step_index,
    ifNull(group_id, '') AS group_id, arrayMap(x -> toUInt32(x), prompt_token_ids) AS prompt_token_ids,
    arrayMap(x -> toUInt32(x), response_token_ids) AS response_token_ids, behaviour_logprobs, reward, return_value,
    advantage, fromUnixTimestamp64Micro(created_at_us, 'UTC') AS created_at
FROM {database}.transitions_ingest;
