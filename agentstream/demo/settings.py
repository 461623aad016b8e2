"""The demos' settings, the config file's ``[demo]``: defined with the demos, read by infra's loader like its own.

Importing this module adds the section to the configuration (``add_section``); ``agentstream``'s
``__init__`` imports it, so every process that loads a configuration reads ``[demo]``, ``DEMO_QUICK``
and ``DEMO_SECONDS``, and ``agentstream config`` shows them, while infra never imports the demos.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentstream.demo.clock import StallWatch
from agentstream.examples import CALCULATOR_FRAMEWORKS
from agentstream.infra.config import Checks, add_section

FRAMEWORKS = tuple(CALCULATOR_FRAMEWORKS)
"""What ``agentstream demo --agent calculator --framework`` takes: the calculator agent's frameworks."""

ENVIRONMENT = {"DEMO_QUICK": "quick", "DEMO_SECONDS": "seconds", "DEMO_STEPS": "steps"}
"""The demos' environment variables, each the field it sets (``DEMO_QUICK=1 make demo``)."""


@dataclass(frozen=True)
class DemoConfig:
    """The training demo (``make demo``) and ``make bench-learning``: how long, how often to evaluate, how wide.

    ``seconds`` is RL's budget (``quick_seconds`` when ``quick``, i.e. ``DEMO_QUICK=1``), unless
    ``steps`` > 0 sets it in optimizer steps (policy versions past where RL starts): every machine then
    trains as much, and a slower one takes longer to (a budget in seconds gave a machine three times
    slower a third of the steps), and ends early where no new version comes for ``stall_limit_s`` of RL's clock
    (every group flat: nothing to train), which the report says;
    held-out greedy accuracy is measured before, every ``eval_every_s`` and after, each evaluation
    off RL's clock (a slower machine's evaluations do not eat its training). ``concurrency``
    rollouts run at once (``prompts_per_wave`` GRPO groups of ``group_size``). ``target`` is the
    held-out accuracy bench-learning times (``time_to_85pct_s``); ``stop_at_target`` ends a run there.
    The trainer steps once per wave (its flat groups counted) and drops transitions more than
    ``max_policy_lag`` versions old; waves are paced so that generation runs at most that many
    versions ahead (0: generate, then train, then generate, as a plain loop does). ``heldout_tasks``
    of the 400 arithmetic tasks are held out (``agentstream.examples.arithmetic.split``). ``dtype`` is the
    compute dtype of the demo's server and trainer: ``auto`` is bfloat16 autocast where the device
    multiplies bfloat16 natively (CUDA, or a CPU with AMX), which trains SmolLM2 about twice as fast
    there, and float32 elsewhere. ``warm_start_demonstrations`` is how many correct conversations
    an agent with a warm start (``agentstream demo --agent calculator`` or ``word-problems``) sends
    through the pipeline, the supervised steps before RL (0: the agent's own number, 128 for the
    calculator, 224 for the word problems): it runs until all of them are trained and served,
    however long that takes on the machine, up to ``warm_start_limit_s``; a finished warm start is saved
    in ``<output_dir>/warm-start``, and ``warm_start_from`` names such a folder to start from instead (the
    demonstrations are not sent again: RL and its control start from the same weights), with AdamW's moments as
    saved, or without its first moment where ``warm_start_momentum`` is false (the direction the warm start was
    moving in carried both alike about as far as their own steps did: docs/multistep.md). ``objective`` is what the
    trainer does with the train rollouts after the warm start: ``policy_gradient`` (RL, the demo) or
    ``supervised``, the control a demo of RL is measured against: the same rollouts and budget, but
    likelihood steps on the rollouts that succeeded only (rejection sampling; the trainer's
    ``supervised_min_reward``, 1 by default). ``adapter_lr`` is the learning rate of the LoRA adapters
    several agents train at once (``agentstream demo --agents``, one adapter per agent on every linear layer;
    0: each agent's own, ``DemoAgent.adapter_lr``).

    ``online_*`` set the online demo (``agentstream demo --online``): seconds of live traffic, the
    users' request rate (per second), the longest feedback delay and the share of answers never
    rated, the service's sampling temperature (SmolLM2 answers about a third right at 0.2 and 0.3,
    a twentieth at 1.0; at 0.2 live success rose faster, 31% -> 80% against 26% -> 72% at 0.3
    in otherwise equal runs), the LoRA learning rate (adapters on every linear layer), batch
    (transitions) and optimizer steps per checkpoint (each checkpoint is a candidate; the gate
    takes the newest when it is free), the trainer's lag bound in checkpoints (the stable version
    trails the trainer by a gate cycle of about five checkpoints; a bound of 8 dropped half the
    transitions as stale), the gate's
    evaluation size, canary share and minimum canary window, the gate's tolerance and confidence
    (a lenient gate, 0.2 at 90%, so that a demo of a quarter hour shows promotions: at the
    production defaults, 0.05 at 95%, a half-share canary at two users a second would need about
    half an hour of traffic to show "no worse"; with these, ``bench.gate``'s simulation of 50% 0/1
    rewards needs a median 80 rated canary rollouts when the candidate is as good, 39 when it is 10
    points better, about two minutes at two users a second; docs/gate.md), and after how many
    refused candidates in a row the trainer goes back to the serving version. The online demo runs
    ``online_model_servers`` model servers behind its proxy, and keeps its checkpoints in the
    object store (``[checkpoints] s3_endpoint``, else the stack's embedded one) where there is one.
    """

    quick: bool = False
    seconds: float = 900.0
    quick_seconds: float = 240.0
    steps: int = 0
    stall_limit_s: float = 900.0  # 4-10x the longest step the slow EPYC made (80-170 s, and a wave to sample)
    eval_every_s: float = 180.0
    group_size: int = 8
    prompts_per_wave: int = 4
    lr: float = 1e-5
    target: float = 0.85
    stop_at_target: bool = False
    server_threads: int = 1
    trainer_threads: int = 1  # beside the server's thread; 2 made a step 7-8 s instead of 5-6 s on two cores
    max_policy_lag: int = 2  # lags 0-4 measured (docs/measured.md): 2 is as fast as 3 and 4, with the freshest data
    heldout_tasks: int = 64
    dtype: str = "auto"
    warm_start_demonstrations: int = 0
    warm_start_limit_s: float = 1800.0
    warm_start_from: str = ""
    warm_start_momentum: bool = True
    objective: str = "policy_gradient"
    adapter_lr: float = 0.0
    output_dir: str = "demo-output"
    report_path: str = "demo-report.json"
    online_seconds: float = 1020.0
    online_rate: float = 2.0
    online_feedback_max_delay_s: float = 60.0
    online_silent_share: float = 0.1
    online_temperature: float = 0.2
    online_lr: float = 5e-4
    online_batch: int = 16
    online_steps_per_checkpoint: int = 1
    online_max_policy_lag: int = 20
    online_eval_tasks: int = 32
    online_rebase_after_rejections: int = 3
    online_canary_share: float = 0.5
    online_canary_s: float = 30.0
    online_tolerance: float = 0.2
    online_confidence: float = 0.9
    online_model_servers: int = 2
    online_report_path: str = "online-report.json"

    @property
    def training_seconds(self) -> float:
        return self.quick_seconds if self.quick else self.seconds

    @property
    def budget(self) -> str:
        """RL's budget, in words."""
        return f"{self.steps} optimizer steps" if self.steps else f"{self.training_seconds:.0f} s"

    def spent(self, seconds: float, steps: int) -> bool:
        """Whether RL has spent its budget, ``seconds`` on its clock and ``steps`` policy versions in."""
        return steps >= self.steps if self.steps else seconds >= self.training_seconds

    def stall_watch(self) -> StallWatch:
        """What ends a budget in steps that no version moves any more (a budget in seconds ends on its own)."""
        return StallWatch(self.stall_limit_s if self.steps else None)

    def refuse_ignored_settings(self, several: bool = False) -> None:
        """Refuse settings the run would ignore: they come apart (a file, then a flag), so are checked together here.

        ``warm_start_momentum = false`` acts only on a saved warm start (``warm_start_from``): a run that makes its
        own warm start carries the momentum on in the same optimizer. Several agents make their own warm starts,
        and train by RL: the supervised control is measured for one agent.
        """
        check = Checks("demo", self)
        check.must("warm_start_from", not (several and self.warm_start_from),
                   "be empty for several agents at once (each makes its own warm start)")
        check.must("objective", not several or self.objective == "policy_gradient",
                   "be policy_gradient for several agents at once (run the supervised control for one agent: "
                   "--agent word-problems --objective supervised)")
        check.must("warm_start_momentum", self.warm_start_momentum or bool(self.warm_start_from),
                   "stay true unless the run starts from a saved warm start (warm_start_from, --warm-start-from): "
                   "a run that makes its own carries the momentum on in the same optimizer")

    def __post_init__(self) -> None:
        check = Checks("demo", self)
        check.above("seconds", 0)
        check.above("quick_seconds", 0)
        check.above("online_seconds", 0)
        check.at_least("steps", 0)
        check.above("stall_limit_s", 0)
        check.above("eval_every_s", 0)
        check.at_least("group_size", 2)
        check.at_least("max_policy_lag", 0)
        check.must("heldout_tasks", 0 < self.heldout_tasks < 400,
                   "be between 1 and 399 (the arithmetic task set has 400)")
        check.at_least("warm_start_demonstrations", 0)
        check.above("warm_start_limit_s", 0)
        check.one_of("objective", ("policy_gradient", "supervised"))
        check.at_least("adapter_lr", 0)
        check.one_of("dtype", ("auto", "float32", "bfloat16"))
        check.above("online_tolerance", 0)
        check.within("online_confidence", "(0.5, 1)")
        check.at_least("online_model_servers", 1)


add_section("demo", DemoConfig, ENVIRONMENT)
