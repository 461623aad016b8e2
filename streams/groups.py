"""The group processor: gathers GRPO groups from the groups topic and credits each group at once.

Completed rollouts that belong to a group arrive keyed by group id, so one worker sees a whole
group; each carries its transitions as drafts, which get their advantage here. A group is
credited when ``group_size`` members arrived or ``group_timeout_s`` after its first one
(stragglers are left out). A group whose rewards are all equal carries no learning
signal: it is counted and skipped, or published with advantage 0 where its rule says
``keep_flat_groups`` (a trainer that steps per amount of experience counts it). The first
record of every pending group is held, so a crash replays the group.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agentstream.infra.config import Config, CreditRule
from agentstream.schemas import ROLLOUT_RESULT, AvroCodec, CodecError
from agentstream.schemas.transition_writer import Draft
from agentstream.streams.credit import GroupNormalized, NonFiniteCredit, matching_rule
from agentstream.streams.records import RawRecord
from agentstream.streams.sink import Completion, CompletionSink
from agentstream.streams.stage import Emitter, Holder, Stage, Transitions, now_us

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


class GroupProcessor(Stage[list[tuple[RawRecord, dict]]]):
    """groups topic → transitions topic and table (advantages normalised within each group).

    State: ``pending``, the groups not credited yet, each holding its first record.
    """

    def __init__(self, config: Config, emitter: Emitter, holder: Holder, sink: CompletionSink,
                 codec: AvroCodec | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, emitter, holder, sink, codec, clock)
        self.pending: dict[str, PendingGroup] = {}
        self.groups_credited = 0
        self.groups_uninformative = 0
        self.strategy = GroupNormalized()

    def read(self, records: list[RawRecord]) -> list[tuple[RawRecord, dict]]:
        """Decode a batch of group results, read as the current RolloutResult (older versions gain its defaults)."""
        results = []
        for record in records:
            try:
                results.append((record, self.codec.decode(record.value, ROLLOUT_RESULT)[1]))
            except CodecError as error:  # written by our own processor: a bad one is a bug worth a loud log
                log.error("undecodable group record at %s[%d]@%d: %s", record.topic, record.partition, record.offset,
                          error)
        return results

    def apply(self, results: list[tuple[RawRecord, dict]]) -> None:
        """Add each result to its pending group, holding the first record of a new group."""
        now = self.clock()
        for record, result in results:
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
        created = now_us()
        transitions = Transitions()
        for group in due:
            members = self._finite_members(group)
            rewards = [member["final_reward"] or 0.0 for member in members]
            try:
                advantages = self.strategy.advantages(rewards)
            except NonFiniteCredit as error:  # finite rewards whose mean or spread overflows
                self.counters.credits_refused += len(members)
                log.warning("group %s not credited: %s", group.group_id, error)
                continue
            if not self.strategy.informative(rewards):
                self.groups_uninformative += 1
                if not group.rule.keep_flat_groups:
                    continue
            else:
                self.groups_credited += 1
            for member, reward, advantage in zip(members, rewards, advantages, strict=True):
                for item in member["drafts"]:
                    pending = Draft(item["model"], member["rollout_id"], item["head"])
                    transitions.drafts.append(pending)
                    transitions.datums.append(pending.complete(reward, reward, advantage, group.group_id, created))
        await self.publish_transitions(transitions)
        await self.sink.put(Completion(transitions=transitions.datums, release=[group.held for group in due]))

    def _finite_members(self, group: PendingGroup) -> list[dict]:
        """The group's members whose final reward is finite; the others are left out of it, counted and logged."""
        members = []
        for member in group.members.values():
            if math.isfinite(member["final_reward"] or 0.0):
                members.append(member)
            else:
                self.counters.credits_refused += 1
                log.warning("rollout %s left out of group %s: final reward %r is not finite", member["rollout_id"],
                            group.group_id, member["final_reward"])
        return members
