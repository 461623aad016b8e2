"""Training: ``train`` (one command, end to end), ``train-worker``, ``sft`` and the ``demo``."""

from __future__ import annotations

import signal
from pathlib import Path

import click

from agentstream.cli.common import command_config as _config
from agentstream.cli.errors import Interrupted, requires_extra
from agentstream.demo import FRAMEWORKS
from agentstream.stack.control import Stack


@click.command()
@click.option("--quick", is_flag=True, default=None, help="The quick mode (same as DEMO_QUICK=1).")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds of RL (default: demo.seconds, 900; the warm start and held-out evaluations are "
              "off this clock), or of live traffic with --online "
              "(demo.online_seconds, 1020).")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="RL's budget in optimizer steps instead of seconds (default: demo.steps, 0: seconds): every "
              "machine trains as much, a slower one for longer.")
@click.option("--online", is_flag=True, help="The production demo: a service, its users' late feedback, the gate, "
              "canaries and rollbacks, on the vLLM contract.")
@click.option("--agent", "agent_name", type=click.Choice(["arithmetic", "calculator", "word-problems"]),
              default="arithmetic", show_default=True, help="The example agent to train: 'Compute a+b.' in one LLM "
              "call; the multi-step calculator agent ('Compute a*b+d.' with a tool), warm-started on "
              "demonstrations and trained at trajectory level; or word problems on the same tool, whose "
              "demonstrations show half the kinds of problem (RL has to teach the rest).")
@click.option("--framework", type=click.Choice(FRAMEWORKS), default="openai", show_default=True,
              help="What the calculator agent is written on: the plain OpenAI SDK, the OpenAI Agents SDK "
              "(Responses API), LangGraph (a ReAct graph over ChatOpenAI) or PydanticAI (Responses API): "
              "examples/calculator_*.py.")
@click.option("--objective", type=click.Choice(["policy_gradient", "supervised"]), default=None,
              help="What the trainer does with the train rollouts after the warm start (default: demo.objective, "
              "policy_gradient): RL, or 'supervised', the control RL is measured against: the same budget spent "
              "on likelihood steps on the rollouts that succeeded (rejection sampling).")
@click.option("--agents", "several", default=None, metavar="A,B",
              help="Train several example agents at once on one base model, each into its own LoRA adapter, "
              "trainer and curve, served by one model server (e.g. arithmetic,calculator); one name is that "
              "agent trained the same way alone. Writes several-report.json.")
@click.option("--warm-start-from", "warm_start_from", type=click.Path(exists=True, file_okay=False), default=None,
              help="Start from the warm start an earlier run of the same agent saved (demo-output/warm-start) "
              "instead of sending the demonstrations again: RL and the control (--objective supervised) from "
              "the same weights, and the warm start's minutes saved.")
