"""Defence in depth: a NaN that got past the entry checks never reaches a transition, the weights or a served model."""

from __future__ import annotations

import asyncio
import copy
import math
import struct
from dataclasses import replace

import pytest
import torch

from agentstream.infra.config import CreditRule, TrainerConfig, load_config
from agentstream.models import NonFiniteWeights, check_finite, read_weights, verify_finite, write_safetensors
from agentstream.schemas import AvroCodec
from agentstream.schemas.span_reader import NonFiniteReward
from agentstream.streams.credit import DiscountedReturns, FinalReward, GroupNormalized, NonFiniteCredit, RunningBaseline
from agentstream.streams.groups import GroupProcessor
from agentstream.streams.processor import SpanProcessor
from agentstream.streams.records import RawRecord
from agentstream.streams.sink import CompletionSink
from agentstream.streams.trajectory import SpanNode, assemble
from agentstream.trainer.batching import Batch, Counts, NonFiniteTransition, Sample
from agentstream.trainer.policy import (
    PolicyError,
    build_policy,
    load_weights,
    restore_last_good,
    save_weights,
    save_weights_later,
)
from agentstream.trainer.step import train_step
from tests.support.streams_fakes import Held, Sent

CODEC = AvroCodec()
NAN, INF = math.nan, math.inf

# ------------------------------------------------------------------ streams: the span reader and the dead letters


def span_batch(rollout_id: str, reward: float | None, dimensions: dict[str, float] | None = None) -> bytes:
    """A SpanBatch as a client that skipped every check would write it (fastavro writes NaN and infinities)."""
    common = {"rollout_id": rollout_id, "attempt_id": f"{rollout_id}-1", "agent_name": "agent", "status": "OK"}
    return CODEC.encode_span_batch([
        {**common, "span_id": "llm", "name": "chat", "kind": "LLM", "start_time_us": 1, "end_time_us": 2,
         "model": "m", "prompt_token_ids": [1, 2], "response_token_ids": [3], "response_logprobs": [-0.5]},
        {**common, "span_id": "reward", "name": "reward", "kind": "REWARD", "start_time_us": 3, "end_time_us": 3,
         "reward": reward, "reward_dimensions": dimensions}])


def test_a_span_record_with_a_non_finite_reward_is_a_dead_letter_with_its_reason():
    records = [RawRecord("t.spans", 0, offset, rollout.encode(), span_batch(rollout, reward, dimensions))
               for offset, (rollout, reward, dimensions) in enumerate([
                   ("good", 1.0, {"a": 1.0}), ("nan", NAN, None), ("inf", -INF, None),
                   ("dimension", 1.0, {"accuracy": 1.0, "speed": INF}), ("also-good", 0.0, None)])]
    processor = SpanProcessor(load_config(environ={}), None, None, Sent(), Held(), None, CODEC)  # type: ignore[arg-type]
    batch = processor.read(records)
    assert [record.key for record, _ in batch.in_order] == [b"good", b"also-good"]
    assert {record.key: (type(error), str(error)) for record, error in batch.dead} == {
        b"nan": (NonFiniteReward, "span 'reward' of rollout 'nan' has reward nan: a reward must be a finite number"),
        b"inf": (NonFiniteReward, "span 'reward' of rollout 'inf' has reward -inf: a reward must be a finite number"),
        b"dimension": (NonFiniteReward, "span 'reward' of rollout 'dimension' has reward dimension 'speed' = inf: "
                                        "a reward must be a finite number")}
    sent = Sent()
    processor.emitter = sent
    for record, error in batch.dead:
        asyncio.run(processor._dead_letter(record, error))
    letters = [CODEC.decode(value)[1] for _, _, value in sent.records]
    assert [(letter["offset"], letter["error_type"]) for letter in letters] == [(1, "NonFiniteReward"),
                                                                               (2, "NonFiniteReward"),
                                                                               (3, "NonFiniteReward")]
    assert letters[0]["value"] == records[1].value and "finite" in letters[0]["error"]  # the record, kept whole


