"""The example agents, run for real: `agentstream run` -> `agentstream proxy` -> `agentstream serve-model --model tiny`.

Each agent (plain OpenAI SDK, OpenAI SDK with a calculator tool, LangChain) runs real rollouts
through a runner process, the capturing proxy and the dev server; a streams worker writes the
spans to ClickHouse, where the test checks every rollout: LLM spans with the exact prompt and
response token ids under the agent's name, a recorded reward equal to the score of the answer
the proxy captured, the rollout row and its transitions.

A random tiny model never calls a tool, so the calculator's tool loop is tested on its own:
against a scripted OpenAI-compatible endpoint (a tool call, then an answer built from the tool
result the agent sent back), and through the real proxy and dev server with a scripted model
that always calls the tool, where the prompt token ids show the tool result the model saw.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web

import agentstream as ags
from agentstream.examples import (
    arithmetic,
    calculator_agent,
    calculator_shaped,
    langchain_agent,
    make_tasks,
    word_problems,
)
from agentstream.infra.clickhouse import connect
from agentstream.infra.config import load_config
from agentstream.infra.kafka import topic_name
from agentstream.infra.processes import free_port
from agentstream.models import tiny_tokenizer
from agentstream.pipeline.proxy.server import LLMProxy
from agentstream.pipeline.runner.tasks import enqueue, grouped_tasks, read_task_file
from agentstream.pipeline.sdk import Rollout
from agentstream.serving.app import create_app
from tests.support.http_thread import ServerThread
from tests.support.readback import read_topic
from tests.support.servers import scripted
from tests.support.sinks import ListSink
from tests.support.streams_harness import (
    CliProcess,
    Worker,
    create_topics,
    wait_for,
    worker_env,
)

AGENTS = {"arithmetic": "agentstream.examples.arithmetic:solve",
          "calculator": "agentstream.examples.calculator_agent:solve",
          "langchain": "agentstream.examples.langchain_agent:solve"}
ROLLOUTS = 4
STREAMS_CONFIG = """
[topics]
partitions = 2

