"""Trajectory-level samples: calls merged by exact token prefix, the loss mask between them, splits where it breaks."""

from __future__ import annotations

import asyncio
import io
import struct
from dataclasses import replace

import fastavro
import pytest

from agentstream.infra.config import CreditRule, load_config
from agentstream.schemas import TRANSITION, AvroCodec, current_schemas
from agentstream.schemas.binary import write_long
from agentstream.schemas.span_reader import SpanReader
from agentstream.schemas.span_writer import SpanBatchEncoder
from agentstream.schemas.transition_writer import array, draft
from agentstream.streams.credit import DiscountedReturns, FinalReward
from agentstream.streams.groups import GroupProcessor
from agentstream.streams.processor import SpanProcessor
from agentstream.streams.records import RawRecord
from agentstream.streams.sink import CompletionSink
from agentstream.streams.trajectory import SpanNode, Trajectory, assemble
from agentstream.streams.trajectory_samples import UnreadableTokens, call_arrays, trajectory_samples, varint_count
from tests.support.streams_fakes import Held, Sent

CODEC = AvroCodec()
TRAJECTORY = CreditRule(level="trajectory")
SAMPLE_FIELDS = ("loss_mask", "merged_calls", "split_at_break")


def llm(index: int, prompt: list[int] | None, response: list[int] | None, logprobs: list[float] | None = None,
        model: str = "m", version: int = 3) -> dict:
    """An LLM span of rollout 'r' at time ``index``; logprobs default to -0.5, -1.5, ... one per response token."""
    if logprobs is None and response is not None:
        logprobs = [-0.5 - i for i in range(len(response))]
    return {"span_id": f"llm{index}", "rollout_id": "r", "attempt_id": "a", "name": "chat", "kind": "LLM",
            "start_time_us": 10 * index, "end_time_us": 10 * index + 5, "agent_name": "agent", "model": model,
            "policy_version": version, "prompt_token_ids": prompt, "response_token_ids": response,
            "response_logprobs": logprobs}


def reward(value: float = 1.0, at: int = 1000) -> dict:
    return {"span_id": f"reward{at}", "rollout_id": "r", "attempt_id": "a", "name": "reward", "kind": "REWARD",
            "start_time_us": at, "end_time_us": at, "agent_name": "agent", "reward": value}


def read_spans(spans: list[dict], sized: bool = True) -> list[SpanNode]:
    """Spans as a worker reads them: the publisher's encoder (token ids in blocks with byte sizes) or fastavro's."""
    body = SpanBatchEncoder().encode_span_batch(spans) if sized else CODEC.encode_span_batch(spans)
    _, _, schema = CODEC.writer_schema(body)
    return SpanReader(schema, SpanNode).batch(body[5:])


def rollout(spans: list[dict], sized: bool = True, group: str | None = None, rollout_id: str = "r") -> Trajectory:
    nodes = read_spans([{**span, "rollout_id": rollout_id, "group_id": group} for span in spans], sized)
    return assemble(rollout_id, nodes, "SUCCEEDED", "a")


def decode(datum: bytes) -> dict:
    return fastavro.schemaless_reader(io.BytesIO(datum), current_schemas()[TRANSITION])


def transitions(trajectory: Trajectory, rule: CreditRule = TRAJECTORY, strategy=None) -> tuple[list[dict], int, int]:
    credits = (strategy or FinalReward()).assign(trajectory)
    samples = trajectory_samples(trajectory, rule, credits)
    datums = [pending.complete(c.reward, c.return_value, c.advantage, None, 7)
              for pending, c in zip(samples.drafts, samples.credits, strict=True)]
    return [decode(datum) for datum in datums], samples.merges, samples.breaks


def test_a_call_whose_prompt_extends_the_last_exactly_merges_with_a_mask_over_the_tokens_between():
    first = llm(0, [1, 2, 3], [10, 11], version=4)
    second = llm(1, [1, 2, 3, 10, 11, 50, 51, 52], [12], version=3)  # + a tool result 50..52
    third = llm(2, [1, 2, 3, 10, 11, 50, 51, 52, 12], [13, 14], version=5)  # nothing in between
    [sample], merges, breaks = transitions(rollout([first, second, third, reward(2.0)]))
    assert (merges, breaks) == (2, 0)
    assert sample["prompt_token_ids"] == [1, 2, 3]
    assert sample["response_token_ids"] == [10, 11, 50, 51, 52, 12, 13, 14]
    assert sample["loss_mask"] == [True, True, False, False, False, True, True, True]
    assert sample["behaviour_logprobs"] == [-0.5, -1.5, 0.0, 0.0, 0.0, -0.5, -0.5, -1.5]
    assert (sample["merged_calls"], sample["split_at_break"]) == (3, False)
    assert (sample["span_id"], sample["step_index"], sample["policy_version"]) == ("llm0", 0, 3)
    assert (sample["reward"], sample["return_value"], sample["advantage"]) == (2.0, 2.0, 2.0)


