"""Two gloo ranks on the CPU hold the weights one rank would after the same batches; a dead rank stops the other.

The ranks are two spawned processes (``trainer/distributed.py``'s Group, as ``train-worker``
runs it under torchrun, without Kafka): rank 0 shards each batch and leads, rank 1 follows.
The single-rank reference is ``train_step`` on the whole batch in this process.

What data parallelism must get right is the gradient: the ranks' summed gradient is one rank's
up to float32 rounding (about 1e-8 here, on gradients of about 1e-2). With plain SGD the
weights then agree within 1e-6, for every loss normalisation and with gradient accumulation.
AdamW, the trainer's optimizer, divides each element by the root of its second moment plus
eps = 1e-8, so an element whose gradient is itself about 1e-9 moves by a sizeable fraction of
lr whatever its exact value: rounding there shows in the weights (measured up to 8e-5 at
lr 1e-3 with two micro-batches). AdamW's case is checked against the distance the weights
moved instead.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from agentstream.infra.config import TrainerConfig
from agentstream.infra.kafka import create_topics, topic_name
from agentstream.infra.processes import free_port
from agentstream.trainer.batching import Batch, Counts, Sample, token_weights
from agentstream.trainer.checkpoint_writer import manifests, open_store
from agentstream.trainer.distributed import Group, Ranks, Shard, join, leave, shard_batch
from agentstream.trainer.policy import Policy, build_policy
from agentstream.trainer.step import train_step
from tests.integration.test_trainer_worker import produce, transition
from tests.support.streams_harness import worker_env
from tests.support.torchrun import Torchrun
from tests.support.trainer_configs import tiny_trainer_toml

BASE = TrainerConfig(model="tiny", device="cpu", threads=1, lr=1e-3, distributed_backend="gloo",
                     distributed_timeout_s=60)
CASES = {  # name: settings, optimizer
    "adamw-token": (BASE, "adamw"),
    "adamw-resumed": (BASE, "adamw"),  # rank 0 takes the first step alone, as if it had loaded a checkpoint
    "sgd-token": (BASE, "sgd"),
    "sgd-transition": (replace(BASE, loss_normalization="transition"), "sgd"),
    "sgd-rollout-accumulated": (replace(BASE, loss_normalization="rollout", accumulation_steps=2), "sgd"),
    "sgd-token-micro-batches": (replace(BASE, micro_batch_tokens=48), "sgd"),
    "sgd-lora-kl": (replace(BASE, lora=True, lora_r=4, kl_coef=0.1), "sgd"),  # the adapter is what the ranks sum
    "sgd-token-per-rank-mean": (BASE, "sgd"),  # the planted mistake: each rank's own token mean, averaged
}
ATOL = 1e-6
ADAPTER_ATOL = 1e-5  # LoRA's product B·A carries the float32 rounding of the summed gradient further: 2.0e-6 was seen


def policy_for(case: str, config: TrainerConfig | None = None) -> Policy:
    """The case's policy (on ``config``'s device where given), with plain SGD where the case says so."""
    config = config or CASES[case][0]
    optimizer = CASES[case][1]
    policy = build_policy(config)
    if optimizer == "sgd":
        policy.optimizer = torch.optim.SGD(policy.trainable(), lr=1.0)
    return policy


def per_rank_mean(samples: list[Sample], normalization: str, world: int) -> list[Shard]:
    """What DDP does with a per-rank mean loss: each shard normalised alone, the ranks' gradients averaged."""
    shards = [[s for s, _ in shard] for shard in shard_batch(samples, normalization, world)]
    return [list(zip(shard, [w / world for w in token_weights(shard, normalization)], strict=True)) if shard else []
            for shard in shards]


def batches() -> list[Batch]:
    """Three steps of GRPO-like groups (a shared prompt, responses of 1 to 12 tokens) and lone samples, then one sample.

    Lengths differ so that the shards of a step hold different numbers of trained tokens.
    """
    generator = torch.Generator().manual_seed(7)
    steps = []
    for step in range(3):
        samples = []
        for group in range(2 + step):
            prompt = torch.randint(5, 200, (3 + 4 * group,), generator=generator).tolist()
            for index in range(3):
                length = 1 + (5 * index + 3 * group + step) % 12
                response = torch.randint(5, 200, (length,), generator=generator).tolist()
                samples.append(Sample(f"s{step}-{group}-{index}", f"r{step}-{group % 2}", 0, prompt, response,
                                      [-4.0 + 0.1 * index] * length, 1.0, float(index) - 1.0 + 0.3 * group))
        lone = torch.randint(5, 200, (20,), generator=generator).tolist()
        samples.append(Sample(f"s{step}-lone", f"r{step}-lone", 0, lone[:6], lone[6:], [-3.0] * 14, 1.0, 0.7))
        steps.append(Batch(samples, 0, Counts()))
    steps.append(Batch(steps[0].samples[:1], 0, Counts()))  # one rank's shard is empty
    return steps