@click.pass_context
def demo(ctx: click.Context, quick: bool | None, seconds: float | None, steps: int | None, online: bool,
         agent_name: str, framework: str, objective: str | None, several: str | None,
         warm_start_from: str | None) -> None:
    """Train SmolLM2-135M-Instruct online on an example agent and show that it learned.

    Starts the stack, the dev model server, proxy, streams, trainer, hot swap and runners;
    measures held-out success before, during and after (greedy; the calculator agent at T=0.5,
    also after its warm start); writes demo-report.json, a plot and a report under demo-output/;
    stops everything it started. With --online: a service answering users, learning from their
    feedback behind the gate (online-report.json).
    """
    from dataclasses import replace

    with requires_extra("train,examples", "demo"):
        from agentstream.demo import run_demo, run_online_demo, run_several

    config = _config(ctx)
    agents = _agent_names(several) if several is not None else None
    if agents is not None and (online or agent_name != "arithmetic" or framework != "openai"):
        raise click.UsageError("--agents trains several agents on the plain OpenAI SDK; leave out --agent, "
                               "--framework and --online")
    if online and agent_name != "arithmetic":
        raise click.UsageError("--online runs its own service agent; --agent is for the training demo")
    if framework != "openai" and agent_name != "calculator":
        raise click.UsageError("--framework is for --agent calculator: the other agents are written on the OpenAI SDK")
    if warm_start_from is not None:
        if online or agents is not None:
            raise click.UsageError("--warm-start-from is for the training demo of one agent with a warm start "
                                   "(--agent calculator or word-problems)")
        config = replace(config, demo=replace(config.demo, warm_start_from=str(Path(warm_start_from).resolve())))
    if objective is not None:
        if online:
            raise click.UsageError("--objective is for the training demo; --online trains by policy gradient")
        config = replace(config, demo=replace(config.demo, objective=objective))
    if steps is not None:
        if online or seconds is not None:
            raise click.UsageError("--steps is the training demo's budget instead of --seconds; the online demo "
                                   "runs for seconds")
        config = replace(config, demo=replace(config.demo, steps=steps))
    if online and seconds is not None:
        config = replace(config, demo=replace(config.demo, online_seconds=seconds))
    elif quick is not None or seconds is not None:
        demo_config = replace(config.demo, quick=bool(quick) or config.demo.quick)
        if seconds is not None:
            demo_config = replace(demo_config, seconds=seconds, quick_seconds=seconds)
        config = replace(config, demo=demo_config)
    signal.signal(signal.SIGTERM, _interrupt)  # stop like Ctrl-C: everything the demo started goes down
    try:
        if online:
            run_online_demo(config)
        elif agents is not None:
            run_several(config, agents)
        else:
            run_demo(config, agent=agent_name, framework=framework)
    except KeyboardInterrupt:
        raise Interrupted("interrupted; the processes the demo started were stopped") from None


def _agent_names(listed: str) -> list[str]:
    """The agents of ``--agents A,B``: known, each once."""
    from agentstream.demo.agents import AGENTS

    names = [name.strip() for name in listed.split(",") if name.strip()]
    unknown = [name for name in names if name not in AGENTS]
    if not names or unknown:
        raise click.BadParameter(f"{', '.join(unknown) or 'no agent'}: name agents among {', '.join(AGENTS)}",
                                 param_hint="--agents")
    if len(set(names)) < len(names):
        raise click.BadParameter("each agent once: it has one adapter", param_hint="--agents")
    return names


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt


@click.command("train")
@click.option("--agent", required=True, help="The agent to train, as module:function (called with task, rollout), "
              "or an Agent Lightning agent (@rollout, a LitAgent, a 1.0 agent class).")
