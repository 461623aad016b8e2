"""The batcher: clients that resubmit at once merge into one batch when it lingers."""

from __future__ import annotations

import threading
import time

import pytest

from agentstream.serving.generation import SamplingParams


@pytest.mark.parametrize("linger_s", [0.0, 1.0])
def test_clients_that_resubmit_at_once_merge_into_one_batch_when_the_batcher_lingers(tiny, linger_s):
    """Runners send a rollout's request right after its last one finished; a late cohort joins the early one."""
    from agentstream.serving.batcher import Batcher, Job
    from agentstream.serving.protocol import Output

    batcher = Batcher(tiny, set(), 0, lambda adapter: 0, linger_s=linger_s)
    output = Output(return_token_ids=True, logprobs=False, stream=False, include_usage=False)

    def client(rounds: int) -> None:
        for _ in range(rounds):
            job = Job("tiny", None, [5, 6, 7], SamplingParams(max_tokens=64, temperature=1.0), output)
            batcher.submit(job).result(timeout=60)
            time.sleep(0.02)  # the runner records the rollout and takes the next task

    try:
        with batcher.model_lock:  # the early client's first batch is taken, then waits: the late ones queue
            early = threading.Thread(target=client, args=(5,))
            early.start()
            time.sleep(0.2)
            late = [threading.Thread(target=client, args=(4,)) for _ in range(3)]
            for thread in late:
                thread.start()
            time.sleep(0.1)
        for thread in [early, *late]:
            thread.join(timeout=120)
    finally:
        batcher.close()
    if linger_s:
        assert batcher.batch_sizes[4] >= 3, batcher.batch_sizes  # merged after one round, and stayed merged
    else:
        assert batcher.batch_sizes[4] == 0 and batcher.batch_sizes[1] == 5, batcher.batch_sizes  # they alternate
