"""Trainer pieces without services: the loss against hand-computed numbers, batching, the step, checkpoint files."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from infra.config import ConfigError, TrainerConfig, load_config
from models import sha256_file
from trainer.batching import (
    Batch,
    Batcher,
    Counts,
    PackedMicroBatch,
    Sample,
    SeenIds,
    TransitionError,
    collate,
)
from trainer.checkpoints import (
    CheckpointError,
    FolderStore,
    UnsupportedStore,
    find_version,
    keep_only_newest,
    latest_manifest,
    manifests,
    open_store,
    prune,
    recent_trained_ids,
    write_checkpoint,
)
from trainer.loss import policy_loss
from trainer.policy import build_policy, load_weights, save_weights, save_weights_later
from trainer.step import token_logprobs, train_step

# ---------------------------------------------------------------- loss


def test_each_branch_of_the_dual_clip_surrogate_by_hand():
    # ratio ρ and advantage A per token; ε = 0.2, c = 2:
    #   ρ=1.5 A=+1 -> min(1.5, 1.2)        = 1.2  loss -1.2  clipped, no gradient
    #   ρ=0.5 A=+1 -> min(0.5, 0.8)        = 0.5  loss -0.5  d/dlogp = -ρA = -0.5
    #   ρ=0.5 A=-1 -> min(-0.5, -0.8)      = -0.8 loss 0.8   clipped, no gradient
    #   ρ=3.0 A=-1 -> max(min(-3,-1.2),-2) = -2   loss 2.0   truncated at c, no gradient
    #   ρ=1.5 A=-1 -> max(min(-1.5,-1.2),-2) = -1.5 loss 1.5 d/dlogp = -ρA = +1.5
    ratios = torch.tensor([[1.5, 0.5, 0.5, 3.0, 1.5]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    behaviour = torch.full((1, 5), -1.0)
    logprobs = (behaviour + ratios.log()).requires_grad_()
    out = policy_loss(logprobs, behaviour, advantages, torch.ones(1, 5), clip_eps=0.2, importance_cap=2.0)
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 2.0 + 1.5) / 5)
    out.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 5, 0.0, 0.0, 1.5 / 5])
    assert out.stats.tokens == 5
    assert out.stats.clipped == 2 and out.stats.truncated == 1
    assert out.stats.mean("importance_weight") == pytest.approx((1.5 + 0.5 + 0.5 + 2.0 + 1.5) / 5)
    assert out.stats.mean("pg_loss") == pytest.approx(2.6 / 5)


def test_mask_per_sequence_advantages_and_the_normalizer():
    behaviour = torch.log(torch.full((2, 3), 0.5))
    advantages = torch.tensor([2.0, -1.0])  # broadcast over each sequence's tokens
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # ratio 1 everywhere: tokens lose -2, -2 and +1; the masked ones count for nothing
    out = policy_loss(behaviour.clone(), behaviour, advantages, mask)
    assert out.loss.item() == pytest.approx(-3 / 3)
    halved = policy_loss(behaviour.clone(), behaviour, advantages, mask, weights=mask / 6)  # 1/6 per token, not 1/3
    assert halved.loss.item() == pytest.approx(-0.5)


def test_kl_and_entropy_terms_by_hand():
    logprobs = torch.log(torch.tensor([[0.25]]))
    reference = torch.log(torch.tensor([[0.5]]))
    # k3: exp(r - l) - (r - l) - 1 with r - l = ln 2  ->  2 - ln 2 - 1
    kl = 1 - math.log(2)
    out = policy_loss(logprobs, logprobs.clone(), torch.tensor([0.0]), torch.ones(1, 1), ref_logprobs=reference,
                      kl_coef=0.1, entropy=torch.tensor([[1.5]]), entropy_coef=0.01)
    assert out.loss.item() == pytest.approx(0.1 * kl - 0.01 * 1.5)
    assert out.stats.mean("kl") == pytest.approx(kl)
    assert out.stats.mean("entropy") == pytest.approx(1.5)


# ---------------------------------------------------------------- batching


def sample(tid: str, version: int = 0, prompt: int = 3, response: int = 2, advantage: float = 1.0,
           position=None) -> Sample:
    return Sample(tid, "r", version, list(range(10, 10 + prompt)), list(range(50, 50 + response)),
                  [-0.5] * response, 1.0, advantage, position)


def batcher(**overrides) -> Batcher:
    options = {"batch_tokens": 0, "batch_transitions": 4, "batch_wait_s": 0, "max_policy_lag": 2,
               "skip_zero_advantage": True, "seen": SeenIds(100)}
    options.update(overrides)
    return Batcher(**options)


def test_transition_records_are_checked():
    record = {"transition_id": "t", "rollout_id": "r", "policy_version": 1, "prompt_token_ids": [1],
              "response_token_ids": [2, 3], "behaviour_logprobs": [-0.1], "reward": 1.0, "advantage": 0.5}
    with pytest.raises(TransitionError, match="1 logprobs for 2"):
        Sample.from_record(record)
    with pytest.raises(TransitionError, match="no prompt"):
        Sample.from_record({**record, "prompt_token_ids": []})
    assert Sample.from_record({**record, "behaviour_logprobs": [-0.1, -0.2]}, ("t", 0, 7)).position == ("t", 0, 7)


def test_duplicates_stale_and_flat_transitions_are_dropped_and_counted():
    b = batcher()
    assert b.offer(sample("a"), current_version=1, now=0)
    assert not b.offer(sample("a"), current_version=1, now=0)  # queued already
    assert not b.offer(sample("old", version=0), current_version=3, now=0)  # lag 3 > 2
    assert not b.offer(sample("flat", advantage=0.0), current_version=1, now=0)
    assert b.offer(sample("b", version=1), current_version=1, now=0)
    batch = b.take(current_version=3)  # "a" (lag 3) went stale while it waited
    assert [s.transition_id for s in batch.samples] == ["b"]
    assert (batch.counts.duplicate, batch.counts.stale, batch.counts.uninformative) == (1, 2, 1)
    assert batch.lags() == [2]
    assert not b.offer(sample("b", version=1), current_version=3, now=0)  # trained already
    assert b.counts.duplicate == 1


def test_batches_close_on_count_token_budget_or_wait():
    b = batcher(batch_transitions=3)
    for name in "abc":
        b.offer(sample(name), 0, now=0)
    assert b.ready(now=0) and len(b.take(0).samples) == 3
    b = batcher(batch_transitions=0, batch_tokens=20)  # padded size = count x longest (5 tokens each)
    for name in "abcde":
        b.offer(sample(name), 0, now=0)
    assert b.ready(now=0) and len(b.take(0).samples) == 4
    assert not b.ready(now=0)
    b.offer(sample("long", prompt=30), 0, now=0)  # alone over budget: still taken, alone, after the queued one
    assert [len(b.take(0).samples), len(b.take(0).samples)] == [1, 1]
    b = batcher(batch_transitions=10, batch_wait_s=2.0)
    b.offer(sample("a"), 0, now=10.0)
    assert not b.ready(now=11.0) and b.ready(now=12.0)


def test_skipped_flat_transitions_count_toward_the_batch_when_asked():
    counting, plain = batcher(batch_transitions=4, count_skipped=True), batcher(batch_transitions=4)
    for b in (counting, plain):
        b.offer(sample("a"), 0, now=0)
        b.offer(sample("flat1", advantage=0.0), 0, now=0)
        b.offer(sample("flat2", advantage=0.0), 0, now=0)
        b.offer(sample("b"), 0, now=0)
    assert counting.ready(now=0) and not plain.ready(now=0)
    batch = counting.take(0)
    assert [s.transition_id for s in batch.samples] == ["a", "b"] and batch.counts.uninformative == 2
    for name in ("f3", "f4", "f5", "f6"):  # a batch's worth with no signal: nothing to take, and it is not carried
        counting.offer(sample(name, advantage=0.0), 0, now=0)
    counting.offer(sample("c"), 0, now=0)
    assert not counting.ready(now=0)


def test_a_backlog_of_rounds_is_cut_where_each_round_ends_when_skipped_ones_count():
    b = batcher(batch_transitions=4, count_skipped=True)
    rounds = [["a1", "flat", "a2", "flat"], ["flat", "flat", "b1", "b2"], ["c1", "c2", "c3", "c4"], ["flat"] * 3]
    for round_ in rounds:  # three rounds of four arrive while the trainer is busy
        for index, name in enumerate(round_):
            b.offer(sample(f"{name}{index}{len(b)}", advantage=0.0 if name == "flat" else 1.0), 0, now=0)
    taken = []
    while b.ready(now=0):
        taken.append([s.transition_id[:2] for s in b.take(0).samples])
    assert taken == [["a1", "a2"], ["b1", "b2"], ["c1", "c2", "c3", "c4"]]  # not [a1 a2 b1 b2], [c1 c2 c3 c4]
    b.offer(sample("d1"), 0, now=0)  # the last round's three flat ones count with it
    assert b.ready(now=0) and [s.transition_id for s in b.take(0).samples] == ["d1"]
    assert not b.ready(now=0)


def test_pending_positions_hold_back_commits():
    b = batcher()
    b.offer(sample("a", position=("t", 0, 5)), 0, now=0)
    b.offer(sample("b", position=("t", 1, 9)), 0, now=0)
    assert sorted(b.pending_positions()) == [("t", 0, 5), ("t", 1, 9)]
    b.take(0)
    assert list(b.pending_positions()) == []


def test_collate_right_pads_and_aligns_targets_with_response_tokens():
    short, long = sample("s", prompt=2, response=1), sample("l", prompt=3, response=3)
    micro, = collate([long, short], pad_id=0, device="cpu")
    assert micro.input_ids.tolist() == [[10, 11, 50, 0, 0, 0], [10, 11, 12, 50, 51, 52]]
    assert micro.attention_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]
    # column c predicts the token at first + c + 1; first is the shortest prompt's last position
    assert micro.first == 1 and micro.logits_to_keep == 5
    assert micro.response_mask.tolist() == [[True, False, False, False],
                                            [False, True, True, True]]
    assert micro.targets[micro.response_mask].tolist() == [50, 50, 51, 52]
    assert micro.behaviour_logprobs[micro.response_mask].tolist() == [-0.5] * 4
    assert [m.input_ids.shape[0] for m in collate([long, short, long], 0, "cpu", micro_batches=2)] == [2, 1]


def test_collate_packs_a_repeated_prompt_once_per_row_with_each_response_after_it():
    group = [replace(sample(f"g{i}", prompt=3, response=1 + i), response_ids=[60 + i] * (1 + i)) for i in range(3)]
    alone = sample("a", prompt=2, response=2)
    micro, = collate([group[2], alone, group[0], group[1]], pad_id=0, device="cpu")
    assert isinstance(micro, PackedMicroBatch)
    assert micro.input_ids.tolist() == [[10, 11, 50, 51, 0, 0, 0, 0, 0], [10, 11, 12, 60, 61, 61, 62, 62, 62]]
    # each response continues its prompt's positions
    assert micro.position_ids.tolist() == [[0, 1, 2, 3, 0, 0, 0, 0, 0], [0, 1, 2, 3, 3, 4, 3, 4, 5]]
    # the second token of response 61 sees the prompt and its own first token, not response 60
    assert micro.attends[1, 5].tolist() == [True, True, True, False, True, True, False, False, False]
    assert micro.attends[1, 2].tolist() == [True, True, True] + [False] * 6  # the prompt is causal
    assert micro.attends[0, 6].tolist() == [False] * 6 + [True, False, False]  # a pad sees only itself
    assert micro.row_of.tolist() == [0, 1, 1, 1]
    # column 0 is predicted by the prompt's last position, column c by the response's token c - 1
    assert micro.predictors[micro.response_mask].tolist() == [1, 2, 2, 2, 4, 2, 6, 7]
    assert micro.targets.tolist() == [[50, 51, 0], [60, 0, 0], [61, 61, 0], [62, 62, 62]]
    assert micro.behaviour_logprobs[micro.response_mask].tolist() == [-0.5] * 8
    two = collate([*group, alone], 0, "cpu", micro_batches=2)  # a group stays together: sorted by prompt
    assert [type(m).__name__ for m in two] == ["MicroBatch", "PackedMicroBatch"]
    split, = collate(group, 0, "cpu", row_tokens=6)  # the third response would make the row 9 tokens long
    assert split.input_ids.tolist() == [[10, 11, 12, 60, 61, 61], [10, 11, 12, 62, 62, 62]]
    assert split.row_of.tolist() == [0, 0, 1] and split.predictors[2].tolist() == [2, 3, 4]


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize(("row_tokens", "attention"), [(512, "eager"), (12, "eager"), (512, "sdpa")])
def test_a_packed_prompt_gives_the_same_logprobs_and_gradients_as_running_it_per_response(lora, row_tokens, attention):
    policy = build_policy(TrainerConfig(model="tiny", threads=1, device="cpu", lora=lora, lora_r=4,
                                        attention=attention))
    generator = torch.Generator().manual_seed(3)
    samples = []
    for group in range(3):
        prompt = torch.randint(5, 200, (4 + 2 * group,), generator=generator).tolist()
        for index in range(4):
            response = torch.randint(5, 200, (1 + (3 * index + group) % 6,), generator=generator).tolist()
            samples.append(Sample(f"s{group}{index}", "r", 0, prompt, response, [-1.0] * len(response), 1.0,
                                  float(index) - 1.5))
    shared, = collate(samples, policy.pad_id, "cpu", row_tokens=row_tokens)
    plain = [collate([s], policy.pad_id, "cpu")[0] for s in shared_order(samples)]
    assert isinstance(shared, PackedMicroBatch) and not any(isinstance(m, PackedMicroBatch) for m in plain)
    assert (shared.input_ids.shape[0] == 3) == (row_tokens == 512)  # one row per group, or several

    def weighted_logprobs(micro) -> tuple[torch.Tensor, list[torch.Tensor]]:
        policy.model.zero_grad(set_to_none=True)
        logprobs = token_logprobs(policy.model, micro, 1.0)[0]
        weights = micro.advantages[:, None].expand_as(logprobs)
        (logprobs * weights * micro.response_mask).sum().backward()
        return logprobs[micro.response_mask].detach(), [p.grad.clone() for p in policy.trainable()]

    shared_logprobs, shared_grads = weighted_logprobs(shared)
    rows = [weighted_logprobs(micro) for micro in plain]
    plain_logprobs = torch.cat([logprobs for logprobs, _ in rows])
    plain_grads = [sum(grads) for grads in zip(*(grads for _, grads in rows), strict=True)]
    assert shared_logprobs.shape == (sum(len(s.response_ids) for s in samples),)
    assert torch.allclose(shared_logprobs, plain_logprobs, atol=1e-5)
    # equal up to float32 rounding, which a different summation order changes (gradients reach 20 here)
    assert all(float((a - b).norm()) <= 1e-5 * float(b.norm()) + 1e-6
               for a, b in zip(shared_grads, plain_grads, strict=True))
    assert max(float(g.abs().max()) for g in shared_grads) > 0


def shared_order(samples: list[Sample]) -> list[Sample]:
    """The order ``collate`` puts samples in when their prompts repeat."""
    return sorted(samples, key=lambda s: (len(s.prompt_ids), s.prompt_ids, len(s.response_ids)))


# ---------------------------------------------------------------- step and policy


@pytest.fixture(scope="module")
def tiny_config() -> TrainerConfig:
    return TrainerConfig(model="tiny", lr=1e-3, threads=1, device="cpu", grad_clip=1e9)


def generated(policy, count: int, advantage: float) -> list[Sample]:
    """Samples whose behaviour logprobs are the policy's own teacher-forced logprobs (ratio exactly 1)."""
    from models import teacher_forced_logprobs

    out = []
    for index in range(count):
        prompt, response = [5 + index, 6, 7, 8], [40 + index, 41, 42 + index]
        logprobs = teacher_forced_logprobs(policy.model, prompt, response, 1.0)
        out.append(Sample(f"s{index}", "r", 0, prompt, response, logprobs, 1.0, advantage))
    return out


