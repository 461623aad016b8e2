"""The `agentstream` command line: it parses options, resolves the configuration and calls what does the work.

A long-running process's `main` lives in the package of what it does (``pipeline/proxy/main.py``,
``trainer/worker_main.py``, ``deploy/gate_main.py``, ...); here it only gets its options.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import sys
from pathlib import Path

import click

from agentstream.command_config import command_config as _config
from agentstream.infra.clickhouse import ClickHouseError, connect, server_message
from agentstream.infra.config import AglConfig, Config, ConfigError, describe, server_urls_problem
from agentstream.infra.kafka import KafkaSetupError
from agentstream.infra.processes import ServiceError
from agentstream.infra.registry_client.errors import RegistryError, RegistryUnavailable
from agentstream.pipeline.runner.pool import AgentLoadError
from agentstream.pipeline.runner.tasks import TaskFileError
from agentstream.schema_registry import schema_registry_command
from agentstream.stack.control import Stack

KNOWN_ERRORS = (ConfigError, ServiceError, ClickHouseError, KafkaSetupError, AgentLoadError, TaskFileError,
                RegistryError, RegistryUnavailable)


class AgentstreamGroup(click.Group):
    """A click group that turns our named errors into one clear line and exit status 1.

    A Kafka error's line starts with its class (KafkaAccessDenied, KafkaAuthenticationFailed, SessionTimeoutRefused,
    ...): an operator's alert or search matches the kind of refusal without parsing the sentence.
    """

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KNOWN_ERRORS as error:
            kind = f"{type(error).__name__}: " if isinstance(error, KafkaSetupError) else ""
            click.secho(f"error: {kind}{error}", fg="red", err=True)
            sys.exit(1)


@click.group(cls=AgentstreamGroup)
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None,
              help="TOML config file (default: ./agentstream.toml if present, or $AGENTSTREAM_CONFIG).")
@click.pass_context
def main(ctx: click.Context, config_path: Path | None) -> None:
    """agentstream: reinforcement learning for any agent, streamed over Kafka."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("aiokafka", "clickhouse_connect"):  # their retry chatter; our errors say what failed
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    ctx.obj = config_path


@main.command()
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for each service to answer.")
@click.pass_context
def up(ctx: click.Context, timeout: float) -> None:
    """Start the local broker and ClickHouse (unless external ones are configured), create topics and tables."""
    endpoints = Stack(_config(ctx)).up(timeout_s=timeout)
    click.echo(f"ready: KAFKA_BOOTSTRAP_SERVERS={endpoints.bootstrap_servers} "
               f"CLICKHOUSE_URL={endpoints.clickhouse_url}")


@main.command()
@click.pass_context
def status(ctx: click.Context) -> None:
    """Show broker reachability, topics, consumer groups, ClickHouse version and table row counts."""
    config = _config(ctx)
    report = Stack(config).status()
    if not report.broker_reachable and not report.clickhouse_version and report.nothing_running:
        click.echo(f"the stack is down (kafka {report.endpoints.bootstrap_servers} and clickhouse "
                   f"{report.endpoints.clickhouse_url} do not answer): start it with `agentstream up`")
        sys.exit(1)
    click.echo(f"kafka       {report.endpoints.bootstrap_servers}  "
               + ("reachable" if report.broker_reachable else f"UNREACHABLE ({report.broker_error})")
               + f"  [{report.services['broker']}]")
    if not config.kafka.external and config.stack.broker == "kafka":
        click.echo(f"  broker: Apache Kafka, data {config.stack.home.resolve() / 'kafka'}")
    if "objectstore" in report.services:
        held = "checkpoints" if config.stack.broker == "kafka" else "durable"
        click.echo(f"  storage: {held}, {Stack(config).broker_data}  [objectstore {report.services['objectstore']}]")
    for name, (partitions, messages) in report.topics.items():
        click.echo(f"  topic {name:<32} partitions {partitions:>3}  messages {messages:>10}")
    if report.broker_reachable:
        click.echo("  consumer groups: " + (", ".join(report.groups) if report.groups else "none"))
    click.echo(f"clickhouse  {report.endpoints.clickhouse_url}  "
               + (f"version {report.clickhouse_version}" if report.clickhouse_version
                  else f"UNREACHABLE ({report.clickhouse_error})")
               + f"  [{report.services['clickhouse']}]")
    for table, rows in report.tables.items():
        click.echo(f"  table {config.clickhouse.database}.{table:<24} rows {rows:>10}" if rows >= 0
                   else f"  table {config.clickhouse.database}.{table:<24} missing (run `agentstream up`)")
    if "schema-registry" in report.services:
        from agentstream.stack.registry_server.service import registry_url

        click.echo(f"schemas     {registry_url(config)}  [{report.services['schema-registry']}]")
    if not (report.broker_reachable and report.clickhouse_version):
        sys.exit(1)