# ------------------------------------------------------------------ streams: credit strategies


def rollout(rollout_id: str, *rewards: float, agent: str = "agent"):
    spans = [SpanNode(span_id="llm", parent_id="", kind="LLM", name="chat", start_us=10, end_us=15, attempt_id="a",
                      agent_name=agent, model="m", has_token_ids=True)]
    spans += [SpanNode(span_id=f"r{index}", parent_id="", kind="REWARD", name="reward", start_us=20 + index,
                       end_us=20 + index, attempt_id="a", agent_name=agent, reward=reward)
              for index, reward in enumerate(rewards)]
    return assemble(rollout_id, spans, "SUCCEEDED", "a")


@pytest.mark.parametrize("strategy", [FinalReward(), DiscountedReturns(0.9), RunningBaseline(), GroupNormalized()])
@pytest.mark.parametrize("reward", [NAN, INF, -INF])
def test_no_strategy_credits_a_non_finite_reward(strategy, reward):
    with pytest.raises(NonFiniteCredit, match="not credited"):
        strategy.assign(rollout("bad", 1.0, reward))


def test_the_span_processor_makes_no_transitions_of_a_rollout_whose_credit_is_not_finite(caplog):
    config = replace(load_config(environ={}), credit=(CreditRule(agent="*", strategy="discounted", gamma=1.0),))
    processor = SpanProcessor(config, None, None, Sent(), Held(), None, CODEC)  # type: ignore[arg-type]
    finished: list = []
    row = processor._decide(rollout("read-back", NAN), finished, 0.0)  # as a NaN stored before this check would come
    assert finished == [] and processor.counters.credits_refused == 1 and "no transitions from read-back" in caplog.text
    assert row.status == "SUCCEEDED"  # the rollout is still recorded
    processor._decide(rollout("fine", 1.0), finished, 0.0)
    assert [credit.advantage for item in finished for credit in item.credits] == [1.0]


def test_the_running_baseline_keeps_its_mean_when_a_reward_or_the_mean_would_not_be_finite():
    baseline = RunningBaseline(decay=0.5)
    assert baseline.assign(rollout("r1", 1.0))[0].advantage == 0.0
    for bad in (NAN, INF):
        with pytest.raises(NonFiniteCredit):
            baseline.assign(rollout("bad", bad))
    assert baseline.means == {"agent": 1.0}  # untouched: the next advantages are still finite
    assert baseline.assign(rollout("r2", 0.0))[0].advantage == -1.0
    huge = RunningBaseline(decay=0.5)
    huge.assign(rollout("r1", 1e308))
    with pytest.raises(NonFiniteCredit, match="advantage -inf"):  # -1e308 - 1e308 overflows
        huge.assign(rollout("r2", -1e308))
    assert huge.means == {"agent": 1e308}


def test_discounted_returns_that_overflow_are_not_credited():
    with pytest.raises(NonFiniteCredit, match="return inf"):
        DiscountedReturns(1.0).assign(rollout("big", 1e308, 1e308))


def test_group_advantages_refuse_non_finite_rewards_and_overflow():
    group = GroupNormalized()
    assert group.advantages([1.0, 0.0]) == pytest.approx([1.0, -1.0], abs=1e-5)
    for rewards in ([1.0, NAN], [INF, 0.0], [1e308, -1e308]):
        with pytest.raises(NonFiniteCredit):
            group.advantages(rewards)


