"""A demo's warm start: demonstrations sent through the pipeline before RL, and kept for later runs.

An agent with a warm start (the calculator, the word problems) first sends correct conversations as
rollouts of its demonstrations agent, and RL starts once they are trained and served
(:func:`warm_start`). The demo then saves it under ``<output_dir>/warm-start``: the checkpoint the server held when
the demonstrations were trained, and a record of what made it (the agent, its framework, how many
demonstrations, the compute dtype, the held-out tasks) and what it scored. ``agentstream demo
--warm-start-from FOLDER`` starts RL, or the control, from that checkpoint instead of sending the
demonstrations again: a paired comparison, and the warm start's minutes saved on every run after the first.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from agentstream.demo.agents import DemoAgent
from agentstream.demo.demonstrations import publish_demonstrations
from agentstream.demo.results import Evaluation
from agentstream.infra.checkpoint_store import CheckpointStore, FolderStore
from agentstream.infra.config import Config
from agentstream.models import model_display_name, smollm2_tokenizer
from agentstream.schemas.errors import AgentstreamError
from agentstream.session import TrainingSession
from agentstream.trainer.checkpoint_writer import Manifest, copy_checkpoint, find_version
from agentstream.trainer.policy import forget_momentum

FOLDER = "warm-start"
"""The folder under the demo's ``output_dir`` that a run saves its warm start in."""
RECORD = "warm-start.json"
TOOLS_WAIT_S = 60.0  # for the first evaluation's spans to reach ClickHouse: seconds at most, minutes never
SAVED_LOAD_S = 300.0  # for the trainer to resume from a saved warm start and the server to load it


class WarmStartMismatch(AgentstreamError, ValueError):
    """A saved warm start that this demo cannot start from: missing, or made for another agent or setting."""


class WarmStartNotServed(AgentstreamError, TimeoutError):
    """The server did not load the saved warm start the trainer started from."""


class WarmStartNotSaved(AgentstreamError, OSError):
    """The warm start could not be copied out (a full disk, most often); nothing of the copy is left behind."""


@dataclass(frozen=True)
class WarmStartSettings:
    """What a warm start depends on: a run starts from a saved one only where these are the same."""

    agent: str
    framework: str
    demonstrations: int
    dtype: str  # the compute dtype its weights were trained and written in
    heldout_tasks: int  # the held-out set its evaluations (the base model's included) were measured on


@dataclass(frozen=True)
class WarmStartRecord:
    """What made a saved warm start and what it scored; written last, so a folder with one is complete."""

    settings: WarmStartSettings
    version: int  # the policy version the server held after the demonstrations
    seconds: float  # how long the warm start took on the machine that made it
    before: Evaluation  # held-out success of the base model
    after: Evaluation  # held-out success of the warm start
    machine: dict  # stack.machine.Calibration of the run that made it


@dataclass(frozen=True)
class WarmStartPlan:
    """A demo's warm start: sent as demonstrations and then saved in ``save_to``, or started from ``saved``."""

    settings: WarmStartSettings
    machine: dict  # the run's calibration, kept in the record it saves
    save_to: Path
    saved: WarmStartRecord | None = None

    def save(self, checkpoints: CheckpointStore, version: int, seconds: float, before: Evaluation,
             after: Evaluation) -> Path:
        """Save the warm start that ended at ``version`` (see :func:`save_warm_start`)."""
        return save_warm_start(self.save_to, checkpoints,
                               WarmStartRecord(self.settings, version, round(seconds, 1), before, after, self.machine))


@dataclass(frozen=True)
class WarmStartProgress:
    """How far the demonstrations are, read from ClickHouse and the server while the warm start runs."""

    demonstrations: int  # sent
    stored: int  # their rollouts in ClickHouse
    samples: int  # their transitions
    trained: int  # transitions the trainer's steps took
    stepped_to: int  # the version the trainer's last step made
    announced: int  # the newest checkpoint announced
    held: int  # the version the server holds

    @property
    def done(self) -> bool:
        """Every demonstration trained, and the server holding the version of the step that trained the last.

        The step's row reaches ``train_steps`` before its checkpoint is announced: counting samples alone took
        a server still on the version before that step as done (v7 of 8 versions, 26 demonstrations short).
        """
        return (self.stored >= self.demonstrations and self.samples > 0 and self.trained >= self.samples
                and self.announced >= self.stepped_to and self.held >= self.stepped_to)