def test_a_step_on_its_own_generations_has_ratio_one_and_raises_rewarded_logprobs(tiny_config):
    policy = build_policy(tiny_config)
    samples = generated(policy, 4, advantage=1.0)
    result = train_step(policy, Batch(samples, 0, Counts()), tiny_config)
    assert result.stats.mean("importance_weight") == pytest.approx(1.0, abs=1e-4)
    assert result.stats.clipped == 0 and result.transitions == 4 and result.tokens == 4 * 7
    micro, = collate(samples, policy.pad_id, "cpu")
    with torch.no_grad():
        after = token_logprobs(policy.model, micro, 1.0)[0][micro.response_mask]
    assert after.sum() > micro.behaviour_logprobs[micro.response_mask].sum()


def test_gradient_accumulation_matches_one_big_batch(tiny_config):
    deltas = []
    for micro_batches in (1, 3):
        policy = build_policy(replace(tiny_config, accumulation_steps=micro_batches))
        policy.optimizer = torch.optim.SGD(policy.trainable(), lr=1.0)
        before = [p.detach().clone() for p in policy.trainable()]
        samples = generated(policy, 5, advantage=0.0)
        samples = [replace(s, advantage=a) for s, a in zip(samples, (1.0, -0.5, 2.0, -1.0, 0.3), strict=True)]
        train_step(policy, Batch(samples, 0, Counts()), replace(tiny_config, accumulation_steps=micro_batches))
        deltas.append(torch.cat([(p.detach() - b).flatten() for p, b in zip(policy.trainable(), before, strict=True)]))
    assert torch.allclose(deltas[0], deltas[1], atol=1e-6)
    assert deltas[0].abs().max() > 0