def test_a_group_member_with_a_non_finite_reward_is_left_out_and_counted():
    rule = CreditRule(agent="agent", strategy="grpo", group_size=3, keep_flat_groups=True)
    sink = CompletionSink(None, "db", Held())  # type: ignore[arg-type]  # queues completions; nothing stores them here
    processor = GroupProcessor(replace(load_config(environ={}), credit=(rule,)), Sent(), Held(), sink, CODEC)  # type: ignore[arg-type]

    def result(group: str, rollout_id: str, reward: float):
        return RawRecord("groups", 0, 0, group.encode(), b""), {
            "rollout_id": rollout_id, "attempt_id": "a", "group_id": group, "agent_name": "agent",
            "status": "SUCCEEDED", "final_reward": reward, "completed_at_us": 1,
            "drafts": [{"model": "m", "head": rollout_id.encode()}]}

    processor.apply([result("g", "g1", 1.0), result("g", "g2", NAN), result("g", "g3", 0.0),
                     result("flat", "f1", 1.0), result("flat", "f2", 1.0), result("flat", "f3", INF),
                     result("huge", "h1", 1e308), result("huge", "h2", -1e308), result("huge", "h3", 0.0)])
    asyncio.run(processor.tick())
    completion = sink.queue.get_nowait()
    credit = {datum[:2].decode(): struct.unpack("<ddd", datum[2:26]) for datum in completion.transitions}
    assert set(credit) == {"g1", "g3", "f1", "f2"}  # the NaN member is left out; the overflowing group is not credited
    assert credit["g1"][2] == pytest.approx(1.0, abs=1e-5) and credit["g3"][2] == pytest.approx(-1.0, abs=1e-5)
    assert credit["f1"] == credit["f2"] == (1.0, 1.0, 0.0)  # a flat group kept with advantage 0, its INF member out
    assert all(math.isfinite(value) for values in credit.values() for value in values)
    assert processor.counters.credits_refused == 2 + 3
    assert len(completion.release) == 3


# ------------------------------------------------------------------ trainer: the transition reader


def transition(**changes) -> dict:
    record = {"transition_id": "t", "rollout_id": "r", "policy_version": 0, "prompt_token_ids": [1, 2],
              "response_token_ids": [3, 4], "behaviour_logprobs": [-0.5, -0.25], "reward": 1.0, "advantage": 1.0}
    return {**record, **changes}


@pytest.mark.parametrize(("changes", "says"), [
    ({"advantage": NAN}, "advantage nan"), ({"advantage": -INF}, "advantage -inf"), ({"reward": INF}, "reward inf"),
    ({"behaviour_logprobs": [-0.5, NAN]}, "logprob that is not finite (nan)"),
    ({"behaviour_logprobs": [-INF, -0.5]}, "logprob that is not finite (-inf)")])
def test_the_transition_reader_drops_a_non_finite_transition(changes, says):
    with pytest.raises(NonFiniteTransition, match=says.replace("(", r"\(").replace(")", r"\)")):
        Sample.from_record(transition(**changes))
    assert Sample.from_record(transition()).advantage == 1.0


# ------------------------------------------------------------------ trainer: the step and the checkpoint


@pytest.fixture
def tiny_config() -> TrainerConfig:
    return TrainerConfig(model="tiny", device="cpu", threads=1, lr=1e-2, seed=3)


def samples(advantage: float, count: int = 4) -> list[Sample]:
    return [Sample(f"s{i}", "r", 0, [60 + i, 61, 62], [70 + i, 71], [-5.0, -5.5], 1.0, advantage)
            for i in range(count)]


def snapshot(policy) -> tuple[dict[str, torch.Tensor], dict]:
    return ({name: tensor.detach().clone() for name, tensor in policy.model.state_dict().items()},
            copy.deepcopy(policy.optimizer.state_dict()))


def assert_same(before: tuple[dict[str, torch.Tensor], dict], after: tuple[dict[str, torch.Tensor], dict]) -> None:
    weights, optimizer = before
    assert all(torch.equal(weights[name], tensor) for name, tensor in after[0].items())
    assert optimizer["state"].keys() == after[1]["state"].keys()
    for key, state in optimizer["state"].items():
        assert all(torch.equal(value, after[1]["state"][key][name]) for name, value in state.items())


