-- Trajectory-level training samples ([[credit]] level = "trajectory"): successive LLM calls of a
-- rollout that extend each other token for token merge into one sample, with a loss mask over the
-- tokens the model did not generate (tool results, template glue); where the prefix breaks the
-- sample splits. Rows written before this read as one call, no mask, no break.

ALTER TABLE {database}.transitions ADD COLUMN IF NOT EXISTS loss_mask Array(Bool) DEFAULT [];
ALTER TABLE {database}.transitions ADD COLUMN IF NOT EXISTS merged_calls UInt32 DEFAULT 1;
ALTER TABLE {database}.transitions ADD COLUMN IF NOT EXISTS split_at_break Bool DEFAULT false;

ALTER TABLE {database}.transitions_ingest ADD COLUMN IF NOT EXISTS loss_mask Array(Bool);
ALTER TABLE {database}.transitions_ingest ADD COLUMN IF NOT EXISTS merged_calls Int32;
ALTER TABLE {database}.transitions_ingest ADD COLUMN IF NOT EXISTS split_at_break Bool;

DROP VIEW IF EXISTS {database}.transitions_ingest_to_transitions;

CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.transitions_ingest_to_transitions TO {database}.transitions AS
SELECT
    transition_id, rollout_id, span_id, agent_name, model, policy_version, toUInt32(step_index) AS step_index,
    ifNull(group_id, '') AS group_id, arrayMap(x -> toUInt32(x), prompt_token_ids) AS prompt_token_ids,
    arrayMap(x -> toUInt32(x), response_token_ids) AS response_token_ids, behaviour_logprobs, loss_mask,
    toUInt32(merged_calls) AS merged_calls, split_at_break, reward, return_value, advantage,
    fromUnixTimestamp64Micro(created_at_us, 'UTC') AS created_at
FROM {database}.transitions_ingest;

-- Per rollout (trajectory level): calls merged into the sample before them, and prefix breaks
-- (a call whose prompt did not start with the previous call's prompt + response: the rollout's
-- retokenization drift). Transition-level rollouts and rows written before this read 0.
ALTER TABLE {database}.rollouts ADD COLUMN IF NOT EXISTS prefix_merges UInt32 DEFAULT 0;
ALTER TABLE {database}.rollouts ADD COLUMN IF NOT EXISTS prefix_breaks UInt32 DEFAULT 0;

-- Per optimizer step: the mean number of LLM calls per sample (1 at transition level) and the
-- samples that start at a prefix break.
ALTER TABLE {database}.train_steps ADD COLUMN IF NOT EXISTS calls_per_sample Float64 DEFAULT 1;
ALTER TABLE {database}.train_steps ADD COLUMN IF NOT EXISTS prefix_breaks Int64 DEFAULT 0;
