"""The dev model server driven by the official openai SDK: vLLM's token-id/logprob contract, tools, LoRA, weights."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from transformers.cache_utils import Cache

from models import LoadedModel, ModelLoadError, load_model, tiny_tokenizer
from serving.app import create_app
from serving.generation import BatchRequest, SamplingParams, SequenceState, draw, generate_batch, truncate
from serving.kv_cache import ROOM, decoding_cache
from serving.tool_format import (
    ToolStreamFilter,
    canonical_tool_call,
    parse_tool_calls,
    render_prompt,
    renders_tools,
)
from tests.support.http_thread import ServerThread
from tests.support.servers import TOLERANCE, assert_exact, make_lora, scripted

HELLO = [{"role": "user", "content": "Say hello."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def post(url: str, body: dict | bytes) -> tuple[int, dict | str, dict]:
    """POST raw JSON with urllib; returns (status, parsed body, headers) for errors too."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, raw, headers = response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as error:
        status, raw, headers = error.code, error.read().decode(), dict(error.headers)
    try:
        return status, json.loads(raw), headers
    except json.JSONDecodeError:
        return status, raw, headers


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture(scope="module")
def server(tiny: LoadedModel):
    running = ServerThread(create_app(tiny))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_logprobs(choice) -> list[float]:
    return [entry.logprob for entry in choice.logprobs.content]


# ---------------------------------------------------------------- chat


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chat_token_ids_and_logprobs_are_exact(client, tiny, temperature):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=HELLO, max_tokens=24, temperature=temperature, seed=11, n=2,
        logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True})
    assert raw.headers["X-Policy-Version"] == "0"
    response = raw.parse()
    extra = response.model_extra
    assert extra["prompt_token_ids"] == render_prompt(tiny.tokenizer, HELLO, None, True)
    assert response.object == "chat.completion" and len(response.choices) == 2
    for choice in response.choices:
        ids = choice.model_extra["token_ids"]
        assert_exact(tiny, tiny.model, extra["prompt_token_ids"], ids, choice.message.content,
                     chat_logprobs(choice), temperature)
        assert choice.finish_reason in ("stop", "length")
        assert all(len(entry.top_logprobs) == 3 for entry in choice.logprobs.content)
        assert all(entry.top_logprobs[0].logprob >= entry.logprob - TOLERANCE for entry in choice.logprobs.content)
    assert response.usage.prompt_tokens == len(extra["prompt_token_ids"])
    assert response.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in response.choices)


def test_greedy_is_deterministic_and_reports_temperature_one(client, tiny):
    responses = [client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, temperature=0,
                                                logprobs=True, extra_body={"return_token_ids": True})
                 for _ in range(2)]
    first, second = (r.choices[0] for r in responses)
    assert first.model_extra["token_ids"] == second.model_extra["token_ids"]
    prompt = responses[0].model_extra["prompt_token_ids"]
    assert_exact(tiny, tiny.model, prompt, first.model_extra["token_ids"], first.message.content,
                 chat_logprobs(first), 1.0)
    with torch.inference_mode():  # greedy really took the argmax at every step
        ids = torch.tensor([prompt + first.model_extra["token_ids"]])
        logits = tiny.model(input_ids=ids).logits[0, len(prompt) - 1:-1]
    assert logits.argmax(-1).tolist() == first.model_extra["token_ids"]


def test_n_samples_are_distinct_and_each_exact(client, tiny):
    response = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16, n=4, seed=3,
                                              logprobs=True, extra_body={"return_token_ids": True})
    ids = [choice.model_extra["token_ids"] for choice in response.choices]
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    assert len({tuple(i) for i in ids}) == 4
    for choice in response.choices:
        assert_exact(tiny, tiny.model, response.model_extra["prompt_token_ids"], choice.model_extra["token_ids"],
                     choice.message.content, chat_logprobs(choice), 1.0)


def test_seed_reproduces_and_differs_across_seeds(client):
    def ids(seed):
        response = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16, seed=seed,
                                                  extra_body={"return_token_ids": True})
        return response.choices[0].model_extra["token_ids"]
    assert ids(5) == ids(5)
    assert ids(5) != ids(6)


