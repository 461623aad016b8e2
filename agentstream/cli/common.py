"""What the command modules share: the command's configuration, the model-server URL check, and tables of rows.

Every command module reads its configuration from here, so none imports another.
"""

from __future__ import annotations

import json

import click

from agentstream.infra.config import Config, load_config, server_urls_problem
from agentstream.infra.registry_client.client import use_configured_registry


def command_config(ctx: click.Context) -> Config:
    """The configuration; with ``[schema_registry] url`` set, this process's records use that registry's ids."""
    config = load_config(ctx.obj)
    use_configured_registry(config)
    return config


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


def server_urls(ctx: click.Context, param: click.Parameter, urls: tuple[str, ...]) -> tuple[str, ...]:
    """A repeated model server option: http(s) URLs, none twice."""
    if problem := server_urls_problem(urls):
        raise click.BadParameter(problem)
    return urls
