"""The [deploy] section: how checkpoints reach live traffic, straight away or through the gate and its canary."""

from __future__ import annotations

from dataclasses import dataclass

from agentstream.infra.config.checks import Checks


@dataclass(frozen=True)
class DeployConfig:
    """How checkpoints reach live traffic: straight away, or through the gate (evaluation, canary, promotion).

    Without the gate (``gate = false``) hot swap promotes every checkpoint to all traffic once
    the server holds it. With it, each checkpoint is a candidate: ``eval_agent`` (module:function,
    called with a task and a rollout, returning the reward; it must call the model the task's
    ``model`` names) runs over ``eval_tasks`` (a JSONL task file; its first ``eval_limit`` tasks,
    0 = all) pinned to the candidate and, afresh, to the stable version. The candidate goes on
    only when the data show it no worse than the stable version by more than ``tolerance``: the
    lower ``confidence`` bound of the mean paired difference over the tasks (Student t) is above
    ``-tolerance``; a task that fails after three tries fails the evaluation (rejected, "evaluation
    failed"), it never scores 0. On 32 tasks with 0/1 rewards that takes a near-identical candidate
    at the default tolerance. A candidate that passes serves ``canary_share`` of live rollouts; an
    always-valid sequential bound on the difference of live mean rewards (a normal mixture with
    scale ``tolerance``, looked at every poll) promotes it once it shows "no worse than
    ``tolerance``" (not before ``canary_min_s``) and rolls it back once it shows "worse", each
    wrong with probability at most 1 - ``confidence``, and never on fewer than
    ``canary_min_rollouts`` rewarded canary rollouts. A canary still undecided at ``canary_max_s``
    is rolled back, never promoted. At the defaults (stable reward 0.8 with 0/1 rewards) a canary
    as good as the stable version needs a median of about 525 rewarded canary rollouts (p90
    1,160; 5,300 and 11,500 in all at a 10% share) to be promoted: docs/gate.md, ``python -m
    bench.gate``. The gate needs LoRA checkpoints (``trainer.lora``): full weights replace the only
    copy a server holds. A gate and a hot swap with ``gate = false`` refuse to run for one model.

    Every ``reconcile_s`` seconds (0: never) hot swap asks the server what it really holds and
    restores what the deployments say it should (a restarted server, an adapter unloaded or
    replaced behind its back).
    """

    gate: bool = False
    eval_agent: str = ""
    eval_tasks: str = ""
    eval_limit: int = 0
    eval_concurrency: int = 8
    tolerance: float = 0.05
    canary_share: float = 0.1
    canary_min_s: float = 120.0
    canary_max_s: float = 900.0
    canary_min_rollouts: int = 20
    confidence: float = 0.95
    load_timeout_s: float = 300.0
    reconcile_s: float = 10.0

    def __post_init__(self) -> None:
        check = Checks("deploy", self)
        check.above("tolerance", 0, " (the margin of non-inferiority)")
        check.within("canary_share", "(0, 1]")
        check.at_least("canary_min_s", 0)
        check.at_least("canary_max_s", self.canary_min_s, " (canary_min_s)")
        check.at_least("canary_min_rollouts", 2)
        check.within("confidence", "(0.5, 1)")
        check.at_least("eval_limit", 0)
        check.at_least("eval_concurrency", 1)
        check.at_least("reconcile_s", 0, " (0: never re-check the server)")