@main.command()
@click.pass_context
def down(ctx: click.Context) -> None:
    """Stop exactly the services `agentstream up` started from this state folder."""
    Stack(_config(ctx)).down()


@main.command()
@click.argument("query", required=False)
@click.option("--file", "query_file", type=click.File("r"), help="Read the query from a file ('-' for stdin).")
@click.option("--format", "output_format", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True)
@click.option("--write", is_flag=True, help="Allow statements that change data (queries are read-only by default).")
@click.pass_context
def sql(ctx: click.Context, query: str | None, query_file, output_format: str, write: bool) -> None:
    """Run SQL against the configured ClickHouse (database defaults to the agentstream one)."""
    if query_file is not None:
        query = query_file.read()
    if not query:
        raise click.UsageError("give a QUERY or --file")
    config = _config(ctx)
    client = connect(config.clickhouse, Stack(config).endpoints().clickhouse_url,
                     database=config.clickhouse.database, readonly=not write)
    try:
        result = client.query(query)
    except Exception as error:
        raise ClickHouseError(server_message(error)) from None
    click.echo(render(result.column_names, result.result_rows, output_format), nl=False)


def render(columns, rows, output_format: str) -> str:
    """Rows as an aligned text table, CSV, or JSON lines."""
    if output_format == "json":
        return "".join(json.dumps(dict(zip(columns, row, strict=True)), default=str) + "\n" for row in rows)
    if output_format == "csv":
        import csv
        import io

        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(columns)
        writer.writerows(rows)
        return buffer.getvalue()
    cells = [[str(c) for c in columns]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines) + f"\n({len(rows)} row{'s' if len(rows) != 1 else ''})\n"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


@main.command("report")
@click.option("--format", "output_format", type=click.Choice(["table", "csv", "json"]), default="table",
              show_default=True)
@click.option("--agent", default=None, help="Only this agent's rollouts and spans.")
@click.option("--model", default=None, help="Only rows of this model (its LLM spans, rollouts and train steps).")
@click.option("--since", default=None, help="Only the last DURATION, e.g. 30m, 1h, 2d (default: all time).")
@click.option("--bucket", default="1m", show_default=True, help="Throughput bucket size, e.g. 30s, 1m, 1h.")
@click.option("--buckets", default=30, show_default=True, type=click.IntRange(1, 10_000),
              help="Throughput buckets shown, ending at the newest activity.")
@click.pass_context
def report_command(ctx: click.Context, output_format: str, agent: str | None, model: str | None, since: str | None,
                   bucket: str, buckets: int) -> None:
    """Analytics over the configured ClickHouse (read-only): reward by policy version, LLM tokens and latency,
    rollout status, training staleness, throughput, and spans by source (how many LLM spans have no token ids:
    those are analytics only, never trained on)."""
    from agentstream import report as analytics

    try:
        since_s = analytics.parse_duration(since) if since else 0
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--since") from None
    try:
        bucket_s = analytics.parse_duration(bucket)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--bucket") from None
    filters = analytics.ReportFilters(agent=agent or "", model=model or "", since_s=since_s, bucket_s=bucket_s,
                                      buckets=buckets)
    logging.getLogger("urllib3").setLevel(logging.ERROR)  # its retry warning; our error line says what failed
    config = _config(ctx)
    client = connect(config.clickhouse, Stack(config).endpoints().clickhouse_url,
                     database=config.clickhouse.database, readonly=True)
    try:
        sections = analytics.build_report(client, filters)
    finally:
        client.close()
    if output_format == "json":
        click.echo(analytics.render_json(sections), nl=False)
    elif output_format == "csv":
        click.echo(analytics.render_csv(sections), nl=False)
    else:
        analytics.print_tables(sections)


def _finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A number option that must be finite (NaN would select nothing, silently)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} must be a finite number")
    return value


