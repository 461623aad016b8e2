"""A saved warm start: kept complete, refused where it was made for another setting, installed as a run's start."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from agentstream.cli import main
from agentstream.demo.agents import AGENTS
from agentstream.demo.results import Evaluation
from agentstream.demo.training import warm_start_settings
from agentstream.demo.warm_start import (
    RECORD,
    WarmStartMismatch,
    WarmStartNotSaved,
    WarmStartPlan,
    WarmStartProgress,
    install_warm_start,
    load_warm_start,
)
from agentstream.infra.config import load_config
from agentstream.trainer.checkpoint_writer import CheckpointError, FolderStore, latest_manifest, write_checkpoint
from tests.support.small_disk import SmallDisk

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _run_store(root, versions=(7, 8)) -> FolderStore:
    """A finished run's checkpoints, as its trainer leaves them: positions, trained ids, an optimizer state."""
    store = FolderStore(root)
    for version in versions:
        staging = store.staging()
        (staging / "model.safetensors").write_bytes(b"weights of v%d" % version)
        (staging / "optimizer.pt").write_bytes(b"adam moments")
        write_checkpoint(store, staging, staging / "model.safetensors", model=MODEL, version=version,
                         step=version * 2, format="full", offsets={"demo-1.transitions:0": 640},
                         trained_ids=[f"t{version}"], metrics={"loss": 0.5})
    return store


def _plan(tmp_path, agent="word-problems") -> WarmStartPlan:
    settings = warm_start_settings(load_config(), AGENTS[agent])
    return WarmStartPlan(settings, {"python_loop_s": 0.5}, tmp_path / "demo-output" / "warm-start")


def test_the_warm_start_is_done_once_the_server_holds_the_step_that_trained_the_last_demonstration():
    """Seen on 2026-12-02: the 8th step's row (the last 26 of 224 demonstrations) was in ClickHouse, its checkpoint
    not yet announced, and the warm start was taken as done on v7."""
    trained_not_announced = WarmStartProgress(demonstrations=224, stored=224, samples=224, trained=224, stepped_to=8,
                                              announced=7, held=7)
    assert not trained_not_announced.done
    assert not replace(trained_not_announced, announced=8).done  # announced, the server still loading it
    assert replace(trained_not_announced, announced=8, held=8).done
    assert not replace(trained_not_announced, announced=8, held=8, trained=198).done  # a step still to come
    assert not replace(trained_not_announced, announced=8, held=8, stored=200).done  # demonstrations on the way


def test_a_saved_warm_start_is_installed_as_a_new_runs_start_without_the_old_runs_positions(tmp_path):
    plan = _plan(tmp_path)
    before, after = Evaluation(0.0, 0, 0.0, 0, 64), Evaluation(0.0, 7, 0.3125, 20, 64)
    saved = plan.save(_run_store(tmp_path / "run-1"), 7, 1074.4, before, after)
    assert (saved / MODEL.replace("/", "%2F") / "v00000007" / "optimizer.pt").read_bytes() == b"adam moments"

    record = load_warm_start(saved, plan.settings)
    assert (record.version, record.seconds, record.before, record.after) == (7, 1074.4, before, after)
    assert record.machine == {"python_loop_s": 0.5}
    run = FolderStore(tmp_path / "run-2" / "checkpoints")
    installed = install_warm_start(saved, record, run)
    resumed = latest_manifest(run, MODEL)  # what the new run's trainer resumes from
    assert resumed == installed and resumed.uri.startswith(run.root.as_uri())
    assert latest_manifest(FolderStore(saved), MODEL).uri.startswith(saved.as_uri())
    assert (resumed.version, resumed.step, resumed.offsets, resumed.trained_ids) == (7, 14, {}, [])
    assert (run.get(resumed.uri) / "model.safetensors").read_bytes() == b"weights of v7"
    assert (run.get(resumed.uri) / "optimizer.pt").read_bytes() == b"adam moments"  # RL steps on from the same moments