@pytest.mark.parametrize("bad", [NAN, INF])
def test_a_batch_with_a_non_finite_loss_leaves_weights_and_optimizer_state_unchanged(tiny_config, bad):
    policy = build_policy(tiny_config)
    assert not train_step(policy, Batch(samples(1.0), 0, Counts()), tiny_config).skipped  # AdamW has moments now
    before = snapshot(policy)
    result = train_step(policy, Batch(samples(1.0)[:2] + samples(bad)[2:], 0, Counts()), tiny_config)
    assert result.skipped and not math.isfinite(result.loss)
    assert_same(before, snapshot(policy))
    assert all(p.grad is None for p in policy.trainable())  # nothing carried into the next step
    assert policy.optimizer.state_dict()["state"][0]["step"] == 1  # AdamW did not count it as a step
    assert not (good := train_step(policy, Batch(samples(-1.0), 0, Counts()), tiny_config)).skipped
    assert math.isfinite(good.loss) and all(torch.isfinite(p).all() for p in policy.model.parameters())


def test_skipped_batches_are_counted_in_the_next_train_steps_row_and_its_line(tiny_config):
    from agentstream.trainer.metrics import TRAIN_STEP_COLUMNS, StepReport

    policy = build_policy(tiny_config)
    batch = Batch(samples(1.0), 0, Counts())
    report = StepReport.of("m", 7, batch, train_step(policy, batch, tiny_config), skipped_nonfinite=2)
    assert report.row()[TRAIN_STEP_COLUMNS.index("skipped_nonfinite")] == 2 and "nonfinite 2" in report.line()
    quiet = StepReport.of("m", 8, batch, train_step(policy, batch, tiny_config))
    assert quiet.row()[TRAIN_STEP_COLUMNS.index("skipped_nonfinite")] == 0 and "nonfinite" not in quiet.line()


def test_a_non_finite_gradient_norm_skips_the_step_too(tiny_config):
    policy = build_policy(tiny_config)
    before = snapshot(policy)
    next(iter(policy.model.parameters())).register_hook(lambda grad: grad * math.inf)  # a finite loss, an inf gradient
    result = train_step(policy, Batch(samples(1.0), 0, Counts()), tiny_config)
    assert result.skipped and math.isfinite(result.loss) and not math.isfinite(result.grad_norm)
    assert_same(before, snapshot(policy))


def poison(policy, value: float = NAN) -> None:
    with torch.no_grad():
        next(iter(policy.model.parameters())).view(-1)[0] = value


