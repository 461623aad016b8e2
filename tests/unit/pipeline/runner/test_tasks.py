"""Task files (JSONL, JSON, CSV) and task waves paced by the policy version the model server holds (no broker)."""

from __future__ import annotations

import pytest

from agentstream.infra.config import load_config
from agentstream.pipeline.runner.tasks import PacedQueue, TaskFileError, read_task_file


def queue(max_lag: int) -> PacedQueue:
    return PacedQueue(load_config(environ={}), "127.0.0.1:9", iter(()), max_lag=max_lag, stall_s=30.0)


def test_generation_runs_at_most_max_lag_versions_ahead():
    assert queue(0).waves_due(0, 0, 0.0) == 1  # lag 0: one wave, then wait for the version it trains
    assert queue(3).waves_due(0, 0, 0.0) == 4
    paced = queue(3)
    assert [paced.waves_due(version, 0, 0.0) for version in (0, 1, 2)] == [4, 5, 6]


def test_versions_count_from_where_the_queue_starts_not_from_zero():
    paced = queue(2)  # RL after a warm start that ended at version 10
    assert paced.waves_due(10, 0, 0.0) == 3  # as from version 0: not 13 waves at once
    assert paced.waves_due(11, 0, 1.0) == 4


def test_a_wave_that_made_no_version_lets_one_more_out_after_the_stall_time():
    paced = queue(1)
    paced.enqueued_tasks = 64
    assert paced.waves_due(4, 0, 0.0) == 2
    assert paced.waves_due(5, 64, 10.0) == 3  # a version in 10 s: from now on the valve waits stall_s (30 s)
    assert paced.waves_due(5, 63, 50.0) == 3  # a task still running: the trainer may yet step
    assert paced.waves_due(5, 64, 60.0) == 3  # every task finished from 60 s on: the stall clock starts there
    assert paced.waves_due(5, 64, 89.0) == 3
    assert paced.waves_due(5, 64, 90.0) == 4  # stalled: one more wave, and the valve waits again
    assert paced.waves_due(5, 64, 100.0) == 4
    assert paced.waves_due(6, 64, 101.0) == 5  # the extra wave stays counted: it made no version


def test_before_the_first_version_the_valve_waits_twice_the_stall_time():
    paced = queue(1)
    paced.enqueued_tasks = 64
    assert paced.waves_due(4, 0, 0.0) == 2
    assert paced.waves_due(4, 64, 20.0) == 2  # the wave is generated: the trainer's first step begins
    assert paced.waves_due(4, 64, 79.0) == 2  # a resumed trainer's first step can outlast the batch wait
    assert paced.waves_due(4, 64, 80.0) == 3


def test_the_valve_waits_the_trainers_batch_wait_by_default():
    config = load_config(environ={})
    paced = PacedQueue(config, "127.0.0.1:9", iter(()), max_lag=1)
    assert paced.stall_after() == 2 * config.trainer.batch_wait_s
    paced.waves_due(0, 0, 0.0)
    paced.waves_due(1, 0, 1.0)
    assert paced.stall_after() == config.trainer.batch_wait_s


def test_a_slow_trainer_step_is_not_taken_for_a_stall():
    paced = queue(1)
    paced.enqueued_tasks = 64
    assert paced.waves_due(4, 64, 0.0) == 2
    assert paced.waves_due(5, 64, 100.0) == 3  # a step took 100 s
    assert paced.stall_after() == 200.0
    assert paced.waves_due(5, 64, 250.0) == 3  # every task finished, the next step 150 s in: still stepping
    assert paced.waves_due(5, 64, 301.0) == 4  # past twice the longest step: stalled, one more wave
    assert paced.waves_due(6, 64, 310.0) == 5 and paced.stall_after() == 2 * 210.0


def test_a_wave_of_flat_groups_lets_one_more_out_once_settled():
    paced = queue(2)
    paced._unsettled = [{"a", "b"}, {"c", "d"}, {"e", "f"}]  # what top_up records for three waves of two groups
    assert paced.waves_due(3, 0, 0.0) == 3
    assert paced.settle({"a": True, "b": False, "c": True}) == 0  # wave 1 had signal; wave 2 is not finished
    assert paced.unsettled_groups() == {"c", "d", "e", "f"}
    assert paced.settle({"c": True, "d": True, "e": True, "f": True}) == 2  # both flat: two more waves
    assert paced.waves_due(3, 0, 1.0) == 5
    assert paced.unsettled_groups() == set() and paced.settle({"a": True}) == 0


def test_task_files_in_jsonl_json_and_csv(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"id": 1}\n\n{"id": 2}\n')
    (tmp_path / "t.json").write_text('[{"id": 1}, {"id": 2}]')
    (tmp_path / "d.json").write_text('{"data": [{"id": 1}, {"id": 2}]}')
    (tmp_path / "t.csv").write_text("id,question\n1,\"a, b\"\n2,c\n")
    assert read_task_file(tmp_path / "t.jsonl") == [{"id": 1}, {"id": 2}]
    assert read_task_file(tmp_path / "t.json") == [{"id": 1}, {"id": 2}]
    assert read_task_file(tmp_path / "d.json") == [{"id": 1}, {"id": 2}]
    assert read_task_file(tmp_path / "t.csv") == [{"id": "1", "question": "a, b"}, {"id": "2", "question": "c"}]
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(TaskFileError, match="item 0"):
        read_task_file(tmp_path / "bad.json")
