"""Typed configuration for every agentstream component: one TOML file plus environment variables.

Precedence, lowest first: built-in defaults, the TOML file (``agentstream.toml`` in the
working directory, or the path in ``AGENTSTREAM_CONFIG``), then environment variables.
Secrets are wrapped in :class:`Secret` so they never show up in a repr, a log line or a
status print.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, get_type_hints
from urllib.parse import unquote, urlsplit, urlunsplit

from agentstream.infra.config.checks import Checks, spelled
from agentstream.infra.config.errors import ConfigError, Secret

IDEMPOTENCE = ("auto", "on", "off")


@dataclass(frozen=True)
class KafkaConfig:
    """Where the Kafka cluster is and how to authenticate; None bootstrap means the embedded broker.

    ``fetch_max_wait_ms`` is how long the pipeline's consumers (runners, trainer, hot swap, gate,
    deployment followers) let the broker hold a fetch that finds nothing. tansu answers such a
    fetch only when the wait is over, even if records arrive meanwhile, so it is the latency of
    every hop: at aiokafka's 500 ms a task reached its runner and a transition its trainer up to
    half a second late, once per policy version. The stream processors have their own
    (``streams.fetch_max_wait_ms``).

    ``idempotence`` is how producers avoid writing a record twice when they retry a send whose
    acknowledgement was lost: ``on`` (every producer is idempotent; a broker without it is an error),
    ``off``, or ``auto`` (the default: on wherever the broker grants a producer id, which Apache Kafka,
    Redpanda and the managed services do; off, with one warning, on tansu 0.6, which does not).
    """

    bootstrap_servers: str | None = None
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: Secret | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    client_id: str = "agentstream"
    fetch_max_wait_ms: int = 50
    idempotence: str = "auto"

    def __post_init__(self) -> None:
        check = Checks("kafka", self)
        check.one_of("idempotence", IDEMPOTENCE)
        check.at_least("fetch_max_wait_ms", 1)

    @property
    def external(self) -> bool:
        return self.bootstrap_servers is not None


@dataclass(frozen=True)
class TopicsConfig:
    """Names and layout of the product topics (all share one prefix)."""

    prefix: str = "agentstream."
    partitions: int = 4
    replication_factor: int = 1
    retention_ms: int = 7 * 24 * 3600 * 1000


@dataclass(frozen=True)
class ClickHouseConfig:
    """Where ClickHouse is; None url means the embedded engine served over ClickHouse HTTP."""

    url: str | None = None
    database: str = "agentstream"
    username: str = "default"
    password: Secret | None = None
    verify_tls: bool = True

    @property
    def external(self) -> bool:
        return self.url is not None


BROKER_STORAGES = ("durable", "memory")
BROKERS = ("tansu", "kafka")


@dataclass(frozen=True)
class StackConfig:
    """The local stack `agentstream up` runs: loopback ports, the state folder, which broker and where it keeps data.

    ``broker`` is ``tansu`` (the default: one Rust process, starts in milliseconds) or ``kafka`` (Apache Kafka in
    KRaft mode on Java 17+, one node that is broker and controller; its jars from ``kafka_jars`` or the checkout's
    ``.kafka/`` that `make install` fills; its log dirs under ``<home>/kafka``, ``kafka_heap_mb`` of heap).
    ``broker_storage`` (tansu's; Kafka always logs to disk) is ``durable`` (the default: tansu stores every
    batch, watermark and group offset through a small S3-compatible object store over ``<home>/broker-data``,
    each write on disk before it is acknowledged, so a broker crash or ``down``/``up`` loses nothing) or
    ``memory`` (tansu's ``memory://``: faster, everything gone when the broker stops; for
    throwaway stacks). ``objectstore_port`` is where that object store listens; 0 picks a free
    loopback port at ``up`` (only the broker talks to it, and it finds it in the pidfile).
    """

    home: Path = Path(".agentstream")
    host: str = "127.0.0.1"
    broker_port: int = 9092
    clickhouse_port: int = 8123
    tansu_bin: str | None = None
    broker_storage: str = "durable"
    objectstore_port: int = 0
    broker: str = "tansu"
    kafka_jars: str | None = None
    kafka_heap_mb: int = 512

    def __post_init__(self) -> None:
        check = Checks("stack", self)
        check.one_of("broker", BROKERS)
        check.at_least("kafka_heap_mb", 128)
        check.one_of("broker_storage", BROKER_STORAGES)
        check.port("objectstore_port", zero="any free port")


@dataclass(frozen=True)
class StreamsConfig:
    """How stream processors batch, when rollouts count as complete, and how long online rollouts wait for rewards."""

    app_id: str = "agentstream-streams"
    batch_max_records: int = 10000
    batch_within_s: float = 0.05
    grace_s: float = 0.2
    idle_timeout_s: float = 30.0
    reward_expiry_s: float = 24 * 3600.0
    clickhouse_retry_max_s: float = 10.0
    session_timeout_s: float = 3.0  # tansu holds a join about half of it: a restarted worker is back in ~4 s
    fetch_max_wait_ms: int = 50  # tansu answers a fetch only after this wait when it had nothing at first
    ingest_interval_s: float = 1.0  # span batches read meanwhile are inserted together
    store_interval_s: float = 1.0  # rollouts and transitions rows are written to ClickHouse this often
    shutdown_grace_s: float = 10.0  # after SIGTERM/SIGINT the worker exits within this, broker or not


@dataclass(frozen=True)
class RunnerConfig:
    """The task runner (``agentstream run``): how long a stopping runner may take to finish its rollouts.

    After SIGTERM or SIGINT a runner stops taking tasks, lets the rollouts in flight finish and
    commits their offsets; when ``shutdown_grace_s`` passes first (a long rollout, a broker that is
    gone) it exits anyway, and the unfinished tasks, never committed, go to another runner.
    """

    shutdown_grace_s: float = 30.0

    def __post_init__(self) -> None:
        Checks("runner", self).above("shutdown_grace_s", 0)


@dataclass(frozen=True)
class CreditRule:
    """Which agents and models are trained, and how credit is assigned to their LLM calls (first match wins).

    ``agent`` and ``model`` are shell-style patterns. ``strategy`` is ``final`` (every call gets
    the final reward), ``discounted`` (intermediate rewards attach to the preceding call, returns
    discounted by ``gamma``) or ``grpo`` (advantages normalised within groups of ``group_size``
    rollouts of one task, waiting at most ``group_timeout_s`` for stragglers) or ``baseline`` (online
    traffic without groups: the final reward minus a running mean of the agent's). ``train_as``
    renames the trained model (the transitions topic key); ``train = false`` excludes.

    ``sample_rate`` (0 to 1, default 1) is the share of the matching rollouts trained on; every
    rollout is still captured and stored for analytics. The choice is a hash of the group id (else
    the rollout id), so it is the same on every worker and replay, and a GRPO group is kept or
    dropped whole. A rollout's own ``agentstream.train`` flag (SDK ``train=``, proxy header
    ``X-Agentstream-Train``) overrides it: false never trains, true trains whatever the rate.
    A GRPO group whose rewards are all equal carries no signal and is dropped; ``keep_flat_groups``
    publishes it as zero-advantage transitions instead, so a trainer that counts experience rather
    than signal (``trainer.batch_counts_skipped``) sees every group.

    ``level`` is what one training sample holds: ``transition`` (one LLM call) or ``trajectory``
    (successive calls of a rollout merged while each call's prompt token ids start with the
    previous call's prompt + response ids; the tokens in between, tool results and template glue,
    are masked out of the loss; where that prefix breaks, the sample splits and the break is
    counted in the rollouts row). A trajectory-level sample carries the credit of its first call.
    """

    agent: str = "*"
    model: str = "*"
    strategy: str = "final"
    gamma: float = 1.0
    group_size: int = 8
    group_timeout_s: float = 60.0
    train: bool = True
    train_as: str | None = None
    sample_rate: float = 1.0
    keep_flat_groups: bool = False
    level: str = "transition"


STRATEGIES = ("final", "discounted", "grpo", "baseline")
LEVELS = ("transition", "trajectory")


@dataclass(frozen=True)
class TrainerConfig:
    """What the trainer learns (model, LoRA, device), how it batches and steps, and where checkpoints go.

    ``model`` is a model spec (``tiny``, ``smollm2`` or a HF folder); ``model_name`` is the trained
    model's name, i.e. the transitions topic key and the checkpoint key (default: the loaded
    model's name, which is also the dev server's default served name). ``temperature`` must be
    the sampling temperature the behaviour logprobs were computed at. Batches close at
    ``batch_tokens`` padded tokens, ``batch_transitions`` transitions or ``batch_wait_s`` seconds,
    whichever comes first (0 disables a limit); with ``batch_counts_skipped`` the transitions skipped
    for zero advantage count toward ``batch_transitions`` (a step per amount of experience, not per
    amount of signal). A step's samples are cut into ``accumulation_steps`` equal micro-batches
    whose gradients add up; with ``micro_batch_tokens`` > 0 each is cut further so that it holds at
    most that many padded tokens (samples × the longest of them; a longer sample goes alone), which
    bounds the activations a step keeps however long its trajectories are (0: no such cut).
    ``checkpoint_dir`` is a folder, a ``file://`` URI or ``s3://bucket/prefix`` (see ``[checkpoints]``;
    default: ``checkpoints`` under the stack home). The optimizer state (AdamW's moments: twice
    the weights, 1 GB for SmolLM2, 2 s to write on a CPU) goes with every ``optimizer_state_every``-th
    checkpoint (0: none); a trainer resumed from a checkpoint without it starts the moments afresh
    and says so. ``threads`` is torch's CPU thread count (0: torch's
    default); ``importance_cap`` is the truncation c of the importance ratio (see ``trainer/loss.py``).
    ``dtype`` is the compute dtype (``auto``: bfloat16 autocast on CUDA, float32 elsewhere);
    weights and optimizer state stay ``weights_dtype``, float32 unless pure bfloat16 is asked for
    (which loses updates below bfloat16's resolution, and warns). See ``models/precision.py``.
    ``checkpoint_dtype`` is the dtype of full weights in checkpoints (``auto``: ``weights_dtype``).
    ``bfloat16`` over float32 weights halves what the trainer writes and hashes and what hot swap
    hashes and the server loads per version, and a server computing in bfloat16 serves the same
    Linear weights either way; a trainer resumed from such a checkpoint starts from weights rounded
    to bfloat16 (it says so). LoRA adapters are written as trained. ``attention`` is the trained
    model's attention kernel: ``auto`` is ``eager`` on the CPU, where torch's fused attention
    spent 0.9 s of a 5.3 s SmolLM2 step in its backward on RL-length sequences (a 37-token
    prompt, 24-token answers), and ``sdpa`` elsewhere; eager keeps every attention matrix for the
    backward, so set ``sdpa`` to train long sequences on a CPU. The model server keeps ``sdpa``,
    which generated a wave faster there (3.7 s against 4.7 s).
    With ``rebase_after_rejections`` N > 0, after the promotion gate refused N of this model's
    candidates in a row (rejected or rolled back), the trainer goes back to the version serving
    users and trains on from it (``deploy/rebase.py``); 0 never does.
    ``loss_normalization`` is how a step's token losses are averaged: ``token`` (every trained token
    of the step weighs the same, so long samples weigh more), ``transition`` (each sample's mean,
    then the mean over samples) or ``rollout`` (each rollout's token mean, then the mean over
    rollouts: a rollout of many calls or long tool loops counts as much as a short one).
    Under ``torchrun`` (``WORLD_SIZE`` set) the trainer runs as data-parallel ranks
    (``trainer/distributed.py``): ``distributed_backend`` is ``gloo``, ``nccl`` or ``auto`` (NCCL
    where the trainer's device is CUDA, gloo elsewhere); a collective that waits longer than
    ``distributed_timeout_s`` fails and the rank exits (rank 0 keeps idle ranks waiting well
    within it).
    ``objective`` is what a step optimises: ``policy_gradient`` (the loss in ``trainer/loss.py``,
    from advantages) or ``supervised`` (rejection-sampling fine-tuning: only samples whose rollout
    reward is at least ``supervised_min_reward`` are trained, by the negative log-likelihood of
    their trained tokens, advantages ignored; the others are counted, see ``trainer/batching.py``).
    """

    model: str = "smollm2"
    model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    weights_dtype: str = "float32"
    checkpoint_dtype: str = "auto"
    attention: str = "auto"
    threads: int = 2
    seed: int = 0
    lr: float = 1e-5
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.0
    clip_eps: float = 0.2
    importance_cap: float = 2.0
    grad_clip: float = 1.0
    accumulation_steps: int = 1
    temperature: float = 1.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    reference_model: str | None = None
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj"
    batch_tokens: int = 16384
    micro_batch_tokens: int = 0
    batch_transitions: int = 64
    batch_wait_s: float = 5.0
    max_policy_lag: int = 4
    skip_zero_advantage: bool = True
    batch_counts_skipped: bool = False
    dedupe_window: int = 100_000
    checkpoint_dir: str = ""
    checkpoint_every_steps: int = 1
    optimizer_state_every: int = 1
    keep_checkpoints: int = 0
    rebase_after_rejections: int = 0
    loss_normalization: str = "token"
    session_timeout_s: float = 4.0  # tansu holds a join about half of it (see infra/members.py)
    shutdown_grace_s: float = 30.0  # time to write a last checkpoint after SIGTERM; then it exits regardless
    distributed_backend: str = "auto"
    distributed_timeout_s: float = 600.0
    objective: str = "policy_gradient"
    supervised_min_reward: float = 1.0

    def __post_init__(self) -> None:
        check = Checks("trainer", self)
        check.device("device")
        check.one_of("dtype", ("auto", "float32", "bfloat16"))
        check.one_of("weights_dtype", ("float32", "bfloat16"))
        check.one_of("checkpoint_dtype", ("auto", "float32", "bfloat16"))
        check.one_of("attention", ("auto", "eager", "sdpa"))
        check.above("lr", 0)
        check.within("clip_eps", "(0, 1)")
        check.above("importance_cap", 1)
        check.above("temperature", 0)
        check.at_least("accumulation_steps", 1)
        check.at_least("batch_transitions", 0)
        check.at_least("batch_tokens", 0)
        check.that(max(self.batch_transitions, self.batch_tokens) > 0,
                   "batch_transitions and batch_tokens are both 0: one of them must be > 0")
        check.at_least("micro_batch_tokens", 0)
        check.at_least("max_policy_lag", 0)
        check.at_least("checkpoint_every_steps", 1)
        check.at_least("optimizer_state_every", 0)
        check.at_least("lora_r", 1)
        check.at_least("rebase_after_rejections", 0)
        check.one_of("loss_normalization", ("token", "transition", "rollout"))
        check.one_of("distributed_backend", ("auto", "gloo", "nccl"))
        check.above("distributed_timeout_s", 0)
        check.one_of("objective", ("policy_gradient", "supervised"))
        check.finite("supervised_min_reward")


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


@dataclass(frozen=True)
class ServerConfig:
    """The dev model server (``agentstream serve-model``): where it runs, at what precision, under which contract.

    ``device`` and ``dtype`` follow the trainer's rule (``auto``: CUDA with bfloat16 autocast
    over float32 weights when present, else float32 on the CPU), so on one machine the server's
    behaviour logprobs and the trainer's recomputed ones agree. ``threads`` applies on the CPU only.
    ``contract`` is ``dev`` (vLLM's API plus ``X-Policy-Version`` and ``/v1/load_weights``) or
    ``vllm`` (exactly what vLLM >= 0.10.2 answers: no policy versions, LoRA updates only).
    """

    device: str = "auto"
    dtype: str = "auto"
    threads: int = 2
    contract: str = "dev"
    max_tokens: int = 1024  # a chat request that names no max_tokens generates at most this many (0: up to the context)

    def __post_init__(self) -> None:
        check = Checks("server", self)
        check.at_least("max_tokens", 0, " (0: no default limit)")
        check.device("device")
        check.one_of("dtype", ("auto", "float32", "bfloat16"))
        check.at_least("threads", 0)
        check.one_of("contract", ("dev", "vllm"))


def server_urls_problem(urls: Sequence[str]) -> str | None:
    """What is wrong with a list of model server URLs (one not http:// or https://, one named twice), or None."""
    if wrong := [url for url in urls if not url.startswith(("http://", "https://"))]:
        return f"not an http:// or https:// URL: {', '.join(wrong)}"
    bases = [url.rstrip("/").removesuffix("/v1") for url in urls]
    if twice := sorted({base for base in bases if bases.count(base) > 1}):
        return f"a model server named twice: {', '.join(twice)}"
    return None


@dataclass(frozen=True)
class ProxyConfig:
    """The LLM proxy: ``max_tokens`` is added to a generation request that names none (0: leave it to the server).

    ``upstreams``: the model servers it forwards to when ``agentstream proxy`` names none with
    ``--upstream`` (``AGENTSTREAM_PROXY_UPSTREAMS``, comma-separated). Each is asked ``/health`` and
    ``/v1/models`` every ``health_interval_s`` (each call bounded by ``health_timeout_s``);
    ``eject_after`` failures in a row take one out until a health check passes.
    """

    max_tokens: int = 1024
    upstreams: tuple[str, ...] = ()
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    eject_after: int = 3

    def __post_init__(self) -> None:
        check = Checks("proxy", self)
        check.at_least("max_tokens", 0, " (0: no default limit)")
        problem = server_urls_problem(self.upstreams)
        check.that(problem is None, f"upstreams: {problem}")
        check.above("health_interval_s", 0)
        check.above("health_timeout_s", 0)
        check.at_least("eject_after", 1)


@dataclass(frozen=True)
class AglConfig:
    """What Agent Lightning agents are handed (``agentstream run``/``train`` on an ``@rollout``/``LitAgent`` agent).

    The LLM resource ``llm_resource`` (Agent Lightning's ``main_llm``) points at the rollout's
    proxy URL with ``model`` (default: the trained model, ``trainer.model_name`` or the served
    name of ``trainer.model``) and sampling parameters ``temperature`` (and ``top_p`` when it
    is not 1). ``prompt_template`` (with ``prompt_engine``) becomes the ``prompt_template``
    resource. ``env_map`` feeds an Agent Lightning 1.0 agent's task fields to its environment
    (``QUESTION=input.question,ANSWER=input.answer``; default: each top-level field, upper-cased).
    """

    model: str | None = None
    llm_resource: str = "main_llm"
    temperature: float = 1.0
    top_p: float = 1.0
    prompt_template: str | None = None
    prompt_engine: str = "f-string"
    env_map: str = ""

    def __post_init__(self) -> None:
        check = Checks("agl", self)
        check.one_of("prompt_engine", ("f-string", "jinja", "poml"))
        check.at_least("temperature", 0)
        check.within("top_p", "(0, 1]")


@dataclass(frozen=True)
class DeployConfig:
    """How checkpoints reach live traffic: straight away, or through the gate (evaluation, canary, promotion).

    Without the gate (``gate = false``) hot swap promotes every checkpoint to all traffic once
    the server holds it. With it, each checkpoint is a candidate: ``eval_agent`` (module:function,
    called with a task and a rollout, returning the reward; it must call the model the task's
    ``model`` names) runs over ``eval_tasks`` (a JSONL task file; its first ``eval_limit`` tasks,
    0 = all) pinned to the candidate and, afresh, to the stable version. The candidate goes on
    only when the data show it no worse than the stable version by more than ``tolerance``: the
    lower ``confidence`` bound of the mean paired difference over the tasks (Student t) is above
    ``-tolerance``; a task that fails after three tries fails the evaluation (rejected, "evaluation
    failed"), it never scores 0. On 32 tasks with 0/1 rewards that takes a near-identical candidate
    at the default tolerance. A candidate that passes serves ``canary_share`` of live rollouts; an
    always-valid sequential bound on the difference of live mean rewards (a normal mixture with
    scale ``tolerance``, looked at every poll) promotes it once it shows "no worse than
    ``tolerance``" (not before ``canary_min_s``) and rolls it back once it shows "worse", each
    wrong with probability at most 1 - ``confidence``, and never on fewer than
    ``canary_min_rollouts`` rewarded canary rollouts. A canary still undecided at ``canary_max_s``
    is rolled back, never promoted. At the defaults (stable reward 0.8 with 0/1 rewards) a canary
    as good as the stable version needs a median of about 525 rewarded canary rollouts (p90
    1,160; 5,300 and 11,500 in all at a 10% share) to be promoted: docs/gate.md, ``python -m
    bench.gate``. The gate needs LoRA checkpoints (``trainer.lora``): full weights replace the only
    copy a server holds. A gate and a hot swap with ``gate = false`` refuse to run for one model.

    Every ``reconcile_s`` seconds (0: never) hot swap asks the server what it really holds and
    restores what the deployments say it should (a restarted server, an adapter unloaded or
    replaced behind its back).
    """

    gate: bool = False
    eval_agent: str = ""
    eval_tasks: str = ""
    eval_limit: int = 0
    eval_concurrency: int = 8
    tolerance: float = 0.05
    canary_share: float = 0.1
    canary_min_s: float = 120.0
    canary_max_s: float = 900.0
    canary_min_rollouts: int = 20
    confidence: float = 0.95
    load_timeout_s: float = 300.0
    reconcile_s: float = 10.0

    def __post_init__(self) -> None:
        check = Checks("deploy", self)
        check.above("tolerance", 0, " (the margin of non-inferiority)")
        check.within("canary_share", "(0, 1]")
        check.at_least("canary_min_s", 0)
        check.at_least("canary_max_s", self.canary_min_s, " (canary_min_s)")
        check.at_least("canary_min_rollouts", 2)
        check.within("confidence", "(0.5, 1)")
        check.at_least("eval_limit", 0)
        check.at_least("eval_concurrency", 1)
        check.at_least("reconcile_s", 0, " (0: never re-check the server)")


@dataclass(frozen=True)
class DemoConfig:
    """The training demo (``make demo``) and ``make bench-learning``: how long, how often to evaluate, how wide.

    ``seconds`` bounds the training phase (``quick_seconds`` when ``quick``, i.e. ``DEMO_QUICK=1``);
    held-out greedy accuracy is measured before, every ``eval_every_s`` and after. ``concurrency``
    rollouts run at once (``prompts_per_wave`` GRPO groups of ``group_size``). ``target`` is the
    held-out accuracy bench-learning times (``time_to_85pct_s``); ``stop_at_target`` ends a run there.
    The trainer steps once per wave (its flat groups counted) and drops transitions more than
    ``max_policy_lag`` versions old; waves are paced so that generation runs at most that many
    versions ahead (0: generate, then train, then generate, as a plain loop does). ``heldout_tasks``
    of the 400 arithmetic tasks are held out (``agentstream.examples.arithmetic.split``). ``dtype`` is the
    compute dtype of the demo's server and trainer: ``auto`` is bfloat16 autocast where the device
    multiplies bfloat16 natively (CUDA, or a CPU with AMX), which trains SmolLM2 about twice as fast
    there, and float32 elsewhere. ``warm_start_demonstrations`` is how many correct conversations
    the calculator demo (``agentstream demo --agent calculator``) sends through the pipeline as its
    warm start, the supervised steps before RL.

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
    warm_start_demonstrations: int = 128
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

    def __post_init__(self) -> None:
        check = Checks("demo", self)
        check.above("seconds", 0)
        check.above("quick_seconds", 0)
        check.above("eval_every_s", 0)
        check.at_least("group_size", 2)
        check.at_least("max_policy_lag", 0)
        check.must("heldout_tasks", 0 < self.heldout_tasks < 400,
                   "be between 1 and 399 (the arithmetic task set has 400)")
        check.at_least("warm_start_demonstrations", 1)
        check.one_of("dtype", ("auto", "float32", "bfloat16"))
        check.above("online_tolerance", 0)
        check.within("online_confidence", "(0.5, 1)")
        check.at_least("online_model_servers", 1)


SCHEMA_REGISTRY_IDS = ("fingerprint", "sequential")
COMPATIBILITY_LEVELS = ("BACKWARD", "BACKWARD_TRANSITIVE", "FORWARD", "FORWARD_TRANSITIVE", "FULL",
                        "FULL_TRANSITIVE", "NONE")


@dataclass(frozen=True)
class SchemaRegistryConfig:
    """The Confluent Schema Registry API: the stack's own, or the user's registry at ``url``.

    Without ``url``, ``agentstream up`` serves one on ``host:port`` (the stack's host), kept in
    the compacted topic ``topic`` (default ``<topics.prefix>_schemas``), whose ids are the
    content-addressed ids agentstream's records carry (``ids = "fingerprint"``; ``sequential``
    numbers them 1, 2, 3 like Confluent). With ``url`` (a registry serving the Confluent REST
    API; tested only against the stack's own server), agentstream registers its schemas there,
    one subject per record full name, checks ``compatibility`` against the latest version
    before using a new one, and writes that registry's ids; ``username``/``password`` are HTTP
    basic auth (an API key and secret).
    """

    url: str | None = None
    username: str | None = None
    password: Secret | None = None
    port: int = 8081
    topic: str | None = None
    ids: str = "fingerprint"
    compatibility: str = "BACKWARD"
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        check = Checks("schema_registry", self)
        check.http_url("url")
        check.port("port")
        check.one_of("ids", SCHEMA_REGISTRY_IDS)
        check.must("compatibility", self.compatibility.upper() in COMPATIBILITY_LEVELS,
                   f"be {spelled(COMPATIBILITY_LEVELS)}")
        check.above("timeout_s", 0)

    @property
    def external(self) -> bool:
        return self.url is not None

    def topic_name(self, prefix: str) -> str:
        """The registry's topic: ``topic`` when set, else ``<prefix>_schemas``."""
        return self.topic or f"{prefix}_schemas"


@dataclass(frozen=True)
class OtlpConfig:
    """The OTLP receiver (``agentstream collector``): where it listens and how traces end.

    ``port`` 4318 is OTLP/HTTP's registered port, so exporters find it with just
    ``OTEL_EXPORTER_OTLP_ENDPOINT=http://<host>:4318``; ``grpc_port`` 4317 is OTLP/gRPC's (0 turns
    the gRPC receiver off), on the same ``host``. With ``complete_on_root`` a trace that is its
    own rollout completes when its root span arrives (the root ends last); otherwise, and for
    rollouts named by an ``agentstream.rollout_id`` attribute, after ``streams.idle_timeout_s`` of
    silence. Bodies (requests, once decompressed) over ``max_body_mb`` are refused with 413
    (gRPC: RESOURCE_EXHAUSTED).
    """

    host: str = "127.0.0.1"
    port: int = 4318
    grpc_port: int = 4317
    complete_on_root: bool = True
    max_body_mb: int = 32

    def __post_init__(self) -> None:
        check = Checks("otlp", self)
        check.port("port")
        check.port("grpc_port", zero="no gRPC receiver")
        check.that(self.grpc_port != self.port,
                   f"grpc_port and otlp.port are both {self.port}: OTLP/gRPC and OTLP/HTTP need a port each")
        check.at_least("max_body_mb", 1)


MLFLOW_SCHEMES = ("file", "http", "https", "databricks", "sqlite", "postgresql", "mysql", "mssql")
"""The tracking URI schemes MLflow's client takes (a bare path is a file store; the SQL ones need full ``mlflow``)."""
WANDB_MODES = ("", "offline", "online")


_URI_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^/\s@]*@")


def masked_uris(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` in it shown as ``***``.

    For printing a URI (a database URI for MLflow holds its password) or an error that quotes one.
    """
    return _URI_PASSWORD.sub(r"\1***@", text)


def uri_scheme(uri: str) -> str:
    """The scheme of a URI, lowercased (``file:./mlruns`` -> ``file``); empty for a bare path."""
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):", uri)
    return match.group(1).lower() if match else ""


@dataclass(frozen=True)
class TrackingConfig:
    """Where the trainer logs its runs for experiment trackers: MLflow, Weights & Biases, both or neither (the default).

    ``mlflow_uri`` is an MLflow tracking URI (``file:./mlruns`` or a folder for a local file store,
    ``http://host:5000`` for a tracking server; empty: off), its runs in ``mlflow_experiment``.
    ``wandb_mode`` is ``offline`` (a run directory under ``wandb_dir``, uploaded later with
    ``wandb sync``) or ``online`` (empty: off), in ``wandb_project``. Every call to a tracker is made
    on a thread of its own behind a queue of ``queue_size`` items: a tracker that is down or slow
    never stops or slows training (its failures and the items dropped are counted and logged). An
    HTTP request to MLflow gives up after ``timeout_s`` (and one retry); when the trainer stops, it
    waits at most ``finish_timeout_s`` for the queue to drain. See docs/tracking.md.
    """

    mlflow_uri: str = ""
    mlflow_experiment: str = "agentstream"
    wandb_mode: str = ""
    wandb_project: str = "agentstream"
    wandb_dir: str = ""
    queue_size: int = 1000
    timeout_s: float = 10.0
    finish_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        check = Checks("tracking", self)
        uri = self.mlflow_uri
        check.that(uri == uri.strip(), f"mlflow_uri {uri!r} has spaces around it (a blank one would turn tracking "
                                       f"on into a folder of that name); leave it empty for off")
        typo = re.match(r"(https?)/", uri, re.IGNORECASE)  # a folder path to MLflow: runs in ./http/host:port
        check.that(not typo, f"mlflow_uri {uri!r} lacks the colon of {typo.group(1).lower() if typo else ''}://")
        scheme = uri_scheme(uri)
        check.that(scheme.split("+", 1)[0] in ("", *MLFLOW_SCHEMES),  # postgresql+psycopg2: the driver follows a +
                   f"mlflow_uri: MLflow cannot take the scheme {scheme!r} of {uri!r}; use a folder, file:, "
                   f"http(s)://, databricks or a database URI")
        check.that(not uri or bool(self.mlflow_experiment), "mlflow_experiment must name an experiment")
        check.must("wandb_mode", self.wandb_mode in WANDB_MODES, "be offline, online or empty (off)")
        check.that(not self.wandb_mode or bool(self.wandb_project), "wandb_project must name a project")
        check.at_least("queue_size", 1)
        check.above("timeout_s", 0)
        check.at_least("finish_timeout_s", 0)

    @property
    def enabled(self) -> bool:
        return bool(self.mlflow_uri or self.wandb_mode)


@dataclass(frozen=True)
class SecurityConfig:
    """Who may call what: API keys for the servers that face users, feedback tokens, and where servers may bind.

    Every ``*_keys`` value is a comma-separated list of keys (``Secret``: never printed). Unset means
    that server takes any caller, which :func:`agentstream.infra.security.check_bind` allows only on loopback.
    ``proxy_keys``: the LLM proxy's OpenAI routes and Agent Lightning event API
    (``Authorization: Bearer <key>``, what the openai SDK sends as ``api_key``). ``collector_keys``:
    the OTLP receiver (``OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20<key>``).
    ``registry_keys``: writes to the stack's Schema Registry (Bearer, or HTTP basic auth with the key
    as password, what ``basic.auth.user.info`` sends); reads stay open. ``dashboard_keys``: the
    dashboard. ``admin_token``: the model server's weight-loading routes, which only hot swap calls.
    ``clickhouse_readers``: ``user:password`` pairs the embedded ClickHouse front serves read-only
    (its writer is ``[clickhouse] username``/``password``).

    ``feedback_tokens`` (on by default) makes ``POST /rollouts/{id}/reward`` take only a token made
    for that rollout (HMAC-SHA256 of the rollout id under ``feedback_secret``), which the proxy hands
    the service on every LLM response (``X-Agentstream-Feedback-Token``) for it to put in the feedback
    URL it gives its user, so a guessed rollout id cannot be rewarded. Without ``feedback_secret`` the
    stack keeps a random one in ``<home>/feedback.secret``; proxies on several hosts need the same one
    configured. ``allow_open_bind`` lets a server without keys listen beyond loopback (not advised).
    """

    proxy_keys: Secret | None = None
    collector_keys: Secret | None = None
    registry_keys: Secret | None = None
    dashboard_keys: Secret | None = None
    admin_token: Secret | None = None
    clickhouse_readers: Secret | None = None
    feedback_tokens: bool = True
    feedback_secret: Secret | None = None
    allow_open_bind: bool = False


@dataclass(frozen=True)
class Config:
    """The whole configuration; build it with :func:`load_config`."""

    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    topics: TopicsConfig = field(default_factory=TopicsConfig)
    clickhouse: ClickHouseConfig = field(default_factory=ClickHouseConfig)
    stack: StackConfig = field(default_factory=StackConfig)
    streams: StreamsConfig = field(default_factory=StreamsConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    credit: tuple[CreditRule, ...] = (CreditRule(),)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoints: CheckpointsConfig = field(default_factory=CheckpointsConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    agl: AglConfig = field(default_factory=AglConfig)
    deploy: DeployConfig = field(default_factory=DeployConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    schema_registry: SchemaRegistryConfig = field(default_factory=SchemaRegistryConfig)
    otlp: OtlpConfig = field(default_factory=OtlpConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


CONFIG_FILE_VARIABLE = "AGENTSTREAM_CONFIG"
"""The environment variable that names the TOML file (the one variable besides :data:`ENVIRONMENT`'s)."""

# Environment variable -> (section, field). The one place environment names are defined.
ENVIRONMENT: dict[str, tuple[str, str]] = {
    "KAFKA_BOOTSTRAP_SERVERS": ("kafka", "bootstrap_servers"),
    "KAFKA_SECURITY_PROTOCOL": ("kafka", "security_protocol"),
    "KAFKA_SASL_MECHANISM": ("kafka", "sasl_mechanism"),
    "KAFKA_SASL_USERNAME": ("kafka", "sasl_username"),
    "KAFKA_SASL_PASSWORD": ("kafka", "sasl_password"),
    "KAFKA_SSL_CAFILE": ("kafka", "ssl_cafile"),
    "KAFKA_SSL_CERTFILE": ("kafka", "ssl_certfile"),
    "KAFKA_SSL_KEYFILE": ("kafka", "ssl_keyfile"),
    "KAFKA_IDEMPOTENCE": ("kafka", "idempotence"),
    "AGENTSTREAM_TOPIC_PREFIX": ("topics", "prefix"),
    "AGENTSTREAM_TOPIC_PARTITIONS": ("topics", "partitions"),
    "AGENTSTREAM_TOPIC_RETENTION_MS": ("topics", "retention_ms"),
    "AGENTSTREAM_TOPIC_REPLICATION_FACTOR": ("topics", "replication_factor"),
    "CLICKHOUSE_URL": ("clickhouse", "url"),
    "CLICKHOUSE_DATABASE": ("clickhouse", "database"),
    "CLICKHOUSE_USER": ("clickhouse", "username"),
    "CLICKHOUSE_PASSWORD": ("clickhouse", "password"),
    "AGENTSTREAM_HOME": ("stack", "home"),
    "AGENTSTREAM_HOST": ("stack", "host"),
    "AGENTSTREAM_BROKER_PORT": ("stack", "broker_port"),
    "AGENTSTREAM_CLICKHOUSE_PORT": ("stack", "clickhouse_port"),
    "TANSU_BIN": ("stack", "tansu_bin"),
    "AGENTSTREAM_BROKER_STORAGE": ("stack", "broker_storage"),
    "AGENTSTREAM_OBJECTSTORE_PORT": ("stack", "objectstore_port"),
    "AGENTSTREAM_BROKER": ("stack", "broker"),
    "AGENTSTREAM_KAFKA_JARS": ("stack", "kafka_jars"),
    "SCHEMA_REGISTRY_URL": ("schema_registry", "url"),
    "SCHEMA_REGISTRY_USERNAME": ("schema_registry", "username"),
    "SCHEMA_REGISTRY_PASSWORD": ("schema_registry", "password"),
    "AGENTSTREAM_SCHEMA_REGISTRY_PORT": ("schema_registry", "port"),
    "AGENTSTREAM_OTLP_HOST": ("otlp", "host"),
    "AGENTSTREAM_OTLP_PORT": ("otlp", "port"),
    "AGENTSTREAM_OTLP_GRPC_PORT": ("otlp", "grpc_port"),
    "AGENTSTREAM_PROXY_KEYS": ("security", "proxy_keys"),
    "AGENTSTREAM_PROXY_UPSTREAMS": ("proxy", "upstreams"),
    "AGENTSTREAM_COLLECTOR_KEYS": ("security", "collector_keys"),
    "AGENTSTREAM_REGISTRY_KEYS": ("security", "registry_keys"),
    "AGENTSTREAM_DASHBOARD_KEYS": ("security", "dashboard_keys"),
    "AGENTSTREAM_ADMIN_TOKEN": ("security", "admin_token"),
    "AGENTSTREAM_CLICKHOUSE_READERS": ("security", "clickhouse_readers"),
    "AGENTSTREAM_FEEDBACK_SECRET": ("security", "feedback_secret"),
    "AGENTSTREAM_ALLOW_OPEN_BIND": ("security", "allow_open_bind"),
    "AWS_ENDPOINT_URL_S3": ("checkpoints", "s3_endpoint"),
    "AGENTSTREAM_CHECKPOINT_CACHE": ("checkpoints", "cache_dir"),
    "DEMO_QUICK": ("demo", "quick"),
    "DEMO_SECONDS": ("demo", "seconds"),
    "AGENTSTREAM_MLFLOW_URI": ("tracking", "mlflow_uri"),
    "AGENTSTREAM_MLFLOW_EXPERIMENT": ("tracking", "mlflow_experiment"),
    "AGENTSTREAM_WANDB_MODE": ("tracking", "wandb_mode"),
    "AGENTSTREAM_WANDB_PROJECT": ("tracking", "wandb_project"),
    "AGENTSTREAM_WANDB_DIR": ("tracking", "wandb_dir"),
}

SECTIONS: dict[str, type] = {
    "kafka": KafkaConfig,
    "topics": TopicsConfig,
    "clickhouse": ClickHouseConfig,
    "stack": StackConfig,
    "streams": StreamsConfig,
    "runner": RunnerConfig,
    "trainer": TrainerConfig,
    "checkpoints": CheckpointsConfig,
    "server": ServerConfig,
    "proxy": ProxyConfig,
    "agl": AglConfig,
    "deploy": DeployConfig,
    "demo": DemoConfig,
    "schema_registry": SchemaRegistryConfig,
    "otlp": OtlpConfig,
    "security": SecurityConfig,
    "tracking": TrackingConfig,
}
RULE_LISTS: dict[str, type] = {"credit": CreditRule}


def load_config(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Read defaults, then the TOML file, then the environment, into a validated :class:`Config`."""
    environ = os.environ if environ is None else environ
    raw: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    rules: dict[str, Any] = {}
    config_path = Path(path) if path else _default_config_path(environ)
    if config_path is not None:
        document = _read_toml(config_path)
        rules = {name: document.pop(name) for name in RULE_LISTS if name in document}
        raw = _merge(raw, document)
    for variable, (section, key) in ENVIRONMENT.items():
        value = environ.get(variable)
        if value not in (None, ""):
            raw[section][key] = value
    rule_lists: dict[str, Any] = {name: _build_rules(name, value) for name, value in rules.items()}
    config = Config(**{name: _build_section(name, raw[name]) for name in SECTIONS}, **rule_lists)
    return _normalise(config)


def _default_config_path(environ: Mapping[str, str]) -> Path | None:
    if environ.get(CONFIG_FILE_VARIABLE):
        return Path(environ[CONFIG_FILE_VARIABLE])
    local = Path("agentstream.toml")
    return local if local.is_file() else None


def _read_toml(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
    unknown = set(data) - set(SECTIONS) - set(RULE_LISTS)
    if unknown:
        raise ConfigError(f"config file {path}: unknown section(s) {sorted(unknown)}; known: {sorted(SECTIONS)}")
    return data


def _merge(base: dict[str, dict[str, Any]], extra: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: {**base.get(name, {}), **extra.get(name, {})} for name in base}


def _build_rules(name: str, values: Any) -> tuple[Any, ...]:
    if not isinstance(values, list):
        raise ConfigError(f"[[{name}]] must be an array of tables, one per rule")
    return tuple(_build_section(f"{name}[{index}]", rule, RULE_LISTS[name]) for index, rule in enumerate(values))


def _build_section(name: str, values: dict[str, Any], cls: type | None = None) -> Any:
    cls = cls or SECTIONS[name]
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"[{name}]: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    return cls(**{key: _coerce(f"{name}.{key}", hints[key], value) for key, value in values.items()})


def _coerce(where: str, hint: Any, value: Any) -> Any:
    text = str(hint)
    try:
        if "Secret" in text:
            return value if isinstance(value, Secret) else Secret(str(value))
        if hint is bool:
            return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes", "on")
        if hint is int:
            return int(value)
        if hint is float:
            return float(value)
        if hint is Path:
            return Path(value)
        if text == "tuple[str, ...]":  # a TOML array, or a comma-separated environment value
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(str(item).strip() for item in items if str(item).strip())
        return value if value is None else str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: cannot use {value!r} (expected {text})") from None


def _normalise(config: Config) -> Config:
    """Move credentials embedded in CLICKHOUSE_URL into their own fields and validate ranges."""
    ch = config.clickhouse
    if ch.url:
        parts = urlsplit(ch.url if "://" in ch.url else f"http://{ch.url}")
        if parts.scheme not in ("http", "https"):
            raise ConfigError(f"clickhouse.url must be http:// or https://, got scheme {parts.scheme!r}")
        updates: dict[str, Any] = {}
        if parts.username:
            updates["username"] = unquote(parts.username)
        if parts.password:
            updates["password"] = Secret(unquote(parts.password))
        netloc = parts.hostname or "localhost"
        if parts.port:
            netloc = f"{netloc}:{parts.port}"
        updates["url"] = urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
        config = replace(config, clickhouse=replace(ch, **updates))
    stack = Checks("stack", config.stack)
    stack.port("broker_port")
    stack.port("clickhouse_port")
    Checks("topics", config.topics).at_least("partitions", 1)
    for index, rule in enumerate(config.credit):
        credit = Checks(f"credit[{index}]", rule)
        credit.one_of("strategy", STRATEGIES)
        credit.must("group_size", rule.strategy != "grpo" or rule.group_size >= 2, "be >= 2 for grpo")
        credit.within("gamma", "[0, 1]")
        credit.within("sample_rate", "[0, 1]")
        credit.one_of("level", LEVELS)
    return config


def describe(config: Config) -> dict[str, Any]:
    """A printable view of the configuration with every secret masked."""
    view: dict[str, Any] = {
        name: {key: ("***" if isinstance(value, Secret) else masked_uris(value) if isinstance(value, str) else value)
               for key, value in dataclasses.asdict(getattr(config, name)).items()}
        for name in SECTIONS
    }
    view.update({name: [dataclasses.asdict(rule) for rule in getattr(config, name)] for name in RULE_LISTS})
    return view


def dump_toml(config: Config) -> str:
    """The configuration as a TOML file that :func:`load_config` reads back to the same values.

    Used to hand one effective configuration (with secrets, so write it privately) to the child
    processes of a session; unset optional values are left out.
    """

    def literal(value: Any) -> str:
        if isinstance(value, Secret):
            value = value.reveal()
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (int, float)):
            return repr(value)
        if isinstance(value, tuple):
            return "[" + ", ".join(literal(item) for item in value) + "]"
        return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'

    def table(header: str, section: Any) -> list[str]:
        return [header, *(f"{f.name} = {literal(getattr(section, f.name))}" for f in fields(section)
                          if getattr(section, f.name) is not None), ""]

    lines: list[str] = []
    for name in SECTIONS:
        lines += table(f"[{name}]", getattr(config, name))
    for name in RULE_LISTS:
        for rule in getattr(config, name):
            lines += table(f"[[{name}]]", rule)
    return "\n".join(lines)