@pytest.mark.parametrize("lora", [False, True])
def test_kl_to_the_reference_starts_at_zero_and_grows_as_the_policy_moves(tiny_config, lora):
    config = replace(tiny_config, kl_coef=0.1, entropy_coef=0.01, lr=1e-2, lora=lora, lora_r=4)
    policy = build_policy(config)
    assert (policy.reference is None) == lora  # LoRA's reference is its own base, adapter off
    batch = Batch(generated(policy, 3, advantage=1.0), 0, Counts())
    first = train_step(policy, batch, config)
    second = train_step(policy, batch, config)
    assert first.stats.mean("kl") == pytest.approx(0.0, abs=1e-6)
    assert second.stats.mean("kl") > 1e-6
    assert second.stats.mean("entropy") > 0


# ---------------------------------------------------------------- checkpoints


def test_full_weights_checkpoint_round_trips_and_fits_the_dev_server(tmp_path, tiny_config):
    from models import check_weights, load_model, read_weights

    policy = build_policy(tiny_config)
    train_step(policy, Batch(generated(policy, 2, 1.0), 0, Counts()), tiny_config)
    store = open_store(tmp_path.as_uri())
    staging = store.staging()
    weights = save_weights(policy, staging)
    manifest = write_checkpoint(store, staging, weights, model="tiny", version=1, step=1, format="full",
                                offsets={"x:0": 4}, trained_ids=["s0", "s1"], metrics={"loss": 0.5})
    folder = store.get(manifest.uri)
    assert manifest.uri.startswith("file://") and manifest.sha256 == sha256_file(folder / "model.safetensors")
    assert latest_manifest(store, "tiny") == manifest
    served = load_model("tiny", threads=None)
    check_weights(served.model, read_weights(folder))  # what /v1/load_weights runs
    restored = build_policy(tiny_config)
    load_weights(restored, folder)
    for name, tensor in policy.model.state_dict().items():
        assert torch.equal(tensor, restored.model.state_dict()[name])
    assert restored.optimizer.state_dict()["state"].keys() == policy.optimizer.state_dict()["state"].keys()


