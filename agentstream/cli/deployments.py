"""What serves what: the ``gate``, and a person's ``deployments``, ``promote`` and ``rollback``."""

from __future__ import annotations

import asyncio

import click

from agentstream.cli.common import command_config as _config
from agentstream.cli.common import render, server_urls
from agentstream.stack.control import Stack


@click.command("gate")
@click.option("--model", "model_name", required=True, help="The trained model whose checkpoints the gate decides on.")
@click.option("--server", "server_url", required=True, help="Base URL of the model server hot swap loads into.")
@click.option("--proxy", "proxy_url", required=True, help="The LLM proxy the evaluation runs through.")
@click.pass_context
def gate_command(ctx: click.Context, model_name: str, server_url: str, proxy_url: str) -> None:
    """Run the promotion gate: evaluate each new checkpoint, canary it on live traffic, promote or roll back.

    Settings are the [deploy] table (eval_agent, eval_tasks, tolerance, canary_share, canary_min_s, ...);
    hot swap must run with deploy.gate = true so that it loads what the gate names (each refuses to
    start beside the other otherwise). The rule and its error rates: docs/gate.md.
    """
    from agentstream.deploy.gate_main import run_gate
    from agentstream.evaluation import task_evaluator
    from agentstream.pipeline.publisher import process_publisher

    config = _config(ctx)
    endpoints = Stack(config).endpoints()
    with process_publisher(config, endpoints.bootstrap_servers, "gate") as publisher:
        run_gate(config, endpoints.bootstrap_servers, endpoints.clickhouse_url, model_name, server_url,
                 evaluate=task_evaluator(config, proxy_url, model_name, publisher), proxy_url=proxy_url)


@click.command("deployments")
@click.option("--model", "model_name", default=None, help="Only this model.")
@click.option("--history", default=10, show_default=True, help="Recent decisions to list (0: none).")
@click.option("--server", "server_urls", multiple=True, callback=server_urls,
              help="A model server to ask what it holds; repeat it for a fleet (default: [proxy] upstreams).")
@click.pass_context
def deployments_command(ctx: click.Context, model_name: str | None, history: int, server_urls: tuple[str, ...]) -> None:
    """What serves what, per trained model, what each model server holds, and the latest deployment decisions."""
    from agentstream.deploy.deployments import read_routes
    from agentstream.deploy.manual import recent_decisions
    from agentstream.pipeline.proxy.upstreams import holdings_rows, survey

    config = _config(ctx)
    endpoints = Stack(config).endpoints()
    routes = asyncio.run(read_routes(config, endpoints.bootstrap_servers))
    rows = [[r.model, r.stable_version, r.canary_version if r.canary_version is not None else "",
             f"{r.canary_share:.0%}" if r.canary_version is not None else "",
             r.candidate_version if r.candidate_version is not None else "", r.format]
            for r in sorted(routes.values(), key=lambda r: r.model) if model_name in (None, r.model)]
    if not rows:
        click.echo("no deployments yet" + (f" of {model_name}" if model_name else "") +
                   ": a model appears here once a checkpoint of it is promoted or becomes a candidate")
    else:
        click.echo(render(["model", "stable", "canary", "share", "candidate", "format"], rows, "table"))
    server_urls = server_urls or config.proxy.upstreams
    if server_urls:
        servers = holdings_rows(asyncio.run(survey(server_urls)), routes.values(), model_name)
        click.echo("\nmodel servers:")
        click.echo(render(["server", "up", "weights", "holds", "missing"], servers, "table"))
    recent = recent_decisions(config, endpoints.clickhouse_url, model_name, history) if history > 0 else []
    if recent:
        click.echo("\nlatest decisions:")
        click.echo(render(["decided_at", "model", "version", "action", "by", "reason"], recent, "table"))


@click.command("promote")
@click.option("--model", "model_name", required=True, help="The trained model.")
@click.option("--version", type=click.IntRange(min=0), required=True, help="The version to serve (0: the base model).")
@click.pass_context
def promote_command(ctx: click.Context, model_name: str, version: int) -> None:
    """Serve VERSION of MODEL to all traffic now (ends its canary or candidacy); recorded as a manual decision."""
    from agentstream.deploy.manual import promote_by_hand

    config = _config(ctx)
    endpoints = Stack(config).endpoints()
    decision = promote_by_hand(config, endpoints.bootstrap_servers, endpoints.clickhouse_url, model_name, version)
    click.echo(f"{model_name}: serving {decision.routing.describe()}")


@click.command("rollback")
@click.option("--model", "model_name", required=True, help="The trained model.")
@click.pass_context
def rollback_command(ctx: click.Context, model_name: str) -> None:
    """End MODEL's canary, or (without one) serve the version that served before the stable one again."""
    from agentstream.deploy.manual import roll_back_by_hand

    config = _config(ctx)
    endpoints = Stack(config).endpoints()
    decision = roll_back_by_hand(config, endpoints.bootstrap_servers, endpoints.clickhouse_url, model_name)
    click.echo(f"{model_name}: serving {decision.routing.describe()}")


COMMANDS = [gate_command, deployments_command, promote_command, rollback_command]
