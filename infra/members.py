"""Fast rejoin after a crash: a restarted consumer removes its dead predecessors from the group at once.

A group that lost a member to SIGKILL waits out that member's session before it rebalances,
so a restarted consumer sat idle (a stream worker: 19-21 s at a 10 s session). Measured on
tansu with aiokafka, seconds from a restarted member's start to its first record:

======================  =========  ========
session timeout         10 s       3 s
======================  =========  ========
plain restart           18.2       7.2
static membership       8.0        6.0      (group.instance.id: tansu is slower with it)
evict the dead member   5.0        2.0      (LeaveGroup on its behalf: a fresh join)
======================  =========  ========

A fresh join itself takes about max(1 s, session/2) on tansu (it holds each JoinGroup that
long), so the sessions are short too (``session_timeout_s``). Each consumer writes its member
id to a ledger under the stack home (``members/<group>.json``: member id -> pid, process
start time, and whether it is rejoining) once it has joined; at start it sends a LeaveGroup for
every member there whose process is gone, then joins. Only the members of this machine's stack
home are known, so a member that died elsewhere still costs its session, as before.

A member that died while rejoining is left to its session instead: it may have been the leader
of the round that was forming, and tansu 0.6 keeps a forming round's leader when that leader
leaves (only a missed session clears it), so the others' SyncGroups were refused until some other
write to the group happened to reload it: 76 s in one `make chaos` run. Each consumer marks its
entry rejoining when its partitions are revoked and settled again when they are assigned; a
member killed between a rebalance's start and its first heartbeat after it (under 0.5 s) is
still evicted.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import KafkaError
from aiokafka.protocol.group import LeaveGroupRequest

from agentstream.infra.processes import process_start_ticks

log = logging.getLogger("agentstream.members")

GROUP_COORDINATOR = 0  # FindCoordinator key type of a consumer group
COORDINATOR_WAIT_S = 3.0  # a broker just started (or a group's first lookup on Kafka) has none for a moment


class MemberLedger:
    """The member ids this stack home's consumers of one group had, with the process each belonged to."""

    def __init__(self, home: Path, group: str) -> None:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in group)
        self.path = home / "members" / f"{safe}.json"
        self.group = group

    def _read(self) -> dict[str, dict[str, int]]:
        try:
            found = json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    @contextmanager
    def _changing(self) -> Iterator[dict[str, dict[str, int]]]:
        """The recorded members, to change in place and write back, with the ledger locked meanwhile.

        Every member of a group writes here at once after a rebalance: without the lock, one
        process's write replaced another's, and a member missing here is never evicted.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(f"{self.path.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            members = self._read()
            yield members
            self._write(members)

    def _write(self, members: dict[str, dict[str, int]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(members))
        temporary.replace(self.path)

    def dead(self) -> list[str]:
        """Recorded member ids whose process no longer runs."""
        return [member for member, owner in self._read().items()
                if process_start_ticks(int(owner.get("pid", 0))) != owner.get("ticks")]

    def rejoining(self, members: list[str]) -> list[str]:
        """Those of ``members`` whose process was rejoining the group when it last wrote here."""
        recorded = self._read()
        return [member for member in members if recorded.get(member, {}).get("rejoining")]

    def record(self, member_id: str) -> None:
        """This process is ``member_id`` now, with its partitions assigned (a rejoin may give a new id)."""
        pid = os.getpid()
        with self._changing() as members:
            for member in [member for member, owner in members.items() if owner.get("pid") == pid]:
                del members[member]
            members[member_id] = {"pid": pid, "ticks": process_start_ticks(pid) or 0, "rejoining": False}

    def mark_rejoining(self) -> None:
        """This process's partitions were revoked: it is rejoining until the next ``record``."""
        pid = os.getpid()
        with self._changing() as members:
            for owner in members.values():
                if owner.get("pid") == pid:
                    owner["rejoining"] = True

    def forget(self, members: list[str]) -> None:
        with self._changing() as recorded:
            for member in members:
                recorded.pop(member, None)


async def evict_dead_members(options: dict[str, Any], ledger: MemberLedger) -> list[str]:
    """Send a LeaveGroup for each dead member in ``ledger``, so the group rebalances without waiting for them.

    Best effort: a broker that is down or a member the group no longer knows is fine (the
    session ends it anyway). Returns the ids sent.
    """
    gone = ledger.dead()
    rejoining = ledger.rejoining(gone)
    if rejoining:  # perhaps a forming round's leader: their sessions end them (see the module's docstring)
        log.info("group %s: %d member(s) of processes that are gone died rejoining; their sessions end them (%s)",
                 ledger.group, len(rejoining), ", ".join(rejoining))
        ledger.forget(rejoining)
    dead = [member for member in gone if member not in rejoining]
    if not dead:
        return []
    client = AIOKafkaClient(**options)
    try:
        await client.bootstrap()
        coordinator = await _coordinator(client, ledger.group)
        for member in dead:
            await client.send(coordinator, LeaveGroupRequest(ledger.group, member))
        log.info("group %s: removed %d member(s) of processes that are gone (%s)", ledger.group, len(dead),
                 ", ".join(dead))
    except KafkaError as error:
        log.info("group %s: could not remove the members of processes that are gone (%s)", ledger.group, error)
        return []
    finally:
        await client.close()
    ledger.forget(dead)
    return dead


async def _coordinator(client: AIOKafkaClient, group: str) -> int:
    """The node that coordinates ``group``, asked again for up to COORDINATOR_WAIT_S while none is available."""
    deadline = time.monotonic() + COORDINATOR_WAIT_S
    while True:
        try:
            return await client.coordinator_lookup(GROUP_COORDINATOR, group)
        except KafkaError as error:
            if not error.retriable or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)


def member_id(consumer: AIOKafkaConsumer) -> str | None:
    """The id the group gave ``consumer`` at its latest join (aiokafka 0.14 keeps it in ``_coordinator.member_id``)."""
    coordinator = getattr(consumer, "_coordinator", None)
    found = getattr(coordinator, "member_id", None)
    return found if isinstance(found, str) and found else None