@main.group("dataset")
def dataset_group() -> None:
    """Datasets from the traces in ClickHouse, for Hugging Face datasets and offline training."""


@dataset_group.command("export")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--format", "file_format", type=click.Choice(["jsonl", "parquet"]), default=None,
              help="File format (default: from OUT's suffix: .jsonl, .jsonl.gz, .parquet).")
@click.option("--where", default=None, help="A SQL expression over the rollouts table's columns, run read-only.")
@click.option("--agent", "agents", multiple=True, help="Only this agent's rollouts (repeat for several).")
@click.option("--min-reward", type=float, default=None, callback=_finite,
              help="Only rollouts whose final reward is at least R.")
@click.option("--max-reward", type=float, default=None, callback=_finite,
              help="Only rollouts whose final reward is at most R.")
@click.option("--since", default=None, help="Only rollouts started at or after TIME (ISO 8601, or a duration: 2h).")
@click.option("--until", default=None, help="Only rollouts started before TIME (ISO 8601, or a duration ago).")
@click.option("--version", type=int, default=None, help="Only rollouts of policy version N (their newest version).")
@click.option("--min-version", type=int, default=None, help="Only rollouts of policy version N or later.")
@click.option("--max-version", type=int, default=None, help="Only rollouts of policy version N or earlier.")
@click.option("--limit", type=click.IntRange(min=0), default=None, help="At most N rollouts (by rollout id).")
@click.option("--batch-rollouts", type=click.IntRange(min=1), default=500, show_default=True,
              help="Rollouts per page: one Parquet row group, and what memory holds at a time.")
@click.pass_context
def dataset_export(ctx: click.Context, out: Path, file_format: str | None, where: str | None, agents: tuple[str, ...],
                   min_reward: float | None, max_reward: float | None, since: str | None, until: str | None,
                   version: int | None, min_version: int | None, max_version: int | None, limit: int | None,
                   batch_rollouts: int) -> None:
    """Write the selected rollouts, one row each (conversation, LLM calls' token ids, training samples), to OUT as
    JSON Lines or Parquet that Hugging Face datasets loads; streamed page by page, renamed into place at the end."""
    from agentstream import dataset
    from agentstream.schemas.dataset import DatasetError

    if version is not None and (min_version is not None or max_version is not None):
        raise click.UsageError("give --version or --min-version/--max-version, not both")
    times = {}
    for name, text in (("--since", since), ("--until", until)):
        try:
            times[name] = dataset.parse_time(text) if text else None
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint=name) from None
    filters = dataset.ExportFilters(
        where=where or "", agents=agents, min_reward=min_reward, max_reward=max_reward, since=times["--since"],
        until=times["--until"], min_version=version if version is not None else min_version,
        max_version=version if version is not None else max_version, limit=limit)
    logging.getLogger("urllib3").setLevel(logging.ERROR)  # its retry warning; our error line says what failed
    config = _config(ctx)
    client = connect(config.clickhouse, Stack(config).endpoints().clickhouse_url,
                     database=config.clickhouse.database, readonly=True)
    try:
        result = dataset.export(client, out, filters, format=file_format, batch_rollouts=batch_rollouts,
                                progress=lambda done: click.echo(dataset.progress_line(done), err=True))
    except DatasetError as error:
        click.secho(f"error: {error}", fg="red", err=True)
        sys.exit(1)
    finally:
        client.close()
    click.echo(dataset.summary_line(result), err=True)


