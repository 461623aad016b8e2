"""Tasks for dataset training: build Task records and put them on the `tasks` topic (a work queue)."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaProducer

from agentstream.infra.config import Config
from agentstream.infra.kafka import client_options, start_producer, topic_name
from agentstream.pipeline.sdk import new_id, now_us
from agentstream.schemas import TASK, AvroCodec
from agentstream.schemas.errors import AgentstreamError
from agentstream.schemas.records import TaskRecord


class TaskFileError(AgentstreamError, ValueError):
    """A task file line is not a JSON object."""


def make_task(payload: Mapping[str, Any], *, task_id: str | None = None, rollout_id: str | None = None,
              group_id: str | None = None, agent_name: str | None = None, max_attempts: int = 1,
              timeout_s: float = 300.0, metadata: Mapping[str, str] | None = None) -> TaskRecord:
    """A Task record: the agent receives ``payload``; rollouts sharing ``group_id`` are compared (GRPO)."""
    return {
        "task_id": task_id or new_id(),
        "rollout_id": rollout_id or new_id(),
        "group_id": group_id,
        "agent_name": agent_name,
        "input": json.dumps(dict(payload), separators=(",", ":")),
        "attempt": 1,
        "max_attempts": max_attempts,
        "timeout_s": float(timeout_s),
        "enqueued_at_us": now_us(),
        "metadata": dict(metadata or {}),
    }


def grouped_tasks(payloads: Iterable[Mapping[str, Any]], *, group_size: int = 1,
                  **options: Any) -> list[TaskRecord]:
    """``group_size`` rollouts per payload, sharing a task id and a group id, each with its own rollout id."""
    tasks: list[TaskRecord] = []
    for payload in payloads:
        task_id = str(payload.get("id", payload.get("task_id", new_id())))
        group_id = f"{task_id}-{new_id()[:8]}" if group_size > 1 else None
        tasks.extend(make_task(payload, task_id=task_id, group_id=group_id, **options) for _ in range(group_size))
    return tasks


def read_task_file(path: Path) -> list[dict[str, Any]]:
    """Task payloads from JSON lines (``.jsonl``, the default), a JSON list of objects (``.json``) or CSV (``.csv``).

    JSON lines skip blank lines and # comments. A ``.json`` file holds a list of objects (or an
    object whose only list value is that list, as dataset dumps often are). A CSV file's header
    row names the fields; every value is a string, as Agent Lightning's CSV datasets read them.
    """
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return _read_csv(path)
    if suffix == ".json":
        return _read_json(path)
    return _read_jsonl(path)


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # JSON lines under a .json name
            return _read_jsonl(path)
        raise TaskFileError(f"{path}:{error.lineno}: not JSON ({error.msg})") from None
    if isinstance(value, dict):
        lists = [item for item in value.values() if isinstance(item, list)]
        if len(lists) != 1:
            raise TaskFileError(f"{path}: expected a JSON list of task objects")
        value = lists[0]
    if not isinstance(value, list):
        raise TaskFileError(f"{path}: expected a JSON list of task objects, got {type(value).__name__}")
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise TaskFileError(f"{path}: item {index}: expected a JSON object, got {type(item).__name__}")
    return value


def _read_csv(path: Path) -> list[dict[str, Any]]:
    with open(path, newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle)
        if not reader.fieldnames:
            raise TaskFileError(f"{path}: a CSV task file needs a header row")
        payloads = []
        for row in reader:
            if None in row:
                raise TaskFileError(f"{path}:{reader.line_num}: more values than the header names")
            if any(value not in (None, "") for value in row.values()):
                payloads.append({key: value for key, value in row.items()})
        return payloads


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    payloads = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            raise TaskFileError(f"{path}:{number}: not JSON ({error.msg})") from None
        if not isinstance(value, dict):
            raise TaskFileError(f"{path}:{number}: expected a JSON object, got {type(value).__name__}")
        payloads.append(value)
    return payloads


async def enqueue(config: Config, bootstrap_servers: str, tasks: Iterable[TaskRecord],
                  codec: AvroCodec | None = None) -> int:
    """Publish Task records keyed by rollout id; returns how many were acknowledged."""
    producer = await start_producer(config.kafka, client_options(config.kafka, bootstrap_servers), linger_ms=5)
    try:
        return await _publish(producer, config, codec or AvroCodec(), tasks)
    finally:
        await producer.stop()


async def _publish(producer: AIOKafkaProducer, config: Config, codec: AvroCodec,
                   tasks: Iterable[TaskRecord]) -> int:
    topic = topic_name(config.topics, "tasks")
    count = 0
    for task in tasks:
        await producer.send(topic, key=task["rollout_id"].encode(), value=codec.encode(TASK, task))
        count += 1
    await producer.flush()
    return count


class PacedQueue:
    """Enqueues tasks in waves so that generation runs at most ``max_lag`` policy versions ahead of training.

    Wave k (from 0) goes out once the model server holds version v + k − ``max_lag``, where v is the
    version the queue first heard of: where its training starts, which after a warm start is not 0.
    With one optimizer step per wave, every rollout is then generated at most ``max_lag`` versions
    behind the version that trains on it, so the trainer's lag bound drops nothing and no CPU goes to
    rollouts too stale to use (AReaL's staleness control). Counting from version 0 instead let a demo
    whose warm start ended at v10 send 13 waves at once (docs/multistep.md, the word problems).

    A wave whose GRPO groups all had equal rewards carries no signal and makes no step: once the
    caller reports it (``settle``), one more wave goes out in its place, or generation would fall a
    wave further behind for each such wave. As a safety valve, if every enqueued task has finished
    and the version has not moved for ``stall_after()`` since then, one more wave goes out too, so the
    loop cannot stall; it stays counted, since that wave made no version. A slow trainer step is not a
    stall: the valve waits ``stall_s`` (by default the trainer's ``batch_wait_s``) or twice the longest
    a version has taken so far, whichever is longer. At a fixed 30 s, a machine whose steps took up to
    170 s got a wave every 30 s of each, and one step dropped 92 samples of them as stale (2 cores,
    docs/multistep.md). Before the first version the step's time is unknown, and a resumed trainer's
    first step is its slowest (142-168 s there, against a 120 s batch wait): the valve waits twice
    ``stall_s``.
    """

    def __init__(self, config: Config, bootstrap_servers: str, waves: Iterable[list[TaskRecord]],
                 max_lag: int, stall_s: float | None = None) -> None:
        self.config, self.bootstrap_servers = config, bootstrap_servers
        # the trainer closes a batch short of its wave only after its batch wait: no stall shows before that
        self.max_lag, self.stall_s = max_lag, config.trainer.batch_wait_s if stall_s is None else stall_s
        self._waves = iter(waves)
        self._codec = AvroCodec()
        self._producer: AIOKafkaProducer | None = None
        self._extra_waves = 0
        self._unsettled: list[set[str]] = []  # group ids of each wave not yet known to carry signal or not
        self._version, self._version_since = -1, 0.0
        self._moved_at, self._longest_version_s = 0.0, 0.0  # when the version last moved; the longest it took
        self._idle_since: float | None = None  # when every enqueued task had finished (None: some still run)
        self._first_version: int | None = None
        self.enqueued_waves = 0
        self.enqueued_tasks = 0

    async def start(self) -> PacedQueue:
        self._producer = await start_producer(self.config.kafka, client_options(self.config.kafka,
                                                                                 self.bootstrap_servers), linger_ms=5)
        return self

    async def close(self) -> None:
        if self._producer is not None:
            await self._producer.stop()

    def waves_due(self, policy_version: int, finished_tasks: int, now: float) -> int:
        """How many waves should have gone out by now, given the version the model server holds.

        Call it once per poll: it also keeps the stall clock (when the version last moved).
        """
        if self._first_version is None:
            self._first_version, self._moved_at = policy_version, now
        if finished_tasks < self.enqueued_tasks:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        if policy_version != self._version:
            if self._version >= 0:
                self._longest_version_s = max(self._longest_version_s, now - self._moved_at)
            self._version, self._version_since, self._moved_at = policy_version, now, now
        elif self._idle_since is not None and now - max(self._idle_since, self._version_since) >= self.stall_after():
            self._extra_waves += 1
            self._version_since = now
        return policy_version - self._first_version + self.max_lag + 1 + self._extra_waves

    def stall_after(self) -> float:
        """How long the version may stay put with every task finished before the valve lets one more wave out."""
        if self._longest_version_s == 0.0:  # no version has moved yet
            return 2 * self.stall_s
        return max(self.stall_s, 2 * self._longest_version_s)

    def unsettled_groups(self) -> set[str]:
        """The group ids of the waves ``settle`` has not yet accounted for."""
        return set().union(*self._unsettled)

    def settle(self, finished: Mapping[str, bool]) -> int:
        """Account for the waves whose groups have all finished; returns how many carried no signal.

        ``finished`` maps each finished group id to whether it was flat (every reward equal, so
        no advantage). Each wave of only flat groups lets one more wave out, as a version would.
        """
        flat = 0
        for groups in list(self._unsettled):
            if groups <= finished.keys():
                self._unsettled.remove(groups)
                flat += all(finished[group] for group in groups)
        self._extra_waves += flat
        return flat

    async def top_up(self, policy_version: int, finished_tasks: int, now: float) -> int:
        """Enqueue the waves ``policy_version`` allows; returns how many tasks went out."""
        assert self._producer is not None, "PacedQueue.start() first"
        sent, due = 0, self.waves_due(policy_version, finished_tasks, now)
        while self.enqueued_waves < due:
            wave = next(self._waves, None)
            if wave is None:
                break
            sent += await _publish(self._producer, self.config, self._codec, wave)
            self.enqueued_waves += 1
            if groups := {group for task in wave if (group := task.get("group_id"))}:
                self._unsettled.append(groups)
        self.enqueued_tasks += sent
        return sent