def test_concurrent_requests_are_batched_and_each_gets_what_it_would_alone(server, tiny):
    """A burst of different prompts, sampling settings, n and stops runs as one batch with per-request results."""
    from serving.handlers import SERVER

    requests = [dict(messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=8 + i, temperature=0)
                for i in range(6)]
    requests += [dict(messages=HELLO, max_tokens=12, temperature=1.0, seed=5, n=3),
                 dict(messages=[{"role": "user", "content": "A longer prompt, to be left-padded less."}],
                      max_tokens=10, temperature=0.8, seed=9, stop=["e"])]

    async def burst() -> list:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(client.chat.completions.create(
            model="tiny", logprobs=True, extra_body={"return_token_ids": True}, **r) for r in requests))

    batches = server.app[SERVER].batcher.batch_sizes
    before = sum(batches.values())
    together = asyncio.run(burst())
    assert max(batches) >= 4 and sum(batches.values()) - before < len(requests)  # they did share batches
    alone_client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    for request, batched in zip(requests, together, strict=True):
        alone = alone_client.chat.completions.create(model="tiny", logprobs=True,
                                                     extra_body={"return_token_ids": True}, **request)
        assert len(batched.choices) == request.get("n", 1)
        for mine, reference in zip(batched.choices, alone.choices, strict=True):
            assert mine.model_extra["token_ids"] == reference.model_extra["token_ids"]
            assert mine.message.content == reference.message.content
            assert chat_logprobs(mine) == pytest.approx(chat_logprobs(reference), abs=TOLERANCE)
            assert_exact(tiny, tiny.model, batched.model_extra["prompt_token_ids"], mine.model_extra["token_ids"],
                         mine.message.content, chat_logprobs(mine), request["temperature"])