@main.command("dashboard")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (loopback: only this machine).")
@click.option("--port", default=8765, show_default=True, type=int, help="Port to listen on (0: any free port).")
@click.option("--database", default=None, help="ClickHouse database to show (default: the configured one).")
@click.option("--no-kafka", is_flag=True, help="Do not read consumer lag and dead letters from Kafka.")
@click.pass_context
def dashboard_command(ctx: click.Context, host: str, port: int, database: str | None, no_kafka: bool) -> None:
    """A live web dashboard over ClickHouse (read-only): throughput, learning, LLM calls, rollouts."""
    from agentstream.dashboard.server import DashboardError, serve

    config = _config(ctx)
    endpoints = Stack(config).endpoints()
    try:
        asyncio.run(serve(config, endpoints.clickhouse_url, None if no_kafka else endpoints.bootstrap_servers,
                          host=host, port=port, database=database,
                          started=lambda url: click.echo(f"dashboard: {url}  (Ctrl-C stops it)")))
    except DashboardError as error:
        click.secho(f"error: {error}", fg="red", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        pass


def _server_urls(ctx: click.Context, param: click.Parameter, urls: tuple[str, ...]) -> tuple[str, ...]:
    """A repeated model server option: http(s) URLs, none twice."""
    if problem := server_urls_problem(urls):
        raise click.BadParameter(problem)
    return urls


@main.command("proxy")
@click.option("--upstream", "upstreams", multiple=True, callback=_server_urls,
              help="Base URL of an OpenAI-compatible model server (vLLM or serve-model); repeat it for a fleet. "
                   "Default: [proxy] upstreams.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=int)
@click.option("--agent-name", default=None, help="Agent name for calls that do not say (X-Agentstream-Agent).")
@click.option("--no-deployments", is_flag=True,
              help="Do not follow the deployments topic: forward every request's model unchanged.")
@click.pass_context
def proxy_command(ctx: click.Context, upstreams: tuple[str, ...], host: str, port: int, agent_name: str | None,
                  no_deployments: bool) -> None:
    """Serve the OpenAI-compatible LLM proxy that records every call as a span with exact token ids.

    It follows the deployments topic and sends each request for a trained model to the version
    deployed for it (stable or canary; ``model@vN`` or X-Agentstream-Version pins one). It forwards
    only the OpenAI routes users may call; with ``[security] proxy_keys`` they need a key, and the
    reward endpoint takes a rollout's feedback token (``[security] feedback_tokens``). Beyond loopback
    it refuses to start without keys unless ``[security] allow_open_bind`` says so. With several
    model servers it sends each request to the least busy healthy one that holds the version asked
    for, and a request that failed on one before its first byte to another.
    """
    from agentstream.pipeline.proxy.main import ProxyOptions, run_proxy

    config = _config(ctx)
    upstreams = upstreams or config.proxy.upstreams
    if not upstreams:
        raise click.UsageError("name the model server: --upstream URL (repeat it for several) or [proxy] upstreams")
    run_proxy(config, Stack(config).endpoints().bootstrap_servers,
              ProxyOptions(upstream=upstreams if len(upstreams) > 1 else upstreams[0], host=host, port=port,
                           agent_name=agent_name,
                           follow_deployments=not no_deployments))


@main.command("collector")
@click.option("--host", default=None, help="Address to listen on (default: [otlp] host, 127.0.0.1).")
@click.option("--port", default=None, type=int, help="OTLP/HTTP port (default: [otlp] port, 4318, OTLP/HTTP's own).")
@click.option("--grpc-port", default=None, type=int,
              help="OTLP/gRPC port (default: [otlp] grpc_port, 4317, OTLP/gRPC's own; 0: no gRPC receiver).")
@click.pass_context
def collector_command(ctx: click.Context, host: str | None, port: int | None, grpc_port: int | None) -> None:
    """Receive OpenTelemetry over OTLP/HTTP and OTLP/gRPC, and publish its traces as spans.

    Point any OpenTelemetry SDK or Collector at it: OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318
    (http/protobuf or http/json: POST /v1/traces, /v1/logs, /v1/metrics) or http://127.0.0.1:4317
    with OTEL_EXPORTER_OTLP_PROTOCOL=grpc; gzip works on both. With [security] collector_keys set,
    exports need OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20<key>.

    gen_ai.* (GenAI semantic conventions), OpenInference and OpenLLMetry spans map to LLM, TOOL,
    AGENT and REWARD spans; a trace is a rollout unless an agentstream.rollout_id attribute names one.
    Spans without token ids are analytics only (stored, never trained on). Logs and metrics are
    accepted and counted, not stored: agentstream keeps traces only.

    Malformed requests get an OTLP error response and a record on the dlq topic; while the broker
    cannot keep up, exports get 503 + Retry-After (gRPC: UNAVAILABLE + RetryInfo), which the
    exporters retry.
    """
    from agentstream.pipeline.collector.main import run_collector

    config = _config(ctx)
    run_collector(config, Stack(config).endpoints().bootstrap_servers, host=host, port=port, grpc_port=grpc_port)


@main.command("run")
@click.argument("agent")
@click.option("--concurrency", default=4, show_default=True, help="Rollouts run at once by this process.")
@click.option("--group", "group_id", default="agentstream-runners", show_default=True,
              help="Consumer group of the runner pool.")
@click.option("--proxy", "proxy_url", default=None, help="LLM proxy URL; rollouts get rollout.llm_base_url() under it.")
@click.option("--max-tasks", default=None, type=int, help="Stop after this many rollouts (default: run until SIGTERM).")
@click.option("--session-timeout-ms", default=4_000, show_default=True,
              help="How long the group waits before a silent runner's tasks go to another runner.")
@click.pass_context
def run_command(ctx: click.Context, agent: str, concurrency: int, group_id: str, proxy_url: str | None,
                max_tasks: int | None, session_timeout_ms: int) -> None:
    """Run AGENT (module:function) on tasks from the tasks topic, as one member of a runner pool."""
    from agentstream.pipeline.runner.main import run_runner
    from agentstream.pipeline.runner.pool import RunnerOptions

    config = _config(ctx)
    options = RunnerOptions(concurrency=concurrency, group_id=group_id, proxy_url=proxy_url,
                            session_timeout_ms=session_timeout_ms)
    run_runner(config, Stack(config).endpoints().bootstrap_servers, agent, options, agl=_agl_settings(config),
               max_tasks=max_tasks)


def _agl_settings(config: Config) -> AglConfig:
    """``[agl]`` with its model resolved: the trained model's served name unless one is set."""
    from dataclasses import replace

    from agentstream.models import model_display_name

    return replace(config.agl, model=config.agl.model or config.trainer.model_name
                   or model_display_name(config.trainer.model))


@main.command("enqueue")
@click.argument("task_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--group-size", default=1, show_default=True, help="Rollouts per task, compared as a group (GRPO).")
@click.option("--agent-name", default=None)
@click.option("--max-attempts", default=1, show_default=True)
@click.option("--timeout", "timeout_s", default=300.0, show_default=True, help="Seconds a rollout may take.")
@click.pass_context
def enqueue_command(ctx: click.Context, task_file: Path, group_size: int, agent_name: str | None,
                    max_attempts: int, timeout_s: float) -> None:
    """Put the tasks of a JSONL file (one JSON object per line) on the tasks topic."""
    from agentstream.pipeline.runner.tasks import enqueue, grouped_tasks, read_task_file

    config = _config(ctx)
    tasks = grouped_tasks(read_task_file(task_file), group_size=group_size, agent_name=agent_name,
                          max_attempts=max_attempts, timeout_s=timeout_s)
    count = asyncio.run(enqueue(config, Stack(config).endpoints().bootstrap_servers, tasks))
    click.echo(f"enqueued {count} rollouts from {task_file}")


@main.command("streams")
@click.option("--loglevel", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]))
@click.pass_context
def streams_command(ctx: click.Context, loglevel: str) -> None:
    """Run a stream-processing worker (spans -> ClickHouse, trajectories, credit, transitions); run more to scale."""
    from agentstream.streams.main import run_streams_worker

    config = _config(ctx)
    endpoints = Stack(config).endpoints()
    run_streams_worker(config, endpoints.bootstrap_servers, endpoints.clickhouse_url, loglevel)


