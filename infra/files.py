"""Local files named by URI, and their sha256: shared by the checkpoint stores and the weights loader."""

from __future__ import annotations

import hashlib
from pathlib import Path
from urllib.parse import unquote, urlsplit

CHUNK = 1 << 20


def local_path(uri: str) -> Path:
    """The local path of a ``file://`` URI or a plain path."""
    parts = urlsplit(uri)
    return Path(unquote(parts.path)) if parts.scheme == "file" else Path(uri)


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()