def _rank(rank: int, port: int, folder: str, cases: list[str]) -> None:
    """One rank: for each case a fresh tiny policy, synced from rank 0, trained on the batches; weights saved."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ranks = Ranks(rank, 2, rank)
    join(BASE, ranks)
    try:
        for case in cases:
            config = CASES[case][0]
            policy = policy_for(case)
            if rank == 1:  # a different start, which rank 0's sync must overwrite
                with torch.no_grad():
                    for parameter in policy.trainable():
                        parameter.add_(0.01)
            group = Group(policy, config, ranks, per_rank_mean if case.endswith("per-rank-mean") else shard_batch)
            alone = 1 if case == "adamw-resumed" else 0
            if rank == 0:
                losses = [train_step(policy, batch, config).loss for batch in batches()[:alone]]
                group.sync()  # the weights and AdamW's moments
                losses += [group.step(batch).loss for batch in batches()[alone:]]
                group.stop()
            else:
                assert group.follow() == len(batches()) - alone
                losses = []
            torch.save({"weights": [p.detach().clone() for p in policy.trainable()], "losses": losses},
                       Path(folder) / f"{case}-rank{rank}.pt")
    finally:
        leave()


def one_rank(case: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    """The weights before and after the batches on one rank, and each step's loss."""
    policy = policy_for(case)
    start = [p.detach().clone() for p in policy.trainable()]
    losses = [train_step(policy, batch, CASES[case][0]).loss for batch in batches()]
    return start, [p.detach().clone() for p in policy.trainable()], losses


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """Every case trained by two spawned gloo ranks (one spawn: the imports cost more than the training)."""
    folder = tmp_path_factory.mktemp("ranks")
    context = mp.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=_rank, args=(rank, port, str(folder), list(CASES))) for rank in (0, 1)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    for process in processes:
        if process.is_alive():
            process.kill()
    assert [p.exitcode for p in processes] == [0, 0]
    return folder


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("case", [case for case in CASES if case.startswith("sgd") and "per-rank" not in case])
def test_two_gloo_ranks_hold_the_weights_one_rank_would(two_ranks, case):
    torch.set_num_threads(1)
    start, expected, expected_losses = one_rank(case)
    leader, follower = (torch.load(two_ranks / f"{case}-rank{rank}.pt") for rank in (0, 1))
    assert max_difference(expected, start) > 1e-3  # the steps moved the weights
    assert max_difference(leader["weights"], expected) <= (ADAPTER_ATOL if "lora" in case else ATOL)
    assert max_difference(follower["weights"], leader["weights"]) == 0  # the same summed gradient, the same step
    assert leader["losses"] == pytest.approx(expected_losses, abs=1e-6)


@pytest.mark.parametrize("case", ["adamw-token", "adamw-resumed"])
def test_with_adamw_two_ranks_stay_within_a_thousandth_of_the_distance_moved(two_ranks, case):
    """``adamw-resumed``: rank 1 gets AdamW's moments from rank 0's sync, or it would step differently."""
    torch.set_num_threads(1)
    start, expected, _ = one_rank(case)
    leader, follower = (torch.load(two_ranks / f"{case}-rank{rank}.pt") for rank in (0, 1))
    moved = max_difference(expected, start)
    assert moved > 1e-3
    assert max_difference(leader["weights"], expected) <= 1e-3 * moved
    assert max_difference(follower["weights"], leader["weights"]) == 0


def test_the_check_fails_on_per_rank_means_averaged(two_ranks):
    """The shards hold different numbers of tokens, so averaging each rank's own token mean gives other weights."""
    shards = shard_batch(batches()[0].samples, "token", 2)
    assert len({sum(s.trained_tokens for s, _ in shard) for shard in shards}) == 2
    _, expected, _ = one_rank("sgd-token")
    planted = torch.load(two_ranks / "sgd-token-per-rank-mean-rank0.pt")
    assert max_difference(planted["weights"], expected) > 100 * ATOL


