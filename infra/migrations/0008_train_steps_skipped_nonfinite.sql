-- Optimizer steps the trainer skipped because their loss or gradient norm was not finite (a NaN
-- never reaches the weights or AdamW's state). A skipped batch is not a step: the next step's
-- row counts the batches skipped since the previous one. Rows written before this read 0.

ALTER TABLE {database}.train_steps ADD COLUMN IF NOT EXISTS skipped_nonfinite Int64 DEFAULT 0;