def test_weights_saved_later_are_the_ones_copied_before_the_next_step(tmp_path, tiny_config):
    from safetensors.torch import load_file

    policy = build_policy(tiny_config)
    train_step(policy, Batch(generated(policy, 2, 1.0), 0, Counts()), tiny_config)
    before = {name: tensor.clone() for name, tensor in policy.model.state_dict().items()}
    write = save_weights_later(policy, tmp_path, optimizer_state=True)
    moments = {k: v["exp_avg"].clone() for k, v in policy.optimizer.state_dict()["state"].items()}
    train_step(policy, Batch(generated(policy, 2, 1.0), 1, Counts()), tiny_config)  # changes weights and moments
    assert any(not torch.equal(before[name], tensor) for name, tensor in policy.model.state_dict().items())
    weights, digest = write()
    assert digest == sha256_file(weights)  # hashed on the way, as written
    saved = load_file(weights)
    storages = {tensor.data_ptr() for tensor in policy.model.state_dict().values()}
    assert len(saved) == len(storages)  # a tied head is written once, as save_model writes it
    restored = build_policy(tiny_config)
    load_weights(restored, tmp_path)
    for name, tensor in before.items():
        assert torch.equal(tensor, restored.model.state_dict()[name]), name
    for key, state in restored.optimizer.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], moments[key])