@main.command()
@click.option("--quick", is_flag=True, default=None, help="The quick mode (same as DEMO_QUICK=1).")
@click.option("--seconds", type=float, default=None,
              help="Seconds of training (default: demo.seconds, 900), or of live traffic with --online "
              "(demo.online_seconds, 1020).")
@click.option("--online", is_flag=True, help="The production demo: a service, its users' late feedback, the gate, "
              "canaries and rollbacks, on the vLLM contract.")
@click.option("--agent", "agent_name", type=click.Choice(["arithmetic", "calculator"]), default="arithmetic",
              show_default=True, help="The example agent to train: 'Compute a+b.' in one LLM call, or the "
              "multi-step calculator agent ('Compute a*b+d.' with a tool), warm-started on demonstrations and "
              "trained at trajectory level.")
@click.pass_context
def demo(ctx: click.Context, quick: bool | None, seconds: float | None, online: bool, agent_name: str) -> None:
    """Train SmolLM2-135M-Instruct online on an example agent and show that it learned.

    Starts the stack, the dev model server, proxy, streams, trainer, hot swap and runners;
    measures held-out success before, during and after (greedy; the calculator agent at T=0.5,
    also after its warm start); writes demo-report.json, a plot and a report under demo-output/;
    stops everything it started. With --online: a service answering users, learning from their
    feedback behind the gate (online-report.json).
    """
    from dataclasses import replace

    from agentstream.demo import run_demo, run_online_demo
    from agentstream.session import ChildFailed

    config = _config(ctx)
    if online and agent_name != "arithmetic":
        raise click.UsageError("--online runs its own service agent; --agent is for the training demo")
    if online and seconds:
        config = replace(config, demo=replace(config.demo, online_seconds=seconds))
    elif quick is not None or seconds is not None:
        demo_config = replace(config.demo, quick=bool(quick) or config.demo.quick)
        if seconds:
            demo_config = replace(demo_config, seconds=seconds, quick_seconds=seconds)
        config = replace(config, demo=demo_config)
    signal.signal(signal.SIGTERM, _interrupt)  # stop like Ctrl-C: everything the demo started goes down
    try:
        if online:
            run_online_demo(config)
        else:
            run_demo(config, agent=agent_name)
    except ChildFailed as error:
        raise click.ClickException(str(error)) from None
    except KeyboardInterrupt:
        raise click.ClickException("interrupted; the processes the demo started were stopped") from None


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt


