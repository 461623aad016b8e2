-- Stream processors now keep each open rollout's spans in memory (token arrays still encoded)
-- and build transitions from them, reading the `spans` table only for rollouts completed by
-- silence or by a late reward. The copy of every span sorted by rollout, and the staging
-- table the old ClickHouse-side join used, are no longer written or read.

DROP VIEW IF EXISTS {database}.spans_ingest_to_rollout_spans;
DROP TABLE IF EXISTS {database}.rollout_spans;
DROP TABLE IF EXISTS {database}.credit_staging;
