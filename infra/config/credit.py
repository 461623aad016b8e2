"""The [[credit]] rules: which agents and models train, and how their LLM calls get credit (first match wins)."""

from __future__ import annotations

from dataclasses import dataclass

from agentstream.infra.config.checks import Checks


@dataclass(frozen=True)
class CreditRule:
    """Which agents and models are trained, and how credit is assigned to their LLM calls (first match wins).

    ``agent`` and ``model`` are shell-style patterns. ``strategy`` is ``final`` (every call gets
    the final reward), ``discounted`` (intermediate rewards attach to the preceding call, returns
    discounted by ``gamma``) or ``grpo`` (advantages normalised within groups of ``group_size``
    rollouts of one task, waiting at most ``group_timeout_s`` for stragglers) or ``baseline`` (online
    traffic without groups: the final reward minus a running mean of the agent's). ``train_as``
    renames the trained model (the transitions topic key); ``train = false`` excludes.

    ``sample_rate`` (0 to 1, default 1) is the share of the matching rollouts trained on; every
    rollout is still captured and stored for analytics. The choice is a hash of the group id (else
    the rollout id), so it is the same on every worker and replay, and a GRPO group is kept or
    dropped whole. A rollout's own ``agentstream.train`` flag (SDK ``train=``, proxy header
    ``X-Agentstream-Train``) overrides it: false never trains, true trains whatever the rate.
    A GRPO group whose rewards are all equal carries no signal and is dropped; ``keep_flat_groups``
    publishes it as zero-advantage transitions instead, so a trainer that counts experience rather
    than signal (``trainer.batch_counts_skipped``) sees every group.

    ``level`` is what one training sample holds: ``transition`` (one LLM call) or ``trajectory``
    (successive calls of a rollout merged while each call's prompt token ids start with the
    previous call's prompt + response ids; the tokens in between, tool results and template glue,
    are masked out of the loss; where that prefix breaks, the sample splits and the break is
    counted in the rollouts row). A trajectory-level sample carries the credit of its first call.
    """

    agent: str = "*"
    model: str = "*"
    strategy: str = "final"
    gamma: float = 1.0
    group_size: int = 8
    group_timeout_s: float = 60.0
    train: bool = True
    train_as: str | None = None
    sample_rate: float = 1.0
    keep_flat_groups: bool = False
    level: str = "transition"


STRATEGIES = ("final", "discounted", "grpo", "baseline")
LEVELS = ("transition", "trajectory")


def check_rule(where: str, rule: CreditRule) -> None:
    """The checks of one rule, named by its place in the file (``credit[2]``), which the rule itself does not know."""
    check = Checks(where, rule)
    check.one_of("strategy", STRATEGIES)
    check.must("group_size", rule.strategy != "grpo" or rule.group_size >= 2, "be >= 2 for grpo")
    check.within("gamma", "[0, 1]")
    check.within("sample_rate", "[0, 1]")
    check.one_of("level", LEVELS)