@main.command("train")
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
    from agentstream.pipeline.runner.tasks import TaskFileError
    from agentstream.session import ChildFailed
    from agentstream.train import TrainRequest, run_training

    try:
        function = load_agent(agent)
    except AgentLoadError as error:
        raise click.BadParameter(str(error), param_hint="--agent") from None
    config = _config(ctx)
    request = TrainRequest(agent=agent, tasks=task_file, agent_name=agent_name or function.__name__,
                           model=model_spec or config.trainer.model, server_url=server_url, runners=runners,
                           concurrency=concurrency, group_size=group_size, strategy=strategy, epochs=epochs,
                           max_steps=max_steps, val_tasks=val_file)
    try:
        run_training(config, request, progress=click.echo)
    except (ChildFailed, TaskFileError, ValueError) as error:
        raise click.ClickException(str(error)) from None


@main.command("kafka-acls")
@click.option("--bootstrap-server", default="<broker:9093>", show_default=True, help="The address the commands name.")
@click.option("--command-config", default=None, help="The admin client's properties file for kafka-acls.sh.")
@click.option("--user", "users", multiple=True, metavar="ROLE=NAME",
              help="The principal of a role (default: the role's name); repeat per role.")
@click.option("--runner-group", default="agentstream-runners", show_default=True, help="The runners' consumer group.")
@click.pass_context
def kafka_acls_command(ctx: click.Context, bootstrap_server: str, command_config: str | None, users: tuple[str, ...],
                       runner_group: str) -> None:
    """Print the kafka-acls.sh commands that grant each role (runner, proxy, collector, worker, trainer, hotswap)
    exactly the topics and groups it uses, under this configuration's topic prefix."""
    from agentstream.infra.acls import kafka_acls_commands

    named = dict(user.split("=", 1) for user in users if "=" in user)
    for line in kafka_acls_commands(_config(ctx), bootstrap_server, named, command_config, runner_group):
        click.echo(line)


@main.command("config")
@click.pass_context
def show_config(ctx: click.Context) -> None:
    """Print the effective configuration (secrets masked)."""
    click.echo(json.dumps(describe(_config(ctx)), indent=2, default=str))


@main.command("serve-model")
@click.option("--model", "model_spec", default="smollm2", show_default=True,
              help="'tiny', 'smollm2' (SmolLM2-135M-Instruct, offline) or a HF model folder.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--served-model-name", default=None, help="The model name clients use (default: the model's name).")
@click.option("--device", default=None,
              help="auto (CUDA when present), cpu, cuda or cuda:N (default: [server] device, auto).")
@click.option("--dtype", default=None, type=click.Choice(["auto", "float32", "bfloat16"]),
              help="Compute dtype; weights stay float32 (default: [server] dtype, auto = bfloat16 autocast on CUDA).")
@click.option("--threads", default=None, type=int, help="CPU threads torch may use, on the CPU (default: [server] "
              "threads, 2).")
@click.option("--max-tokens", default=None, type=click.IntRange(min=0),
              help="Most tokens a chat completion naming no max_tokens generates (default: [server] max_tokens; "
              "0: up to the context).")
@click.option("--contract", default=None, type=click.Choice(["dev", "vllm"]),
              help="dev: vLLM's API plus X-Policy-Version and /v1/load_weights; vllm: exactly vLLM's (no policy "
              "versions, LoRA updates only) (default: [server] contract, dev).")
