"""The Kafka ACLs each agentstream role needs, in one table: the docs, the `kafka-acls` command and the tests read it.

A role is a kind of process with its own principal on a secured cluster. Each gets the least it
needs: the topics it reads (Read, which implies Describe), the topics it writes (Write), and the
consumer group it commits in (Read on the group). Topics are named with ``[topics] prefix``;
groups with the names the processes use (the streams app id, the runners' group, the trainer's
``agentstream-trainer-<model>``). Nobody but an operator's admin principal creates the product
topics on such a cluster (`agentstream up` does it on the embedded broker).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from agentstream.infra.config import Config

ROLES = ("runner", "proxy", "collector", "worker", "trainer", "hotswap")
"""The roles that talk to Kafka; the promotion gate runs as ``hotswap`` (same topics: checkpoints in, deployments)."""

RUNNER_GROUP = "agentstream-runners"
"""The runners' consumer group on the tasks topic (`agentstream run --group`'s default)."""

TRAINER_GROUP_PREFIX = "agentstream-trainer-"
"""Trainers commit in ``agentstream-trainer-<model>``: one group per trained model, hence a prefixed ACL."""


@dataclass(frozen=True)
class Grant:
    """One ALLOW ACL: ``operation`` (read, write, create, describe) on a ``resource`` (topic or group) named
    ``name``, matched ``literal``ly or as a ``prefixed`` name."""

    resource: str
    name: str
    operation: str
    pattern: str = "literal"

    def kafka_acls_args(self) -> list[str]:
        """The part of a `kafka-acls.sh --add` command line that names this grant."""
        pattern = ["--resource-pattern-type", "prefixed"] if self.pattern == "prefixed" else []
        return ["--operation", self.operation.capitalize(), f"--{self.resource}", self.name, *pattern]


def role_grants(config: Config, runner_group: str = RUNNER_GROUP) -> dict[str, list[Grant]]:
    """Every role's grants under ``config`` (topic prefix, streams app id, whether the trainer follows deployments).

    The streams worker is a faust app whose group id is ``streams.app_id``; it runs without faust's
    leader topic (``topic_disable_leader``), so it creates no topic and needs no ACL beyond its
    product topics and group (observed with a worker process on a secured Apache Kafka node).
    """
    prefix = config.topics.prefix

    def topic(role: str, operation: str) -> Grant:
        return Grant("topic", f"{prefix}{role}", operation)

    app_id = config.streams.app_id
    trainer = [topic("transitions", "read"), Grant("group", TRAINER_GROUP_PREFIX, "read", "prefixed"),
               topic("checkpoints", "write")]
    if config.trainer.rebase_after_rejections > 0:  # it follows the gate's refusals on the deployments topic
        trainer.append(topic("deployments", "read"))
    return {
        "runner": [topic("tasks", "read"), Grant("group", runner_group, "read"), topic("spans", "write")],
        "proxy": [topic("spans", "write"), topic("deployments", "read")],
        "collector": [topic("spans", "write"), topic("dlq", "write")],
        "worker": [topic("spans", "read"), topic("streams.groups", "read"), topic("streams.groups", "write"),
                   topic("transitions", "write"), topic("dlq", "write"), Grant("group", app_id, "read")],
        "trainer": trainer,
        "hotswap": [topic("checkpoints", "read"), topic("deployments", "read"), topic("deployments", "write")],
    }


def kafka_acls_commands(config: Config, bootstrap_servers: str, users: dict[str, str] | None = None,
                        command_config: str | None = None, runner_group: str = RUNNER_GROUP) -> list[str]:
    """One `kafka-acls.sh --add` command per grant, for an operator to paste; ``users`` maps role -> principal name
    (default: the role's own name), ``command_config`` is the admin client's properties file."""
    lines: list[str] = []
    for role, grants in role_grants(config, runner_group).items():
        user = (users or {}).get(role, role)
        for grant in grants:
            words = ["kafka-acls.sh", "--bootstrap-server", bootstrap_servers,
                     *(["--command-config", command_config] if command_config else []),
                     "--add", "--allow-principal", f"User:{user}", *grant.kafka_acls_args()]
            lines.append(shlex.join(words))
    return lines
