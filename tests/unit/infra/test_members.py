"""The member ledger that lets a restarted consumer remove its dead predecessors from the group (infra/members.py)."""

from __future__ import annotations

import inspect
import multiprocessing
import os
from pathlib import Path

from aiokafka.consumer.group_coordinator import GroupCoordinator

from agentstream.infra.members import MemberLedger


def test_aiokafka_still_keeps_the_member_id_where_member_id_reads_it():
    assert "self.member_id" in inspect.getsource(GroupCoordinator), \
        "aiokafka's GroupCoordinator no longer has member_id: adapt infra.members.member_id"


def _record_many(home: str, group: str, count: int) -> None:
    ledger = MemberLedger(Path(home), group)
    for index in range(count):  # each process keeps one entry: its latest id
        ledger.record(f"{os.getpid()}-{index}")
        ledger.mark_rejoining()


def test_members_recording_at_once_from_many_processes_all_stay_recorded(tmp_path):
    # After a rebalance every member of a group records its new id at the same moment; a
    # process's write used to replace another's, and the member lost is never evicted.
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_record_many, args=(str(tmp_path), "runners", 60)) for _ in range(4)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
        assert process.exitcode == 0
    recorded = MemberLedger(tmp_path, "runners")._read()
    assert sorted(owner["pid"] for owner in recorded.values()) == sorted(process.pid for process in processes)
    assert all(member.endswith("-59") and owner["rejoining"] for member, owner in recorded.items())
