"""The group processor: gathers GRPO groups from the groups topic and credits each group at once.

Completed rollouts that belong to a group arrive keyed by group id, so one worker sees a whole
group. A group is credited when ``group_size`` members arrived or ``group_timeout_s`` after its
first one (stragglers are left out). A group whose rewards are all equal carries no learning
signal: it is counted and skipped. The first record of every pending group is held, so a crash
replays the group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from infra.config import Config, CreditRule
from schemas import AvroCodec, CodecError
from streams.credit import GroupNormalized, matching_rule
from streams.processor import Emitter, Holder, Stage, publish_transitions, read_spans
from streams.records import RawRecord
from streams.trajectory import assemble
from streams.warehouse import Warehouse

log = logging.getLogger("agentstream.streams.groups")


@dataclass
class PendingGroup:
    group_id: str
    rule: CreditRule
    held: RawRecord
    first_seen_s: float
    members: dict[str, dict] = field(default_factory=dict)

    def due(self, now_s: float) -> bool:
        return len(self.members) >= self.rule.group_size or now_s >= self.first_seen_s + self.rule.group_timeout_s


class GroupProcessor(Stage):
    """groups topic → transitions (advantages normalised within each group)."""

    def __init__(self, config: Config, warehouse: Warehouse, emitter: Emitter, holder: Holder,
                 codec: AvroCodec | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, warehouse, emitter, holder, codec, clock)
        self.pending: dict[str, PendingGroup] = {}
        self.groups_credited = 0
        self.groups_uninformative = 0
        self.strategy = GroupNormalized()

    async def process(self, records: list[RawRecord]) -> None:
        now = self.clock()
        for record in records:
            try:
                _, result = self.codec.decode(record.value)
            except CodecError as error:  # written by our own processor: a bad one is a bug worth a loud log
                log.error("undecodable group record at %s[%d]@%d: %s", record.topic, record.partition, record.offset,
                          error)
                continue
            group = self.pending.get(result["group_id"])
            if group is None:
                rule = matching_rule(self.config.credit, result["agent_name"], "")
                rule = rule or next(r for r in self.config.credit if r.strategy == "grpo")
                group = self.pending[result["group_id"]] = PendingGroup(result["group_id"], rule, record, now)
                self.holder.hold(record)
            group.members[result["rollout_id"]] = result

    async def tick(self) -> None:
        now = self.clock()
        due = [g for g in self.pending.values() if g.due(now)]
        if not due:
            return
        for group in due:
            del self.pending[group.group_id]
        rollout_ids = [rid for group in due for rid in group.members]
        spans = await read_spans(self.warehouse, self.database, rollout_ids)
        credited = []
        for group in due:
            trajectories = [assemble(rid, spans.get(rid, []), member["status"], member["attempt_id"])
                            for rid, member in group.members.items()]
            rewards = [t.final_reward or 0.0 for t in trajectories]
            if not self.strategy.informative(rewards):
                self.groups_uninformative += 1
                continue
            self.groups_credited += 1
            credits = self.strategy.assign_group(trajectories)
            credited.extend((t, credits[t.rollout_id], group.rule) for t in trajectories)
        await publish_transitions(self, credited)
        for group in due:
            self.holder.release(group.held)
