-- Training traffic selection: every rollout is still captured, but only some are trained on
-- (a span's agentstream.train opt-in/opt-out, else the credit rule's sample_rate). A rollouts
-- row says which and why: opted_out, opted_in, sampled, sampled_out or not_trained; '' for a
-- rollout that failed or still awaits its reward. Rows written before this read ''.

ALTER TABLE {database}.rollouts ADD COLUMN IF NOT EXISTS training LowCardinality(String) DEFAULT '';