def test_requests_with_the_same_prompt_share_one_prefill_and_each_gets_what_it_would_alone(tiny):
    """A GRPO group's rollouts send one request each with the same prompt: it is prefilled once, not per request."""
    group, other = [5, 6, 7, 8, 9, 10], [11, 12, 13]
    requests = [BatchRequest(group, SamplingParams(max_tokens=8, temperature=1.0, seed=seed, logprobs=True))
                for seed in (1, 2, 3)]
    requests.append(BatchRequest(other, SamplingParams(max_tokens=8, temperature=1.0, seed=4, logprobs=True)))
    prefill_rows: list[int] = []
    hook = tiny.model.register_forward_pre_hook(
        lambda module, args, kwargs: prefill_rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        together = generate_batch(tiny.model, tiny.tokenizer, requests, eos_ids=set())
    finally:
        hook.remove()
    assert prefill_rows[0] == 2 and set(prefill_rows[1:]) == {4}  # two distinct prompts, then four rows decoding
    for request, (batched,) in zip(requests, together, strict=True):
        (alone,) = generate_batch(tiny.model, tiny.tokenizer, [request], eos_ids=set())[0]
        assert batched.token_ids == alone.token_ids
        assert [e.logprob for e in batched.logprobs] == pytest.approx([e.logprob for e in alone.logprobs],
                                                                      abs=TOLERANCE)
    assert len({tuple(states[0].token_ids) for states in together[:3]}) == 3  # same prompt, own seeds, own samples


@pytest.mark.parametrize("linger_s", [0.0, 1.0])
def test_clients_that_resubmit_at_once_merge_into_one_batch_when_the_batcher_lingers(tiny, linger_s):
    """Runners send a rollout's request right after its last one finished; a late cohort joins the early one."""
    from serving.batcher import Batcher, Job
    from serving.protocol import Output

    batcher = Batcher(tiny, set(), 0, lambda adapter: 0, linger_s=linger_s)
    output = Output(return_token_ids=True, logprobs=False, stream=False, include_usage=False)

    def client(rounds: int) -> None:
        for _ in range(rounds):
            job = Job("tiny", None, [5, 6, 7], SamplingParams(max_tokens=64, temperature=1.0), output)
            batcher.submit(job).result(timeout=60)
            time.sleep(0.02)  # the runner records the rollout and takes the next task

    try:
        with batcher.model_lock:  # the early client's first batch is taken, then waits: the late ones queue
            early = threading.Thread(target=client, args=(5,))
            early.start()
            time.sleep(0.2)
            late = [threading.Thread(target=client, args=(4,)) for _ in range(3)]
            for thread in late:
                thread.start()
            time.sleep(0.1)
        for thread in [early, *late]:
            thread.join(timeout=120)
    finally:
        batcher.close()
    if linger_s:
        assert batcher.batch_sizes[4] >= 3, batcher.batch_sizes  # merged after one round, and stayed merged
    else:
        assert batcher.batch_sizes[4] == 0 and batcher.batch_sizes[1] == 5, batcher.batch_sizes  # they alternate


def test_streaming_matches_non_streaming(server, tiny):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        request = dict(model="tiny", messages=HELLO, max_tokens=40, seed=21, n=2, temperature=0.7,
                       logprobs=True, extra_body={"return_token_ids": True})
        whole = await client.chat.completions.create(**request)
        stream = await client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
        texts, ids, logprobs, finish, usage, prompt_ids = {}, {}, {}, {}, None, None
        async for chunk in stream:
            prompt_ids = prompt_ids or chunk.model_extra.get("prompt_token_ids")
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                ids.setdefault(choice.index, []).extend(choice.model_extra.get("token_ids") or [])
                if choice.logprobs is not None:
                    logprobs.setdefault(choice.index, []).extend(e.logprob for e in choice.logprobs.content)
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
        await client.close()
        return whole, texts, ids, logprobs, finish, usage, prompt_ids

    whole, texts, ids, logprobs, finish, usage, prompt_ids = asyncio.run(run())
    assert prompt_ids == whole.model_extra["prompt_token_ids"]
    for choice in whole.choices:
        assert texts[choice.index] == choice.message.content
        assert ids[choice.index] == choice.model_extra["token_ids"]
        assert logprobs[choice.index] == pytest.approx(chat_logprobs(choice), abs=1e-6)
        assert finish[choice.index] == choice.finish_reason
        assert_exact(tiny, tiny.model, prompt_ids, ids[choice.index], texts[choice.index],
                     logprobs[choice.index], 0.7)
    assert usage.completion_tokens == sum(len(i) for i in ids.values())


def test_tokens_are_streamed_as_they_are_generated():
    gate = threading.Event()
    loaded = scripted("streamed", gate)
    running = ServerThread(create_app(loaded))
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(model="scripted", messages=HELLO, stream=True, max_tokens=50)
        contents = []
        for chunk in stream:
            text = chunk.choices[0].delta.content if chunk.choices else None
            if text:
                if not gate.is_set():  # the model is paused after its first token: this chunk came out mid-generation
                    assert text == "s"
                    gate.set()
                contents.append(text)
        assert gate.is_set() and "".join(contents) == "streamed"
    finally:
        gate.set()
        running.stop()


# ---------------------------------------------------------------- text and sampling units


def test_text_deltas_hold_back_partial_characters_and_stop_strings():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("a€b", add_special_tokens=False)  # € is three bytes
    sequence = SequenceState(0, tokenizer, SamplingParams(max_tokens=10), {tokenizer.eos_token_id})
    assert [sequence.append(i, None).text for i in ids] == ["a", "", "", "€", "b"]

    stopped = SequenceState(0, tokenizer, SamplingParams(max_tokens=10, stop=("END",)), {tokenizer.eos_token_id})
    deltas = [stopped.append(i, None) for i in tokenizer.encode("okEND!", add_special_tokens=False)[:5]]
    assert "".join(d.text for d in deltas) == "ok" == stopped.text
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", "END")
    assert stopped.token_ids == tokenizer.encode("okEND", add_special_tokens=False)


def test_eos_and_stop_token_ids_end_sequences_and_stay_in_token_ids():
    tokenizer = tiny_tokenizer()
    eos = tokenizer.eos_token_id
    sequence = SequenceState(0, tokenizer, SamplingParams(max_tokens=10), {eos})
    last = [sequence.append(i, None) for i in [*tokenizer.encode("hi", add_special_tokens=False), eos]][-1]
    assert (last.finish_reason, last.stop_reason, sequence.text, sequence.token_ids[-1]) == ("stop", None, "hi", eos)
    by_id = SequenceState(0, tokenizer, SamplingParams(max_tokens=10, stop_token_ids=(ord("x") + 3,)), {eos})
    assert by_id.append(ord("x") + 3, None).stop_reason == ord("x") + 3


def test_top_k_and_top_p_truncation():
    logprobs = torch.log_softmax(torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]), dim=-1)
    kept = lambda masked: torch.isfinite(masked)[0].tolist()  # noqa: E731
    assert kept(truncate(logprobs, 2, 1.0)) == [True, True, False, False, False]
    probs = logprobs.exp()[0]
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert kept(truncate(logprobs, 0, 0.7)) == [True, True, False, False, False]
    assert kept(truncate(logprobs, 0, 1.0)) == [True] * 5


