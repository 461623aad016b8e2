"""The member ledger that lets a restarted consumer remove its dead predecessors from the group (infra/members.py)."""

from __future__ import annotations

import inspect
import os
import subprocess

from aiokafka.consumer.group_coordinator import GroupCoordinator

from infra.members import MemberLedger


def test_a_member_whose_process_is_gone_is_dead_and_a_live_one_is_not(tmp_path):
    ledger = MemberLedger(tmp_path, "agentstream-streams")
    gone = subprocess.Popen(["true"])
    gone.wait()
    ledger.record("mine-1")
    ledger.record("mine-2")  # a rejoin: this process's earlier id is dropped
    members = ledger._read()
    members["theirs"] = {"pid": gone.pid, "ticks": 1}
    ledger._write(members)
    assert ledger.dead() == ["theirs"]
    assert set(ledger._read()) == {"mine-2", "theirs"}
    assert ledger._read()["mine-2"]["pid"] == os.getpid()
    ledger.forget(["theirs"])
    assert ledger.dead() == [] and set(ledger._read()) == {"mine-2"}


def test_aiokafka_still_keeps_the_member_id_where_member_id_reads_it():
    assert "self.member_id" in inspect.getsource(GroupCoordinator), \
        "aiokafka's GroupCoordinator no longer has member_id: adapt infra.members.member_id"