@click.pass_context
def serve_model_command(ctx: click.Context, model_spec: str, host: str, port: int, served_model_name: str | None,
                        device: str | None, dtype: str | None, threads: int | None, max_tokens: int | None,
                        contract: str | None) -> None:
    """Serve a model with vLLM's OpenAI-compatible API (token ids, logprobs, LoRA and weight updates)."""
    try:
        from agentstream.models import ModelLoadError
        from agentstream.models.precision import PrecisionError
        from agentstream.serving.model_server_main import ModelServerOptions, run_model_server
    except ImportError as error:
        raise click.ClickException(f"serve-model needs {error.name}: pip install 'agentstream[train]'") from None

    options = ModelServerOptions(model_spec=model_spec, host=host, port=port, served_model_name=served_model_name,
                                 device=device, dtype=dtype, threads=threads, max_tokens=max_tokens,
                                 contract=contract)
    try:
        run_model_server(_config(ctx), options)
    except (ModelLoadError, PrecisionError) as error:
        raise click.ClickException(str(error)) from None


# ---------------------------------------------------------------- trainer and hot swap


@main.command("train-worker")
@click.option("--model", "model_spec", default=None, help="Model spec to train (overrides trainer.model).")
@click.option("--max-steps", default=None, type=int,
              help="Stop after this many optimizer steps (default: run until SIGTERM).")
@click.pass_context
def train_worker_command(ctx: click.Context, model_spec: str | None, max_steps: int | None) -> None:
    """Train one model from the transitions topic; checkpoints go to the store and the checkpoints topic.

    Under torchrun (`torchrun --nproc-per-node N -m agentstream train-worker`) it runs as N
    data-parallel ranks: rank 0 reads Kafka and writes checkpoints, the others follow it.
    """
    from dataclasses import replace

    from agentstream.deploy.rebase import RejectionStreak

    try:
        from agentstream.trainer.checkpoint_writer import CheckpointError
        from agentstream.trainer.distributed import Ranks
        from agentstream.trainer.policy import PolicyError
        from agentstream.trainer.worker_main import run_train_follower, run_train_worker
    except ImportError as error:
        raise click.ClickException(f"train-worker needs {error.name}: pip install 'agentstream[train]'") from None
    config = _config(ctx)
    if model_spec:
        config = replace(config, trainer=replace(config.trainer, model=model_spec))
    ranks = Ranks.from_env()  # set by torchrun: data-parallel ranks, rank 0 reads Kafka
    if ranks is not None and not ranks.leader:
        run_train_follower(config, ranks)
        return
    endpoints = Stack(config).endpoints()
    try:
        run_train_worker(config, endpoints.bootstrap_servers, endpoints.clickhouse_url, max_steps=max_steps,
                         rebase=RejectionStreak, ranks=ranks)
    except (CheckpointError, PolicyError) as error:
        raise click.ClickException(str(error)) from None


@main.command("sft")
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
    from pathlib import Path

    from agentstream.infra.clickhouse import ClickHouseError
    from agentstream.infra.config import ConfigError
    from agentstream.schemas.dataset import DatasetError

    try:
        from agentstream.trainer.checkpoint_writer import CheckpointError
        from agentstream.trainer.policy import PolicyError
        from agentstream.trainer.sft_main import NothingToTrain, run_supervised
        from agentstream.trainer.tracking import TrackerMissing
    except ImportError as error:
        raise click.ClickException(f"sft needs {error.name}: pip install 'agentstream[train]'") from None
    config = _config(ctx)
    try:
        config = replace(config, trainer=replace(
            config.trainer, model=model_spec or config.trainer.model,
            supervised_min_reward=config.trainer.supervised_min_reward if min_reward is None else min_reward))
    except ConfigError as error:
        raise click.BadParameter(str(error)) from None
    endpoints = Stack(config).endpoints()
    try:
        run_supervised(config, endpoints.bootstrap_servers, endpoints.clickhouse_url, Path(dataset), epochs=epochs,
                       progress=click.echo)
    except (CheckpointError, PolicyError, DatasetError, NothingToTrain, TrackerMissing, ClickHouseError) as error:
        raise click.ClickException(str(error)) from None


