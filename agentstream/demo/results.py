"""What a demo run reports: the records of ``demo-report.json``, its reward-per-version plot and its markdown page."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Evaluation:
    """Held-out success of the policy version the server held (greedy, or as the agent's ``judged`` says)."""

    seconds: float  # on RL's clock (0: before RL, the warm start's included)
    policy_version: int
    accuracy: float
    correct: int
    total: int


@dataclass
class Snapshot:
    """The weights the server held ``seconds`` after training started (``weights`` empty: the base model's)."""

    seconds: float
    policy_version: int
    weights: str


@dataclass
class DemoReport:
    """What ``demo-report.json`` holds."""

    heldout_before: float
    heldout_after: float
    policy_versions: int
    seconds: float  # the whole run, wall time
    training_seconds: float  # RL's clock: evaluations and the warm start are off it
    time_to_target_s: float | None
    target: float
    agent: str = "arithmetic"
    framework: str = "openai"  # what the agent is written on (the calculator agent has several)
    judged: str = "greedy"  # how held-out success was measured
    objective: str = "policy_gradient"  # RL, or "supervised": the control (likelihood steps on successes)
    heldout_warm_start: float | None = None  # after the warm start, before RL (agents with one)
    warm_start_seconds: float | None = None  # on the machine that made it, when it was saved by an earlier run
    warm_start_from: str = ""  # the folder of a warm start saved by an earlier run, this run's start
    budget: str = ""  # RL's: seconds, or optimizer steps (demo.steps)
    stalled: bool = False  # a budget in steps ended unspent: no new version for [demo] stall_limit_s
    evaluation_seconds: float = 0.0  # held-out evaluations during RL (off its clock)
    llm_calls_per_rollout: float | None = None  # train rollouts of the last policy versions
    heldout_llm_calls_per_rollout: float | None = None  # the last held-out evaluation's rollouts
    prefix_merges: int = 0
    prefix_breaks: int = 0
    train_tokens_per_s: float | None = None  # tokens forwarded per second of optimizer steps
    evaluations: list[Evaluation] = field(default_factory=list)
    reward_per_version: list[dict] = field(default_factory=list)
    rollouts: int = 0
    spans: int = 0
    train_steps: int = 0
    quick: bool = False
    machine: dict = field(default_factory=dict)  # stack.machine.Calibration: compare runs on different machines
    snapshots: list[Snapshot] = field(default_factory=list)


def write_plot(path: Path, report: DemoReport, title: str) -> None:
    """Sampled reward per policy version, with the held-out evaluations on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    versions = [row["policy_version"] for row in report.reward_per_version]
    axis.plot(versions, [row["reward_mean"] for row in report.reward_per_version], marker=".",
              label="sampled reward (train rollouts, T=1)")
    axis.plot([e.policy_version for e in report.evaluations], [e.accuracy for e in report.evaluations],
              marker="o", label=f"held-out {report.judged} accuracy")
    axis.axhline(report.target, color="grey", linestyle=":", label=f"target {report.target:.0%}")
    axis.set_xlabel("policy version")
    axis.set_ylabel("reward / accuracy")
    axis.set_ylim(0, 1.02)
    axis.set_title(f"SmolLM2-135M-Instruct learning {title} online through agentstream")
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_markdown(path: Path, report: DemoReport) -> None:
    reached = "not reached" if report.time_to_target_s is None else f"{report.time_to_target_s:.0f} s"
    trained, phase = (("RL (policy gradient)", "RL") if report.objective == "policy_gradient" else
                      ("the supervised control: likelihood steps on the train rollouts that succeeded, instead of RL",
                       "the control"))
    lines = ["# agentstream demo report", "",
             f"- agent: {report.agent}, written on {report.framework}; trained by {trained}",
             (f"- held-out success ({report.judged}): {report.heldout_before:.1%} before, "
              f"{report.heldout_warm_start:.1%} after "
              f"the warm start ({report.warm_start_seconds:.0f} s"
              f"{', saved by an earlier run in ' + report.warm_start_from if report.warm_start_from else ''}), "
              f"{report.heldout_after:.1%} after {phase}"
              if report.heldout_warm_start is not None else
              f"- held-out {report.judged} accuracy: {report.heldout_before:.1%} before -> "
              f"{report.heldout_after:.1%} after"),
             *([f"- LLM calls per train rollout at the end: {report.llm_calls_per_rollout:.2f}; prefix merges "
                f"{report.prefix_merges}, breaks {report.prefix_breaks}"]
               if report.llm_calls_per_rollout is not None else []),
             *([f"- LLM calls per held-out rollout at the end ({report.judged}): "
                f"{report.heldout_llm_calls_per_rollout:.2f}"]
               if report.heldout_llm_calls_per_rollout is not None else []),
             (f"- {report.policy_versions} policy versions in {report.training_seconds:.0f} s of {phase} (its budget: "
              f"{report.budget or 'its seconds'}; {report.evaluation_seconds:.0f} s of held-out evaluations during "
              f"it were off its clock, {report.seconds:.0f} s in all); {report.rollouts} train rollouts, "
              f"{report.spans} spans"),
             *([f"- {phase} ended before its budget was spent: no new policy version for the demo's stall_limit_s"]
               if report.stalled else []),
             f"- time to {report.target:.0%} held-out: {reached}",
             *([f"- machine: {report.machine['cpu_model']}, {report.machine['cores']} cores; calibration "
                f"python_loop_s {report.machine['python_loop_s']}, numpy_matmul_s {report.machine['numpy_matmul_s']}"]
               if report.machine else []),
             "", "| seconds | policy version | held-out accuracy |", "|---|---|---|",
             *(f"| {e.seconds:.0f} | v{e.policy_version} | {e.accuracy:.1%} ({e.correct}/{e.total}) |"
               for e in report.evaluations),
             "", "![reward per policy version](reward_per_version.png)", ""]
    path.write_text("\n".join(lines))