def save_warm_start(folder: Path, checkpoints: CheckpointStore, record: WarmStartRecord) -> Path:
    """Copy the checkpoint of ``record.version`` from a run's (folder) store into ``folder``, with the record.

    AdamW's moments go with the weights where the run wrote them: a run from the copy then steps as the run that
    made it would have (started afresh, the first step moves every weight by the learning rate).

    A warm start saved earlier in ``folder`` is replaced; the record is written last, so a folder with one is
    complete. Returns ``folder``. Raises :class:`WarmStartNotSaved`, with ``folder`` removed, where the copy fails.
    """
    manifest = find_version(checkpoints, record.version)  # before the earlier one goes
    shutil.rmtree(folder, ignore_errors=True)
    try:
        copy_checkpoint(manifest, checkpoints, FolderStore(folder))
        (folder / RECORD).write_text(json.dumps(asdict(record), indent=2) + "\n")
    except OSError as error:
        shutil.rmtree(folder, ignore_errors=True)
        free = shutil.disk_usage(folder.parent).free if folder.parent.exists() else 0
        raise WarmStartNotSaved(f"the warm start was not saved in {folder}: {error.strerror or error} "
                                f"({free / 1e9:.1f} GB free there)") from error
    return folder


def load_warm_start(folder: Path, settings: WarmStartSettings) -> WarmStartRecord:
    """The record of the warm start saved in ``folder``, if a run with ``settings`` can start from it."""
    path = folder / RECORD
    try:
        fields = json.loads(path.read_text())
        record = WarmStartRecord(**{**fields, "settings": WarmStartSettings(**fields["settings"]),
                                    "before": Evaluation(**fields["before"]), "after": Evaluation(**fields["after"])})
    except FileNotFoundError:
        raise WarmStartMismatch(f"{folder} holds no saved warm start ({RECORD} is missing): a demo with a warm "
                                f"start saves one under its output folder, <output_dir>/{FOLDER}") from None
    except (ValueError, TypeError, KeyError) as error:
        raise WarmStartMismatch(f"cannot read {path}: {error}") from None
    differences = [f"{name} {saved!r} (this run: {wanted!r})"
                   for name, saved, wanted in zip(asdict(settings), astuple(record.settings), astuple(settings),
                                                 strict=True)
                   if saved != wanted]
    if differences:
        raise WarmStartMismatch(f"the warm start in {folder} was made for another setting: "
                                f"{'; '.join(differences)}")
    return record


def install_warm_start(folder: Path, record: WarmStartRecord, checkpoints: CheckpointStore,
                       momentum: bool = True) -> Manifest:
    """Copy the saved checkpoint into a new run's (empty) store, where its trainer resumes from it and announces it.

    Without ``momentum``, the copy's AdamW first moment is zeroed (:func:`forget_momentum`): the run's gains are
    then its own gradient's, not the warm start's direction playing out.
    """
    saved = FolderStore(folder)
    copied = copy_checkpoint(find_version(saved, record.version), saved, checkpoints)
    if not momentum:
        forget_momentum(checkpoints.get(copied.uri))
    return copied


def _scalar(client, sql: str) -> Any:
    return client.query(sql).result_rows[0][0]


async def tools_sent(agent: DemoAgent, client, console: Console, wait_s: float = TOOLS_WAIT_S) -> list[dict]:
    """The tool definitions the agent's framework sent in its first held-out evaluation, read from its LLM spans.

    Demonstrations are rendered with them, so the warm start trains on the prompt the agent will send:
    each framework writes the calculator's JSON schema its own way, and the schema is part of the prompt.
    Falls back to the plain agent's ``CALCULATOR`` if no captured call has arrived in ``wait_s``.
    """
    sql = (f"SELECT attributes['gen_ai.tool.definitions'] FROM spans WHERE agent_name = '{agent.eval_name}' "
           "AND kind = 'LLM' AND mapContains(attributes, 'gen_ai.tool.definitions') LIMIT 1")
    deadline = time.monotonic() + wait_s
    while not (rows := client.query(sql).result_rows) and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
    if rows:
        return list(json.loads(rows[0][0]))
    console.print(f"[yellow]no captured call of {agent.eval_name!r} named its tools in {wait_s:.0f} s; "
                  "demonstrations use the plain agent's calculator tool[/yellow]")
    return [agent.module.CALCULATOR]