def test_decoding_in_place_past_the_reserved_room_keeps_every_row_exact(tiny):
    """Rows that end at different steps leave the batch, and decoding past ``ROOM`` grows the buffers: still exact."""
    assert isinstance(decoding_cache(tiny.model), Cache)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    lengths = [3, 40, ROOM + 20]
    requests = [BatchRequest(prompts[number % 2], SamplingParams(max_tokens=length, temperature=1.0, seed=number,
                                                                 ignore_eos=True, logprobs=True))
                for number, length in enumerate(lengths)]
    results = generate_batch(tiny.model, tiny.tokenizer, requests, eos_ids=set())
    for request, (state,), length in zip(requests, results, lengths, strict=True):
        assert len(state.token_ids) == length
        assert_exact(tiny, tiny.model, list(request.prompt_ids), state.token_ids, None,
                     [entry.logprob for entry in state.logprobs], 1.0)


def test_draw_follows_the_probabilities_and_never_picks_an_impossible_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]]).repeat(20_000, 1)
    picked = draw(probs, torch.Generator().manual_seed(3))
    counts = torch.bincount(picked, minlength=6) / len(picked)
    assert counts[[0, 2, 5]].tolist() == [0.0, 0.0, 0.0]
    assert torch.allclose(counts[[1, 3, 4]], torch.tensor([0.5, 0.3, 0.2]), atol=0.015)
    assert torch.equal(draw(probs[:50], torch.Generator().manual_seed(3)), picked[:50])  # a seed replays
    unnormalised = torch.tensor([[0.0, 0.0, 0.0, 7.0]])  # truncation leaves rows that need not sum to 1
    assert draw(unnormalised, torch.Generator().manual_seed(0)).tolist() == [3]


def test_chat_with_top_k_top_p_still_reports_untruncated_logprobs(client, tiny):
    response = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=20, seed=2, temperature=0.7,
                                              top_p=0.8, logprobs=True,
                                              extra_body={"return_token_ids": True, "top_k": 20})
    choice = response.choices[0]
    assert_exact(tiny, tiny.model, response.model_extra["prompt_token_ids"], choice.model_extra["token_ids"],
                 choice.message.content, chat_logprobs(choice), 0.7)


def test_stop_string_cuts_text_but_not_token_ids(client, tiny):
    base = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=30, seed=8, temperature=0.5,
                                          extra_body={"return_token_ids": True}).choices[0]
    stop = next(c for c in base.message.content[3:] if c.isprintable() and not c.isspace())
    cut = base.message.content.index(stop)
    stopped = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=30, seed=8, temperature=0.5,
                                             stop=[stop], extra_body={"return_token_ids": True}).choices[0]
    assert stopped.message.content == base.message.content[:cut]
    assert (stopped.finish_reason, stopped.model_extra["stop_reason"]) == ("stop", stop)
    ids = stopped.model_extra["token_ids"]
    assert ids == base.model_extra["token_ids"][:len(ids)]
    assert stop in tiny.tokenizer.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------- completions


def test_completions_with_string_and_token_prompts(client, tiny):
    prompt = "The capital of France is"
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, seed=4, logprobs=2,
                                         extra_body={"return_token_ids": True})
    choice = response.choices[0]
    prompt_ids = choice.model_extra["prompt_token_ids"]
    assert prompt_ids == tiny.tokenizer(prompt).input_ids
    assert_exact(tiny, tiny.model, prompt_ids, choice.model_extra["token_ids"], choice.text,
                 choice.logprobs.token_logprobs, 1.0)
    assert len(choice.logprobs.tokens) == len(choice.logprobs.text_offset) == 12
    for token, logprob, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs,
                                   choice.logprobs.top_logprobs, strict=True):
        assert max(top.values()) >= logprob and token in top  # the top alternatives plus the sampled token
    assert response.usage.completion_tokens == 12 and choice.finish_reason == "length"

    token_prompt = [40, 50, 60, 70]
    by_ids = client.completions.create(model="tiny", prompt=token_prompt, max_tokens=8, seed=4, logprobs=0,
                                       extra_body={"return_token_ids": True}).choices[0]
    assert by_ids.model_extra["prompt_token_ids"] == token_prompt
    assert_exact(tiny, tiny.model, token_prompt, by_ids.model_extra["token_ids"], by_ids.text,
                 by_ids.logprobs.token_logprobs, 1.0)