[streams]
app_id = "examples-{tag}"
grace_s = 0.2
session_timeout_s = 3
"""


# ---------------------------------------------------------------- the calculator, alone


@pytest.mark.parametrize("expression, value", [
    ("1+2", 3), ("(17 + 5) * 2 - 3", 41), ("-3 * -(2 + 1)", 9), ("7/2", 3.5), ("6/3", 2), ("1.5 * 2", 3),
    (" 12 - 20 ", -8), ("9" * 60 + "/3", int("3" * 60)),
])
def test_calculator_evaluates_arithmetic(expression, value):
    result = calculator_agent.calculate(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "os", "x + 1", "(1).__class__", "().__class__.__bases__", "abs(-1)",
    "2 ** 8", "7 // 2", "7 % 2", "+1", "True + 1", "1j", "'a' * 3", "[1, 2]", "1 if 1 else 2", "lambda: 1",
    "1; 2", "1 +", "", "1/0", "1e308 * 10", "1" * 201,
])
def test_calculator_refuses_everything_but_arithmetic(expression):
    with pytest.raises(calculator_agent.CalculatorError):
        calculator_agent.calculate(expression)


def test_tool_results_are_values_or_readable_errors():
    assert calculator_agent.run_tool("calculator", '{"expression": "2 * (3 + 4)"}') == "14"
    assert calculator_agent.run_tool("calculator", '{"expression": "__import__(\'os\')"}').startswith("error: only")
    assert calculator_agent.run_tool("calculator", "not json").startswith("error: the arguments")
    assert calculator_agent.run_tool("calculator", '{"expr": "1"}').startswith("error: the arguments")
    assert calculator_agent.run_tool("shell", '{"expression": "1"}') == "error: there is no tool named 'shell'"


# ---------------------------------------------------------------- the tool loop against a scripted LLM


class ScriptedLLM:
    """An OpenAI-compatible chat endpoint that answers from a script and keeps every request it got.

    Each script step is a function of the request body returning ``(content, [(tool, arguments), ...])``;
    the last step repeats.
    """

    def __init__(self, script):
        self.script, self.requests = script, []
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        if request.method != "POST" or not request.path.endswith("/v1/chat/completions"):
            return web.json_response({"error": {"message": "not found", "code": 404}}, status=404)
        body = await request.json()
        self.requests.append(body)
        turn = len(self.requests)
        content, calls = self.script[min(turn, len(self.script)) - 1](body)
        tool_calls = [{"id": f"call_{turn}_{index}", "type": "function",
                       "function": {"name": name, "arguments": arguments}}
                      for index, (name, arguments) in enumerate(calls)]
        message = {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}
        return web.json_response({
            "id": f"chatcmpl-{turn}", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def call(expression: str) -> tuple[str, str]:
    return "calculator", json.dumps({"expression": expression})


def answer_from_tool_result(body: dict) -> tuple[str, list]:
    """The answer a model would give after reading the tool result: whatever the calculator said."""
    result = body["messages"][-1]
    assert result["role"] == "tool", result
    return f"The calculator says {result['content']}, so the answer is {result['content']}.", []


def run_agent(agent, task: dict, base: str, rollout_id: str = "r-unit"):
    """One rollout of ``agent`` on a fresh event loop, its LLM at ``base`` (as if the proxy were there)."""
    return asyncio.run(agent.solve(task, Rollout(rollout_id, f"{rollout_id}-1", proxy_url=base)))


@pytest.mark.parametrize(("expression", "intermediate"), [("6 * 7", [calculator_shaped.TOOL_REWARD]),
                                                         ("6 ** 7", [])])
def test_the_shaped_calculator_rewards_a_first_turn_whose_calls_worked(expression, intermediate):
    llm = ScriptedLLM([lambda body: (None, [call(expression)]), answer_from_tool_result])
    server = ServerThread(llm.app)
    sink = ListSink()
    try:
        task = {"id": "t", "prompt": "Compute 6*7.", "answer": 42, "model": "scripted"}
        with ags.rollout("calc-shaped", sink=sink, proxy_url=server.url) as state:
            score = asyncio.run(calculator_shaped.solve(task, state))
    finally:
        server.stop()
    assert score == (1.0 if intermediate else 0.0)  # the tool's error message holds no 42
    assert [span["reward"] for span in sink.rewards()] == intermediate  # the final reward is the runner's to emit


def test_calculator_sends_the_computed_value_back_and_scores_the_answer():
    llm = ScriptedLLM([lambda body: (None, [call("(17 + 5) * 2 - 3")]), answer_from_tool_result])
    server = ServerThread(llm.app)
    try:
        task = {"id": "t", "prompt": "Compute (17+5)*2-3.", "answer": 41, "model": "scripted"}
        score = run_agent(calculator_agent, task, server.url)
    finally:
        server.stop()
    assert score == 1.0
    first, second = llm.requests
    assert first["tools"] == [calculator_agent.CALCULATOR] and first["tool_choice"] == "auto"
    assert first["messages"][-1] == {"role": "user", "content": "Compute (17+5)*2-3."}
    assistant, tool = second["messages"][-2:]
    assert assistant["role"] == "assistant"
    assert assistant["tool_calls"] == [{"id": "call_1_0", "type": "function", "function": {
        "name": "calculator", "arguments": json.dumps({"expression": "(17 + 5) * 2 - 3"})}}]
    assert tool == {"role": "tool", "tool_call_id": "call_1_0", "content": "41"}
    assert second["messages"][:2] == first["messages"]


def test_calculator_loop_is_bounded_and_reports_tool_errors_to_the_model():
    llm = ScriptedLLM([lambda body: (None, [call("__import__('os').system('true')"), ("shell", "{}"),
                                            call("40 + 2")])])
    server = ServerThread(llm.app)
    try:
        score = run_agent(calculator_agent, {"id": "t", "prompt": "Compute 40+2.", "answer": 42, "model": "m"},
                          server.url)
    finally:
        server.stop()
    assert score == 0.0, "the model never answered in text"
    assert len(llm.requests) == calculator_agent.MAX_TURNS
    assert [r["tool_choice"] for r in llm.requests] == ["auto"] * (calculator_agent.MAX_TURNS - 1) + ["none"]
    results = [m for m in llm.requests[1]["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == ["call_1_0", "call_1_1", "call_1_2"]
    assert results[0]["content"].startswith("error: only numbers") and "__import__" in results[0]["content"]
    assert results[1]["content"] == "error: there is no tool named 'shell'"
    assert results[2]["content"] == "42"


@pytest.fixture
def offline(monkeypatch):
    """Name resolution works for loopback only: any download (tiktoken files, LangSmith) fails loudly."""
    import socket

    resolve = socket.getaddrinfo
    refused = []

    def loopback_only(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", "::1"):
            refused.append(host)
            raise OSError(f"offline test: refused to resolve {host!r}")
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", loopback_only)
    for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "OPENAI_BASE_URL", "OPENAI_API_BASE"):
        monkeypatch.delenv(name, raising=False)
    yield refused
    assert not refused, f"tried to reach {refused}"


@pytest.mark.parametrize("agent", [arithmetic, calculator_agent, langchain_agent], ids=lambda m: m.__name__)
@pytest.mark.parametrize("reply, expected", [("Adding them: 9 + 11 = 20", 1.0), ("9 + 11 is 21", 0.0), ("", 0.0)])
def test_agents_score_the_answer_offline(agent, reply, expected, offline):
    llm = ScriptedLLM([lambda body: (reply, [])])
    server = ServerThread(llm.app)
    try:
        score = run_agent(agent, {"id": "add-9-11", "prompt": "Compute 9+11.", "answer": 20, "model": "tiny"},
                          server.url)
    finally:
        server.stop()
    assert score == expected
    (request,) = llm.requests
    assert request["model"] == "tiny" and request["messages"][-1] == {"role": "user", "content": "Compute 9+11."}
    assert request.get("max_tokens", request.get("max_completion_tokens")) == agent.MAX_TOKENS
    assert not request.get("stream")


# ---------------------------------------------------------------- the tool loop through the real proxy and dev server


def test_calculator_loop_through_the_proxy_and_dev_server(publisher, topics_config, kafka_options):
    raw = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    loaded = scripted(raw)  # the real dev server; its model writes this tool call whatever the prompt
    upstream = ServerThread(create_app(loaded))
    proxy = ServerThread(LLMProxy(upstream.url, publisher, agent_name="math-calculator").app)
    rollout_id = f"r-calc-{uuid.uuid4().hex[:8]}"
    try:
        score = run_agent(calculator_agent, {"id": "t", "prompt": "Compute 6*7.", "answer": 42, "model": "scripted"},
                          proxy.url, rollout_id=rollout_id)
    finally:
        proxy.stop()
        upstream.stop()
    assert score == 0.0, "the scripted model only ever calls the tool"
    publisher.flush(10)
    landed = read_topic(kafka_options, topic_name(topics_config.topics, "spans"),
                        lambda got: len(got.of(rollout_id)[0]) >= calculator_agent.MAX_TURNS, timeout_s=20)
    spans = sorted(landed.of(rollout_id)[0], key=lambda s: s["start_time_us"])
    assert [s["kind"] for s in spans] == ["LLM"] * calculator_agent.MAX_TURNS
    finishes = [json.loads(s["attributes"]["gen_ai.response.finish_reasons"]) for s in spans]
    assert finishes == [["tool_calls"], ["tool_calls"], ["stop"]], "tool_choice 'none' on the last turn"
    for span in spans:
        assert span["agent_name"] == "math-calculator"
        assert loaded.tokenizer.decode(span["response_token_ids"], skip_special_tokens=True) == raw
        assert "calculator" in span["attributes"]["gen_ai.tool.definitions"]
    sent = json.loads(spans[1]["attributes"]["gen_ai.input.messages"])
    assert sent[-1]["role"] == "tool" and sent[-1]["content"] == "42"
    assert sent[-2]["tool_calls"][0]["function"]["name"] == "calculator"
    seen = loaded.tokenizer.decode(spans[1]["prompt_token_ids"])
    assert "<tool_response>\n42\n</tool_response>" in seen, "the dev server rendered the tool result for the model"
    assert seen.count("<tool_response>") == 1
    assert loaded.tokenizer.decode(spans[2]["prompt_token_ids"]).count("<tool_response>\n42\n</tool_response>") == 2


# ---------------------------------------------------------------- task files


@pytest.mark.parametrize(("agent", "stem"), [(arithmetic, "arithmetic"), (calculator_agent, "calculator"),
                                             (word_problems, "word-problems")])
def test_task_files_are_the_seeded_split(tmp_path, agent, stem):
    written = make_tasks.write(tmp_path)
    train, heldout = agent.split()
    for name, tasks in (("train", train), ("heldout", heldout)):
        committed = make_tasks.TASKS_DIR / f"{stem}-{name}.jsonl"
        assert committed.read_text() == written[f"{stem}-{name}"].read_text(), (
            f"{committed} is stale: python -m agentstream.examples.make_tasks")
        assert read_task_file(committed) == tasks
    assert len(heldout) == agent.HELDOUT_SIZE
    assert {t["id"] for t in train}.isdisjoint(t["id"] for t in heldout)
    assert sorted(train + heldout, key=lambda t: t["id"]) == sorted(agent.all_tasks(), key=lambda t: t["id"])
    for task in train + heldout:  # "Compute a+b.", "Compute a*b+d." or a story's three numbers
        numbers = [int(n) for n in re.findall(r"\d+", task["prompt"])]
        if agent is word_problems:
            assert task["answer"] == calculator_agent.calculate(word_problems.kind_of(task).expression.format(
                a=numbers[0], b=numbers[1], c=numbers[2])) > 0
        else:
            assert task["answer"] == (sum(numbers) if len(numbers) == 2 else numbers[0] * numbers[1] + numbers[2])


def test_word_problems_demonstrate_half_the_kinds_and_hold_out_every_kind_alike():
    train, heldout = word_problems.split()
    kinds = {kind.name for kind in word_problems.KINDS}
    per_kind = collections.Counter(word_problems.kind_of(task).name for task in heldout)
    assert set(per_kind) == kinds and set(per_kind.values()) == {len(heldout) // len(kinds)}
    demonstrated = word_problems.demonstration_tasks(train)
    assert {word_problems.kind_of(task).name for task in demonstrated} == word_problems.DEMONSTRATED
    assert 0 < len(word_problems.DEMONSTRATED) < len(kinds)
    assert demonstrated == [t for t in train if word_problems.kind_of(t).name in word_problems.DEMONSTRATED]
    for task in demonstrated[:8] + heldout:  # a demonstration computes the answer with the task's own expression
        conversation = word_problems.demonstration(task)
        arguments = json.loads(conversation[2]["tool_calls"][0]["function"]["arguments"])
        assert calculator_agent.calculate(arguments["expression"]) == task["answer"]
        assert conversation[3]["content"] == str(task["answer"])
        assert arithmetic.final_number(conversation[-1]["content"]) == task["answer"]


def test_a_larger_heldout_set_extends_the_demos():
    train, heldout = arithmetic.split(heldout=160)
    assert len(heldout) == 160 and heldout[:arithmetic.HELDOUT_SIZE] == arithmetic.split()[1]
    assert {t["id"] for t in train}.isdisjoint(t["id"] for t in heldout) and len(train) + 160 == 400
    with pytest.raises(ValueError, match="between 1 and 399"):
        arithmetic.split(heldout=400)


# ---------------------------------------------------------------- every agent end to end


@dataclass
class Fleet:
    env: dict
    logs: Path
    database: str
    server_url: str
    group: str


def wait_healthy(url: str, process: CliProcess, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        assert process.process.poll() is None, process.log()[-3000:]
        assert time.monotonic() < deadline, f"{url} never became healthy:\n{process.log()[-3000:]}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fleet(stack, stack_config, tmp_path_factory):
    """One dev server (tiny) and one streams worker on this module's topics and database."""
    logs = tmp_path_factory.mktemp("examples")
    tag = uuid.uuid4().hex[:8]
    database = f"examples_{tag}"
    env = worker_env(logs, stack, f"ex{tag}.", database, STREAMS_CONFIG.format(tag=tag))
    create_topics(env)
    port = free_port()
    server = CliProcess(["serve-model", "--model", "tiny", "--port", str(port)], env, logs / "server.log").start()
    streams = Worker(env, logs / "streams.log")
    try:
        streams.start()
        wait_healthy(f"http://127.0.0.1:{port}", server)
        yield Fleet(env, logs, database, f"http://127.0.0.1:{port}", f"runners-{tag}")
    finally:
        server.stop()
        streams.stop()
        client = connect(stack_config.clickhouse, stack.clickhouse_url)
        client.command(f"DROP DATABASE IF EXISTS {database}")
        client.close()


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.mark.parametrize("name", list(AGENTS))
def test_agent_rollouts_are_captured_with_token_ids_and_rewards(name, fleet, stack, clickhouse, tokenizer):
    started = time.monotonic()
    agent_name = f"math-{name}"
    proxy_url = f"http://127.0.0.1:{free_port()}"
    # The rollout's base URL carries its rollout and attempt ids but not its agent's name: the proxy's
    # LLM spans get the name from --agent-name (the runner's own spans get it from the task).
    proxy = CliProcess(["proxy", "--upstream", fleet.server_url, "--port", proxy_url.rsplit(":", 1)[1],
                        "--agent-name", agent_name], fleet.env, fleet.logs / f"proxy-{name}.log").start()
    # The shipped task file names no model: each agent asks the server which model it serves (tiny here).
    payloads = read_task_file(make_tasks.TASKS_DIR / "arithmetic-train.jsonl")
    assert not any("model" in payload for payload in payloads)
    tasks = grouped_tasks(payloads[:ROLLOUTS], agent_name=agent_name, timeout_s=60)
    by_rollout = {task["rollout_id"]: json.loads(task["input"]) for task in tasks}
    try:
        wait_healthy(proxy_url, proxy)
        asyncio.run(enqueue(load_config(environ=fleet.env), stack.bootstrap_servers, tasks))
        runner = subprocess.run(
            [sys.executable, "-m", "agentstream", "run", AGENTS[name], "--proxy", proxy_url,
             "--max-tasks", str(ROLLOUTS), "--group", fleet.group, "--concurrency", str(ROLLOUTS),
             "--session-timeout-ms", "3000"],
            env=fleet.env, capture_output=True, text=True, timeout=120, check=False)
        assert runner.returncode == 0 and f"{ROLLOUTS} succeeded" in runner.stdout, runner.stdout + runner.stderr
        ran_s = time.monotonic() - started
        ids = ", ".join(f"'{rollout_id}'" for rollout_id in by_rollout)

        def rollouts() -> list[tuple]:
            return clickhouse.query(
                f"SELECT rollout_id, agent_name, status, final_reward, llm_calls, llm_calls_without_tokens "
                f"FROM {fleet.database}.rollouts FINAL WHERE rollout_id IN ({ids})").result_rows

        wait_for(lambda: sorted(row[2] for row in rollouts()), equals=["SUCCEEDED"] * ROLLOUTS, timeout_s=30,
                 what="every rollout SUCCEEDED in ClickHouse")
        rows = rollouts()
    finally:
        proxy.stop()
    spans = clickhouse.query(
        f"SELECT rollout_id, kind, status, agent_name, model, prompt_token_ids, response_token_ids, "
        f"length(response_logprobs), reward, attributes FROM {fleet.database}.spans FINAL "
        f"WHERE rollout_id IN ({ids}) ORDER BY start_time").result_rows
    for rollout_id, agent, status, final_reward, llm_calls, without_tokens in rows:
        task = by_rollout[rollout_id]
        own = [row for row in spans if row[0] == rollout_id]
        llm = [row for row in own if row[1] == "LLM"]
        rewards = [row for row in own if row[1] == "REWARD"]
        assert llm and len(rewards) == 1, own
        for _, _, span_status, span_agent, model, prompt_ids, response_ids, logprobs, _, attributes in llm:
            assert span_status == "OK" and span_agent == agent_name and model == "tiny"
            assert prompt_ids and response_ids and logprobs == len(response_ids)
            assert task["prompt"] in tokenizer.decode(prompt_ids), "the prompt ids are the agent's rendered prompt"
            assert json.loads(attributes["gen_ai.input.messages"])[-1]["content"] == task["prompt"]
            output = json.loads(attributes["gen_ai.output.messages"])[0]
            if not output["tool_calls"]:
                decoded = tokenizer.decode(response_ids, skip_special_tokens=True)
                assert decoded.strip() == (output["content"] or "").strip()
            if name == "calculator":
                assert "calculator" in attributes["gen_ai.tool.definitions"]
        answer = json.loads(llm[-1][9]["gen_ai.output.messages"])[0]["content"] or ""
        assert rewards[0][3] == agent_name
        assert rewards[0][8] == arithmetic.reward(answer, task["answer"]), "the reward scores the captured answer"
        assert (agent, status, final_reward) == (agent_name, "SUCCEEDED", rewards[0][8])
        assert (llm_calls, without_tokens) == (len(llm), 0)

    def transitions() -> dict[str, list[float]]:
        return dict(clickhouse.query(
            f"SELECT rollout_id, groupArray(reward) FROM {fleet.database}.transitions FINAL "
            f"WHERE rollout_id IN ({ids}) GROUP BY rollout_id").result_rows)

    expected = {rollout_id: [final_reward] * llm_calls for rollout_id, _, _, final_reward, llm_calls, _ in rows}
    wait_for(transitions, equals=expected, timeout_s=20, what="one transition per LLM call with the final reward")
    print(f"\n{name}: {ROLLOUTS} rollouts ran in {ran_s:.1f}s, checked in {time.monotonic() - started:.1f}s")
