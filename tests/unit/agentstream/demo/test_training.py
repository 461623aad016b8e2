"""The demo's configuration per agent (the credit level each trains at, its samples per step) and RL's clock."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from click.testing import CliRunner

from agentstream.cli import main
from agentstream.demo import DemoConfig
from agentstream.demo.agents import AGENTS, on_framework
from agentstream.demo.clock import TrainingClock
from agentstream.demo.training import demo_config
from agentstream.examples import calculator_agent, calculator_langgraph
from agentstream.infra.config import ConfigError, load_config
from agentstream.trainer.batching import Batcher, Sample, SeenIds


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


def test_a_demo_step_holds_its_whole_wave_though_its_groups_reach_the_trainer_over_90_s(tmp_path):
    """At a 15 s wait each GRPO group of a slow wave made a step of its own, and a version, which let the next
    wave out before the trainer had used this one (docs/multistep.md, why samples went stale)."""
    config = demo_config(load_config(), "r", tmp_path, AGENTS["word-problems"])
    trainer, demo = config.trainer, config.demo
    batcher = Batcher.for_trainer(trainer, SeenIds(1000))
    for group in range(demo.prompts_per_wave):
        arrives = 30.0 * group
        assert not batcher.ready(arrives)  # the groups before it wait for it
        for member in range(demo.group_size):
            reward = float(member % 2)
            batcher.offer(Sample(f"g{group}-{member}", f"g{group}-{member}", 3, [1, 2], [3], [-0.5], reward,
                                 reward - 0.5), current_version=3, now=arrives)
    batch = batcher.take(current_version=3)
    assert batch is not None and len(batch.samples) == demo.group_size * demo.prompts_per_wave


def test_the_supervised_control_keeps_the_runs_credit_and_budget_and_changes_only_the_objective(tmp_path):
    config = load_config()
    agent = AGENTS["word-problems"]
    rl = demo_config(config, "r", tmp_path, agent)
    control = demo_config(replace(config, demo=replace(config.demo, objective="supervised")), "r", tmp_path, agent)
    assert (rl.trainer.objective, control.trainer.objective) == ("policy_gradient", "supervised")
    assert control.trainer.supervised_min_reward == 1.0  # the rollouts that succeeded
    assert control.credit == rl.credit and control.demo.training_seconds == rl.demo.training_seconds
    assert replace(control.trainer, objective="policy_gradient") == rl.trainer
    with pytest.raises(ConfigError, match="objective"):
        replace(config.demo, objective="sft")


def test_the_calculator_agent_on_a_framework_runs_that_framework_on_the_same_tasks_and_recipe(tmp_path):
    plain = AGENTS["calculator"]
    assert on_framework(plain, "openai") is plain and plain.solve is calculator_agent.solve
    graph = on_framework(plain, "langgraph")
    assert graph.entry == "agentstream.examples.calculator_langgraph:solve"
    assert graph.solve is calculator_langgraph.solve
    assert (graph.name, graph.module, graph.temperature, graph.level) == (plain.name, plain.module, 0.5, "trajectory")
    config = load_config()
    assert demo_config(config, "r", tmp_path, graph).credit == demo_config(config, "r", tmp_path, plain).credit
    with pytest.raises(ValueError, match="only the calculator agent"):
        on_framework(AGENTS["arithmetic"], "langgraph")
    with pytest.raises(ValueError, match="unknown framework 'crewai'"):
        on_framework(plain, "crewai")


def test_rls_clock_stands_still_while_an_evaluation_holds_it_and_goes_on_from_there():
    clock = TrainingClock()
    time.sleep(0.05)
    clock.hold()
    held_at = clock.elapsed()
    time.sleep(0.2)
    assert clock.elapsed() == pytest.approx(held_at, abs=0.01)  # an evaluation's seconds are not RL's
    clock.release()
    time.sleep(0.05)
    assert 0.09 <= clock.elapsed() < 0.2 and clock.paused >= 0.2
    clock.release()  # a second release changes nothing
    assert clock.paused < 0.25


def test_rls_budget_is_seconds_on_its_clock_or_else_steps_past_where_rl_started():
    timed = DemoConfig(seconds=600.0)
    assert (timed.budget, timed.spent(599.9, 1000), timed.spent(600.0, 0)) == ("600 s", False, True)
    assert DemoConfig(seconds=600.0, quick=True).spent(240.0, 0)  # quick_seconds
    stepped = DemoConfig(seconds=600.0, steps=24)
    assert (stepped.budget, stepped.spent(10_000.0, 23), stepped.spent(0.0, 24)) == ("24 optimizer steps", False, True)
    with pytest.raises(ConfigError, match="steps"):
        DemoConfig(steps=-1)


def test_a_budget_in_steps_ends_when_no_new_version_comes_for_the_stall_limit_of_rls_clock():
    watch = DemoConfig(steps=5, stall_limit_s=900.0).stall_watch()
    assert not watch.check(4, 0.0) and not watch.check(4, 899.0)
    assert not watch.check(5, 900.0) and not watch.check(5, 1799.0)  # a new version starts the wait again
    assert watch.check(5, 1800.0) and watch.stalled and "for 900 s of RL (v5 since 900 s)" in watch.describe()
    assert watch.check(6, 1801.0)  # once ended, RL stays ended
    timed = DemoConfig(seconds=600.0, stall_limit_s=900.0).stall_watch()
    assert not timed.check(0, 10_000.0) and not timed.stalled  # a budget in seconds ends on its own
    with pytest.raises(ConfigError, match="stall_limit_s"):
        DemoConfig(stall_limit_s=0.0)


def test_the_demo_takes_a_budget_in_steps_or_in_seconds_not_both():
    for args, problem in [(["--steps", "0"], "0 is not in the range x>=1"),
                          (["--steps", "24", "--seconds", "600"], "--steps is the training demo's budget"),
                          (["--steps", "24", "--online"], "--steps is the training demo's budget")]:
        result = CliRunner().invoke(main, ["demo", *args])
        assert result.exit_code == 2 and problem in result.output, (args, result.output)


def test_a_warm_start_that_will_be_saved_is_written_with_its_optimizer_state(tmp_path):
    """Without AdamW's moments a run from the saved warm start took a first step of lr on every weight."""
    config = load_config()
    saving = demo_config(config, "r", tmp_path, AGENTS["word-problems"])
    resumed = demo_config(replace(config, demo=replace(config.demo, warm_start_from=str(tmp_path))), "r", tmp_path,
                          AGENTS["word-problems"])
    plain = demo_config(config, "r", tmp_path, AGENTS["arithmetic"])  # no warm start: nothing to resume
    assert (saving.trainer.optimizer_state_every, resumed.trainer.optimizer_state_every,
            plain.trainer.optimizer_state_every) == (1, 0, 0)