def _doomed(rank: int, port: int, folder: str) -> None:
    """Rank 0 steps forever; rank 1 follows. The test kills one of them."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    config = replace(BASE, distributed_timeout_s=20)
    ranks = Ranks(rank, 2, rank)
    join(config, ranks)
    group = Group(build_policy(config), config, ranks)
    if rank == 0:
        group.sync()
        batch = batches()[0]
        while True:
            group.step(batch)
            (Path(folder) / "stepped").touch()
    else:
        group.follow()


@pytest.mark.parametrize("killed", [0, 1])
def test_a_killed_rank_makes_the_other_exit_non_zero(tmp_path, killed):
    context = mp.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=_doomed, args=(rank, port, str(tmp_path))) for rank in (0, 1)]
    for process in processes:
        process.start()
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "stepped").exists():
            assert time.monotonic() < deadline and all(p.is_alive() for p in processes), "no step was taken"
            time.sleep(0.05)
        os.kill(processes[killed].pid, signal.SIGKILL)
        survivor = processes[1 - killed]
        survivor.join(timeout=45)
        assert not survivor.is_alive(), "the surviving rank hangs"
        assert survivor.exitcode not in (0, None)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()


def _idle(rank: int, port: int, keepalive: bool) -> None:
    """Rank 0 idles for 2.5 collective timeouts (keeping the group alive or not), then steps once and stops."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    config = replace(BASE, distributed_timeout_s=2)
    ranks = Ranks(rank, 2, rank)
    policy = build_policy(config)  # before joining: the ranks then meet well within the 2 s
    join(config, ranks)
    try:
        group = Group(policy, config, ranks)
        if rank == 0:
            group.sync()
            idle_until = time.monotonic() + 5
            while time.monotonic() < idle_until:  # as the worker's consume loop does between batches
                if keepalive and group.idle_s() > group.keepalive_s:
                    group.keepalive()
                time.sleep(0.1)
            group.step(batches()[0])
            group.stop()
        else:
            assert group.follow() == 1
    finally:
        leave()


@pytest.mark.parametrize("keepalive", [True, False])
def test_an_idle_group_outlives_the_collective_timeout_only_with_keepalives(keepalive):
    context = mp.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=_idle, args=(rank, port, keepalive)) for rank in (0, 1)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
    if keepalive:
        assert [p.exitcode for p in processes] == [0, 0]
    else:  # the waiting rank gave up after 2 s, and rank 0's step found it gone
        assert processes[1].exitcode not in (0, None) and processes[0].exitcode not in (0, None)


def _leaving(rank: int, port: int, folder: str) -> None:
    """Join, build an optimizer (as every rank's policy does), take the stop, leave; write this process's threads."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ranks = Ranks(rank, 2, rank)
    join(BASE, ranks)
    policy = policy_for("adamw-token")
    group = Group(policy, BASE, ranks)
    group.stop() if rank == 0 else group.follow()
    leave()
    threads = [Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task")]
    (Path(folder) / f"threads-{rank}").write_text("\n".join(threads))


def test_leaving_ends_the_groups_threads(tmp_path):
    """Left running, a gloo worker thread that drops its last collective while the interpreter exits aborts the rank."""
    context = mp.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=_leaving, args=(rank, port, str(tmp_path))) for rank in (0, 1)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert [p.exitcode for p in processes] == [0, 0]
    for rank in (0, 1):
        threads = (tmp_path / f"threads-{rank}").read_text().split()
        assert not [name for name in threads if "gloo" in name], (rank, threads)


def _nccl_rank(rank: int, world: int, port: int, folder: str) -> None:
    """One NCCL rank on GPU ``rank``: the SGD and AdamW token cases, weights saved (on the CPU)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ranks = Ranks(rank, world, rank)
    join(nccl(BASE, rank), ranks)
    try:
        for case in ("sgd-token", "adamw-token"):
            config = nccl(CASES[case][0], rank)
            policy = policy_for(case, config)
            group = Group(policy, config, ranks)
            if rank == 0:
                group.sync()
                for batch in batches():
                    group.step(batch)
                group.stop()
            else:
                group.follow()
            torch.save([p.detach().cpu() for p in policy.trainable()], Path(folder) / f"{case}-nccl-rank{rank}.pt")
    finally:
        leave()


def nccl(config: TrainerConfig, gpu: int) -> TrainerConfig:
    return replace(config, device=f"cuda:{gpu}", dtype="float32", distributed_backend="nccl")


