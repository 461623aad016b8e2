"""The [checkpoints] section: how an s3:// checkpoint store is reached, and the local cache readers load from."""

from __future__ import annotations

from dataclasses import dataclass

from agentstream.infra.config.checks import Checks
from agentstream.infra.config.errors import Secret

CHECKPOINT_BUCKET = "agentstream"
"""The bucket the stack's embedded object store serves for checkpoints (``s3://agentstream/...``)."""
OBJECTSTORE_SERVICE = "objectstore"
"""The name the stack records its embedded object store under (``<home>/run/objectstore.json``)."""


@dataclass(frozen=True)
class CheckpointsConfig:
    """How an ``s3://`` checkpoint store is reached, and the local cache its readers load from.

    ``trainer.checkpoint_dir`` names the store the trainer writes; readers (hot swap, a resuming
    trainer) follow the ``uri`` each Checkpoint event carries. For ``s3://bucket/prefix`` URIs
    ``s3_endpoint`` is the S3 API to call (MinIO ``http://host:9000``, AWS
    ``https://s3.<region>.amazonaws.com``, GCS ``https://storage.googleapis.com`` with HMAC keys);
    left empty, the local stack's embedded object store is used when the stack runs, and nothing
    else is guessed. ``s3_region`` defaults to the AWS environment's (``AWS_REGION``), else
    ``us-east-1``. ``s3_access_key_id``/``s3_secret_access_key`` left empty fall back to the AWS
    chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, profiles, instance roles). Files of
    ``s3_multipart_mb`` or more go up in parts of that size (0: one PUT each, for stores without
    multipart uploads; S3 takes at most 5 GiB in one PUT, the embedded store 1 GiB).

    A reader downloads each version once into ``cache_dir`` (default ``<home>/checkpoint-cache``),
    checks every file's sha256, and hands the model server that local folder. The cache keeps at
    most ``cache_max_versions`` versions and ``cache_max_gb`` gigabytes (0: no bound), evicting
    the least recently used whole versions, never the one being loaded.
    """

    s3_endpoint: str | None = None
    s3_region: str | None = None
    s3_access_key_id: str | None = None
    s3_secret_access_key: Secret | None = None
    s3_multipart_mb: int = 64
    cache_dir: str = ""
    cache_max_gb: float = 20.0
    cache_max_versions: int = 4

    def __post_init__(self) -> None:
        check = Checks("checkpoints", self)
        check.http_url("s3_endpoint")
        check.must("s3_multipart_mb", self.s3_multipart_mb == 0 or self.s3_multipart_mb >= 5,
                   "be 0 (one PUT) or >= 5 (S3's smallest part)")
        check.at_least("cache_max_gb", 0)
        check.at_least("cache_max_versions", 0)
