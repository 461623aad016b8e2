"""The generation thread: requests that wait together are generated together, because RL traffic arrives in bursts.

One thread runs one batch at a time, taking every queued request on the same adapter (prompts
left-padded, each request sampled with its own parameters and RNG). Rollouts of a GRPO group
and evaluation sweeps arrive together, so this is what makes a CPU server usable for RL.
Weight updates take ``model_lock`` too: ``load_weights`` waits for the batch in progress to
finish on the old weights, batches after it run on the new ones, and a job's ``version`` is
the one its batch ran with.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass

from agentstream.models import LoadedModel
from agentstream.serving.generation import BatchRequest, Delta, SamplingParams, SequenceState, generate_batch
from agentstream.serving.lora import LoraAdapter, MergedWeights, applied
from agentstream.serving.protocol import Output

log = logging.getLogger("agentstream.model_server")


@dataclass
class Job:
    """One generation request, resolved: which adapter, which prompt, how to sample, what to return."""

    model_name: str
    adapter: LoraAdapter | None
    prompt_ids: list[int]
    params: SamplingParams
    output: Output
    version: int | None = None  # the policy version its batch ran with, set when the batch starts


@dataclass
class _Queued:
    job: Job
    emit: Callable[[list[Delta]], None]
    cancelled: Callable[[], bool]
    future: Future[list[SequenceState]]


class Batcher:
    """Runs the queued requests on one adapter as one batch, one batch at a time, on its own thread.

    ``model_lock`` is held for a whole batch; weight updates take it too, so a batch never sees
    half-assigned weights. After the first request of an idle spell arrives the thread waits
    ``window_s`` for the rest of its burst (the other rollouts of a group arrive milliseconds apart).
    While fewer rows wait than the last batch ran, it waits up to ``linger_s`` more: the clients of
    the batch that just finished send their next request at once (a runner's next rollout, an
    agent's next turn), and without the wait they would run as a second, smaller batch beside the
    requests that queued meanwhile, two half batches alternating for good at half the throughput.
    ``version_of`` names the policy version a batch on an adapter (None: the base model) runs with.
    """

    def __init__(self, loaded: LoadedModel, eos_ids: Collection[int], pad_id: int,
                 version_of: Callable[[LoraAdapter | None], int], max_sequences: int = 64,
                 window_s: float = 0.01, linger_s: float = 0.25) -> None:
        self.loaded = loaded
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.version_of = version_of
        self.max_sequences = max_sequences
        self.window_s = window_s
        self.linger_s = linger_s
        self._last_rows = 0
        self.model_lock = threading.Lock()
        self._queue: deque[_Queued] = deque()
        self._wakeup = threading.Condition()
        self._closed = False
        self.batch_sizes: Counter[int] = Counter()  # requests per batch -> batches run
        self.merged = MergedWeights()  # touched by the generation thread only
        self._thread = threading.Thread(target=self._run, name="generation", daemon=True)
        self._thread.start()

    def submit(self, job: Job, emit: Callable[[list[Delta]], None] = lambda deltas: None,
               cancelled: Callable[[], bool] = lambda: False) -> Future[list[SequenceState]]:
        """Queue a job; the future resolves to its sequences (or the generation's exception)."""
        queued = _Queued(job, emit, cancelled, Future())
        with self._wakeup:
            if self._closed:
                raise RuntimeError("the model server is shutting down")
            self._queue.append(queued)
            self._wakeup.notify()
        return queued.future

    def close(self) -> None:
        """Stop taking batches; the one running finishes, queued requests fail."""
        with self._wakeup:
            self._closed = True
            self._wakeup.notify()
        self._thread.join()
        for queued in self._queue:
            queued.future.set_exception(RuntimeError("the model server shut down"))

    def _next_batch(self) -> list[_Queued]:
        with self._wakeup:
            while not self._queue and not self._closed:
                self._wakeup.wait()
            deadline = time.monotonic() + self.linger_s
            while (not self._closed and sum(q.job.params.n for q in self._queue) < self._last_rows
                   and (left := deadline - time.monotonic()) > 0):
                self._wakeup.wait(left)
            if self._closed:
                return []
        time.sleep(self.window_s)
        with self._wakeup:
            adapter = self._queue[0].job.adapter
            batch: list[_Queued] = []
            rest: deque[_Queued] = deque()
            rows = 0
            for queued in self._queue:
                fits = not batch or rows + queued.job.params.n <= self.max_sequences
                if queued.job.adapter is adapter and fits:
                    batch.append(queued)
                    rows += queued.job.params.n
                else:
                    rest.append(queued)
            self._queue = rest
        return batch

    def _run(self) -> None:
        while batch := self._next_batch():
            with self.model_lock:
                for queued in batch:
                    queued.job.version = self.version_of(queued.job.adapter)
                self.batch_sizes[len(batch)] += 1
                self._last_rows = sum(queued.job.params.n for queued in batch)
                requests = [BatchRequest(q.job.prompt_ids, q.job.params, q.emit, q.cancelled) for q in batch]
                try:
                    with applied(batch[0].job.adapter, self.loaded.model, self.merged):
                        results = generate_batch(self.loaded.model, self.loaded.tokenizer, requests, self.eos_ids,
                                                 self.pad_id, autocast=self.loaded.autocast)
                except Exception as error:
                    log.exception("generation failed for a batch of %d requests", len(batch))
                    for queued in batch:
                        queued.future.set_exception(error)
                    continue
            for queued, sequences in zip(batch, results, strict=True):
                queued.future.set_result(sequences)
