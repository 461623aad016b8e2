"""Several agents at once: each agent's credit, trainer and adapter are its own; one runner serves all; the CLI."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from click.testing import CliRunner

from agentstream.cli import main
from agentstream.demo import agents as demo_agents
from agentstream.demo.agents import AGENTS, as_adapter, solve_named
from agentstream.demo.online import ALL_LINEAR
from agentstream.demo.several import adapter_version, model_of, several_config, trainer_config
from agentstream.demo.training import demo_config, waves
from agentstream.infra.config import load_config


def test_each_agent_trains_its_own_model_by_its_own_credit_rules_and_the_rest_trains_nothing(tmp_path):
    config = load_config()
    chosen = [AGENTS["arithmetic"], AGENTS["calculator"]]
    shared = several_config(config, "r", tmp_path, chosen)
    rules = {rule.agent: rule for rule in shared.credit}
    assert list(rules) == ["arithmetic", "calculator", "calculator-demonstrations", "*"]
    assert rules["arithmetic"].train_as == "smollm2-arithmetic" and rules["arithmetic"].level == "transition"
    assert rules["calculator"].train_as == rules["calculator-demonstrations"].train_as == "smollm2-calculator"
    assert rules["calculator"].level == "trajectory" and rules["calculator-demonstrations"].strategy == "final"
    assert not rules["*"].train
    alone = demo_config(config, "r", tmp_path, AGENTS["calculator"])
    assert replace(rules["calculator"], train_as=None) == alone.credit[0]  # the one-agent demo's rule otherwise
    assert shared.trainer.lora and shared.trainer.lora_target_modules == ALL_LINEAR


def test_each_agent_has_its_own_trainer_adapter_and_checkpoints_at_its_own_batch_and_temperature(tmp_path):
    config = load_config()
    chosen = [AGENTS["arithmetic"], AGENTS["calculator"]]
    shared = several_config(config, "r", tmp_path, chosen)
    arithmetic, calculator = (trainer_config(shared, "r", tmp_path, agent).trainer for agent in chosen)
    assert (arithmetic.model_name, calculator.model_name) == ("smollm2-arithmetic", "smollm2-calculator")
    assert arithmetic.checkpoint_dir != calculator.checkpoint_dir
    assert (arithmetic.temperature, calculator.temperature) == (1.0, 0.5)
    assert (arithmetic.micro_batch_tokens, calculator.micro_batch_tokens) == (0, 2048)
    assert arithmetic.lora and calculator.lora
    assert (arithmetic.lr, calculator.lr) == (5e-4, 2e-4)  # each its own, where [demo] adapter_lr is 0
    one_rate = several_config(replace(config, demo=replace(config.demo, adapter_lr=3e-4)), "r", tmp_path, chosen)
    assert {trainer_config(one_rate, "r", tmp_path, agent).trainer.lr for agent in chosen} == {3e-4}


def test_an_agent_trained_into_an_adapter_sends_its_adapter_demonstrations_else_its_own():
    calculator = AGENTS["calculator"]
    assert as_adapter(calculator).demonstrations == calculator.adapter_demonstrations != calculator.demonstrations
    assert replace(as_adapter(calculator), demonstrations=calculator.demonstrations) == calculator  # nothing else
    assert as_adapter(AGENTS["arithmetic"]) is AGENTS["arithmetic"]  # no number of its own: as many as alone


def test_each_wave_names_its_agent_and_the_model_it_trains():
    agent = AGENTS["arithmetic"]
    train, _ = agent.module.split(heldout=64)
    wave = next(waves(train, 4, 8, agent, model_of(agent)))
    assert len(wave) == 8 and {task["agent_name"] for task in wave} == {"arithmetic"}
    payloads = [json.loads(task["input"]) for task in wave]
    assert {(p["agent"], p["model"], p["temperature"]) for p in payloads} == {("arithmetic", "smollm2-arithmetic", 1.0)}
    plain = next(waves(train, 4, 8, agent))
    assert all("model" not in json.loads(task["input"]) for task in plain)


def test_one_runner_runs_the_agent_each_task_names_and_refuses_a_task_that_names_none(monkeypatch):
    seen = []

    async def fake_solve(task: dict, rollout, *, temperature: float = 1.0) -> float:
        seen.append((task["agent"], task["id"], temperature))
        return 1.0

    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

        @property
        def solve(self):
            return fake_solve

    monkeypatch.setattr(demo_agents, "AGENTS", {"arithmetic": Named("arithmetic"), "calculator": Named("calculator")})
    assert asyncio.run(solve_named({"agent": "calculator", "id": "t1"}, None, temperature=0.5)) == 1.0
    assert asyncio.run(solve_named({"agent": "arithmetic", "id": "t2"}, None)) == 1.0
    assert seen == [("calculator", "t1", 0.5), ("arithmetic", "t2", 1.0)]
    for task in ({"id": "t3"}, {"agent": "word-probs", "id": "t4"}):
        with pytest.raises(ValueError, match="the task names no demo agent"):
            asyncio.run(solve_named(task, None))
    assert len(seen) == 2


class _Models(BaseHTTPRequestHandler):
    listed: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": name, "object": "model"} for name in self.listed]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args) -> None:
        pass


def test_an_agents_served_version_is_its_own_newest_adapter_not_another_agents():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        _Models.listed = ["smollm2-arithmetic", "smollm2-calculator"]
        assert adapter_version(url, "smollm2-arithmetic") == 0  # no adapter yet: the base weights answer
        _Models.listed = ["smollm2-arithmetic", "smollm2-calculator", "smollm2-arithmetic@v3",
                          "smollm2-arithmetic@v4", "smollm2-calculator@v9"]
        assert adapter_version(url, "smollm2-arithmetic") == 4
        assert adapter_version(url, "smollm2-calculator") == 9
        assert adapter_version(url, "smollm2-word-problems") == 0
    finally:
        server.shutdown()
        server.server_close()


def test_the_demo_refuses_an_unknown_or_repeated_agent_agents_with_another_mode_and_no_seconds():
    for args, problem in [(["--agents", "arithmetic,chess"], "chess: name agents among"),
                          (["--agents", ","], "no agent: name agents among"),
                          (["--agents", "arithmetic,arithmetic"], "each agent once"),
                          (["--agents", "arithmetic,calculator", "--online"], "leave out --agent"),
                          (["--agents", "arithmetic", "--agent", "calculator"], "leave out --agent"),
                          (["--agents", "arithmetic", "--seconds", "0"], "0.0 is not in the range x>0"),
                          (["--agent", "calculator", "--seconds", "-5"], "-5.0 is not in the range x>0"),
                          (["--online", "--seconds", "0"], "0.0 is not in the range x>0")]:
        result = CliRunner().invoke(main, ["demo", *args])
        assert result.exit_code == 2 and problem in result.output, (args, result.output)


def test_several_agents_refuse_the_supervised_control_from_the_flag_or_the_file(tmp_path, monkeypatch):
    """Several agents train by RL; the control was ignored and the run called RL before this refusal."""
    monkeypatch.setenv("AGENTSTREAM_HOME", str(tmp_path / "home"))  # the run's folder; no stack starts
    settings = tmp_path / "settings.toml"
    settings.write_text('[demo]\nobjective = "supervised"\n')
    for args in (["demo", "--agents", "arithmetic,calculator", "--objective", "supervised"],
                 ["--config", str(settings), "demo", "--agents", "calculator"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1, result.output
        assert "demo.objective must be policy_gradient for several agents at once" in result.output