def test_a_re_rendered_turn_breaks_the_prefix_and_splits_the_sample():
    first = llm(0, [1, 2, 3], [10, 11, 12])  # the model wrote the tool call as 10 11 12
    second = llm(1, [1, 2, 3, 10, 99, 12, 50], [20])  # the template re-rendered it as 10 99 12
    third = llm(2, [1, 2, 3, 10, 99, 12, 50, 20, 60], [21])  # extends the second exactly
    spans = [first, reward(1.0, at=7), second, third, reward(2.0, at=1000)]
    samples, merges, breaks = transitions(rollout(spans), strategy=DiscountedReturns(1.0))
    assert (merges, breaks) == (1, 1)
    assert [(s["span_id"], s["step_index"], s["merged_calls"], s["split_at_break"]) for s in samples] == [
        ("llm0", 0, 1, False), ("llm1", 1, 2, True)]
    assert samples[0]["response_token_ids"] == [10, 11, 12] and samples[0]["loss_mask"] == []
    assert samples[1]["prompt_token_ids"] == [1, 2, 3, 10, 99, 12, 50]
    assert samples[1]["response_token_ids"] == [20, 60, 21] and samples[1]["loss_mask"] == [True, False, True]
    assert [s["return_value"] for s in samples] == [3.0, 2.0]  # each sample: its first call's credit


def test_a_prompt_shorter_than_the_last_sequence_is_a_break():
    samples, merges, breaks = transitions(rollout([llm(0, [1, 2], [3, 4]), llm(1, [1, 2, 3], [5]), reward()]))
    assert (merges, breaks) == (0, 1) and [s["split_at_break"] for s in samples] == [False, True]


def test_calls_of_another_model_neither_merge_nor_break_a_models_sample():
    spans = [llm(0, [1, 2], [3], model="planner"), llm(1, [7], [8], model="coder"),
             llm(2, [1, 2, 3, 4], [5], model="planner"), llm(3, [9], [8], model="coder"), reward()]
    samples, merges, breaks = transitions(rollout(spans))
    assert (merges, breaks) == (1, 1)  # the coder's second prompt does not extend its first
    assert [(s["model"], s["span_id"], s["merged_calls"], s["split_at_break"]) for s in samples] == [
        ("planner", "llm0", 2, False), ("coder", "llm1", 1, False), ("coder", "llm3", 1, True)]
    assert samples[0]["response_token_ids"] == [3, 4, 5] and samples[0]["loss_mask"] == [True, False, True]
    renamed, merges, _ = transitions(rollout(spans), rule=CreditRule(level="trajectory", train_as="one"))
    assert merges == 0 and {s["model"] for s in renamed} == {"one"}  # one trained model: the coder breaks each time


def test_calls_without_token_ids_are_not_samples_and_do_not_break_a_merge():
    spans = [llm(0, [1, 2], [3]), llm(1, None, None), llm(2, [1, 2, 3, 4], [5]), reward()]
    [sample], merges, breaks = transitions(rollout(spans))
    assert (merges, breaks, sample["merged_calls"]) == (1, 0, 2)
    assert sample["response_token_ids"] == [3, 4, 5]


@pytest.mark.parametrize("sized", [True, False])
def test_a_single_call_sample_is_the_transition_level_transition(sized):
    trajectory = rollout([llm(0, [1, 2, 300, 2**31 - 1], [-1, 128000]), reward(0.5)], sized=sized)
    [credit] = FinalReward().assign(trajectory)
    transition = draft("r", "a", "agent", "m", 0, credit.call).complete(0.5, 0.5, 0.5, None, 7)
    [sample], merges, breaks = transitions(trajectory)
    assert sample == decode(transition)  # same values; at trajectory level too the token bytes are copied
    assert (sample["loss_mask"], sample["merged_calls"], sample["split_at_break"], merges, breaks) == ([], 1, False,
                                                                                                       0, 0)


def sized_block(items: bytes, count: int) -> bytes:
    """An Avro array block written with its byte size: the negated count, the size, the items."""
    return write_long(-count) + write_long(len(items)) + items