@click.option("--tasks", "task_file", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Task payloads: JSON lines, a JSON list, or CSV with a header row.")
@click.option("--agent-name", default=None, help="Agent name on its rollouts (default: the function's name).")
@click.option("--model", "model_spec", default=None, help="Model to serve and train: tiny, smollm2 or a HF folder "
              "(default: trainer.model).")
@click.option("--server", "server_url", default=None,
              help="Use this running model server (vLLM) instead of starting one.")
@click.option("--runners", default=1, show_default=True, help="Runner processes.")
@click.option("--concurrency", default=8, show_default=True, help="Rollouts at once per runner.")
@click.option("--strategy", type=click.Choice(["grpo", "final", "discounted"]), default="grpo", show_default=True)
@click.option("--group-size", default=8, show_default=True, help="Rollouts per task, compared as a group (grpo).")
@click.option("--epochs", default=1, show_default=True, help="Passes over the task file.")
@click.option("--max-steps", default=None, type=int, help="Stop after this many optimizer steps.")
@click.option("--val-tasks", "val_file", default=None, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Evaluation tasks (JSONL, JSON or CSV), run before and after training as AGENT_NAME-eval, "
              "never trained on (Agent Lightning's val_dataset).")
@click.pass_context
def train_command(ctx: click.Context, agent: str, task_file: Path, agent_name: str | None, model_spec: str | None,
                  server_url: str | None, runners: int, concurrency: int, strategy: str, group_size: int,
                  epochs: int, max_steps: int | None, val_file: Path | None) -> None:
    """Train an agent on a task file with one command: enqueue, run, train, hot-swap, until done."""
    from agentstream.pipeline.runner.pool import AgentLoadError, load_agent
    from agentstream.train import TrainRequest, run_training

    try:
        function = load_agent(agent)
    except AgentLoadError as error:  # a usage error (status 2), like any option click refuses
        raise click.BadParameter(str(error), param_hint="--agent") from None
    config = _config(ctx)
    request = TrainRequest(agent=agent, tasks=task_file, agent_name=agent_name or function.__name__,
                           model=model_spec or config.trainer.model, server_url=server_url, runners=runners,
                           concurrency=concurrency, group_size=group_size, strategy=strategy, epochs=epochs,
                           max_steps=max_steps, val_tasks=val_file)
    run_training(config, request, progress=click.echo)


@click.command("train-worker")
@click.option("--model", "model_spec", default=None, help="Model spec to train (overrides trainer.model).")
@click.option("--max-steps", default=None, type=int,
              help="Stop after this many optimizer steps (default: run until SIGTERM).")
@click.pass_context
def train_worker_command(ctx: click.Context, model_spec: str | None, max_steps: int | None) -> None:
    """Train one model from the transitions topic; checkpoints go to the store and the checkpoints topic.

    Under torchrun (`torchrun --nproc-per-node N -m agentstream train-worker`) it runs as N
    data-parallel ranks: rank 0 reads Kafka and writes checkpoints, the others follow it.

    A second train-worker of the same model on the same machine (stack home) stands by, model
    loaded, and takes over within seconds when the active one dies.
    """
    from dataclasses import replace

    from agentstream.deploy.rebase import RejectionStreak

    with requires_extra("train", "train-worker"):
        from agentstream.trainer.distributed import Ranks
        from agentstream.trainer.worker_main import run_train_follower, run_train_worker
    config = _config(ctx)
    if model_spec:
        config = replace(config, trainer=replace(config.trainer, model=model_spec))
    ranks = Ranks.from_env()  # set by torchrun: data-parallel ranks, rank 0 reads Kafka
    if ranks is not None and not ranks.leader:
        run_train_follower(config, ranks)
        return
    endpoints = Stack(config).endpoints()
    run_train_worker(config, endpoints.bootstrap_servers, endpoints.clickhouse_url, max_steps=max_steps,
                     rebase=RejectionStreak, ranks=ranks)


@click.command("sft")
@click.option("--dataset", "dataset", required=True, type=click.Path(exists=True, dir_okay=False),
              help="A file of `agentstream dataset export` (.jsonl, .jsonl.gz or .parquet).")
@click.option("--min-reward", default=None, type=float,
              help="Train only rollouts whose reward is at least this (default: trainer.supervised_min_reward).")
@click.option("--epochs", default=1, type=click.IntRange(min=1), help="Passes over the file.")
@click.option("--model", "model_spec", default=None, help="Model spec to train (overrides trainer.model).")
@click.pass_context
def sft_command(ctx: click.Context, dataset: str, min_reward: float | None, epochs: int,
                model_spec: str | None) -> None:
    """Supervised steps on a dataset's good rollouts (rejection sampling); the result is the model's next checkpoint.

    It starts from the model's latest checkpoint and announces the new one on the checkpoints
    topic: hot swap loads it and `train-worker` resumes from it (a warm start before RL). Its
    steps and checkpoint are train_steps and checkpoints rows, and a run where [tracking] says.
    """
    from dataclasses import replace

    from agentstream.infra.config import ConfigError

    with requires_extra("train", "sft"):
        from agentstream.trainer.sft_main import run_supervised
    config = _config(ctx)
    try:
        config = replace(config, trainer=replace(
            config.trainer, model=model_spec or config.trainer.model,
            supervised_min_reward=config.trainer.supervised_min_reward if min_reward is None else min_reward))
    except ConfigError as error:  # the option's value is what the configuration refuses: a usage error (status 2)
        raise click.BadParameter(str(error)) from None
    endpoints = Stack(config).endpoints()
    run_supervised(config, endpoints.bootstrap_servers, endpoints.clickhouse_url, Path(dataset), epochs=epochs,
                   progress=click.echo)


COMMANDS = [train_command, train_worker_command, sft_command, demo]