def test_completions_stream_matches_non_streaming(client):
    request = dict(model="tiny", prompt=[40, 50, 60], max_tokens=20, seed=9, logprobs=1,
                   extra_body={"return_token_ids": True})
    whole = client.completions.create(**request).choices[0]
    text, ids, logprobs, prompt_ids = "", [], [], None
    for chunk in client.completions.create(**request, stream=True):
        for choice in chunk.choices:
            text += choice.text
            ids += choice.model_extra["token_ids"]
            logprobs += choice.logprobs.token_logprobs
            prompt_ids = prompt_ids or choice.model_extra.get("prompt_token_ids")
    assert (text, ids, prompt_ids) == (whole.text, whole.model_extra["token_ids"], [40, 50, 60])
    assert logprobs == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)


# ---------------------------------------------------------------- tools


def test_parse_tool_calls_from_text():
    parsed = parse_tool_calls('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                              '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert parsed.content == "Let me look.\n"
    assert [call["function"]["name"] for call in parsed.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(call["id"].startswith("call_") and call["type"] == "function" for call in parsed.tool_calls)

    unterminated = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert unterminated.content is None and unterminated.tool_calls[0]["function"]["arguments"] == '{"x": 1}'
    broken = parse_tool_calls("<tool_call>{not json}</tool_call>")
    assert broken.tool_calls == [] and broken.content == "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls("no tools here") == parse_tool_calls("no tools here")
    assert parse_tool_calls("no tools here").tool_calls == []
    spaced = parse_tool_calls('\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", '
                              '"arguments": {}}</tool_call>\n')
    assert spaced.content == "\n" and len(spaced.tool_calls) == 2, "leading text is kept, separators are not"


def test_tool_stream_filter_never_leaks_a_tool_call():
    text = 'Sure.<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    stream_filter = ToolStreamFilter()
    streamed = "".join(stream_filter.feed(character) for character in text)
    rest, calls = stream_filter.finish()
    assert streamed + rest == "Sure." and calls[0]["function"]["name"] == "f"
    partial = ToolStreamFilter()
    assert partial.feed("ok <tool") == "ok "
    assert partial.feed("kit") == "<toolkit"


def test_tools_render_natively_or_as_a_system_prompt():
    tokenizer = tiny_tokenizer()
    conversation = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert renders_tools(tokenizer)
    native = tokenizer.decode(render_prompt(tokenizer, conversation, [WEATHER_TOOL], True))
    assert '"name": "get_weather"' in native and "<tools>" in native
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in native
    assert "<tool_response>\nsunny\n</tool_response>" in native

    plain = tiny_tokenizer()  # a template that ignores tools, like SmolLM2's
    plain.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert not renders_tools(plain)
    fallback = plain.decode(render_prompt(plain, conversation, [WEATHER_TOOL], False))
    assert fallback.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in fallback
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in fallback
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in fallback


PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # ignores tools, like SmolLM2's
CALL = canonical_tool_call("get_weather", {"city": "Oslo"})


@pytest.mark.parametrize(("written", "extends"), [
    (CALL, True),
    ("Let me look.\n" + CALL, True),
    ("Sure. " + CALL + "\n" + canonical_tool_call("get_time", {"zone": "CET", "exact": True}), True),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', False),
    ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>', False),
    ('<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>', False),
    (CALL + "\nDone.", False),
], ids=["canonical", "text-before", "two-calls", "no-newlines", "compact", "keys-swapped", "text-after"])
def test_a_tool_call_sent_back_re_renders_into_the_tokens_written_in_the_canonical_form_only(written, extends):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = PLAIN_TEMPLATE
    prompt = render_prompt(tokenizer, HELLO, [WEATHER_TOOL], False)
    response = tokenizer.encode(written + "<|im_end|>", add_special_tokens=False)  # bytes: the turn's end is text
    parsed = parse_tool_calls(written)
    assert parsed.tool_calls, "every form parses into a call"
    sent_back = json.loads(json.dumps({"role": "assistant", "content": parsed.content,
                                       "tool_calls": parsed.tool_calls}))  # as the SDK sends it
    results = [{"role": "tool", "tool_call_id": call["id"], "content": "ok"} for call in parsed.tool_calls]
    following = render_prompt(tokenizer, [*HELLO, sent_back, *results], [WEATHER_TOOL], False)
    sequence = prompt + response
    assert (following[:len(sequence)] == sequence) is extends


def test_tool_calls_end_to_end():
    raw = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    loaded = scripted(raw)
    running = ServerThread(create_app(loaded))
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        request = dict(model="scripted", messages=HELLO, tools=[WEATHER_TOOL], max_tokens=200,
                       extra_body={"return_token_ids": True})
        response = client.chat.completions.create(**request)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
        (call,) = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert loaded.tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True) == raw
        assert choice.model_extra["token_ids"][-1] == loaded.tokenizer.eos_token_id
        assert "get_weather" in loaded.tokenizer.decode(response.model_extra["prompt_token_ids"])

        content, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(**request, stream=True):
            for delta_choice in chunk.choices:
                content += delta_choice.delta.content or ""
                for tool_call in delta_choice.delta.tool_calls or []:
                    calls[tool_call.index] = tool_call
                finish = delta_choice.finish_reason or finish
        assert (content, finish) == ("Checking.", "tool_calls")
        assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}

        without_parsing = client.chat.completions.create(**request, tool_choice="none").choices[0]
        assert without_parsing.message.content == raw and not without_parsing.message.tool_calls
    finally:
        running.stop()


