"""The trainer: transitions from Kafka, policy-gradient steps on exact token ids, checkpoints the fleet hot-swaps."""