def varints(ids: list[int]) -> bytes:
    return b"".join(map(write_long, ids))


def test_token_arrays_in_several_blocks_with_byte_sizes_read_as_their_items():
    ids = [0, 63, 64, -65, 8191, 8192, 2**31 - 1, -(2**31)]
    prompt = sized_block(varints(ids[:5]), 5) + write_long(3) + varints(ids[5:]) + b"\x00"
    response = sized_block(write_long(7), 1) + sized_block(write_long(300), 1) + b"\x00"
    logprobs = sized_block(struct.pack("<f", -0.5), 1) + write_long(1) + struct.pack("<f", -0.25) + b"\x00"
    arrays = call_arrays(prompt + response + logprobs)
    assert (arrays.prompt, arrays.prompt_count, arrays.response, arrays.response_count) == (
        varints(ids), 8, varints([7, 300]), 2)
    assert arrays.logprobs == struct.pack("<2f", -0.5, -0.25) and varint_count(arrays.prompt) == 8
    written = array(8, arrays.prompt) + array(2, arrays.response) + array(2, arrays.logprobs)
    datum = b"\x02x" * 5 + b"\x00\x00" + written + b"\x00\x02\x00" + b"\x00" * 24 + b"\x00\x00"
    value = decode(datum)  # one block each, as fastavro reads them
    assert (value["prompt_token_ids"], value["response_token_ids"], value["behaviour_logprobs"]) == (
        ids, [7, 300], [-0.5, -0.25])


def test_a_sized_block_merges_like_the_same_ids_in_a_plain_block():
    spans = [llm(0, [1, 2], [3]), llm(1, [1, 2, 3, 4], [5]), reward()]
    assert transitions(rollout(spans, sized=True)) == transitions(rollout(spans, sized=False))


@pytest.mark.parametrize("tokens, says", [
    (array(2, varints([1, 2])) + array(1, varints([3])) + array(1, struct.pack("<f", -0.5))[:-3], "cut short"),
    (array(2, varints([1, 2])) + array(1, varints([3])) + array(1, struct.pack("<f", -0.5)) + b"\x00", "bytes"),
    (sized_block(varints([1, 2, 300]), 2) + b"\x00" + array(1, b"\x06") + array(1, b"\x00" * 4), "2 ids"),
    (sized_block(b"\x02\x84", 2) + b"\x00" + array(1, b"\x06") + array(1, b"\x00" * 4), "2 ids"),
    (array(1, b"\x02") + array(1, b"\x06") + sized_block(b"\x00" * 5, 1) + b"\x00", "1 floats"),
])
def test_token_bytes_that_do_not_read_as_three_arrays_are_refused_by_name(tokens, says):
    with pytest.raises(UnreadableTokens, match=says):
        call_arrays(tokens)


def test_a_call_with_logprobs_that_do_not_match_its_response_stands_alone():
    spans = [llm(0, [1, 2], [3]), llm(1, [1, 2, 3], [4, 5], logprobs=[-1.0]), llm(2, [1, 2, 3, 4, 5], [6]), reward()]
    samples, merges, breaks = transitions(rollout(spans))
    assert (merges, breaks) == (0, 0)
    assert [(s["span_id"], s["merged_calls"], s["split_at_break"]) for s in samples] == [
        ("llm0", 1, False), ("llm1", 1, False), ("llm2", 1, False)]
    assert samples[1]["behaviour_logprobs"] == [-1.0]  # copied as transition level copies it (the trainer refuses it)


def test_demonstrations_merge_into_samples_without_logprobs_and_never_with_sampled_calls():
    first = llm(0, [1, 2], [3, 4], logprobs=[])  # scripted: token ids, no logprobs
    second = llm(1, [1, 2, 3, 4, 40, 41], [5], logprobs=[])
    sampled = llm(2, [1, 2, 3, 4, 40, 41, 5, 42], [6])  # extends them, but the model sampled it
    samples, merges, breaks = transitions(rollout([first, second, sampled, reward()]))
    assert (merges, breaks) == (1, 0)  # a change of kind is not retokenization drift
    demonstration, alone = samples
    assert demonstration["response_token_ids"] == [3, 4, 40, 41, 5]
    assert demonstration["loss_mask"] == [True, True, False, False, True]
    assert demonstration["behaviour_logprobs"] == [] and demonstration["merged_calls"] == 2
    assert (alone["span_id"], alone["behaviour_logprobs"], alone["split_at_break"]) == ("llm2", [-0.5], False)