def test_safetensors_written_in_one_pass_read_back_as_safetensors_writes_them(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from models import WeightsError, write_safetensors

    tensors = {"b.weight": torch.randn(3, 4), "a.norm": torch.randn(5).to(torch.bfloat16), "step": torch.tensor(7),
               "empty": torch.zeros(0, 2), "transposed": torch.arange(6).reshape(2, 3).t(),
               "mask": torch.tensor([True, False, True])}
    digest = write_safetensors(tensors, tmp_path / "w.safetensors")
    assert digest == sha256_file(tmp_path / "w.safetensors")
    back = load_file(tmp_path / "w.safetensors")
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    with safe_open(tmp_path / "w.safetensors", "pt") as handle:
        assert handle.metadata() == {"format": "pt"}  # what transformers and vLLM look for
    header_size = int.from_bytes((tmp_path / "w.safetensors").read_bytes()[:8], "little")
    assert header_size % 8 == 0
    with pytest.raises(WeightsError, match="complex64"):
        write_safetensors({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "z.safetensors")


def test_bfloat16_checkpoints_hold_the_weights_rounded_and_a_resumed_trainer_says_so(tmp_path, tiny_config, caplog):
    from models import check_weights, load_model, read_weights

    config = replace(tiny_config, checkpoint_dtype="bfloat16")
    policy = build_policy(config)
    train_step(policy, Batch(generated(policy, 2, 1.0), 0, Counts()), config)
    weights, digest = save_weights_later(policy, tmp_path, optimizer_state=False)()
    state = read_weights(tmp_path)
    assert {tensor.dtype for tensor in state.values()} == {torch.bfloat16} and digest == sha256_file(weights)
    full = {name: tensor for name, tensor in policy.model.state_dict().items() if name in state}
    assert sum(tensor.numel() * 2 for tensor in state.values()) < weights.stat().st_size < \
        sum(tensor.numel() * 4 for tensor in full.values())  # half the bytes of float32, plus the header
    served = load_model("tiny", threads=None)
    check_weights(served.model, state)
    restored = build_policy(tiny_config)
    with caplog.at_level("WARNING", logger="trainer.policy"):
        load_weights(restored, tmp_path)
    assert "rounded" in caplog.text and "torch.bfloat16" in caplog.text
    for name, tensor in full.items():
        assert torch.equal(restored.model.state_dict()[name], tensor.to(torch.bfloat16).float()), name
    with pytest.raises(ConfigError, match="checkpoint_dtype"):
        replace(tiny_config, checkpoint_dtype="float16")


def test_lora_checkpoint_is_a_peft_adapter_the_dev_server_loads(tmp_path, tiny_config):
    from models import load_model
    from serving.lora import load_lora

    config = replace(tiny_config, lora=True, lora_r=4, lora_alpha=8, lr=1e-2)
    policy = build_policy(config)
    train_step(policy, Batch(generated(policy, 2, 1.0), 0, Counts()), config)
    store = FolderStore(tmp_path)
    staging = store.staging()
    weights = save_weights(policy, staging)
    assert weights.name == "adapter_model.safetensors"
    manifest = write_checkpoint(store, staging, weights, model="a/b", version=3, step=7, format="lora", offsets={},
                                trained_ids=[], metrics={})
    folder = store.get(manifest.uri)
    adapter = load_lora(folder, load_model("tiny", threads=None).model, "a/b@v3", 3)
    assert len(adapter.layers) == 2 * 4  # q, k, v, o in both layers
    restored = build_policy(config)
    load_weights(restored, folder)
    lora_state = {k: v for k, v in policy.model.state_dict().items() if "lora_" in k}
    assert all(torch.equal(v, restored.model.state_dict()[k]) for k, v in lora_state.items())


def test_store_lists_prunes_and_remembers_trained_ids(tmp_path):
    store = FolderStore(tmp_path)
    for version in range(1, 5):
        staging = store.staging()
        (staging / "model.safetensors").write_bytes(b"w%d" % version)
        write_checkpoint(store, staging, staging / "model.safetensors", model="m", version=version, step=version,
                         format="full", offsets={}, trained_ids=[f"t{version}a", f"t{version}b"], metrics={})
    assert [m.version for m in manifests(store, "m")] == [1, 2, 3, 4]
    assert recent_trained_ids(store, "m", limit=3) == ["t3a", "t3b", "t4a", "t4b"]
    prune(store, "m", keep=2)
    assert [m.version for m in manifests(store, "m")] == [3, 4]
    assert find_version(store, 3).version == 3
    with pytest.raises(CheckpointError, match="no checkpoint of version 2"):
        find_version(store, 2)
    (store.root / "m" / "v00000004" / "optimizer.pt").write_bytes(b"adam")
    assert keep_only_newest(store, drop_files=("optimizer.pt",)) == [store.root / "m" / "v00000004"]
    assert [m.version for m in manifests(store, "m")] == [4]
    kept = sorted(p.name for p in (store.root / "m" / "v00000004").iterdir())
    assert kept == ["checkpoint.json", "model.safetensors"]
    with pytest.raises(UnsupportedStore):
        open_store("gs://bucket/checkpoints")


def test_trainer_config_section_is_typed_and_validated(tmp_path):
    path = tmp_path / "agentstream.toml"
    path.write_text('[trainer]\nmodel = "tiny"\nlr = 0.002\nlora = true\nbatch_transitions = 32\n')
    config = load_config(path, environ={})
    assert (config.trainer.model, config.trainer.lr, config.trainer.lora, config.trainer.batch_transitions) == \
        ("tiny", 0.002, True, 32)
    path.write_text('[trainer]\nclip_eps = 1.5\n')
    with pytest.raises(ConfigError, match="clip_eps"):
        load_config(path, environ={})


def test_the_trained_model_runs_eager_attention_on_the_cpu_unless_told_otherwise(tmp_path, tiny_config):
    assert build_policy(tiny_config).model.config._attn_implementation == "eager"
    assert build_policy(replace(tiny_config, attention="sdpa")).model.config._attn_implementation == "sdpa"
    path = tmp_path / "agentstream.toml"
    path.write_text('[trainer]\nattention = "flash"\n')
    with pytest.raises(ConfigError, match="attention must be auto, eager or sdpa"):
        load_config(path, environ={})


def test_demo_heldout_tasks_are_bounded_by_the_task_set(tmp_path):
    path = tmp_path / "agentstream.toml"
    path.write_text('[demo]\nheldout_tasks = 160\n')
    assert load_config(path, environ={}).demo.heldout_tasks == 160
    path.write_text('[demo]\nheldout_tasks = 400\n')
    with pytest.raises(ConfigError, match="heldout_tasks must be between 1 and 399"):
        load_config(path, environ={})