# ---------------------------------------------------------------- models, LoRA, weights, errors


def test_lora_load_serve_unload(server, client, tiny, tmp_path):
    reference = make_lora(tmp_path / "adapter")
    status, body, _ = post(server.url + "/v1/load_lora_adapter",
                           {"lora_name": "skill-v7", "lora_path": str(tmp_path / "adapter"), "version": 7})
    assert status == 200 and "skill-v7" in body
    try:
        models = {m.id: m for m in client.models.list().data}
        assert models["skill-v7"].model_extra["parent"] == "tiny" and models["tiny"].model_extra["parent"] is None

        request = dict(messages=HELLO, max_tokens=16, seed=5, logprobs=True, extra_body={"return_token_ids": True})
        base = client.chat.completions.create(model="tiny", **request).choices[0]
        raw = client.chat.completions.with_raw_response.create(model="skill-v7", **request)
        assert raw.headers["X-Policy-Version"] == "7"
        adapted = raw.parse()
        assert adapted.model == "skill-v7"
        ids = adapted.choices[0].model_extra["token_ids"]
        assert ids != base.model_extra["token_ids"]
        assert_exact(tiny, reference, adapted.model_extra["prompt_token_ids"], ids, adapted.choices[0].message.content,
                     chat_logprobs(adapted.choices[0]), 1.0)
        again = client.chat.completions.create(model="tiny", **request).choices[0]
        assert again.model_extra["token_ids"] == base.model_extra["token_ids"]  # the base model is untouched

        duplicate = post(server.url + "/v1/load_lora_adapter", {"lora_name": "skill-v7", "lora_path": str(tmp_path)})
        assert duplicate[0] == 400 and duplicate[1]["error"]["code"] == 400
        missing = post(server.url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "none")})
        assert missing[0] == 404 and missing[1]["error"]["type"] == "NotFoundError"
    finally:
        status, body, _ = post(server.url + "/v1/unload_lora_adapter", {"lora_name": "skill-v7"})
    assert status == 200
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="skill-v7", messages=HELLO, max_tokens=2)
    assert post(server.url + "/v1/unload_lora_adapter", {"lora_name": "skill-v7"})[0] == 404


def test_an_adapter_runs_on_merged_weights_made_again_when_the_base_weights_change(tmp_path):
    from serving.lora import applied, load_lora

    model = load_model("tiny").model
    reference = make_lora(tmp_path / "adapter")
    adapter = load_lora(tmp_path / "adapter", model, "skill", 1)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    weights = {name: module.weight for name, module in model.named_modules() if name in adapter.layers}
    with torch.no_grad():
        with applied(adapter, model):
            merged = model(input_ids=ids).logits
        expected = reference(input_ids=ids).logits
        assert torch.allclose(merged, expected, atol=1e-5)  # what peft computes unmerged
        assert all(module.weight is weights[name] for name, module in model.named_modules() if name in weights)
        assert not torch.allclose(model(input_ids=ids).logits, merged)  # the base model, untouched

        changed = next(iter(weights))
        weights[changed].mul_(1.5)  # a full-weight load assigns in place
        with applied(adapter, model):
            after = model(input_ids=ids).logits
        fresh = load_lora(tmp_path / "adapter", model, "skill", 1)  # no merged copies yet
        with applied(fresh, model):
            assert torch.equal(after, model(input_ids=ids).logits)
        assert not torch.allclose(after, merged)