def test_weights_that_are_not_finite_are_never_written(tmp_path, tiny_config):
    policy = build_policy(tiny_config)
    poison(policy)
    with pytest.raises(NonFiniteWeights, match="1 tensor"):
        save_weights_later(policy, tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before a byte was written
    narrow = build_policy(replace(tiny_config, checkpoint_dtype="bfloat16"))
    poison(narrow, 3.4e38)  # finite in float32, rounds to infinity in the bfloat16 the checkpoint is written in
    with pytest.raises(NonFiniteWeights, match="bfloat16"):
        save_weights_later(narrow, tmp_path)


def test_a_lora_adapter_that_is_not_finite_is_never_written(tmp_path, tiny_config):
    policy = build_policy(replace(tiny_config, lora=True, lora_r=4))
    with torch.no_grad():
        next(p for name, p in policy.model.named_parameters() if "lora_B" in name).fill_(INF)
    with pytest.raises(NonFiniteWeights, match="LoRA adapter"):
        save_weights_later(policy, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_going_back_to_the_last_good_checkpoint_restores_weights_and_moments(tmp_path, tiny_config):
    policy = build_policy(tiny_config)
    train_step(policy, Batch(samples(1.0), 0, Counts()), tiny_config)
    for folder in ("good", "without"):
        (tmp_path / folder).mkdir()
    save_weights(policy, tmp_path / "good", optimizer_state=True)
    good = snapshot(policy)
    train_step(policy, Batch(samples(-1.0), 0, Counts()), tiny_config)
    poison(policy)
    restore_last_good(policy, tmp_path / "good")
    assert_same(good, snapshot(policy))
    save_weights(policy, tmp_path / "without", optimizer_state=False)
    restore_last_good(policy, tmp_path / "without")
    assert policy.optimizer.state_dict()["state"] == {}  # no moments written with it: AdamW starts afresh


# ------------------------------------------------------------------ loading: the trainer, the dev server, hot swap


def test_weights_with_a_nan_are_refused_by_every_loader(tmp_path, tiny_config):
    policy = build_policy(tiny_config)
    for folder in ("good", "bad"):
        (tmp_path / folder).mkdir()
    save_weights(policy, tmp_path / "good")
    poison(policy)
    write_safetensors(dict(policy.model.state_dict()), tmp_path / "bad" / "model.safetensors")  # as a careless writer
    for load in (read_weights, lambda folder: verify_finite(folder, "full")):
        with pytest.raises(NonFiniteWeights, match=r"1 tensor\(s\) hold NaN or infinite values"):
            load(tmp_path / "bad")
    with pytest.raises(PolicyError, match="NaN or infinite"):  # a trainer resuming or going back to it
        load_weights(build_policy(tiny_config), tmp_path / "bad")
    verify_finite(tmp_path / "good", "full")
    verify_finite(tmp_path / "missing", "full")  # a file not readable here is left to the server
    check_finite({"ids": torch.tensor([1, 2])}, "integers")  # integer tensors cannot hold a NaN
    check_finite({"big": torch.tensor([3e38, 3e38])}, "finite values whose sum overflows")
    with pytest.raises(NonFiniteWeights, match=r"\(a\)"):
        check_finite({"a": torch.tensor([INF, -INF]), "b": torch.ones(3)}, "a sum that is NaN")


def test_the_dev_server_and_hot_swap_refuse_weights_with_a_nan(tmp_path, tiny_config):
    from safetensors.torch import load_file, save_file

    from agentstream.models import ADAPTER_WEIGHTS_FILE, load_model, sha256_file
    from agentstream.schemas.checkpoint import Checkpoint
    from agentstream.serving.app import create_app
    from agentstream.serving.hotswap import HotSwapError, HotSwapper
    from tests.support.http_thread import ServerThread, post
    from tests.support.servers import make_lora

    policy = build_policy(tiny_config)
    poison(policy, INF)
    (tmp_path / "full").mkdir()
    write_safetensors(dict(policy.model.state_dict()), tmp_path / "full" / "model.safetensors")
    make_lora(tmp_path / "lora")
    adapter = load_file(tmp_path / "lora" / ADAPTER_WEIGHTS_FILE)
    adapter[next(name for name in adapter if "lora_B" in name)].view(-1)[0] = NAN
    save_file(adapter, tmp_path / "lora" / ADAPTER_WEIGHTS_FILE)

    server = ServerThread(create_app(load_model("tiny")))
    try:
        status, body, _ = post(server.url + "/v1/load_weights", {"path": str(tmp_path / "full"), "version": 5})
        assert status == 400 and "NaN or infinite" in body["error"]["message"]
        status, body, _ = post(server.url + "/v1/load_lora_adapter",
                               {"lora_name": "bad-v5", "lora_path": str(tmp_path / "lora"), "version": 5})
        assert status == 400 and "NaN or infinite" in body["error"]["message"]
        swapper = HotSwapper(load_config(environ={}), "127.0.0.1:1", server.url, "tiny")
        for folder, form, file in ((tmp_path / "full", "full", "model.safetensors"),
                                   (tmp_path / "lora", "lora", ADAPTER_WEIGHTS_FILE)):
            digest = sha256_file(folder / file)  # the right digest: only the NaN
            checkpoint = Checkpoint(model="tiny", version=5, uri=folder.as_uri(), sha256=digest, step=5,
                                    created_at_us=1, format=form)
            with pytest.raises(HotSwapError, match="NaN or infinite"):
                asyncio.run(swapper.apply(checkpoint))
        assert swapper.version is None and swapper.adapters == {}
        status, body, headers = post(server.url + "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 200 and headers["X-Policy-Version"] == "0"  # still the weights it started with
    finally:
        server.stop()
