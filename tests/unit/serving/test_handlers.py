"""The dev model server's routes driven by the official openai SDK: vLLM's token-id/logprob contract,
streaming, completions, tool calls, LoRA routes, weight loads and OpenAI errors."""

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

from agentstream.models import LoadedModel, load_model
from agentstream.serving.app import create_app
from agentstream.serving.tool_format import render_prompt
from tests.support.http_thread import ServerThread, post
from tests.support.servers import HELLO, TOLERANCE, WEATHER_TOOL, assert_exact, make_lora, scripted


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
    from agentstream.serving.handlers import SERVER

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


# ---------------------------------------------------------------- sampling options


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
