"""When the gate keeps refusing the trainer's checkpoints, the trainer goes back to the version serving users.

The gate stops a worse checkpoint from reaching users, but it cannot stop the trainer that
made it: a trainer that has drifted (its entropy collapsed, a run of bad updates) keeps
stepping from its own weights, and every later candidate is refused too. ``RejectionStreak``
follows the deployment decisions about the trainer's model and, after ``limit`` candidates in
a row were rejected by evaluation or rolled back from their canary, names the stable version
for the trainer to load (weights and optimizer state) and train on from. A candidate that
reaches the canary or is promoted ends the streak; superseded versions do not count.

Only decisions made while the trainer runs count: the history read at start-up was made
before the checkpoint it resumed from, which already carries any earlier rebase.

The trainer does not import ``deploy`` (the two talk through Kafka): whoever starts it hands it
``RejectionStreak`` as its ``rebase`` factory (``agentstream.trainer.worker.Rebase``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from agentstream.deploy.deployments import Action, Decision, DeploymentFollower, Routing
from agentstream.infra.config import Config

REFUSED = (Action.REJECTED, Action.ROLLED_BACK)
ACCEPTED = (Action.CANARY, Action.PROMOTED)


@dataclass
class RejectionStreak:
    """Counts the refused candidates of one model in a row; ``due`` names the routing to rebase on."""

    model: str
    limit: int
    refused: list[int] = field(default_factory=list)
    routing: Routing | None = None
    live: bool = False  # set once the decisions written before the trainer started have been read

    def seen(self, decision: Decision) -> None:
        if decision.model != self.model:
            return
        self.routing = decision.routing
        if not self.live:
            return
        if decision.action in REFUSED:
            self.refused.append(decision.version)
        elif decision.action in ACCEPTED:
            self.refused.clear()

    def due(self, version: int | None = None, max_lag: int | None = None) -> Routing | None:
        """The routing whose stable version the trainer should go back to, once ``limit`` were refused in a row.

        Sooner where the trainer is stranded: a candidate was refused, none is pending (no
        candidate, no canary) and the trainer at ``version`` is more than ``max_lag`` ahead of the
        stable version, so every transition served is too stale to train and no new candidate
        could ever come. The base model (version 0) is no checkpoint to load, so a streak while it
        serves waits until a trained version does.
        """
        routing = self.routing
        if self.limit <= 0 or not self.refused or routing is None:
            return None
        if routing.stable_version == 0 or not routing.stable_uri:
            return None
        stranded = (version is not None and max_lag is not None and version - routing.stable_version > max_lag
                    and routing.candidate_version is None and routing.canary_version is None)
        return routing if len(self.refused) >= self.limit or stranded else None

    def clear(self) -> list[int]:
        """Start a new streak (after a rebase); returns the refused versions that caused it."""
        refused, self.refused = self.refused, []
        return refused

    async def follow(self, config: Config, bootstrap_servers: str, stop: asyncio.Event) -> None:
        """Feed the gate's decisions to the streak until ``stop``; those made before this run only set the routing."""
        follower = DeploymentFollower(config, bootstrap_servers, on_decision=self.seen)
        following, ready = asyncio.create_task(follower.run(stop)), asyncio.create_task(follower.ready.wait())
        await asyncio.wait([following, ready], return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        self.live = True
        await following