def processor(rule: CreditRule) -> SpanProcessor:
    config = replace(load_config(environ={}), credit=(rule,))
    return SpanProcessor(config, None, None, Sent(), Held(), None, CODEC)  # type: ignore[arg-type]


def three_calls() -> list[dict]:
    """A tool loop: the second prompt extends the first exactly, the third re-renders the first reply."""
    return [llm(0, [1, 2], [3, 4]), llm(1, [1, 2, 3, 4, 40, 41], [5]), llm(2, [1, 2, 3, 9, 40, 41, 5, 42], [6, 7])]


def test_the_span_processor_counts_merges_and_breaks_in_the_rollouts_row_at_trajectory_level_only():
    for level, counts, merged in [("trajectory", (1, 1), [2, 1]), ("transition", (0, 0), [1, 1, 1])]:
        spans = processor(CreditRule(level=level))
        finished: list = []
        row = spans._decide(rollout([*three_calls(), reward()]), finished, 0.0)
        assert (row.prefix_merges, row.prefix_breaks) == counts
        assert (spans.counters.prefix_merges, spans.counters.prefix_breaks) == counts
        datums = asyncio.run(spans._emit_transitions(finished))
        assert [decode(datum)["merged_calls"] for datum in datums] == merged
        assert [t["merged_calls"] for _, _, value in spans.emitter.records  # type: ignore[attr-defined]
                for t in CODEC.decode(value)[1]["transitions"]] == merged


def test_a_grpo_group_at_trajectory_level_credits_the_merged_samples():
    spans = processor(CreditRule(strategy="grpo", group_size=2, level="trajectory"))
    finished: list = []
    rows = [spans._decide(rollout([*three_calls(), reward(value)], group="g", rollout_id=name), finished, 0.0)
            for name, value in (("r", 1.0), ("r2", 0.0))]
    assert [(row.prefix_merges, row.prefix_breaks) for row in rows] == [(1, 1), (1, 1)]
    assert asyncio.run(spans._emit_transitions(finished)) == []  # the group credits them
    sink = CompletionSink(None, "db", Held())  # type: ignore[arg-type]
    groups = GroupProcessor(spans.config, Sent(), Held(), sink, CODEC)
    records = [RawRecord("groups", 0, offset, key, value)
               for offset, (_, key, value) in enumerate(spans.emitter.records)]  # type: ignore[attr-defined]
    groups.apply(groups.read(records))
    asyncio.run(groups.tick())
    samples = [decode(datum) for datum in sink.queue.get_nowait().transitions]
    assert [(s["rollout_id"], s["merged_calls"], s["split_at_break"], round(s["advantage"], 4)) for s in samples] == [
        ("r", 2, False, 1.0), ("r", 1, True, 1.0), ("r2", 2, False, -1.0), ("r2", 1, True, -1.0)]
    assert {s["group_id"] for s in samples} == {"g"}  # the trainer keeps a group's samples in one step
    assert samples[0]["response_token_ids"] == [3, 4, 40, 41, 5] and samples[0]["loss_mask"] == [True, True, False,
                                                                                                  False, True]


def test_a_rollout_credited_alone_names_no_group_in_its_transitions():
    for level in ("trajectory", "transition"):
        spans = processor(CreditRule(strategy="final", level=level))
        finished: list = []
        spans._decide(rollout([*three_calls(), reward()], group="session-7"), finished, 0.0)
        datums = asyncio.run(spans._emit_transitions(finished))
        assert datums and {decode(datum)["group_id"] for datum in datums} == {None}


def test_a_call_whose_token_bytes_lie_about_their_count_makes_no_sample_and_is_logged(caplog):
    trajectory = rollout([llm(0, [1, 2], [3]), llm(1, [1, 2, 3, 4], [5]), llm(2, [1, 2, 3, 4, 5, 6], [7]), reward()])
    lying = sized_block(varints([1, 2, 3, 4]), 3) + b"\x00" + array(1, b"\x0a") + array(1, b"\x00" * 4)
    trajectory.trainable_calls[1].tokens = lying  # the span reader steps over a sized block without counting it
    samples, merges, breaks = transitions(trajectory)
    assert (merges, breaks) == (0, 0)
    assert [(s["span_id"], s["merged_calls"], s["split_at_break"]) for s in samples] == [
        ("llm0", 1, False), ("llm2", 1, False)]
    assert "no sample from call llm1 of rollout r: prompt ids" in caplog.text
