"""The demo's configuration per agent: the credit level each trains at and its samples per step."""

from __future__ import annotations

from dataclasses import replace

from agentstream.demo.training import AGENTS, demo_config
from agentstream.infra.config import load_config


def test_the_demo_trains_each_agent_at_its_level_and_steps_on_its_samples_per_step(tmp_path):
    config = load_config()
    wave = config.demo.group_size * config.demo.prompts_per_wave
    calculator = demo_config(config, "r", tmp_path, AGENTS["calculator"])
    rules = {rule.agent: rule for rule in calculator.credit}
    assert rules["calculator"].level == rules["calculator-demonstrations"].level == "trajectory"
    assert rules["calculator-demonstrations"].strategy == "final" and not rules["*"].train
    assert calculator.trainer.batch_transitions == wave and calculator.trainer.micro_batch_tokens == 2048
    halved = demo_config(config, "r", tmp_path, replace(AGENTS["calculator"], samples_per_step=wave // 2))
    assert halved.trainer.batch_transitions == wave // 2
    arithmetic = demo_config(config, "r", tmp_path, AGENTS["arithmetic"])
    assert {rule.agent for rule in arithmetic.credit} == {"arithmetic", "*"}
    assert arithmetic.credit[0].level == "transition"