def test_unknown_model_and_bad_requests_get_openai_errors(server, client):
    status, body, headers = post(server.url + "/v1/chat/completions", {"model": "nope", "messages": HELLO})
    assert status == 404 and headers["X-Policy-Version"] == "0"
    assert body == {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                              "param": "model", "code": 404}}
    for bad in (b"{not json", {"model": "tiny"}, {"messages": HELLO, "temperature": "hot"},
                {"messages": HELLO, "top_logprobs": 2}, {"messages": [{"role": "user", "content": "x" * 5000}]},
                {"messages": HELLO, "max_tokens": 10_000}, {"prompt": [1, 999_999]}):
        path = "/v1/completions" if isinstance(bad, dict) and "prompt" in bad else "/v1/chat/completions"
        status, body, _ = post(server.url + path, bad)
        assert status == 400, bad
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == 400
    too_long = post(server.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]})
    assert "maximum context length is 4096" in too_long[1]["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=0)
    with urllib.request.urlopen(server.url + "/health", timeout=10) as response:
        assert response.status == 200 and response.headers["X-Policy-Version"] == "0"


def test_load_weights_waits_for_in_flight_generation_and_changes_outputs(tmp_path):
    served = load_model("tiny")
    updated = load_model("tiny")
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for parameter in updated.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    updated.model.save_pretrained(tmp_path / "v3")

    gate, calls = threading.Event(), []

    def pause_after_first_token(module, args, kwargs):
        calls.append(1)
        if len(calls) > 2:
            assert gate.wait(timeout=20)

    gate.set()
    running = ServerThread(create_app(served))
    hook = served.model.register_forward_pre_hook(pause_after_first_token, with_kwargs=True)
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        request = dict(model="tiny", messages=HELLO, max_tokens=12, seed=5, logprobs=True,
                       extra_body={"return_token_ids": True})
        before = client.chat.completions.create(**request)
        gate.clear()
        calls.clear()
        raw_stream = client.chat.completions.with_raw_response.create(**request, stream=True)
        assert raw_stream.headers["X-Policy-Version"] == "0"
        stream = iter(raw_stream.parse())
        ids, logprobs = [], []
        while not ids:  # the generation is now paused mid-sequence, on the old weights
            for choice in next(stream).choices:
                ids += choice.model_extra.get("token_ids") or []
                logprobs += [e.logprob for e in (choice.logprobs.content if choice.logprobs else [])]
        swap: dict = {}
        swapper = threading.Thread(target=lambda: swap.update(result=post(
            running.url + "/v1/load_weights", {"path": str(tmp_path / "v3"), "version": 3})))
        swapper.start()
        time.sleep(0.5)
        assert "result" not in swap  # the swap waits for the in-flight generation
        gate.set()
        for chunk in stream:
            for choice in chunk.choices:
                ids += choice.model_extra.get("token_ids") or []
                logprobs += [e.logprob for e in (choice.logprobs.content if choice.logprobs else [])]
        swapper.join(timeout=30)
        status, body, headers = swap["result"]
        assert status == 200 and body["version"] == 3 and headers["X-Policy-Version"] == "3"
        prompt = before.model_extra["prompt_token_ids"]
        assert ids == before.choices[0].model_extra["token_ids"]  # finished on the weights it started with
        assert_exact(served, load_model("tiny").model, prompt, ids, None, logprobs, 1.0)

        raw = client.chat.completions.with_raw_response.create(**request)
        assert raw.headers["X-Policy-Version"] == "3"
        after = raw.parse().choices[0]
        assert after.model_extra["token_ids"] != ids
        assert_exact(served, updated.model, prompt, after.model_extra["token_ids"], after.message.content,
                     chat_logprobs(after), 1.0)
        assert post(running.url + "/v1/load_weights", {"path": str(tmp_path / "nowhere"), "version": 4})[0] == 400
    finally:
        gate.set()
        hook.remove()
        running.stop()


def test_tiny_model_is_deterministic_and_bad_specs_fail(tiny):
    again = load_model("tiny")
    pairs = zip(tiny.model.state_dict().values(), again.model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    with pytest.raises(ModelLoadError):
        load_model("/nonexistent/model")