async def warm_start(agent: DemoAgent, train: list[dict], config: Config, session: TrainingSession, client,
                     console: Console, served_version: Callable[[], int], model: str | None = None,
                     ) -> tuple[float, int | None]:
    """Send the agent's demonstrations through the pipeline and wait until the server holds weights trained on them.

    Returns the seconds it took and the version the server then holds (None: unfinished). It runs
    until every demonstration is trained and served (a budget in steps, not in seconds, so a slower
    machine still starts RL from the same warm start), or for at most ``warm_start_limit_s``.
    Demonstrations are the first ``warm_start_demonstrations`` (else the agent's ``demonstrations``)
    of the train tasks the agent demonstrates (``agent.module.demonstration_tasks``), their correct
    conversations (``agent.module.demonstration``), recorded as rollouts of the demonstrations agent:
    stored, queryable, credited and trained from the stream like any other.
    With ``model`` (one trained model of several), they call that model and only its trainer counts.
    """
    started = time.monotonic()
    count = config.demo.warm_start_demonstrations or agent.demonstrations
    tokenizer = await asyncio.to_thread(smollm2_tokenizer)  # the ids the server renders; its weights are not needed
    tools = await tools_sent(agent, client, console)
    calls = publish_demonstrations(agent.module.demonstration_tasks(train)[:count], agent.module.demonstration,
                                   tools, tokenizer,
                                   model=model or model_display_name("smollm2"), agent_name=agent.demonstrations_name)
    console.print(f"warm start: {count} demonstrations ({calls} LLM calls) published as rollouts of "
                  f"{agent.demonstrations_name!r}; waiting for the trainer and the server")
    name = agent.demonstrations_name
    of_model = f" WHERE model = '{model}'" if model else ""
    while True:
        session.check()
        progress = WarmStartProgress(
            demonstrations=count,
            stored=_scalar(client, f"SELECT count() FROM rollouts FINAL WHERE agent_name = '{name}'"),
            samples=_scalar(client, f"SELECT count() FROM transitions FINAL WHERE agent_name = '{name}'"),
            trained=_scalar(client, f"SELECT sum(transitions) FROM train_steps FINAL{of_model}"),
            stepped_to=_scalar(client, f"SELECT max(policy_version) + 1 FROM train_steps FINAL{of_model}"),
            announced=_scalar(client, f"SELECT max(version) FROM checkpoints FINAL{of_model}"),
            held=await asyncio.to_thread(served_version))
        if progress.done:
            console.print(f"warm start done in {time.monotonic() - started:.0f} s: {progress.samples} samples "
                          f"trained, the server holds v{progress.held}")
            return time.monotonic() - started, progress.held
        if time.monotonic() - started > config.demo.warm_start_limit_s:
            console.print(f"[yellow]warm start unfinished after {time.monotonic() - started:.0f} s: "
                          f"{progress.stored}/{count} demonstrations stored, {progress.trained} of {progress.samples} "
                          f"samples trained, the server holds v{progress.held}; RL starts from there (see the "
                          "trainer's log)[/yellow]")
            return time.monotonic() - started, None
        await asyncio.sleep(1.0)


async def served_saved(saved: WarmStartRecord, served_version: Callable[[], int], session: TrainingSession,
                       console: Console) -> None:
    """Wait until the server holds a saved warm start (its trainer announces it on resuming)."""
    console.print(f"warm start: v{saved.version}, saved by an earlier run (it took {saved.seconds:.0f} s there); "
                  "waiting for the server to load it")
    deadline = time.monotonic() + SAVED_LOAD_S
    while (held := await asyncio.to_thread(served_version)) < saved.version:
        session.check()
        if time.monotonic() > deadline:
            raise WarmStartNotServed(f"the server still holds v{held} {SAVED_LOAD_S:.0f} s after the "
                                     f"trainer started from the saved warm start v{saved.version}: see the trainer's "
                                     f"and the hot swap's logs in {session.workdir}")
        await asyncio.sleep(1.0)
