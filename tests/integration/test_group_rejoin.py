"""A restarted consumer and the members its predecessors left in the group (infra/members.py).

The runner stands in for every consumer that keeps a member ledger (the stream worker and the
trainer mark it the same way, from their own rebalance listeners). The leader a forming round
keeps is tansu's group coordinator's; on Apache Kafka the same test found the ledger losing a
member when every member recorded its id at once (the ledger is locked now).
"""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from collections.abc import Callable

from agentstream.infra.config import load_config
from agentstream.infra.kafka import client_options
from agentstream.infra.members import MemberLedger, evict_dead_members
from tests.support.streams_harness import CliProcess, create_topics, wait_for, worker_env

ATTEMPTS = 5


def _env(tmp_path, stack) -> dict:
    return worker_env(tmp_path, stack, f"g{uuid.uuid4().hex[:6]}.", "unused")


def _runner(env: dict, group: str, log) -> CliProcess:
    return CliProcess(["run", "tests.support.agents:slow_agent", "--group", group, "--session-timeout-ms", "4000"],
                      env, log).start()


def _state(ledger: MemberLedger, process: CliProcess) -> bool | None:
    """Whether ``process`` is rejoining (True), settled with partitions (False), or not in the ledger (None)."""
    for owner in ledger._read().values():
        if owner.get("pid") == process.process.pid:
            return bool(owner.get("rejoining"))
    return None


def _catch_rejoining(ledger: MemberLedger, first: CliProcess, join: Callable[[int], CliProcess]) -> CliProcess:
    """Join a second runner until ``first`` is seen between revoke and assignment; return that second runner.

    The window is a JoinGroup and a SyncGroup (tens of milliseconds on Apache Kafka), so a loaded machine's
    poll can miss it; each further attempt stops the second runner (its LeaveGroup rebalances the group
    too) and starts another, so a miss costs a rebalance, not the test."""
    for attempt in range(ATTEMPTS):
        second = join(attempt)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if _state(ledger, first) is True:
                return second
            if _state(ledger, second) is False and _state(ledger, first) is False:
                break  # this round formed without our seeing the first runner rejoin
            time.sleep(0.005)
        second.stop()
    raise AssertionError(f"the first runner was not seen rejoining in {ATTEMPTS} rebalances")


def test_dead_members_are_sent_a_leave_group_unless_they_died_rejoining(tmp_path, stack):
    config = load_config(environ=_env(tmp_path, stack))
    ledger = MemberLedger(tmp_path, f"group-{uuid.uuid4().hex[:8]}")
    gone = subprocess.Popen(["true"])
    gone.wait()
    ledger.record("mine")
    ledger.mark_rejoining()
    assert ledger.rejoining(["mine"]) == ["mine"]
    ledger.record("mine")  # assigned again
    members = ledger._read()
    members["settled"] = {"pid": gone.pid, "ticks": 1, "rejoining": False}
    members["rejoining"] = {"pid": gone.pid, "ticks": 1, "rejoining": True}
    members["recorded-before-rejoining-was"] = {"pid": gone.pid, "ticks": 1}
    ledger._write(members)

    evicted = asyncio.run(evict_dead_members(client_options(config.kafka, config.kafka.bootstrap_servers), ledger))
    assert sorted(evicted) == ["recorded-before-rejoining-was", "settled"]
    assert set(ledger._read()) == {"mine"}  # the one left to its session is forgotten too


def test_a_runner_killed_while_its_group_rebalances_is_left_to_its_session_and_the_group_forms(tmp_path, stack):
    # The first runner leads the group; a second one's join starts a rebalance that the first leads
    # too. Killed then, the first is the leader of a round that never completes; a LeaveGroup for it
    # (what a restarted runner sends for a dead member) left tansu's group without a leader that
    # syncs, and every member's SyncGroup was refused for over a minute.
    group = f"runners-{uuid.uuid4().hex[:8]}"
    env = _env(tmp_path, stack)
    create_topics(env)
    ledger = MemberLedger(load_config(environ=env).stack.home, group)
    first = _runner(env, group, tmp_path / "first.log")
    second = restarted = None
    try:
        wait_for(lambda: _state(ledger, first) is False, 60, what="the first runner's partitions")
        second = _catch_rejoining(ledger, first,
                                  lambda attempt: _runner(env, group, tmp_path / f"second-{attempt}.log"))
        first.kill()
        restarted = _runner(env, group, tmp_path / "restarted.log")
        started = time.monotonic()
        wait_for(lambda: _state(ledger, second) is False and _state(ledger, restarted) is False, 40, interval_s=0.05,
                 what="the second and the restarted runner's partitions")
        seconds = time.monotonic() - started
        print(f'{{"metric": "group_formed_after_leader_killed_rejoining_s", "value": {seconds:.2f}}}')
        assert seconds < 15, seconds  # its session (4 s) and a join; over a minute when the dead leader was evicted
    finally:
        for process in (first, second, restarted):
            if process is not None:
                process.stop()


def test_a_runner_whose_agent_cannot_be_imported_says_so_and_leaves(tmp_path, stack):
    env = _env(tmp_path, stack)
    create_topics(env)
    runner = CliProcess(["run", "no_such_module:agent"], env, tmp_path / "runner.log").start()
    try:
        assert runner.exit_code(30) == 1, runner.log()
    finally:
        runner.stop()
    assert "cannot import 'no_such_module'" in runner.log()
    assert "Traceback" not in runner.log()