def test_a_saved_warm_start_installed_without_momentum_loses_the_first_moment_in_the_copy_only(tmp_path):
    import torch

    state = {"step": torch.tensor(12.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.full((3,), 4.0)}
    moments = {"state": {0: state}, "param_groups": [{"params": [0], "lr": 1e-5}]}
    store = _run_store(tmp_path / "run-1", versions=(7,))
    torch.save(moments, store.get(latest_manifest(store, MODEL).uri) / "optimizer.pt")
    plan = _plan(tmp_path)
    saved = plan.save(store, 7, 900.0, Evaluation(0.0, 0, 0.0, 0, 64), Evaluation(0.0, 7, 0.25, 16, 64))
    run = FolderStore(tmp_path / "run-2" / "checkpoints")
    installed = install_warm_start(saved, load_warm_start(saved, plan.settings), run, momentum=False)
    state = torch.load(run.get(installed.uri) / "optimizer.pt", weights_only=True)["state"][0]
    assert not state["exp_avg"].any()
    assert torch.equal(state["exp_avg_sq"], torch.full((3,), 4.0)) and state["step"] == 12  # each weight's scale
    kept = torch.load(saved / MODEL.replace("/", "%2F") / "v00000007" / "optimizer.pt", weights_only=True)["state"][0]
    assert torch.equal(kept["exp_avg"], torch.ones(3))  # the saved warm start serves the next run as it was


def test_a_warm_start_made_for_another_setting_or_not_saved_at_all_is_refused_with_what_differs(tmp_path):
    plan = _plan(tmp_path)
    saved = plan.save(_run_store(tmp_path / "run"), 8, 900.0, Evaluation(0, 0, 0, 0, 64), Evaluation(0, 8, .3, 19, 64))
    made_in = plan.settings.dtype  # the machine's: bfloat16 where it multiplies it natively, else float32
    other = replace(plan.settings, demonstrations=plan.settings.demonstrations // 2,
                    dtype="float32" if made_in == "bfloat16" else "bfloat16")
    with pytest.raises(WarmStartMismatch, match=rf"demonstrations 224 \(this run: 112\); dtype '{made_in}'"):
        load_warm_start(saved, other)
    with pytest.raises(WarmStartMismatch, match="agent 'word-problems'"):
        load_warm_start(saved, warm_start_settings(load_config(), AGENTS["calculator"]))
    with pytest.raises(WarmStartMismatch, match=f"{RECORD} is missing"):
        load_warm_start(tmp_path, plan.settings)
    (saved / RECORD).write_text(json.dumps({"settings": {"agent": "word-problems"}}))
    with pytest.raises(WarmStartMismatch, match="cannot read"):
        load_warm_start(saved, plan.settings)


def test_saving_again_replaces_the_saved_warm_start_and_a_save_that_cannot_be_made_keeps_it(tmp_path):
    plan = _plan(tmp_path)
    evaluation = Evaluation(0, 0, 0, 0, 64)
    plan.save(_run_store(tmp_path / "run-1", versions=(5,)), 5, 600.0, evaluation, evaluation)
    with pytest.raises(CheckpointError, match="no checkpoint of version 9"):
        plan.save(_run_store(tmp_path / "run-2", versions=(8,)), 9, 700.0, evaluation, evaluation)
    assert load_warm_start(plan.save_to, plan.settings).version == 5  # the earlier one, whole
    plan.save(_run_store(tmp_path / "run-3", versions=(8,)), 8, 700.0, evaluation, evaluation)
    assert load_warm_start(plan.save_to, plan.settings).version == 8


def test_a_warm_start_the_disk_has_no_room_for_is_a_named_error_and_leaves_no_half_copy(tmp_path):
    """Seen in CI on 2026-12-05: a full disk stopped the demo with a traceback and left a 942 MB half copy behind."""
    disk = SmallDisk(tmp_path / "disk", 256 * 1024)
    try:
        plan = WarmStartPlan(_plan(tmp_path).settings, {}, disk.path / "demo-output" / "warm-start")
        evaluation = Evaluation(0, 0, 0, 0, 64)
        run = _run_store(tmp_path / "run", versions=(8,))
        disk.fill(leave_bytes=0)
        with pytest.raises(WarmStartNotSaved, match=f"not saved in {plan.save_to}: No space left on device "
                                                    r"\(0.0 GB free there\)"):
            plan.save(run, 8, 700.0, evaluation, evaluation)
        assert not plan.save_to.exists()
        disk.free()
        plan.save(run, 8, 700.0, evaluation, evaluation)  # with room, the same save is made
        assert load_warm_start(plan.save_to, plan.settings).version == 8
    finally:
        disk.unmount()


def test_the_demo_starts_from_a_saved_warm_start_only_for_one_agent_that_has_one(tmp_path, monkeypatch):
    for args in (["--online"], ["--agents", "arithmetic,calculator"]):
        result = CliRunner().invoke(main, ["demo", "--warm-start-from", str(tmp_path), *args])
        assert result.exit_code == 2 and "--warm-start-from is for the training demo of one agent" in result.output
    result = CliRunner().invoke(main, ["demo", "--agent", "calculator", "--warm-start-from", str(tmp_path / "none")])
    assert result.exit_code == 2 and "does not exist" in result.output
    monkeypatch.setenv("AGENTSTREAM_HOME", str(tmp_path / "home"))  # the run's folder; no stack starts
    result = CliRunner().invoke(main, ["demo", "--warm-start-from", str(tmp_path)])
    assert result.exit_code == 1 and "the arithmetic agent has no warm start" in result.output


def test_a_run_without_the_warm_starts_momentum_needs_a_saved_warm_start_to_start_from(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSTREAM_HOME", str(tmp_path / "home"))  # the run's folder; no stack starts
    settings = tmp_path / "settings.toml"
    settings.write_text("[demo]\nwarm_start_momentum = false\n")
    for args in (["--agent", "word-problems"], ["--agents", "arithmetic,calculator"]):
        result = CliRunner().invoke(main, ["--config", str(settings), "demo", *args])
        assert result.exit_code == 1
        assert "demo.warm_start_momentum must stay true unless the run starts from a saved warm start" in result.output
    settings.write_text(f"[demo]\nwarm_start_from = {json.dumps(str(tmp_path))}\n")
    result = CliRunner().invoke(main, ["--config", str(settings), "demo", "--agents", "arithmetic,calculator"])
    assert result.exit_code == 1 and "demo.warm_start_from must be empty for several agents at once" in result.output