@main.command("hotswap")
@click.option("--server", "server_urls", required=True, multiple=True, callback=_server_urls,
              help="Base URL of the model server (serve-model or vLLM); repeat it for each server of a fleet.")
@click.option("--model", "model_name", required=True, help="The trained model whose checkpoints to load.")
@click.option("--no-verify", is_flag=True, help="Do not check the weights' sha256 before loading.")
@click.pass_context
def hotswap_command(ctx: click.Context, server_urls: tuple[str, ...], model_name: str, no_verify: bool) -> None:
    """Keep model servers holding the deployed versions of MODEL (without a gate: each new checkpoint, promoted).

    Each server is reconciled on its own: one that restarts gets the deployed versions back.
    """
    from agentstream.deploy.deployments import DeploymentError
    from agentstream.serving.hotswap_main import run_hotswap

    config = _config(ctx)
    endpoints = Stack(config).endpoints()
    try:
        run_hotswap(config, endpoints.bootstrap_servers, endpoints.clickhouse_url, server_urls, model_name,
                    verify=not no_verify)
    except DeploymentError as error:  # e.g. a gate runs for this model and deploy.gate is false here
        raise click.ClickException(str(error)) from None


# ---------------------------------------------------------------- deployments


@main.command("gate")
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
    from agentstream.deploy.deployments import DeploymentError
    from agentstream.deploy.gate_main import run_gate
    from agentstream.evaluation import task_evaluator
    from agentstream.pipeline.publisher import process_publisher

    config = _config(ctx)
    endpoints = Stack(config).endpoints()
    try:
        with process_publisher(config, endpoints.bootstrap_servers, "gate") as publisher:
            run_gate(config, endpoints.bootstrap_servers, endpoints.clickhouse_url, model_name, server_url,
                     evaluate=task_evaluator(config, proxy_url, model_name, publisher), proxy_url=proxy_url)
    except DeploymentError as error:
        raise click.ClickException(str(error)) from None


@main.command("deployments")
@click.option("--model", "model_name", default=None, help="Only this model.")
@click.option("--history", default=10, show_default=True, help="Recent decisions to list (0: none).")
@click.option("--server", "server_urls", multiple=True, callback=_server_urls,
              help="A model server to ask what it holds; repeat it for a fleet (default: [proxy] upstreams).")
@click.pass_context
def deployments_command(ctx: click.Context, model_name: str | None, history: int, server_urls: tuple[str, ...]) -> None:
    """What serves what, per trained model, what each model server holds, and the latest deployment decisions."""
    from agentstream.deploy.deployments import DeploymentError, read_routes
    from agentstream.deploy.manual import recent_decisions
    from agentstream.pipeline.proxy.upstreams import holdings_rows, survey

    config = _config(ctx)
    endpoints = Stack(config).endpoints()
    try:
        routes = asyncio.run(read_routes(config, endpoints.bootstrap_servers))
    except DeploymentError as error:
        raise click.ClickException(str(error)) from None
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


@main.command("promote")
@click.option("--model", "model_name", required=True, help="The trained model.")
@click.option("--version", type=click.IntRange(min=0), required=True, help="The version to serve (0: the base model).")
@click.pass_context
def promote_command(ctx: click.Context, model_name: str, version: int) -> None:
    """Serve VERSION of MODEL to all traffic now (ends its canary or candidacy); recorded as a manual decision."""
    from agentstream.deploy.deployments import DeploymentError
    from agentstream.deploy.manual import promote_by_hand

    config = _config(ctx)
    endpoints = Stack(config).endpoints()
    try:
        decision = promote_by_hand(config, endpoints.bootstrap_servers, endpoints.clickhouse_url, model_name, version)
    except DeploymentError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"{model_name}: serving {decision.routing.describe()}")


@main.command("rollback")
@click.option("--model", "model_name", required=True, help="The trained model.")
@click.pass_context
def rollback_command(ctx: click.Context, model_name: str) -> None:
    """End MODEL's canary, or (without one) serve the version that served before the stable one again."""
    from agentstream.deploy.deployments import DeploymentError
    from agentstream.deploy.manual import roll_back_by_hand

    config = _config(ctx)
    endpoints = Stack(config).endpoints()
    try:
        decision = roll_back_by_hand(config, endpoints.bootstrap_servers, endpoints.clickhouse_url, model_name)
    except DeploymentError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"{model_name}: serving {decision.routing.describe()}")


main.add_command(schema_registry_command)
