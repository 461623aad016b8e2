"""The chaos soak's ledger: which span ids and rollout events each producer process had acknowledged.

The soak's producers, each writing the ledger file ``--ledger`` names: an unmodified ``agentstream`` command with
:class:`tests.support.span_ledger.LedgeredPublisher` installed in place of every SpanPublisher it creates, or a
direct load through one. The ledger's format, its writer and its reader are tests/support/span_ledger.py's.

Run as::

    python -m bench.chaos_ledger --ledger FILE -- run examples.arithmetic:solve --proxy URL   # any agentstream command
    python -m bench.chaos_ledger --ledger FILE publish --journal DIR --rollouts-per-s 10   # direct SpanPublisher load
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

from tests.support.span_ledger import LEDGER_ENV, LedgeredPublisher

DIRECT_MODEL = "chaos-direct"  # not the trained model: the trainer skips these transitions (their token ids are random)
DIRECT_AGENT = "chaos-direct"
LLM_SPANS_PER_ROLLOUT = 15


def install() -> None:
    """Make every SpanPublisher an ``agentstream`` command creates from now on a ledgered one."""
    import agentstream.pipeline.publisher
    import agentstream.pipeline.publisher.front

    # process_publisher (front) builds the processes' publishers; the package's name is patched for any other caller
    agentstream.pipeline.publisher.SpanPublisher = LedgeredPublisher  # type: ignore[misc]
    agentstream.pipeline.publisher.front.SpanPublisher = LedgeredPublisher  # type: ignore[misc]


def publish_direct(journal: Path, rollouts_per_s: float, seed: int) -> None:
    """Steady direct load: rollouts of 15 LLM spans, a reward and SUCCEEDED, until SIGTERM or SIGINT."""
    from agentstream.infra.config import load_config
    from agentstream.stack.control import Stack
    from bench.common import llm_span  # here, not at the top: a restarted runner's clock runs while this imports

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    config = load_config()
    rng = random.Random(seed * 1_000_003 + os.getpid())
    pool = [llm_span(rng, i) for i in range(64)]
    prefix = f"d{seed}-{os.getpid()}-{int(time.time())}"
    with LedgeredPublisher(config, Stack(config).endpoints().bootstrap_servers, journal_dir=journal) as publisher:
        print(f"direct publisher {os.getpid()}: {rollouts_per_s:g} rollouts/s of {LLM_SPANS_PER_ROLLOUT + 1} spans",
              flush=True)
        begin, sent = time.monotonic(), 0
        while not stop.is_set():
            pause = begin + sent / rollouts_per_s - time.monotonic()
            if pause > 0:
                stop.wait(pause)
                continue
            sent += 1
            rollout_id = f"{prefix}-{sent:07d}"
            attempt = f"{rollout_id}-1"
            now = time.time_ns() // 1000
            event = {"rollout_id": rollout_id, "attempt_id": attempt, "task_id": f"t{sent}", "agent_name": DIRECT_AGENT}
            publisher.publish_event({**event, "event": "STARTED", "at_us": now})
            for index in range(LLM_SPANS_PER_ROLLOUT):
                template = pool[(sent * 7 + index) % len(pool)]
                publisher.publish({**template, "span_id": f"{rollout_id}-{index}", "rollout_id": rollout_id,
                                   "attempt_id": attempt, "agent_name": DIRECT_AGENT, "model": DIRECT_MODEL,
                                   "policy_version": 0, "start_time_us": now + index, "end_time_us": now + index + 1})
            publisher.publish({"span_id": f"{rollout_id}-r", "rollout_id": rollout_id, "attempt_id": attempt,
                               "name": "reward", "kind": "REWARD", "start_time_us": now + 100, "end_time_us": now + 100,
                               "status": "OK", "agent_name": DIRECT_AGENT, "attributes": {}, "reward": 1.0})
            publisher.publish_event({**event, "event": "SUCCEEDED", "at_us": time.time_ns() // 1000})
        print(f"direct publisher {os.getpid()}: stopping after {sent} rollouts", flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ledger", type=Path, required=True)
    if "--" in argv:  # an agentstream command with the ledgered publisher
        split = argv.index("--")
        args = parser.parse_args(argv[:split])
        os.environ[LEDGER_ENV] = str(args.ledger)
        install()
        from agentstream.cli import main as agentstream

        agentstream(args=argv[split + 1:], prog_name="agentstream")
        return
    commands = parser.add_subparsers(dest="command", required=True)
    direct = commands.add_parser("publish", help="direct SpanPublisher load")
    direct.add_argument("--journal", type=Path, required=True)
    direct.add_argument("--rollouts-per-s", type=float, default=10.0)
    direct.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ[LEDGER_ENV] = str(args.ledger)
    publish_direct(args.journal, args.rollouts_per_s, args.seed)


if __name__ == "__main__":
    main()
