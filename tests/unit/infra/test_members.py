"""The member ledger that lets a restarted consumer remove its dead predecessors from the group (infra/members.py)."""

from __future__ import annotations

import inspect

from aiokafka.consumer.group_coordinator import GroupCoordinator


def test_aiokafka_still_keeps_the_member_id_where_member_id_reads_it():
    assert "self.member_id" in inspect.getsource(GroupCoordinator), \
        "aiokafka's GroupCoordinator no longer has member_id: adapt infra.members.member_id"
