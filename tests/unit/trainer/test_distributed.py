"""The data-parallel trainer's pieces that need no process group: torchrun's environment, the backend, the shards."""

from __future__ import annotations

import pytest

from agentstream.infra.config import ConfigError, TrainerConfig
from agentstream.trainer.batching import Sample, token_weights
from agentstream.trainer.distributed import Ranks, backend_for, rank_config, shard_batch


def sample(name: str, rollout: str, prompt: list[int], response_tokens: int) -> Sample:
    return Sample(name, rollout, 0, prompt, list(range(5, 5 + response_tokens)), [-1.0] * response_tokens, 1.0, 1.0)


SAMPLES = [sample(f"g{g}-{i}", f"r{g % 2}", [g + 10] * (3 + g), 1 + (5 * i + g) % 9)
           for g in range(3) for i in range(4)]


def test_ranks_come_from_torchruns_environment_and_a_plain_process_has_none():
    assert Ranks.from_env({}) is None
    assert Ranks.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == Ranks(3, 4, 1)
    assert Ranks.from_env({"WORLD_SIZE": "1"}) == Ranks(0, 1, 0)
    assert Ranks(0, 2, 0).leader and not Ranks(1, 2, 1).leader


def test_the_backend_is_nccl_on_cuda_and_gloo_on_the_cpu_unless_set():
    assert backend_for(TrainerConfig(device="cpu")) == "gloo"
    assert backend_for(TrainerConfig(device="cuda:1")) == "nccl"
    assert backend_for(TrainerConfig(device="cuda", distributed_backend="gloo")) == "gloo"
    assert rank_config(TrainerConfig(device="cuda"), Ranks(5, 8, 1)).device == "cuda:1"
    assert rank_config(TrainerConfig(device="cpu"), Ranks(1, 2, 1)).device == "cpu"
    with pytest.raises(ConfigError, match="distributed_backend"):
        TrainerConfig(distributed_backend="mpi")
    with pytest.raises(ConfigError, match="distributed_timeout_s"):
        TrainerConfig(distributed_timeout_s=0)


@pytest.mark.parametrize("normalization", ["token", "transition", "rollout"])
@pytest.mark.parametrize("world", [2, 3])
def test_shards_hold_every_sample_once_with_the_whole_steps_weights(normalization, world):
    shards = shard_batch(SAMPLES, normalization, world)
    assert len(shards) == world and all(shards)
    assert sorted(s.transition_id for shard in shards for s, _ in shard) == sorted(s.transition_id for s in SAMPLES)
    weights = {s.transition_id: w for s, w in zip(SAMPLES, token_weights(SAMPLES, normalization), strict=True)}
    assert all(w == weights[s.transition_id] for shard in shards for s, w in shard)
    assert sum(w * s.trained_tokens for shard in shards for s, w in shard) == pytest.approx(1.0)
    tokens = [sum(s.length for s, _ in shard) for shard in shards]
    assert max(tokens) - min(tokens) <= max(s.length for s in SAMPLES)  # about equal work


def test_a_group_stays_together_where_it_fits_and_fewer_samples_than_ranks_leave_shards_empty():
    shards = shard_batch(SAMPLES, "token", 2)
    groups = [{s.transition_id.split("-")[0] for s, _ in shard} for shard in shards]
    assert len(groups[0] & groups[1]) <= 1  # ordered by prompt: at most the group at the cut is split
    assert sorted(map(len, shard_batch(SAMPLES[:1], "token", 3))) == [0, 0, 1]
