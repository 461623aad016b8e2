"""Pipeline processes: ``proxy``, ``collector``, ``run``, ``enqueue``, ``streams``, ``serve-model`` and ``hotswap``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from agentstream.cli.common import command_config as _config
from agentstream.cli.common import server_urls
from agentstream.cli.errors import requires_extra
from agentstream.infra.config import AglConfig, Config
from agentstream.stack.control import Stack


@click.command("proxy")
@click.option("--upstream", "upstreams", multiple=True, callback=server_urls,
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


@click.command("collector")
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


@click.command("run")
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


@click.command("enqueue")
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


@click.command("streams")
@click.option("--loglevel", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]))
@click.pass_context
def streams_command(ctx: click.Context, loglevel: str) -> None:
    """Run a stream-processing worker (spans -> ClickHouse, trajectories, credit, transitions); run more to scale."""
    from agentstream.streams.main import run_streams_worker

    config = _config(ctx)
    endpoints = Stack(config).endpoints()
    run_streams_worker(config, endpoints.bootstrap_servers, endpoints.clickhouse_url, loglevel)


@click.command("serve-model")
@click.option("--model", "model_spec", default="smollm2", show_default=True,
              help="'tiny', 'smollm2' (SmolLM2-135M-Instruct, offline) or a HF model folder.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--served-model-name", "served_model_names", multiple=True,
              help="A name clients use for the base model (default: the model's name). Repeat it to serve several "
              "trained models of one base, each with its own adapters (as vLLM's --served-model-name A B).")
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
def serve_model_command(ctx: click.Context, model_spec: str, host: str, port: int, served_model_names: tuple[str, ...],
                        device: str | None, dtype: str | None, threads: int | None, max_tokens: int | None,
                        contract: str | None) -> None:
    """Serve a model with vLLM's OpenAI-compatible API (token ids, logprobs, LoRA and weight updates)."""
    with requires_extra("train", "serve-model"):
        from agentstream.serving.model_server_main import ModelServerOptions, run_model_server

    options = ModelServerOptions(model_spec=model_spec, host=host, port=port, served_model_names=served_model_names,
                                 device=device, dtype=dtype, threads=threads, max_tokens=max_tokens,
                                 contract=contract)
    run_model_server(_config(ctx), options)


@click.command("hotswap")
@click.option("--server", "server_urls", required=True, multiple=True, callback=server_urls,
              help="Base URL of the model server (serve-model or vLLM); repeat it for each server of a fleet.")
@click.option("--model", "model_name", required=True, help="The trained model whose checkpoints to load.")
@click.option("--no-verify", is_flag=True, help="Do not check the weights' sha256 before loading.")
@click.pass_context
def hotswap_command(ctx: click.Context, server_urls: tuple[str, ...], model_name: str, no_verify: bool) -> None:
    """Keep model servers holding the deployed versions of MODEL (without a gate: each new checkpoint, promoted).

    Each server is reconciled on its own: one that restarts gets the deployed versions back.
    """
    from agentstream.serving.hotswap_main import run_hotswap

    config = _config(ctx)
    endpoints = Stack(config).endpoints()
    run_hotswap(config, endpoints.bootstrap_servers, endpoints.clickhouse_url, server_urls, model_name,
                verify=not no_verify)


COMMANDS = [proxy_command, collector_command, run_command, enqueue_command, streams_command, serve_model_command,
            hotswap_command]