def test_nccl_ranks_hold_the_weights_one_rank_would(tmp_path):
    """``make gpu-check``: NCCL ranks on the GPUs there are, at most two, against one rank on GPU 0.

    NCCL will not put two ranks on one GPU, so with one GPU this is a world of one: it checks
    the NCCL path (object scatter, all-reduce, sync) on CUDA, not the splitting of a step.
    """
    if not torch.cuda.is_available():
        if os.environ.get("AGENTSTREAM_REQUIRE_CUDA"):
            pytest.fail("AGENTSTREAM_REQUIRE_CUDA is set (make gpu-check) but torch sees no CUDA device")
        pytest.skip("NCCL needs a CUDA device; this machine has none")
    world = min(2, torch.cuda.device_count())
    print(f"NCCL: {world} rank(s) on {torch.cuda.device_count()} GPU(s)")
    context = mp.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=_nccl_rank, args=(rank, world, port, str(tmp_path))) for rank in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=300)
    assert [p.exitcode for p in processes] == [0] * world
    for case in ("sgd-token", "adamw-token"):
        config = nccl(CASES[case][0], 0)
        policy = policy_for(case, config)
        start = [p.detach().cpu().clone() for p in policy.trainable()]
        for batch in batches():
            train_step(policy, batch, config)
        expected = [p.detach().cpu() for p in policy.trainable()]
        ranks = [torch.load(tmp_path / f"{case}-nccl-rank{rank}.pt") for rank in range(world)]
        moved = max_difference(expected, start)
        assert moved > 1e-3
        bound = ATOL if case.startswith("sgd") else 1e-3 * moved
        assert max_difference(ranks[0], expected) <= bound, case
        assert all(max_difference(weights, ranks[0]) == 0 for weights in ranks[1:]), case



def test_under_torchrun_a_killed_rank_restarts_the_group_and_no_transition_is_lost_or_trained_twice(
        topics_config, stack, kafka_options, tmp_path, clickhouse):
    """`torchrun --nproc-per-node 2 --max-restarts 1 -m agentstream train-worker`: rank 1 is killed after v2.

    torchrun stops rank 0 and starts both again; rank 0 resumes from its last checkpoint's offsets.
    Every transition is then in the lineage's trained ids exactly once.
    """
    model = f"tiny-ranks-{uuid.uuid4().hex[:6]}"
    database = f"trainer_{uuid.uuid4().hex[:8]}"
    checkpoints = tmp_path / "checkpoints"
    env = worker_env(tmp_path, stack, topics_config.topics.prefix, database,
                     tiny_trainer_toml(model, checkpoints, distributed_timeout_s=60))
    asyncio.run(create_topics(topics_config, stack.bootstrap_servers))
    topic = topic_name(topics_config.topics, "transitions")
    records = [transition(f"t{i:02d}", model, advantage=(-1.0) ** i) for i in range(40)]
    group = Torchrun(["--nproc-per-node", "2", "--max-restarts", "1"], ["train-worker"], env,
                     tmp_path / "torchrun.log").start()
    try:
        asyncio.run(produce(kafka_options, topic, records[:20]))
        follower = int(group.wait_for(r"rank 1 of 2 \(gloo\), pid (\d+)").group(1))
        group.wait_for(r"checkpoint v2 ")
        os.kill(follower, signal.SIGKILL)
        group.wait_for(r"resumed from version \d+ \(step \d+\)")
        # the rest, plus replays of transitions already trained (t00, t03) and maybe lost with the group (t16)
        asyncio.run(produce(kafka_options, topic, [*records[20:], records[0], records[3], records[16]]))
        group.wait_for(r"step +10 ")
    finally:
        group.stop()  # SIGTERM: rank 0 writes a last checkpoint, then stops rank 1
    log_text = group.log()
    lineage = manifests(open_store(str(checkpoints)), model)
    trained = [transition_id for m in lineage for transition_id in m.trained_ids]
    assert len(trained) == len(set(trained)) == 40, log_text[-4000:]  # every transition once in the lineage
    assert lineage[-1].step == 10
    assert len(re.findall(r"rank 1 of 2 \(gloo\), pid", log_text)) == 2  # the group was started again
    print("\n".join(line for line in log_text.splitlines()
                    if re.search(r"resumed|checkpoint v|rank \d of|failed|Error|restart", line)))
    clickhouse.command(f"DROP DATABASE IF EXISTS {database}")
