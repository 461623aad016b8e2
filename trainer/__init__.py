"""The trainer: transitions from Kafka, policy-gradient steps on the exact token ids, checkpoints the fleet hot-swaps."""
